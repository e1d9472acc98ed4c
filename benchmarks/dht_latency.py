"""DHT requests behind bulk averaging traffic on a shaped link (TESTMATRIX row 23): how long one DHT request
to the other peer takes while a round's parts fill the link, to choose ``--dht-rpc-timeout-s``.

Two test hosts (netns, both links shaped to each rate of ``--rates``). Each runs a hivemind DHT and a
`averaging.GroupAverager` over it, and they average ``--numel`` fp32 values ``--rounds`` times in a row
(fp32: the most bytes a round sends). Host 0 pings host 1's DHT node every 0.2 s (hivemind's own
``ping`` request, over the same libp2p connection as the parts), with a 30 s RPC timeout so that no
ping is cut short, first for 6 s before any round and then through the rounds. A ping slower than the
RPC timeout that Swarm gives hivemind (``--dht-rpc-timeout-s``, 3 s by default) would have been taken for
a dead node and that node left out of lookups for 5 s and more. Prints a table and writes JSON
(default benchmarks/results/dht_latency.json)::

    .venv/bin/python -m benchmarks.dht_latency --rates 20,10,5
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks._common import run_metadata, save_result, signals_unwind

RESULTS = Path(__file__).parent / "results" / "dht_latency.json"
_PING_EVERY_S = 0.2
_QUIET_S = 6.0
_RUN_TIMEOUT_S = 600.0
THRESHOLDS_S = (1.0, 2.0, 3.0)


async def _ping(other: str, _dht: Any, node: Any) -> tuple[float, bool]:
    from hivemind.p2p import PeerID

    started = time.perf_counter()
    answer = await node.protocol.call_ping(PeerID.from_base58(other), validate=False, strict=False)
    return time.perf_counter() - started, answer is not None


def worker(rank: int, ip: str, work: Path, numel: int, rounds: int) -> None:
    """One host: its DHT and averager; rank 0 also pings rank 1's DHT node. Rendezvous through files in ``work``."""
    import hivemind
    import torch

    from averaging.config import AveragingConfig
    from averaging.group import GroupAverager

    maddrs = [f"/ip4/{ip}/tcp/0"]
    if rank == 0:
        dht = hivemind.DHT(start=True, host_maddrs=maddrs, wait_timeout=30)
        (work / "rendezvous.json").write_text(json.dumps([str(m) for m in dht.get_visible_maddrs()]))
    else:
        deadline = time.monotonic() + 60
        while not (work / "rendezvous.json").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("no rendezvous from host 0")
            time.sleep(0.05)
        initial = json.loads((work / "rendezvous.json").read_text())
        dht = hivemind.DHT(start=True, host_maddrs=maddrs, initial_peers=initial, wait_timeout=30)
        (work / "peer1.json").write_text(json.dumps(str(dht.peer_id)))
    config = AveragingConfig(
        codec="fp32",
        aggregator="mean",
        max_weight_ratio=None,
        matchmaking_time_s=1.0,
        sender_timeout_s=120.0,
        reducer_timeout_s=240.0,
        agreement_timeout_s=30.0,
        round_timeout_s=400.0,
    )
    averager = GroupAverager(dht, prefix="latency", config=config)
    pings: list[tuple[float, float, bool]] = []
    stop = threading.Event()

    def pinger() -> None:
        deadline = time.monotonic() + 60
        while not (work / "peer1.json").exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        other = json.loads((work / "peer1.json").read_text())
        while not stop.is_set():
            sent = time.time()
            latency, ok = dht.run_coroutine(functools.partial(_ping, other))
            pings.append((sent, latency, ok))
            stop.wait(_PING_EVERY_S)

    thread = threading.Thread(target=pinger, daemon=True)
    if rank == 0:
        thread.start()
    time.sleep(_QUIET_S)
    values = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    spans = []
    for _ in range(rounds):
        began = time.time()
        _, record = averager.step(values, weight=1.0, timeout_s=_RUN_TIMEOUT_S / 2)[:2]
        spans.append((began, time.time(), record.outcome))
    stop.set()
    if thread.is_alive():
        thread.join(timeout=35)
    (work / f"result{rank}.json").write_text(json.dumps({"pings": pings, "rounds": spans}))
    (work / f"done{rank}").write_text("")
    deadline = time.monotonic() + 60  # the other host may still read a reply from this one
    while not all((work / f"done{i}").exists() for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.1)
    averager.close()
    dht.shutdown()


def _stats(latencies: list[float], failed: int) -> dict[str, Any]:
    ordered = sorted(latencies)
    if not ordered:
        return {"pings": 0, "failed": failed}

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "pings": len(ordered),
        "failed": failed,
        "median_s": statistics.median(ordered),
        "p90_s": at(0.9),
        "p99_s": at(0.99),
        "max_s": ordered[-1],
        **{f"over_{t:g}s": sum(1 for x in ordered if x > t) for t in THRESHOLDS_S},
    }


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Split host 0's pings into those sent during a round and those sent outside every round."""
    spans = [(a, b) for a, b, _ in result["rounds"]]
    during = [(lat, ok) for t, lat, ok in result["pings"] if any(a <= t <= b for a, b in spans)]
    quiet = [(lat, ok) for t, lat, ok in result["pings"] if not any(a <= t <= b for a, b in spans)]
    return {
        "round_s": [round(b - a, 2) for a, b, _ in result["rounds"]],
        "outcomes": [o for _, _, o in result["rounds"]],
        "during_rounds": _stats([lat for lat, _ in during], sum(1 for _, ok in during if not ok)),
        "quiet": _stats([lat for lat, _ in quiet], sum(1 for _, ok in quiet if not ok)),
    }


def run_rate(rate: float, numel: int, rounds: int, console: Console) -> dict[str, Any]:
    from benchmarks.netlab import netns_lab

    work = Path(tempfile.mkdtemp(prefix="swarm-dht-latency-"))
    argv = [sys.executable, "-m", "benchmarks.dht_latency", "--worker"]
    with netns_lab(2, rate_mbit=rate) as lab:
        for rank in range(2):
            ip = lab.hosts[rank].ip
            args = [str(rank), ip, str(work), str(numel), str(rounds)]
            lab.spawn(rank, [*argv, *args], log=work / f"host{rank}.log", env={"OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + _RUN_TIMEOUT_S
        while not all((work / f"done{i}").exists() for i in range(2)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the hosts did not finish within {_RUN_TIMEOUT_S:.0f} s; see {work}")
            time.sleep(0.5)
    row = {"rate_mbit": rate, "numel": numel, **summarize(json.loads((work / "result0.json").read_text()))}
    console.print(f"  {rate:g} Mbit/s: rounds {row['round_s']} s; during rounds {row['during_rounds']}")
    return row


def print_table(rows: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="one DHT request to the other host, during averaging rounds (quiet link: last column)")
    for column in ("link", "round s", "pings", "median s", "p90 s", "p99 s", "max s", "> 1 s", "> 2 s", "> 3 s"):
        table.add_column(column, justify="right")
    table.add_column("quiet median / max s", justify="right")
    for row in rows:
        d, q = row["during_rounds"], row["quiet"]
        table.add_row(
            f"{row['rate_mbit']:g} Mbit/s",
            ", ".join(f"{s:.1f}" for s in row["round_s"]),
            str(d["pings"]),
            *(f"{d.get(k, float('nan')):.3f}" for k in ("median_s", "p90_s", "p99_s", "max_s")),
            *(str(d.get(f"over_{t:g}s", "-")) for t in THRESHOLDS_S),
            f"{q.get('median_s', float('nan')):.3f} / {q.get('max_s', float('nan')):.3f}",
        )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--worker"]:
        rank, ip, work, numel, rounds = args_in[1:6]
        worker(int(rank), ip, Path(work), int(numel), int(rounds))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dht_latency", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rates", default="20,10,5", help="link rates in Mbit/s, comma-separated (default: %(default)s)"
    )
    parser.add_argument("--numel", type=int, default=5_000_000, help="fp32 values averaged (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds in a row per rate (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON result (default: %(default)s)")
    args = parser.parse_args(args_in)
    console = Console()
    try:
        rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--rates: comma-separated numbers, got {args.rates!r}")
    if not rates or any(not r > 0 for r in rates) or args.numel < 1 or args.rounds < 1:
        parser.error("--rates must be positive, --numel and --rounds >= 1")
    try:
        with signals_unwind():
            rows = [run_rate(rate, args.numel, args.rounds, console) for rate in rates]
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    except RuntimeError as e:
        console.print(f"[red]{e}[/]")
        return 1
    print_table(rows, console)
    result = {"rows": rows, "meta": run_metadata("dht_latency", argv)}
    console.print(f"wrote {save_result(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
