"""The trainer API: wrap a model and its (inner) optimizer, and train it with the swarm.

DiLoCo-style training (Douillard et al., 2023): every peer takes ``sync_every`` local steps with its
own inner optimizer, then a group averages its pseudo-gradients ``global - local`` and each member
applies the outer Nesterov-SGD step to its copy of the global parameters (`swarm.outer.DiLoCo`).
Members that hold different global state (after a missed round, say) also average that state, so
the bases are pulled together instead of drifting apart. With ``outer_lr=1, outer_momentum=0`` a
round is plain parameter averaging; the defaults follow ``swarm.recipe``.

With ``overlap=True`` each round runs in the background during the next phase's inner steps and its
outer step lands when it ends, under the progress made meanwhile (`swarm.overlap` defines it).

`Trainer` only wires the parts: its config (`swarm.config`), the outer optimizer (`swarm.outer`), the
round (`swarm.round_runner`), the round's bookkeeping as pure functions (`swarm.rounds`), presence in the run (`swarm.presence`), group
averaging (`averaging`), sealed checkpoints and receipts (`swarm.checkpoint`) and the evidence sinks.

    trainer = swarm.Trainer(model, torch.optim.AdamW(model.parameters()), run="my-run",
                            initial_peers=["/ip4/1.2.3.4/tcp/31337/p2p/Qm..."])
    for x, y in batches:
        loss_fn(model(x), y).backward()
        trainer.step(num_samples=len(x))
    trainer.finish()  # the last round lands (overlapped) and is sealed
    trainer.shutdown()
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from hivemind import DHT

from averaging import GroupAverager
from bootstrap import Stopped, StopSignal, start_reaper, stop_dht
from bootstrap.cli import default_log_handler
from bootstrap.identity import Identity
from bootstrap.network import start_swarm_dht
from bootstrap.owned import OwnerBoundValidator
from peers import ResourceGraph
from swarm import rounds
from swarm._private.divergence import DivergenceGuard
from swarm._private.evidence import Evidence, open_evidence, status_snapshot
from swarm.checkpoint.sync import CheckpointManager
from swarm.config import RunMismatch, TaskInfo, TrainerConfig, averaging_prefix
from swarm.outer import DiLoCo
from swarm.overlap import Overlap
from swarm.presence import PeerView, Presence, RunFacts, check_run
from swarm.recipe import ScaledStep, inner_step, warmup_factor
from swarm.round_runner import RoundRunner
from swarm.rounds import RoundResult, TrainerCounters
from swarm.work import WorkChecks, WorkSpec

__all__ = ["RoundResult", "RunMismatch", "TaskInfo", "Trainer", "TrainerConfig", "TrainerCounters"]

logger = logging.getLogger(__name__)


class Trainer:
    """Train ``model`` with ``inner_optimizer`` locally and average with the run's peers every ``sync_every`` steps.

    ``config`` holds every setting; keyword ``overrides`` replace single fields of it by plain name
    (`TrainerConfig.with_fields`), so ``Trainer(model, opt, run="r", sync_every=20, codec="fp32")``
    works without a config. Pass ``dht`` to share one DHT between components (the caller then owns
    its shutdown). ``evaluate`` (optional): the current model's validation loss after each grouped round (NaN: not
    measured); sealed into each checkpoint and shown on the status board. ``identity_key``: this peer's key
    file, by default ``~/.swarm/identity.key`` as swarm.peer's ``--identity-key`` (created 0600, refused
    if others can read it, held by one live peer at a time): a restarted script is the same peer. With ``work``
    (`swarm.work.WorkSpec`) and ``verify_work``, train on ``trainer.work.batches()``: each phase is checked by replay.
    Once ``cancel`` (a stop request, e.g. `bootstrap.StopSignal.event`) is set, a state sync ends: ``Stopped``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer | ScaledStep,
        *,
        config: TrainerConfig | None = None,
        dht: DHT | None = None,
        identity: Identity | None = None,
        identity_key: str | os.PathLike[str] | None = None,
        task_info: TaskInfo | None = None,
        evaluate: Callable[[], float] | None = None,
        work: WorkSpec | None = None,
        cancel: threading.Event | None = None,
        **overrides: Any,
    ):
        if config is None:
            config = TrainerConfig.create(**overrides)
        elif overrides:
            config = config.with_fields(**overrides)
        self.config = config
        self.model, self.inner_optimizer, self.evaluate = model, inner_optimizer, evaluate
        self.identity = Identity.of(identity, identity_key)
        self.counters = TrainerCounters()
        self.local_step = 0
        self.state = "joining"
        self.before_sync: list[Callable[[int, list[torch.Tensor]], None]] = []
        """Callbacks run with (round, local parameters) right before each averaging round."""
        self.outer = DiLoCo.for_model(model, config.outer())
        """The outer optimizer: global parameters (and the model's buffers), outer momentum, the round counter."""
        self.task_info = (task_info or TaskInfo()).for_params(self.outer.names, self.outer.params)
        self.evidence = Evidence()
        """This trainer's ledger, status board entry and metrics (see ``swarm._private.evidence``)."""
        guard = DivergenceGuard(rounds=config.divergence_rounds)
        self._book = rounds.RoundBook(
            started_at=time.time(), last_sync_end=time.perf_counter(), divergence=guard, next_sync=config.sync_every
        )
        self.presence: Presence | None = None
        self.group_averager: GroupAverager | None = None
        self.checkpoints: CheckpointManager | None = None
        self._runner: RoundRunner | None = None
        self._stop: StopSignal | None = None
        """Inside ``with``: SIGINT / SIGTERM, a request to leave at the next step."""
        self.identity.lock()
        start_reaper()
        default_log_handler("swarm")  # join, state sync and each round, unless the application set up logging
        self._owns_dht = dht is None
        net = config.network.dht_kwargs()
        self.dht = dht if dht is not None else start_swarm_dht(self.identity, initial_peers=config.initial_peers, **net)
        try:
            self._wire(work, cancel)
        except BaseException:
            self.shutdown()
            raise

    def _wire(self, work: WorkSpec | None, cancel: threading.Event | None) -> None:
        cfg, task, own = self.config, self.task_info, self.identity.peer_id == self.peer_id
        if not own:
            logger.warning(
                "no ledger, record or checkpoints: the DHT's peer ID is not this trainer's identity (pass no dht=)"
            )
        elif not self._owns_dht:  # a DHT passed in signs our records as start_swarm_dht's would (merged if it does)
            self.dht.add_validators([OwnerBoundValidator(self.identity)])
        ledger_dir = cfg.checkpoint.ledger_dir if own else ""
        self.evidence = open_evidence(
            self.identity, run=cfg.run, task=task.name, ledger_dir=ledger_dir, metrics=cfg.metrics
        )
        graph = ResourceGraph(self.dht)
        requirements = check_run(graph, run=cfg.run, task=task, device=self.device, own=cfg.requirements.requirements())
        run = RunFacts.of(cfg.run, task, requirements, self.device)
        self.presence = Presence(self.dht, self.identity, graph, cfg, run, view=self._view, status=self._status)
        self.evidence.status = self.presence.status
        # own DHT: owner-signed matchmaking entries; with members_only, only members of the run are drawn
        signed = {"identity": self.identity, "run": cfg.run if cfg.averaging.members_only else None} if own else {}
        where = {"bandwidth_mbps": self.presence.bandwidth_mbps, "region": cfg.presence.region, **signed}
        self.group_averager = GroupAverager(self.dht, prefix=averaging_prefix(cfg.run), config=cfg.averaging, **where)
        if own:
            self.checkpoints = CheckpointManager.for_run(
                self.dht, self.identity, cfg, task, self.presence.run_peers, self.evidence.checkpoint_event
            )
        parts = (self.outer, self.group_averager, self.presence, self.checkpoints, self.evidence)
        binding = self.identity.bind(self.peer_id)
        self._runner = RoundRunner(cfg, *parts, self.identity, binding, self.counters, self._book)
        rt = cfg.averaging.round_timeout_s  # a round may take two all-reduces, then its bookkeeping
        self._runner.evaluate, self._runner.overlap = self.evaluate, Overlap(2 * rt + 30) if cfg.overlap else None
        self._runner.cancel = cancel
        if cfg.load_state:
            self.load_state(timeout_s=cfg.load_state_timeout_s)
        self._runner.work = WorkChecks.for_trainer(self, work)  # its first phase starts from this state
        self._set_state("training")
        newest = self.checkpoints.newest_digest() if self.checkpoints is not None else None
        join_s = time.time() - self._book.started_at
        self.evidence.record("joined", rounds.joined_entry(self.round, self.local_step, self.counters, join_s, newest))
        loaded = " from its sealed state (verified)" if self.counters.state_loaded else ""
        logger.info("peer %s joined run %r at round %s%s in %.1f s", self.peer_id, cfg.run, self.round, loaded, join_s)

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    @property
    def round(self) -> int:
        """The run's round counter, as this peer holds it."""
        return self.outer.round

    @property
    def last_round(self) -> RoundResult | None:
        """The result of the last round that ended."""
        return self._runner.last if self._runner is not None else None

    @property
    def rounds_in_flight(self) -> int:
        """Rounds started on a phase's progress, not yet joined: 0 or 1 (overlapped), always 0 blocking."""
        overlap = self._runner.overlap if self._runner is not None else None
        return int(overlap is not None and overlap.in_flight and overlap.pending is None)

    device = property(lambda self: self.outer.params[0].device, doc="Where the model's parameters are.")
    work = property(lambda self: getattr(self._runner, "work", None), doc="Verified work (`swarm.work`), or None.")
    samples_per_s = property(lambda self: self._book.samples_per_s, doc="Samples/s over the last round's steps.")
    last_loss = property(lambda self: self._book.last_loss, doc="The last training loss passed to :meth:`step`.")
    last_val_loss = property(
        lambda self: self._book.last_val_loss,
        lambda self, value: setattr(self._book, "last_val_loss", value),
        doc="The last value of ``evaluate()``, taken after each grouped round (None once cleared).",
    )

    def _status(self) -> dict:
        return status_snapshot(self.state, self.round, self.local_step, self.evidence.last_group, self._book, self.work)

    def _view(self) -> PeerView:
        sealed = self.checkpoints.sealed if self.checkpoints is not None else 0
        return PeerView(self.state, self.round, self.local_step, self.samples_per_s, self.counters.rounds_ok, sealed)

    def _set_state(self, state: str) -> None:
        self.state = state
        if self.presence is not None:
            self.presence.changed()

    def step(self, *, num_samples: int = 1, loss: float | None = None) -> RoundResult | None:
        """One inner optimizer step (and zero_grad); every ``sync_every`` steps also an averaging round, whose
        result it returns (else None; overlapped: a round's result is returned at the step it lands). Over the first ``inner_warmup_steps`` steps the learning rates are
        scaled by ``step / inner_warmup_steps`` for the step only (a user's scheduler keeps its values).
        ``loss`` (optional) is only reported: status board and metrics."""
        book = self._book
        if self._stop is not None and self._stop.event.is_set():
            raise Stopped(self._stop.signal_name)
        inner_step(self.inner_optimizer, self.local_step + 1, self.config.inner_warmup_steps)
        self.local_step += 1
        if self._runner.work is not None:
            self._runner.work.stepped()
        book.samples_since_sync += num_samples
        if loss is not None:
            book.last_loss = float(loss)
        overlap = self._runner.overlap
        if overlap is not None:
            overlap.tick()
        self.evidence.step(self.local_step, num_samples, book, round=self.round, in_flight=self.rounds_in_flight > 0)
        if self.local_step >= book.next_sync:
            return self.sync()
        return self._runner.between_steps(self.local_step) if overlap is not None else None

    def inner_lr_factor(self) -> float:
        """The factor on the inner optimizer's learning rate for the next local step (the warm-up)."""
        return warmup_factor(self.local_step + 1, self.config.inner_warmup_steps)

    def sync(self) -> RoundResult | None:
        """Average pseudo-gradients with a group and apply the outer step. Blocking (the default): the round
        runs now and its result is returned; it never blocks past ``round_timeout_s`` (plus a second
        all-reduce of the global state when members disagree on it). With ``overlap``: the round started at
        the last sync point is joined and its result returned (None at the first), and this phase's round
        starts in the background, or gets its delta if prelaunched (the algorithm: `swarm.overlap`)."""
        book, overlap, joined, delta = self._book, self._runner.overlap, None, None
        started, book.next_sync = time.perf_counter(), self.local_step + self.config.sync_every
        book.samples_per_s = book.samples_since_sync / max(started - book.last_sync_end, 1e-9)
        book.steps_per_s = (self.local_step - book.last_sync_step) / max(started - book.last_sync_end, 1e-9)
        book.last_sync_step = self.local_step
        samples, book.samples_since_sync = int(book.samples_since_sync), 0
        # a copy when overlapped: the model's own tensors (on a CPU, in fp32) are overwritten below
        local = [p.detach().to("cpu", torch.float32, copy=overlap is not None) for p in self.outer.params]
        if overlap is not None:  # a prelaunched round (its group formed already) is this phase's own
            delta, prelaunched = overlap.progress(local, self.outer.global_flat), overlap.pending is not None
            joined = None if prelaunched else self._runner.join()
            if not prelaunched and self._resync_if_lagging():  # the model is the loaded state: no progress
                overlap.start, delta = None, None
                local = [p.detach().to("cpu", torch.float32) for p in self.outer.params]
        for hook in self.before_sync:
            hook(self.round, local)
        pseudo = self.outer.pseudo_gradient(local, delta)
        if overlap is not None:
            self._runner.start_phase(pseudo, samples, self.local_step, started)
        else:
            joined = self._runner.run(pseudo, samples, self.local_step, started)
            self._resync_if_lagging()
        book.last_sync_end = time.perf_counter()
        return joined

    def _resync_if_lagging(self, max_solo_rounds: int = 3) -> bool:
        """A peer cut off from the others for a few rounds takes the run's newest sealed state again, but
        only state sealed at a later round than its own: a peer left alone (the others died or left)
        keeps training forward instead of rolling back to the last checkpoint it sealed with them."""
        if self.checkpoints is None or self._book.solo_streak < max_solo_rounds:
            return False
        streak, before = self._book.solo_streak, self.round
        self._book.solo_streak = 0  # looked again after another max_solo_rounds solo rounds
        if not self.load_state(timeout_s=self.config.load_state_timeout_s, reason="resync", newer_than=before):
            return False
        logger.info("cut off for %s rounds: re-synced from round %s to sealed round %s", streak, before, self.round)
        return True

    def load_state(self, *, timeout_s: float, reason: str = "join", newer_than: int | None = None) -> bool:
        """Resume from the run's newest sealed checkpoint, verified end to end; True if one was loaded. With
        ``newer_than`` only one sealed after that round is taken (never an older state than this peer's).
        Nothing unverified is loaded (before the first seal all start from the seeded genesis model). Meanwhile
        the averager tells the members looking for a group not to wait for this peer."""
        with self.group_averager.loading():
            return self._runner.load_state(timeout_s=timeout_s, reason=reason, newer_than=newer_than)

    def finish(self) -> RoundResult | None:
        """End training: overlapped, wait for the round in flight (its result is returned) and put the global
        parameters in the model; blocking, the model holds them already after a sync point (None). Then wait
        (bounded: `CheckpointManager.flush`) for the last round's seal, so the state a run ends at is sealed."""
        overlap, joined = self._runner.overlap if self._runner is not None else None, None
        if overlap is not None:
            overlap.cancel_pending()
            joined, overlap.start = overlap.join(self.interrupt), None
            self.outer.to_model()
        if self.checkpoints is not None:
            self.checkpoints.flush(cancel=self._runner.cancel)
        return joined

    def interrupt(self) -> None:
        """Abandon the averaging round in progress at once (the update is applied alone); for Ctrl+C."""
        if self.group_averager is not None:
            self.group_averager.interrupt()

    def shutdown(self, *, reason: str | None = None) -> None:
        """Leave the run: withdraw the record, stop the averager, then the DHT if this trainer started it.
        The ledger's last entry is "stop" with ``reason`` (e.g. the signal's name). Idempotent; a round
        still in flight (overlapped) is abandoned first."""
        if getattr(self, "_runner", None) is not None and self._runner.overlap is not None:
            self._runner.overlap.abandon(self.interrupt)
        if getattr(self, "group_averager", None) is not None:
            self.group_averager.leave()  # first: the others stop waiting for this peer at once
        for part in ("work", "presence", "checkpoints", "group_averager"):
            if getattr(self, part, None) is not None:
                getattr(self, part).close()
        if getattr(self, "evidence", None) is not None:
            if self.evidence.ledger is not None:
                self.evidence.record("stop", {"step": self.local_step, "round": self.round, "signal": reason})
            self.evidence.close()
        if getattr(self, "_owns_dht", False) and getattr(self, "dht", None) is not None:
            stop_dht(self.dht)
        self.identity.unlock()  # the key may serve this process's next peer

    def __enter__(self) -> Trainer:
        """In the main thread, SIGINT (Ctrl+C) and SIGTERM inside the block become a clean leave: a round in
        progress is abandoned, the next `step` raises `Stopped`, and `__exit__` leaves the run quietly."""
        if threading.current_thread() is threading.main_thread():
            self._stop = StopSignal().install()
            self._stop.on_stop.append(self.interrupt)
            self._runner.cancel = self._runner.cancel or self._stop.event  # a re-sync ends too
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> bool:
        """Leave the run (`shutdown`); a stop signal or Ctrl+C ends the block quietly, the program goes on."""
        stop, self._stop = self._stop, None
        if stop is not None:
            stop.restore()
        interrupted = isinstance(error, KeyboardInterrupt)
        reason = (stop.signal_name if stop is not None else None) or ("SIGINT" if interrupted else None)
        self.shutdown(reason=reason)
        if interrupted:
            logger.info("stopped by %s: left the run cleanly", reason)
        return interrupted
