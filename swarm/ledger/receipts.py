"""Participation receipts: what a peer signs about its part in one averaging round.

A :class:`Receipt` names the run, the round, the group (id and sorted members), the signing peer,
what it contributed (samples, bytes sent and received), its ledger head at that moment
(``ledger_seq``, ``ledger_head``) and the time. Its :meth:`Receipt.payload` is canonical JSON (ints
and strings only), signed with kind :data:`RECEIPT_KIND` and the run bound in; the key is recovered
from the peer ID, so a receipt needs no key distribution.

Each member of a group records every verified receipt of that group in its own ledger, so a peer's
claim is witnessed by the others, and the ledger head it names pins the peer's own history: see
:func:`cross_check` and the module docstring of :mod:`swarm.ledger.chain`.

Everything from outside (the DHT, a ledger file, a manifest) goes through :func:`verify_receipt`:
strict schema, sizes, signature, run. Each refusal raises :class:`ReceiptRejected` with a short
``reason`` that is logged and counted.
"""

from __future__ import annotations

import logging
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bootstrap.envelope import JsonFields, Signable, check_hex, check_int, check_str, expect_keys, strict_json
from bootstrap.errors import Rejected
from bootstrap.identity import Identity, canonical_json, public_key_from_peer_id, verify
from swarm.ledger.chain import GENESIS, LedgerEntry, LedgerVerdict

logger = logging.getLogger(__name__)

RECEIPT_KIND = "swarm/receipt"
"""Signature domain of receipts."""
RECEIPT_VERSION = 1
MAX_RECEIPT_BYTES = 8 << 10
"""Largest receipt accepted, as canonical JSON of :meth:`SignedReceipt.to_dict`."""
MAX_RECEIPT_MEMBERS = 128
"""Most members a receipt may name (128 peer IDs of 52 chars fit in :data:`MAX_RECEIPT_BYTES`)."""


_FIELDS = (
    "v",
    "run",
    "round",
    "group_id",
    "members",
    "peer",
    "samples",
    "bytes_sent",
    "bytes_received",
    "ledger_seq",
    "ledger_head",
    "t",
)
_INT_FIELDS = ("round", "samples", "bytes_sent", "bytes_received", "ledger_seq", "t")
_HEX128 = re.compile(r"[0-9a-f]{128}")
_MAX_ID_CHARS = 128


class ReceiptRejected(Rejected):
    """A receipt was refused. ``reason`` is a short fixed string (a counter key); ``detail`` says more."""

    what = "receipt"


@dataclass(frozen=True, kw_only=True, slots=True)
class Receipt(Signable):
    """One peer's signed account of its part in one round. Invalid fields raise ReceiptRejected (a ValueError)."""

    v: int = RECEIPT_VERSION
    """Schema version; only :data:`RECEIPT_VERSION` is accepted."""
    run: str
    """The run (also bound into the signature)."""
    round: int
    """The averaging round."""
    group_id: str
    """The averaging group's id."""
    members: tuple[str, ...]
    """Sorted, unique peer IDs of the group (1 to :data:`MAX_RECEIPT_MEMBERS`)."""
    peer: str
    """The signer; one of ``members``."""
    samples: int
    """Samples the signer trained on since its previous round."""
    bytes_sent: int
    """Bytes the signer sent during the round."""
    bytes_received: int
    """Bytes the signer received during the round."""
    ledger_seq: int
    """Seq of the newest entry in the signer's ledger when it signed (0: empty ledger)."""
    ledger_head: str
    """Digest of that entry (``GENESIS`` exactly when ``ledger_seq`` is 0)."""
    t: int
    """Unix seconds when signed."""

    def __post_init__(self) -> None:
        if isinstance(self.v, bool) or not isinstance(self.v, int) or self.v != RECEIPT_VERSION:
            raise ReceiptRejected("unsupported version", f"v must be {RECEIPT_VERSION}, got {self.v!r:.40}")
        try:
            for name in ("run", "group_id", "peer"):
                check_str(name, getattr(self, name), max_chars=_MAX_ID_CHARS, printable=True)
            for name in _INT_FIELDS:
                check_int(name, getattr(self, name))
            check_hex("ledger_head", self.ledger_head)
        except ValueError as e:
            raise ReceiptRejected("malformed", str(e)) from None
        if (self.ledger_seq == 0) != (self.ledger_head == GENESIS):
            raise ReceiptRejected("malformed", "ledger_head must be GENESIS exactly when ledger_seq is 0")
        self._check_members()

    def _check_members(self) -> None:
        if not isinstance(self.members, tuple) or not 0 < len(self.members) <= MAX_RECEIPT_MEMBERS:
            raise ReceiptRejected("malformed", f"members must be a tuple of 1..{MAX_RECEIPT_MEMBERS} peer IDs")
        try:
            for member in self.members:
                check_str("members", member, max_chars=_MAX_ID_CHARS, printable=True)
        except ValueError as e:
            raise ReceiptRejected("malformed", str(e)) from None
        if list(self.members) != sorted(set(self.members)):
            raise ReceiptRejected("members not sorted and unique", f"{len(self.members)} members")
        if self.peer not in self.members:
            raise ReceiptRejected("peer not a member", f"{self.peer} is not among the {len(self.members)} members")


@dataclass(frozen=True, slots=True)
class SignedReceipt(JsonFields):
    """A receipt and its signer's signature (the signer is ``receipt.peer``); ``to_dict()`` is
    ``{"receipt": {...}, "signature": hex}``: ints and strings only (fit for a DHT or a ledger)."""

    receipt: Receipt
    """The signed receipt."""
    signature: str
    """Hex (128 chars) Ed25519 signature of ``receipt.payload()``, kind ``swarm/receipt``."""


def sign_receipt(receipt: Receipt, identity: Identity) -> SignedReceipt:
    """``identity``'s signature of ``receipt``; ValueError unless ``identity`` is ``receipt.peer``."""
    return SignedReceipt(
        receipt, receipt.signature_by(identity, signer=receipt.peer, kind=RECEIPT_KIND, run=receipt.run)
    )


def verify_receipt(data: Any, *, run_id: str | None = None, counter: Counter[str] | None = None) -> SignedReceipt:
    """Parse and check an untrusted receipt (a dict as :meth:`SignedReceipt.to_dict` makes, or JSON bytes).

    Strict: exactly the expected keys, ints that are not bools, sizes (at most
    :data:`MAX_RECEIPT_BYTES`), hex formats, sorted unique members including the peer; then the
    run (when ``run_id`` is given) and the signature, with the key recovered from ``receipt.peer``.
    Each refusal is logged, counted in ``counter`` (the caller's, if given) under its
    reason, and raised as ReceiptRejected.
    """
    counter = Counter() if counter is None else counter
    try:
        signed = _parse(data)
        if run_id is not None and signed.receipt.run != run_id:
            raise ReceiptRejected("another run", f"run {signed.receipt.run!r}, expected {run_id!r}")
        _check_signature(signed)
    except ReceiptRejected as e:
        counter[e.reason] += 1
        logger.warning("refused a participation receipt: %s", e)
        raise
    return signed


def _parse(data: Any) -> SignedReceipt:
    if isinstance(data, SignedReceipt):
        data = data.to_dict()
    if isinstance(data, (bytes, bytearray)):
        if len(data) > MAX_RECEIPT_BYTES:
            raise ReceiptRejected("oversized", f"{len(data)} bytes > limit {MAX_RECEIPT_BYTES}")
        data = strict_json(bytes(data), ReceiptRejected)
    expect_keys(data, {"receipt", "signature"}, "top level", ReceiptRejected)
    fields = data["receipt"]
    expect_keys(fields, set(_FIELDS), "receipt", ReceiptRejected)
    if not isinstance(fields["members"], list) or len(fields["members"]) > MAX_RECEIPT_MEMBERS:
        raise ReceiptRejected("malformed", f"members must be a list of at most {MAX_RECEIPT_MEMBERS} peer IDs")
    try:
        size = len(canonical_json(data))
    except (TypeError, ValueError, RecursionError) as e:
        raise ReceiptRejected("malformed", f"not plain JSON of ints and strings: {e}") from None
    if size > MAX_RECEIPT_BYTES:
        raise ReceiptRejected("oversized", f"{size} bytes > limit {MAX_RECEIPT_BYTES}")
    signature = data["signature"]
    if not isinstance(signature, str) or not _HEX128.fullmatch(signature):
        raise ReceiptRejected("malformed", "signature must be 128 lowercase hex chars")
    receipt = Receipt(**{**fields, "members": tuple(fields["members"])})
    return SignedReceipt(receipt=receipt, signature=signature)


def _check_signature(signed: SignedReceipt) -> None:
    receipt = signed.receipt
    try:
        public_key = public_key_from_peer_id(receipt.peer)
    except ValueError as e:
        raise ReceiptRejected("bad signature", str(e)) from None
    if not verify(
        public_key=public_key,
        kind=RECEIPT_KIND,
        run_id=receipt.run,
        payload=receipt.payload(),
        signature=bytes.fromhex(signed.signature),
    ):
        raise ReceiptRejected("bad signature", f"the signature does not verify for {receipt.peer}")


# ---------------------------------------------------------------------------------------------- summaries


@dataclass(frozen=True, kw_only=True, slots=True)
class Contribution:
    """One peer's contribution, summed over its distinct receipts."""

    peer: str
    """The peer ID."""
    rounds: int
    """Distinct (run, round) pairs with a receipt."""
    samples: int
    """Samples, summed over distinct receipts."""
    bytes_sent: int
    """Bytes sent, summed over distinct receipts."""
    bytes_received: int
    """Bytes received, summed over distinct receipts."""
    first_round: int
    """Lowest round with a receipt."""
    last_round: int
    """Highest round with a receipt."""
    num_receipts: int = 0
    """Distinct receipts (more than ``rounds`` when a round was retried in another group)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, as ``swarm.ledger`` and ``swarm.report`` print them (``num_receipts`` as "receipts")."""
        return {
            "peer": self.peer,
            "rounds": self.rounds,
            "receipts": self.num_receipts,
            "samples": self.samples,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "first_round": self.first_round,
            "last_round": self.last_round,
        }


def receipt_key(receipt: Receipt) -> tuple[str, str, int, str]:
    """``(peer, run, round, group_id)``: receipts with equal keys count once."""
    return receipt.peer, receipt.run, receipt.round, receipt.group_id


def contributions(receipts: Iterable[SignedReceipt]) -> dict[str, Contribution]:
    """Per-peer sums over ``receipts`` (already verified), each key of :func:`receipt_key` counted once.

    When one key has several receipts (copies in many ledgers, or a peer that signed two versions),
    the one with the smallest digest is kept, so the result does not depend on the order given.
    """
    chosen: dict[tuple[str, str, int, str], Receipt] = {}
    for signed in receipts:
        key, receipt = receipt_key(signed.receipt), signed.receipt
        if key not in chosen or receipt.digest() < chosen[key].digest():
            chosen[key] = receipt
    by_peer: dict[str, list[Receipt]] = defaultdict(list)
    for receipt in chosen.values():
        by_peer[receipt.peer].append(receipt)
    return {peer: _sum(peer, mine) for peer, mine in sorted(by_peer.items())}


def _sum(peer: str, receipts: list[Receipt]) -> Contribution:
    rounds = [r.round for r in receipts]
    return Contribution(
        peer=peer,
        rounds=len({(r.run, r.round) for r in receipts}),
        samples=sum(r.samples for r in receipts),
        bytes_sent=sum(r.bytes_sent for r in receipts),
        bytes_received=sum(r.bytes_received for r in receipts),
        first_round=min(rounds),
        last_round=max(rounds),
        num_receipts=len(receipts),
    )


def cross_check(
    ledgers: Iterable[tuple[LedgerVerdict, Sequence[LedgerEntry]]], *, counter: Counter[str] | None = None
) -> list[str]:
    """Problems found by checking every receipt in ``ledgers`` against its signer's ledger, if given.

    ``ledgers`` pairs each file's verdict (for its owner and run) with its entries. A verified
    receipt by peer P names P's ledger head when P signed (``ledger_seq``, ``ledger_head``); when
    P's ledger of that run is among ``ledgers``, it must hold that entry with that digest. A missing
    entry means P truncated its ledger, another digest that P rewrote it. Receipts that fail
    :func:`verify_receipt` are counted in ``counter`` (the caller's, if given) and skipped.
    One problem is reported per (ledger, named entry), however many copies of the receipt exist.
    """
    ledgers = list(ledgers)
    owned: dict[tuple[str, str], list[tuple[Path, dict[int, str]]]] = defaultdict(list)
    for verdict, entries in ledgers:
        owned[verdict.peer, verdict.run].append((verdict.path, {e.seq: e.digest for e in entries}))
    problems: dict[tuple[Path, int, str], str] = {}
    for verdict, entries in ledgers:
        for signed in verified_receipts(entries, run=verdict.run, counter=counter):
            r = signed.receipt
            for path, digests in owned.get((r.peer, r.run), []):
                problem = _head_problem(r, digests.get(r.ledger_seq), holder=verdict.path, path=path)
                if problem is not None:
                    problems.setdefault((path, r.ledger_seq, r.ledger_head), problem)
    return list(problems.values())


def _head_problem(r: Receipt, found: str | None, *, holder: Path, path: Path) -> str | None:
    if r.ledger_seq == 0 or found == r.ledger_head:
        return None
    what = "has no such entry (its tail was cut)" if found is None else "holds another digest there (rewritten)"
    return (
        f"{path}: the receipt of round {r.round} signed by {r.peer} (held by {holder}) names its entry "
        f"{r.ledger_seq} with digest {r.ledger_head[:16]}, but the ledger {what}"
    )


def verified_receipts(
    entries: Iterable[LedgerEntry], *, run: str, counter: Counter[str] | None = None
) -> list[SignedReceipt]:
    """The receipts among ``entries`` (kind "receipt") that :func:`verify_receipt` accepts for ``run``;
    the others are counted in ``counter`` (the caller's, if given) and left out."""
    found = []
    for entry in entries:
        if entry.kind == "receipt":
            try:
                found.append(verify_receipt(entry.body, run_id=run, counter=counter))
            except ReceiptRejected:
                continue
    return found
