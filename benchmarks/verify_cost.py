"""What verified work costs: recording a phase's commitment, and replaying one segment of it.

    python -m benchmarks.verify_cost [--task charlm --preset small] [--steps 10] [--segments 1 2] [--phases 8]
                                     [--stream-offset 3000]

One process, the task's model and AdamW as `swarm.peer` builds them, phases of ``--steps`` inner steps.
Side by side in one run (interleaved, so the machine's load hits both arms alike): a plain phase, and
the same phase under a `swarm.verify.WorkRecorder` (a boundary every ``segment_steps`` steps: hashes
and copies of the parameters and the optimizer state, then the signed commitment). Then a verifier's
check of each segment: the inputs through safetensors bytes, the digests, the replay, with the verifier's
positioned batch streams (`swarm.verify.Streams`, as `swarm.work` keeps them), and the binding (the
verifier's slice of the committed update, in a group of ``--group-size``, encoded as sent and hashed).
``--stream-offset N`` starts the phases N batches into the shard's stream (a check late in a run); the
first check of a shard then draws those N batches once, which the median leaves out: the table also gives
the slowest check.

Per segment length: the recording overhead, measured twice: as the difference of the two arms (recorded /
plain phase - 1, noisy on a shared machine) and directly, as the time spent inside the recorder (begin,
each step's boundary work, the commitment) over a plain phase; a check's time as a fraction of a phase;
the compute the swarm spends at check rate r (time in the recorder + r x check), at each ``--rates`` and
at `swarm.config.WorkConfig`'s defaults (``check_rate`` while a prover is on probation, ``trusted_rate``
once its verifier passed ``trust_after`` of its checks); the memory the boundaries hold; and the chance a
peer that never trains is caught within 5 rounds, 1 - (1 - r)^5.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from averaging.config import AveragingConfig
from averaging.group import part_digest, slice_bounds
from benchmarks._common import run_metadata, save_result
from bootstrap.identity import Identity
from swarm import verify
from swarm.config import TaskInfo, WorkConfig
from swarm.recipe import inner_step
from swarm.tasks import get_task

RESULTS = Path(__file__).parent / "results" / "verify_cost_sync10.json"


def _phase(task, model, optimizer, batches, steps: int, step: int, recorder=None, params=None) -> tuple[int, float]:
    """``steps`` inner steps; returns the step reached and the seconds spent inside the recorder."""
    in_recorder = 0.0
    for _ in range(steps):
        task.loss(model, next(batches)).backward()
        step += 1
        inner_step(optimizer, step, 0)
        if recorder is not None:
            started = time.perf_counter()
            recorder.stepped(params, optimizer)
            in_recorder += time.perf_counter() - started
    return step, in_recorder


def measure(
    task, info: TaskInfo, *, steps: int, segment_steps: int, phases: int, stream_offset: int = 0, group_size: int = 2
) -> dict:
    identity = Identity.generate()
    model = task.build_model(seed=0)
    params = verify.trainable(model)
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    recorder = verify.WorkRecorder(
        task, peer=identity.peer_id, shard_index=0, num_shards=4, segment_steps=segment_steps
    )
    batches, step = recorder.batches(), 0
    for _ in range(stream_offset):
        next(batches)
    step, _ = _phase(task, model, optimizer, batches, steps, step)  # warm-up: allocator, optimizer state
    plain, recorded, in_recorder, checks, signed, binding = [], [], [], [], [], []
    averaging = AveragingConfig()
    for round_ in range(phases):
        started = time.perf_counter()
        step, _ = _phase(task, model, optimizer, batches, steps, step)
        plain.append(time.perf_counter() - started)
        base = verify.flat_params(params)
        started = time.perf_counter()
        recorder.begin(params, optimizer, first_step=step + 1)
        begun = time.perf_counter()
        step, stepped_s = _phase(task, model, optimizer, batches, steps, step, recorder, params)
        committing = time.perf_counter()
        commitment = recorder.commit(
            params, optimizer, base=base, identity=identity, run="bench", round_=round_,
            task_digest=info.config_digest, samples=steps, warmup_steps=0,
        )  # fmt: skip
        recorded.append(time.perf_counter() - started)
        in_recorder.append(begun - started + stepped_s + time.perf_counter() - committing)
        signed.append((round_, base, commitment.commitment))
    streams = verify.Streams(task)
    for round_, base, commitment in signed:
        for segment in range(commitment.segments):
            started = time.perf_counter()
            inputs = verify.ReplayInputs.from_bytes(recorder.inputs(round_, segment).to_bytes())
            ok, reason, _ = verify.check(
                task, info.config_digest, commitment, segment, inputs, base=base, streams=streams
            )
            if not ok:
                raise SystemExit(f"an honest segment failed its check: {reason}")
            bound = time.perf_counter()  # the binding: the verifier's slice of the committed update, as sent
            lo, hi = slice_bounds(base.numel(), group_size)[0]
            part_digest((base - inputs.end_params)[lo:hi], averaging.codec, averaging.piece_numel)
            checks.append(time.perf_counter() - started)
            binding.append(time.perf_counter() - bound)
    phase_s, recorded_s, check_s = statistics.median(plain), statistics.median(recorded), statistics.median(checks)
    record_s = statistics.median(in_recorder)
    state_bytes = sum(p.numel() for p in params) * 4 * 3  # parameters + AdamW's two moments, fp32
    return {
        "segment_steps": segment_steps,
        "phase_s": phase_s,
        "recorded_phase_s": recorded_s,
        "record_overhead": recorded_s / phase_s - 1,
        "record_s": record_s,
        "record_fraction": record_s / phase_s,
        "check_s": check_s,
        "check_fraction": check_s / phase_s,
        "slowest_check_s": max(checks),
        "binding_s": statistics.median(binding),
        "checks": len(checks),
        "boundary_memory_mb": (-(-steps // segment_steps) + 1) * state_bytes / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.verify_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=10, help="inner steps per phase (sync_every)")
    parser.add_argument("--segments", type=int, nargs="+", default=[1, 2], help="segment lengths to measure")
    parser.add_argument("--phases", type=int, default=8, help="phases per arm")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5])
    parser.add_argument("--stream-offset", type=int, default=0, help="batches of the stream drawn before the phases")
    parser.add_argument("--group-size", type=int, default=2, help="the verifier's slice is 1/group-size of a part")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one core per peer, as on this 2-core machine's swarm runs
    task = get_task(args.task, preset=args.preset)
    info = TaskInfo.of(task, args.preset)
    extra = {"stream_offset": args.stream_offset, "group_size": args.group_size}
    rows = [measure(task, info, steps=args.steps, segment_steps=m, phases=args.phases, **extra) for m in args.segments]
    defaults = WorkConfig()
    rates = sorted({*args.rates, defaults.check_rate, defaults.trusted_rate})
    table = Table(title=f"verified work: {args.task} {args.preset}, {args.steps} steps a phase")
    names = (
        "segment", "phase s", "recorded s", "recorded / plain - 1", "in recorder", "check s", "of it binding ms",
        "slowest", "check / phase",
    )  # fmt: skip
    for name in names:
        table.add_column(name, justify="right")
    for r in rates:
        role = {defaults.check_rate: " (probation)", defaults.trusted_rate: " (trusted)"}.get(r, "")
        table.add_column(f"cost at r={r}{role}", justify="right")
    table.add_column("boundaries MB", justify="right")
    for row in rows:
        costs = {str(r): row["record_fraction"] + r * row["check_fraction"] for r in rates}
        row["cost_at_rate"] = costs
        table.add_row(
            str(row["segment_steps"]),
            f"{row['phase_s']:.2f}",
            f"{row['recorded_phase_s']:.2f}",
            f"{row['record_overhead']:+.1%}",
            f"{row['record_fraction']:.1%}",
            f"{row['check_s']:.3f}",
            f"{1e3 * row['binding_s']:.1f}",
            f"{row['slowest_check_s']:.3f}",
            f"{row['check_fraction']:.1%}",
            *[f"{costs[str(r)]:.1%}" for r in rates],
            f"{row['boundary_memory_mb']:.0f}",
        )
    console = Console(width=max(Console().width, 160))
    console.print(table)
    caught = {str(r): 1 - (1 - r) ** 5 for r in rates}
    console.print(
        "a peer that never trains, caught within 5 rounds: " + ", ".join(f"r={r}: {p:.3f}" for r, p in caught.items())
    )
    result = run_metadata("verify_cost", argv if argv is not None else sys.argv[1:], task=args.task, preset=args.preset)
    result.update(
        steps=args.steps,
        stream_offset=args.stream_offset,
        defaults={
            "check_rate": defaults.check_rate,
            "trusted_rate": defaults.trusted_rate,
            "trust_after": defaults.trust_after,
        },
        rows=rows,
        caught_within_5_rounds=caught,
    )
    console.print(f"wrote {save_result(args.out, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
