"""State download for a joiner, side by side in one run: our verified shard exchange from 1 and from 3
donors, and hivemind's (unverified) `load_state_from_peers` of the same tensors.

    python -m benchmarks.state_sync [--numel 25000000] [--setting loopback 100 1000 unshaped] [--repeats 1]

25M fp32 parameters = 100 MB. ``--setting`` takes one or more settings, measured one after the other
in one run. ``loopback`` (default) runs every peer in this process on loopback. A rate in Mbit/s (or
``unshaped``) runs on test hosts (benchmarks.netlab network
namespaces): the joiner on host 0, donors on hosts 1-3, each its own process, each link shaped to the
rate both ways (``--donor-rate-mbit`` gives the donors' links another rate, e.g. slow uplinks that
several donors together can fill); the floor of a download from k donors is then the state's bytes
over min(joiner's rate, k x donor rate), and the joiner's
received wire bytes (its interface counters) are reported per method.

Our figure includes writing every shard into the joiner's store (digest checked on arrival) and
loading the state back from it (digests checked again); hivemind's is the download alone. Neither
includes starting the joiner's DHT.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from rich.console import Console
from rich.table import Table

from benchmarks._common import run_metadata, save_result
from benchmarks.netlab import LabUnavailable
from bootstrap import start_dht, stop_dht, visible_maddrs
from swarm.checkpoint import CheckpointStore
from swarm.checkpoint.exchange import ShardExchange
from swarm.checkpoint.manifest import ShardInfo, TensorInfo
from swarm.checkpoint.sync import StoreShardSource

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RESULTS = Path(__file__).parent / "results" / "state_sync.json"
CHUNKS = 8
MAX_SHARD_BYTES = 16 << 20
PREFIX = "bench_state"
_POLL_S = 0.1


class _Donor(DecentralizedAverager):
    def __init__(self, *args, state, **kwargs):
        self._state = state
        super().__init__(*args, **kwargs)

    def get_current_state(self):
        return {"step": 1}, self._state, None


def make_state(numel: int) -> dict[str, torch.Tensor]:
    """The same seeded tensors in every process (so the joiner can check what it got)."""
    generator = torch.Generator().manual_seed(0)
    return {f"param/{i}": torch.randn(numel // CHUNKS, generator=generator) for i in range(CHUNKS)}


def _hivemind_averager(dht, state: list[torch.Tensor], *, donor: bool) -> _Donor:
    # same class for donor and joiner: hivemind names its RPC handlers after the averager's class
    return _Donor(
        [torch.zeros(1)],
        dht,
        start=True,
        prefix=PREFIX,
        state=state,
        allow_state_sharing=donor,
        declare_state_period=5,
        next_chunk_timeout=60,
        min_matchmaking_time=5.0,
        request_timeout=3.0,
    )


def _ours(dht, shards: list[ShardInfo], donors: list[str], store_dir: Path, timeout_s: float) -> tuple[float, dict]:
    """Fetch every shard from ``donors``, store it (checked), load the state back (checked again)."""
    joiner_store = CheckpointStore(store_dir)
    joiner = ShardExchange(dht, StoreShardSource(joiner_store))
    try:
        started = time.perf_counter()
        data, report = joiner.fetch({s.digest: s.size_bytes for s in shards}, donors, timeout_s=timeout_s)
        for shard in shards:
            joiner_store.put_shard_bytes(data[shard.digest], expected_digest=shard.digest)
        loaded = {}
        for shard in shards:
            loaded.update(joiner_store.load_tensors(shard))
        seconds = time.perf_counter() - started
    finally:
        joiner.close()
    return seconds, loaded


def _hivemind_download(joiner: _Donor, *, wait_s: float, timeout_s: float) -> tuple[float, list[torch.Tensor]]:
    deadline = time.monotonic() + wait_s
    result = None
    while result is None and time.monotonic() < deadline:  # the donor's DHT declaration may not be there yet
        started = time.perf_counter()
        result = joiner.load_state_from_peers(timeout=timeout_s)
    seconds = time.perf_counter() - started
    if result is None:
        raise RuntimeError(f"hivemind's state download found no donor within {wait_s:.0f}s")
    return seconds, list(result[1])


# ------------------------------------------------------------------------------------ loopback, one process
def run_loopback(state: dict[str, torch.Tensor], repeats: int, console: Console) -> list[dict[str, Any]]:
    rows = {"ours-1": [], "ours-3": [], "hivemind-1": []}
    with tempfile.TemporaryDirectory() as tmp:
        dhts = [start_dht(host_maddrs=LOOPBACK, nat_port_map=False)]
        exchanges = []
        try:
            dhts += [start_dht(visible_maddrs(dhts[0]), host_maddrs=LOOPBACK, nat_port_map=False) for _ in range(3)]
            donor_stores = [CheckpointStore(Path(tmp) / f"donor{i}") for i in range(3)]
            shards = [store.put_tensors(state, max_shard_bytes=MAX_SHARD_BYTES) for store in donor_stores][0]
            exchanges = [ShardExchange(d, StoreShardSource(s)) for d, s in zip(dhts[1:], donor_stores)]
            for repeat in range(repeats):
                for num_donors in (1, 3):
                    with console.status(f"ours from {num_donors} donor(s), {repeat + 1}/{repeats}"):
                        seconds, loaded = _ours(
                            dhts[0],
                            shards,
                            [e.peer_id for e in exchanges[:num_donors]],
                            Path(tmp) / f"joiner{num_donors}-{repeat}",
                            timeout_s=600,
                        )
                    assert all(torch.equal(loaded[k], v) for k, v in state.items())
                    rows[f"ours-{num_donors}"].append(seconds)
            donor = _hivemind_averager(dhts[1], list(state.values()), donor=True)
            joiner = _hivemind_averager(dhts[0], [], donor=False)
            try:
                for repeat in range(repeats):
                    with console.status(f"hivemind load_state_from_peers, {repeat + 1}/{repeats}"):
                        seconds, tensors = _hivemind_download(joiner, wait_s=30, timeout_s=300)
                    assert all(torch.equal(a, b) for a, b in zip(tensors, state.values()))
                    rows["hivemind-1"].append(seconds)
            finally:
                joiner.shutdown()
                donor.shutdown()
        finally:
            for exchange in exchanges:
                exchange.close()
            for dht in dhts:
                stop_dht(dht)
    return [{"method": method, "times_s": times} for method, times in rows.items()]


# ------------------------------------------------------------------------------------ test hosts, processes
def _worker(argv: list[str]) -> int:
    """One donor or joiner process on a lab host (started by run_lab)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.state_sync _worker")
    parser.add_argument("role", choices=("donor", "joiner"))
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--host-maddr", required=True)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True, help="JSON written when ready (donor) or done (joiner)")
    parser.add_argument("--hivemind", action="store_true", help="donor: also serve hivemind's state sharing")
    parser.add_argument("--method", choices=("ours", "hivemind"), default="ours")
    parser.add_argument("--donors", nargs="*", default=[])
    parser.add_argument("--shards", default=None, help="joiner: the donors' shard list (a donor's --out file)")
    parser.add_argument("--timeout-s", type=float, default=600)
    args = parser.parse_args(argv)
    stop = threading.Event()
    if args.role == "donor":
        signal.signal(signal.SIGTERM, lambda *_: stop.set())  # then it closes its DHT (and p2pd) itself
    dht = start_dht(args.initial_peers, host_maddrs=[args.host_maddr], nat_port_map=False)
    try:
        if args.role == "donor":
            _serve_donor(dht, args, stop)
        else:
            _join(dht, args)
    finally:
        stop_dht(dht)
    return 0


def _serve_donor(dht, args: argparse.Namespace, stop: threading.Event) -> None:
    state = make_state(args.numel)
    store = CheckpointStore(Path(args.dir))
    shards = store.put_tensors(state, max_shard_bytes=MAX_SHARD_BYTES)
    exchange = ShardExchange(dht, StoreShardSource(store))
    donor = _hivemind_averager(dht, list(state.values()), donor=True) if args.hivemind else None
    try:
        _write_json(
            Path(args.out),
            {"peer_id": str(dht.peer_id), "maddrs": visible_maddrs(dht), "shards": [s.to_dict() for s in shards]},
        )
        stop.wait()
    finally:
        if donor is not None:
            donor.shutdown()
        exchange.close()


def _join(dht, args: argparse.Namespace) -> None:
    state = make_state(args.numel)
    if args.method == "ours":
        shards = [_shard(obj) for obj in json.loads(Path(args.shards).read_text())["shards"]]
        seconds, loaded = _ours(dht, shards, args.donors, Path(args.dir), timeout_s=args.timeout_s)
        ok = set(loaded) == set(state) and all(torch.equal(loaded[k], v) for k, v in state.items())
    else:
        joiner = _hivemind_averager(dht, [], donor=False)
        try:
            seconds, tensors = _hivemind_download(joiner, wait_s=60, timeout_s=args.timeout_s)
        finally:
            joiner.shutdown()
        ok = len(tensors) == len(state) and all(torch.equal(a, b) for a, b in zip(tensors, state.values()))
    _write_json(Path(args.out), {"seconds": seconds, "state_ok": ok})


def _shard(obj: dict[str, Any]) -> ShardInfo:
    tensors = tuple(TensorInfo(name=t["name"], dtype=t["dtype"], shape=tuple(t["shape"])) for t in obj["tensors"])
    return ShardInfo(name=obj["name"], digest=obj["digest"], size_bytes=obj["size_bytes"], tensors=tensors)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _wait_file(path: Path, proc: Any, timeout_s: float, what: str, log: Path) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.poll()} before finishing; see {log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not finish within {timeout_s:.0f}s; see {log}")
        time.sleep(_POLL_S)
    return json.loads(path.read_text())


def floor_seconds(
    size_bytes: int, rate_mbit: float | None, donor_rate_mbit: float | None, num_donors: int
) -> float | None:
    """Bytes over the narrowest of the joiner's downlink and the donors' uplinks together; None if unshaped."""
    rates = [r for r in (rate_mbit, donor_rate_mbit * num_donors if donor_rate_mbit else None) if r]
    return size_bytes * 8 / (min(rates) * 1e6) if rates else None


def run_lab(
    numel: int,
    rate_mbit: float | None,
    donor_rate_mbit: float | None,
    repeats: int,
    size_bytes: int,
    console: Console,
    work: Path,
) -> list[dict[str, Any]]:
    """Donors on hosts 1-3 and one fresh joiner process per download on host 0 of a netns lab."""
    from benchmarks import netlab

    floor_s = floor_seconds(size_bytes, rate_mbit, donor_rate_mbit, 1) or 0.0
    timeout_s = max(120.0, 10 * floor_s + 60)
    worker = [sys.executable, "-m", "benchmarks.state_sync", "_worker"]
    rows: dict[str, dict[str, list]] = {
        m: {"times_s": [], "rx_bytes": [], "tx_bytes": []} for m in ("ours-1", "ours-3", "hivemind-1")
    }
    with netlab.netns_lab(4, rate_mbit=rate_mbit) as lab:
        if donor_rate_mbit:
            for i in (1, 2, 3):
                lab.set_rate(i, donor_rate_mbit)
        donors: list[dict[str, Any]] = []
        with console.status("starting 3 donors (each writes the state to its store)"):

            def start_donor(i: int, initial: list[str]) -> tuple[Any, Path, Path]:
                ready, log = work / f"donor{i}.json", work / f"donor{i}.log"
                command = [
                    *worker,
                    "donor",
                    "--numel",
                    str(numel),
                    "--host-maddr",
                    lab.hosts[i].maddr(0),
                    "--initial-peers",
                    *initial,
                    "--dir",
                    str(work / f"donor{i}"),
                    "--out",
                    str(ready),
                    *(["--hivemind"] if i == 1 else []),
                ]
                return lab.spawn(i, command, log=log), ready, log

            # donor 1 first; donors 2 and 3 join through it, starting together
            proc, ready, log = start_donor(1, [])
            donors.append(_wait_file(ready, proc, 300, "donor 1", log))
            started = {i: start_donor(i, donors[0]["maddrs"]) for i in (2, 3)}
            for i, (proc, ready, log) in started.items():
                donors.append(_wait_file(ready, proc, 300, f"donor {i}", log))
        initial = [m for d in donors for m in d["maddrs"]]
        for repeat in range(repeats):
            for method in rows:
                kind, num_donors = method.split("-")
                name = f"joiner-{method}-{repeat}"
                out, log = work / f"{name}.json", work / f"{name}.log"
                before = lab.hosts[0].counters()
                with console.status(f"{method}, {repeat + 1}/{repeats}"):
                    proc = lab.spawn(
                        0,
                        [
                            *worker,
                            "joiner",
                            "--numel",
                            str(numel),
                            "--method",
                            kind,
                            "--host-maddr",
                            lab.hosts[0].maddr(0),
                            "--initial-peers",
                            *initial,
                            "--donors",
                            *[d["peer_id"] for d in donors[: int(num_donors)]],
                            "--shards",
                            str(work / "donor1.json"),
                            "--dir",
                            str(work / name),
                            "--out",
                            str(out),
                            "--timeout-s",
                            str(timeout_s),
                        ],
                        log=log,
                    )
                    result = _wait_file(out, proc, timeout_s + 120, f"the {method} joiner", log)
                    proc.wait(timeout=60)
                after = lab.hosts[0].counters()
                if not result["state_ok"]:
                    raise RuntimeError(f"{method}: the joiner's state differs from the donors'; see {log}")
                rows[method]["times_s"].append(result["seconds"])
                rows[method]["rx_bytes"].append(after["rx_bytes"] - before["rx_bytes"])
                rows[method]["tx_bytes"].append(after["tx_bytes"] - before["tx_bytes"])
    return [{"method": method, **row} for method, row in rows.items()]


# ------------------------------------------------------------------------------------ report
_LABELS = {"ours-1": "ours, 1 donor", "ours-3": "ours, 3 donors", "hivemind-1": "hivemind, 1 donor"}


def summarize(
    rows: list[dict[str, Any]], size_bytes: int, rate_mbit: float | None, donor_rate_mbit: float | None
) -> list[dict[str, Any]]:
    hivemind = statistics.median(next(r["times_s"] for r in rows if r["method"] == "hivemind-1"))
    for row in rows:
        seconds = statistics.median(row["times_s"])
        floor_s = floor_seconds(size_bytes, rate_mbit, donor_rate_mbit, int(row["method"].split("-")[1]))
        row.update(
            {
                "system": _LABELS[row["method"]],
                "seconds": seconds,
                "mb_per_s": size_bytes / 1e6 / seconds,
                "floor_s": floor_s,
                "x_floor": seconds / floor_s if floor_s else None,
                "x_hivemind": seconds / hivemind,
            }
        )
    return rows


def print_table(size_bytes: int, block: dict[str, Any], console: Console) -> None:
    where = (
        "loopback, one process"
        if block["lab"] == "loopback"
        else (f"netns, {block['rate_mbit']:g} Mbit/s" if block["rate_mbit"] else "netns, unshaped")
    )
    if block.get("donor_rate_mbit"):
        where += f", donors at {block['donor_rate_mbit']:g} Mbit/s"
    table = Table(
        title=f"joiner state download: {size_bytes / 1e6:.0f} MB, {where}",
        caption="ours: every digest checked on arrival and again on load; hivemind's "
        "load_state_from_peers: unverified; rx MB: bytes the joiner's interface received",
    )
    for column in ("system", "seconds", "MB/s", "floor s", "x floor", "x hivemind", "rx MB"):
        table.add_column(column, justify="right")
    for row in block["rows"]:
        rx = statistics.median(row["rx_bytes"]) / 1e6 if row.get("rx_bytes") else None
        table.add_row(
            row["system"],
            f"{row['seconds']:.2f}",
            f"{row['mb_per_s']:.0f}",
            _fmt(row["floor_s"]),
            _fmt(row["x_floor"]),
            f"{row['x_hivemind']:.2f}",
            _fmt(rx, ".1f"),
        )
    console.print(table)


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _parse_setting(text: str) -> float | None | str:
    if text in ("loopback", "unshaped"):
        return text
    try:
        rate = float(text)
    except ValueError:
        rate = -1.0
    if not rate > 0:
        raise ValueError(f"setting must be loopback, unshaped or a link rate in Mbit/s, got {text!r}")
    return rate


def run_setting(
    setting: str, *, numel: int, repeats: int, donor_rate_mbit: float | None, console: Console
) -> dict[str, Any]:
    """One setting's block of the result: loopback (one process) or netns test hosts at a rate."""
    parsed = _parse_setting(setting)
    rate_mbit = parsed if isinstance(parsed, float) else None
    size_bytes = (numel // CHUNKS) * CHUNKS * 4
    if parsed == "loopback":
        donor_rate_mbit = None
        rows = run_loopback(make_state(numel), repeats, console)
    else:
        with tempfile.TemporaryDirectory(prefix="swarm-state-sync-") as tmp:
            rows = run_lab(numel, rate_mbit, donor_rate_mbit, repeats, size_bytes, console, Path(tmp))
    return {
        "setting": setting,
        "lab": "loopback" if parsed == "loopback" else "netns",
        "rate_mbit": rate_mbit,
        "donor_rate_mbit": donor_rate_mbit,
        "floor_s": floor_seconds(size_bytes, rate_mbit, donor_rate_mbit, 1),
        "rows": summarize(rows, size_bytes, rate_mbit, donor_rate_mbit),
    }


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    if args_list[:1] == ["_worker"]:
        return _worker(args_list[1:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks.state_sync", description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000, help="fp32 parameters (default: %(default)s)")
    parser.add_argument(
        "--setting",
        nargs="+",
        default=["loopback"],
        help="one or more of: loopback (one process), unshaped, or a link rate in Mbit/s (netns "
        "test hosts) (default: loopback)",
    )
    parser.add_argument(
        "--donor-rate-mbit",
        type=float,
        default=None,
        help="netns settings: the donors' link rate (default: the setting's rate)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="downloads per method (default: %(default)s)")
    parser.add_argument("--out", default=str(RESULTS), help="JSON output path (default: %(default)s)")
    args = parser.parse_args(args_list)
    console = Console()
    logging.getLogger("hivemind").setLevel(logging.WARNING)  # its per-download INFO lines would split the tables
    try:
        for setting in args.setting:
            _parse_setting(setting)
        if args.donor_rate_mbit is not None and not args.donor_rate_mbit > 0:
            raise ValueError(f"donor_rate_mbit must be > 0, got {args.donor_rate_mbit!r}")
        if args.numel < CHUNKS or args.repeats < 1:
            raise ValueError(f"need numel >= {CHUNKS} and repeats >= 1, got {args.numel} and {args.repeats}")
    except ValueError as e:
        console.print(f"[bold red]error:[/] {e}")
        return 2
    size_bytes = (args.numel // CHUNKS) * CHUNKS * 4
    blocks, skipped = [], []
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: DHTs, workers, lab closed
    try:
        for setting in args.setting:
            try:
                blocks.append(
                    run_setting(
                        setting,
                        numel=args.numel,
                        repeats=args.repeats,
                        donor_rate_mbit=args.donor_rate_mbit,
                        console=console,
                    )
                )
            except LabUnavailable as e:
                console.print(f"[yellow]skipping {setting}: no test hosts here ({e})[/]")
                skipped.append({"setting": setting, "reason": str(e)})
                continue
            print_table(size_bytes, blocks[-1], console)
    finally:
        signal.signal(signal.SIGTERM, previous)
    result = {
        **run_metadata("state_sync", argv),
        "config": {
            "numel": args.numel,
            "settings": args.setting,
            "donor_rate_mbit": args.donor_rate_mbit,
            "repeats": args.repeats,
            "chunks": CHUNKS,
            "max_shard_bytes": MAX_SHARD_BYTES,
        },
        "size_bytes": size_bytes,
        "size_mb": size_bytes / 1e6,
        "settings": blocks,
        "skipped": skipped,
    }
    out = save_result(args.out, result)
    console.print(f"wrote {out}")
    return 0 if blocks else 2


if __name__ == "__main__":
    sys.exit(main())
