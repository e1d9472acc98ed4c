"""The table of built-in tasks, and tasks from installed packages.

A task is named by one of: a built-in name (`charlm`, `teacher`); the name of an entry point in the
``swarm.tasks`` group of an installed distribution (``[project.entry-points."swarm.tasks"]`` in its
pyproject.toml, e.g. ``mlp = "my_pkg.tasks:MLPTask.from_overrides"``); or ``package.module:factory``,
a module importable from this installation. Code always comes from the local installation, never from
the network: a run's name for its task only selects among what the machine's owner installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bootstrap.errors import ConfigError
from swarm.tasks.charlm import CharLMTask
from swarm.tasks.teacher import TeacherTask

if TYPE_CHECKING:
    from swarm.tasks import Task

ENTRY_POINT_GROUP = "swarm.tasks"
"""The entry-point group an installed package registers its tasks in."""

_FACTORIES: dict[str, Callable[..., Task]] = {
    "charlm": CharLMTask.from_overrides,
    "teacher": TeacherTask.from_overrides,
}
_REFERENCE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_TASK_PARTS = ("name", "config", "config_dict", "build_model", "train_batches", "loss", "val_batches", "evaluate")


class UnknownTaskError(ConfigError):
    """A task name that is not built in, installed or importable; the message lists the known tasks."""


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def known_tasks() -> list[str]:
    """Names of the built-in tasks and of the installed ones (entry points), sorted."""
    return sorted(set(_FACTORIES) | set(_entry_points()))


def _factory(name: str) -> Callable[..., Any]:
    if name in _FACTORIES:
        return _FACTORIES[name]
    installed = _entry_points().get(name)
    try:
        if installed is not None:
            return installed.load()
        if _REFERENCE.match(name):
            module, _, attr = name.partition(":")
            found: Any = importlib.import_module(module)
            for part in attr.split("."):
                found = getattr(found, part)
            return found
    except (ImportError, AttributeError) as e:
        raise UnknownTaskError(f"task {name!r} cannot be loaded from this installation: {e}") from None
    raise UnknownTaskError(
        f"unknown task {name!r}; known tasks: {', '.join(known_tasks())} (or package.module:factory, or an "
        f"installed package's entry point in the {ENTRY_POINT_GROUP!r} group)"
    )


def get_task(name: str, **overrides: Any) -> Task:
    """The task `name` (built in, installed or ``package.module:factory``), configured by `overrides`
    (e.g. `preset="tiny"`, `d_model=64`).

    Raises UnknownTaskError for a name that names no task, ConfigError for a factory whose result is not
    a task, and ValueError for a bad override.
    """
    if not isinstance(name, str):
        raise UnknownTaskError(f"unknown task {name!r}; known tasks: {', '.join(known_tasks())}")
    task = _factory(name)(**overrides)
    missing = [part for part in _TASK_PARTS if not hasattr(task, part)]
    if missing:
        raise ConfigError(f"task {name!r} made a {type(task).__name__}, not a task: it has no {', '.join(missing)}")
    return task
