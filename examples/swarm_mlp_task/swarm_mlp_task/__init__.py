"""A user's own task for Swarm: a small MLP regressor on a synthetic, deterministic data set.

Install this folder (``pip install -e examples/swarm_mlp_task``) and every peer can train it:
``python -m swarm.peer --task mlp --task-preset tiny ...``. A task is any object with the members
of `swarm.tasks.Task`; the factory named by the entry point takes ``preset`` and overrides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class MLPConfig:
    inputs: int = 16
    hidden: int = 64
    batch_size: int = 32
    noise: float = 0.1
    data_seed: int = 0
    seed: int = 0


PRESETS = {"tiny": MLPConfig(hidden=32), "default": MLPConfig()}


class MLPTask:
    """y = sin(x . w) + noise, x ~ N(0, I); shard i of n draws from its own seeded stream."""

    name = "mlp"

    def __init__(self, config: MLPConfig) -> None:
        self.config = config
        generator = torch.Generator().manual_seed(config.data_seed)
        self._w = torch.randn(config.inputs, generator=generator)
        self._val = [self._batch(torch.Generator().manual_seed(10_000 + i)) for i in range(4)]

    @classmethod
    def from_overrides(cls, preset: str = "default", **overrides: Any) -> MLPTask:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
        return cls(dataclasses.replace(PRESETS[preset], **overrides))

    def config_dict(self) -> dict[str, Any]:
        return {"task": self.name, "config": dataclasses.asdict(self.config)}

    def build_model(self, *, seed: int | None = None) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed if seed is None else seed)
            c = self.config
            return nn.Sequential(nn.Linear(c.inputs, c.hidden), nn.Tanh(), nn.Linear(c.hidden, 1))

    def _batch(self, generator: torch.Generator) -> Batch:
        c = self.config
        x = torch.randn(c.batch_size, c.inputs, generator=generator)
        y = torch.sin(x @ self._w) + c.noise * torch.randn(c.batch_size, generator=generator)
        return x, y.unsqueeze(1)

    def train_batches(self, *, shard_index: int, num_shards: int, seed: int = 0) -> Iterator[Batch]:
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
        generator = torch.Generator().manual_seed(1 + seed * 1_000_003 + shard_index * 7919 + num_shards)
        while True:
            yield self._batch(generator)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        device = next(model.parameters()).device
        x, y = (t.to(device) for t in batch)
        return nn.functional.mse_loss(model(x), y)

    def val_batches(self) -> list[Batch]:
        return list(self._val)

    def evaluate(self, model: nn.Module, *, max_batches: int | None = None) -> float:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                batches = self._val[:max_batches] if max_batches else self._val
                return sum(float(self.loss(model, b)) for b in batches) / len(batches)
        finally:
            model.train(was_training)
