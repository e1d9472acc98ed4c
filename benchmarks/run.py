"""`python -m benchmarks.run`: run the benchmark set, one after the other, each printing its table and
writing its JSON under benchmarks/results/; then a summary of every run benchmark in latest.json.

    python -m benchmarks.run [--quick | --full] [--only NAME ...]

Figures are compared within one run (ratios), never against numbers remembered from another day:
the machines are shared and noisy. Benchmarks run sequentially so that they do not disturb each
other. Shaped-link rows need root (network namespaces); without it they are skipped with the reason.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from benchmarks._common import save_result

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
        rows.append(
            {
                "preset": preset,
                "params": num_params(model),
                "steps": num_steps,
                "ms_per_step": 1e3 * elapsed / num_steps,
                "samples_per_s": num_steps * task.config.batch_size / elapsed,
            }
        )
    return rows


def _table(title: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=title)
    for key in rows[0]:
        table.add_column(key, justify="right")
    for row in rows:
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()))
    return table


# name -> (module, quick argv lists, full argv lists); each argv list is one invocation.
# The quick set took 9 min 15 s on 2 cores; the full set about 50 minutes (25 without dht_churn and chaos), timed
# before adversary (about 19 minutes) and dht_latency (about 5) were in it.
PLAN: dict[str, tuple[str, list[list[str]], list[list[str]]]] = {
    "averaging_round": (
        "benchmarks.averaging_round",
        [["--peers", "4", "--numel", "2500000", "--settings", "loopback", "100", "--repeats", "2"]],
        [
            [
                "--peers",
                "4",
                "--numel",
                "25000000",
                "--settings",
                "loopback",
                "100",
                "1000",
                "--repeats",
                "2",
                "--sender-death",
                "--out",
                str(RESULTS_DIR / "averaging_round.json"),
            ],
            [
                "--peers",
                "8",
                "--numel",
                "10000000",
                "--settings",
                "loopback",
                "1000",
                "--repeats",
                "2",
                "--out",
                str(RESULTS_DIR / "averaging_round_8peers.json"),
            ],
        ],
    ),
    "convergence": (
        "benchmarks.convergence",
        [["--preset", "tiny", "--samples", "16000", "--peers", "4"]],
        [
            ["--preset", "tiny", "--samples", "61000", "--peers", "4"],
            [
                "--task",
                "teacher",
                "--preset",
                "tiny",
                "--samples",
                "120000",
                "--peers",
                "4",
                "--eval-batches",
                "4",
                "--out",
                str(RESULTS_DIR / "convergence_teacher.json"),
            ],
        ],
    ),
    # single-process simulations of the outer-step recipes against data parallelism (about 30 minutes for charlm)
    "recipe_sweep": (
        "benchmarks.recipe_sweep",
        [
            [
                "--task",
                "teacher",
                "--grid",
                "quick",
                "--samples",
                "30000",
                "--out",
                str(RESULTS_DIR / "recipe_sweep_quick.json"),
            ]
        ],
        [["--task", "charlm", "--samples", "60000"], ["--task", "teacher", "--samples", "120000"]],
    ),
    "churn": (
        "benchmarks.churn",
        [["--peers", "4", "--rate-mbit", "100", "--repeats", "1"]],
        [["--peers", "8", "--rate-mbit", "100", "--repeats", "1"]],
    ),
    "state_sync": (
        "benchmarks.state_sync",
        [["--numel", "6250000", "--setting", "loopback", "100"]],
        [["--numel", "25000000", "--setting", "loopback", "100"]],
    ),
    "gossip": ("benchmarks.gossip", [["--peers", "30", "--repeats", "3"]], [["--peers", "50", "--repeats", "5"]]),
    "peers_graph": (
        "benchmarks.peers_graph",
        [["--peers", "30", "--refresh-s", "2", "--expiry-s", "6"]],
        [["--peers", "50"]],
    ),
    # the model alone takes about a minute; the full set also measures 50 and 100 real DHT nodes (6 minutes)
    "scale_model": ("benchmarks.scale_model", [["--measure"]], [[]]),
    "dht_churn": ("benchmarks.dht_churn", [], [["--peers", "30", "--kill-fraction", "0.1", "--lookups", "300"]]),
    # about 5 minutes: one DHT request's time behind a round's parts on shaped links (--dht-rpc-timeout-s)
    "dht_latency": ("benchmarks.dht_latency", [], [["--rates", "20,10,5"]]),
    # about 19 minutes: grouped rounds per minute beside an outsider, signed Sybils and a frozen member,
    # defaults and hardened
    "adversary": (
        "benchmarks.adversary",
        [],
        [
            ["--window-s", "60", "--out", str(RESULTS_DIR / "adversary.json")],
            [
                "--window-s",
                "60",
                "--peer-flags",
                "--members-only --suspect-s 30",
                "--out",
                str(RESULTS_DIR / "adversary_hardened.json"),
            ],
        ],
    ),
    # about 23 minutes: a 10-minute no-chaos arm, then the 10-minute chaos arm (RESILIENCE.md)
    "chaos": ("benchmarks.chaos", [], [["--duration", "600", "--peers", "6", "--seed", "1"]]),
}


def _run_one(name: str, argv: list[str], console: Console) -> dict[str, Any]:
    import importlib

    module = importlib.import_module(PLAN[name][0])
    main: Callable[[list[str]], int] = module.main
    console.rule(f"{name}: python -m {PLAN[name][0]} {' '.join(argv)}")
    started = time.monotonic()
    try:
        code = main(argv)
        error = None
    except Exception as e:  # one broken benchmark must not hide the others' figures
        code, error = 1, f"{e!r}\n{traceback.format_exc()[-2000:]}"
        console.print(f"[red]{name} failed: {e!r}[/]")
    return {
        "name": name,
        "command": f"python -m {PLAN[name][0]} {' '.join(argv)}",
        "exit_code": code,
        "error": error,
        "seconds": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the quick set (default; under 15 minutes here)")
    mode.add_argument("--full", action="store_true", help="every benchmark at the issue's sizes (about 50 minutes)")
    parser.add_argument("--only", nargs="+", choices=sorted(PLAN), default=None, help="run only these")
    parser.add_argument("--out", default=str(RESULTS_DIR / "latest.json"), help="summary JSON path")
    args = parser.parse_args(argv)
    console = Console()
    started = time.monotonic()
    inner = bench_inner_steps(["tiny", "small"] if not args.full else ["tiny", "small", "default"], num_steps=20)
    console.print(_table("charlm inner steps (1 CPU thread)", inner))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    runs = [
        _run_one(name, argv, console)
        for name in (args.only or list(PLAN))
        for argv in (PLAN[name][2] if args.full else PLAN[name][1])
    ]
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "cpus": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "command": "python -m benchmarks.run " + ("--full" if args.full else "--quick"),
        "seconds": round(time.monotonic() - started, 1),
        "inner_steps": inner,
        "benchmarks": runs,
    }
    summary = Table(title="benchmark set")
    for column in ("benchmark", "exit", "seconds", "command"):
        summary.add_column(column)
    for run in runs:
        summary.add_row(run["name"], str(run["exit_code"]), f"{run['seconds']:.0f}", run["command"])
    console.print(summary)
    out = save_result(args.out, result)
    console.print(f"wrote {out}; each benchmark's own JSON is beside it")
    return 0 if all(run["exit_code"] == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
