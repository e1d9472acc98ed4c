"""Byzantine updates (TESTMATRIX row 9): K of N peers poison every round; val loss against a clean run.

    python -m benchmarks.byzantine [--peers 4] [--attackers 1] [--rounds 6] [--sync-every 10] [--attack all]
                                   [--seed 0] [--aggregators centered_clip trimmed_mean mean]
                                   [--out benchmarks/results/byzantine.json]

Every arm trains charlm/tiny with ``--peers`` in-process ``swarm.Trainer`` peers (the real DiLoCo
trainer: ``--sync-every`` local AdamW steps, then the group averages its pseudo-gradients with the
real ``GroupAverager`` over P2P streams -- the trainer's default int8 codec -- and applies the outer
Nesterov step). Peer i trains on shard i of N; the model seed, the batches and the number of samples
are the same in every arm. Each peer has its own loopback DHT node whose key is its identity's, shared
by all arms; each arm is a run of its own. The peers wait for each other before every round (a
barrier), so every round is a full group and the arms differ only in what is averaged.

Arms: ``clean`` (no attacker, CenteredClip, the default aggregator) and ``clean/mean`` (no attacker, the
plain mean), then for each attack and each of ``--aggregators``, the last ``--attackers`` peers are
byzantine. They train honestly, collude, and see every honest update of the round before they send
(the omniscient threat model of the ALIE and history-aware attacks). Their averagers put on the wire,
every round:

* ``sign_flip_x10``: -10 x its pseudo-gradient, with its honest weight (its sample count);
* ``nan``: a pseudo-gradient of NaN. Our own encoder refuses non-finite vectors, so the attacker runs
  one that does not (a malicious peer runs whatever code it likes): the NaN bytes really reach the
  reducers;
* ``huge_weight``: its pseudo-gradient sign-flipped (an honest norm, so only the weight is big),
  claiming the largest weight reducers accept (the trainer's ``max_weight``, 1e9, against about
  ``sync_every x batch`` samples of an honest peer). Weights beyond ``max_weight`` (and NaN,
  negative) are TESTMATRIX row 10 and are rejected outright. When the trainer caps each weight at a
  multiple of its group's median (``TrainerConfig.max_weight_ratio``), one more arm runs this attack
  on the default aggregator with the cap off (``.../no-cap``);
* ``alie`` ("a little is enough", Baruch et al. 2019): the honest mean minus ``ALIE_Z`` honest standard
  deviations, per coordinate, from every attacker: inside the honest spread, coordinate by coordinate;
* ``history`` (after the relocated orthogonal perturbation of Ozfatura et al., arXiv 2208.09894, which
  took up to 33% accuracy from CenteredClip): the honest mean plus ``scale`` median honest distances
  along one fixed direction, half against the honest mean and half orthogonal to it, so that the
  outer momentum adds it up round after round. It learns from every round's result: ``scale`` grows
  1.5x after a round whose result moved with it as much as a plain mean would have (it was neither
  clipped nor left out) and shrinks 0.6x otherwise (``HISTORY_START`` 1, floor ``HISTORY_FLOOR``), so it
  settles at the edge of what the rule lets through. Its scales are in the JSON.

Evidence, per arm: the parts the attackers sent with a poisoned contribution (counted at their averagers'
``send`` fault-injection point, keyed by (peer, round, phase, action) like ``averaging.FaultInjector``),
and for each round of the attackers' group what became of them, from the honest members' round records
and contributions: ``dropped`` (not in ``included``: refused at decode or rejected by validation; the
reducers' refusal counters are reported too), ``clipped`` (included, but they moved the result by less
than half of what the plain weighted mean would have; a rule that leaves an input out by itself, as
the default CenteredClip does with gross outliers, counts here, with a pull near 0), or ``passed``.
``pull`` is that ratio, ``|result - honest mean| / |plain mean - honest mean|``, averaged over the
rounds they were included (0 for nothing, 1 for the mean; the int8 codec adds a little).

Verdict (exit status 1 if any check fails): the clean run's loss falls by 10% or more; the default rule
ends within ``HONEST_TOLERANCE`` (1%) of the plain mean with no attacker; every attack fired; every robust
aggregator ends within ``ROBUST_TOLERANCE`` (10%) of the clean run's loss; the plain mean (negative
control) ends non-finite or at least ``CONTROL_FACTOR`` (1.5x) the clean loss -- except for ``nan``, which
no aggregator ever sees (a non-finite part is refused at decode, before any rule), so there the mean
must hold too and every poisoned part must have been dropped; for ``huge_weight`` under a weight cap,
which applies to every rule (the mean's figure and the no-cap arm's are reported, not judged); and for
the attacks inside the honest spread (``alie``, ``history``), whose point is to pass as honest: the
mean's figure under them is reported, not judged.

The nan arms are the slow ones: a refused part is waited for until the sender deadline, and the
attacker, left without a result, applies its own update alone; from then on its state differs, so
the honest members run the trainer's second all-reduce of their bases, which the attacker (whose
round failed) never joins, and which fails after the sender deadline plus the 5 s agreement timeout
each round. The reducers' refusal counters therefore also count that all-reduce's broken streams.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from benchmarks._common import run_metadata, signals_unwind
from bootstrap.cli import add_dataclass_arguments, dataclass_from_args

RESULTS = Path(__file__).parent / "results" / "byzantine.json"
ATTACKS = ("sign_flip_x10", "nan", "huge_weight", "alie", "history")
AGGREGATORS = ("centered_clip", "trimmed_mean", "mean")
DEFAULT_AGGREGATOR = "centered_clip"
PRESET = "tiny"
LR = 3e-3
"""Inner AdamW learning rate (swarm.peer's default)."""
WEIGHT_DECAY = 0.01
ROBUST_TOLERANCE = 0.10
"""A robust aggregator under attack may end at most this much above the clean run's val loss."""
CONTROL_FACTOR = 1.5
"""The plain mean under attack must end at least this many times the clean loss (or non-finite)."""
MIN_CLEAN_DROP = 0.10
"""The clean run's val loss must fall by at least this fraction, or the comparison says nothing."""
CLIPPED_PULL = 0.5
"""An included attacker counts as clipped when it moved the result less than this share of the mean's move."""
MEAN_SURVIVES = frozenset({"nan"})
"""Attacks refused before any aggregator runs, so the plain mean must survive them too."""
IN_SPREAD = frozenset({"alie", "history"})
"""Attacks that stay inside the honest spread: the plain mean's figure under them is reported, not judged."""
HONEST_TOLERANCE = 0.01
"""With no attacker, the default aggregator must end within this much of the plain mean's val loss."""
ALIE_Z = 1.0
"""ALIE's shift in honest standard deviations. Baruch et al.'s own z_max, from the normal quantile of the share
of peers the attackers must sway, is 0 for 1 attacker of 4 (a no-op) and 0.32 for 2 of 8: 1.0 is stronger."""
HISTORY_START = 1.0
"""The history-aware attack's first offset, in median honest distances from the honest mean."""
HISTORY_FLOOR = 0.3
"""The smallest offset it backs off to."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ByzantineConfig:
    """What the byzantine benchmark trains and which attacks it runs."""

    peers: int = 4
    """Peers of every arm; the last ``attackers`` of them are byzantine in the attacked arms."""
    attackers: int = 1
    """Byzantine peers of each attacked arm (they collude); fewer than half of ``peers``."""
    rounds: int = 6
    """Averaging rounds of every arm."""
    sync_every: int = 10
    """Local steps of each peer between averaging rounds."""
    attack: str = "all"
    """sign_flip_x10, nan, huge_weight, alie, history, or all."""
    aggregators: tuple[str, ...] = AGGREGATORS
    """Aggregators run under each attack; mean is the negative control (the clean arm always uses centered_clip)."""
    seed: int = 0
    """Seed of the initial model and of the batch order."""
    sender_timeout_s: float = 2.0
    """Reducers wait this long for a part (a refused NaN part is waited for until then)."""

    def __post_init__(self) -> None:
        if self.peers < 3:
            raise ValueError(f"peers must be >= 3 (one attacker needs an honest majority), got {self.peers!r}")
        if not 1 <= self.attackers < self.peers / 2:
            raise ValueError(f"attackers must be >= 1 and fewer than half of peers, got {self.attackers!r}")
        if self.rounds < 1 or self.sync_every < 1:
            raise ValueError(f"rounds and sync_every must be >= 1, got {self.rounds!r} and {self.sync_every!r}")
        if self.attack not in (*ATTACKS, "all"):
            raise ValueError(f"attack must be one of {', '.join(ATTACKS)} or all, got {self.attack!r}")
        unknown = [a for a in self.aggregators if a not in AGGREGATORS]
        if unknown or not self.aggregators:
            raise ValueError(f"aggregators must be some of {', '.join(AGGREGATORS)}, got {self.aggregators!r}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if not (math.isfinite(self.sender_timeout_s) and 0 < self.sender_timeout_s <= 60):
            raise ValueError(f"sender_timeout_s must be in (0, 60], got {self.sender_timeout_s!r}")

    @property
    def attacks(self) -> tuple[str, ...]:
        return ATTACKS if self.attack == "all" else (self.attack,)


@dataclass(frozen=True, kw_only=True, slots=True)
class Arm:
    name: str
    attack: str | None
    aggregator: str
    uncapped: bool = False
    """Run with the trainer's weight cap (``max_weight_ratio``) switched off."""


def trainer_weight_cap() -> float | None:
    """The trainer's default cap on a weight, as a multiple of its group's median; None: it has none."""
    from swarm.trainer import TrainerConfig

    return TrainerConfig(run="probe").averaging.max_weight_ratio or None


def arms_of(config: ByzantineConfig) -> list[Arm]:
    """The clean arm, every (attack, aggregator) pair, and, when the trainer caps weights, huge_weight
    on the default aggregator with the cap off: the negative control of a defence that is not the rule."""
    arms = [Arm(name="clean", attack=None, aggregator=DEFAULT_AGGREGATOR)]
    if "mean" in config.aggregators:  # honest-only, the default rule against the plain mean
        arms.append(Arm(name="clean/mean", attack=None, aggregator="mean"))
    for attack in config.attacks:
        arms += [
            Arm(name=f"{attack}/{aggregator}", attack=attack, aggregator=aggregator)
            for aggregator in config.aggregators
        ]
        if attack == "huge_weight" and trainer_weight_cap() is not None:
            arms.append(
                Arm(
                    name=f"{attack}/{DEFAULT_AGGREGATOR}/no-cap",
                    attack=attack,
                    aggregator=DEFAULT_AGGREGATOR,
                    uncapped=True,
                )
            )
    return arms


# --- the attacker ---------------------------------------------------------------------------------


class Adversary:
    """What the byzantine peers of one arm send, as one colluding party (the threat model of ALIE and of the
    history-aware attack: the attackers see every honest update of the round before they send theirs).

    Every peer puts the tensor it is about to send on a board (`publish`); an attacker's `poison` waits for the
    honest peers' tensors of the same call (every peer calls its averager once per round, after a barrier).
    """

    def __init__(self, attack: str, *, honest: int, attackers: int, seed: int) -> None:
        self.attack, self.honest, self.attackers = attack, honest, attackers
        self._cond = threading.Condition()
        self._making = threading.Lock()
        self._judged: set[int] = set()
        self._board: dict[int, dict[int, torch.Tensor]] = {}
        self._made: dict[int, torch.Tensor] = {}
        self._generator = torch.Generator().manual_seed(seed + 1)
        self._direction: torch.Tensor | None = None
        self.scale = HISTORY_START
        """The history-aware attack's distance from the honest mean, in median honest distances (it adapts)."""
        self.scales: list[float] = []

    def publish(self, call: int, peer: int, tensor: torch.Tensor) -> None:
        if peer < self.honest:
            with self._cond:
                self._board.setdefault(call, {})[peer] = tensor.detach().to(torch.float64, copy=True)
                self._cond.notify_all()

    def _honest(self, call: int) -> torch.Tensor:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._board.get(call, ())) == self.honest, timeout=120):
                raise TimeoutError(f"the honest peers' updates of call {call} did not all arrive")
            return torch.stack([self._board[call][peer] for peer in range(self.honest)])

    def poison(
        self, call: int, tensor: torch.Tensor, weight: float, *, max_weight: float
    ) -> tuple[torch.Tensor, float]:
        """What a byzantine peer sends instead of (``tensor``, ``weight``) at its ``call``-th round."""
        if self.attack == "sign_flip_x10":
            return -10.0 * tensor, weight
        if self.attack == "nan":
            return torch.full_like(tensor, float("nan")), weight
        if self.attack == "huge_weight":
            return -tensor, float(max_weight)
        with self._making:  # the colluding attackers send one vector, made once
            made = self._made.get(call)
            if made is None:
                made = self._made[call] = self._alie(call) if self.attack == "alie" else self._history(call)
        return made.to(torch.float32), weight

    def _alie(self, call: int) -> torch.Tensor:
        """ALIE, "a little is enough" (Baruch et al., NeurIPS 2019): mean - z x std of the honest updates, per coordinate."""
        honest = self._honest(call)
        return honest.mean(0) - ALIE_Z * honest.std(0)

    def _history(self, call: int) -> torch.Tensor:
        """The honest mean plus ``scale`` median honest distances along a fixed direction, half against the honest
        mean and half orthogonal to it (the same orthogonal part every round, so that the outer momentum adds it
        up; the relocated orthogonal perturbation of Ozfatura et al., arXiv 2208.09894, in our setting)."""
        honest = self._honest(call)
        mean = honest.mean(0)
        if self._direction is None:
            self._direction = torch.randn(mean.numel(), generator=self._generator, dtype=torch.float64)
        unit = mean / mean.norm()
        orthogonal = self._direction - (self._direction @ unit) * unit
        direction = orthogonal / orthogonal.norm() - unit
        spread = float((honest - mean).norm(dim=1).median())
        self.scales.append(self.scale)
        return mean + self.scale * spread * direction / direction.norm()

    def observe(self, call: int, result: torch.Tensor | None) -> None:
        """The history-aware attack learns from the round's result: pushed further when the result moved with it
        as a plain mean would have, drawn back inside the honest spread when it was clipped or dropped."""
        if self.attack != "history":
            return
        with self._cond:
            sent, honest = self._made.get(call), self._board.get(call)
            if sent is None or honest is None or call in self._judged:
                return
            self._judged.add(call)
        mean = torch.stack(list(honest.values())).mean(0)
        offset = sent - mean
        along = 0.0 if result is None else float((result.double() - mean) @ offset) / float(offset.norm())
        plain = self.attackers * float(offset.norm()) / (self.honest + self.attackers)
        self.scale = self.scale * 1.5 if along > 0.7 * plain else max(HISTORY_FLOOR, 0.6 * self.scale)


def encode_as_is(codec: Any, t: torch.Tensor) -> bytes:
    """``codec``'s wire format of ``t`` with its non-finite values kept (our encoders refuse them)."""
    if codec.name == "fp32":
        return t.numpy().astype("<f4").tobytes()
    if codec.name == "fp16":
        return t.to(torch.float16).numpy().astype("<f2").tobytes()
    if codec.name == "int8":  # header, one float32 absmax per block, codes: the blocks holding NaN get a NaN absmax
        data = bytearray(codec.encode(torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)))
        num_blocks = -(-t.numel() // codec.blocksize)
        start = codec.wire_bytes(t.numel()) - 4 * num_blocks - t.numel()  # the header's size
        absmax = np.frombuffer(data, dtype="<f4", count=num_blocks, offset=start).copy()
        padded = torch.zeros(num_blocks * codec.blocksize, dtype=torch.bool)
        padded[: t.numel()] = ~torch.isfinite(t)
        absmax[padded.view(num_blocks, -1).any(dim=1).numpy()] = np.nan
        data[start : start + 4 * num_blocks] = absmax.tobytes()
        return bytes(data)
    raise ValueError(f"no as-is encoding for codec {codec.name!r}")


class _AsIsCodec:
    """The attacker's codec: the real one, except that it puts non-finite vectors on the wire too."""

    def __init__(self, codec: Any):
        self._codec = codec

    def __getattr__(self, name: str) -> Any:
        return getattr(self._codec, name)

    def encode(self, t: torch.Tensor) -> bytes:
        return self._codec.encode(t) if bool(torch.isfinite(t).all()) else encode_as_is(self._codec, t)


@contextmanager
def attacker_codecs(attacker_loops: set) -> Iterator[None]:
    """While active, averagers running on one of ``attacker_loops`` encode with ``_AsIsCodec``.

    The averager looks its codec up by name in ``averaging.group`` on its own event loop; every other
    averager of this process keeps the real codecs (an honest peer whose update went non-finite still
    has it refused by its own encoder)."""
    from averaging import group as group_module

    real = group_module.get_codec

    def get_codec(name: str) -> Any:
        codec = real(name)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return codec
        return _AsIsCodec(codec) if loop in attacker_loops else codec

    group_module.get_codec = get_codec
    try:
        yield
    finally:
        group_module.get_codec = real


@dataclass
class Attacker:
    """Makes one trainer's averager byzantine and counts what fired, keyed by (peer, round, phase, action)."""

    adversary: Adversary
    name: str
    fired: Counter = field(default_factory=Counter)
    """(peer, round, "send", attack) -> parts sent to a reducer with a poisoned contribution."""
    poisoned_rounds: int = 0
    """Rounds whose contribution this peer poisoned."""
    _armed: bool = False

    def attach(self, averager: Any) -> None:
        original, calls = averager.step, itertools.count()

        def step(tensor: torch.Tensor, *, weight: float, **round_args: Any) -> Any:
            call = next(calls)
            bad, bad_weight = self.adversary.poison(call, tensor, weight, max_weight=averager.config.max_weight)
            self.poisoned_rounds += 1
            self._armed = True
            try:
                outcome = original(bad, weight=bad_weight, **round_args)
            finally:
                self._armed = False
            self.adversary.observe(call, outcome[0])
            return outcome

        async def hook(round_: int, phase: str, _peer: str) -> None:
            if phase == "send" and self._armed:
                self.fired[(self.name, round_, phase, self.adversary.attack)] += 1

        averager.step = step
        averager.fault_hook = hook

    @property
    def parts_sent(self) -> int:
        return sum(self.fired.values())


# --- one arm --------------------------------------------------------------------------------------


@dataclass
class Observation:
    """One peer's side of one round: what it put in (after any poisoning) and what it got back."""

    peer: int
    sent: torch.Tensor
    weight: float
    result: torch.Tensor | None
    record: Any


def observe(
    averager: Any, peer: int, log: list[Observation], lock: threading.Lock, adversary: Adversary | None = None
) -> None:
    """Record every round of ``averager`` into ``log`` (what was sent on the wire, and the result); an honest
    peer's update also goes on ``adversary``'s board before it is sent."""
    original, calls = averager.step, itertools.count()

    def step(tensor: torch.Tensor, *, weight: float, **round_args: Any) -> Any:
        if adversary is not None:
            adversary.publish(next(calls), peer, tensor)
        result, record, group = original(tensor, weight=weight, **round_args)
        with lock:
            log.append(
                Observation(
                    peer=peer,
                    sent=tensor.detach().clone(),
                    weight=float(weight),
                    result=None if result is None else result.clone(),
                    record=record,
                )
            )
        return result, record, group

    averager.step = step


def _weighted_mean(observations: list[Observation]) -> torch.Tensor:
    total = sum(o.weight for o in observations)
    return sum((o.weight / total) * o.sent.double() for o in observations)


def judge_rounds(log: list[Observation], *, attacker_ids: set[str], peer_ids: list[str]) -> dict[str, Any]:
    """What became of the attackers' contributions in each round of their group (see the module docstring)."""
    by_group: dict[str, list[Observation]] = {}
    for obs in log:
        if obs.record.group_id:
            by_group.setdefault(obs.record.group_id, []).append(obs)
    outcome: Counter = Counter()
    pulls, reasons = [], Counter()
    for observations in by_group.values():
        honest = [o for o in observations if peer_ids[o.peer] not in attacker_ids and o.result is not None]
        if not attacker_ids or not honest or not attacker_ids & set(honest[0].record.members):
            continue
        record = honest[0].record
        if not attacker_ids & set(record.included):
            outcome["dropped"] += 1
            reasons.update(r["reason"][:60] for r in record.failures if r["peer"] in attacker_ids)
            reasons.update(v[:60] for k, v in record.rejected.items() if k in attacker_ids)
            continue
        included = [o for o in observations if peer_ids[o.peer] in record.included]
        honest_mean = _weighted_mean([o for o in included if peer_ids[o.peer] not in attacker_ids])
        plain_mean = _weighted_mean(included)
        moved = float(torch.linalg.vector_norm(honest[0].result.double() - honest_mean))
        plain_move = float(torch.linalg.vector_norm(plain_mean - honest_mean))
        pull = moved / plain_move if plain_move > 0 else (0.0 if moved == 0 else math.inf)
        if math.isfinite(pull):  # a diverged run's own updates can be non-finite: no pull to measure
            pulls.append(pull)
        outcome["clipped" if pull < CLIPPED_PULL else "passed"] += 1
    return {
        "attacked_rounds": sum(outcome.values()),
        **{k: outcome[k] for k in ("dropped", "clipped", "passed")},
        "mean_pull": float(np.mean(pulls)) if pulls else None,
        "drop_reasons": dict(reasons),
    }


def _train_peer(
    index: int,
    *,
    trainer: Any,
    model: torch.nn.Module,
    task: Any,
    config: ByzantineConfig,
    barrier: threading.Barrier,
    on_round: Callable[[int, Any], None],
) -> None:
    batches = task.train_batches(shard_index=index, num_shards=config.peers, seed=config.seed)
    for step in range(config.rounds * config.sync_every):
        batch = next(batches)
        loss = task.loss(model, batch)
        loss.backward()
        if (step + 1) % config.sync_every == 0:
            barrier.wait()  # every peer looks for the group at once: full groups, the same rounds in each arm
        result = trainer.step(num_samples=len(batch[0]), loss=float(loss.detach()))
        if result is not None:
            on_round(index, result)


def run_arm(
    arm: Arm, *, config: ByzantineConfig, peers: list, task: Any, advance: Callable[[], None]
) -> dict[str, Any]:
    """Train one arm to the end; its val-loss curve, the attack's counts and the rounds' fate. ``peers``:
    (identity, DHT started with that identity's key) of every peer, shared by the arms."""
    from swarm.trainer import Trainer, TrainerConfig

    started = time.monotonic()
    trainer_config = TrainerConfig.create(
        run=f"byz-{uuid.uuid4().hex[:12]}",
        sync_every=config.sync_every,
        aggregator=arm.aggregator,
        target_group_size=config.peers,
        sender_timeout_s=config.sender_timeout_s,
        load_state=False,
        checkpoint_every=0,
        ledger_dir="",
        advertise=False,
        bandwidth_probe_period_s=0,
        progress=False,  # the benchmark draws its own progress bars
        **({"max_weight_ratio": 0} if arm.uncapped else {}),
    )
    models = [task.build_model(seed=config.seed) for _ in range(config.peers)]
    trainers: list[Any] = []
    log: list[Observation] = []
    lock = threading.Lock()
    curve = [(0, task.evaluate(models[0]))]
    samples_per_round = config.peers * config.sync_every * task.config.batch_size
    honest = config.peers - (config.attackers if arm.attack else 0)
    adversary = None
    if arm.attack is not None:
        adversary = Adversary(arm.attack, honest=honest, attackers=config.attackers, seed=config.seed)
    attackers: list[Attacker] = []
    try:
        for i, ((identity, dht), model) in enumerate(zip(peers, models)):
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            trainers.append(Trainer(model, optimizer, config=trainer_config, dht=dht, identity=identity))
            observe(trainers[-1].group_averager, i, log, lock, adversary)
        peer_ids = [t.peer_id for t in trainers]
        setup_s = time.monotonic() - started
        if adversary is not None:
            attackers = [Attacker(adversary=adversary, name=f"peer{i}") for i in range(honest, config.peers)]
            for attacker, trainer in zip(attackers, trainers[honest:]):
                attacker.attach(trainer.group_averager)
        attacker_ids = set(peer_ids[honest:])

        def on_round(index: int, result: Any) -> None:
            if index == 0:  # after a round every member holds the same global parameters
                curve.append((result.round * samples_per_round, task.evaluate(models[0])))
                advance()

        nan_on_the_wire = attacker_codecs({t.group_averager._loop for t in trainers[honest:]})
        with nan_on_the_wire if arm.attack == "nan" else contextlib.nullcontext():
            _run_threads(trainers, models, task=task, config=config, on_round=on_round)
        honest_refusals = sum((t.group_averager.rejected for t in trainers[:honest]), Counter())
        judged = judge_rounds(log, attacker_ids=attacker_ids, peer_ids=peer_ids)
        outcomes = Counter(o.record.outcome for o in log if peer_ids[o.peer] not in attacker_ids)
        round_s = [o.record.phase_s["total"] for o in log if "total" in o.record.phase_s]
    finally:
        for trainer in trainers:
            trainer.shutdown()
    final = curve[-1][1]
    return {
        "arm": arm.name,
        "attack": arm.attack,
        "aggregator": arm.aggregator,
        "uncapped": arm.uncapped,
        "weight_cap": None if arm.uncapped else trainer_weight_cap(),
        "final_val_loss": final if math.isfinite(final) else None,
        "final_finite": math.isfinite(final),
        "initial_val_loss": curve[0][1],
        "curve": [[s, v if math.isfinite(v) else None] for s, v in curve],
        "samples": config.rounds * samples_per_round,
        "rounds_evaluated": len(curve) - 1,
        "attackers": len(attackers),
        "parts_sent_poisoned": sum(a.parts_sent for a in attackers),
        "rounds_poisoned": sum(a.poisoned_rounds for a in attackers),
        **({"history_scales": adversary.scales} if adversary is not None and adversary.scales else {}),
        "honest_round_outcomes": dict(outcomes),
        "honest_refusals": dict(honest_refusals),
        **judged,
        "round_s_median": float(np.median(round_s)) if round_s else None,
        "setup_s": setup_s,
        "wall_s": time.monotonic() - started,
    }


def _run_threads(
    trainers: list, models: list, *, task: Any, config: ByzantineConfig, on_round: Callable[[int, Any], None]
) -> None:
    """One thread per peer; the first failure aborts the barrier so that no peer waits forever."""
    barrier = threading.Barrier(len(trainers), timeout=120)
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            _train_peer(
                i, trainer=trainers[i], model=models[i], task=task, config=config, barrier=barrier, on_round=on_round
            )
        except BaseException as e:  # reported below, in the main thread
            errors.append(e)
            barrier.abort()

    threads = [
        threading.Thread(target=body, args=(i,), name=f"byzantine-peer{i}", daemon=True) for i in range(len(trainers))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)] or errors
        raise RuntimeError(f"a peer failed (seed {config.seed}): {real[0]!r}") from real[0]


# --- the whole benchmark ------------------------------------------------------------------------


def verdict(arms: list[dict[str, Any]]) -> list[str]:
    """Failed checks, one line each (empty: the row holds)."""
    clean = next(a for a in arms if a["attack"] is None)
    base = clean["final_val_loss"]
    problems = []
    clean.update(ratio_to_clean=1.0, expected="reference")
    not_ok = sum(n for outcome, n in clean["honest_round_outcomes"].items() if outcome != "ok")
    if not_ok:  # a dropped or retried member makes the reference a different run: say so, compare anyway
        problems.append(
            f"clean: {not_ok} of {sum(clean['honest_round_outcomes'].values())} peer-rounds were not ok "
            f"({clean['honest_refusals']}); is the machine overloaded? raise --sender-timeout-s"
        )
    if base is None or base > (1 - MIN_CLEAN_DROP) * clean["initial_val_loss"]:
        return problems + [f"clean: the run did not learn: val loss {clean['initial_val_loss']:.3f} -> {base}"]
    for arm in arms:
        if arm["attack"] is None and arm is not clean:  # honest-only on the plain mean
            ratio = base / arm["final_val_loss"] if arm["final_finite"] else math.inf
            arm.update(ratio_to_clean=arm["final_val_loss"] / base if arm["final_finite"] else None)
            arm["expected"] = f"the default rule within {HONEST_TOLERANCE:.0%} of it"
            if abs(ratio - 1) > HONEST_TOLERANCE:
                problems.append(f"{arm['arm']}: the default rule ends {ratio:.3f}x the plain mean with no attacker")
        if arm["attack"] is None:
            continue
        ratio = arm["final_val_loss"] / base if arm["final_finite"] else math.inf
        arm["ratio_to_clean"] = ratio if math.isfinite(ratio) else None
        name = arm["arm"]
        if arm["parts_sent_poisoned"] == 0 or arm["attacked_rounds"] == 0:
            problems.append(f"{name}: the attack never reached a reducer")
        holds = ratio <= 1 + ROBUST_TOLERANCE
        arm["expected"] = _expected(arm)
        if arm["expected"] == "holds" and not holds:
            problems.append(f"{name}: val loss {ratio:.2f}x clean, above {1 + ROBUST_TOLERANCE:.2f}x")
        elif arm["expected"].startswith("fails") and ratio < CONTROL_FACTOR:
            problems.append(f"{name}: the negative control held ({ratio:.2f}x clean, below {CONTROL_FACTOR}x)")
        if arm["attack"] in MEAN_SURVIVES and arm["dropped"] != arm["attacked_rounds"]:
            problems.append(f"{name}: {arm['attacked_rounds'] - arm['dropped']} poisoned rounds were not dropped")
    return problems


def _expected(arm: dict[str, Any]) -> str:
    """holds, fails (a negative control), or info (not judged), for an attacked arm."""
    if arm["uncapped"]:  # the default rule leaves a gross outlier out whatever its weight; the cap bounds the rest
        return "info (no weight cap)"
    if arm["aggregator"] != "mean" or arm["attack"] in MEAN_SURVIVES:
        return "holds"
    if arm["attack"] == "huge_weight" and arm["weight_cap"] is not None:
        return "info (the weight cap, not the rule, answers it)"
    if arm["attack"] in IN_SPREAD:
        return "info (inside the honest spread)"
    return "fails (negative control)"


def run(config: ByzantineConfig, console: Console) -> dict[str, Any]:
    """Every arm, one after the other, on one set of loopback DHT nodes."""
    from averaging import get_codec
    from bootstrap import stop_dht, visible_maddrs
    from bootstrap.identity import Identity
    from bootstrap.network import start_swarm_dht
    from swarm.tasks import get_task
    from swarm.trainer import TrainerConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # four peers share this process (and the machine's cores)
    task = get_task("charlm", preset=PRESET)
    arms = arms_of(config)
    results = []
    loopback = ["/ip4/127.0.0.1/tcp/0"]
    identities = [Identity.generate() for _ in range(config.peers)]
    dhts = []  # each peer's DHT has its identity's key: members check that a peer's binding names it
    try:
        dhts.append(start_swarm_dht(identities[0], host_maddrs=loopback))
        initial = visible_maddrs(dhts[0])
        dhts += [start_swarm_dht(identity, initial_peers=initial, host_maddrs=loopback) for identity in identities[1:]]
        # the int8 codec loads bitsandbytes on first use (seconds here): not inside the first arm's first round
        codec = get_codec(TrainerConfig(run="warm-up").averaging.codec)
        codec.decode(codec.encode(torch.zeros(16)), numel=16)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            for arm in arms:
                bar = progress.add_task(f"{arm.name:>28}", total=config.rounds)
                results.append(
                    run_arm(
                        arm,
                        config=config,
                        peers=list(zip(identities, dhts)),
                        task=task,
                        advance=lambda bar=bar: progress.advance(bar),
                    )
                )
    finally:
        for dht in dhts:
            stop_dht(dht)
        torch.set_num_threads(threads)
    return {
        "arms": results,
        "problems": verdict(results),
        "thresholds": {
            "robust_tolerance": ROBUST_TOLERANCE,
            "control_factor": CONTROL_FACTOR,
            "min_clean_drop": MIN_CLEAN_DROP,
            "clipped_pull": CLIPPED_PULL,
        },
    }


def table(result: dict[str, Any]) -> Table:
    out = Table(title="byzantine updates: val loss after the same samples (TESTMATRIX row 9)")
    for column in (
        "arm",
        "final val loss",
        "/ clean",
        "poisoned parts sent",
        "dropped / clipped / passed",
        "pull",
        "expected",
        "check",
        "wall",
    ):
        out.add_column(column, justify="left" if column in ("arm", "expected", "check") else "right")
    failed = {problem.split(":")[0] for problem in result["problems"]}
    for arm in result["arms"]:
        ratio = arm.get("ratio_to_clean")
        loss = arm["final_val_loss"]
        expected = arm.get("expected", "info")
        check = "-" if expected.startswith("info") else "[red]FAILED[/]" if arm["arm"] in failed else "[green]ok[/]"
        out.add_row(
            arm["arm"],
            "non-finite" if loss is None else f"{loss:.3f}",
            "-" if arm["attack"] is None and ratio in (None, 1.0) else ("inf" if ratio is None else f"{ratio:.3f}x"),
            str(arm["parts_sent_poisoned"]) if arm["attack"] else "-",
            f"{arm['dropped']} / {arm['clipped']} / {arm['passed']}" if arm["attack"] else "-",
            "-" if arm["mean_pull"] is None else f"{arm['mean_pull']:.2f}",
            arm.get("expected", "-"),
            check,
            f"{arm['wall_s']:.0f} s",
        )
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Val loss against the swarm's samples, one line per arm; off-scale (diverged) arms are noted."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    arms = result["arms"]
    clean = arms[0]
    top = 1.3 * clean["initial_val_loss"]
    fig = Figure(figsize=(11.0, 5.0), dpi=110)
    fig.subplots_adjust(left=0.07, right=0.72)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    styles = {"centered_clip": "-", "trimmed_mean": "--", "mean": ":"}
    colors = {
        None: "black",
        "sign_flip_x10": "tab:blue",
        "nan": "tab:green",
        "huge_weight": "tab:red",
        "alie": "tab:purple",
        "history": "tab:orange",
    }
    for arm in arms:
        points = [(s, v if v is not None else math.nan) for s, v in arm["curve"]]
        off = any(not math.isfinite(v) or v > top for _, v in points)
        ax.plot(
            [s for s, _ in points],
            [min(v, top) if math.isfinite(v) else top for _, v in points],
            linestyle="-." if arm["uncapped"] else styles[arm["aggregator"]],
            color=colors[arm["attack"]],
            marker=".",
            linewidth=2.5 if arm["attack"] is None else 1.5,
            label=arm["arm"] + (" (off scale)" if off else ""),
        )
    ax.set_ylim(top=top)
    ax.set_xlabel("samples seen by the swarm")
    ax.set_ylabel("validation loss (nats/char)")
    peers = result["config"]["peers"]
    attackers, seed = result["config"]["attackers"], result["config"]["seed"]
    ax.set_title(f"charlm/{PRESET}: {attackers} byzantine of {peers} peers vs a clean run (seed {seed})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.byzantine", description=__doc__.splitlines()[0])
    add_dataclass_arguments(parser, ByzantineConfig)
    parser.add_argument(
        "--out", default=str(RESULTS), help="JSON output path; the plot goes beside it (.png) (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    console = Console()
    try:
        config = dataclass_from_args(ByzantineConfig, args)
    except ValueError as e:
        console.print(f"[bold red]error:[/] {e}")
        return 2
    logging.getLogger("swarm.trainer").setLevel(logging.ERROR)  # one DHT per peer, shared by the arms: no ledger
    started = time.monotonic()
    try:
        with signals_unwind():
            measured = run(config, console)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; every DHT node and averager was stopped[/]")
        return 130
    result = {
        **run_metadata("byzantine", argv),
        "config": asdict(config),
        **measured,
        "wall_s": time.monotonic() - started,
    }
    console.print(table(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result["plot"] = str(out.with_suffix(".png"))
    plot(result, out.with_suffix(".png"))
    out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {out} and {result['plot']} in {result['wall_s']:.0f} s (seed {config.seed})")
    for problem in result["problems"]:
        console.print(f"[bold red]FAILED:[/] {problem}")
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
