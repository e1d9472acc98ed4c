"""Notice a run whose validation loss keeps rising: the signal that its outer settings are too aggressive.

Fed the validation loss each group round seals (every member evaluates the same new global parameters),
:class:`DivergenceGuard` reports when it rose ``rounds`` times in a row by at least ``min_rise`` of
the value the streak started from, once per streak; it re-arms when the loss falls again. A plateau's
noise (small ups and downs) stays silent; a run that trains away from its data does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Rising:
    """A reported streak: the loss rose ``rounds`` sealed rounds in a row, from ``start`` to ``now``."""

    rounds: int
    start: float
    now: float
    round: int

    @property
    def rise(self) -> float:
        return self.now / self.start - 1.0 if self.start > 0 else math.inf

    def to_dict(self) -> dict[str, float | int]:
        return {"rounds": self.rounds, "from": self.start, "to": self.now, "rise": self.rise, "round": self.round}

    def message(self, *, sync_every: int, outer: Any) -> str:
        """The loud warning: what rose, the outer settings (``outer``: lr, momentum), what usually cures it."""
        return (
            f"round {self.round}: the validation loss sealed by the groups rose {self.rounds} rounds in a row, "
            f"{self.start:.4f} -> {self.now:.4f} (+{100 * self.rise:.1f}%): training is diverging. "
            f"Outer settings: sync_every={sync_every}, outer_lr={outer.lr}, outer_momentum={outer.momentum}; "
            f"a lower outer_lr or outer_momentum (README: choosing sync_every and the outer optimizer) or a "
            f"lower inner learning rate usually cures it"
        )


class DivergenceGuard:
    """Counts consecutive rises of the sealed validation loss (see the module docstring)."""

    def __init__(self, *, rounds: int = 3, min_rise: float = 0.01):
        if rounds < 0:
            raise ValueError(f"rounds must be >= 0 (0: off), got {rounds!r}")
        if not 0 <= min_rise < 10:
            raise ValueError(f"min_rise must be in [0, 10), got {min_rise!r}")
        self.rounds, self.min_rise = rounds, min_rise
        self._last: float | None = None
        self._start: float | None = None
        self._streak = 0
        self._reported = False
        self.reports = 0

    def observe(self, val_loss: float | None, *, round_: int) -> Rising | None:
        """Feed one sealed round's validation loss; a :class:`Rising` when a streak is first long enough."""
        if not self.rounds or val_loss is None or not math.isfinite(val_loss):
            return None
        last, self._last = self._last, val_loss
        if last is None or val_loss <= last:
            self._start, self._streak, self._reported = val_loss, 0, False
            return None
        self._streak += 1
        start = self._start if self._start is not None else last
        if self._streak >= self.rounds and not self._reported and val_loss >= start * (1 + self.min_rise):
            self._reported = True
            self.reports += 1
            return Rising(rounds=self._streak, start=start, now=val_loss, round=round_)
        return None
