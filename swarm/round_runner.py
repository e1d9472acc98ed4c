"""One averaging round of a trainer: the group's all-reduce of the pseudo-gradient, base agreement, the
outer step, and the round's evidence (ledger entry, validation, receipt, seal, rejections).

`swarm.trainer.Trainer` runs it on the training thread (blocking) or in the background (overlapped,
`swarm.overlap`); the pure bookkeeping is in `swarm.rounds`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import TYPE_CHECKING, Any

import torch

from swarm import rounds, verify
from swarm.rounds import RoundBook, RoundResult, TrainerCounters

if TYPE_CHECKING:
    from averaging import GroupAverager
    from bootstrap.identity import Identity, PeerBinding
    from swarm._private.evidence import Evidence
    from swarm.checkpoint.sync import CheckpointManager
    from swarm.config import TrainerConfig
    from swarm.outer import DiLoCo
    from swarm.overlap import Overlap
    from swarm.presence import Presence

logger = logging.getLogger(__name__)


class RoundRunner:
    """Runs a trainer's rounds over the parts `swarm.trainer.Trainer` wired (see `run`)."""

    def __init__(
        self,
        config: TrainerConfig,
        outer: DiLoCo,
        group_averager: GroupAverager,
        presence: Presence,
        checkpoints: CheckpointManager | None,
        evidence: Evidence,
        identity: Identity,
        binding: PeerBinding,
        counters: TrainerCounters,
        book: RoundBook,
    ) -> None:
        self.config, self.outer, self.group_averager, self.presence = config, outer, group_averager, presence
        self.checkpoints, self.evidence, self.identity, self.binding = checkpoints, evidence, identity, binding
        self.counters, self.book = counters, book
        self.evaluate: Callable[[], float] | None = None
        """Returns the validation loss of the model (evaluated after a grouped blocking round)."""
        self.overlap: Overlap | None = None
        """Overlapped rounds (`swarm.overlap`): the round runs in the background and leaves the model alone."""
        self.last: RoundResult | None = None
        """The result of the last round that ended."""
        self.work: Any = None
        """Verified work (`swarm.work.WorkChecks`), or None."""
        self.cancel: threading.Event | None = None
        """A stop request: once set, a state sync in progress ends (`bootstrap.Stopped`)."""

    def load_state(self, *, timeout_s: float, reason: str, newer_than: int | None) -> bool:
        """`swarm.Trainer.load_state`: the run's newest sealed state, verified end to end, into the outer optimizer
        (and the model); True if one was loaded."""
        if self.checkpoints is None:
            return False
        manifest, problem = self.checkpoints.resume(
            self.outer, timeout_s=timeout_s, newer_than=newer_than, reason=reason, cancel=self.cancel
        )
        if problem is not None:
            self.counters.rejected[problem] += 1
        if manifest is not None:
            self.counters.state_loaded += 1
            self.counters.state_verified += 1
            self.group_averager.vouch(manifest.participants)  # its signers: the run's core in a Sybil flood
        return manifest is not None

    def run(self, pseudo: Any, samples: int, step: int, started: float) -> RoundResult:
        """Average ``pseudo`` with a group, step the global state and keep the round's evidence (blocking, or in
        the background when overlapped: then the model is left to the training thread)."""
        # verified work: this phase's signed commitment goes with the round's metadata
        work = self.work.commit(pseudo, samples, self.outer.round) if self.work is not None else None
        return self._finish(pseudo, samples, step, started, self._average(pseudo.delta, samples, pseudo.digest, work))

    def run_prelaunched(self, pending: Future, samples: int, digest: str) -> RoundResult | None:
        """`run`, started before the sync point (`swarm.overlap`): the group forms now, on ``samples`` (the
        phase's planned samples) and ``digest`` (the global state's), and the all-reduce begins when the sync
        point sets ``pending`` to ``(pseudo, samples, step, started)``; None if it is cancelled or never set."""
        ready: Future = Future()  # what the group's all-reduce waits for: (tensor, weight)

        def handed(done: Future) -> None:
            if done.cancelled() or not ready.set_running_or_notify_cancel():
                ready.cancel()
                return
            pseudo, actual, *_ = done.result()
            ready.set_result((pseudo.delta, float(max(actual, 1))))

        pending.add_done_callback(handed)
        outcome = self._average(ready, samples, digest)
        try:
            pseudo, samples, step, started = pending.result(timeout=self.config.averaging.round_timeout_s)
        except TimeoutError:
            if pending.cancel():  # the sync point never came (it finds the round gone, `Overlap.deliver`)
                return None
            pseudo, samples, step, started = pending.result()  # it came just now
        except CancelledError:
            return None
        return self._finish(pseudo, samples, step, started, outcome)

    def _average(
        self, tensor: torch.Tensor | Future, samples: int, digest: str, work: dict | None = None
    ) -> tuple[Any, Any, Any, set[str]]:
        """The group's all-reduce: (averaged, record, group, the run's peers this one expected); ``work``: the
        phase's signed work commitment, sent in the gathered metadata."""
        newest = self.checkpoints.newest_digest() if self.checkpoints is not None else None
        fresh = self.counters.rounds_ok + self.counters.rounds_solo == 0
        gather = rounds.gather_metadata(self.outer.round, samples, self.binding, digest, newest, fresh=fresh)
        if work is not None:
            gather["work"] = work
        expected: set[str] = set()
        try:
            expected = self.presence.run_peers()  # all of them looking: the window closes early
            averaged, record, group = self.group_averager.step(
                tensor,
                weight=float(max(samples, 1)),
                gather=gather,
                timeout_s=self.config.averaging.round_timeout_s,
                expected=expected,
                label=verify.commitment_digest(work) if work is not None else "",
            )
        except Exception as e:  # a failed round must not kill training; the update is applied alone
            logger.warning("averaging round failed: %r; applying this peer's update alone", e)
            averaged, record, group = None, None, None
        return averaged, record, group, expected

    def _finish(self, pseudo: Any, samples: int, step: int, started: float, outcome: tuple) -> RoundResult:
        """Base agreement, the outer step and the round's evidence, after the all-reduce."""
        book, timeout_s, weight = self.book, self.config.averaging.round_timeout_s, float(max(samples, 1))
        averaged, record, group, expected = outcome
        grouped = averaged is not None and group is not None
        if group is not None and not set(group.members) <= expected:
            self.presence.forget_run_peers()  # a member it did not know of: its view of the run is stale
        rejected: tuple[str, ...] = ()
        new_state = None
        if grouped:
            problems = rounds.check_gathered(group.gathered)
            self.counters.rejected.update(problems.values())
            for peer_id, reason in problems.items():
                logger.warning("round %s: rejected metadata from %s: %s", self.outer.round, peer_id, reason)
            rejected = tuple(problems)
            agree = rounds.base_agreement_group(group, record, self.binding.peer_id)
            if agree is not None:
                new_state, agreement = self.group_averager.average_in_group(
                    agree, pseudo.state, weight=1.0, codec="fp32", timeout_s=timeout_s
                )
                if new_state is None:
                    logger.info("round %s: diverged bases not averaged: %s", self.outer.round, agreement.failures[:3])
            next_round = rounds.next_round(self.outer.round, group.gathered)
            if self.work is not None:
                self.work.after_round(group, pseudo.state[: pseudo.delta.numel()], record, averaged)
            self.counters.rounds_ok += 1
            book.solo_streak = 0
            self.presence.recent.add(group.members)
        else:
            averaged, next_round = pseudo.delta, self.outer.round + 1
            self.counters.rounds_solo += 1
            book.solo_streak += 1
            self.presence.reconnect()
        self.outer.step(averaged, next_round=next_round, new_state=new_state, to_model=self.overlap is None)
        if self.work is not None:  # the next phase starts from the new global state; accusations are re-checked
            self.work.begin(first_step=step + 1)
            self.work.poll()
        size, duration = len(group.members) if grouped else 1, time.perf_counter() - started
        self.last = RoundResult(
            round=self.outer.round,
            group_size=size,
            weight=weight,
            duration_s=duration,
            rejected=rejected,
            record=record,
        )
        self._after_round(group if grouped else None, record, samples=samples, step=step)
        what = f"{record.outcome}, group of {size}" if record is not None and grouped else "no group, own update alone"
        loss = "-" if book.last_loss is None else f"{book.last_loss:.4f}"
        shown = book.last_val_loss
        val = f", val loss {shown:.4f}" if grouped and shown is not None and math.isfinite(shown) else ""
        logger.info("round %s: %s in %.2f s, loss %s%s", self.outer.round, what, duration, loss, val)
        return self.last

    def _after_round(self, group: Any | None, record: Any | None, *, samples: int, step: int) -> None:
        """Evaluate (blocking), watch for divergence, keep the evidence, seal and swap receipts."""
        book, blocking = self.book, self.overlap is None  # overlapped: evaluated at the join (Trainer.sync)
        val_loss = float(self.evaluate()) if group is not None and self.evaluate is not None and blocking else None
        self.observe_val(val_loss)
        entry = rounds.round_entry(self.last, step, samples, book.samples_per_s, val_loss, group is None)
        self.evidence.round(entry, group=group, record=record, peer_id=self.binding.peer_id)
        if group is not None and self.checkpoints is not None:
            every, state = self.config.checkpoint.checkpoint_every, self.outer.state_dict
            sealing = bool(every) and self.outer.round % every == 0
            seal = rounds.seal_request(group, val_loss, state=state, step=self.outer.round) if sealing else None
            receipt = rounds.sign_participation(
                self.identity, self.config.run, self.outer.round, group, record, samples, ledger=self.evidence.ledger
            )
            self.checkpoints.finish_round_async(receipt=receipt, seal=seal)
        sources = {"metadata": self.counters.rejected, "record": self.presence.graph.rejections.counts}
        self.evidence.rejections_of(
            {**sources, **(self.checkpoints.rejections() if self.checkpoints else {})}, self.outer.round
        )
        if self.evidence.metrics is not None:
            self.evidence.metrics.set_peers_known(len(self.presence.run_peers()))

    def between_steps(self, local_step: int) -> RoundResult | None:
        """Overlapped, after an inner step that is no sync point: the round in flight lands if it has ended, and
        this phase's round is prelaunched once the sync point is `lead` steps away (`rounds.prelaunch_due`)."""
        overlap, book = self.overlap, self.book
        if overlap is None:
            raise RuntimeError("between_steps() is for overlapped rounds")
        landed = self.land(local_step) if overlap.ended else None
        grouped, flying = self.counters.rounds_ok, overlap.in_flight
        if rounds.prelaunch_due(book, local_step=local_step, lead=self.lead(), grouped=grouped, in_flight=flying):
            done = max(local_step - book.last_sync_step, 1)
            planned = book.samples_since_sync + (book.next_sync - local_step) * book.samples_since_sync // done
            _state, digest = self.outer.state()
            overlap.prelaunch(lambda pending: self.run_prelaunched(pending, planned, digest))
        return landed

    def lead(self) -> int:
        """How many steps before its sync point an overlapped phase's round starts matchmaking: its window's
        length at the last phase's pace, at least 1, at most half a phase (the group forms while the peer
        trains, so the round lands as soon after the sync point as the all-reduce allows)."""
        steps = math.ceil(self.config.averaging.matchmaking_time_s * self.book.steps_per_s)
        return max(1, min(steps, self.config.sync_every // 2))

    def start_phase(self, pseudo: Any, samples: int, step: int, started: float) -> None:
        """Overlapped, at a sync point: hand ``pseudo`` to this phase's prelaunched round (its group formed
        already) or, with none waiting, start the round now; the next phase begins at global - delta, or with
        `overlap_eager` at global - the outer step of delta alone (`swarm.overlap`)."""
        overlap = self.overlap
        if overlap is None:
            raise RuntimeError("start_phase() is for overlapped rounds")
        if overlap.pending is not None:
            start = self.outer.rebase(pseudo.delta, eager=self.config.overlap_eager)
            if overlap.deliver(start, (pseudo, samples, step, started)):
                return
            self.join()  # it gave up waiting (no result): this phase's round runs as a fresh one
        args = (pseudo, samples, step)
        start = self.outer.rebase(pseudo.delta, eager=self.config.overlap_eager)
        overlap.launch(start, lambda: self.run(*args, time.perf_counter()))

    def join(self) -> RoundResult | None:
        """Overlapped: wait for the round in flight (`Overlap.join`) and evaluate the new global parameters."""
        if self.overlap is None:
            raise RuntimeError("join() is for overlapped rounds")
        joined = self.overlap.join(self.group_averager.interrupt)
        if joined is not None and joined.group_size > 1 and self.evaluate is not None:
            self.outer.to_model()  # the new global parameters, the same on every member
            self.observe_val(float(self.evaluate()))
        return joined

    def land(self, local_step: int) -> RoundResult | None:
        """Overlapped: the round in flight ended between sync points; its outer step lands now, under the progress
        made since the sync point (`swarm.overlap`), which the next pseudo-gradient measures from the global state.
        The steps this peer took while it waited for its group to form lengthen this phase, so that the members'
        next sync points come together."""
        overlap = self.overlap
        if overlap is None:
            raise RuntimeError("land() is for overlapped rounds")
        local = [p.detach().to("cpu", torch.float32, copy=True) for p in self.outer.params]
        delta = overlap.progress(local, self.outer.global_flat)
        joined = self.join()
        self.outer.rebase(delta)
        overlap.start = None
        if joined is None:
            return None
        if joined.group_size > 1 and joined.record is not None:
            phases, cap = joined.record.phase_s, self.config.sync_every // 2
            if "ready" in phases:  # prelaunched: the next sync point moves to the members' mean (steps ahead > 0)
                ahead = round(phases.get("mean_sender", 0.0) * self.book.steps_per_s)
                self.book.next_sync += max(-cap, min(ahead, cap))
            else:  # the phase counts from when the group formed
                self.book.next_sync += overlap.steps_before(phases.get("matchmaking", 0.0))
        return dataclasses.replace(joined, landed_step=local_step)

    def observe_val(self, val_loss: float | None) -> None:
        """Keep a grouped round's validation loss (of the new global parameters) and watch for divergence."""
        if val_loss is not None:
            self.book.last_val_loss = val_loss
            if math.isfinite(val_loss):  # NaN: not measured this round (`swarm.peer --eval-every`); the board keeps
                self.book.shown_val_loss = val_loss  # the last value measured
        rising = self.book.divergence.observe(val_loss, round_=self.outer.round)
        if rising is not None:
            logger.warning(rising.message(sync_every=self.config.sync_every, outer=self.outer.settings))
            self.evidence.record("diverging", rising.to_dict())
