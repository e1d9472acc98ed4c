"""Training tasks: the model, data and loss a swarm trains, built in or from an installed package.

Owns the task interface (`Task`), the registry (`known_tasks`, `get_task`: built-in names, entry points
of installed packages in the ``swarm.tasks`` group, or ``package.module:factory``) and the built-in
tasks: `charlm` (a small character-level transformer over the CPython help text) and `teacher` (an MLP
classifier on a non-IID synthetic data set labelled by a random teacher). A run names its task; the
code always comes from this machine's installation and never from the network.

Depends on torch and on `pydoc_data` from the standard library (the charlm corpus); nothing else
in swarm. Exports: Task, Batch, get_task, known_tasks, UnknownTaskError, num_params, CharLMConfig,
CharLMTask, PRESETS, TeacherConfig, TeacherTask, TEACHER_PRESETS.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

from swarm.tasks._registry import UnknownTaskError, get_task, known_tasks
from swarm.tasks.charlm import PRESETS, Batch, CharLMConfig, CharLMTask
from swarm.tasks.teacher import TEACHER_PRESETS, TeacherConfig, TeacherTask

__all__ = [
    "PRESETS",
    "TEACHER_PRESETS",
    "Batch",
    "CharLMConfig",
    "CharLMTask",
    "Task",
    "TeacherConfig",
    "TeacherTask",
    "UnknownTaskError",
    "get_task",
    "known_tasks",
    "num_params",
]


@runtime_checkable
class Task(Protocol):
    """What the swarm needs from a task. Every peer of a run builds the same task from the same config."""

    name: str
    """Registry name of the task."""
    config: Any
    """The task's frozen config dataclass."""

    def config_dict(self) -> dict[str, Any]:
        """JSON-able description of the task and its config; equal dicts mean interchangeable models."""
        ...

    def build_model(self, *, seed: int | None = None) -> nn.Module:
        """A fresh CPU model; the same seed (default: the config's) gives identical weights everywhere."""
        ...

    def train_batches(self, *, shard_index: int, num_shards: int, seed: int = 0) -> Iterator[Batch]:
        """Endless deterministic CPU batches from shard `shard_index` of `num_shards` of the training split."""
        ...

    def loss(self, model: nn.Module, batch: Batch) -> Tensor:
        """Scalar training loss of `model` on `batch`, on the model's device."""
        ...

    def val_batches(self) -> list[Batch]:
        """The fixed validation set, disjoint from every training shard and identical in every process."""
        ...

    def evaluate(self, model: nn.Module, *, max_batches: int | None = None) -> float:
        """Mean validation loss without gradients; the model's train/eval mode is restored."""
        ...

    # Optional: ``random_in_training: bool``, whether a training step draws random numbers (dropout). Verified
    # work replays such a task's segments in a process of their own (`swarm.replayer`), as it does a task
    # that does not say.


def num_params(model: nn.Module) -> int:
    """Number of distinct parameters' elements (a tied weight counts once)."""
    return sum(parameter.numel() for parameter in model.parameters())
