"""The table of built-in tasks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bootstrap.errors import ConfigError
from swarm.tasks.charlm import CharLMTask
from swarm.tasks.teacher import TeacherTask

if TYPE_CHECKING:
    from swarm.tasks import Task

_FACTORIES: dict[str, Callable[..., Task]] = {
    "charlm": CharLMTask.from_overrides,
    "teacher": TeacherTask.from_overrides,
}


class UnknownTaskError(ConfigError):
    """A task name that is not in the built-in registry; the message lists the known tasks."""


def known_tasks() -> list[str]:
    """Names of the built-in tasks, sorted."""
    return sorted(_FACTORIES)


def get_task(name: str, **overrides: Any) -> Task:
    """The built-in task `name`, configured by `overrides` (e.g. `preset="tiny"`, `d_model=64`).

    Raises UnknownTaskError for a name outside the registry and ValueError for a bad override.
    """
    factory = _FACTORIES.get(name) if isinstance(name, str) else None
    if factory is None:
        raise UnknownTaskError(f"unknown task {name!r}; known tasks: {', '.join(known_tasks())}")
    return factory(**overrides)
