"""The CUDA path, checked on a machine with a GPU: bf16 and fp16 autocast, the 8-bit optimizer, a real swarm run.

    python -m benchmarks.gpu_check [--out benchmarks/results] [--swarm-duration-s 60]

1. charlm (``default`` preset, and a ~25M-parameter ``wide`` variant) trained from the same seed for
   the same batches in fp32, under bf16 autocast, and under fp16 autocast stepped through a loss scaler
   (`swarm.ScaledStep`: what ``swarm.peer --precision auto`` picks on a GPU of compute capability 7.x):
   steps/s and the loss reached (both must track fp32). The JSON names what ``auto`` picks on this GPU.
2. Inner optimizer: torch AdamW against bitsandbytes AdamW8bit (bf16 autocast): steps/s, loss reached,
   and optimizer-state bytes.
3. A real run: a bootstrap node and two ``swarm.peer`` processes on this GPU (``--device cuda
   --optimizer adamw8bit``) for ``--swarm-duration-s``: rounds averaged, validation loss first/last.

Prints a table and writes ``gpu_check.json``. Exits 1 when CUDA is missing or a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from swarm.events import read_events
from swarm.recipe import ScaledStep, autocast_dtype
from swarm.tasks import get_task

_INITIAL_PEERS = re.compile(r"--initial-peers\s+(.+)$")
ARMS = (("fp32", "adamw"), ("bf16", "adamw"), ("bf16", "adamw8bit"), ("fp16", "adamw"))
"""(precision, inner optimizer) of each training arm, on each model."""


def _autocast(precision: str) -> contextlib.AbstractContextManager:
    dtype = autocast_dtype(precision, torch.device("cuda"))
    return torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adamw8bit":
        from averaging.compression import import_bitsandbytes  # as swarm.peer imports it

        bnb = import_bitsandbytes()
        return bnb.optim.AdamW8bit(params, lr=3e-3, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def train_once(preset: str, *, precision: str, optimizer: str, steps: int, overrides: dict | None = None) -> dict:
    task = get_task("charlm", preset=preset, **(overrides or {}))
    model = task.build_model(seed=0).cuda()
    opt = _optimizer(optimizer, model.parameters())
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    step = ScaledStep(opt, scaler) if scaler is not None else opt
    batches = task.train_batches(shard_index=0, num_shards=1, seed=0)
    data = [next(batches) for _ in range(steps)]
    losses = []
    for i, (x, y) in enumerate(data):
        if i == 5:  # warm-up done (kernels compiled, allocator primed)
            torch.cuda.synchronize()
            started = time.perf_counter()
        with _autocast(precision):
            loss = task.loss(model, (x.cuda(), y.cuda()))
        (loss if scaler is None else scaler.scale(loss)).backward()
        step.step()
        step.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    with _autocast(precision):
        val = float(task.evaluate(model, max_batches=8))
    tail = torch.stack(losses[-10:]).float().mean().item()
    return {
        "preset": preset,
        "precision": precision,
        "optimizer": optimizer,
        "params": sum(p.numel() for p in model.parameters()),
        "steps_per_s": (steps - 5) / seconds,
        "train_loss_last10": tail,
        "val_loss": val,
        "optimizer_state_bytes": _state_bytes(opt),
        "finite": bool(torch.isfinite(torch.stack(losses)).all()),
    }


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", *args],
        stdout=subprocess.PIPE,
        stderr=open(log, "wb"),  # noqa: SIM115
        stdin=subprocess.DEVNULL,
        env=env,
    )


def swarm_run(duration_s: float, work: Path) -> dict:
    boot = _spawn(
        ["bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", str(work / "boot.id")],
        work / "bootstrap.log",
    )
    procs = [boot]
    try:
        initial = None
        deadline = time.monotonic() + 60
        while initial is None and time.monotonic() < deadline and boot.poll() is None:
            match = _INITIAL_PEERS.search(boot.stdout.readline().decode(errors="replace").strip())
            initial = match.group(1).split() if match else None
        if initial is None:
            return {"ok": False, "error": "bootstrap did not start: " + (work / "bootstrap.log").read_text()[-2000:]}
        for i in range(2):
            procs.append(
                _spawn(
                    [
                        "swarm.peer",
                        "--initial-peers",
                        *initial,
                        "--run",
                        "gpu",
                        "--task-preset",
                        "small",
                        "--device",
                        "cuda",
                        "--optimizer",
                        "adamw8bit",
                        "--host-maddrs",
                        "/ip4/127.0.0.1/tcp/0",
                        "--shard-index",
                        str(i),
                        "--num-shards",
                        "2",
                        "--sync-every",
                        "20",
                        "--target-group-size",
                        "2",
                        "--identity-key",
                        str(work / f"p{i}.key"),
                        "--events",
                        str(work / f"p{i}.jsonl"),
                        "--checkpoint-dir",
                        str(work / "ckpt"),
                        "--duration-s",
                        str(duration_s),
                        "--no-progress",
                        "--ledger-dir",
                        str(work / "ledgers"),
                    ],
                    work / f"p{i}.log",
                )
            )
        for proc in procs[1:]:
            proc.wait(timeout=duration_s + 120)
        return _summarize_swarm(work, [p.returncode for p in procs[1:]])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=20)
            if proc.poll() is None:
                proc.kill()


def _summarize_swarm(work: Path, exit_codes: list[int]) -> dict:
    rounds = [e for i in range(2) for e in read_events(work / f"p{i}.jsonl") if e["event"] == "round"]
    vals = [e["val_loss"] for e in sorted(rounds, key=lambda e: e["t"]) if isinstance(e.get("val_loss"), float)]
    trains = [e for i in range(2) for e in read_events(work / f"p{i}.jsonl") if e["event"] == "train"]
    grouped = sum(1 for e in rounds if e.get("group_size", 1) >= 2)
    out = {
        "exit_codes": exit_codes,
        "rounds": len(rounds),
        "rounds_grouped": grouped,
        "val_loss_first": vals[0] if vals else None,
        "val_loss_last": vals[-1] if vals else None,
        "samples_per_s_median": sorted(e["samples_per_s"] for e in trains)[len(trains) // 2] if trains else None,
    }
    out["ok"] = exit_codes == [0, 0] and grouped >= 2 and bool(vals) and vals[-1] < vals[0]
    if not out["ok"]:
        out["logs"] = {f"p{i}": (work / f"p{i}.log").read_text(errors="replace")[-3000:] for i in range(2)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--swarm-duration-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    console = Console()
    if not torch.cuda.is_available():
        console.print("[red]no CUDA device: this check needs a GPU[/]")
        return 1
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "bf16_supported": torch.cuda.is_bf16_supported(),
        "bf16_native": torch.cuda.is_bf16_supported(including_emulation=False),
        "precision_auto": str(autocast_dtype("auto", torch.device("cuda"))),
        "date": time.strftime("%Y-%m-%d"),
    }
    wide = {"d_model": 768, "num_layers": 4, "num_heads": 12, "seq_len": 256, "batch_size": 64}
    runs = []
    for preset, overrides in (("default", None), ("wide", wide)):
        for precision, opt in ARMS:
            run = train_once("default", precision=precision, optimizer=opt, steps=args.steps, overrides=overrides)
            run["preset"] = preset
            runs.append(run)
    result["training"] = runs
    with tempfile.TemporaryDirectory() as work:
        result["swarm"] = swarm_run(args.swarm_duration_s, Path(work))
    table = Table(title=f"CUDA path on {result['device']} (torch {result['torch']})")
    for col in ("model", "params", "autocast", "optimizer", "steps/s", "train loss", "val loss", "opt state MB"):
        table.add_column(col)
    for r in runs:
        table.add_row(
            r["preset"],
            f"{r['params'] / 1e6:.1f}M",
            r["precision"],
            r["optimizer"],
            f"{r['steps_per_s']:.1f}",
            f"{r['train_loss_last10']:.3f}",
            f"{r['val_loss']:.3f}",
            f"{r['optimizer_state_bytes'] / 1e6:.1f}",
        )
    console.print(table)
    console.print({k: v for k, v in result["swarm"].items() if k != "logs"})
    arm = {(r["preset"], r["precision"], r["optimizer"]): r for r in runs}

    def tracks(arm_a: tuple[str, str], arm_b: tuple[str, str]) -> bool:
        """Val loss of ``arm_b`` within 10% of ``arm_a``'s, on both models."""
        pairs = [(arm[(p, *arm_a)], arm[(p, *arm_b)]) for p in ("default", "wide")]
        return all(abs(b["val_loss"] - a["val_loss"]) <= 0.1 * a["val_loss"] for a, b in pairs)

    checks = {
        "finite": all(r["finite"] for r in runs),
        "bf16 tracks fp32 (val loss within 10%)": tracks(("fp32", "adamw"), ("bf16", "adamw")),
        "fp16 with a loss scaler tracks fp32 (val loss within 10%)": tracks(("fp32", "adamw"), ("fp16", "adamw")),
        "adamw8bit tracks adamw (val loss within 10%)": tracks(("bf16", "adamw"), ("bf16", "adamw8bit")),
        "swarm run on CUDA": bool(result["swarm"].get("ok")),
    }
    result["checks"] = checks
    console.print(checks)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(result, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
