"""What every benchmark's JSON carries about the run that produced it."""

from __future__ import annotations

import os
import platform
import shlex
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any


def run_metadata(name: str, argv: list[str] | None, **extra: Any) -> dict[str, Any]:
    """Benchmark name, date, machine, versions and the exact command (``python -m benchmarks.NAME ...``)."""
    import hivemind
    import torch

    return {"benchmark": name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "hivemind": hivemind.__version__, **extra,
            "command": shlex.join([sys.executable, "-m", f"benchmarks.{name}",
                                   *(sys.argv[1:] if argv is None else argv)])}


def make_lab(kind: str, *, rate_mbit: float, num_hosts: int, console: Any) -> tuple[Any, str | None]:
    """The lab to run on (kind: auto, netns or loopback), and why it is loopback when auto found no
    shaped test hosts (None otherwise). ``rate_mbit`` 0 leaves netns links unshaped."""
    from benchmarks import netlab

    if kind == "loopback":
        return netlab.loopback_lab(num_hosts), None
    try:
        return netlab.netns_lab(num_hosts, rate_mbit=rate_mbit or None), None
    except netlab.LabUnavailable as e:
        if kind == "netns":
            raise
        console.print(f"[yellow]no shaped test hosts ({e}); running on loopback[/]")
        return netlab.loopback_lab(num_hosts), str(e)


@contextmanager
def signals_unwind() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl+C, so every finally block (and the lab's close) runs."""
    def handler(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
