"""Checkpoint manifests: the canonical description of one training state, and its signatures.

A :class:`Manifest` names a run, a step, the shards that hold the state (by SHA-256 of their
bytes) and the group of peers that produced it. Its :meth:`Manifest.payload` is canonical JSON
(sorted keys, ints and strings only), and :meth:`Manifest.digest` is the SHA-256 of that payload:
the manifest's name in the store and the ``parent`` link of the next manifest.

Signatures use kind ``swarm/manifest`` with the manifest's run id bound in (see
:mod:`bootstrap.identity`), so a manifest signature never verifies as another kind of object or for
another run. The signer's public key is recovered from its Ed25519 peer ID, so a signature needs
no key distribution beyond the peer IDs themselves.

Everything received from the network goes through :meth:`SignedManifest.from_bytes` (strict
schema) and :func:`verify_manifest` (run, signers, quorum, replay); each refusal raises
:class:`ManifestRejected` with a short ``reason`` that is also counted.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bootstrap.envelope import (
    INT64_MAX,
    JsonFields,
    Signable,
    check_hex,
    check_int,
    check_str,
    expect_keys,
    strict_json,
)
from bootstrap.errors import Rejected
from bootstrap.identity import Identity, canonical_json, public_key_from_peer_id, verify
from swarm.ledger.receipts import ReceiptRejected, SignedReceipt, verify_receipt

logger = logging.getLogger(__name__)

MANIFEST_KIND = "swarm/manifest"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 1 << 20
ALLOWED_DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "uint8", "bool")
"""Tensor dtypes a checkpoint may hold; anything else is refused on write and on read."""


_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX128 = re.compile(r"[0-9a-f]{128}")
_MAX_ID_CHARS = 128
_MAX_TENSOR_NAME_CHARS = 1024
_MAX_DIMS = 16
_MAX_PEERS = 1024
_PARSED: OrderedDict[bytes, SignedManifest] = OrderedDict()
"""The last manifests `SignedManifest.from_bytes` parsed, by their bytes: a peer takes a gossiped manifest apart
five times (its check, the index announcement, storing it, the sealing group's members, the newest), and each
parse verifies every receipt's signature (py-spy of a peer in a 3-peer run sealing every round: about 1% of a
core, 25 of 2000 samples; 7 with this cache)."""
_PARSED_KEPT = 8
_PARSED_LOCK = threading.Lock()
_MAX_METRICS = 64
_INT64_MAX = (1 << 63) - 1


class ManifestRejected(Rejected):
    """A manifest was refused. ``reason`` is a short fixed string (a counter key); ``detail`` says more."""

    what = "manifest"


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorInfo(JsonFields):
    """One tensor of a shard, as recorded in the manifest."""

    name: str
    """The state-dict key."""
    dtype: str
    """One of :data:`ALLOWED_DTYPES`, e.g. ``"float32"``."""
    shape: tuple[int, ...]
    """The tensor's shape."""

    def __post_init__(self) -> None:
        check_str("tensor name", self.name, max_chars=_MAX_TENSOR_NAME_CHARS)
        if self.dtype not in ALLOWED_DTYPES:
            raise ValueError(f"tensor {self.name!r}: dtype {self.dtype!r} is not one of {ALLOWED_DTYPES}")
        if not isinstance(self.shape, tuple) or len(self.shape) > _MAX_DIMS:
            raise ValueError(
                f"tensor {self.name!r}: shape must be a tuple of at most {_MAX_DIMS} ints, got {self.shape!r}"
            )
        for dim in self.shape:
            check_int(f"tensor {self.name!r} shape", dim)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardInfo(JsonFields):
    """One shard: a safetensors file named by the SHA-256 of its bytes."""

    name: str
    """A human-readable label, e.g. ``"shard-00000"`` (not used for lookup)."""
    digest: str
    """SHA-256 hex (lowercase) of the file's bytes: its address in the store."""
    size_bytes: int
    """Length of the file in bytes."""
    tensors: tuple[TensorInfo, ...]
    """The tensors the file must hold, exactly (names, dtypes, shapes)."""

    def __post_init__(self) -> None:
        check_str("shard name", self.name, max_chars=_MAX_ID_CHARS)
        check_hex("shard digest", self.digest)
        check_int("shard size_bytes", self.size_bytes)
        if not isinstance(self.tensors, tuple) or not all(isinstance(t, TensorInfo) for t in self.tensors):
            raise TypeError(f"shard {self.name!r}: tensors must be a tuple of TensorInfo")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"shard {self.name!r}: duplicate tensor names")


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest(Signable):
    """The canonical, signable description of one checkpoint."""

    version: int = MANIFEST_VERSION
    """Schema version; only :data:`MANIFEST_VERSION` is accepted."""
    run_id: str
    """The training run this state belongs to (bound into every signature)."""
    step: int
    """Optimizer step of this state; strictly increases along the lineage."""
    round: int
    """Averaging round that produced this state."""
    task: str
    """Task name (see ``swarm.tasks``)."""
    config_digest: str
    """SHA-256 hex of the run's canonical config."""
    parent: str
    """Digest of the parent manifest, or ``""`` for the genesis manifest."""
    shards: tuple[ShardInfo, ...]
    """The shards that together hold the state dict."""
    participants: tuple[str, ...]
    """Sorted, unique peer IDs of the group that produced this state (the only valid signers)."""
    metrics: dict[str, int] = field(default_factory=dict)
    """Integer metrics, e.g. ``{"val_loss_micro": 2310000}`` (no floats: they are signed)."""
    created_at: int
    """Unix time in seconds."""
    contributions: dict[str, int] = field(default_factory=dict)
    """Participant -> samples it contributed to this round, as the whole group saw them (so every member
    signs the same values); each member's signed receipt in :class:`SignedManifest` must agree."""

    def __post_init__(self) -> None:
        if self.version != MANIFEST_VERSION or isinstance(self.version, bool):
            raise ValueError(f"version: only {MANIFEST_VERSION} is supported, got {self.version!r}")
        check_str("run_id", self.run_id, max_chars=_MAX_ID_CHARS)
        check_str("task", self.task, max_chars=_MAX_ID_CHARS)
        for name in ("step", "round", "created_at"):
            check_int(name, getattr(self, name))
        check_hex("config_digest", self.config_digest)
        if self.parent != "":
            check_hex("parent", self.parent)
        self._check_shards()
        self._check_participants()
        if not isinstance(self.metrics, dict) or len(self.metrics) > _MAX_METRICS:
            raise ValueError(f"metrics must be a dict of at most {_MAX_METRICS} entries")
        for key, value in self.metrics.items():
            check_str("metric name", key, max_chars=_MAX_ID_CHARS)
            check_int(f"metric {key!r}", value, minimum=-INT64_MAX)
        if not isinstance(self.contributions, dict) or not set(self.contributions) <= set(self.participants):
            raise ValueError("contributions must map participants to sample counts")
        for peer_id, samples in self.contributions.items():
            check_int(f"contribution of {peer_id!r:.60}", samples)

    def _check_shards(self) -> None:
        if not isinstance(self.shards, tuple) or not all(isinstance(s, ShardInfo) for s in self.shards):
            raise TypeError("shards must be a tuple of ShardInfo")
        tensor_names = [t.name for s in self.shards for t in s.tensors]
        if len(set(tensor_names)) != len(tensor_names):
            raise ValueError("shards: a tensor name appears in more than one shard")
        if len({s.digest for s in self.shards}) != len(self.shards):
            raise ValueError("shards: the same shard digest is listed twice")

    def _check_participants(self) -> None:
        if not isinstance(self.participants, tuple) or len(self.participants) > _MAX_PEERS:
            raise ValueError(f"participants must be a tuple of at most {_MAX_PEERS} peer IDs")
        for peer_id in self.participants:
            check_str("participant", peer_id, max_chars=_MAX_ID_CHARS)
        if list(self.participants) != sorted(set(self.participants)):
            raise ValueError("participants must be sorted and unique")


@dataclass(frozen=True, kw_only=True, slots=True)
class SignedManifest:
    """A manifest with the signatures gathered so far (peer ID -> signature hex)."""

    manifest: Manifest
    """The signed manifest."""
    signatures: dict[str, str] = field(default_factory=dict)
    """Peer ID -> hex of its Ed25519 signature over the manifest (kind ``swarm/manifest``)."""
    receipts: tuple[SignedReceipt, ...] = ()
    """The group's participation receipts for the manifest's round, sorted by peer, one per peer at most.
    Each is signed by its own peer alone, so none can be forged; :func:`verify_manifest` checks that each
    names this run, round and group and agrees with ``manifest.contributions``."""

    def with_signature(self, peer_id: str, signature_hex: str) -> SignedManifest:
        """A copy with one more (or a replaced) signature."""
        return SignedManifest(
            manifest=self.manifest, signatures={**self.signatures, peer_id: signature_hex}, receipts=self.receipts
        )

    def _copy(self) -> SignedManifest:
        """A copy that shares only immutable parts (tuples, frozen records, strings) with this one."""
        manifest = self.manifest
        return SignedManifest(
            manifest=dataclasses.replace(
                manifest, metrics=dict(manifest.metrics), contributions=dict(manifest.contributions)
            ),
            signatures=dict(self.signatures),
            receipts=self.receipts,
        )

    def to_bytes(self) -> bytes:
        """The wire format: canonical JSON ``{"manifest": {...}, "signatures": {...}, "receipts": [...]}``."""
        return canonical_json(
            {
                "manifest": self.manifest.to_dict(),
                "signatures": dict(self.signatures),
                "receipts": [r.to_dict() for r in self.receipts],
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> SignedManifest:
        """Parse untrusted bytes with a strict schema; raises ManifestRejected.

        Reasons: ``oversized``, ``malformed``, ``unsupported version``. Signatures are *not*
        checked here (see :func:`verify_manifest`).
        """
        if not isinstance(data, (bytes, bytearray)):
            raise ManifestRejected("malformed", f"expected bytes, got {type(data).__name__}")
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestRejected("oversized", f"{len(data)} bytes > limit {MAX_MANIFEST_BYTES}")
        data = bytes(data)
        with _PARSED_LOCK:
            parsed = _PARSED.get(data)
            if parsed is not None:
                _PARSED.move_to_end(data)
        if parsed is None:
            parsed = cls._parse(data)
            with _PARSED_LOCK:
                _PARSED[data] = parsed
                while len(_PARSED) > _PARSED_KEPT:
                    _PARSED.popitem(last=False)
        return parsed._copy()

    @classmethod
    def _parse(cls, data: bytes) -> SignedManifest:
        obj = strict_json(data, ManifestRejected)
        expect_keys(obj, {"manifest", "signatures", "receipts"}, "top level", ManifestRejected)
        signatures = obj["signatures"]
        if not isinstance(signatures, dict) or len(signatures) > _MAX_PEERS:
            raise ManifestRejected("malformed", f"signatures must be an object of at most {_MAX_PEERS} entries")
        for peer_id, sig in signatures.items():
            if len(peer_id) > _MAX_ID_CHARS or not isinstance(sig, str) or not _HEX128.fullmatch(sig):
                raise ManifestRejected("malformed", f"signature of {peer_id!r:.140} must be 128 lowercase hex chars")
        receipts = obj["receipts"]
        if not isinstance(receipts, list) or len(receipts) > _MAX_PEERS:
            raise ManifestRejected("malformed", f"receipts must be a list of at most {_MAX_PEERS} entries")
        manifest = _manifest_from_obj(obj["manifest"])
        return cls(
            manifest=manifest,
            signatures=signatures,
            receipts=tuple(_receipt_from_obj(r, run_id=manifest.run_id) for r in receipts),
        )


def sign_manifest(manifest: Manifest, identity: Identity) -> tuple[str, str]:
    """``identity``'s signature of ``manifest``: ``(peer_id, signature_hex)``, ready for ``signatures``."""
    signature = identity.sign(kind=MANIFEST_KIND, run_id=manifest.run_id, payload=manifest.payload())
    return identity.peer_id, signature.hex()


def default_quorum(num_participants: int) -> int:
    """Signatures needed by default: a strict majority of the participants, and at least 2."""
    return max(2, num_participants // 2 + 1)


def verify_manifest(
    signed: SignedManifest | bytes,
    *,
    run_id: str,
    is_known_signer: Callable[[str], bool] | None = None,
    quorum: int | None = None,
    previous: Manifest | None = None,
    require_parent: bool = False,
    counter: Counter[str] | None = None,
) -> Manifest:
    """Return the manifest if it is *sealed* for ``run_id``; otherwise raise ManifestRejected.

    Sealed: every signature is valid, by a participant that ``is_known_signer`` accepts (when
    given), and there are at least ``quorum`` of them (default :func:`default_quorum`). With
    ``previous`` (the newest manifest the caller already trusts) an older step, or a different
    manifest at the same step, is refused as a replay; with ``require_parent`` a newer step must
    name ``previous`` as its parent. Pass the raw bytes received so that ``oversized`` and
    ``malformed`` are counted too. Each refusal is logged and counted in the caller's ``counter`` (if
    given) under its reason.
    """
    counter = Counter() if counter is None else counter
    try:
        if not isinstance(signed, SignedManifest):
            signed = SignedManifest.from_bytes(signed)
        manifest = signed.manifest
        if manifest.run_id != run_id:
            raise ManifestRejected("another run's manifest", f"run {manifest.run_id!r}, expected {run_id!r}")
        _check_signatures(signed, run_id=run_id, is_known_signer=is_known_signer, quorum=quorum)
        _check_receipts(signed)
        if previous is not None:
            _check_not_replayed(manifest, previous=previous, require_parent=require_parent)
    except ManifestRejected as e:
        counter[e.reason] += 1
        logger.warning("refused a checkpoint manifest: %s", e)
        raise
    return manifest


def verify_lineage(manifests: list[Manifest], *, root_parent: str = "") -> None:
    """Check that ``manifests`` form one chain, oldest first; raise ManifestRejected otherwise.

    The first manifest's ``parent`` must be ``root_parent`` (``""``: it is the genesis manifest,
    or pass the digest of a manifest already trusted); each later one names the previous one's
    digest as its parent, belongs to the same run and has a strictly greater step.
    """
    if not manifests:
        raise ValueError("verify_lineage needs at least one manifest")
    if manifests[0].parent != root_parent:
        raise ManifestRejected(
            "broken lineage",
            f"step {manifests[0].step} has parent {manifests[0].parent!r:.20}, expected {root_parent!r:.20}",
        )
    for older, newer in zip(manifests, manifests[1:]):
        if newer.run_id != older.run_id:
            raise ManifestRejected(
                "another run's manifest", f"lineage mixes runs {older.run_id!r} and {newer.run_id!r}"
            )
        if newer.parent != older.digest():
            raise ManifestRejected("broken lineage", f"step {newer.step} does not name step {older.step} as parent")
        if newer.step <= older.step:
            raise ManifestRejected("steps not increasing", f"step {newer.step} follows step {older.step}")


def _check_signatures(
    signed: SignedManifest, *, run_id: str, is_known_signer: Callable[[str], bool] | None, quorum: int | None
) -> None:
    manifest = signed.manifest
    needed = default_quorum(len(manifest.participants)) if quorum is None else quorum
    if isinstance(needed, bool) or not isinstance(needed, int) or needed < 1:
        raise ValueError(f"quorum must be a positive int, got {quorum!r}")
    if not signed.signatures:
        raise ManifestRejected("missing signature", f"step {manifest.step} carries no signature")
    participants = set(manifest.participants)
    payload = manifest.payload()
    for peer_id, signature_hex in sorted(signed.signatures.items()):
        if peer_id not in participants:
            raise ManifestRejected("signer not a participant", f"{peer_id} is not in the manifest's participants")
        if is_known_signer is not None and not is_known_signer(peer_id):
            raise ManifestRejected("unknown signer", f"{peer_id} is not known to run {run_id!r}")
        try:
            public_key = public_key_from_peer_id(peer_id)
        except ValueError as e:
            raise ManifestRejected("bad signature", str(e)) from None
        valid_hex = isinstance(signature_hex, str) and _HEX128.fullmatch(signature_hex)
        signature = bytes.fromhex(signature_hex) if valid_hex else b""
        if not verify(public_key=public_key, kind=MANIFEST_KIND, run_id=run_id, payload=payload, signature=signature):
            raise ManifestRejected("bad signature", f"signature of {peer_id} does not verify")
    if len(signed.signatures) < needed:
        raise ManifestRejected(
            "below quorum",
            f"{len(signed.signatures)} valid signatures, {needed} needed ({len(participants)} participants)",
        )


def _check_not_replayed(manifest: Manifest, *, previous: Manifest, require_parent: bool) -> None:
    if manifest.step < previous.step:
        raise ManifestRejected(
            "replayed old manifest", f"step {manifest.step} is older than the current step {previous.step}"
        )
    if manifest.step == previous.step:
        if manifest.digest() != previous.digest():
            raise ManifestRejected("conflicting manifest for step", f"a different manifest for step {manifest.step}")
        return
    if require_parent and manifest.parent != previous.digest():
        raise ManifestRejected("broken lineage", f"step {manifest.step} does not descend from step {previous.step}")


# ---- strict parsing of untrusted JSON ----


def _manifest_from_obj(obj: Any) -> Manifest:
    expect_keys(obj, {f for f in Manifest.__dataclass_fields__}, "manifest", ManifestRejected)
    if obj["version"] != MANIFEST_VERSION or isinstance(obj["version"], bool):
        raise ManifestRejected("unsupported version", f"version {obj['version']!r:.40}, expected {MANIFEST_VERSION}")
    try:
        for name in ("shards", "participants"):
            if not isinstance(obj[name], list):
                raise TypeError(f"{name} must be a list")
        return Manifest(
            **{
                k: obj[k]
                for k in (
                    "version",
                    "run_id",
                    "step",
                    "round",
                    "task",
                    "config_digest",
                    "parent",
                    "metrics",
                    "created_at",
                    "contributions",
                )
            },
            shards=tuple(_shard_from_obj(s) for s in obj["shards"]),
            participants=tuple(obj["participants"]),
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, ManifestRejected):
            raise
        raise ManifestRejected("malformed", str(e)) from None


def _receipt_from_obj(obj: Any, *, run_id: str) -> SignedReceipt:
    try:  # checks its peer's signature and the run
        return verify_receipt(obj, run_id=run_id)
    except ReceiptRejected as e:
        raise ManifestRejected("bad receipt", str(e)) from None


def _check_receipts(signed: SignedManifest) -> None:
    """Each attached receipt must describe the manifest's round and group and agree with its contributions."""
    manifest = signed.manifest
    peers = [r.receipt.peer for r in signed.receipts]
    if peers != sorted(set(peers)):
        raise ManifestRejected("bad receipt", "receipts must be sorted by peer, one per peer")
    for item in signed.receipts:
        r = item.receipt
        if (r.run, r.round, r.members) != (manifest.run_id, manifest.round, manifest.participants):
            raise ManifestRejected("bad receipt", f"the receipt of {r.peer} describes another round or group")
        if r.peer in manifest.contributions and r.samples != manifest.contributions[r.peer]:
            raise ManifestRejected(
                "bad receipt", f"{r.peer} signed {r.samples} samples, the group saw {manifest.contributions[r.peer]}"
            )


def _shard_from_obj(obj: Any) -> ShardInfo:
    expect_keys(obj, {"name", "digest", "size_bytes", "tensors"}, "shard", ManifestRejected)
    if not isinstance(obj["tensors"], list):
        raise TypeError("shard tensors must be a list")
    return ShardInfo(
        name=obj["name"],
        digest=obj["digest"],
        size_bytes=obj["size_bytes"],
        tensors=tuple(_tensor_from_obj(t) for t in obj["tensors"]),
    )


def _tensor_from_obj(obj: Any) -> TensorInfo:
    expect_keys(obj, {"name", "dtype", "shape"}, "tensor", ManifestRejected)
    if not isinstance(obj["shape"], list):
        raise TypeError("tensor shape must be a list")
    return TensorInfo(name=obj["name"], dtype=obj["dtype"], shape=tuple(obj["shape"]))
