"""`teacher`: an MLP classifier learning a fixed random teacher network, on data generated from a seed.

Nothing is downloaded: the inputs are a mixture of Gaussian clusters in ``input_dim`` dimensions and
each label is drawn from the softmax of a fixed random teacher MLP (``temperature`` sets the label
noise, so the best possible loss is above zero and a long run can overfit its finite pool). The
training pool (``train_size`` examples) is sorted by cluster before it is cut into contiguous shards,
so each shard sees a few clusters only: the shards are non-IID, as volunteers' own data would be.
The validation set is a separate draw from the whole mixture, identical in every process.

The student is an MLP (``hidden`` units x ``num_layers``, GELU) trained with cross-entropy; it is a
different kind of model from charlm (no attention, no embeddings), so a recipe tuned on one is
checked on the other.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from swarm.tasks.charlm import _require_fraction, _require_int, config_from_preset, evaluate_batches

Batch = tuple[Tensor, Tensor]
"""``(inputs, labels)``: a float32 ``[batch_size, input_dim]`` tensor and a LongTensor ``[batch_size]``."""

_MAX_SEED = 2**63 - 1
_VAL_BATCH = 512
"""Examples per validation batch: 4 batches (swarm.peer's --eval-batches default) cover 2048 examples."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TeacherConfig:
    """Shape of the teacher data set and of the student MLP; every peer of a run must use the same one."""

    input_dim: int = 32
    """Input features."""
    num_classes: int = 10
    """Output classes."""
    num_clusters: int = 16
    """Gaussian clusters of the input mixture; the sorted pool gives each shard a few of them."""
    cluster_spread: float = 1.5
    """Standard deviation of the cluster centres (each cluster has unit variance)."""
    teacher_hidden: int = 64
    """Hidden width of the (fixed, random) teacher MLP that labels the data."""
    temperature: float = 0.5
    """Softmax temperature of the teacher's labels: lower is less label noise."""
    train_size: int = 50_000
    """Examples in the training pool (all shards together)."""
    val_size: int = 2048
    """Examples in the fixed validation set."""
    hidden: int = 128
    """Hidden width of the student MLP."""
    num_layers: int = 2
    """Hidden layers of the student MLP."""
    batch_size: int = 32
    """Examples per batch, for training and validation alike."""
    data_seed: int = 0
    """Seed of the data set (clusters, teacher, pool, validation set)."""
    seed: int = 0
    """Seed of the student's initial weights, used by build_model when it is given no seed."""

    def __post_init__(self) -> None:
        for name in (
            "input_dim",
            "num_classes",
            "num_clusters",
            "teacher_hidden",
            "hidden",
            "num_layers",
            "batch_size",
        ):
            _require_int(name, getattr(self, name), minimum=1, maximum=1 << 16)
        _require_int("num_classes", self.num_classes, minimum=2, maximum=1 << 16)
        _require_int("train_size", self.train_size, minimum=1, maximum=1 << 24)
        _require_int("val_size", self.val_size, minimum=1, maximum=1 << 20)
        for name in ("data_seed", "seed"):
            _require_int(name, getattr(self, name), minimum=0, maximum=_MAX_SEED)
        _require_fraction("cluster_spread", self.cluster_spread, low=0.0, high=100.0, high_inclusive=True)
        _require_fraction("temperature", self.temperature, low=1e-3, high=100.0, high_inclusive=True)

    @classmethod
    def preset(cls, name: str = "default", **overrides: Any) -> TeacherConfig:
        """The named preset (see TEACHER_PRESETS) with ``overrides`` applied; bad names or values raise ValueError."""
        return config_from_preset(TEACHER_PRESETS, task="teacher", name=name, overrides=overrides)


TEACHER_PRESETS: dict[str, TeacherConfig] = {
    # ~22k parameters: hundreds of steps per second on one CPU thread; tests and benchmarks.
    "tiny": TeacherConfig(hidden=128, num_layers=2, batch_size=32),
    # ~0.3M parameters.
    "default": TeacherConfig(hidden=512, num_layers=2, batch_size=64, train_size=200_000),
}


def _generator(seed: int, what: str) -> torch.Generator:
    digest = hashlib.blake2b(f"teacher:{seed}:{what}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & _MAX_SEED)


@functools.cache
def _data(config: TeacherConfig) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(train inputs sorted by cluster, train labels, val inputs, val labels), from config.data_seed only."""
    c = config
    gen = _generator(c.data_seed, "world")
    centres = torch.randn(c.num_clusters, c.input_dim, generator=gen) * c.cluster_spread
    w1 = torch.randn(c.input_dim, c.teacher_hidden, generator=gen) / c.input_dim**0.5
    w2 = torch.randn(c.teacher_hidden, c.num_classes, generator=gen) * (2.0 / c.teacher_hidden**0.5)

    def draw(n: int, what: str, *, sort: bool) -> tuple[Tensor, Tensor]:
        g = _generator(c.data_seed, what)
        cluster = torch.randint(0, c.num_clusters, (n,), generator=g)
        if sort:
            cluster, _ = torch.sort(cluster)
        x = centres[cluster] + torch.randn(n, c.input_dim, generator=g)
        x = x / (1.0 + c.cluster_spread**2) ** 0.5  # about unit variance per feature
        logits = torch.tanh(x @ w1) @ w2
        y = torch.multinomial(torch.softmax(logits / c.temperature, dim=1), 1, generator=g).squeeze(1)
        return x.contiguous(), y

    train_x, train_y = draw(c.train_size, "train", sort=True)
    val_x, val_y = draw(c.val_size, "val", sort=False)
    return train_x, train_y, val_x, val_y


class TeacherMLP(nn.Module):
    """Student MLP: ``num_layers`` hidden layers of ``hidden`` GELU units, then a linear classifier."""

    def __init__(self, config: TeacherConfig) -> None:
        super().__init__()
        widths = [config.input_dim] + [config.hidden] * config.num_layers
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.out = nn.Linear(widths[-1], config.num_classes)
        self.input_dim = config.input_dim

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 2 or x.size(1) != self.input_dim:
            raise ValueError(f"expected inputs of shape [B, {self.input_dim}], got {tuple(x.shape)}")
        for layer in self.hidden:
            x = F.gelu(layer(x))
        return self.out(x)


class TeacherTask:
    """The ``teacher`` task: model factory, sharded training stream and fixed validation set for one config."""

    name = "teacher"
    random_in_training = False
    """A training step draws no random numbers (see `swarm.replayer`)."""

    def __init__(self, config: TeacherConfig | None = None) -> None:
        self.config = TEACHER_PRESETS["default"] if config is None else config
        if not isinstance(self.config, TeacherConfig):
            raise TypeError(f"config must be a TeacherConfig, got {type(self.config).__name__}")
        self._val_batches: list[Batch] | None = None

    @classmethod
    def from_overrides(cls, preset: str = "default", **overrides: Any) -> TeacherTask:
        """The task for ``TeacherConfig.preset(preset, **overrides)``."""
        return cls(TeacherConfig.preset(preset, **overrides))

    def config_dict(self) -> dict[str, Any]:
        """JSON-able description of everything that shapes the model and data."""
        return {"task": self.name, "config": dataclasses.asdict(self.config), "data": "generated (v1)"}

    def build_model(self, *, seed: int | None = None) -> TeacherMLP:
        """A fresh CPU model whose weights depend only on the config and ``seed`` (default config.seed);
        the global RNG is left as it was."""
        seed = self.config.seed if seed is None else seed
        _require_int("seed", seed, minimum=0, maximum=_MAX_SEED)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return TeacherMLP(self.config)

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """Mean cross-entropy of ``model`` on ``batch``, computed on the model's device."""
        device = next(model.parameters()).device
        inputs, labels = (t.to(device) for t in batch)
        return F.cross_entropy(model(inputs), labels)

    def shard_bounds(self, shard_index: int, num_shards: int) -> tuple[int, int]:
        """Example indices ``[start, end)`` of one of ``num_shards`` contiguous, disjoint shards of the pool."""
        _require_int("num_shards", num_shards, minimum=1, maximum=self.config.train_size)
        _require_int("shard_index", shard_index, minimum=0, maximum=num_shards - 1)
        size = self.config.train_size
        return size * shard_index // num_shards, size * (shard_index + 1) // num_shards

    def train_batches(self, *, shard_index: int, num_shards: int, seed: int = 0) -> Iterator[Batch]:
        """Endless deterministic batches drawn only from shard ``shard_index`` of ``num_shards``."""
        start, end = self.shard_bounds(shard_index, num_shards)
        _require_int("seed", seed, minimum=0, maximum=_MAX_SEED)
        x, y, _, _ = _data(self.config)
        generator = _generator(seed, f"shard:{shard_index}:{num_shards}")

        def stream() -> Iterator[Batch]:
            while True:
                index = torch.randint(start, end, (self.config.batch_size,), generator=generator)
                yield x[index], y[index]

        return stream()

    def val_batches(self) -> list[Batch]:
        """The fixed validation set as CPU batches (the last may be short); identical in every process."""
        if self._val_batches is None:
            _, _, x, y = _data(self.config)
            size = _VAL_BATCH
            self._val_batches = [(x[i : i + size], y[i : i + size]) for i in range(0, x.size(0), size)]
        return list(self._val_batches)

    def evaluate(self, model: nn.Module, *, max_batches: int | None = None) -> float:
        """Mean validation cross-entropy over the first ``max_batches`` batches (all by default); the
        model's train/eval mode is restored."""
        return evaluate_batches(model, self.val_batches(), max_batches, _mean_loss)


def _mean_loss(model: nn.Module, batches: list[Batch]) -> float:
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for inputs, labels in batches:
        logits = model(inputs.to(device))
        total += F.cross_entropy(logits.float(), labels.to(device), reduction="sum").item()
        count += labels.numel()
    return total / count
