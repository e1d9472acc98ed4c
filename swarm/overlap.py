"""Overlapped rounds: a phase's averaging round runs in the background during the next phase's inner steps.

The trainer's ``overlap`` mode is DiLoCo whose outer step lands when the round ends, under the progress
the peer made meanwhile (as in Streaming DiLoCo's overlapped communication, with no mixing: a peer keeps
all of its own progress). With ``G`` the global parameters (`swarm.outer.DiLoCo`), ``Y`` the model and
``S`` where the progress not yet sent is measured from (``S = G`` at the start):

    at sync point j:
        delta_j = S - Y                      the progress since S: the pseudo-gradient round j averages
        if round j-1 is still running:       wait for it (it averages delta_{j-1} into D, steps G <- outer(G, D))
        S = model = G - u(delta_j)           eager (the default, `TrainerConfig.overlap_eager`): u(d) is what the
                                             outer step would subtract from G for the gradient d alone, with its
                                             momentum as it is (Nesterov SGD: lr (d + mu (mu m + d))); this
                                             peer's own progress stands in for the mean until the round lands
                                             ("eager updates", Kale et al. 2025); off: u(d) = d, the global
                                             state plus the progress just sent
        start round j on delta_j             in the background, against G's digest (as a blocking round)
    after any other inner step, once round j has ended (it lands):
        model = G - (S - Y)                  the new global state plus the progress made since sync point j
        S = G
        the next sync point comes sync_every steps after round j's group formed (the steps this peer took
        while it waited for the others to be looking are added to the phase), so the members' sync points
        come together and no member's update waits on a member that is behind
    once round j-1 has landed, ``lead`` steps before sync point j (one matchmaking window at the last phase's
    pace, 1 to sync_every/2 steps; only after a grouped round, so never a process's first round, whose
    members' sync points are as far apart as their starts): round j is prelaunched -- it forms its group
        while the peer trains, and its all-reduce starts when sync point j hands it delta_j (no join then:
        round j-1 has landed); here the next sync point moves instead by how far this peer's sync point was
        ahead of the members' mean (from when their parts began to arrive, at the last phase's pace; a member
        behind gets a shorter phase), so phases stay sync_every long on average and the members in step

A round lands after the first inner step it has ended by, so its update is as stale as the round is long;
the eager start halves what that staleness costs (measured: section 11 of benchmarks/README.md)
(prelaunched: as its all-reduce after the last member's sync point)
(``python -m benchmarks.recipe_sweep --grid overlap`` measures the cost of each step of delay); a round
slower than a whole phase lands at the next sync point. A round that finds no group applies the peer's
own ``delta`` alone, as in blocking mode; bases that differ are averaged in the round as in blocking mode.
Every member of a round steps ``G`` with the same ``D``, so the sealed state (``G`` with its momentum)
is the same on every signer; only the model a peer trains differs by its own un-averaged progress. The
join, the state swap and any re-sync of a lagging peer happen on the training thread, between steps.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

logger = logging.getLogger(__name__)


class Overlap:
    """At most one round in flight beside the inner steps; ``start`` is where this phase began (``S_j``)."""

    def __init__(self, join_timeout_s: float) -> None:
        self.join_timeout_s = join_timeout_s
        self.start: torch.Tensor | None = None
        """Flat fp32 parameters this phase started from; None: from the global state (at first, after a re-sync)."""
        self.waited_s = 0.0
        """Seconds the training thread waited at sync points for a round still in flight."""
        self._thread: threading.Thread | None = None
        self._outcome: tuple[Any, BaseException | None] = (None, None)
        self._launched_at = self._round_started = 0.0
        self.pending: Future | None = None
        """A prelaunched round waits for its sync point to set this (`prelaunch`)."""
        self._ticks: list[float] = []
        """When each inner step since the launch ended (perf_counter)."""

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    @property
    def ended(self) -> bool:
        """A round was in flight and has ended: its result waits for the join (which will not wait)."""
        return self._thread is not None and not self._thread.is_alive()

    def progress(self, local: Sequence[torch.Tensor], base: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``delta_j = S_j - Y_j``, flat fp32 (``base()``: the global parameters, flat, read only if this phase
        began there)."""
        start = self.start if self.start is not None else base()
        return start - torch.cat([t.reshape(-1) for t in local])

    def tick(self) -> None:
        """An inner step ended (while a round is in flight)."""
        if self._thread is not None:
            self._ticks.append(time.perf_counter())

    def steps_before(self, seconds: float) -> int:
        """Inner steps that ended within ``seconds`` of the round's start (its launch or prelaunch), counted from
        the start of the phase (the launch, or the delivery of a prelaunched round)."""
        since = bisect.bisect_left(self._ticks, self._launched_at)
        return max(0, bisect.bisect_left(self._ticks, self._round_started + seconds) - since)

    def join(self, interrupt: Callable[[], None]) -> Any:
        """Wait for the round in flight (at most ``join_timeout_s``, then ``interrupt`` it) and return its result
        (None if none was in flight); an exception the round raised is raised here, on the training thread."""
        thread, self._thread = self._thread, None
        if thread is None:
            return None
        began = time.perf_counter()
        thread.join(self.join_timeout_s)
        if thread.is_alive():
            logger.warning("the round in flight passed its deadline (%.0f s): interrupting it", self.join_timeout_s)
            interrupt()
            thread.join(10.0)
        self.waited_s += time.perf_counter() - began
        result, error = self._outcome
        self._outcome = (None, None)
        if error is not None:
            raise error
        return result

    def cancel_pending(self) -> None:
        """A prelaunched round whose sync point will not come (training ends): it ends without a result."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.cancel()

    def abandon(self, interrupt: Callable[[], None]) -> None:
        """Interrupt the round in flight, if any, and wait for it to end (on shutdown)."""
        if self._thread is not None:
            self.cancel_pending()
            interrupt()
            with contextlib.suppress(Exception):
                self.join(lambda: None)

    def launch(self, start: torch.Tensor, round_fn: Callable[[], Any]) -> None:
        """Begin the next phase at ``start`` (flat, already in the model) and run ``round_fn`` in the background."""
        self._run(round_fn)
        self.start, self._launched_at = start, self._round_started

    def prelaunch(self, round_fn: Callable[[Future], Any]) -> None:
        """Start this phase's round before its sync point: ``round_fn(pending)`` matchmakes now and waits for
        `deliver` to set ``pending`` (to what the sync point hands over), or for it to be cancelled."""
        pending: Future = Future()
        self._run(lambda: round_fn(pending))
        self.pending = pending

    def deliver(self, start: torch.Tensor, handed: Any) -> bool:
        """The sync point of a prelaunched round: the next phase begins at ``start`` and the round gets ``handed``;
        False if the round no longer waits for it (it gave up: the caller starts the phase as after a round)."""
        pending, self.pending = self.pending, None
        self.start, self._launched_at = start, time.perf_counter()
        if pending is None or not pending.set_running_or_notify_cancel():
            return False
        pending.set_result(handed)
        return True

    def _run(self, round_fn: Callable[[], Any]) -> None:
        if self._thread is not None:
            raise RuntimeError("a round is still in flight: join() it first")
        self._ticks, self._round_started = [], time.perf_counter()

        def run() -> None:
            try:
                self._outcome = (round_fn(), None)
            except BaseException as e:  # handed to the training thread by join()
                self._outcome = (None, e)

        self._thread = threading.Thread(target=run, name="swarm-round", daemon=True)
        self._thread.start()
