"""Averaging round time, side by side in one run, every peer a separate OS process on its own lab host.

    python -m benchmarks.averaging_round [--peers 4 8] [--numel 10000000 25000000]
        [--settings loopback 100 1000] [--methods ours-fp32 ours-fp16 ours-int8 hivemind gloo]
        [--repeats 2] [--warmup 1] [--out PATH] [--work-dir DIR] [--sender-death]

Methods, all averaging the same seeded fp32 vectors (worker i: `make_tensor(seed, i, numel)`):
  * ours-fp32 / ours-fp16 / ours-int8: our GroupAverager round (aggregator mean), matchmaking included,
    pipelined in pieces of `AveragingConfig.piece_numel` (the default); ours-fp32/whole and ours-int8/whole:
    the same with one piece a slice (each reducer aggregates once every part came, as before 2026-12-05);
  * hivemind: hivemind's plain DecentralizedAverager (target_group_size = N), matchmaking included;
  * gloo: torch.distributed gloo all_reduce (the centralized baseline), timed from a barrier's exit;
  * floor (shaped links only): each peer must send and receive 2(N-1)/N of the fp32 payload S, so
    floor_s = 2(N-1)/N * S * 8 / rate.
Each method's peers first average --warmup untimed rounds (connections, lazy imports). A timed repeat
starts all peers at one wall-clock time; its round time is the slowest peer's end minus that start.
Every peer's result, warm-up included, is checked against a reference mean computed here (fp32: 1e-5
relative to the largest contribution; fp16/int8: within the codec's stated error bound, sent and
returned), so a fast wrong answer cannot pass. Settings: "loopback", or a rate in Mbit/s (a netns lab with tbf-shaped
links, bytes on the wire from the hosts' counters); a setting whose lab cannot be built is skipped
with the reason. Prints a table and writes benchmarks/results/averaging_round.json.

--sender-death adds the figure "a sender is SIGKILLed as it starts sending -> the survivors' round
end" (ours, int8, sender timeout 5 s) on each setting.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import hivemind
import torch
from rich.console import Console
from rich.table import Table

from averaging.compression import get_codec, wire_bytes
from averaging.config import AveragingConfig
from averaging.group import piece_bounds, slice_bounds
from benchmarks._avg_worker import make_tensor, sample_indices, wait_json, write_json
from benchmarks._common import save_result
from benchmarks.netlab import Lab, LabUnavailable, loopback_lab, netns_lab

RESULTS = Path(__file__).parent / "results" / "averaging_round.json"
REPO = Path(__file__).resolve().parent.parent
METHODS = ("ours-fp32", "ours-fp16", "ours-int8", "hivemind", "gloo")
VARIANTS = ("ours-fp32/whole", "ours-int8/whole")
"""Methods run only when named: ours with one piece a slice (no pipelining), for a side-by-side comparison."""


def method_parts(method: str) -> tuple[str, str, int | None]:
    """(mode, codec, piece_numel: None for the default, 0 for one piece a slice) of a method name."""
    name, _, variant = method.partition("/")
    mode, _, codec = name.partition("-")
    return mode, codec or "fp32", 0 if variant == "whole" else None


FP32_REL_TOL = 1e-5
LOSSY_SLACK = 1.01
"""The codec bound of the returned slice is computed on the exact mean; 1% covers the rounding of the mean."""
MATCHMAKING_S = 2.0
"""An upper bound: both our matchmaking and hivemind's close as soon as the full group has gathered."""
SEED = 0


class RunFailed(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------- helpers
def floor_s(num_peers: int, payload_bytes: int, rate_mbit: float | None) -> float | None:
    """Bandwidth floor of an all-reduce of `payload_bytes` among `num_peers` on links of `rate_mbit`."""
    if rate_mbit is None:
        return None
    return 2 * (num_peers - 1) / num_peers * payload_bytes * 8 / (rate_mbit * 1e6)


def _budget_s(num_peers: int, numel: int, rate_mbit: float | None) -> float:
    """Bound on start-up and on one round: generous, it only catches a hung run."""
    return 60.0 + 10.0 * floor_s(num_peers, 4 * numel, rate_mbit or 100.0)


def _sender_timeout_s(num_peers: int, numel: int, rate_mbit: float | None) -> float:
    """What a user would set: well above the time every part takes to arrive (half the floor) at the
    link rate, or at 100 Mbit/s on loopback. Only a stall or a dead peer ever waits for it."""
    return 10.0 + 3.0 * floor_s(num_peers, 4 * numel, rate_mbit or 100.0)


def _setting_label(setting: str) -> str:
    return "loopback" if setting == "loopback" else f"{float(setting):g} Mbit/s"


def _open_lab(setting: str, num_hosts: int) -> Lab:
    if setting == "loopback":
        return loopback_lab(num_hosts)
    return netns_lab(num_hosts, rate_mbit=float(setting))


def _counters(lab: Lab, num_peers: int) -> list[dict[str, int]] | None:
    if lab.kind != "netns":
        return None
    return [lab.hosts[i].counters() for i in range(num_peers)]


def _log_tail(path: Path, num_lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    return ""


# --------------------------------------------------------------------------------------------- reference
@dataclass(frozen=True, slots=True)
class Reference:
    """The exact mean at the sampled indices and its sum, with the tolerance of a given codec."""

    samples: torch.Tensor
    tol: torch.Tensor
    sum: float
    sum_tol: float


_REFERENCES: dict[tuple, Reference] = {}


def _sliced_bound(codec, x: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
    # a butterfly encodes piece by piece, so int8 blocks start at each piece's first element
    return torch.cat([codec.error_bound(x[a:b]) for a, b in bounds])


def _piece_bounds(numel: int, num_slices: int, piece_numel: int) -> list[tuple[int, int]]:
    """Every piece of every slice, as (start, end) in the whole vector."""
    return [
        (lo + a, lo + b) for lo, hi in slice_bounds(numel, num_slices) for a, b in piece_bounds(hi - lo, piece_numel)
    ]


def reference(
    numel: int, ranks: tuple[int, ...], num_slices: int, codec_name: str, piece_numel: int | None = None
) -> Reference:
    """Mean of the ranks' vectors; tolerance = 1e-5 x the largest contribution, plus for a lossy codec
    the mean of the parts' encoding bounds and the bound of the encoded result (pieces of slices of `num_slices`)."""
    piece_numel = AveragingConfig().piece_numel if piece_numel is None else piece_numel
    key = (numel, ranks, num_slices if codec_name != "fp32" else 0, codec_name, piece_numel)
    if key not in _REFERENCES:
        codec, bounds = get_codec(codec_name), _piece_bounds(numel, num_slices, piece_numel)
        total = torch.zeros(numel, dtype=torch.float64)
        maxabs = torch.zeros(numel)
        parts_bound = torch.zeros(numel, dtype=torch.float64)
        for rank in ranks:
            x = make_tensor(SEED, rank, numel)
            total += x
            torch.maximum(maxabs, x.abs(), out=maxabs)
            if codec_name != "fp32":
                parts_bound += _sliced_bound(codec, x, bounds)
        mean = total / len(ranks)
        tol = FP32_REL_TOL * maxabs.double() + 1e-12
        if codec_name != "fp32":
            tol += LOSSY_SLACK * (parts_bound / len(ranks) + _sliced_bound(codec, mean.float(), bounds))
        idx = sample_indices(numel)
        _REFERENCES[key] = Reference(samples=mean[idx], tol=tol[idx], sum=float(mean.sum()), sum_tol=float(tol.sum()))
    return _REFERENCES[key]


def check(results: list[dict], ref: Reference) -> dict[str, Any]:
    """Every worker's result against the reference; ok needs every round ok and every error in bounds."""
    worst, worst_sum = 0.0, 0.0
    for result in results:
        if result.get("checksum") is None:
            return {"ok": False, "reason": f"rank {result['rank']}: {result.get('outcome')}"}
        got = torch.tensor(result["checksum"]["samples"], dtype=torch.float64)
        worst = max(worst, float(((got - ref.samples).abs() / ref.tol).max()))
        worst_sum = max(worst_sum, abs(result["checksum"]["sum"] - ref.sum) / ref.sum_tol)
    outcomes = Counter(str(r.get("outcome")) for r in results)
    ok = worst <= 1.0 and worst_sum <= 1.0 and set(outcomes) <= {"ok", "retried", "partial"}
    return {
        "ok": ok,
        "max_err_over_tol": worst,
        "sum_err_over_tol": worst_sum,
        "outcomes": dict(outcomes),
        "identical_across_ranks": len({r["checksum"]["digest"] for r in results}) == 1,
    }


# --------------------------------------------------------------------------------------------- runs
@dataclass
class _Run:
    """N workers of one method on the lab's first N hosts, driven repeat by repeat through files."""

    lab: Lab
    num_peers: int
    numel: int
    mode: str
    codec: str
    repeats: int
    run_dir: Path
    victim: int | None = None
    piece_numel: int | None = None

    def __post_init__(self) -> None:
        self.budget_s = _budget_s(self.num_peers, self.numel, self.lab.rate_mbit)
        self.procs: list[subprocess.Popen] = []

    def _argv(self, rank: int) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "benchmarks._avg_worker",
            "--mode",
            self.mode,
            "--rank",
            str(rank),
            "--world",
            str(self.num_peers),
            "--numel",
            str(self.numel),
            "--ip",
            self.lab.hosts[rank].ip,
            "--ip-rank0",
            self.lab.hosts[0].ip,
            "--dir",
            str(self.run_dir),
            "--codec",
            self.codec,
            "--repeats",
            str(self.repeats),
            "--seed",
            str(SEED),
            "--timeout-s",
            f"{self.budget_s:.0f}",
            "--matchmaking-s",
            str(MATCHMAKING_S),
            "--sender-timeout-s",
            f"{_sender_timeout_s(self.num_peers, self.numel, self.lab.rate_mbit):.1f}",
        ]
        argv += ["--piece-numel", str(self.piece_numel)] if self.piece_numel is not None else []
        return argv + (["--victim", str(self.victim)] if self.victim is not None else [])

    def _wait(self, rank: int, name: str, deadline: float) -> Any:
        """Wait for file `name` of worker `rank`; fail early if that worker, or any worker, died."""
        path = self.run_dir / name

        def alive() -> None:
            for r, proc in enumerate(self.procs):
                done = proc.poll() is not None and r != self.victim
                if done and (proc.returncode != 0 or r == rank and not path.exists()):
                    raise RunFailed(
                        f"worker {r} exited with {proc.returncode}:\n{_log_tail(self.run_dir / f'worker{r}.log')}"
                    )

        return wait_json(path, deadline, alive=alive)

    def start(self) -> None:
        self.run_dir.mkdir(parents=True)
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.procs = [
            self.lab.spawn(rank, self._argv(rank), log=self.run_dir / f"worker{rank}.log", env=env)
            for rank in range(self.num_peers)
        ]

    def repeat(self, repeat: int) -> dict[str, Any]:
        """Release every worker at one wall-clock time; return their results and the hosts' counters."""
        deadline = time.monotonic() + self.budget_s
        for rank in range(self.num_peers):
            self._wait(rank, f"ready-{repeat}-{rank}", deadline)
        before = _counters(self.lab, self.num_peers)
        start_wall = time.time() + 0.3
        write_json(self.run_dir / f"go-{repeat}", {"start_wall": start_wall})
        deadline = time.monotonic() + self.budget_s
        # the victim dies in the last repeat; it takes part in the ones before (warm-up)
        ranks = [r for r in range(self.num_peers) if r != self.victim or repeat < self.repeats - 1]
        results = [self._wait(r, f"result-{repeat}-{r}.json", deadline) for r in ranks]
        after = _counters(self.lab, self.num_peers)
        counters = (
            None
            if before is None
            else [{k: a[k] - b[k] for k in ("tx_bytes", "rx_bytes")} for a, b in zip(after, before)]
        )
        round_s = max(r["end_wall"] for r in results) - min(r["began_wall"] for r in results)
        return {"round_s": round_s, "start_wall": start_wall, "workers": results, "counters": counters}

    def stop(self) -> None:
        """Let the workers exit (they wait for this), then SIGTERM and SIGKILL whatever is left."""
        with contextlib.suppress(OSError):
            write_json(self.run_dir / "exit", {})
        deadline = time.monotonic() + 30
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        for proc in self.procs:
            self.lab.stop(proc, grace_s=15)  # SIGTERM its process group if anything is left, then SIGKILL


def run_method(
    lab: Lab, num_peers: int, numel: int, method: str, repeats: int, warmup: int, run_dir: Path
) -> dict[str, Any]:
    """`warmup` untimed rounds then `repeats` timed ones of one method; raw results plus the result
    check of every round (warm-up included) against the reference mean."""
    mode, codec, piece_numel = method_parts(method)
    run = _Run(lab, num_peers, numel, mode, codec, warmup + repeats, run_dir, piece_numel=piece_numel)
    raw: list[dict[str, Any]] = []
    error = None
    try:
        run.start()
        for repeat in range(warmup + repeats):
            raw.append(run.repeat(repeat))
    except (RunFailed, TimeoutError) as e:
        error = str(e)
    finally:
        run.stop()
    ref = reference(numel, tuple(range(num_peers)), num_peers, codec, piece_numel)
    for r in raw:
        r["check"] = check(r["workers"], ref)
        _drop_samples(r)
    ok = error is None and all(r["check"]["ok"] for r in raw)
    return {
        "warmup": raw[:warmup],
        "repeats": raw[warmup:],
        "error": error,
        "check": {
            "ok": ok,
            "max_err_over_tol": max((r["check"].get("max_err_over_tol", 0) for r in raw), default=None),
        },
    }


def _drop_samples(raw_repeat: dict[str, Any]) -> None:
    """The sampled values served the check; the JSON keeps each result's sum and digest."""
    for worker in raw_repeat["workers"]:
        if worker.get("checksum"):
            worker["checksum"].pop("samples", None)


def sender_death(lab: Lab, num_peers: int, numel: int, run_dir: Path) -> dict[str, Any]:
    """After a warm-up round, the last peer SIGKILLs itself as it starts sending; seconds from its death
    to the survivors' round end."""
    run = _Run(lab, num_peers, numel, "ours", "int8", 2, run_dir, victim=num_peers - 1)
    try:
        run.start()
        warmup = run.repeat(0)  # connections up, every peer has averaged once
        raw = run.repeat(1)
        death = wait_json(run_dir / "death.json", time.monotonic() + 5)
    except (RunFailed, TimeoutError) as e:
        return {"peers": num_peers, "numel": numel, "error": str(e), "check": {"ok": False}}
    finally:
        run.stop()
    survivors = tuple(range(num_peers - 1))
    num_slices = max(r.get("members", num_peers) for r in raw["workers"])
    result = {
        "peers": num_peers,
        "numel": numel,
        "sender_timeout_s": 5.0,
        "death_to_round_end_s": max(r["end_wall"] for r in raw["workers"]) - death["wall"],
        "death_after_start_s": death["wall"] - raw["start_wall"],
        "error": None,
        "warmup_outcomes": dict(Counter(str(w.get("outcome")) for w in warmup["workers"])),
        "check": check(raw["workers"], reference(numel, survivors, num_slices, "int8")),
        "raw": raw,
    }
    _drop_samples(raw)
    return result


# --------------------------------------------------------------------------------------------- summary
def summarize(
    setting: str, rate_mbit: float | None, num_peers: int, numel: int, method: str, run: dict[str, Any]
) -> dict[str, Any]:
    codec = method_parts(method)[1]
    times = [r["round_s"] for r in run["repeats"]]
    tx = [sum(c["tx_bytes"] for c in r["counters"]) / num_peers for r in run["repeats"] if r["counters"]]
    rx = [sum(c["rx_bytes"] for c in r["counters"]) / num_peers for r in run["repeats"] if r["counters"]]
    app = [
        statistics.mean(w["bytes_sent"] for w in r["workers"])
        for r in run["repeats"]
        if all("bytes_sent" in w for w in r["workers"])
    ]
    floor = floor_s(num_peers, 4 * numel, rate_mbit)
    return {
        "setting": setting,
        "rate_mbit": rate_mbit,
        "peers": num_peers,
        "numel": numel,
        "payload_bytes": 4 * numel,
        "method": method,
        "codec": codec,
        "round_s": times,
        "median_s": statistics.median(times) if times and not run["error"] else None,
        "min_s": min(times) if times and not run["error"] else None,
        "floor_s": floor,
        "floor_wire_s": floor_s(num_peers, wire_bytes(get_codec(codec), numel), rate_mbit),
        "tx_bytes_per_peer": tx or None,
        "rx_bytes_per_peer": rx or None,
        "app_bytes_sent_per_peer": app or None,
        "check_ok": run["check"]["ok"],
        "error": run["error"],
        "check": run["check"],
        "warmup_round_s": [r["round_s"] for r in run["warmup"]],
        "repeats": run["repeats"],
        "warmup": run["warmup"],
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """ours/floor, ours/hivemind, ours/gloo (medians) within each (setting, peers, numel)."""
    by_key = {(r["setting"], r["peers"], r["numel"], r["method"]): r for r in rows}
    for row in rows:
        median = row["median_s"]
        row["over_floor"] = median / row["floor_s"] if median and row["floor_s"] else None
        for anchor in ("hivemind", "gloo"):
            other = by_key.get((row["setting"], row["peers"], row["numel"], anchor))
            ok = row["method"].startswith("ours") and median and other and other["median_s"]
            row[f"over_{anchor}"] = median / other["median_s"] if ok else None


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _mb_sent(row: dict[str, Any]) -> str:
    if row["tx_bytes_per_peer"]:
        return f"{statistics.median(row['tx_bytes_per_peer']) / 1e6:.1f}"
    if row["app_bytes_sent_per_peer"]:  # loopback: what our averager itself counted
        return f"{statistics.median(row['app_bytes_sent_per_peer']) / 1e6:.1f}*"
    return "-"


def table(rows: list[dict[str, Any]]) -> Table:
    out = Table(
        title="averaging round, one process per peer, matchmaking included "
        "(floor: fp32 payload; * = bytes counted by our averager, not the wire)"
    )
    for column in (
        "setting",
        "peers",
        "params",
        "method",
        "median s",
        "min s",
        "floor s",
        "/floor",
        "ours/hivemind",
        "ours/gloo",
        "MB sent/peer",
        "result check",
    ):
        out.add_column(column, justify="right")
    for r in rows:
        out.add_row(
            r["setting"],
            str(r["peers"]),
            f"{r['numel'] / 1e6:g}M",
            r["method"],
            _fmt(r["median_s"]),
            _fmt(r["min_s"]),
            _fmt(r["floor_s"]),
            _fmt(r["over_floor"]),
            _fmt(r["over_hivemind"]),
            _fmt(r["over_gloo"]),
            _mb_sent(r),
            "ok" if r["check_ok"] else f"FAILED{': ' + r['error'].splitlines()[0] if r['error'] else ''}",
        )
    return out


# --------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.averaging_round", description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 8])
    parser.add_argument(
        "--numel", type=int, nargs="+", default=[10_000_000, 25_000_000], help="fp32 values per peer (25M = 100 MB)"
    )
    parser.add_argument(
        "--settings",
        nargs="+",
        default=["loopback", "100", "1000"],
        help="'loopback' or a link rate in Mbit/s (netns lab, tbf-shaped)",
    )
    parser.add_argument("--methods", nargs="+", choices=METHODS + VARIANTS, default=list(METHODS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed rounds first (connections, lazy imports such as bitsandbytes'), still checked",
    )
    parser.add_argument("--out", default=str(RESULTS), help="JSON output path")
    parser.add_argument(
        "--work-dir",
        default=None,
        help="keep the workers' logs and rendezvous files here (a new folder; default: a temp dir)",
    )
    parser.add_argument(
        "--sender-death",
        action="store_true",
        help="also time a SIGKILLed sender -> the survivors' round end (ours, int8)",
    )
    args = parser.parse_args(argv)
    for setting in args.settings:
        if setting != "loopback":
            try:
                if not float(setting) > 0:
                    raise ValueError
            except ValueError:
                parser.error(f"--settings: expected 'loopback' or a positive rate in Mbit/s, got {setting!r}")
    if min(args.peers) < 2 or min(args.numel) < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--peers must be >= 2, --numel and --repeats >= 1, --warmup >= 0")
    return args


@contextlib.contextmanager
def _work_dir(path: str | None) -> Iterator[str]:
    """Where workers rendezvous and log: a temporary folder, or `path` (kept, for reading the logs)."""
    if path is None:
        with tempfile.TemporaryDirectory(prefix="swarm-avgbench-") as tmp:
            yield tmp
        return
    Path(path).mkdir(parents=True, exist_ok=False)
    yield path


def _bench_setting(
    console: Console, lab: Lab, setting: str, args: argparse.Namespace, tmp: Path, rows: list, deaths: list
) -> None:
    for num_peers in args.peers:
        for numel in args.numel:
            for method in args.methods:
                label = f"{_setting_label(setting)}, {num_peers} peers, {numel / 1e6:g}M params, {method}"
                with console.status(label):
                    run = run_method(
                        lab,
                        num_peers,
                        numel,
                        method,
                        args.repeats,
                        args.warmup,
                        tmp / f"{setting}-{num_peers}-{numel}-{method}",
                    )
                rows.append(summarize(_setting_label(setting), lab.rate_mbit, num_peers, numel, method, run))
                times = ", ".join(f"{t:.2f}" for t in rows[-1]["round_s"])
                console.print(
                    f"  {label}: [{times}] s, check {'ok' if run['check']['ok'] else 'FAILED'}"
                    + (f"\n{run['error']}" if run["error"] else "")
                )
    if args.sender_death:
        num_peers, numel = max(args.peers), min(min(args.numel), 2_500_000)
        if num_peers < 3:
            console.print("  sender death: needs >= 3 peers (the survivors must still form a group); skipped")
            return
        with console.status(f"{_setting_label(setting)}: sender death, {num_peers} peers"):
            death = sender_death(lab, num_peers, numel, tmp / f"{setting}-death")
        deaths.append({"setting": _setting_label(setting), **death})
        console.print(
            f"  sender death -> survivors' round end: {_fmt(death.get('death_to_round_end_s'))} s "
            f"(sender timeout 5 s), check {'ok' if death['check']['ok'] else 'FAILED'}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=180)  # a piped table keeps its columns
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: workers and labs are closed
    rows: list[dict[str, Any]] = []
    deaths: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    started = time.time()
    try:
        with _work_dir(args.work_dir) as tmp:
            for setting in args.settings:
                try:
                    lab = _open_lab(setting, max(args.peers))
                except LabUnavailable as e:
                    console.print(f"[yellow]skipping {_setting_label(setting)}: {e}[/yellow]")
                    skipped.append({"setting": _setting_label(setting), "reason": str(e)})
                    continue
                with lab:
                    _bench_setting(console, lab, setting, args, Path(tmp), rows, deaths)
    finally:
        signal.signal(signal.SIGTERM, previous)
    add_ratios(rows)
    if rows:
        console.print(table(rows))
    ok = all(r["check_ok"] for r in rows) and all(d["check"]["ok"] for d in deaths)
    result = {
        "benchmark": "averaging_round",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "hivemind": hivemind.__version__,
        "command": shlex.join(
            ["python", "-m", "benchmarks.averaging_round", *(argv if argv is not None else sys.argv[1:])]
        ),
        "config": {
            "peers": args.peers,
            "numel": args.numel,
            "settings": args.settings,
            "methods": args.methods,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "seed": SEED,
            "matchmaking_s": MATCHMAKING_S,
            "fp32_rel_tol": FP32_REL_TOL,
            "lossy_slack": LOSSY_SLACK,
            "worker_threads": 1,
            "sender_death": args.sender_death,
        },
        "elapsed_s": time.time() - started,
        "ok": ok,
        "rows": rows,
        "skipped": skipped,
        "sender_death": deaths,
    }
    out = save_result(args.out, result)
    console.print(f"wrote {out}" + ("" if ok else " [red](some result checks FAILED)[/red]"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
