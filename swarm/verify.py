"""Verified work: a peer's signed commitment to its inner steps, and the spot-check replay that tests it.

A peer that claims samples must have trained on them. Each phase (the inner steps between two
rounds) a `WorkRecorder` takes, every ``segment_steps`` steps, a digest of the trainable parameters
and of the inner optimizer's state (a *boundary*), and keeps the states themselves until the phase's
checks are done. With its contribution the peer signs a `Commitment`: the task's config digest, its
shard and seed, where in the shard's deterministic batch stream the phase began, the local step it
began at (for the warm-up), the boundary digests and the digest of its pseudo-gradient.

After the round is sealed, `draw_checks` picks, from the sealed manifest's digest (unknown until the
contributions were sent), which contributions are checked, one segment of each and a verifier among
the other contributors. The verifier asks the prover for `ReplayInputs` (the states at the segment's
start and the end parameters; safetensors bytes, never pickle) and `check` then:

1. the phase started from the round's base: ``params[0]`` is the digest of the base parameters;
2. the served states are the committed ones (digests), else the prover served something else;
3. the pseudo-gradient is ``base - end parameters`` (its digest);
4. replaying the segment (same batches, same optimizer, same warm-up factors, the same RNG seed) from its
   start gives the committed next boundary, bit for bit on a CPU (``tolerance`` 0), at the prover's number
   of torch threads and its CPU kernel level (both in the commitment). Both matter: torch's CPU reductions
   split their sums by thread, and charlm replayed with 1 thread differs from its training with 2 in every
   segment; trained with AVX2 kernels and replayed with AVX512 ones, too. A verifier replays at the prover's
   level by running torch with ``ATEN_CPU_CAPABILITY`` lowered to it (`swarm.replayer`); a prover whose level
   this CPU lacks is not checked here.

A peer that did not train (a free rider), trained on another shard, or presents an earlier phase's
work fails 1 or 4; one that will not serve its inputs is recorded as refusing. A check replays one segment, so a
peer that skips a fraction f of its segments is caught only when a check draws one of them: with probability f
a check, about ``rate x f`` a round. At the defaults (10-step phases of five 2-step segments, a trusted rate of
0.25) a peer that skips one segment a phase saves a fifth of its compute and is caught with probability 0.05 a
round, in 20 rounds on average (0.18 a round on probation). A `Verdict` is signed
by its verifier. `arbitrate` is the third replay that settles a dispute: a verifier that accused a
peer whose segment replays to its commitment is shown wrong.

Cost: recording hashes ``3 x params`` fp32 bytes (AdamW) per boundary, one step after taking it (so not
at the sync point, inside the round), and keeps ``boundaries`` copies of it; a check replays
``segment_steps`` inner steps (``segment_steps / steps`` of a phase), at most `MAX_REPLAY_STEPS`.

The network side (serving `ReplayInputs`, running the drawn checks, spreading verdicts, exclusion) is
`swarm.work`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from bootstrap.envelope import JsonFields, Signable, check_hex, check_int, check_str, from_dict, strict_json
from bootstrap.errors import Rejected
from bootstrap.identity import Identity, canonical_json, public_key_from_peer_id, verify
from swarm.recipe import inner_step

COMMITMENT_KIND = "swarm/work"
"""Signature domain of work commitments."""
VERDICT_KIND = "swarm/verdict"
"""Signature domain of check verdicts."""
VERSION = 2
"""Schema version of commitments and verdicts (2: commitments name the prover's torch threads and CPU
kernel level)."""
MAX_BOUNDARIES = 33
"""Most boundaries a commitment may name (32 segments): 8 commitments fit a round's gathered metadata."""
MAX_INPUT_BYTES = 4 << 30
"""Largest `ReplayInputs` accepted."""
MAX_REPLAY_THREADS = 256
"""Most torch threads a commitment may name (a replay runs with as many)."""
MAX_REPLAY_STEPS = 256
"""Most inner steps one check replays (a segment); a phase with longer segments is not committed."""
MAX_STREAM_POSITION = 1 << 22
"""Furthest batch of a shard's stream a check draws (a task's stream is read from its start, or from where
the verifier's last replay of that shard stopped): a phase beyond it is not committed, nor replayed."""
REPLAYABLE_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}
"""Inner optimizers a verifier rebuilds (by class name); others are not replayable."""
_MAX_ID = 128
_GROUP_VALUE = (int, float, bool, str, type(None))


class WorkRejected(Rejected):
    """A commitment, verdict or replay input was refused (malformed, wrong signature, inconsistent)."""

    what = "work"


def params_digest(flat: torch.Tensor) -> str:
    """SHA-256 of a flat fp32 CPU tensor's bytes."""
    return hashlib.sha256(flat.detach().to("cpu", torch.float32).contiguous().numpy()).hexdigest()  # no copy


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same bytes (what equal `params_digest` means: -0.0 is not 0.0, a NaN equals
    the same NaN), at a sixth of the cost of hashing one of them."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def cpu_capability() -> str:
    """The level of torch's CPU kernels in this process ("AVX512", "AVX2", "DEFAULT", ...; the environment
    variable ``ATEN_CPU_CAPABILITY`` lowers it): a replay is bit for bit only at the prover's level."""
    return torch.backends.cpu.get_cpu_capability()


_X86_LEVELS = ("DEFAULT", "AVX2", "AVX512")


def replayable_levels() -> frozenset[str]:
    """The CPU kernel levels this machine replays at: its own and the lower ones (``ATEN_CPU_CAPABILITY``
    lowers torch's level, never raises it; outside x86, its own and DEFAULT)."""
    own = cpu_capability()
    if own in _X86_LEVELS:
        return frozenset(_X86_LEVELS[: _X86_LEVELS.index(own) + 1])
    return frozenset({"DEFAULT", own})


def flat_params(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters as one flat fp32 CPU tensor (a copy), in order."""
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in params])


@dataclass(frozen=True, slots=True)
class InnerState:
    """An inner optimizer's state: its tensors by ``"<param index>.<name>"`` and its param groups as JSON."""

    tensors: dict[str, torch.Tensor]
    groups: str

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> InnerState:
        state = optimizer.state_dict()
        tensors = {}
        for index, entries in state["state"].items():
            for name, value in entries.items():
                tensor = value if torch.is_tensor(value) else torch.tensor(value)
                tensors[f"{index}.{name}"] = tensor.detach().to("cpu", copy=True).contiguous()
        return cls(tensors, json.dumps(state["param_groups"], sort_keys=True))

    def digest(self) -> str:
        h = hashlib.sha256(self.groups.encode())
        for key in sorted(self.tensors):
            tensor = self.tensors[key]
            h.update(f"\x00{key}:{tensor.dtype}:{tuple(tensor.shape)}\x00".encode())
            h.update(tensor.contiguous().numpy())  # the buffer itself: no copy of it
        return h.hexdigest()

    def param_groups(self, params: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
        """``params`` split into this state's param groups (its ``"params"`` index lists, a permutation of
        ``range(len(params))``); WorkRejected otherwise (untrusted)."""
        try:
            groups = json.loads(self.groups)
            indices = [g["params"] for g in groups]
            flat = [i for group in indices for i in group]
            if sorted(flat) != list(range(len(params))) or not all(type(i) is int for i in flat):
                raise ValueError("not a permutation")
        except (ValueError, TypeError, KeyError) as e:
            raise WorkRejected("malformed", f"param groups: {str(e)[:100]}") from None
        return [{"params": [params[i] for i in group]} for group in indices]

    def load_into(self, optimizer: torch.optim.Optimizer) -> None:
        """Put this state into a fresh optimizer of the same class over the same parameters; WorkRejected
        if its groups or tensors do not fit that optimizer (untrusted: it may come from the prover)."""
        try:
            groups = json.loads(self.groups)
        except ValueError:
            raise WorkRejected("malformed", "param groups are not JSON") from None
        expected = optimizer.state_dict()["param_groups"]
        if not isinstance(groups, list) or len(groups) != len(expected):
            raise WorkRejected("malformed", "param groups do not match the optimizer's")
        for group, own in zip(groups, expected):
            if not isinstance(group, dict) or set(group) != set(own) or group.get("params") != own["params"]:
                raise WorkRejected("malformed", "param group keys or parameters do not match the optimizer's")
            for key, value in group.items():
                values = value if isinstance(value, list) else [value]
                if key != "params" and not all(isinstance(v, _GROUP_VALUE) for v in values):
                    raise WorkRejected("malformed", f"param group value {key!r} is not a plain number")
        state: dict[int, dict[str, torch.Tensor]] = {}
        indices = {index for group in expected for index in group["params"]}
        for key, tensor in self.tensors.items():
            index, _, name = key.partition(".")
            if not index.isdigit() or int(index) not in indices or not name:
                raise WorkRejected("malformed", f"state tensor {key!r:.60} names no parameter")
            state.setdefault(int(index), {})[name] = tensor.clone()  # the optimizer steps its state in place
        try:
            optimizer.load_state_dict({"state": state, "param_groups": groups})
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            raise WorkRejected("malformed", f"optimizer state does not load: {str(e)[:200]}") from None


@dataclass(frozen=True, slots=True)
class Boundary:
    """The state at one segment boundary: flat fp32 parameters and the inner optimizer's state."""

    params: torch.Tensor
    inner: InnerState


@dataclass(frozen=True, kw_only=True, slots=True)
class Commitment(Signable):
    """What a peer signs about one phase of inner steps (see the module docstring)."""

    v: int = VERSION
    run: str
    """The run (also bound into the signature)."""
    round: int
    """The round this phase's pseudo-gradient went into."""
    peer: str
    """The prover: the peer that trained (and signs)."""
    task: str
    """SHA-256 of the task's config (`swarm.config.TaskInfo.config_digest`)."""
    shard_index: int
    num_shards: int
    seed: int
    """The data stream: ``task.train_batches(shard_index=, num_shards=, seed=)``."""
    stream_start: int
    """Batches drawn from that stream before the phase's first step."""
    first_step: int
    """The local step number (1-based) of the phase's first inner step: the warm-up factor's input."""
    warmup_steps: int
    steps: int
    """Inner steps in the phase, one batch each."""
    segment_steps: int
    """A boundary every this many steps (the last segment may be shorter)."""
    samples: int
    """Samples claimed (steps x batch size for a registry task)."""
    optimizer: str
    """The inner optimizer's class (a key of `REPLAYABLE_OPTIMIZERS`)."""
    threads: int
    """torch's intra-op threads while the prover trained: CPU reductions split their sums by thread, so a
    replay with another count differs in the last bits (`swarm.replayer` replays with this many)."""
    cpu: str
    """torch's CPU kernel level while the prover trained (`cpu_capability`: "AVX512", "AVX2", "DEFAULT", ...):
    kernels of another level round differently (`swarm.replayer` replays at this one where this CPU has it)."""
    params: tuple[str, ...]
    """Digest of the parameters at each boundary: step 0, segment_steps, 2 x segment_steps, ..., steps."""
    inner: tuple[str, ...]
    """Digest of the inner optimizer's state at each boundary."""
    pseudo: str
    """Digest of the pseudo-gradient ``base - parameters at the end`` (flat fp32)."""

    def __post_init__(self) -> None:
        try:
            check_int("v", self.v, minimum=VERSION, maximum=VERSION)
            for name in ("run", "peer", "optimizer"):
                check_str(name, getattr(self, name), max_chars=_MAX_ID, printable=True)
            check_str("cpu", self.cpu, max_chars=32, printable=True)
            if not self.cpu.replace("_", "").isalnum():
                raise ValueError(f"cpu must be a kernel level such as AVX2, got {self.cpu!r:.40}")
            for name in ("round", "shard_index", "seed", "stream_start", "warmup_steps", "samples"):
                check_int(name, getattr(self, name))
            for name in ("num_shards", "first_step", "steps", "segment_steps"):
                check_int(name, getattr(self, name), minimum=1)
            check_int("shard_index", self.shard_index, maximum=self.num_shards - 1)
            check_int("threads", self.threads, minimum=1, maximum=MAX_REPLAY_THREADS)
            for digest in (self.task, self.pseudo, *self.params, *self.inner):
                check_hex("digest", digest)
        except ValueError as e:
            raise WorkRejected("malformed", str(e)) from None
        boundaries = self.segments + 1
        if not isinstance(self.params, tuple) or not isinstance(self.inner, tuple) or boundaries > MAX_BOUNDARIES:
            raise WorkRejected("malformed", f"at most {MAX_BOUNDARIES} boundaries")
        if len(self.params) != boundaries or len(self.inner) != boundaries:
            raise WorkRejected(
                "malformed", f"{self.steps} steps in segments of {self.segment_steps}: {boundaries} boundaries"
            )

    @property
    def segments(self) -> int:
        return math.ceil(self.steps / self.segment_steps)

    def segment(self, k: int) -> tuple[int, int]:
        """Steps ``[first, end)`` of segment ``k``, counted from the phase's start."""
        return k * self.segment_steps, min((k + 1) * self.segment_steps, self.steps)


@dataclass(frozen=True, slots=True)
class SignedCommitment(JsonFields):
    commitment: Commitment
    signature: str
    """Hex Ed25519 signature of ``commitment.payload()`` by ``commitment.peer``, kind ``swarm/work``."""


def sign_commitment(commitment: Commitment, identity: Identity) -> SignedCommitment:
    signature = commitment.signature_by(identity, signer=commitment.peer, kind=COMMITMENT_KIND, run=commitment.run)
    return SignedCommitment(commitment, signature)


def commitment_digest(signed: Mapping[str, Any]) -> str:
    """``Commitment.digest()`` of a commitment as `SignedCommitment.to_dict` holds it (this peer's own): what its
    prover's statements of its parts in the round name (`averaging.GroupAverager.step`'s ``label``)."""
    return hashlib.sha256(canonical_json(signed["commitment"])).hexdigest()


def verify_commitment(data: Any, *, run: str | None = None) -> SignedCommitment:
    """Parse and check an untrusted commitment (`SignedCommitment.to_dict` or its JSON bytes): exact fields
    and types, sizes, the run, the prover's signature. WorkRejected with a reason otherwise."""
    obj = _signed_object(data, "commitment")
    try:
        commitment = from_dict(Commitment, obj["commitment"], "commitment", max_str=_MAX_ID, max_items=MAX_BOUNDARIES)
    except TypeError as e:
        raise WorkRejected("malformed", str(e)) from None
    _check_signature(commitment.peer, COMMITMENT_KIND, commitment.run, commitment.payload(), obj["signature"])
    if run is not None and commitment.run != run:
        raise WorkRejected("another run", f"run {commitment.run!r}, expected {run!r}")
    return SignedCommitment(commitment, obj["signature"])


def _signed_object(data: Any, name: str) -> dict:
    if isinstance(data, (bytes, bytearray)):
        if len(data) > 64 << 10:
            raise WorkRejected("oversized", f"{len(data)} bytes")
        data = strict_json(bytes(data), WorkRejected)
    if not isinstance(data, dict) or set(data) != {name, "signature"}:
        raise WorkRejected("malformed", f"expected {{{name}, signature}}")
    if not isinstance(data["signature"], str):
        raise WorkRejected("malformed", "signature must be hex")
    return data


def _check_signature(peer: str, kind: str, run: str, payload: bytes, signature: str) -> None:
    try:
        check_hex("signature", signature, chars=128)
        key = public_key_from_peer_id(peer)
    except ValueError as e:
        raise WorkRejected("malformed", str(e)) from None
    if not verify(public_key=key, kind=kind, run_id=run, payload=payload, signature=bytes.fromhex(signature)):
        raise WorkRejected("bad signature", f"not signed by {peer}")


def segment_seed(peer: str, stream_start: int, k: int) -> int:
    """The torch RNG seed at the start of segment ``k`` (dropout and the like replay the same)."""
    return int.from_bytes(hashlib.sha256(f"{peer}:{stream_start}:{k}".encode()).digest()[:8], "big") >> 1


@dataclass(slots=True)
class Phase:
    """One recorded phase: the commitment's fields so far and the boundary states."""

    stream_start: int
    first_step: int
    boundaries: list[Boundary]
    segment_steps: int
    """This phase's segment length (`WorkRecorder.begin`)."""
    steps: int = 0
    replayable: bool = True
    """False once the phase did something a replay would not (a batch drawn off the step count)."""
    committed_at: float = 0.0
    """When the phase was committed (monotonic seconds): `WorkRecorder.forget` keeps recent ones longer."""
    digests: list[tuple[str, str]] = field(default_factory=list)
    """The digests (parameters, inner state) of the boundaries hashed so far: each is hashed at the step after
    it was taken, so that the commitment at the sync point (inside the round) has little left to hash."""

    def nbytes(self) -> int:
        return sum(b.params.nbytes + sum(t.nbytes for t in b.inner.tensors.values()) for b in self.boundaries)

    def hash_boundaries(self) -> None:
        for boundary in self.boundaries[len(self.digests) :]:
            self.digests.append((params_digest(boundary.params), boundary.inner.digest()))


class WorkRecorder:
    """Records a peer's phases so they can be committed to and replayed (see the module docstring).

    Draw batches from `batches` (one per inner step), call `begin` when a phase starts (the model
    holds the round's base), `stepped` after each inner step and `commit` at the sync point. It sets
    torch's RNG seed at each boundary (`segment_seed`)."""

    def __init__(
        self, task: Any, *, peer: str, shard_index: int, num_shards: int, seed: int = 0, segment_steps: int = 1
    ) -> None:
        check_int("segment_steps", segment_steps, minimum=1)
        self.task, self.peer, self.segment_steps = task, peer, segment_steps
        self.shard_index, self.num_shards, self.seed = shard_index, num_shards, seed
        self.drawn = 0
        self.phase: Phase | None = None
        self.kept: dict[int, Phase] = {}
        """Committed phases by round, kept to serve replay inputs (`forget` drops them)."""

    def batches(self) -> Iterator[Any]:
        for batch in self.task.train_batches(shard_index=self.shard_index, num_shards=self.num_shards, seed=self.seed):
            self.drawn += 1
            yield batch

    def begin(
        self,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        first_step: int,
        expected_steps: int | None = None,
    ) -> None:
        """A phase starts; ``expected_steps`` (the sync interval) lengthens its segments if it would otherwise
        have more than ``MAX_BOUNDARIES - 1`` of them (memory and the commitment's size stay bounded)."""
        segment_steps = self.segment_steps
        if expected_steps is not None and expected_steps > 0:
            segment_steps = max(segment_steps, math.ceil(expected_steps / (MAX_BOUNDARIES - 1)))
        first = Boundary(flat_params(params), InnerState.of(optimizer))
        self.phase = Phase(self.drawn, first_step, [first], segment_steps=segment_steps)
        torch.manual_seed(segment_seed(self.peer, self.drawn, 0))

    def stepped(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        phase = self.phase
        if phase is None:
            return
        phase.steps += 1
        phase.replayable &= self.drawn == phase.stream_start + phase.steps
        if phase.steps % phase.segment_steps == 0:
            phase.replayable &= len(phase.boundaries) < MAX_BOUNDARIES  # longer than expected: not committed
            if phase.replayable:
                phase.boundaries.append(Boundary(flat_params(params), InnerState.of(optimizer)))
                phase.hash_boundaries()
            torch.manual_seed(segment_seed(self.peer, phase.stream_start, phase.steps // phase.segment_steps))

    def commit(
        self,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        base: torch.Tensor,
        identity: Identity,
        run: str,
        round_: int,
        task_digest: str,
        samples: int,
        warmup_steps: int,
    ) -> SignedCommitment | None:
        """Close the phase and sign its commitment (None: nothing to commit, or not replayable)."""
        phase, self.phase = self.phase, None
        if phase is None or phase.steps == 0 or not phase.replayable:
            return None
        if (
            type(optimizer).__name__ not in REPLAYABLE_OPTIMIZERS
            or math.ceil(phase.steps / phase.segment_steps) >= MAX_BOUNDARIES
            or phase.segment_steps > MAX_REPLAY_STEPS
            or phase.stream_start + phase.steps > MAX_STREAM_POSITION
        ):
            return None
        optimized = [p for group in optimizer.param_groups for p in group["params"]]
        if len(optimized) != len(params) or any(a is not b for a, b in zip(optimized, params)):
            return None  # the replay maps the optimizer's state indices onto the trainable parameters, in order
        if phase.steps % phase.segment_steps:
            phase.boundaries.append(Boundary(flat_params(params), InnerState.of(optimizer)))
        phase.hash_boundaries()
        end = phase.boundaries[-1].params
        if not same_bits(phase.boundaries[0].params, base):  # (its digest is digests[0]: not hashed again)
            return None  # the phase did not start from this base (the state was reloaded meanwhile): nothing to claim
        if torch.get_num_threads() > MAX_REPLAY_THREADS:
            return None  # no verifier replays with that many threads: unverified, never accused
        commitment = Commitment(
            run=run,
            round=round_,
            peer=identity.peer_id,
            task=task_digest,
            shard_index=self.shard_index,
            num_shards=self.num_shards,
            seed=self.seed,
            stream_start=phase.stream_start,
            first_step=phase.first_step,
            warmup_steps=warmup_steps,
            steps=phase.steps,
            segment_steps=phase.segment_steps,
            samples=samples,
            optimizer=type(optimizer).__name__,
            threads=torch.get_num_threads(),
            cpu=cpu_capability(),
            params=tuple(p for p, _ in phase.digests),
            inner=tuple(i for _, i in phase.digests),
            pseudo=params_digest(base - end),
        )
        phase.committed_at = time.monotonic()
        self.kept[round_] = phase
        return sign_commitment(commitment, identity)

    def inputs(self, round_: int, segment: int) -> ReplayInputs | None:
        """What a verifier needs to replay ``segment`` of the phase committed for ``round_`` (None: not kept)."""
        phase = self.kept.get(round_)
        if phase is None or not 0 <= segment < len(phase.boundaries) - 1:
            return None
        return ReplayInputs(start=phase.boundaries[segment], end_params=phase.boundaries[-1].params)

    def forget(self, keep: int, *, keep_for_s: float = 0.0, max_bytes: int = 0) -> None:
        """Keep the newest ``keep`` committed phases, and older ones while they were committed less than
        ``keep_for_s`` ago and all kept phases take at most ``max_bytes`` (fast rounds: a verifier's check
        or re-check of a published verdict still finds the phase a few rounds later)."""
        rounds = list(self.kept)
        size = sum(phase.nbytes() for phase in self.kept.values())
        now = time.monotonic()
        for round_ in rounds[: max(len(rounds) - keep, 0)]:
            phase = self.kept[round_]
            if now - phase.committed_at < keep_for_s and size <= max_bytes:
                break
            size -= phase.nbytes()
            del self.kept[round_]


@dataclass(frozen=True, slots=True)
class ReplayInputs:
    """What a prover serves for one check: the state at the segment's start, and the end parameters."""

    start: Boundary
    end_params: torch.Tensor

    def to_bytes(self) -> bytes:
        tensors = {"params": self.start.params, "end_params": self.end_params}
        tensors.update({f"inner.{k}": t for k, t in self.start.inner.tensors.items()})
        return save_tensors(tensors, metadata={"groups": self.start.inner.groups})

    @classmethod
    def from_bytes(cls, data: bytes) -> ReplayInputs:
        """Untrusted safetensors bytes; WorkRejected if malformed (their digests are checked by `check`)."""
        if not isinstance(data, bytes) or len(data) > MAX_INPUT_BYTES or len(data) < 8:
            raise WorkRejected("malformed", "replay inputs: not safetensors bytes of an accepted size")
        (header_len,) = struct.unpack("<Q", data[:8])
        try:
            header = strict_json(data[8 : 8 + header_len], WorkRejected) if header_len <= 1 << 24 else None
            tensors = load_tensors(data)
        except WorkRejected:
            raise
        except Exception as e:  # safetensors raises its own error types on malformed input
            raise WorkRejected("malformed", f"replay inputs: {str(e)[:200]}") from None
        groups = (header or {}).get("__metadata__", {}).get("groups") if isinstance(header, dict) else None
        if not isinstance(groups, str) or "params" not in tensors or "end_params" not in tensors:
            raise WorkRejected("malformed", "replay inputs: params, end_params or groups missing")
        inner = {k.removeprefix("inner."): t for k, t in tensors.items() if k.startswith("inner.")}
        if len(inner) + 2 != len(tensors):
            raise WorkRejected("malformed", "replay inputs: unexpected tensors")
        for name in ("params", "end_params"):
            if tensors[name].dtype != torch.float32 or tensors[name].dim() != 1:
                raise WorkRejected("malformed", f"replay inputs: {name} is not a flat fp32 tensor")
        return cls(Boundary(tensors["params"], InnerState(inner, groups)), tensors["end_params"])


@dataclass(frozen=True, slots=True)
class Assignment:
    """One drawn check: ``verifier`` replays segment ``segment`` of ``prover``'s phase."""

    prover: str
    segment: int
    verifier: str


def _draw(seed: str, *parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest(), "big")


def draw_checks(
    seed: str,
    commitments: Mapping[str, Commitment],
    *,
    rate: float | Callable[[str, str], float],
    salts: Mapping[str, str] | None = None,
) -> list[Assignment]:
    """The checks of one round: each contribution's verifier is the other contributor nearest to it by
    rendezvous hashing, and it checks one segment of it with probability ``rate`` (or ``rate(prover,
    verifier)``: a verifier's own rate for that prover, e.g. lower once it has passed enough of its checks;
    then only the draws of the peer that calls it are meaningful). The same on every peer for the same rates.
    ``seed`` must be unknown until the contributions are fixed (the group's id and the commitments); a prover's
    draw is also salted with ``salts[prover]`` (none: ""). Since a check also binds the work to the part the
    prover sent (`swarm.work`), that salt is the round's result without the prover's own slice
    (`swarm.work.result_salts`): no member knows it before it sent all of its part, and none can steer its own
    draw through the slice it reduces."""
    peers = sorted(commitments)
    out = []
    for prover in peers:
        others = [p for p in peers if p != prover]
        if not others:
            continue
        seed_ = seed + (salts or {}).get(prover, "")
        verifier = min(others, key=lambda v: _draw(seed_, "verifier", prover, v))
        chance = rate(prover, verifier) if callable(rate) else rate
        if _draw(seed_, "check", prover) >= chance * 2**256:
            continue
        segment = _draw(seed_, "segment", prover) % commitments[prover].segments
        out.append(Assignment(prover, segment, verifier))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict(Signable):
    """A verifier's signed result of one check."""

    v: int = VERSION
    run: str
    round: int
    prover: str
    verifier: str
    commitment: str
    """Digest of the checked commitment's payload."""
    segment: int
    ok: bool
    reason: str
    """``"match"``, or what failed (see `check`)."""
    replayed: str
    """Digest of the replayed end of the segment's parameters ("" when nothing was replayed)."""


def sign_verdict(verdict: Verdict, identity: Identity) -> dict[str, Any]:
    signature = verdict.signature_by(identity, signer=verdict.verifier, kind=VERDICT_KIND, run=verdict.run)
    return {"verdict": verdict.to_dict(), "signature": signature}


def verify_verdict(data: Any) -> Verdict:
    obj = _signed_object(data, "verdict")
    try:
        verdict = from_dict(Verdict, obj["verdict"], "verdict", max_str=_MAX_ID)
    except TypeError as e:
        raise WorkRejected("malformed", str(e)) from None
    _check_signature(verdict.verifier, VERDICT_KIND, verdict.run, verdict.payload(), obj["signature"])
    return verdict


def trainable(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


class Streams:
    """A verifier's batch streams, each left where its last replay stopped: checking a later segment of the
    same shard skips ahead from there instead of drawing every batch from the stream's start (a shard's
    stream is deterministic, and a check late in a run would otherwise draw thousands of batches)."""

    MAX_STREAMS = 16

    def __init__(self, task: Any) -> None:
        self.task = task
        self._open: OrderedDict[tuple[int, int, int], tuple[int, Iterator[Any]]] = OrderedDict()

    def take(self, commitment: Commitment, first: int, end: int) -> list[Any]:
        """Batches ``first`` to ``end`` (phase steps) of ``commitment``'s phase."""
        key = (commitment.shard_index, commitment.num_shards, commitment.seed)
        position, stream = self._open.pop(key, (0, None))
        start = commitment.stream_start + first
        if stream is None or position > start:
            position, stream = 0, self.task.train_batches(shard_index=key[0], num_shards=key[1], seed=key[2])
        for _ in itertools.islice(stream, start - position):
            pass
        batches = list(itertools.islice(stream, end - first))
        self._open[key] = (start + len(batches), stream)
        while len(self._open) > self.MAX_STREAMS:
            self._open.popitem(last=False)
        return batches


def replay(
    task: Any, commitment: Commitment, segment: int, start: Boundary, *, streams: Streams | None = None
) -> Boundary:
    """Segment ``segment`` of ``commitment``'s phase replayed from ``start`` on this machine's CPU: the task's
    model and stream (``streams``: positioned streams of ``task`` to reuse), the committed optimizer class,
    warm-up and RNG seed. WorkRejected if ``start`` does not fit the task's model or optimizer."""
    model = task.build_model(seed=0)
    model.train()
    params = trainable(model)
    total = sum(p.numel() for p in params)
    if start.params.dtype != torch.float32 or start.params.numel() != total:
        raise WorkRejected("malformed", f"start parameters: {start.params.numel()} values, the model has {total}")
    with torch.no_grad():
        offset = 0
        for p in params:
            p.copy_(start.params[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    optimizer = REPLAYABLE_OPTIMIZERS[commitment.optimizer](start.inner.param_groups(params))
    start.inner.load_into(optimizer)
    first, end = commitment.segment(segment)
    batches = (streams if streams is not None and streams.task is task else Streams(task)).take(commitment, first, end)
    torch.manual_seed(segment_seed(commitment.peer, commitment.stream_start, segment))
    for i, batch in enumerate(batches):
        task.loss(model, batch).backward()
        inner_step(optimizer, commitment.first_step + first + i, commitment.warmup_steps)
    return Boundary(flat_params(params), InnerState.of(optimizer))


def check(
    task: Any,
    task_digest: str,
    commitment: Commitment,
    segment: int,
    inputs: ReplayInputs | None,
    *,
    base: torch.Tensor,
    streams: Streams | None = None,
    replayer: Callable[..., Boundary] | None = None,
) -> tuple[bool, str, str]:
    """Check segment ``segment`` of ``commitment`` against the round's ``base`` parameters (flat fp32), with
    the prover's ``inputs`` (None: it refused or did not answer). Returns (ok, reason, replayed digest).
    ``replayer`` runs the replay (default `replay`, here; `swarm.replayer.Replayer.replay`: in a process of
    its own); what it raises other than WorkRejected is the verifier's failure, and propagates."""
    if commitment.task != task_digest:
        return False, "another task", ""
    if (
        commitment.optimizer not in REPLAYABLE_OPTIMIZERS
        or not 0 <= segment < commitment.segments
        or commitment.segment_steps > MAX_REPLAY_STEPS
        or commitment.stream_start + commitment.steps > MAX_STREAM_POSITION
    ):
        return False, "not replayable", ""  # a phase no honest recorder commits: bounded work for the verifier
    if commitment.params[0] != params_digest(base):
        return False, "not from the round's base", ""
    if inputs is None:
        return False, "inputs refused", ""
    if params_digest(inputs.end_params) != commitment.params[-1] or inputs.end_params.shape != base.shape:
        return False, "served end differs from the commitment", ""
    if params_digest(base - inputs.end_params) != commitment.pseudo:
        return False, "pseudo-gradient is not base - end", ""
    start = inputs.start
    if params_digest(start.params) != commitment.params[segment] or start.inner.digest() != commitment.inner[segment]:
        return False, "served start differs from the commitment", ""
    try:
        replayed = (replayer or replay)(task, commitment, segment, start, streams=streams)
    except WorkRejected as e:
        return False, f"served start does not load: {e.reason}", ""
    got = params_digest(replayed.params)
    if got != commitment.params[segment + 1] or replayed.inner.digest() != commitment.inner[segment + 1]:
        return False, "replay differs", got
    return True, "match", got


def verdict_of(
    identity: Identity, commitment: Commitment, segment: int, outcome: tuple[bool, str, str]
) -> dict[str, Any]:
    """The verifier's signed verdict on one check (its ledger entry and what spreads to the run)."""
    ok, reason, replayed = outcome
    verdict = Verdict(
        run=commitment.run,
        round=commitment.round,
        prover=commitment.peer,
        verifier=identity.peer_id,
        commitment=commitment.digest(),
        segment=segment,
        ok=ok,
        reason=reason,
        replayed=replayed,
    )
    return sign_verdict(verdict, identity)


def arbitrate(
    task: Any,
    task_digest: str,
    signed: SignedCommitment,
    verdict: Verdict,
    inputs: ReplayInputs | None,
    *,
    base: torch.Tensor,
    streams: Streams | None = None,
    replayer: Callable[..., Boundary] | None = None,
) -> str:
    """A third replay of a disputed check: ``"prover"`` (the prover's work fails it too), ``"verifier"`` (the
    verdict is wrong: the work checks out, or the verdict is about another commitment) or ``"agree"``."""
    commitment = signed.commitment
    if verdict.commitment != commitment.digest() or verdict.prover != commitment.peer:
        return "verifier"
    ok, _, _ = check(
        task, task_digest, commitment, verdict.segment, inputs, base=base, streams=streams, replayer=replayer
    )
    if ok == verdict.ok:
        return "agree" if ok else "prover"
    return "verifier"


__all__ = [
    "Assignment",
    "Boundary",
    "Commitment",
    "InnerState",
    "ReplayInputs",
    "SignedCommitment",
    "Streams",
    "Verdict",
    "WorkRecorder",
    "WorkRejected",
    "arbitrate",
    "check",
    "cpu_capability",
    "replayable_levels",
    "draw_checks",
    "flat_params",
    "params_digest",
    "replay",
    "same_bits",
    "sign_commitment",
    "verdict_of",
    "verify_commitment",
    "verify_verdict",
]
