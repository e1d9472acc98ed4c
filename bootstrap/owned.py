"""Owner-bound DHT records: in a Swarm DHT no one can forge, overwrite or hide another peer's record.

Every record a Swarm node stores or returns, under any key, must sit under a subkey that is its
writer's Ed25519 peer ID and carry that peer's signature (domain ``swarm/dht-record``) over the
record's key, subkey, value and expiration time. Our peer IDs embed the public key, so any node checks
this without a lookup. :class:`OwnerBoundValidator` does both halves, as hivemind's
``RSASignatureValidator`` does for its owner-marked subkeys:

* ``sign_value`` (the writer's node, for the identities it was given) appends the 64-byte signature;
* ``validate`` (every node, on store and on every value it reads from another node) refuses a record
  without a peer-ID subkey (a plain value included: one could replace a whole dictionary of
  subkeys), with a bad signature, signed for another key, subkey, value or expiry, or with an expiry that is
  not a finite number (NaN or infinity: it would never leave hivemind's storage); each refusal
  is counted by reason. A replayed old record keeps its old signed expiry, so it loses to the newer
  one, and a record cannot be kept alive past the expiry it was signed with;
* ``strip_value`` removes the signature before the application sees the value.

The capability records of :data:`bootstrap.records.PEERS_KEYS` carry their own signed payload (bound to
the same subkey and to their own expiry, :class:`bootstrap.records.PeerRecordValidator`); they pass
here untouched, so anyone may still relay a peer's genuine record.

Reads are re-verified by the reader's own node: hivemind validates every value found on another
node, so a plain hivemind node that stores garbage cannot serve it to a Swarm peer (hivemind drops
that node's whole answer for the key, and the answers of honest nodes stand).
"""

from __future__ import annotations

import math
import struct
from collections import OrderedDict
from typing import Any

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from bootstrap.envelope import RejectionLog
from bootstrap.errors import Rejected
from bootstrap.identity import Identity, public_key_from_peer_id, verify
from bootstrap.records import capability_key_ids, validator_rejections

OWNED_KIND = "swarm/dht-record"
_SIGNATURE_BYTES = 64
_CACHE_SIZE = 4096
"""Verified records remembered, so that a key polled many times a second is not verified each time."""
_CAPABILITY_KEYS = frozenset(capability_key_ids())
"""The capability records' keys: they carry their own owner-bound signature (PeerRecordValidator)."""
_REGULAR_VALUE = MSGPackSerializer.dumps(None)
"""hivemind's subkey marker for a plain (subkey-less) value."""


class RecordNotOwned(Rejected):
    """A DHT record that is not signed by the peer its subkey names; ``reason`` is a countable label."""

    what = "DHT record"


def owned_rejections() -> RejectionLog:
    return RejectionLog("DHT record")


def _message(record: DHTRecord, value: bytes) -> bytes:
    """What is signed (with the key's DHT id as run id, so the record cannot move to another key): the
    length-prefixed subkey, the expiry as sent (a double), then the value."""
    return b"".join(
        [struct.pack(">I", len(record.subkey)), record.subkey, struct.pack(">d", record.expiration_time), value]
    )


class OwnerBoundValidator(RecordValidatorBase):
    """Signs the records of ``identities`` and refuses every record that its subkey's owner did not sign.

    Validators of this class merge: adding one to a DHT that has one already adds its identities.
    """

    def __init__(self, *identities: Identity) -> None:
        self._identities = {identity.peer_id: identity for identity in identities}
        self._verified: OrderedDict[tuple[bytes, bytes, bytes, float], None] = OrderedDict()
        self.rejections = owned_rejections()

    def __getstate__(self) -> dict:  # add_validators sends us to the DHT's process (a local pipe)
        return {"identities": self._identities}

    def __setstate__(self, state: dict) -> None:
        self._identities = state["identities"]
        self._verified, self.rejections = OrderedDict(), owned_rejections()

    @property
    def priority(self) -> int:
        return 10  # signs last and validates first: the signature wraps what other validators see

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, OwnerBoundValidator):
            return False
        self._identities.update(other._identities)
        return True

    def _signer(self, subkey: bytes) -> Identity | None:
        try:
            peer_id = MSGPackSerializer.loads(subkey)
        except Exception:
            return None
        return self._identities.get(peer_id) if isinstance(peer_id, str) else None

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key in _CAPABILITY_KEYS:
            return record.value
        identity = self._signer(record.subkey)
        if identity is None:  # not ours to sign: validate() refuses it, here and on every other node
            return record.value
        payload = _message(record, record.value)
        return record.value + identity.sign(kind=OWNED_KIND, run_id=record.key.hex(), payload=payload)

    def strip_value(self, record: DHTRecord) -> bytes:
        if record.key in _CAPABILITY_KEYS:
            return record.value
        return record.value[:-_SIGNATURE_BYTES]

    def validate(self, record: DHTRecord) -> bool:
        if record.key in _CAPABILITY_KEYS:
            return True
        cache_key = (record.key, record.subkey, record.value, record.expiration_time)
        if cache_key in self._verified:
            self._verified.move_to_end(cache_key)
            return True
        source: Any = "?"
        try:
            self._check(record)
        except RecordNotOwned as e:
            try:
                source = MSGPackSerializer.loads(record.subkey)
            except Exception:
                pass
            self.rejections.reject(e, where="DHT", source=source)
            return False
        self._verified[cache_key] = None
        if len(self._verified) > _CACHE_SIZE:
            self._verified.popitem(last=False)
        return True

    @staticmethod
    def _check(record: DHTRecord) -> None:
        if not math.isfinite(record.expiration_time):  # even signed by its owner: it would never expire from
            # hivemind's storage, and a NaN breaks the order of that storage's expiry heap
            raise RecordNotOwned("non-finite expiration", repr(record.expiration_time))
        if record.subkey == _REGULAR_VALUE:
            raise RecordNotOwned("no owner", "a plain value: every Swarm record is stored under its writer's subkey")
        try:
            peer_id = MSGPackSerializer.loads(record.subkey)
            public_key = public_key_from_peer_id(peer_id)
        except Exception as e:
            raise RecordNotOwned("subkey is not a peer id", repr(e)[:120]) from None
        if len(record.value) <= _SIGNATURE_BYTES:
            raise RecordNotOwned("unsigned", f"{len(record.value)} bytes")
        value, signature = record.value[:-_SIGNATURE_BYTES], record.value[-_SIGNATURE_BYTES:]
        if not verify(
            public_key=public_key,
            kind=OWNED_KIND,
            run_id=record.key.hex(),
            payload=_message(record, value),
            signature=signature,
        ):
            raise RecordNotOwned("bad signature", f"not signed by {peer_id}")


def dht_owned_rejections(dht: Any, *, timeout_s: float = 10.0) -> dict[str, int]:
    """Records this DHT node's :class:`OwnerBoundValidator` refused (on store or on get), by reason."""
    return validator_rejections(dht, OwnerBoundValidator, timeout_s=timeout_s)
