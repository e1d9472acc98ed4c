"""Two revisions of Swarm, benchmarked side by side in one run: did a change move the figures?

    python -m benchmarks.side_by_side --base REV [--head REV] [--rounds 2]

Each revision is checked out in its own git worktree; every benchmark then runs alternately on the base
and the head (base, head, base, head, ...), each in its own worktree (``cwd`` and ``PYTHONPATH``), so a
drift of this shared machine lands on both. Benchmarks and the figures compared:

* averaging round (`benchmarks.averaging_round`): 4 peers, 40 MB of fp32, fp32 and int8, loopback and
  100 Mbit/s test hosts: median round time;
* state sync (`benchmarks.state_sync`): 100 MB from 1 and 3 donors at 100 Mbit/s: download time;
* convergence (`benchmarks.convergence`): charlm tiny, 4 peers, a short budget of samples: final val loss
  of our swarm and of data parallelism, and their ratio.

Prints a table (median of each side, head / base) and writes JSON. Times are noisy on a shared machine:
a ratio within about 10% is noise here; losses within about 1%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parent / "results" / "side_by_side.json"

Figures = dict[str, float]


def _averaging(out: Path) -> tuple[list[str], Callable[[dict], Figures]]:
    argv = [
        "benchmarks.averaging_round",
        "--peers",
        "4",
        "--numel",
        "10000000",
        "--settings",
        "loopback",
        "100",
        "--methods",
        "ours-fp32",
        "ours-int8",
        "--repeats",
        "2",
        "--out",
        str(out),
    ]

    def figures(result: dict) -> Figures:
        return {
            f"averaging round {r['method']} {r['setting']} (s)": r["median_s"]
            for r in result["rows"]
            if r.get("median_s") is not None
        }

    return argv, figures


def _state_sync(out: Path) -> tuple[list[str], Callable[[dict], Figures]]:
    argv = ["benchmarks.state_sync", "--numel", "25000000", "--setting", "100", "--out", str(out)]

    def figures(result: dict) -> Figures:
        return {
            f"state sync {row['method']} {block['setting']} Mbit/s (s)": row["seconds"]
            for block in result["settings"]
            for row in block["rows"]
            if row["method"].startswith("ours")
        }

    return argv, figures


def _convergence(out: Path, samples: int) -> tuple[list[str], Callable[[dict], Figures]]:
    argv = ["benchmarks.convergence", "--preset", "tiny", "--peers", "4", "--samples", str(samples), "--out", str(out)]

    def figures(result: dict) -> Figures:
        arms = result["arms"]
        ours, dp = arms["ours"]["final_val_loss"], arms["dp"]["final_val_loss"]
        return {"convergence ours val loss": ours, "convergence dp val loss": dp, "convergence ours / dp": ours / dp}

    return argv, figures


def _plan(name: str, out: Path, *, samples: int) -> tuple[list[str], Callable[[dict], Figures]]:
    if name == "averaging":
        return _averaging(out)
    if name == "state_sync":
        return _state_sync(out)
    return _convergence(out, samples)


def _worktree(repo: Path, rev: str, parent: Path) -> Path:
    path = parent / rev.replace("/", "_")
    subprocess.run(
        ["git", "-C", str(repo), "worktree", "add", "--detach", str(path), rev],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return path


def _run(tree: Path, argv: list[str], *, timeout_s: float, log: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with open(log, "w") as f:
        subprocess.run(
            [sys.executable, "-m", *argv],
            cwd=tree,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            check=True,
            timeout=timeout_s,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.side_by_side", description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision before the change")
    parser.add_argument("--head", default="HEAD", help="the revision after it (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each benchmark on each side (alternating)")
    parser.add_argument("--samples", type=int, default=12000, help="convergence: samples per arm")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=("averaging", "state_sync", "convergence"),
        default=["averaging", "state_sync", "convergence"],
    )
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    console = Console()
    repo = Path(__file__).resolve().parents[1]
    figures: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with tempfile.TemporaryDirectory(prefix="swarm-side-by-side-") as tmp:
        work = Path(tmp)
        trees = {"base": _worktree(repo, args.base, work), "head": _worktree(repo, args.head, work)}
        try:
            for name in args.only:
                for i in range(args.rounds):
                    for side in ("base", "head"):
                        out = work / f"{name}-{side}-{i}.json"
                        bench_argv, read = _plan(name, out, samples=args.samples)
                        started = time.monotonic()
                        console.print(f"{name} round {i + 1}: {side} ({args.base if side == 'base' else args.head})")
                        _run(trees[side], bench_argv, timeout_s=3600, log=work / f"{name}-{side}-{i}.log")
                        for key, value in read(json.loads(out.read_text())).items():
                            figures[key][side].append(value)
                        console.print(f"  done in {time.monotonic() - started:.0f} s")
        finally:
            for tree in trees.values():
                subprocess.run(
                    ["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)],
                    capture_output=True,
                    timeout=60,
                )
    table = Table(title=f"side by side: {args.base} (base) vs {args.head} (head)")
    for column in ("figure", "base", "head", "head / base"):
        table.add_column(column)
    rows = []
    for key, sides in figures.items():
        base, head = statistics.median(sides["base"]), statistics.median(sides["head"])
        rows.append(
            {"figure": key, "base": sides["base"], "head": sides["head"], "ratio": head / base if base else None}
        )
        table.add_row(key, f"{base:.4g}", f"{head:.4g}", f"{head / base:.3f}" if base else "-")
    console.print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "benchmark": "side_by_side",
                "base": args.base,
                "head": args.head,
                "rounds": args.rounds,
                "command": " ".join(sys.argv),
                "rows": rows,
            },
            indent=1,
        )
    )
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
