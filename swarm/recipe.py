"""The training recipe's defaults, and the rule they come from (the evidence: benchmarks/README.md, section 2b).

Swarm trains DiLoCo-style: ``sync_every`` inner steps, then an outer Nesterov-SGD step on the group's
averaged pseudo-gradient. Published outer settings (DiLoCo's lr 0.7 / momentum 0.9) were tuned for
hundreds of inner steps, usually from a pretrained model; at the 10-50 inner steps our users run,
from scratch, their momentum adds up each round's drift and the loss stalls or climbs (measured:
charlm tiny at H=15, 1.74x data parallelism's validation loss; a user's MLP diverged). Two things
close the gap, both measured by ``python -m benchmarks.recipe_sweep`` against synchronous data
parallelism at equal samples, on two kinds of model (charlm, a transformer; teacher, an MLP):

* an inner learning-rate warm-up (:data:`INNER_WARMUP_STEPS`, linear): a fresh AdamW takes steps
  of about its full learning rate from the first step, and replicas that start with large steps
  from scratch walk apart before their first average (the largest single gain: 1.40 -> 1.27 at
  H=15 on charlm, data parallelism 1.21);
* outer settings that follow the sync interval (:func:`outer_settings`): a light Nesterov step
  at small H, plain averaging from H=40, DiLoCo's setting only in its own regime (H >= 300).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

DEFAULT_SYNC_EVERY = 10
"""Default sync interval H: the smallest whose bytes per sample stay 25x under fp32 data parallelism's on
charlm tiny (measured on real peers: 28.6x at H=10), since smaller intervals train better at equal samples."""

INNER_WARMUP_STEPS = 100
"""Default linear warm-up of the inner learning rate, in a peer's local steps (50 and 200 did worse)."""


@dataclass(frozen=True, slots=True)
class OuterSettings:
    """Learning rate and (Nesterov) momentum of the outer SGD step."""

    lr: float
    momentum: float


def outer_settings(sync_every: int) -> OuterSettings:
    """The default outer step for a sync interval (the documented rule; see the module docstring).

    * ``sync_every < 40``: Nesterov lr 0.5, momentum 0.5: the best row at H=10, 15 and 30 on both
      tasks (with the inner warm-up), 0.2-0.7% better than plain averaging;
    * ``40 <= sync_every < 300``: plain averaging (lr 1, momentum 0): the best at H=50 (charlm) and
      H=100 (both tasks), 0.8-1.5% better than Nesterov 0.5 / 0.5;
    * ``sync_every >= 300``: DiLoCo's Nesterov lr 0.7, momentum 0.9, its published setting at H=500
      (not measured here). DiLoCo's setting was the worst row at every H we measured (<= 100).
    """
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every!r}")
    if sync_every < 40:
        return OuterSettings(lr=0.5, momentum=0.5)
    if sync_every < 300:
        return OuterSettings(lr=1.0, momentum=0.0)
    return OuterSettings(lr=0.7, momentum=0.9)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The factor on the inner learning rate for local step ``step`` (1-based): ``min(1, step / warmup)``."""
    return min(1.0, step / warmup_steps) if warmup_steps > 0 else 1.0


def step_with_lr_factor(optimizer: torch.optim.Optimizer | ScaledStep, factor: float) -> None:
    """``optimizer.step()`` with every group's learning rate scaled by ``factor`` for this step only: the
    learning rates are restored afterwards, so a user's own scheduler keeps working on its own values."""
    if factor >= 1.0:
        optimizer.step()
        return
    groups = optimizer.param_groups
    saved = [group["lr"] for group in groups]
    for group, lr in zip(groups, saved):
        group["lr"] = lr * factor
    try:
        optimizer.step()
    finally:
        for group, lr in zip(groups, saved):
            group["lr"] = lr


class ScaledStep:
    """An inner optimizer stepped through a `torch.amp.GradScaler`, for fp16 mixed precision: pass
    ``swarm.ScaledStep(optimizer, scaler)`` to `swarm.Trainer` in the optimizer's place, and backpropagate
    ``scaler.scale(loss)``. Each `Trainer.step` then unscales the gradients, skips the optimizer's step when one
    of them is inf or NaN, and updates the scale (``scaler.step``, ``scaler.update``), as a torch AMP loop does;
    the plain optimizer would apply the gradients still multiplied by the scale (2^16 at first). To clip
    gradients, call ``scaler.unscale_(optimizer)`` and clip before ``trainer.step``. The learning rates are the
    optimizer's own (``param_groups`` is its list: a scheduler of the optimizer keeps working)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
        self.optimizer, self.scaler = optimizer, scaler

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def step(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


Precision = Literal["auto", "fp32", "bf16", "fp16"]
"""Mixed-precision choices of `autocast_dtype` (``swarm.peer --precision``)."""
PRECISIONS: tuple[str, ...] = get_args(Precision)
DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The autocast dtype of each explicit precision (None: fp32, no autocast)."""


def autocast_dtype(precision: Precision, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``precision`` on ``device``; None: fp32, no autocast. ``auto`` picks what the device
    computes natively: bf16 on CUDA GPUs of compute capability 8.0 and up (and on ROCm); fp16 on 7.x (Volta and
    Turing: V100, T4, RTX 20xx), whose tensor cores compute fp16, not bf16 (torch runs bf16 there emulated),
    trained with a loss scaler (`ScaledStep`); fp32 on older GPUs (no tensor cores) and on a CPU."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision != "auto":
        return DTYPES[precision]
    if device.type != "cuda":
        return None
    if torch.version.hip:
        return torch.bfloat16
    major, _ = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16 if major >= 7 else None


def inner_step(optimizer: torch.optim.Optimizer | ScaledStep, step: int, warmup_steps: int) -> None:
    """Local step ``step`` (1-based) of the inner loop: the optimizer step under the warm-up factor, then
    ``zero_grad``. The one definition shared by `swarm.Trainer.step` and the other ranks of a node."""
    step_with_lr_factor(optimizer, warmup_factor(step, warmup_steps))
    optimizer.zero_grad(set_to_none=True)
