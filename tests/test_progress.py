"""The trainer's live progress line: shown on a terminal only, throttled, gone when the peer leaves."""

from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from swarm._private.evidence import Evidence
from swarm._private.progress import ProgressLine, line


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=160), out


def test_the_line_is_shown_on_a_terminal_only() -> None:
    terminal, _ = _terminal()
    assert ProgressLine.open(True, Console(file=io.StringIO())) is None  # a file or a pipe: plain log lines only
    assert ProgressLine.open(False, terminal) is None  # --no-progress
    assert isinstance(ProgressLine.open(True, terminal), ProgressLine)


def test_evidence_drives_the_line_from_the_trainers_figures_and_throttles_it() -> None:
    terminal, out = _terminal()
    shown = ProgressLine(terminal, refresh_s=3600.0)
    evidence = Evidence(progress=shown)
    evidence.last_group = {"members": ["a", "b", "c"]}
    book = SimpleNamespace(samples_since_sync=64, last_sync_end=0.0, last_loss=2.3101, shown_val_loss=float("nan"))
    evidence.step(120, 8, book, round=6, in_flight=True)
    first = out.getvalue()
    assert "step 120  loss 2.310" in first and "round 6 (next in flight)  group 3  val -" in first, first
    evidence.step(121, 8, book, round=7, in_flight=False)  # within refresh_s: nothing drawn
    assert out.getvalue() == first
    evidence.close()  # transient: the line is erased, the progress display stopped
    assert evidence.progress is None and out.getvalue() != first


def test_the_lines_text() -> None:
    text = line(step=3, loss=None, samples_per_s=812.44, round=0, group=None, val_loss=2.4021)
    assert text == "step 3  loss -  812.4 samples/s  round 0  group -  val 2.402"
