"""`python -m benchmarks.run`: run the benchmark set, print one table per benchmark, write JSON.

Figures are compared within one run (ratios), never against numbers remembered from another day:
the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

RESULTS_DIR = Path(__file__).parent / "results"


def bench_inner_steps(presets: list[str], num_steps: int) -> list[dict[str, Any]]:
    """Training throughput of the charlm presets on one CPU thread (the demo's setting)."""
    from swarm.tasks import get_task, num_params

    rows = []
    torch.set_num_threads(1)
    for preset in presets:
        task = get_task("charlm", preset=preset)
        model = task.build_model(seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        batches = task.train_batches(shard_index=0, num_shards=1)
        for step in range(num_steps + 2):
            if step == 2:  # two warm-up steps
                started = time.perf_counter()
            loss = task.loss(model, next(batches))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        elapsed = time.perf_counter() - started
        rows.append({"preset": preset, "params": num_params(model), "steps": num_steps,
                     "ms_per_step": 1e3 * elapsed / num_steps,
                     "samples_per_s": num_steps * task.config.batch_size / elapsed})
    return rows


def bench_averaging_round(num_peers: int, num_params: int, compression: str, rounds: int) -> dict[str, Any]:
    """Round time of `num_peers` trainers in this process on loopback (hivemind's averager is the data path)."""
    from bootstrap import start_dht, stop_dht
    from swarm.trainer import Trainer, TrainerConfig

    config = TrainerConfig(run=f"bench-{num_peers}-{num_params}-{compression}", sync_every=1, min_group_size=num_peers,
                           target_group_size=num_peers, matchmaking_time_s=1.0, request_timeout_s=0.5,
                           averaging_timeout_s=60, compression=compression, load_state=False,
                           host_maddrs=("/ip4/127.0.0.1/tcp/0",))
    first = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    initial = [str(a) for a in first.get_visible_maddrs()]
    dhts = [first] + [start_dht(initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(num_peers - 1)]
    trainers = []
    try:
        for dht in dhts:
            model = torch.nn.Linear(num_params // 1000, 1000, bias=False)
            trainers.append(Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), config=config, dht=dht))
        durations = []
        for _ in range(rounds):
            with ThreadPoolExecutor(num_peers) as pool:
                results = list(pool.map(lambda trainer: trainer.sync(), trainers, timeout=120))
            if not all(r is not None and r.group_size == num_peers for r in results):
                raise RuntimeError(f"a benchmark round did not gather all {num_peers} peers: {results}")
            durations.append(max(r.duration_s for r in results))
        return {"peers": num_peers, "params": num_params, "compression": compression,
                "fp32_mb": num_params * 4 / 1e6, "round_s_best": min(durations),
                "round_s_median": sorted(durations)[len(durations) // 2]}
    finally:
        for trainer in trainers:
            trainer.shutdown()
        for dht in dhts:
            stop_dht(dht)


def _table(title: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=title)
    for key in rows[0]:
        table.add_column(key, justify="right")
    for row in rows:
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the quick set (default; a few minutes)")
    mode.add_argument("--full", action="store_true", help="larger payloads and more repetitions")
    parser.add_argument("--out", default=str(RESULTS_DIR / "latest.json"), help="JSON output path")
    args = parser.parse_args(argv)
    console = Console()
    sizes = [1_000_000, 10_000_000] if not args.full else [1_000_000, 10_000_000, 25_000_000]
    peer_counts = [2, 4] if not args.full else [2, 4, 8]
    rounds = 3 if not args.full else 5

    inner = bench_inner_steps(["tiny", "small"] if not args.full else ["tiny", "small", "default"], num_steps=20)
    console.print(_table("charlm inner steps (1 CPU thread)", inner))
    averaging = []
    for num_peers in peer_counts:
        for size in sizes:
            for compression in ("none", "fp16"):
                averaging.append(bench_averaging_round(num_peers, size, compression, rounds))
                console.print(f"  averaging: {averaging[-1]['peers']} peers, {size:,} params, {compression}: "
                              f"{averaging[-1]['round_s_best']:.2f} s")
    for row in averaging:
        fp32 = next(r for r in averaging if r["peers"] == row["peers"] and r["params"] == row["params"]
                    and r["compression"] == "none")
        row["vs_fp32"] = row["round_s_best"] / fp32["round_s_best"]
    console.print(_table("averaging round on loopback (matchmaking included)", averaging))

    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
              "cpus": torch.get_num_threads(), "python": sys.version.split()[0], "torch": torch.__version__,
              "command": "python -m benchmarks.run " + ("--full" if args.full else "--quick"),
              "inner_steps": inner, "averaging_round": averaging}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
