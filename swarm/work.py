"""Verified work in a running trainer: commit to each phase, check the segments drawn to this peer, spread
the verdicts, re-check every accusation, exclude whoever a replay shows wrong.

`swarm.verify` holds the pure parts (commitments, replay, the draw); this is their network side, one
`WorkChecks` per trainer (blocking rounds only; an overlapped trainer does not commit):

* **Prover.** The trainer draws its batches from `batches` (the task's deterministic shard stream),
  calls `stepped` after each inner step and `commit` at the sync point; the signed commitment rides in
  the round's gathered metadata (``"work"``). This peer serves the replay inputs of its last
  `KEEP_ROUNDS` phases, and of older ones younger than `KEEP_FOR_S` within `KEEP_BYTES`, on the
  ``swarm_<run>.work`` stream handler.
* **Verifier.** After a grouped round, every member draws the same verifiers from the group's id, its
  commitments and the round's result (`swarm.verify.draw_checks`, `result_salts`: fixed only once every
  commitment and every part was sent); a verifier checks
  its prover with probability ``check_rate`` while the prover is on probation with it, ``trusted_rate``
  once it has passed ``trust_after`` of that prover's checks itself (`_Standing`). The checks drawn to
  this peer run on one worker thread: fetch the prover's inputs (in `CHUNK_BYTES` chunks, each only
  between this peer's rounds: `_Lag.quiet`), replay (at niceness ``replay_nice``: it takes the CPU a round
  leaves idle before it takes any from training), sign a verdict, write it to the ledger (``work_check``). A
  failed check excludes the prover here at once (ledger: ``work_excluded``, with the reason) and is
  published under the run's verdicts key (owner-bound: subkey = the verifier), with the commitment.
* **Binding.** A verifier is a reducer of its prover's group: its `averaging.RoundRecord` holds the digest of
  the prover's part of its slice as it came, and the weight claimed (``parts``). A check whose replay matches
  also requires that part to be the committed update's slice, ``base - end`` encoded as a sender streams it
  (`averaging.group.part_digest`), and the weight to be the committed samples (`_Part`): else it fails
  (`UNBOUND`), so a peer cannot commit honest work and average something else. Each part came with the
  prover's signed statement of it (`averaging.group.PartStatement`, labelled with its commitment's digest; a
  reducer refuses a part without one, and excludes a prover whose statement names another commitment than the
  one it sent): an `UNBOUND` verdict is published with that statement, and any arbiter holds the prover to it
  (`_judge_unbound`): the statement is the prover's own word of what it averaged, so a mismatch with its
  committed update excludes the prover, and a match shows the accuser lied.
* **Arbiter.** Each round the worker reads the verdicts key, ahead of its routine checks (`_Worker`). A
  failing verdict this peer can re-check (it holds that round's base) is replayed a third time: if the
  prover's work fails again the prover is excluded; if it checks out the *verifier* lied, and is excluded
  (ledger: ``work_dispute``).
  Nobody is excluded on hearsay: only on this peer's own replay.
* **Evidence.** The ledger entries above feed ``swarm.report`` (a "Verified work" table: checks done,
  passed, failed, refused, disputes, who was excluded and why) and the status board (`tally`: each
  peer's counts and the peers it excluded; exclusions and failed checks also on its event timeline).

Excluded peers are never drawn into a group, admitted to a lobby or waited for (`averaging.GroupAverager.exclude`),
so they sign no seal with the others. Members that send no commitment (a custom data loop, an
overlapped trainer) are counted as unverified and averaged with; with ``require_verified`` matchmaking
refuses them, round by round (`averaging.GroupAverager.require`; ledger: ``work_refused``, once per peer):
a leader refuses their join, a follower declines a group that holds one. An honest peer's phase that
cannot be committed (its first after loading a sealed state mid-phase) is refused that one round.

Replays run in a process of their own (`swarm.replayer`) for a task whose training draws random numbers
(dropout > 0; a task that does not say, see `swarm.replayer.random_in_training`), since torch has one CPU
random generator per process and a replay on the worker thread would reseed and draw from the stream this
peer's own training draws its dropout masks from, and the other way round; and for a prover that trained
with another number of torch threads or at another CPU kernel level than this process has (both are per
process, and a replay must use the prover's: `swarm.verify`, step 4). The others replay on the worker
thread (no process to start). A prover whose level this machine lacks is not checked here ("cannot replay
here"): no verdict either way; with ``require_verified`` such a member is refused in matchmaking, since a
claimed level that none of its verifiers has (or one torch does not know) would escape every check.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind import DHT
from hivemind.utils import get_dht_time

from averaging.group import PartRejected, PartStatement, part_digest, piece_bounds, read_part, slice_bounds
from bootstrap.dhtcalls import latest_within, store_within
from bootstrap.framing import ProtocolError, header_field, linger, read_blob, read_frame, write_blob, write_frame
from bootstrap.identity import Identity
from bootstrap.runtime import Handler, peer_id_of
from swarm import verify
from swarm.config import WorkConfig, averaging_prefix
from swarm.replayer import CannotReplayHere, Replayer, random_in_training
from swarm.verify import Commitment, ReplayInputs, WorkRecorder, WorkRejected

logger = logging.getLogger(__name__)

_MAX_HEADER = 1024
_REPLAYERS = 3
"""Replay processes kept at once (one per CPU kernel level replayed at: `_Replays.apart`)."""
_VERDICTS_KEPT = 8
"""Failing verdicts a verifier keeps published (newest first)."""
_VERDICT_EXPIRY_S = 600.0
KEEP_ROUNDS = 3
"""Committed phases a prover keeps to serve (and bases a verifier keeps for re-checks)."""
KEEP_FOR_S = 30.0
KEEP_BYTES = 256 << 20
"""A prover keeps older phases too while they are younger than `KEEP_FOR_S` and all kept phases fit in
`KEEP_BYTES`: with rounds of a fraction of a second, the few rounds that a verdict takes to be published,
read and re-checked can outlast `KEEP_ROUNDS` (seen in tests/test_work.py's end-to-end run on a loaded
machine: an honest peer that could re-check none of a liar's 6 accusations, and so never excluded it)."""
CHECK_LAG_ROUNDS = 0
"""A round does not start while this peer's checks of rounds more than this many before it are pending."""
CHECK_WAIT_S = 10.0
"""The longest a round's start waits for this peer's late checks (`WorkChecks._wait_for_checks`)."""
LATE_AFTER_S = KEEP_FOR_S / 2
"""A check drawn this long ago, for a phase older than the prover's last `KEEP_ROUNDS`, is skipped as late: the
prover keeps such phases for `KEEP_FOR_S` (within `KEEP_BYTES`), so younger ones are still asked for (under
load this peer's checks fall rounds behind: skipped, they let a cheater through for rounds more)."""
_MAX_SETTLED = 10_000
TIMEOUT_S = 30.0
"""Bound on one chunk of replay inputs, one DHT read or store of verdicts, the handler's start, and on a
check's wait for this peer's round to end before its next chunk."""
CHUNK_BYTES = 256 << 10
"""Replay inputs travel in chunks of this size, each sent between this peer's rounds (`_Lag.quiet`): 0.1 s
at 20 Mbit/s, less than an inner step of charlm small here, so a chunk started before a phase's last step
is off the link when the round starts."""
FETCH_DEADLINE_S = 600.0
"""Bound on one whole fetch of replay inputs, chunks and waits: a prover slower than that is unreachable."""
_SERVED_KEPT = 2
"""Serialized replay inputs a prover keeps while verifiers fetch them chunk by chunk."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkSpec:
    """What a trainer's verified work replays: a registry task and this peer's place in its data."""

    task: Any
    """A `swarm.tasks.Task` (its config digest is the run's)."""
    task_digest: str
    shard_index: int
    num_shards: int
    seed: int = 0
    task_name: str | None = None
    """The name `swarm.tasks.get_task` built ``task`` from (a built-in name, an installed entry point or
    ``package.module:factory``): a replay in a process of its own (`swarm.replayer`) rebuilds the task by it.
    None: the task's own ``name`` (right for the built-in and installed tasks)."""


class _Worker:
    """One daemon thread that runs jobs, the urgent ones first (re-checks of published accusations: they settle
    an exclusion, while a routine check may only start one), each kind in order of submission. `close` stops it
    between jobs and waits for the job in progress (a replay in torch on a thread the interpreter is tearing
    down aborts the process)."""

    URGENT, ROUTINE = 0, 1

    def __init__(self, name: str, counts: Counter[str], nice: int = 0) -> None:
        self.jobs: queue.PriorityQueue = queue.PriorityQueue(maxsize=64)
        self.submitted = itertools.count()  # ties in priority run in order of submission
        self.stopping, self.counts, self.nice = threading.Event(), counts, nice
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, job: Callable, *args: Any, priority: int = ROUTINE) -> bool:
        try:
            self.jobs.put_nowait((priority, next(self.submitted), job, args))
        except queue.Full:  # checks pile up faster than they run: this one is skipped
            self.counts["skipped"] += 1
            return False
        return True

    def _run(self) -> None:
        if self.nice > 0 and hasattr(os, "setpriority"):  # Linux: a thread's own niceness, by its thread ID
            try:
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + self.nice))
            except OSError as e:
                logger.info("verified work: replays run at the trainer's priority: %r", e)
        while (item := self.jobs.get())[2] is not None and not self.stopping.is_set():
            _, _, job, args = item
            try:
                job(*args)
            except Exception as e:  # a check must never stop the others
                self.counts["internal error"] += 1
                logger.warning("verified work: %s failed: %r", job.__name__, e)

    def stop(self) -> None:
        self.stopping.set()
        with contextlib.suppress(queue.Full):
            self.jobs.put_nowait((-1, -1, None, ()))

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            logger.warning("verified work: a check still runs after %.0f s at shutdown", timeout_s)


class _Forgotten(Exception):
    """The prover answered that it dropped the phase asked for (it keeps its last `KEEP_ROUNDS`)."""


@dataclass
class _Lag:
    """How far behind this peer's checks are, and when their transfers may take the link (the worker's state;
    see `WorkChecks._late` and `WorkChecks._fetch`)."""

    quiet: threading.Event = field(default_factory=threading.Event)
    """Set between this peer's rounds (from the end of one to the last inner step before the next): a check's
    inputs move only then, chunk by chunk, so they do not queue the round's own messages behind them."""
    newest_round: int = -1
    """The newest round of a commitment this peer saw in a group or made itself."""
    unreachable: set[str] = field(default_factory=set)
    """Provers the last fetch could not reach."""
    owed: dict[str, tuple] = field(default_factory=dict)
    """Checks whose prover was unreachable, by prover: run again if it is in a later group of this peer."""
    pending: Counter[int] = field(default_factory=Counter)
    """Checks and re-checks on the worker (queued or running), by the round they belong to (`commit` waits)."""
    settled: threading.Condition = field(default_factory=threading.Condition)
    """Notified whenever one of ``pending`` ends."""
    gave_up_below: int = -1
    """Checks of rounds before this one were waited for until `CHECK_WAIT_S` once: not waited for again."""

    def behind(self, limit: int) -> bool:
        """Checks of rounds before ``limit`` (and not given up on) are pending; call holding ``settled``."""
        return any(self.gave_up_below <= r < limit for r in self.pending)


@dataclass
class _Standing:
    """What this peer found about the others, by its own replays and matchmaking (never on hearsay)."""

    excluded: dict[str, str] = field(default_factory=dict)
    """Peers kept out of this peer's groups, with the reason."""
    refused: dict[str, str] = field(default_factory=dict)
    """Members matchmaking refused (``require_verified``: no valid commitment), with the first reason."""
    passed: Counter[str] = field(default_factory=Counter)
    """Checks of each prover this peer ran and passed: its rate drops to ``trusted_rate`` after ``trust_after``."""

    def rate(self, config: WorkConfig, prover: str) -> float:
        """This verifier's chance of checking one of ``prover``'s contributions."""
        return config.trusted_rate if self.passed[prover] >= config.trust_after else config.check_rate


@dataclass
class _Replays:
    """What this peer's replays start from: the base parameters (flat fp32) of its last `KEEP_ROUNDS` grouped
    rounds, by digest (re-checks), and its batch streams, each left where its last replay stopped."""

    streams: verify.Streams
    task_name: str | None = None
    """How the replayers' processes rebuild the task (`WorkSpec.task_name`)."""
    nice: int = 0
    random: bool = False
    """The task's training draws random numbers (`swarm.replayer.random_in_training`)."""
    levels: frozenset[str] = field(default_factory=verify.replayable_levels)
    """The CPU kernel levels this machine replays at (`swarm.verify.replayable_levels`)."""
    apart: OrderedDict[str, Replayer] = field(default_factory=OrderedDict)
    """Replays in processes of their own (`swarm.replayer`), by the CPU kernel level each runs torch at (at most
    `_REPLAYERS`; the least recently used is closed): every replay of a task whose training draws random
    numbers, and of a commitment whose prover trained with another number of torch threads or at another
    level than this process has (`WorkChecks._replaying`). The others run on the worker thread."""
    bases: OrderedDict[str, torch.Tensor] = field(default_factory=OrderedDict)
    committed: tuple[torch.Tensor, str] | None = None
    """The base of this peer's last commitment, with its digest: `after_round` does not hash that base again."""

    def replayer(self, cpu: str) -> Replayer:
        """The process that replays at CPU kernel level ``cpu`` (untrusted: a commitment's)."""
        if cpu in self.apart:
            self.apart.move_to_end(cpu)
            return self.apart[cpu]
        level = None if cpu == verify.cpu_capability() else cpu
        self.apart[cpu] = Replayer(nice=self.nice, cpu=level, task_name=self.task_name)
        while len(self.apart) > _REPLAYERS:
            self.apart.popitem(last=False)[1].close()
        return self.apart[cpu]

    def close(self) -> None:
        for replayer in self.apart.values():
            replayer.close()


def result_salts(averaged: torch.Tensor | None, members: Sequence[str], piece_numel: int) -> dict[str, str]:
    """Member -> the salt of its draw (`verify.draw_checks`): a digest of the last piece of every slice of the
    round's result (``averaged``, bit for bit the same on every member) but the slice the member reduced itself.
    The group's id and the commitments are known before the all-reduce, so a draw seeded by them alone tells a
    prover, before it sends its parts, who checks it: it could send another update to every reducer but that
    one. A slice's last piece is aggregated only once every member sent all of its part (pieces go in order),
    so a prover learns its draw after the last byte it could tamper with; and leaving its own slice out, it
    cannot steer its draw by choosing what it sends back as that slice's aggregate."""
    if averaged is None:
        return {}
    pieces = []
    for lo, hi in slice_bounds(averaged.numel(), len(members)):
        a, b = piece_bounds(hi - lo, piece_numel)[-1]
        pieces.append(hashlib.sha256(averaged[lo + a : lo + b].contiguous().numpy()).hexdigest())
    return {str(m): ":" + ":".join(d for j, d in enumerate(pieces) if j != i) for i, m in enumerate(members)}


UNBOUND = "its part in the all-reduce was not its committed update"
"""A check's reason when the prover's work replays but the part it sent this peer's slice is another update."""


@dataclass(frozen=True, slots=True)
class _Part:
    """What a prover sent a reducer in the round it is checked for, as the prover signed it: its statement of
    its part of that slice (`averaging.group.PartStatement`: the part's digest, `averaging.group.part_digest`,
    and the weight it claimed) and the signature. A check whose replay matches the commitment also requires
    that part to be the committed update's (``base - end``) slice, so that a peer cannot commit honest work and
    average something else (a poisoned or a copied update)."""

    statement: PartStatement
    signature: str
    weight: float
    """The statement's claimed weight, parsed."""

    @classmethod
    def of(cls, record: Any, prover: str) -> _Part | None:
        """From the round's `averaging.RoundRecord` (None: ``prover``'s part is not in this peer's slice)."""
        part = record.parts.get(prover) if record is not None else None
        return None if part is None else cls.signed(part.get("statement"), part.get("signature"), prover, None)

    @classmethod
    def signed(cls, statement: Any, signature: Any, prover: str, run: str | None) -> _Part | None:
        """From a statement ``prover`` signed (untrusted: None unless well-formed and, with ``run``, signed by
        ``prover`` among the run's averagers, `swarm.config.averaging_prefix`)."""
        signer, prefix = (prover, averaging_prefix(run)) if run is not None else (None, "")
        try:
            read = read_part(statement, signature, signer=signer, prefix=prefix)
            return cls(read, signature, float(read.weight))
        except (PartRejected, ValueError):
            return None

    def shown(self) -> dict:
        """As it is published with an `UNBOUND` verdict."""
        return {"statement": self.statement.to_dict(), "signature": self.signature}

    def matches(self, delta: torch.Tensor, commitment: Commitment) -> bool:
        lo, hi = self.statement.lo, self.statement.hi
        if self.weight != float(max(commitment.samples, 1)) or not 0 <= lo <= hi <= delta.numel():
            return False
        digest = part_digest(delta[lo:hi], self.statement.codec, self.statement.piece_numel)
        return digest == self.statement.sha256


@dataclass
class _Disputes:
    """The verdicts this peer published, and those of others it settled (the arbiter's state)."""

    dht: Any
    """Where verdicts are published and read (the run's verdicts key)."""
    published: list[dict] = field(default_factory=list)
    settled: set[str] = field(default_factory=set)
    polling: threading.Event = field(default_factory=threading.Event)


class WorkChecks:
    """One trainer's verified work (see the module docstring). ``exclude(peer, reason)`` keeps a peer out of
    this peer's groups; ``record(kind, body)`` writes evidence (the ledger)."""

    def __init__(
        self,
        dht: DHT,
        identity: Identity,
        spec: WorkSpec,
        config: WorkConfig,
        *,
        run: str,
        warmup_steps: int,
        exclude: Callable[[str, str], None],
        require: Callable[[Callable[[str, Any], str | None]], None],
        record: Callable[[str, dict], None],
        params: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        first_step: int,
        sync_every: int | None = None,
    ) -> None:
        self.spec, self.identity, self.config, self.run, self.warmup_steps = spec, identity, config, run, warmup_steps
        self.params, self.optimizer, self.sync_every = params, optimizer, sync_every
        """The trainer's trainable parameters (in order), inner optimizer and sync interval (a phase's length)."""
        self._exclude, self._record = exclude, record
        self.recorder = WorkRecorder(
            spec.task,
            peer=identity.peer_id,
            shard_index=spec.shard_index,
            num_shards=spec.num_shards,
            seed=spec.seed,
            segment_steps=config.segment_steps,
        )
        self.counts: Counter[str] = Counter()
        """checks / passed / failed / refused / late (skipped: `_late`) / unverified / rechecked / confirmed /
        liars (false accusations found) / cannot recheck: WHY / refused members / rejected:REASON."""
        self.standing = _Standing()
        random = random_in_training(spec.task)
        self.replays = _Replays(
            verify.Streams(spec.task), task_name=spec.task_name, nice=config.replay_nice, random=random
        )
        self._lag, self._disputes = _Lag(), _Disputes(dht)
        self._served: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        """Replay inputs being fetched chunk by chunk, serialized once (the newest `_SERVED_KEPT`)."""
        self._lock = threading.Lock()
        self._worker = _Worker("swarm-work", self.counts, nice=config.replay_nice)
        self._service = Handler(dht, handler_name=f"swarm_{run}.work", handler=self._serve, start_timeout_s=TIMEOUT_S)
        self.begin(first_step=first_step)
        if config.require_verified:
            require(self._policy)
        if random:  # its imports run while this peer trains, not in its first check
            self.replays.replayer(verify.cpu_capability()).start()

    @classmethod
    def for_trainer(cls, trainer: Any, spec: WorkSpec | None) -> WorkChecks | None:
        """A `swarm.Trainer`'s verified work, or None: ``verify_work`` off, no spec, overlapped rounds, a model with
        floating-point buffers, a `swarm.ScaledStep`, or a DHT that is not the trainer's own (nothing could be
        signed)."""
        cfg = trainer.config
        if not cfg.work.verify_work or spec is None or cfg.overlap or trainer.identity.peer_id != trainer.peer_id:
            return None
        if trainer.outer.buffers:  # a replay restores the parameters and the optimizer's state, not the buffers
            logger.warning(
                "verified work is off: the model has buffers (batch norm statistics), which no replay restores"
            )
            return None
        if not isinstance(trainer.inner_optimizer, torch.optim.Optimizer):  # a `swarm.ScaledStep` (fp16 steps)
            logger.warning("verified work is off: the inner optimizer steps through a gradient scaler (not replayed)")
            return None
        averager, record = trainer.group_averager, trainer.evidence.record
        return cls(
            trainer.dht, trainer.identity, spec, cfg.work, run=cfg.run, warmup_steps=cfg.inner_warmup_steps,
            exclude=averager.exclude, require=averager.require, record=record, params=list(trainer.outer.params),
            optimizer=trainer.inner_optimizer,
            first_step=trainer.local_step + 1, sync_every=cfg.sync_every,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------ prover
    def batches(self) -> Iterator[Any]:
        """The batches this peer trains on: one per inner step, from its shard's deterministic stream."""
        return self.recorder.batches()

    def begin(self, *, first_step: int) -> None:
        """A phase starts (the model holds the global state); ``first_step``: the local step number of its first step.
        The round is over: checks' transfers may take the link again."""
        self.recorder.begin(self.params, self.optimizer, first_step=first_step, expected_steps=self.sync_every)
        self._lag.quiet.set()

    def stepped(self) -> None:
        """After each inner step (the optimizer's learning rates back at their own values). The phase's last
        step begins: no new chunk of a check's inputs starts, so none is on the link when the round does."""
        self.recorder.stepped(self.params, self.optimizer)
        phase = self.recorder.phase
        if self.sync_every is not None and phase is not None and phase.steps >= self.sync_every - 1:
            self._lag.quiet.clear()

    def commit(self, pseudo: Any, samples: int, round_: int) -> dict | None:
        """The phase's signed commitment, as it goes into the round's gathered metadata (None: not replayable).
        ``pseudo``: the round's `swarm.outer.PseudoGradient` (its state begins with the base parameters). A
        round starts: checks' transfers wait for its end (`begin`). First, if this peer's checks of rounds
        before ``round_ - CHECK_LAG_ROUNDS`` are still pending, it waits for them (`_wait_for_checks`)."""
        self._wait_for_checks(round_)
        self._lag.quiet.clear()
        self._lag.newest_round = max(self._lag.newest_round, round_)  # this peer's own round: `_late`
        base = pseudo.state[: pseudo.delta.numel()]
        signed = self.recorder.commit(
            self.params,
            self.optimizer,
            base=base,
            identity=self.identity,
            run=self.run,
            round_=round_,
            task_digest=self.spec.task_digest,
            samples=samples,
            warmup_steps=self.warmup_steps,
        )
        with self._lock:
            self.recorder.forget(KEEP_ROUNDS, keep_for_s=KEEP_FOR_S, max_bytes=KEEP_BYTES)
        if signed is None:
            return None
        self.replays.committed = (base, signed.commitment.params[0])
        return signed.to_dict()

    def _wait_for_checks(self, round_: int) -> None:
        """Backpressure: a round does not start while this peer's checks of provers on probation, and its
        re-checks of published accusations, of rounds before ``round_ - CHECK_LAG_ROUNDS`` are pending (for at
        most `CHECK_WAIT_S`). A cheater is then out of this peer's groups within a bounded number of rounds, not
        seconds: on a loaded machine checks fall rounds behind rounds of a fraction of a second (seen: a cheater
        in 7 of an honest peer's rounds, bar 5). When the checks keep up, nothing waits; checks of trusted
        provers never hold a round (on a slow link they lag, and late ones are skipped). The link is the
        checks' meanwhile."""
        limit, lag = round_ - CHECK_LAG_ROUNDS, self._lag
        with lag.settled:
            if not lag.behind(limit):
                return
        began = time.monotonic()
        deadline = began + CHECK_WAIT_S
        lag.quiet.set()
        try:
            with lag.settled:
                while lag.behind(limit) and not self._worker.stopping.is_set():
                    if time.monotonic() >= deadline:  # e.g. a prover that went away: its fetch takes longer
                        self.counts["check wait timed out"] += 1
                        lag.gave_up_below = limit
                        break
                    lag.settled.wait(min(0.5, deadline - time.monotonic()))
        finally:
            lag.quiet.clear()
        self.counts["waits for checks"] += 1
        self.counts["waited for checks ms"] += round(1000 * (time.monotonic() - began))

    # ------------------------------------------------------------------------------------ after a round
    def after_round(
        self, group: Any, base: torch.Tensor, record: Any = None, averaged: torch.Tensor | None = None
    ) -> None:
        """A grouped round ended: keep its base, draw its checks, run this peer's on the worker (returns at once).
        ``record``: the round's `averaging.RoundRecord`, whose part digests bind each prover's commitment to what
        it sent this peer (`_Part`); ``averaged``: the round's result, the same on every member, which seeds the
        draw (`result_salts`)."""
        committed, self.replays.committed = self.replays.committed, None
        same = committed is not None and verify.same_bits(committed[0], base)
        base_digest = committed[1] if same else verify.params_digest(base)
        bases = self.replays.bases
        bases[base_digest] = base
        while len(bases) > KEEP_ROUNDS:
            bases.popitem(last=False)
        commitments: dict[str, Commitment] = {}
        raw: dict[str, dict] = {}
        for peer, gathered in group.gathered.items():
            peer = str(peer)
            work = gathered.get("work") if isinstance(gathered, dict) else None
            if work is None:  # with require_verified, matchmaking refused such members (`_policy`)
                self.counts["unverified"] += peer != self.identity.peer_id
                continue
            commitment = self._accepted(peer, work, gathered)
            if commitment is not None and commitment.params[0] == base_digest:
                commitments[peer], raw[peer] = commitment, work  # a member on another base is not checked here
        self._lag.newest_round = max([self._lag.newest_round, *(c.round for c in commitments.values())])
        parts = {prover: _Part.of(record, prover) for prover in commitments}
        for prover, part in parts.items():  # a statement an arbiter could not hold against this commitment
            if part is not None and part.statement.label != commitments[prover].digest():
                self._exclude_peer(prover, f"{UNBOUND} (its part's statement names another commitment)")
        for peer, gathered in group.gathered.items():  # an unreachable prover is back: it is asked once more
            owed = self._lag.owed.pop(str(peer), None)
            if owed is not None and not (isinstance(gathered, dict) and gathered.get("fresh")):  # fresh: restarted
                self._submit(self._check_one, *owed, True)
        if len(commitments) < 2:
            return
        seed = f"{group.group_id}:" + ":".join(commitments[p].digest() for p in sorted(commitments))
        salts = result_salts(averaged, group.members, getattr(record, "piece_numel", 0))
        draws = verify.draw_checks(
            seed, commitments, rate=lambda prover, _: self.standing.rate(self.config, prover), salts=salts
        )
        mine = [a for a in draws if a.verifier == self.identity.peer_id]
        for assignment in mine:
            prover = assignment.prover
            # a prover on probation (this peer has not passed `trust_after` of its checks): rounds wait for it
            probation = self.standing.passed[prover] < self.config.trust_after
            drawn, round_ = time.monotonic(), commitments[prover].round if probation else None
            part = parts.get(prover)
            self._submit(
                self._check_one,
                commitments[prover],
                raw[prover],
                assignment.segment,
                base,
                False,
                drawn,
                part,
                round_=round_,
            )

    def poll(self) -> None:
        """After every round, grouped or not: re-check the run's published accusations (on the worker, once at a time)."""
        if not self._disputes.polling.is_set():
            self._disputes.polling.set()
            if not self._submit(self._arbitrate_published, priority=_Worker.URGENT, round_=self._lag.newest_round):
                self._disputes.polling.clear()

    def _policy(self, peer: str, gathered: Any) -> str | None:
        """``require_verified``: matchmaking admits only members whose metadata carries a commitment signed
        by them for this run, at a CPU kernel level this peer can replay (a claimed level that no verifier has
        would escape every check); runs on the averager's loop; the first refusal of a peer goes to the ledger."""
        work = gathered.get("work") if isinstance(gathered, dict) else None
        reason = "sent no commitment (verified work required)" if work is None else None
        if work is not None:
            try:
                commitment = verify.verify_commitment(work, run=self.run).commitment
                if commitment.peer != peer:
                    reason = "sent another peer's commitment"
                elif commitment.cpu not in self.replays.levels:
                    reason = f"trains at a CPU kernel level this peer cannot replay ({commitment.cpu})"
            except WorkRejected as e:
                reason = f"sent a refused commitment: {e.reason}"
        if reason is not None:
            self.counts["refused members"] += 1
            if peer not in self.standing.refused and len(self.standing.refused) < _MAX_SETTLED:
                self.standing.refused[peer] = reason
                self._submit(self._record, "work_refused", {"peer": peer, "reason": reason})
        return reason

    def _accepted(self, peer: str, work: Any, gathered: Mapping) -> Commitment | None:
        try:
            commitment = verify.verify_commitment(work, run=self.run).commitment
            if commitment.peer != peer:
                raise WorkRejected("another peer's commitment", commitment.peer)
            if commitment.round != gathered.get("round") or commitment.samples != gathered.get("samples"):
                raise WorkRejected("round or samples differ from the metadata", f"round {commitment.round}")
        except WorkRejected as e:
            self.counts[f"rejected:{e.reason}"] += 1
            logger.warning("refused the work commitment of %s: %s", peer, e)
            return None
        return commitment

    # ------------------------------------------------------------------------------------ worker thread
    def _submit(self, job: Callable, *args: Any, priority: int = _Worker.ROUTINE, round_: int | None = None) -> bool:
        """Queue ``job`` on the worker; with ``round_``, counted in ``_lag.pending`` until it ends."""
        if round_ is None:
            return self._worker.submit(job, *args, priority=priority)
        lag = self._lag

        def settle() -> None:
            with lag.settled:
                lag.pending[round_] -= 1
                if lag.pending[round_] <= 0:
                    del lag.pending[round_]
                lag.settled.notify_all()

        @functools.wraps(job)
        def tracked(*job_args: Any) -> None:
            try:
                job(*job_args)
            finally:
                settle()

        with lag.settled:
            lag.pending[round_] += 1
        if not self._worker.submit(tracked, *args, priority=priority):
            settle()
            return False
        return True

    def _late(self, round_: int, drawn_at: float | None = None) -> bool:
        """A check of ``round_`` (drawn at ``drawn_at``, monotonic) is late: the prover, which keeps its last
        `KEEP_ROUNDS` phases and may be a round ahead of this peer, may rightly have forgotten it, and it was
        drawn `LATE_AFTER_S` ago or more (younger phases are kept too, within `KEEP_BYTES`). Late checks are
        skipped, never held against the prover (this peer's checks could not keep up: a slow link, a busy core);
        one the prover answers "forgotten" to is counted late too."""
        if round_ >= self._lag.newest_round - (KEEP_ROUNDS - 2):
            return False
        if drawn_at is not None and time.monotonic() - drawn_at < LATE_AFTER_S:
            return False
        self.counts["late"] += 1
        return True

    def _check_one(
        self,
        commitment: Commitment,
        work: dict,
        segment: int,
        base: torch.Tensor,
        asked_again: bool = False,
        drawn_at: float | None = None,
        part: _Part | None = None,
    ) -> None:
        if self._late(commitment.round, drawn_at):
            return
        if commitment.peer in self.standing.excluded:  # excluded meanwhile (a re-check ran first): nothing to learn
            self.counts["excluded before checked"] += 1
            return
        try:
            inputs = self._fetch(commitment.peer, commitment.round, segment)
        except _Forgotten:
            # an honest prover drops a phase once it committed KEEP_ROUNDS newer ones: plausible only if this
            # peer asked a round or more late (its own round moved on); asked at once, it is a refusal
            if self._lag.newest_round >= commitment.round + 2:
                self.counts["late"] += 1
                return
            logger.warning(
                "round %s: %s answered 'forgotten' although this peer asked at round %s",
                commitment.round, commitment.peer, self._lag.newest_round,
            )  # fmt: skip
            inputs = None
        if self._worker.stopping.is_set():  # shutting down: the fetch was cancelled, nothing to hold against anyone
            return
        if inputs is None and self._late(commitment.round, drawn_at):  # fell behind while fetching
            return
        if inputs is None and commitment.peer in self._lag.unreachable and not asked_again:
            # gone (left, killed, restarted) or a link failed: no verdict now; asked again if it shows up in
            # this peer's groups meanwhile (still in the run, so it must serve: `after_round`)
            self.counts["unreachable"] += 1
            if len(self._lag.owed) < _MAX_SETTLED:
                self._lag.owed[commitment.peer] = (commitment, work, segment, base)
            return
        if inputs is None:
            logger.warning(
                "round %s: no replay inputs from %s (segment %s, asked again: %s, this peer at round %s)",
                commitment.round, commitment.peer, segment, asked_again, self._lag.newest_round,
            )  # fmt: skip
        try:
            outcome = verify.check(
                self.spec.task, self.spec.task_digest, commitment, segment, inputs, **self._replaying(base, commitment)
            )
        except CannotReplayHere as e:  # this machine lacks the prover's CPU kernel level: no verdict here
            self.counts["cannot replay here"] += 1
            logger.info("round %s: cannot replay the work of %s here: %s", commitment.round, commitment.peer, e)
            return
        sent_other = outcome[0] and part is not None and not part.matches(base - inputs.end_params, commitment)
        if sent_other:  # its replay checks out, but what it averaged with this peer was not that update
            outcome = (False, UNBOUND, "")
            self.counts["part not its update"] += 1
        ok, reason, _ = outcome
        self.counts["checks"] += 1
        self.counts["passed" if ok else ("refused" if inputs is None else "failed")] += 1
        if ok and (commitment.peer in self.standing.passed or len(self.standing.passed) < _MAX_SETTLED):
            self.standing.passed[commitment.peer] += 1
        signed = verify.verdict_of(self.identity, commitment, segment, outcome)
        self._record("work_check", signed["verdict"])
        if ok:
            return
        logger.warning("round %s: the work of %s failed its check: %s", commitment.round, commitment.peer, reason)
        if sent_other:  # seen on this peer's own stream, and shown to others as the prover signed it
            self._exclude_peer(commitment.peer, f"{UNBOUND} (its part of this peer's slice)")
            self._publish({**signed, "work": work, "part": part.shown()})
            return
        self._exclude_peer(commitment.peer, f"failed a replay check: {reason}")
        self._publish({**signed, "work": work})  # the commitment as the prover signed it: anyone can re-check

    def _replaying(self, base: torch.Tensor, commitment: Commitment) -> dict[str, Any]:
        """`verify.check`'s and `verify.arbitrate`'s keywords for ``commitment``: the base, and where its replay
        runs (`_Replays.apart`: torch's thread count and CPU kernel level are per process, so a replay at the
        prover's, when they are not this process's, runs in a replayer's). CannotReplayHere for a level this
        CPU lacks, without starting a process for it (an untrusted claim: one process per claimed level would
        let a prover make this peer start one per check)."""
        if commitment.cpu not in self.replays.levels:
            levels = sorted(self.replays.levels)
            raise CannotReplayHere(f"the prover's CPU kernel level {commitment.cpu!r:.40}, here {levels}")
        apart = (
            self.replays.random
            or commitment.threads != torch.get_num_threads()
            or commitment.cpu != verify.cpu_capability()
        )
        replayer = self.replays.replayer(commitment.cpu).replay if apart else None
        return {"base": base, "streams": self.replays.streams, "replayer": replayer}

    def _fetch(self, prover: str, round_: int, segment: int, attempts: int = 2) -> ReplayInputs | None:
        """The prover's replay inputs; None if it answered that it has none (or sent malformed ones), or a chunk
        could not be reached ``attempts`` times in a row (a reset or cut-off stream counts as not reached, never
        as an answer) or the whole fetch outlasted `FETCH_DEADLINE_S` (then
        ``self._lag.unreachable`` holds it: it may have left the run). Chunk by chunk, each between this
        peer's rounds (`_Lag.quiet`, waited for at most `TIMEOUT_S`)."""
        self._lag.unreachable.discard(prover)
        parts: list[bytes] = []
        size, received, failures = None, 0, 0
        deadline = time.monotonic() + FETCH_DEADLINE_S
        while (size is None or received < size) and failures < attempts and time.monotonic() < deadline:
            if not self._lag.quiet.wait(TIMEOUT_S):
                self.counts["link wait timed out"] += 1  # a round longer than that, or one not ended by `begin`
            if self._worker.stopping.is_set():
                return None
            try:
                answer = self._service.runtime.call(
                    self._request(prover, round_, segment, received), timeout_s=TIMEOUT_S
                )
            except _Forgotten:
                raise
            except Exception as e:  # unreachable, reset, timed out: once more, then the prover did not serve
                failures += 1
                logger.info("could not fetch replay inputs from %s (attempt %s): %r", prover, failures, e)
                continue
            if answer is None:
                logger.info(
                    "%s has no replay inputs of round %s, segment %s (at offset %s)", prover, round_, segment, received
                )
                return None
            total, chunk = answer
            if size is not None and total != size:
                self.counts["rejected:malformed"] += 1
                logger.info("%s changed the size of its replay inputs: %s, then %s bytes", prover, size, total)
                return None
            size, received, failures = total, received + len(chunk), 0  # ``attempts`` failures in a row
            parts.append(chunk)
        if size is None or received < size:
            self._lag.unreachable.add(prover)
            return None
        try:
            return ReplayInputs.from_bytes(b"".join(parts))
        except WorkRejected as e:
            self.counts[f"rejected:{e.reason}"] += 1
            logger.info("malformed replay inputs from %s: %s", prover, e)
            return None

    async def _request(self, prover: str, round_: int, segment: int, offset: int) -> tuple[int, bytes] | None:
        """One chunk of the prover's inputs from ``offset``: (their whole size, the chunk), or None (it has none)."""
        _, reader, writer = await self._service.p2p.call_binary_stream_handler(
            peer_id_of(prover), self._service.handler_name
        )
        try:
            await write_frame(writer, {"round": round_, "segment": segment, "offset": offset})
            header = await read_frame(reader, max_header_bytes=_MAX_HEADER)
            if header.get("status") == "forgotten":
                raise _Forgotten(prover)
            if header.get("status") != "ok":
                return None
            size = header_field(header, "size", int, low=offset + 1, high=verify.MAX_INPUT_BYTES)
            chunk = await read_blob(reader, max_bytes=CHUNK_BYTES)
            if not chunk or offset + len(chunk) > size:
                raise ProtocolError("malformed chunk", f"{len(chunk)} bytes at {offset} of {size}")
            return size, chunk
        except ProtocolError as e:
            if e.reason == "truncated":  # the stream ended early (reset): a link failure, asked again, not an answer
                raise ConnectionError(f"the answer was cut off: {e}") from None
            self.counts[f"rejected:{e.reason}"] += 1
            logger.info("malformed replay inputs from %s: %s", prover, e)
            return None
        finally:
            writer.close()

    async def _serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header = await asyncio.wait_for(read_frame(reader, max_header_bytes=_MAX_HEADER), TIMEOUT_S)
            round_ = header_field(header, "round", int, low=0, high=2**62)
            segment = header_field(header, "segment", int, low=0, high=verify.MAX_BOUNDARIES)
            offset = header_field(header, "offset", int, low=0, high=verify.MAX_INPUT_BYTES)
            data = await self._serialized(round_, segment)
            if data is None or offset >= len(data):
                with self._lock:  # it had that phase, and dropped it for newer ones (KEEP_ROUNDS), or never had it
                    kept = sorted(self.recorder.kept)
                forgot = data is None and bool(kept) and round_ < kept[0]
                logger.info(
                    "asked for round %s, segment %s at offset %s by %s: %s (kept rounds %s)",
                    round_, segment, offset, info.peer_id, "forgotten" if forgot else "missing", kept,
                )  # fmt: skip
                await write_frame(writer, {"status": "forgotten" if forgot else "missing"})
            else:
                await write_frame(writer, {"status": "ok", "size": len(data)})
                await asyncio.wait_for(write_blob(writer, data[offset : offset + CHUNK_BYTES]), TIMEOUT_S)
                self.counts["served chunks"] += 1
            await linger(reader, TIMEOUT_S)  # until the verifier, having read it all, hangs up
        except ProtocolError as e:
            self.counts[f"rejected:{e.reason}"] += 1
        except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError) as e:
            logger.debug("work stream from %s ended: %r", info.peer_id, e)
        except asyncio.CancelledError:
            logger.debug("work stream cancelled at shutdown")
        except Exception as e:  # never let a peer's bytes crash the server
            self.counts["rejected:internal error"] += 1
            logger.warning("error while serving replay inputs to %s: %r", info.peer_id, e)
        finally:
            writer.close()

    async def _serialized(self, round_: int, segment: int) -> bytes | None:
        """The replay inputs of ``segment`` of the phase committed for ``round_`` as bytes (kept while they
        are fetched chunk by chunk, even if the phase is forgotten meanwhile), or None."""
        key = (round_, segment)
        with self._lock:
            data = self._served.get(key)
            inputs = self.recorder.inputs(round_, segment) if data is None else None
        if data is None and inputs is not None:
            data = await asyncio.get_running_loop().run_in_executor(None, inputs.to_bytes)
            with self._lock:
                self._served[key] = data
                while len(self._served) > _SERVED_KEPT:
                    self._served.popitem(last=False)
        return data

    def tally(self) -> dict[str, Any]:
        """This peer's checks for the status board (`swarm.status.WorkTally`): done, passed, failed, refused
        and the peers it excluded (newest last, at most 16)."""
        counts = self.counts
        return {
            "checks": counts["checks"],
            "passed": counts["passed"],
            "failed": counts["failed"],
            "refused": counts["refused"],
            "excluded": list(self.standing.excluded)[-16:],
        }

    def _exclude_peer(self, peer: str, reason: str) -> None:
        if peer == self.identity.peer_id or peer in self.standing.excluded:
            return
        self.standing.excluded[peer] = reason
        self._exclude(peer, reason)
        self._record("work_excluded", {"peer": peer, "reason": reason})
        logger.warning("excluded %s from this peer's groups: %s", peer, reason)

    @property
    def _verdicts_key(self) -> str:
        return f"swarm_{self.run}.verdicts"

    def _publish(self, entry: dict) -> None:
        self._disputes.published = [entry, *self._disputes.published][:_VERDICTS_KEPT]
        failure = store_within(
            self._disputes.dht,
            self._verdicts_key,
            {"v": self._disputes.published},
            subkey=self.identity.peer_id,
            expiration_time=get_dht_time() + _VERDICT_EXPIRY_S,
            timeout_s=TIMEOUT_S,
        )
        if failure is not None:
            logger.info("could not publish a verdict: %s", failure)

    def _arbitrate_published(self) -> None:
        """Re-check every failing verdict in the run's verdicts key that this peer can replay."""
        try:
            found = latest_within(self._disputes.dht, self._verdicts_key, timeout_s=TIMEOUT_S)
        except Exception as e:
            logger.debug("could not read the verdicts: %r", e)
            return
        finally:
            self._disputes.polling.clear()
        if found is None or not isinstance(found.value, dict):
            return
        for verifier, item in list(found.value.items())[:64]:
            value = getattr(item, "value", None)
            entries = value.get("v") if isinstance(value, dict) else None
            if str(verifier) == self.identity.peer_id or not isinstance(entries, list):
                continue
            for entry in entries[:_VERDICTS_KEPT]:
                if self._worker.stopping.is_set():
                    return
                self._recheck(entry)

    def _recheck(self, entry: Any) -> None:
        try:
            if not isinstance(entry, dict) or set(entry) - {"part"} != {"verdict", "signature", "work"}:
                raise WorkRejected("malformed", "verdict entry")
            verdict = verify.verify_verdict({"verdict": entry["verdict"], "signature": entry["signature"]})
            signed = verify.verify_commitment(entry["work"], run=self.run)
        except WorkRejected as e:
            self.counts[f"rejected:{e.reason}"] += 1
            return
        key = f"{verdict.verifier}:{verdict.commitment}:{verdict.segment}"
        prover, liar = signed.commitment.peer, verdict.verifier
        if verdict.ok or key in self._disputes.settled:
            return
        # the prover is out already (a verdict signed by an excluded verifier may still be true: it is replayed)
        if prover in self.standing.excluded:
            return
        commitment = signed.commitment
        if len(self._disputes.settled) >= _MAX_SETTLED:  # bounded: a verdict seen long ago may be replayed once more
            self._disputes.settled.clear()
        self._disputes.settled.add(key)
        if verdict.reason == UNBOUND:  # its replay passes; the part it signed tells
            if liar not in self.standing.excluded:  # an excluded accuser's word costs this peer no fetch
                self._judge_unbound(entry, commitment, verdict)
            return
        inputs = self._inputs(prover, commitment.round, verdict.segment)
        base = self.replays.bases.get(commitment.params[0])
        if base is None and verdict.reason != "not from the round's base":
            # not in that round's group: the phase's own start (served, digest-checked) stands in for the base;
            # whether it *was* the round's base only that group can tell, so such verdicts are left to it
            first = self._inputs(prover, commitment.round, 0) if verdict.segment else inputs
            if first is not None and verify.params_digest(first.start.params) == commitment.params[0]:
                base = first.start.params
        if base is None or inputs is None:  # not served (any more): no one is excluded on this verdict here
            self.counts["cannot recheck: " + ("inputs not served" if inputs is None else "no base")] += 1
            return
        try:
            outcome = verify.arbitrate(
                self.spec.task,
                self.spec.task_digest,
                signed,
                verdict,
                inputs,
                **self._replaying(base, signed.commitment),
            )
        except CannotReplayHere:
            self.counts["cannot recheck: its CPU kernel level"] += 1
            return
        self.counts["rechecked"] += 1
        self._record("work_dispute", {"verdict": entry["verdict"], "outcome": outcome})
        if outcome == "prover":
            self.counts["confirmed"] += 1
            self._exclude_peer(prover, f"failed a replay check ({verdict.reason}), confirmed here")
        elif outcome == "verifier" and verdict.reason == "inputs refused":
            self.counts["refusal not confirmed"] += 1  # the prover served this peer: a link may have failed
        elif outcome == "verifier":
            self.counts["liars"] += 1
            self._exclude_peer(liar, f"accused {prover} falsely: its work replays to its commitment")

    def _judge_unbound(self, entry: dict, commitment: Commitment, verdict: verify.Verdict) -> None:
        """An accusation that a prover averaged another update than it committed (`UNBOUND`), judged on the part
        the accuser shows: the prover's signed statement of what it sent the accuser's slice, labelled with this
        commitment (else the verdict proves nothing and is set aside). Against the committed update (``base -
        end``, from one fetch of the phase's first segment, digest-checked against the commitment): a mismatch
        excludes the prover, a match shows the accuser lied, since a reducer takes a part only with a statement of
        exactly what came. Nothing is replayed: the accusation says the work replays."""
        shown = entry.get("part")
        part = (
            _Part.signed(shown.get("statement"), shown.get("signature"), commitment.peer, self.run)
            if isinstance(shown, dict)
            else None
        )
        if part is None or part.statement.label != verdict.commitment or verdict.commitment != commitment.digest():
            self.counts["rejected:unbound without its signed part"] += 1
            return
        # the first segment's inputs: the phase's start (the base it committed to) and its end, both digest-checked
        inputs = self._inputs(commitment.peer, commitment.round, 0)
        base = self.replays.bases.get(commitment.params[0])
        if base is None and inputs is not None and verify.params_digest(inputs.start.params) == commitment.params[0]:
            base = inputs.start.params  # not in that group: the phase's own start
        end = inputs.end_params if inputs is not None else None
        if base is None or end is None or end.shape != base.shape or verify.params_digest(end) != commitment.params[-1]:
            self.counts["cannot recheck: inputs not served"] += 1
            return
        self.counts["rechecked"] += 1
        if part.matches(base - end, commitment):
            self.counts["liars"] += 1
            self._record("work_dispute", {"verdict": entry["verdict"], "outcome": "verifier"})
            self._exclude_peer(verdict.verifier, f"accused {commitment.peer} falsely: the part it signed is its update")
            return
        self.counts["confirmed"] += 1
        self._record("work_dispute", {"verdict": entry["verdict"], "outcome": "prover"})
        self._exclude_peer(commitment.peer, f"{UNBOUND} (the part it signed), confirmed here")

    def _inputs(self, prover: str, round_: int, segment: int) -> ReplayInputs | None:
        if prover == self.identity.peer_id:  # accused: this peer replays its own work like any arbiter
            with self._lock:
                return self.recorder.inputs(round_, segment)
        try:
            return self._fetch(prover, round_, segment)
        except _Forgotten:
            return None

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the worker (its fetch in flight is cancelled with the handler; a replay in progress finishes,
        within ``timeout_s``), then the handler."""
        self._worker.stop()
        self._lag.quiet.set()  # a fetch waiting for the round to end stops at once
        self._service.close(timeout_s)
        self._worker.join(timeout_s)
        self.replays.close()
