"""Outer-optimizer recipes at small sync intervals, side by side with synchronous data parallelism.

    python -m benchmarks.recipe_sweep [--task charlm|teacher] [--preset tiny] [--samples 60000] [--peers 4]
                                      [--grid full|quick] [--jobs 2] [--out benchmarks/results/recipe_sweep_TASK.json]

A single-process simulation of the swarm's algorithm (``swarm.Trainer``), one recipe per row, so a
grid of recipes costs minutes instead of hours of real swarms (benchmarks.convergence checks the
chosen one on real peers). ``--peers`` workers, worker i on shard i of N with its own AdamW (the
same lr and weight decay as swarm.peer; statistics kept across rounds, as each peer keeps its own),
every ``H`` local steps:

    delta = base - mean_i(local_i)          (the pseudo-gradient, through the codec when one is set)
    base  = outer_sgd(base, grad=delta)     (Nesterov when momentum > 0)
    local_i = base                          (every worker resumes from the new base)

with the inner learning rate scaled by ``swarm.trainer``'s warm-up factor ``min(1, step / W)``.
Techniques from the literature a row can switch on: an inner learning-rate warm-up (``W``), a sync
interval that grows from 1 to H over the first steps (post-local SGD), averaging the inner AdamW
statistics every round (3x the bytes), and the int8 / 4-bit codecs' rounding on the pseudo-gradients.

The reference row ``dp`` is synchronous data parallelism at the same global batch (N x batch per
step, the mean of the N shards' gradients, one AdamW step), with the same inner warm-up as each row
(``dp-nowarmup`` without it). Every row sees the same samples and the same fixed validation set.
Reported per row: final validation loss, its ratio to ``dp``'s, the lowest loss on the way and
whether the curve ever rose by more than 2% over its running minimum in the second half of training
("rising"), and the averaging bytes per sample relative to fp32 data parallelism (codec payload of
the rounds only; the real swarm's other traffic is measured by benchmarks.convergence).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import math
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks._common import rising, save_result

RESULTS = Path(__file__).parent / "results"
LR = 3e-3
WEIGHT_DECAY = 0.01
_CODEC_BYTES = {"fp32": 4.0, "int8": 1.0 + 4 / 4096, "int4": 0.5 + 4 / 64}
"""Wire bytes per element of each codec (payload plus its per-block absmax)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    """One row of the sweep."""

    name: str
    sync_every: int = 15
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    inner_warmup: int = 0
    sync_warmup: int = 0
    """Steps over which the sync interval grows linearly from 1 to sync_every (0: fixed)."""
    average_inner_state: bool = False
    inner_decay: bool = False
    """Cosine decay of the inner learning rate after the warm-up, to 10% at the last step."""
    codec: str = "int8"
    """Rounding of the pseudo-gradients on the wire: int8 (the swarm's default), int4 or fp32."""
    dp: bool = False
    overlap: float | None = None
    """Overlapped rounds (swarm.overlap; None: blocking): a round's outer step lands ``overlap_delay`` local
    steps after its sync point, and each worker then resumes from the new global state plus ``overlap`` x its
    progress since the sync point; at each sync point a worker resumes from the global state plus ``overlap``
    x the progress it just sent (1: swarm.overlap's rule; below 1 it also mixes toward the global state)."""
    overlap_delay: int = 0
    """Local steps a round takes to land (0: at the next sync point, a whole phase late)."""
    eager: bool = False
    """Overlapped: at a sync point each worker resumes from the outer step its own pseudo-gradient alone would
    give (the global state and the outer momentum as they are), not from its local state; when the round
    lands it keeps its progress since then on the true global state ("eager updates", Kale et al. 2025)."""
    eager_mix: bool = False
    """With ``eager``: the stand-in gradient is the last round's mean with this worker's share in it replaced by
    its new pseudo-gradient (the last mean + (d - d_last) / M), not ``d`` alone: the paper's mixture of the
    current local outer gradient with the delayed ones of the other replicas."""
    phase_from_landing: bool = False
    """Overlapped: the next sync point comes ``sync_every`` steps after the round lands (not after the last sync
    point), so a phase is ``sync_every`` plus the steps taken while the round ran."""

    def sync_interval(self, step: int) -> int:
        if self.sync_warmup and step < self.sync_warmup:
            return max(1, round(self.sync_every * (step + 1) / self.sync_warmup))
        return self.sync_every


def grid(name: str, *, warmup: int) -> list[Recipe]:
    """The rows of a named grid; ``warmup`` is the inner warm-up the chosen defaults use."""
    from swarm.recipe import DEFAULT_SYNC_EVERY as DEFAULT_H
    from swarm.recipe import outer_settings

    rows = [Recipe(name="dp", dp=True, inner_warmup=warmup), Recipe(name="dp-nowarmup", dp=True)]
    if name == "overlap":
        outer = outer_settings(DEFAULT_H)
        base = {"sync_every": DEFAULT_H, "inner_warmup": warmup, "outer_lr": outer.lr, "outer_momentum": outer.momentum}
        return [
            rows[0],
            Recipe(name="defaults", **base),
            *(Recipe(name=f"overlapped, lands at the next sync, own x{a:g}", overlap=a, **base) for a in (1.0, 0.5)),
            *(
                Recipe(name=f"overlapped, lands after {d} steps", overlap=1.0, overlap_delay=d, **base)
                for d in (1, 2, 5)
            ),
            *(
                Recipe(name=f"overlapped, lands after {d} steps, own x0.5", overlap=0.5, overlap_delay=d, **base)
                for d in (2, 5)
            ),
            *(
                Recipe(
                    name=f"overlapped, lands after {d} steps, {label}", overlap=1.0, overlap_delay=d, **flags, **base
                )
                for label, flags in (
                    ("eager", {"eager": True}),
                    ("eager mix", {"eager": True, "eager_mix": True}),
                    ("phase from landing", {"phase_from_landing": True}),
                )
                for d in (1, 2, 5)
            ),
            Recipe(
                name="overlapped, lands after 5 steps, plain outer",
                overlap=1.0,
                overlap_delay=5,
                **{**base, "outer_lr": 1.0, "outer_momentum": 0.0},
            ),
            Recipe(name="defaults, plain outer", **{**base, "outer_lr": 1.0, "outer_momentum": 0.0}),
        ]
    if name == "quick":
        outer = outer_settings(DEFAULT_H)
        return [
            *rows,
            Recipe(name="plain H15", sync_every=15),
            Recipe(
                name="defaults",
                sync_every=DEFAULT_H,
                inner_warmup=warmup,
                outer_lr=outer.lr,
                outer_momentum=outer.momentum,
            ),
        ]
    for h in (15, 30, 50, 100):
        rows += [
            Recipe(name=f"H{h} plain", sync_every=h),
            Recipe(name=f"H{h} nesterov 0.7/0.9", sync_every=h, outer_lr=0.7, outer_momentum=0.9),
            Recipe(name=f"H{h} nesterov 0.7/0.5", sync_every=h, outer_lr=0.7, outer_momentum=0.5),
            Recipe(name=f"H{h} nesterov 0.5/0.5", sync_every=h, outer_lr=0.5, outer_momentum=0.5),
            Recipe(name=f"H{h} plain + warm-up", sync_every=h, inner_warmup=warmup),
            Recipe(
                name=f"H{h} nesterov 0.5/0.5 + warm-up",
                sync_every=h,
                outer_lr=0.5,
                outer_momentum=0.5,
                inner_warmup=warmup,
            ),
        ]
    rows += [
        Recipe(
            name="H15 nesterov 0.7/0.9 + warm-up", sync_every=15, outer_lr=0.7, outer_momentum=0.9, inner_warmup=warmup
        ),
        Recipe(name="H15 sync 1->15 over 300 steps", sync_every=15, sync_warmup=300),
        Recipe(name="H15 avg inner AdamW state", sync_every=15, average_inner_state=True),
        Recipe(name="H15 plain + warm-up x2", sync_every=15, inner_warmup=2 * warmup),
        Recipe(
            name="H15 nesterov 0.5/0.5 + warm-up, fp32",
            sync_every=15,
            outer_lr=0.5,
            outer_momentum=0.5,
            inner_warmup=warmup,
            codec="fp32",
        ),
        Recipe(name="H10 plain + warm-up", sync_every=10, inner_warmup=warmup),
        Recipe(
            name="H10 nesterov 0.5/0.5 + warm-up", sync_every=10, outer_lr=0.5, outer_momentum=0.5, inner_warmup=warmup
        ),
        Recipe(
            name="H8 nesterov 0.5/0.5 + warm-up", sync_every=8, outer_lr=0.5, outer_momentum=0.5, inner_warmup=warmup
        ),
        Recipe(name="dp + decay", dp=True, inner_warmup=warmup, inner_decay=True),
        Recipe(
            name="H15 nesterov 0.5/0.5 + warm-up + decay",
            sync_every=15,
            outer_lr=0.5,
            outer_momentum=0.5,
            inner_warmup=warmup,
            inner_decay=True,
        ),
        Recipe(name="H15 plain + warm-up + decay", sync_every=15, inner_warmup=warmup, inner_decay=True),
        Recipe(
            name="H10 nesterov 0.5/0.5 + warm-up + decay",
            sync_every=10,
            outer_lr=0.5,
            outer_momentum=0.5,
            inner_warmup=warmup,
            inner_decay=True,
        ),
        Recipe(name="H30 plain + warm-up + decay", sync_every=30, inner_warmup=warmup, inner_decay=True),
        Recipe(
            name="H8 nesterov 0.5/0.5 + warm-up, int4",
            sync_every=8,
            outer_lr=0.5,
            outer_momentum=0.5,
            inner_warmup=warmup,
            codec="int4",
        ),
    ]
    return rows


def _quantize(t: Any, codec: str) -> Any:
    """The rounding of the codec's blockwise absmax quantization (int8: 4096-blocks, int4: 64-blocks)."""
    import torch

    if codec == "fp32":
        return t
    block, levels = (4096, 127) if codec == "int8" else (64, 7)
    flat = t.reshape(-1)
    pad = (-flat.numel()) % block
    x = torch.cat([flat, flat.new_zeros(pad)]).view(-1, block)
    scale = x.abs().amax(1, keepdim=True).clamp_min(1e-30)
    q = torch.round(x / scale * levels).clamp(-levels, levels) * scale / levels
    return q.reshape(-1)[: flat.numel()].view_as(t)


def _outer_step(base: list[Any], outer: Any, mean: list[Any] | None) -> None:
    import torch

    if mean is None:
        return
    with torch.no_grad():
        for param, grad in zip(base, mean):
            param.grad = grad
        outer.step()
        outer.zero_grad(set_to_none=True)


def _land(
    workers: list[list[Any]], base: list[Any], outer: Any, starts: list[list[Any]], pending: Any, alpha: float
) -> None:
    """A round lands mid-phase: the global state takes its mean; each worker keeps ``alpha`` x its progress since
    the sync point, on the new global state, and its next pseudo-gradient is measured from the global state."""
    import torch

    _outer_step(base, outer, pending)
    with torch.no_grad():
        for worker, start in zip(workers, starts):
            for param, s, g in zip(worker, start, base):
                param.copy_(g - alpha * (s - param))
                s.copy_(g)


def _sync_overlapped(
    workers: list[list[Any]],
    base: list[Any],
    outer: Any,
    starts: list[list[Any]],
    pending: Any,
    recipe: Recipe,
    last: dict[str, Any],
) -> list[Any]:
    """A sync point of the overlapped algorithm (one group of every worker): each worker's pseudo-gradient
    ``start - local`` goes into this round (returned, pending); a round still pending lands now; each worker
    resumes from the global state plus ``overlap`` x the progress just sent. ``last`` keeps the last round's
    mean and pseudo-gradients (for ``eager_mix``)."""
    import torch

    from swarm.outer import outer_update

    with torch.no_grad():
        deltas = [[_quantize(s - p, recipe.codec) for s, p in zip(start, w)] for start, w in zip(starts, workers)]
        _outer_step(base, outer, pending)
        for w, (worker, start, delta) in enumerate(zip(workers, starts, deltas)):
            for k, (param, s, g, d) in enumerate(zip(worker, start, base, delta)):
                if recipe.eager:  # the outer step on g with d for the gradient, the optimizer untouched
                    if recipe.eager_mix and last:
                        d = last["mean"][k] + (d - last["deltas"][w][k]) / len(workers)
                    buffer = outer.state.get(g, {}).get("momentum_buffer")
                    lr, momentum = outer.defaults["lr"], outer.defaults["momentum"]
                    param.copy_(g - outer_update(d, buffer, lr=lr, momentum=momentum))
                else:
                    param.copy_(g - recipe.overlap * d)
                s.copy_(param)
        mean = [_quantize(torch.stack(ds).mean(0), recipe.codec) for ds in zip(*deltas)]
        last.update(mean=mean, deltas=deltas)
        return mean


def _evaluate(task: Any, model: Any) -> float:
    return float(task.evaluate(model))


def decay_factor(step: int, *, warmup_steps: int, total_steps: int, final: float = 0.1) -> float:
    """The ``+ decay`` rows' inner learning-rate factor (measured, not a default: it hurt every swarm row):
    cosine decay after the warm-up, 1 at ``warmup_steps``, ``final`` at ``total_steps`` (1-based ``step``;
    1 throughout when ``total_steps`` is 0, an open-ended run)."""
    if total_steps <= 0 or step <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


def simulate(
    recipe: Recipe, *, task_name: str, preset: str, samples: int, peers: int, eval_every_samples: int
) -> dict[str, Any]:
    """Train one recipe in this process; returns its curve and figures."""
    import torch

    from swarm.recipe import warmup_factor
    from swarm.tasks import get_task

    torch.set_num_threads(1)
    task = get_task(task_name, preset=preset)
    batch = task.config.batch_size
    steps = samples // (peers * batch)
    started = time.monotonic()

    def lr_factor(step: int) -> float:  # swarm.Trainer.inner_lr_factor, for the (step + 1)-th step
        factor = warmup_factor(step + 1, recipe.inner_warmup)
        if recipe.inner_decay:
            factor *= decay_factor(step + 1, warmup_steps=recipe.inner_warmup, total_steps=steps)
        return factor

    curve: list[tuple[int, float]] = []
    rounds = 0
    if recipe.dp:
        model = task.build_model(seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        streams = [task.train_batches(shard_index=i, num_shards=peers, seed=0) for i in range(peers)]
        curve.append((0, _evaluate(task, model)))
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = LR * lr_factor(step)
            loss = sum(task.loss(model, next(s)) for s in streams) / peers  # = the mean of the N gradients
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            seen = (step + 1) * batch * peers
            if seen // eval_every_samples != step * batch * peers // eval_every_samples or step + 1 == steps:
                curve.append((seen, _evaluate(task, model)))
    else:
        models = [task.build_model(seed=0) for _ in range(peers)]
        opts = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WEIGHT_DECAY) for m in models]
        streams = [task.train_batches(shard_index=i, num_shards=peers, seed=0) for i in range(peers)]
        params = [list(m.parameters()) for m in models]
        base = [p.detach().clone() for p in params[0]]
        momentum = recipe.outer_momentum
        outer = torch.optim.SGD(base, lr=recipe.outer_lr, momentum=momentum, nesterov=momentum > 0)
        starts = [[p.detach().clone() for p in worker] for worker in params]
        pending: list[Any] | None = None
        last: dict[str, Any] = {}
        lands = -1
        probe = task.build_model(seed=0)
        curve.append((0, _evaluate(task, models[0])))
        since, interval = 0, recipe.sync_interval(0)
        for step in range(steps):
            for model, opt, stream in zip(models, opts, streams):
                for group in opt.param_groups:
                    group["lr"] = LR * lr_factor(step)
                task.loss(model, next(stream)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            since += 1
            if pending is not None and step + 1 == lands and since < interval and step + 1 < steps:
                _land(params, base, outer, starts, pending, recipe.overlap)
                pending = None
                if recipe.phase_from_landing:
                    since = 0
            if since < interval and step + 1 < steps:
                continue
            if recipe.overlap is not None:
                pending = _sync_overlapped(params, base, outer, starts, pending, recipe, last)
                lands = step + 1 + (recipe.overlap_delay or interval)
                rounds += 1
                since, interval = 0, recipe.sync_interval(step + 1)
                seen = (step + 1) * batch * peers
                if step + 1 == steps:  # Trainer.finish(): the last round lands; the global state is the model
                    _outer_step(base, outer, pending)
                if not curve or seen - curve[-1][0] >= eval_every_samples or step + 1 == steps:
                    with torch.no_grad():
                        for param, new in zip(probe.parameters(), base):
                            param.copy_(new)
                    curve.append((seen, _evaluate(task, probe)))
                continue
            with torch.no_grad():
                for k, param in enumerate(base):
                    deltas = [_quantize(param - worker[k], recipe.codec) for worker in params]
                    param.grad = _quantize(torch.stack(deltas).mean(0), recipe.codec)
                outer.step()
                outer.zero_grad(set_to_none=True)
                for worker in params:
                    for param, new in zip(worker, base):
                        param.copy_(new)
                if recipe.average_inner_state:
                    for k in range(len(base)):
                        states = [o.state[worker[k]] for o, worker in zip(opts, params)]
                        for key in ("exp_avg", "exp_avg_sq"):
                            mean = torch.stack([s[key] for s in states]).mean(0)
                            for s in states:
                                s[key].copy_(mean)
            rounds += 1
            since, interval = 0, recipe.sync_interval(step + 1)
            seen = (step + 1) * batch * peers
            if not curve or seen - curve[-1][0] >= eval_every_samples or step + 1 == steps:
                curve.append((seen, _evaluate(task, models[0])))
    numel = sum(p.numel() for p in task.build_model(seed=0).parameters())
    return {
        "recipe": dataclasses.asdict(recipe),
        "curve": curve,
        "rounds": rounds,
        "steps": steps,
        "numel": numel,
        "wall_s": time.monotonic() - started,
    }


def bytes_ratio(result: dict[str, Any], *, peers: int) -> float | None:
    """How many times fewer bytes per sample than fp32 data parallelism (averaging payload only)."""
    recipe = result["recipe"]
    if recipe["dp"]:
        return None
    per_element = _CODEC_BYTES[recipe["codec"]] * (3 if recipe["average_inner_state"] else 1)
    dp_bytes = 4.0 * result["steps"]  # one fp32 all-reduce per step
    ours = per_element * result["rounds"]  # both: x 2(N-1)/N x numel per peer
    return dp_bytes / ours


def summarize(results: list[dict[str, Any]], *, peers: int) -> list[dict[str, Any]]:
    by_name = {r["recipe"]["name"]: r for r in results}
    rows = []
    for r in results:
        recipe = r["recipe"]
        with_warmup = recipe["inner_warmup"] or recipe["dp"] or "dp-nowarmup" not in by_name
        # each row against data parallelism with the same inner schedule
        name = (
            "dp + decay"
            if recipe["inner_decay"] and "dp + decay" in by_name
            else "dp"
            if with_warmup
            else "dp-nowarmup"
        )
        reference = by_name[name]
        final = r["curve"][-1][1]
        rows.append(
            {
                "recipe": recipe["name"],
                "final_val_loss": final,
                "min_val_loss": min(v for _, v in r["curve"]),
                "reference": reference["recipe"]["name"],
                "ratio_to_dp": final / reference["curve"][-1][1],
                "ratio_to_dp_with_warmup": final / by_name["dp"]["curve"][-1][1],
                "rising": rising(r["curve"]),
                "rounds": r["rounds"],
                "fewer_bytes_than_fp32_dp": bytes_ratio(r, peers=peers),
                "wall_s": r["wall_s"],
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]], *, title: str, console: Console) -> None:
    table = Table(title=title)
    for column in (
        "recipe",
        "final val loss",
        "x dp",
        "x dp (warm-up)",
        "min",
        "rising",
        "rounds",
        "fewer B than fp32 dp",
        "wall s",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        fewer = row["fewer_bytes_than_fp32_dp"]
        table.add_row(
            row["recipe"],
            f"{row['final_val_loss']:.4f}",
            f"{row['ratio_to_dp']:.3f}",
            f"{row['ratio_to_dp_with_warmup']:.3f}",
            f"{row['min_val_loss']:.4f}",
            "yes" if row["rising"] else "no",
            str(row["rounds"]),
            "-" if fewer is None else f"{fewer:.0f}x",
            f"{row['wall_s']:.0f}",
        )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    from swarm.recipe import INNER_WARMUP_STEPS

    parser = argparse.ArgumentParser(prog="python -m benchmarks.recipe_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--samples", type=int, default=60000)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--grid", choices=("full", "quick", "overlap"), default="full")
    parser.add_argument(
        "--only", nargs="*", default=None, help="run only the rows with these names (and the reference row dp)"
    )
    parser.add_argument("--jobs", type=int, default=2, help="rows trained at once (one CPU thread each)")
    parser.add_argument("--eval-every-samples", type=int, default=3840)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    warmup = INNER_WARMUP_STEPS
    recipes = grid(args.grid, warmup=warmup)
    if args.only:
        recipes = [r for r in recipes if r.name in ("dp", "dp + decay") or r.name in args.only]
    out = Path(args.out) if args.out else RESULTS / f"recipe_sweep_{args.task}.json"
    kwargs = {
        "task_name": args.task,
        "preset": args.preset,
        "samples": args.samples,
        "peers": args.peers,
        "eval_every_samples": args.eval_every_samples,
    }
    console.print(
        f"recipe sweep: {args.task}/{args.preset}, {args.peers} workers, {args.samples} samples, "
        f"{len(recipes)} rows, {args.jobs} at a time",
        highlight=False,
    )
    context = multiprocessing.get_context("spawn")
    results: dict[str, dict[str, Any]] = {}
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs, mp_context=context) as pool:
        futures = {pool.submit(simulate, r, **kwargs): r for r in recipes}
        for future in concurrent.futures.as_completed(futures):
            recipe = futures[future]
            results[recipe.name] = future.result()
            console.print(
                f"  {recipe.name}: {results[recipe.name]['curve'][-1][1]:.4f} ({results[recipe.name]['wall_s']:.0f} s)",
                highlight=False,
            )
    ordered = [results[r.name] for r in recipes]
    rows = summarize(ordered, peers=args.peers)
    command = "python -m benchmarks.recipe_sweep " + " ".join(sys.argv[1:] if argv is None else argv)
    save_result(
        out,
        {
            "benchmark": "recipe_sweep",
            "command": command.strip(),
            "config": vars(args),
            "inner_warmup_default": warmup,
            "cpus": os.cpu_count(),
            "rows": rows,
            "results": ordered,
        },
    )
    print_table(
        rows,
        title=f"recipes on {args.task}/{args.preset}: {args.peers} workers, {args.samples} samples",
        console=console,
    )
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
