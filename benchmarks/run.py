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
    inner = bench_inner_steps(["tiny", "small"] if not args.full else ["tiny", "small", "default"], num_steps=20)
    console.print(_table("charlm inner steps (1 CPU thread)", inner))
    # the other benchmarks print their own tables and write their own JSON beside this one
    from benchmarks import averaging_round, peers_graph

    numel = "2500000" if not args.full else "25000000"
    averaging_round.main(["--peers", "4", "--numel", numel, "--repeats", "2" if not args.full else "3"])
    peers_graph.main(["--peers", "20", "--refresh-s", "2", "--expiry-s", "6"] if not args.full else ["--peers", "20"])
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
              "cpus": torch.get_num_threads(), "python": sys.version.split()[0], "torch": torch.__version__,
              "command": "python -m benchmarks.run " + ("--full" if args.full else "--quick"),
              "inner_steps": inner}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
