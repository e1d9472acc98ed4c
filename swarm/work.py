"""Verified work in a running trainer: commit to each phase, check the segments drawn to this peer, spread
the verdicts, re-check every accusation, exclude whoever a replay shows wrong.

`swarm.verify` holds the pure parts (commitments, replay, the draw); this is their network side, one
`WorkChecks` per trainer (blocking rounds only; an overlapped trainer does not commit):

* **Prover.** The trainer draws its batches from `batches` (the task's deterministic shard stream),
  calls `stepped` after each inner step and `commit` at the sync point; the signed commitment rides in
  the round's gathered metadata (``"work"``). This peer serves the replay inputs of its last
  ``keep_rounds`` phases on the ``swarm_<run>.work`` stream handler.
* **Verifier.** After a grouped round, every member draws the same checks from the group's id and its
  commitments (`swarm.verify.draw_checks`: fixed only once every commitment was sent). The checks
  drawn to this peer run on one worker thread: fetch the prover's inputs, replay, sign a verdict,
  write it to the ledger (``work_check``). A failed check excludes the prover here at once and is
  published under the run's verdicts key (owner-bound: subkey = the verifier), with the commitment.
* **Arbiter.** Each round the worker reads the verdicts key. A failing verdict this peer can re-check
  (it holds that round's base) is replayed a third time: if the prover's work fails again the prover
  is excluded; if it checks out the *verifier* lied, and is excluded (ledger: ``work_dispute``).
  Nobody is excluded on hearsay: only on this peer's own replay.

Excluded peers are never drawn into a group, admitted to a lobby or waited for (`averaging.GroupAverager.exclude`),
so they sign no seal with the others. Members that send no commitment (a custom data loop, an
overlapped trainer) are counted as unverified; with ``require_verified`` they are excluded.

Known limit: the replay runs on a worker thread and reseeds torch's global RNG for the segment; a task
whose training step draws random numbers (dropout > 0) can then differ from its replay. The built-in
tasks' presets draw none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from hivemind import DHT
from hivemind.utils import get_dht_time

from bootstrap.framing import ProtocolError, header_field, read_blob, read_frame, write_blob, write_frame
from bootstrap.identity import Identity
from bootstrap.runtime import Handler, peer_id_of
from swarm import verify
from swarm.config import WorkConfig
from swarm.verify import Commitment, ReplayInputs, WorkRecorder, WorkRejected

logger = logging.getLogger(__name__)

_MAX_HEADER = 1024
_VERDICTS_KEPT = 8
"""Failing verdicts a verifier keeps published (newest first)."""
_VERDICT_EXPIRY_S = 600.0
KEEP_ROUNDS = 3
_MAX_SETTLED = 10_000
"""Committed phases a prover keeps to serve (and bases a verifier keeps for re-checks)."""
TIMEOUT_S = 30.0
"""Bound on one fetch of replay inputs, one DHT read or store of verdicts, the handler's start."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkSpec:
    """What a trainer's verified work replays: a registry task and this peer's place in its data."""

    task: Any
    """A `swarm.tasks.Task` (its config digest is the run's)."""
    task_digest: str
    shard_index: int
    num_shards: int
    seed: int = 0


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
        record: Callable[[str, dict], None],
        params: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        first_step: int,
    ) -> None:
        self.spec, self.identity, self.config, self.run, self.warmup_steps = spec, identity, config, run, warmup_steps
        self.params, self.optimizer = params, optimizer
        """The trainer's trainable parameters (in order) and inner optimizer: what each phase records."""
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
        """checks / passed / failed / refused / unverified / rechecked / confirmed / liars (false accusations
        found) / cannot recheck / rejected:REASON."""
        self.excluded: dict[str, str] = {}
        self.bases: OrderedDict[str, torch.Tensor] = OrderedDict()
        """The base parameters (flat fp32) of this peer's last `KEEP_ROUNDS` grouped rounds, by digest: re-checks."""
        self._published: list[dict] = []
        self._settled: set[str] = set()
        self._polling = threading.Event()
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue(maxsize=64)
        threading.Thread(target=self._work, name="swarm-work", daemon=True).start()
        self._service = Handler(dht, handler_name=f"swarm_{run}.work", handler=self._serve, start_timeout_s=TIMEOUT_S)
        self.dht = dht
        self.begin(first_step=first_step)

    @classmethod
    def for_trainer(cls, trainer: Any, spec: WorkSpec | None) -> WorkChecks | None:
        """A `swarm.Trainer`'s verified work, or None: ``verify_work`` off, no spec, overlapped rounds, or a DHT
        that is not the trainer's own (nothing could be signed)."""
        cfg = trainer.config
        if not cfg.work.verify_work or spec is None or cfg.overlap or trainer.identity.peer_id != trainer.peer_id:
            return None
        exclude, record = trainer.group_averager.exclude, trainer.evidence.record
        return cls(
            trainer.dht, trainer.identity, spec, cfg.work, run=cfg.run, warmup_steps=cfg.inner_warmup_steps,
            exclude=exclude, record=record, params=list(trainer.outer.params), optimizer=trainer.inner_optimizer,
            first_step=trainer.local_step + 1,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------ prover
    def batches(self) -> Iterator[Any]:
        """The batches this peer trains on: one per inner step, from its shard's deterministic stream."""
        return self.recorder.batches()

    def begin(self, *, first_step: int) -> None:
        """A phase starts (the model holds the global state); ``first_step``: the local step number of its first step."""
        self.recorder.begin(self.params, self.optimizer, first_step=first_step)

    def stepped(self) -> None:
        """After each inner step (the optimizer's learning rates back at their own values)."""
        self.recorder.stepped(self.params, self.optimizer)

    def commit(self, pseudo: Any, samples: int, round_: int) -> dict | None:
        """The phase's signed commitment, as it goes into the round's gathered metadata (None: not replayable).
        ``pseudo``: the round's `swarm.outer.PseudoGradient` (its state begins with the base parameters)."""
        signed = self.recorder.commit(
            self.params,
            self.optimizer,
            base=pseudo.state[: pseudo.delta.numel()],
            identity=self.identity,
            run=self.run,
            round_=round_,
            task_digest=self.spec.task_digest,
            samples=samples,
            warmup_steps=self.warmup_steps,
        )
        with self._lock:
            self.recorder.forget(KEEP_ROUNDS)
        return signed.to_dict() if signed is not None else None

    # ------------------------------------------------------------------------------------ after a round
    def after_round(self, group: Any, base: torch.Tensor) -> None:
        """A grouped round ended: keep its base, draw its checks, run this peer's on the worker (returns at once)."""
        base_digest = verify.params_digest(base)
        self.bases[base_digest] = base
        while len(self.bases) > KEEP_ROUNDS:
            self.bases.popitem(last=False)
        commitments: dict[str, Commitment] = {}
        raw: dict[str, dict] = {}
        for peer, gathered in group.gathered.items():
            peer = str(peer)
            work = gathered.get("work") if isinstance(gathered, dict) else None
            if work is None:
                self.counts["unverified"] += peer != self.identity.peer_id
                if self.config.require_verified and peer != self.identity.peer_id:
                    self._exclude_peer(peer, "sent no commitment (verified work required)")
                continue
            commitment = self._accepted(peer, work, gathered)
            if commitment is not None and commitment.params[0] == base_digest:
                commitments[peer], raw[peer] = commitment, work  # a member on another base is not checked here
        if len(commitments) < 2:
            return
        seed = f"{group.group_id}:" + ":".join(commitments[p].digest() for p in sorted(commitments))
        mine = [
            a
            for a in verify.draw_checks(seed, commitments, rate=self.config.check_rate)
            if a.verifier == self.identity.peer_id
        ]
        for assignment in mine:
            prover = assignment.prover
            self._submit(self._check_one, commitments[prover], raw[prover], assignment.segment, base)

    def poll(self) -> None:
        """After every round, grouped or not: re-check the run's published accusations (on the worker, once at a time)."""
        if not self._polling.is_set():
            self._polling.set()
            if not self._submit(self._arbitrate_published):
                self._polling.clear()

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
    def _submit(self, job: Callable, *args: Any) -> bool:
        try:
            self._jobs.put_nowait((job, args))
        except queue.Full:  # checks pile up faster than they run: this one is skipped
            self.counts["skipped"] += 1
            return False
        return True

    def _work(self) -> None:
        """The worker (a daemon thread: a check or a DHT read in progress never holds up the process's exit)."""
        while (item := self._jobs.get()) is not None:
            job, args = item
            try:
                job(*args)
            except Exception as e:  # a check must never stop the others
                self.counts["internal error"] += 1
                logger.warning("verified work: %s failed: %r", job.__name__, e)

    def _check_one(self, commitment: Commitment, work: dict, segment: int, base: torch.Tensor) -> None:
        inputs = self._fetch(commitment.peer, commitment.round, segment)
        outcome = verify.check(self.spec.task, self.spec.task_digest, commitment, segment, inputs, base=base)
        ok, reason, _ = outcome
        self.counts["checks"] += 1
        self.counts["passed" if ok else ("refused" if inputs is None else "failed")] += 1
        signed = verify.verdict_of(self.identity, commitment, segment, outcome)
        self._record("work_check", signed["verdict"])
        if ok:
            return
        logger.warning("round %s: the work of %s failed its check: %s", commitment.round, commitment.peer, reason)
        self._exclude_peer(commitment.peer, f"failed a replay check: {reason}")
        self._publish({**signed, "work": work})  # the commitment as the prover signed it: anyone can re-check

    def _fetch(self, prover: str, round_: int, segment: int, attempts: int = 2) -> ReplayInputs | None:
        """The prover's replay inputs; None if it answered that it has none, or failed ``attempts`` times."""
        for attempt in range(attempts):
            try:
                data = self._service.runtime.call(self._request(prover, round_, segment), timeout_s=TIMEOUT_S)
                return ReplayInputs.from_bytes(data) if data is not None else None
            except WorkRejected as e:
                self.counts[f"rejected:{e.reason}"] += 1
                return None
            except Exception as e:  # unreachable, reset, timed out: once more, then the prover did not serve
                logger.info("could not fetch replay inputs from %s (attempt %s): %r", prover, attempt + 1, e)
        return None

    async def _request(self, prover: str, round_: int, segment: int) -> bytes | None:
        _, reader, writer = await self._service.p2p.call_binary_stream_handler(
            peer_id_of(prover), self._service.handler_name
        )
        try:
            await write_frame(writer, {"round": round_, "segment": segment})
            header = await read_frame(reader, max_header_bytes=_MAX_HEADER)
            if header.get("status") != "ok":
                return None
            return await read_blob(reader, max_bytes=verify.MAX_INPUT_BYTES)
        finally:
            writer.close()

    async def _serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header = await asyncio.wait_for(read_frame(reader, max_header_bytes=_MAX_HEADER), TIMEOUT_S)
            round_ = header_field(header, "round", int, low=0, high=2**62)
            segment = header_field(header, "segment", int, low=0, high=verify.MAX_BOUNDARIES)
            with self._lock:
                inputs = self.recorder.inputs(round_, segment)
            if inputs is None:
                await write_frame(writer, {"status": "missing"})
                return
            data = await asyncio.get_running_loop().run_in_executor(None, inputs.to_bytes)
            await write_frame(writer, {"status": "ok"})
            await asyncio.wait_for(write_blob(writer, data), TIMEOUT_S)
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

    def _exclude_peer(self, peer: str, reason: str) -> None:
        if peer == self.identity.peer_id or peer in self.excluded:
            return
        self.excluded[peer] = reason
        self._exclude(peer, reason)
        logger.warning("excluded %s from this peer's groups: %s", peer, reason)

    @property
    def _verdicts_key(self) -> str:
        return f"swarm_{self.run}.verdicts"

    def _publish(self, entry: dict) -> None:
        self._published = [entry, *self._published][:_VERDICTS_KEPT]
        expiry = get_dht_time() + _VERDICT_EXPIRY_S
        try:
            stored = self.dht.store(
                self._verdicts_key, {"v": self._published}, expiry, subkey=self.identity.peer_id, return_future=True
            )
            stored.result(timeout=TIMEOUT_S)
        except Exception as e:
            logger.info("could not publish a verdict: %r", e)

    def _arbitrate_published(self) -> None:
        """Re-check every failing verdict in the run's verdicts key that this peer can replay."""
        try:
            found = self.dht.get(self._verdicts_key, latest=True, return_future=True).result(timeout=TIMEOUT_S)
        except Exception as e:
            logger.debug("could not read the verdicts: %r", e)
            return
        finally:
            self._polling.clear()
        if found is None or not isinstance(found.value, dict):
            return
        for verifier, item in list(found.value.items())[:64]:
            value = getattr(item, "value", None)
            entries = value.get("v") if isinstance(value, dict) else None
            if str(verifier) == self.identity.peer_id or not isinstance(entries, list):
                continue
            for entry in entries[:_VERDICTS_KEPT]:
                self._recheck(entry)

    def _recheck(self, entry: Any) -> None:
        try:
            if not isinstance(entry, dict) or set(entry) != {"verdict", "signature", "work"}:
                raise WorkRejected("malformed", "verdict entry")
            verdict = verify.verify_verdict({"verdict": entry["verdict"], "signature": entry["signature"]})
            signed = verify.verify_commitment(entry["work"], run=self.run)
        except WorkRejected as e:
            self.counts[f"rejected:{e.reason}"] += 1
            return
        key = f"{verdict.verifier}:{verdict.commitment}:{verdict.segment}"
        prover, liar = signed.commitment.peer, verdict.verifier
        if verdict.ok or key in self._settled:
            return
        if prover in self.excluded:  # a verdict signed by an excluded verifier may still be true: it is replayed
            return
        commitment = signed.commitment
        if len(self._settled) >= _MAX_SETTLED:  # bounded: a verdict seen long ago may be replayed once more
            self._settled.clear()
        self._settled.add(key)
        inputs = self._inputs(prover, commitment.round, verdict.segment)
        base = self.bases.get(commitment.params[0])
        if base is None and verdict.reason != "not from the round's base":
            # not in that round's group: the phase's own start (served, digest-checked) stands in for the base;
            # whether it *was* the round's base only that group can tell, so such verdicts are left to it
            first = self._inputs(prover, commitment.round, 0) if verdict.segment else inputs
            if first is not None and verify.params_digest(first.start.params) == commitment.params[0]:
                base = first.start.params
        if base is None or inputs is None:  # not served (any more): no one is excluded on this verdict here
            self.counts["cannot recheck"] += 1
            return
        outcome = verify.arbitrate(self.spec.task, self.spec.task_digest, signed, verdict, inputs, base=base)
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

    def _inputs(self, prover: str, round_: int, segment: int) -> ReplayInputs | None:
        if prover == self.identity.peer_id:  # accused: this peer replays its own work like any arbiter
            with self._lock:
                return self.recorder.inputs(round_, segment)
        return self._fetch(prover, round_, segment)

    def close(self, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(queue.Full):
            self._jobs.put_nowait(None)
        self._service.close(timeout_s)
