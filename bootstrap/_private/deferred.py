"""Modules hivemind imports at start-up that no Swarm process uses, deferred to their first use.

hivemind's package ``__init__`` imports its whole averaging stack, and with it ``scipy.optimize`` (the load
balancing of ``DecentralizedAverager``, which Swarm does not use): about a quarter of a second of every Swarm
process's start here (``python -X importtime -c "import swarm.peer"``: 0.24-0.27 s of hivemind's 0.45 s).
Each such module is registered, before hivemind is imported, as a stand-in that imports the real module on
the first attribute it is asked for other than its ``__spec__`` and ``__file__`` (what the import statement
and `inspect.getmodule`, which torch calls at import, read of every module), and from then on forwards to
it; importing a submodule of it reads ``__path__``, so that loads it too. `importlib.util.LazyLoader` does
not do here: the import statement's own read of ``__spec__`` loads such a module.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

DEFERRED = ("scipy.optimize",)


class _Deferred(types.ModuleType):
    """Stands in for a module until an attribute of it is read: then the real one is imported, replaces this one
    in `sys.modules` and on its package, and answers (for this and every later read through a stale
    reference)."""

    def __getattr__(self, attr: str) -> Any:  # only for attributes not set on the stand-in itself
        return getattr(self._real(), attr)

    def __dir__(self) -> list[str]:  # `dir`, `help` and `inspect.getmembers` of a stale reference see the real one
        return dir(self._real())

    def _real(self) -> types.ModuleType:
        real = self.__dict__.get("_deferred_real")
        if real is None:
            name = self.__name__
            if sys.modules.get(name) is self:
                del sys.modules[name]
            real = importlib.import_module(name)
            self.__dict__["_deferred_real"] = real
            parent, _, child = name.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, real)
        return real


def defer_unused_imports(names: tuple[str, ...] = DEFERRED) -> list[str]:
    """Registers a stand-in for each of ``names`` (``package.module``, the package a top-level one) not imported
    yet; returns those it registered. A module that is missing, or already imported, is left as it is. Nothing
    is imported: the module is found on its package's path, so the watchdog (`bootstrap.lifetime`) still
    imports psutil only."""
    deferred = []
    for name in names:
        parent, _, child = name.rpartition(".")
        if name in sys.modules or not parent or "." in parent:
            continue
        try:  # a top-level package's spec is found without importing it
            package = sys.modules[parent].__spec__ if parent in sys.modules else importlib.util.find_spec(parent)
            locations = package.submodule_search_locations if package is not None else None
            spec = importlib.machinery.PathFinder.find_spec(name, locations) if locations else None
        except (ImportError, ValueError, AttributeError):
            continue
        if spec is None:
            continue
        stand_in = _Deferred(name)
        stand_in.__spec__, stand_in.__file__ = spec, spec.origin  # what `inspect.getmodule` reads of every module
        sys.modules[name] = stand_in
        if parent in sys.modules:  # what an import of the submodule sets on its package (scipy's own
            # `__getattr__` answers with `sys.modules`' entry when the package comes later)
            setattr(sys.modules[parent], child, stand_in)
        deferred.append(name)
    return deferred
