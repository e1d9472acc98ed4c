"""Matchmaking's last stretch: from the last member's step to every member's result, wake-ups on and off.

4 in-process GroupAveragers on loopback DHTs (fp32, 1000 coordinates, a 2 s window, the default 0.1 s poll),
told who the live members are. Three step at once; the fourth steps 0.3-0.4 s later, once they are in their
windows. With wake-ups (the default), its join or its nudges make the others read the key at once; without
(``_MAX_WAKES = 0``) they read at their next 0.1 s tick. The two alternate, trial by trial, in one process.
Every trial must average all 4 members. Prints a table and writes JSON::

    .venv/bin/python -m benchmarks.window_wake --trials 40
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from averaging import group as group_module
from averaging.config import AveragingConfig
from averaging.group import GroupAverager
from benchmarks._common import run_metadata, save_result
from bootstrap import start_dht, stop_dht, visible_maddrs

RESULTS = Path(__file__).parent / "results" / "window_wake.json"
PEERS = 4
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _trial(dhts: list, prefix: str, woken: bool, late_s: float) -> float | None:
    group_module._MAX_WAKES = 4 if woken else 0
    config = AveragingConfig(codec="fp32", max_weight_ratio=None, matchmaking_time_s=2.0, aggregator="mean")
    averagers = [GroupAverager(dht, prefix=prefix, config=config) for dht in dhts]
    members = {a.peer_id for a in averagers}
    tensors = [torch.randn(1000) for _ in averagers]
    try:
        with ThreadPoolExecutor(PEERS) as pool:
            futures = [
                pool.submit(averagers[i].step, tensors[i], weight=1.0, timeout_s=30, expected=members)
                for i in range(PEERS - 1)
            ]
            time.sleep(late_s)
            came = time.monotonic()
            futures.append(pool.submit(averagers[-1].step, tensors[-1], weight=1.0, timeout_s=30, expected=members))
            results = [f.result() for f in futures]
            took = time.monotonic() - came
    finally:
        for averager in averagers:
            averager.close()
    return took if all(r.outcome == "ok" and len(g.members) == PEERS for _, r, g in results) else None


def run(trials: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    dhts = [start_dht(host_maddrs=LOOPBACK, nat_port_map=False)]
    default = group_module._MAX_WAKES
    try:
        dhts += [start_dht(visible_maddrs(dhts[0]), host_maddrs=LOOPBACK, nat_port_map=False) for _ in range(PEERS - 1)]
        times: dict[str, list[float | None]] = {"woken": [], "polled": []}
        for trial in range(trials):
            woken = trial % 2 == 0
            late_s = 0.3 + 0.1 * rng.random()
            times["woken" if woken else "polled"].append(_trial(dhts, f"wake{trial}", woken, late_s))
    finally:
        group_module._MAX_WAKES = default
        for dht in dhts:
            stop_dht(dht)
    rows = []
    for mode, values in times.items():
        ok = sorted(v for v in values if v is not None)
        rows.append(
            {
                "mode": mode,
                "trials": len(values),
                "failed": values.count(None),
                "median_s": statistics.median(ok) if ok else None,
                "p90_s": ok[int(0.9 * len(ok))] if ok else None,
                "mean_s": statistics.mean(ok) if ok else None,
            }
        )
    return {"peers": PEERS, "trials": trials, "seed": seed, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.window_wake", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=40, help="trials, alternating the modes (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the late member's delay (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON result (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.trials < 2:
        parser.error("--trials: at least 2")
    console = Console()
    result = run(args.trials, args.seed)
    result["meta"] = run_metadata("window_wake", argv)
    table = Table(title="from the last member's step to every member's result (4 peers, loopback)")
    for column in ("mode", "trials", "failed", "median s", "p90 s", "mean s"):
        table.add_column(column, justify="right")
    for r in result["rows"]:
        cells = [r["median_s"], r["p90_s"], r["mean_s"]]
        table.add_row(r["mode"], str(r["trials"]), str(r["failed"]), *("-" if c is None else f"{c:.3f}" for c in cells))
    console.print(table)
    console.print(f"wrote {save_result(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
