"""The trainer API: wrap a model and its (inner) optimizer, and train it with the swarm.

DiLoCo-style training (Douillard et al., 2023): every peer takes ``sync_every`` local steps with its
own inner optimizer, then a group averages its pseudo-gradients ``global - local`` and each member
applies the outer Nesterov-SGD step to its copy of the global parameters (`swarm.outer.DiLoCo`).
Members that hold different global state (after a missed round, say) also average that state, so
the bases are pulled together instead of drifting apart. With ``outer_lr=1, outer_momentum=0`` a
round is plain parameter averaging; the defaults follow ``swarm.recipe``.

`Trainer` only wires the parts: its config (`swarm.config`), the outer optimizer (`swarm.outer`), the
round's bookkeeping as pure functions (`swarm.rounds`), presence in the run (`swarm.presence`), group
averaging (`averaging`), sealed checkpoints and receipts (`swarm.checkpoint`) and the evidence sinks.

    trainer = swarm.Trainer(model, torch.optim.AdamW(model.parameters()), run="my-run",
                            initial_peers=["/ip4/1.2.3.4/tcp/31337/p2p/Qm..."])
    for x, y in batches:
        loss_fn(model(x), y).backward()
        trainer.step(num_samples=len(x))
    trainer.shutdown()
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from hivemind import DHT

from averaging import GroupAverager
from bootstrap import start_reaper, stop_dht
from bootstrap.identity import Identity
from bootstrap.network import start_swarm_dht
from bootstrap.owned import OwnerBoundValidator
from peers import ResourceGraph
from swarm import rounds
from swarm._private.divergence import DivergenceGuard
from swarm._private.evidence import Evidence, milli, open_evidence
from swarm.checkpoint.sync import CheckpointManager
from swarm.config import RunMismatch, TaskInfo, TrainerConfig
from swarm.outer import DiLoCo
from swarm.presence import PeerView, Presence, RunFacts, check_run
from swarm.recipe import step_with_lr_factor, warmup_factor
from swarm.rounds import RoundResult, TrainerCounters

__all__ = ["RoundResult", "RunMismatch", "TaskInfo", "Trainer", "TrainerConfig", "TrainerCounters"]

logger = logging.getLogger(__name__)


class Trainer:
    """Train ``model`` with ``inner_optimizer`` locally and average with the run's peers every ``sync_every`` steps.

    ``config`` holds every setting; keyword ``overrides`` replace single fields of it by plain name
    (`TrainerConfig.with_fields`), so ``Trainer(model, opt, run="r", sync_every=20, codec="fp32")``
    works without a config. Pass ``dht`` to share one DHT between components (the caller then owns
    its shutdown). ``evaluate`` (optional) returns the validation loss of the current model; its
    value is sealed into each checkpoint and shown on the status board.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        config: TrainerConfig | None = None,
        dht: DHT | None = None,
        identity: Identity | None = None,
        task_info: TaskInfo | None = None,
        evaluate: Callable[[], float] | None = None,
        **overrides: Any,
    ):
        if config is None:
            config = TrainerConfig.create(**overrides)
        elif overrides:
            config = config.with_fields(**overrides)
        self.config = config
        self.model, self.inner_optimizer, self.evaluate = model, inner_optimizer, evaluate
        self.identity = identity if identity is not None else Identity.generate()
        self.counters = TrainerCounters()
        self.local_step = 0
        self.last_round: RoundResult | None = None
        self.state = "joining"
        self.before_sync: list[Callable[[int, list[torch.Tensor]], None]] = []
        """Callbacks run with (round, local parameters) right before each averaging round."""
        names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
        self.outer = DiLoCo(names, params, config.outer())
        """The outer optimizer: global parameters, outer momentum, the run's round counter."""
        self.task_info = (task_info or TaskInfo()).for_params(names, params)
        self.evidence = Evidence()
        """This trainer's ledger, status board entry and metrics (see ``swarm._private.evidence``)."""
        guard = DivergenceGuard(rounds=config.divergence_rounds)
        self._book = rounds.RoundBook(started_at=time.time(), last_sync_end=time.perf_counter(), divergence=guard)
        self.presence: Presence | None = None
        self.group_averager: GroupAverager | None = None
        self.checkpoints: CheckpointManager | None = None
        self.identity.lock()
        start_reaper()
        self._owns_dht = dht is None
        net = config.network.dht_kwargs()
        self.dht = dht if dht is not None else start_swarm_dht(self.identity, initial_peers=config.initial_peers, **net)
        self.binding = self.identity.bind(self.peer_id)
        try:
            self._wire()
        except BaseException:
            self.shutdown()
            raise

    def _wire(self) -> None:
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
        self.presence = Presence(
            self.dht, self.identity, graph, cfg, run, view=self._view, status=self._status_snapshot
        )
        self.evidence.status = self.presence.status
        # own DHT: owner-signed matchmaking entries; with members_only, only members of the run are drawn
        signed = {"identity": self.identity, "run": cfg.run if cfg.averaging.members_only else None} if own else {}
        where = {"bandwidth_mbps": self.presence.bandwidth_mbps, "region": cfg.presence.region, **signed}
        self.group_averager = GroupAverager(self.dht, prefix=f"swarm_{cfg.run}", config=cfg.averaging, **where)
        if own:
            on_event = self.evidence.checkpoint_event
            self.checkpoints = CheckpointManager.for_run(
                self.dht, self.identity, cfg, task, self.presence.run_peers, on_event
            )
        if cfg.load_state:
            self.load_state(timeout_s=cfg.load_state_timeout_s)
        self._set_state("training")
        newest = self.checkpoints.newest_digest() if self.checkpoints is not None else None
        join_s = time.time() - self._book.started_at
        self.evidence.record("joined", rounds.joined_entry(self.round, self.local_step, self.counters, join_s, newest))

    @property
    def peer_id(self) -> str:
        return str(self.dht.peer_id)

    @property
    def round(self) -> int:
        """The run's round counter, as this peer holds it."""
        return self.outer.round

    @property
    def device(self) -> torch.device:
        return self.outer.params[0].device

    samples_per_s = property(lambda self: self._book.samples_per_s, doc="Samples/s over the last round's steps.")
    last_loss = property(lambda self: self._book.last_loss, doc="The last training loss passed to :meth:`step`.")
    last_val_loss = property(
        lambda self: self._book.last_val_loss,
        lambda self, value: setattr(self._book, "last_val_loss", value),
        doc="The last value of ``evaluate()``, taken after each grouped round (None once cleared).",
    )

    def _view(self) -> PeerView:
        sealed = self.checkpoints.sealed if self.checkpoints is not None else 0
        return PeerView(self.state, self.round, self.local_step, self.samples_per_s, self.counters.rounds_ok, sealed)

    def _status_snapshot(self) -> dict:
        book = self._book
        return {
            "state": self.state,
            "round": self.round,
            "step": self.local_step,
            "last_group": self.evidence.last_group,
            "samples_per_s_milli": milli(book.samples_per_s) or 0,
            "loss_milli": milli(book.last_loss),
            "val_loss_milli": milli(book.shown_val_loss),
        }

    def _set_state(self, state: str) -> None:
        self.state = state
        if self.presence is not None:
            self.presence.changed()

    def step(self, *, num_samples: int = 1, loss: float | None = None) -> RoundResult | None:
        """One inner optimizer step (and zero_grad); every ``sync_every`` steps also an averaging round, whose
        result it returns (else None). Over the first ``inner_warmup_steps`` steps the learning rates are
        scaled by ``step / inner_warmup_steps`` for the step only (a user's scheduler keeps its values).
        ``loss`` (optional) is only reported: status board and metrics."""
        book = self._book
        step_with_lr_factor(self.inner_optimizer, self.inner_lr_factor())
        self.inner_optimizer.zero_grad(set_to_none=True)
        self.local_step += 1
        book.samples_since_sync += num_samples
        if loss is not None:
            book.last_loss = float(loss)
        if self.evidence.metrics is not None:
            rate = book.samples_since_sync / max(time.perf_counter() - book.last_sync_end, 1e-9)
            self.evidence.metrics.observe_step(
                step=self.local_step, samples=num_samples, loss=book.last_loss, samples_per_s=rate
            )
        return self.sync() if self.local_step % self.config.sync_every == 0 else None

    def inner_lr_factor(self) -> float:
        """The factor on the inner optimizer's learning rate for the next local step (the warm-up)."""
        return warmup_factor(self.local_step + 1, self.config.inner_warmup_steps)

    def sync(self) -> RoundResult:
        """Average pseudo-gradients with a group now and apply the outer step. Never blocks past
        ``round_timeout_s`` (plus a second all-reduce of the global state when members disagree on it)."""
        book, timeout_s = self._book, self.config.averaging.round_timeout_s
        started = time.perf_counter()
        book.samples_per_s = book.samples_since_sync / max(started - book.last_sync_end, 1e-9)
        samples, weight = int(book.samples_since_sync), float(max(book.samples_since_sync, 1))
        local = [p.detach().to("cpu", torch.float32) for p in self.outer.params]
        for hook in self.before_sync:
            hook(self.round, local)
        pseudo = self.outer.pseudo_gradient(local)
        newest = self.checkpoints.newest_digest() if self.checkpoints is not None else None
        fresh = self.counters.rounds_ok + self.counters.rounds_solo == 0
        gather = rounds.gather_metadata(self.round, samples, self.binding, pseudo.digest, newest, fresh=fresh)
        try:
            averaged, record, group = self.group_averager.step(
                pseudo.delta, weight=weight, gather=gather, timeout_s=timeout_s
            )
        except Exception as e:  # a failed round must not kill training; the update is applied alone
            logger.warning("averaging round failed: %r; applying this peer's update alone", e)
            averaged, record, group = None, None, None
        grouped = averaged is not None and group is not None
        rejected: tuple[str, ...] = ()
        new_state = None
        if grouped:
            problems = rounds.check_gathered(group.gathered)
            self.counters.rejected.update(problems.values())
            for peer_id, reason in problems.items():
                logger.warning("round %s: rejected metadata from %s: %s", self.round, peer_id, reason)
            rejected = tuple(problems)
            agree = rounds.base_agreement_group(group, record, self.peer_id)
            if agree is not None:
                new_state, agreement = self.group_averager.average_in_group(
                    agree, pseudo.state, weight=1.0, codec="fp32", timeout_s=timeout_s
                )
                if new_state is None:
                    logger.info("round %s: diverged bases not averaged: %s", self.round, agreement.failures[:3])
            next_round = rounds.next_round(self.round, group.gathered)
            self.counters.rounds_ok += 1
            book.solo_streak = 0
            self.presence.recent.add(group.members)
        else:
            averaged, next_round = pseudo.delta, self.round + 1
            self.counters.rounds_solo += 1
            book.solo_streak += 1
            self.presence.reconnect()
        self.outer.step(averaged, next_round=next_round, new_state=new_state)
        book.samples_since_sync = 0
        size, duration = len(group.members) if grouped else 1, time.perf_counter() - started
        self.last_round = RoundResult(
            round=self.round, group_size=size, weight=weight, duration_s=duration, rejected=rejected, record=record
        )
        self._after_round(group if grouped else None, record, samples=samples)
        return self.last_round

    def _after_round(self, group: Any | None, record: Any | None, *, samples: int) -> None:
        """Evaluate, watch for divergence, keep the evidence, seal and swap receipts; resync a lagging peer."""
        book = self._book
        val_loss = float(self.evaluate()) if group is not None and self.evaluate is not None else None
        if val_loss is not None:  # the new global parameters, the same on every member
            book.last_val_loss = book.shown_val_loss = val_loss
        rising = book.divergence.observe(val_loss, round_=self.round)
        if rising is not None:
            logger.warning(rising.message(sync_every=self.config.sync_every, outer=self.outer.settings))
            self.evidence.record("diverging", rising.to_dict())
        entry = rounds.round_entry(
            self.last_round, self.local_step, samples, book.samples_per_s, val_loss, group is None
        )
        self.evidence.round(entry, group=group, record=record, peer_id=self.peer_id)
        if group is not None and self.checkpoints is not None:
            every = self.config.checkpoint.checkpoint_every
            sealing = bool(every) and self.round % every == 0
            seal = (
                rounds.seal_request(group, val_loss, state=self.outer.state_dict, step=self.round) if sealing else None
            )
            receipt = rounds.sign_participation(
                self.identity, self.config.run, self.round, group, record, samples, ledger=self.evidence.ledger
            )
            self.checkpoints.finish_round_async(receipt=receipt, seal=seal)
        sources = {"metadata": self.counters.rejected, "record": self.presence.graph.rejections.counts}
        if self.checkpoints is not None:
            sources.update(self.checkpoints.rejections())
        for what, counts in sources.items():
            self.evidence.rejections(what, counts, round_=self.round)
        if self.evidence.metrics is not None:
            self.evidence.metrics.set_peers_known(len(self.presence.run_peers()))
        self._resync_if_lagging()
        book.last_sync_end = time.perf_counter()

    def _resync_if_lagging(self, max_solo_rounds: int = 3) -> None:
        """A peer cut off from the others for a few rounds takes the run's newest sealed state again, but
        only state sealed at a later round than its own: a peer left alone (the others died or left)
        keeps training forward instead of rolling back to the last checkpoint it sealed with them."""
        if self.checkpoints is None or self._book.solo_streak < max_solo_rounds:
            return
        streak, before = self._book.solo_streak, self.round
        self._book.solo_streak = 0  # looked again after another max_solo_rounds solo rounds
        if self.load_state(timeout_s=self.config.load_state_timeout_s, reason="resync", newer_than=before):
            logger.info("cut off for %s rounds: re-synced from round %s to sealed round %s", streak, before, self.round)

    def load_state(self, *, timeout_s: float, reason: str = "join", newer_than: int | None = None) -> bool:
        """Resume from the run's newest sealed checkpoint, verified end to end; True if one was loaded. With
        ``newer_than`` only one sealed after that round is taken (never an older state than this peer's).
        Nothing unverified is loaded (before the first seal all start from the seeded genesis model)."""
        if self.checkpoints is None:
            return False
        manifest, problem = self.checkpoints.resume(
            self.outer, timeout_s=timeout_s, newer_than=newer_than, reason=reason
        )
        if problem is not None:
            self.counters.rejected[problem] += 1
        if manifest is not None:
            self.counters.state_loaded += 1
            self.counters.state_verified += 1
            self.group_averager.vouch(manifest.participants)  # its signers: the run's core in a Sybil flood
        return manifest is not None

    def interrupt(self) -> None:
        """Abandon the averaging round in progress at once (the update is applied alone); for Ctrl+C."""
        if self.group_averager is not None:
            self.group_averager.interrupt()

    def shutdown(self, *, reason: str | None = None) -> None:
        """Leave the run: withdraw the record, stop the averager, then the DHT if this trainer started it.
        The ledger's last entry is "stop" with ``reason`` (e.g. the signal's name). Idempotent."""
        for part in ("presence", "checkpoints", "group_averager"):
            if getattr(self, part, None) is not None:
                getattr(self, part).close()
        if getattr(self, "evidence", None) is not None:
            if self.evidence.ledger is not None:
                self.evidence.record("stop", {"step": self.local_step, "round": self.round, "signal": reason})
            self.evidence.close()
        if getattr(self, "_owns_dht", False) and getattr(self, "dht", None) is not None:
            stop_dht(self.dht)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
