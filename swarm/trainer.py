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
from pathlib import Path
from typing import Any

import torch
from hivemind import DHT

from averaging import GroupAverager, RoundRecord
from bootstrap import start_reaper, stop_dht
from bootstrap.identity import Identity
from bootstrap.network import start_swarm_dht
from peers import ResourceGraph
from swarm import rounds
from swarm._private.divergence import DivergenceGuard
from swarm._private.evidence import Evidence, milli, open_evidence
from swarm.checkpoint.manifest import MANIFEST_REJECTIONS
from swarm.checkpoint.sync import CheckpointManager
from swarm.config import RunMismatch, TaskInfo, TrainerConfig
from swarm.ledger import GENESIS
from swarm.ledger.receipts import sign_receipt
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

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *,
                 config: TrainerConfig | None = None, dht: DHT | None = None, identity: Identity | None = None,
                 task_info: TaskInfo | None = None, evaluate: Callable[[], float] | None = None, **overrides: Any):
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
        self.outer = DiLoCo(names, params, self.config.outer())
        """The outer optimizer: global parameters, outer momentum, the run's round counter."""
        self.task_info = (task_info or TaskInfo()).for_params(names, params)
        self.evidence = Evidence()
        """This trainer's ledger, status board entry and metrics (see ``swarm._private.evidence``)."""
        self._book = rounds.RoundBook(started_at=time.time(), last_sync_end=time.perf_counter(),
                                      divergence=DivergenceGuard(rounds=self.config.divergence_rounds))
        self.presence: Presence | None = None
        self.group_averager: GroupAverager | None = None
        self.checkpoints: CheckpointManager | None = None
        self.identity.lock()
        start_reaper()
        self._owns_dht = dht is None
        net = self.config.network
        self.dht = dht if dht is not None else start_swarm_dht(
            self.identity, initial_peers=self.config.initial_peers, host_maddrs=net.host_maddrs,
            announce_maddrs=net.announce_maddrs, connect_timeout_s=net.connect_timeout_s)
        self.binding = self.identity.bind(self.peer_id)
        try:
            self._wire()
        except BaseException:
            self.shutdown()
            raise

    def _wire(self) -> None:
        cfg, own = self.config, self.identity.peer_id == self.peer_id
        if not own:
            logger.warning("no ledger, record or sealed checkpoints: the DHT's peer ID is not this trainer's "
                           "identity (pass no dht=)")
        self.evidence = open_evidence(self.identity, run=cfg.run, task=self.task_info.name, ledger_dir=(
            cfg.checkpoint.ledger_dir if own else ""), metrics=cfg.metrics)
        graph = ResourceGraph(self.dht)
        requirements = check_run(graph, run=cfg.run, task=self.task_info, device=self.device,
                                 own=cfg.requirements.requirements())
        run = RunFacts(name=cfg.run, task=self.task_info.name, preset=self.task_info.preset,
                       config_digest=self.task_info.config_digest, requirements=requirements)
        self.presence = Presence(self.dht, self.identity, graph, config=cfg.presence, run=run, device=self.device,
                                 view=self._view, status_snapshot=self._status_snapshot,
                                 initial_peers=cfg.initial_peers)
        self.evidence.status = self.presence.status
        self.group_averager = GroupAverager(self.dht, prefix=f"swarm_{cfg.run}", config=cfg.averaging,
                                            bandwidth_mbps=self.presence.bandwidth_mbps, region=cfg.presence.region)
        if own:
            ck = cfg.checkpoint
            self.checkpoints = CheckpointManager(
                self.dht, identity=self.identity, run_id=cfg.run, task=self.task_info.name,
                config_digest=self.task_info.config_digest, keep_last=ck.keep_checkpoints,
                directory=Path(ck.checkpoint_dir).expanduser() / cfg.run / self.peer_id,
                run_peers=self.presence.run_peers, on_event=self.evidence.checkpoint_event)
        if cfg.load_state:
            self.load_state(timeout_s=cfg.load_state_timeout_s)
        self._set_state("training")
        newest = self.checkpoints.newest_digest() if self.checkpoints is not None else None
        self.evidence.record("joined", {
            "round": self.round, "step": self.local_step, "state_loaded": self.counters.state_loaded > 0,
            "state_verified": self.counters.state_verified > 0, "join_s": time.time() - self._book.started_at,
            "manifest": newest[1] if newest and self.counters.state_verified else None})

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
    last_val_loss = property(lambda self: self._book.last_val_loss,
                             lambda self, value: setattr(self._book, "last_val_loss", value),
                             doc="The last value of ``evaluate()``, taken after each grouped round (None once cleared).")

    def _view(self) -> PeerView:
        return PeerView(state=self.state, round=self.round, step=self.local_step, samples_per_s=self.samples_per_s,
                        rounds_completed=self.counters.rounds_ok,
                        checkpoints_cosigned=self.checkpoints.sealed if self.checkpoints is not None else 0)

    def _status_snapshot(self) -> dict:
        return {"state": self.state, "round": self.round, "step": self.local_step,
                "samples_per_s_milli": milli(self.samples_per_s) or 0, "loss_milli": milli(self.last_loss),
                "val_loss_milli": milli(self._book.shown_val_loss), "last_group": self.evidence.last_group}

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
            elapsed = max(time.perf_counter() - book.last_sync_end, 1e-9)
            self.evidence.metrics.observe_step(step=self.local_step, samples=num_samples, loss=book.last_loss,
                                               samples_per_s=book.samples_since_sync / elapsed)
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
        gather = rounds.gather_metadata(round_=self.round, samples=samples, binding=self.binding,
                                        state_digest=pseudo.digest, now=int(time.time()), sealed=newest,
                                        fresh=self.counters.rounds_ok + self.counters.rounds_solo == 0)
        try:
            averaged, record, group = self.group_averager.step(pseudo.delta, weight=weight, gather=gather,
                                                               timeout_s=timeout_s)
        except Exception as e:  # a failed round must not kill training; the update is applied alone
            logger.warning(f"averaging round failed: {e!r}; applying this peer's update alone")
            averaged, record, group = None, None, None
        grouped = averaged is not None and group is not None
        rejected: tuple[str, ...] = ()
        new_state = None
        if grouped:
            problems = rounds.check_gathered(group.gathered)
            self.counters.rejected.update(problems.values())
            for peer_id, reason in problems.items():
                logger.warning(f"round {self.round}: rejected metadata from {peer_id}: {reason}")
            rejected = tuple(problems)
            agree = rounds.base_agreement_group(group, record, self.peer_id)
            if agree is not None:
                new_state, agreement = self.group_averager.average_in_group(agree, pseudo.state, weight=1.0,
                                                                            codec="fp32", timeout_s=timeout_s)
                if new_state is None:
                    logger.info(f"round {self.round}: could not average the diverged bases: {agreement.failures[:3]}")
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
        self.last_round = RoundResult(round=self.round, group_size=len(group.members) if grouped else 1,
                                      weight=weight, duration_s=time.perf_counter() - started, rejected=rejected,
                                      record=record)
        val_loss = float(self.evaluate()) if grouped and self.evaluate is not None else None  # the new global params
        if val_loss is not None:
            book.last_val_loss = book.shown_val_loss = val_loss
        rising = book.divergence.observe(val_loss, round_=self.round)
        if rising is not None:
            logger.warning(rising.message(sync_every=self.config.sync_every, outer=self.outer.settings))
            self.evidence.record("diverging", rising.to_dict())
        self.evidence.round(rounds.round_entry(
            round_=self.round, step=self.local_step, group_size=self.last_round.group_size,
            duration_s=self.last_round.duration_s, samples=samples, samples_per_s=book.samples_per_s,
            val_loss=val_loss, solo=not grouped, rejected=rejected, record=record),
            group=group if grouped else None, record=record, peer_id=self.peer_id)
        if grouped and self.checkpoints is not None:
            every = self.config.checkpoint.checkpoint_every
            seal = rounds.seal_request(group, val_loss, state=self.outer.state_dict, step=self.round) \
                if every and self.round % every == 0 else None
            self.checkpoints.finish_round_async(receipt=self._sign_receipt(group, record, samples=samples), seal=seal)
        self._record_rejections()
        if self.evidence.metrics is not None:
            self.evidence.metrics.set_peers_known(len(self.presence.run_peers()))
        self._resync_if_lagging()
        book.last_sync_end = time.perf_counter()
        return self.last_round

    def _record_rejections(self) -> None:
        """Rejected untrusted input seen since the last round, by source and reason, into the ledger."""
        sources = {"metadata": self.counters.rejected, "record": self.presence.graph.rejections.counts,
                   "manifest": MANIFEST_REJECTIONS}
        if self.checkpoints is not None:
            sources["receipt"] = self.checkpoints.receipt_rejections
            sources["gossip"] = self.checkpoints.gossip.rejected
        for what, counts in sources.items():
            self.evidence.rejections(what, counts, round_=self.round)

    def _resync_if_lagging(self, max_solo_rounds: int = 3) -> None:
        """A peer cut off from the others for a few rounds takes the run's newest sealed state again, but
        only state sealed at a later round than its own: a peer left alone (the others died or left)
        keeps training forward instead of rolling back to the last checkpoint it sealed with them."""
        if self.checkpoints is None or self._book.solo_streak < max_solo_rounds:
            return
        streak, before = self._book.solo_streak, self.round
        self._book.solo_streak = 0  # looked again after another max_solo_rounds solo rounds
        if self.load_state(timeout_s=self.config.load_state_timeout_s, reason="resync", newer_than=before):
            logger.info(f"was cut off for {streak} rounds: re-synced from round {before} to the run's newer "
                        f"sealed round {self.round}")

    def _sign_receipt(self, group: Any, record: RoundRecord | None, *, samples: int) -> Any:
        """This peer's signed participation receipt of a grouped round (None: no evidence, training goes on)."""
        ledger = self.evidence.ledger
        try:
            receipt = rounds.participation_receipt(
                run=self.config.run, round_=self.round, group=group, record=record, peer_id=self.peer_id,
                samples=samples, ledger_head=ledger.head() if ledger is not None else (0, GENESIS), now=time.time())
            return sign_receipt(receipt, self.identity) if receipt is not None else None
        except ValueError as e:  # e.g. a group larger than a receipt may name
            logger.warning(f"round {self.round}: no participation receipt: {e}")
            return None

    def load_state(self, *, timeout_s: float, reason: str = "join", newer_than: int | None = None) -> bool:
        """Resume from the run's newest sealed checkpoint, verified end to end; True if one was loaded. With
        ``newer_than`` only one sealed after that round is taken (never an older state than this peer's).
        Nothing unverified is ever loaded: before the first seal every peer starts from the same seeded
        model, the run's genesis state."""
        started = time.monotonic()
        manifest, problem = (None, None) if self.checkpoints is None else self.checkpoints.resume(
            self.outer, timeout_s=timeout_s, newer_than=newer_than)
        if problem is not None:
            self.counters.rejected[problem] += 1
        if manifest is None:
            logger.info("no sealed checkpoint of this run yet: starting from the model as given (the run's genesis)"
                        if newer_than is None else f"no sealed checkpoint of this run after round {newer_than}: "
                        f"training on from this peer's own")
            return False
        self.counters.state_loaded += 1
        self.counters.state_verified += 1
        self.evidence.record("state_synced", {
            "round": self.round, "step": manifest.step, "manifest": manifest.digest(),
            "seconds": time.monotonic() - started, "reason": reason, "participants": len(manifest.participants)})
        return True

    def interrupt(self) -> None:
        """Abandon the averaging round in progress at once (the update is applied alone); for Ctrl+C."""
        if self.group_averager is not None:
            self.group_averager.interrupt()

    def shutdown(self, *, reason: str | None = None) -> None:
        """Leave the run: withdraw the record, stop the averager, then the DHT if this trainer started it.
        The ledger's last entry is "stop" with ``reason`` (e.g. the signal's name). Idempotent."""
        for part in ("presence", "checkpoints", "group_averager"):
            component = getattr(self, part, None)
            if component is not None:
                component.close()
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
