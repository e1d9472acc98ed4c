"""Averaging round time, side by side in one run: our GroupAverager (fp32, fp16, int8) and hivemind's
plain DecentralizedAverager on the same tensors, plus the time from a peer's death to the end of the
survivors' round.

    python -m benchmarks.averaging_round [--peers 4] [--numel 25000000] [--repeats 2]

All peers live in this process (each with its own DHT and p2pd) on loopback; times include
matchmaking. Prints a table and writes benchmarks/results/averaging_round.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from hivemind.averaging import DecentralizedAverager
from rich.console import Console
from rich.table import Table

from averaging import AveragingConfig, Crashed, FaultInjector, GroupAverager
from bootstrap import start_dht, stop_dht, visible_maddrs

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RESULTS = Path(__file__).parent / "results" / "averaging_round.json"
MATCHMAKING_S = 1.0


def _ours(dhts, tensors, codec: str, repeats: int, prefix: str) -> list[float]:
    config = AveragingConfig(matchmaking_time_s=MATCHMAKING_S, aggregator="mean", codec=codec,
                             sender_timeout_s=60, reducer_timeout_s=120, round_timeout_s=240,
                             min_group_size=len(dhts), target_group_size=len(dhts))
    averagers = [GroupAverager(dht, prefix=prefix, config=config) for dht in dhts]
    try:
        times = []
        for _ in range(repeats):
            with ThreadPoolExecutor(len(dhts)) as pool:
                results = list(pool.map(lambda i: averagers[i].step(tensors[i], weight=1.0), range(len(dhts))))
            if any(out is None for out, _, _ in results):
                raise RuntimeError(f"a round failed: {[r.to_dict() for _, r, _ in results]}")
            times.append(max(r.phase_s["total"] for _, r, _ in results))
        return times
    finally:
        for averager in averagers:
            averager.close()


def _hivemind(dhts, tensors, repeats: int, prefix: str) -> list[float]:
    averagers = [DecentralizedAverager([t.clone()], dht, start=True, prefix=prefix, target_group_size=len(dhts),
                                       min_group_size=len(dhts), min_matchmaking_time=MATCHMAKING_S,
                                       request_timeout=0.5, allreduce_timeout=240, next_chunk_timeout=60,
                                       sender_timeout=60, reducer_timeout=120)
                 for dht, t in zip(dhts, tensors)]
    try:
        times = []
        for _ in range(repeats):
            def one(averager):
                started = time.perf_counter()
                result = averager.step(timeout=240)
                if result is None:
                    raise RuntimeError("a hivemind round failed")
                return time.perf_counter() - started
            with ThreadPoolExecutor(len(dhts)) as pool:
                times.append(max(pool.map(one, averagers)))
        return times
    finally:
        for averager in averagers:
            averager.shutdown()


def _death_to_round_end(dhts, tensors, prefix: str) -> float:
    """SIGKILL-like crash of one peer while it sends; seconds from its death to the survivors' result."""
    config = AveragingConfig(matchmaking_time_s=MATCHMAKING_S, aggregator="mean", codec="int8",
                             sender_timeout_s=5, reducer_timeout_s=10, agreement_timeout_s=2, round_timeout_s=60)
    averagers = [GroupAverager(dht, prefix=prefix, config=config) for dht in dhts]
    faults, died_at = FaultInjector(), {}
    for i, averager in enumerate(averagers):
        faults.attach(averager, f"peer{i}")
    faults.add(f"peer{len(dhts) - 1}", 1, "send", "crash")
    original_crash = averagers[-1].crash

    async def timed_crash():
        died_at["t"] = time.monotonic()
        await original_crash()
    averagers[-1].crash = timed_crash

    def one(i):
        try:
            out, record, _ = averagers[i].step(tensors[i], weight=1.0)
            return time.monotonic() if out is not None else None
        except Crashed:
            return None
    try:
        with ThreadPoolExecutor(len(dhts)) as pool:
            ends = [e for e in pool.map(one, range(len(dhts))) if e is not None]
        if len(ends) != len(dhts) - 1 or "t" not in died_at:
            raise RuntimeError("the survivors did not finish the round")
        return max(ends) - died_at["t"]
    finally:
        for averager in averagers:
            averager.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.averaging_round", description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--numel", type=int, default=25_000_000, help="fp32 values per peer (25M = 100 MB)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    console = Console()
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(args.numel, generator=generator) for _ in range(args.peers)]
    dhts = [start_dht(host_maddrs=LOOPBACK, nat_port_map=False)]
    rows = []
    try:
        dhts += [start_dht(visible_maddrs(dhts[0]), host_maddrs=LOOPBACK, nat_port_map=False)
                 for _ in range(args.peers - 1)]
        for name, run in [("hivemind fp32", lambda: _hivemind(dhts, tensors, args.repeats, "bench_hm")),
                          *[(f"ours {c}", lambda c=c: _ours(dhts, tensors, c, args.repeats, f"bench_{c}"))
                            for c in ("fp32", "fp16", "int8")]]:
            with console.status(f"{name}: {args.peers} peers, {4 * args.numel / 1e6:.0f} MB each"):
                times = run()
            rows.append({"system": name, "round_s_median": statistics.median(times), "round_s_min": min(times)})
            console.print(f"  {name}: {rows[-1]['round_s_median']:.2f} s")
        hivemind_s = rows[0]["round_s_median"]
        for row in rows:
            row["vs_hivemind"] = row["round_s_median"] / hivemind_s
        small = [t[: min(args.numel, 2_500_000)].clone() for t in tensors]
        death_s = _death_to_round_end(dhts, small, "bench_death")
    finally:
        for dht in dhts:
            stop_dht(dht)
    table = Table(title=f"averaging round on loopback: {args.peers} peers, {4 * args.numel / 1e6:.0f} MB fp32 each "
                        f"(matchmaking {MATCHMAKING_S:.0f} s included)")
    for column in ("system", "round_s_median", "round_s_min", "vs_hivemind"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["system"], f"{row['round_s_median']:.2f}", f"{row['round_s_min']:.2f}",
                      f"{row['vs_hivemind']:.2f}")
    console.print(table)
    console.print(f"death of a sender -> survivors' round end: {death_s:.2f} s (sender timeout 5 s)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"peers": args.peers, "numel": args.numel, "rows": rows,
                                   "death_to_round_end_s": death_s}, indent=2))
    console.print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
