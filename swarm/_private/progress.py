"""The live progress line on a terminal (rich): step, loss, samples/s, round, group, validation loss.

One line under the log records (rich moves them above it), refreshed from the training thread at most
every ``refresh_s`` (no thread of its own), gone when the peer leaves. Off unless stderr is a terminal,
so logs written to a file or a pipe stay plain lines.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from bootstrap.cli import stderr_console


class ProgressLine:
    def __init__(self, console: Console, *, refresh_s: float = 0.25):
        columns = (SpinnerColumn(), TextColumn("{task.fields[line]}"), TimeElapsedColumn())
        # print() goes above the line when stdout is this terminal too; stdout to a file or a pipe stays there
        own_stdout = sys.stdout is not None and sys.stdout.isatty()
        self._progress = Progress(
            *columns, console=console, auto_refresh=False, transient=True, redirect_stdout=own_stdout
        )
        self._task: Any = None
        self._refresh_s, self._shown_at = refresh_s, -float("inf")

    @classmethod
    def open(cls, enabled: bool, console: Console | None = None) -> ProgressLine | None:
        """A progress line on ``console`` (default: stderr), or None when off or not a terminal."""
        console = console if console is not None else stderr_console()
        return cls(console) if enabled and console.is_terminal else None

    def update(self, **fields: Any) -> None:
        """Show ``fields`` (step, loss, samples_per_s, round, group, val_loss, in_flight): the first at once,
        then at most every ``refresh_s``, so a fast loop pays nothing for it."""
        now = time.monotonic()
        if now - self._shown_at < self._refresh_s:
            return
        self._shown_at = now
        if self._task is None:
            self._progress.start()
            self._task = self._progress.add_task("train", total=None, line="")
        self._progress.update(self._task, line=line(**fields))
        self._progress.refresh()

    def close(self) -> None:
        if self._task is not None:
            self._task = None
            self._progress.stop()


def line(
    *,
    step: int,
    loss: float | None,
    samples_per_s: float,
    round: int,
    group: int | None,
    val_loss: float | None,
    in_flight: bool = False,
) -> str:
    """The progress line's text, e.g. ``step 120  loss 2.310  812.4 samples/s  round 6  group 3  val 2.402``."""
    flight = " (next in flight)" if in_flight else ""
    return (
        f"step {step}  loss {_num(loss)}  {samples_per_s:.1f} samples/s  round {round}{flight}  "
        f"group {group if group else '-'}  val {_num(val_loss)}"
    )


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
