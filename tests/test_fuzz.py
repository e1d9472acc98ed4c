"""Fuzzed input to every parser and RPC handler of untrusted bytes (issue 8 item 2; TESTMATRIX row 15).

Each target gets random values *and* mutations of a valid input (bit flips, inserted, deleted or
duplicated spans, truncation, and JSON-level edits: a field replaced, deleted or added, or a raw token
spliced in such as a 5000-digit integer, 1200-deep nesting, NaN, 1e999 or a lone surrogate). Mutated
payloads are often re-signed with the right key, so the checks behind the signature are reached too.
Every property asserts the same three things:

* no crash: the only exception is the target's own refusal type, with a known ``reason``;
* a clear rejection that is counted: the target's counter moves by exactly one (or, for a handler,
  the stream ends either served or with one counted reason, never "internal error");
* no hang: every handler call is bounded (``asyncio.wait_for``) by its own timeout plus a margin.

| target | fuzzed entry point | live P2P check |
|---|---|---|
| capability records | ``bootstrap.records.parse_record``, ``PeerRecordValidator.validate`` (msgpack) | test_peers |
| status board | ``swarm.status.parse_status`` | test_status |
| matchmaking entries | ``averaging.membership.parse_entry`` through ``GroupAverager._parse_entry`` | test_averaging |
| receipts | ``swarm.ledger.receipts.verify_receipt`` (dicts and JSON bytes) | - |
| manifests | ``SignedManifest.from_bytes``, ``verify_manifest`` | gossip below |
| checkpoint shards | ``CheckpointStore.put_shard_bytes`` / ``load_tensors`` (header-level mutations) | - |
| ledgers | ``read_entries`` / ``verify_ledger`` / ``Ledger(...)`` on mutated SQLite files and rows | - |
| identity keys | ``Identity.load_or_create`` on mutated key files and modes | - |
| averaging codecs | ``Codec.decode`` on mutated messages | - |
| averaging handler | ``bootstrap.framing.read_frame``, ``GroupAverager._handle_stream`` (in memory) | yes |
| group metadata | ``swarm.rounds`` (gathered_problem, base_agreement_group, next_round, seal_fields) | - |
| manifest gossip | ``ManifestGossip._serve``, ``ManifestGossip._serve_unary`` (in memory) | yes |
| shard exchange | ``ShardServer._handle``, client ``_Session.request`` (in memory) | yes |
| bandwidth probe | ``ProbeServer._handle``, client ``_probe`` (in memory) | test_bandwidth |
| `/metrics` | ``bootstrap.metrics.serve_metrics``: raw requests on TCP | yes (the server is live) |

Determinism: hypothesis runs with a fixed seed (``SWARM_FUZZ_SEED``, default below), no example
database and bounded ``max_examples``; a failure prints the seed and the command to rerun it (a
hypothesis note), plus the minimal failing example. The live tests use fixed inputs. Each property
runs with the stack headroom a peer's thread has (``peer_stack``): hypothesis raises the recursion
limit, which would hide a RecursionError that deep nesting causes in a peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import hashlib
import json
import logging
import os
import socket
import sqlite3
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import HealthCheck, event, example, find, given, note, seed, settings
from hypothesis import strategies as st
from nacl.signing import SigningKey
from safetensors.torch import save as safetensors_save

from averaging.compression import get_codec
from averaging.config import AveragingConfig, RoundRecord
from averaging.group import Group, GroupAverager, _Activity, _Lobby, _Pieces, _ReduceState, _Window
from averaging.membership import ENTRY_KIND, Admission, Entry, sign_entry
from bootstrap import start_dht, stop_dht, visible_maddrs
from bootstrap.framing import ProtocolError, read_frame
from bootstrap.identity import Identity, IdentityError, PeerBinding, canonical_json, verify
from bootstrap.records import PeerRecordValidator, RecordRejected, parse_record, peers_key, sign_record
from bootstrap.runtime import open_p2p_replica
from peers.bandwidth import ProbeConfig, ProbeError, ProbeServer, _probe
from peers.testing import make_record
from swarm import rounds
from swarm.checkpoint._private import parse_header
from swarm.checkpoint.exchange import PROTOCOL as SHARDS_PROTOCOL
from swarm.checkpoint.exchange import (
    ExchangeConfig,
    MemoryShardSource,
    ShardExchange,
    ShardServer,
    _AttemptFailed,
    _Session,
    request_chunk,
)
from swarm.checkpoint.gossip import MAX_MANIFEST_BYTES, GossipConfig, ManifestGossip
from swarm.checkpoint.manifest import (
    Manifest,
    ManifestRejected,
    ShardInfo,
    SignedManifest,
    TensorInfo,
    sign_manifest,
    verify_manifest,
)
from swarm.checkpoint.store import CheckpointStore, ShardRejected
from swarm.ledger.chain import GENESIS, Ledger, LedgerError, read_entries, verify_ledger
from swarm.ledger.receipts import Receipt, ReceiptRejected, sign_receipt, verify_receipt
from swarm.status import LastGroup, PeerStatus, StatusEvent, StatusRejected, parse_status, sign_status
from tests.helpers import wait_until

FUZZ_SEED = int(os.environ.get("SWARM_FUZZ_SEED", "20260808"))
NOW = 1_800_000_000
RUN = "fuzz-run"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
HANG_MARGIN_S = 3.0

_PROFILE = settings(
    database=None,
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def fuzz(max_examples: int, **strategies: Any):
    """``@given(**strategies)`` with the fixed seed, no database, and the seed noted on failure."""

    def decorate(test):
        @functools.wraps(test)
        def noted(*args: Any, **kwargs: Any) -> Any:
            note(
                f"fuzz seed {FUZZ_SEED}; rerun: SWARM_FUZZ_SEED={FUZZ_SEED} pytest tests/test_fuzz.py -k "
                f"{test.__name__}"
            )
            with peer_stack():
                return test(*args, **kwargs)

        return seed(FUZZ_SEED)(settings(_PROFILE, max_examples=max_examples)(given(**strategies)(noted)))

    return decorate


@contextlib.contextmanager
def peer_stack(free_frames: int = 950) -> Any:
    """Hypothesis raises the recursion limit while a test runs; a peer's threads have about 1000 frames.

    Without this, input nested deeper than a peer can parse (a RecursionError there) would pass here.
    """
    depth, frame_ = 0, sys._getframe()
    while frame_ is not None:
        depth, frame_ = depth + 1, frame_.f_back
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + free_frames)
    try:
        yield
    finally:
        sys.setrecursionlimit(previous)


def identity(name: str) -> Identity:
    """A deterministic identity, so that the valid inputs (and thus the mutations) repeat run to run."""
    return Identity(SigningKey(hashlib.sha256(f"fuzz/{name}".encode()).digest()))


OWNER, OTHER, THIRD, FOURTH = (identity(n) for n in ("owner", "other", "third", "fourth"))

# ------------------------------------------------------------------------------------------ strategies
RAW_TOKENS = (
    "1" * 5000,  # over Python's 4300-digit int parsing limit: a ValueError, not JSON's
    "[" * 1200 + "]" * 1200,  # deeper than the recursion limit: a RecursionError
    "18446744073709551616",
    "-9223372036854775809",
    "1e999",
    "-1e999",
    "NaN",
    "Infinity",
    "-0",
    "0.5",
    "true",
    "false",
    "null",
    '""',
    "{}",
    "[]",
    '"\\ud800"',
    '"\\u0000"',
    '"\\u001b[2J"',
    '"' + "x" * 3000 + '"',
)
_HUGE_INTS = st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30, -1, 0, 2**31, 2**53 + 1])
json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    _HUGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=16),
)
json_values = st.recursive(
    json_leaves,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)
_PLACEHOLDER = "\x00fuzz-placeholder\x00"


@st.composite
def mutated_bytes(draw: Any, base: bytes, *, max_ops: int = 4) -> bytes:
    """``base`` with 1..max_ops random edits."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(("flip", "byte", "insert", "delete", "truncate", "token", "dup")))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 64))]
        elif op == "truncate":
            del data[pos:]
        elif op == "token":
            data[pos : pos + draw(st.integers(0, 8))] = draw(st.sampled_from(RAW_TOKENS)).encode()
        elif op == "dup":
            data[pos:pos] = data[pos : pos + draw(st.integers(1, 64))]
    return bytes(data)


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(obj, dict):
        for key, value in obj.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(obj, list):
        for index, value in enumerate(obj):
            found += _paths(value, (*prefix, index))
    return found


def _edit(obj: Any, path: tuple, how: str, value: Any) -> Any:
    if not path:
        return value if how != "add" or not isinstance(obj, dict) else {**obj, "extra": value}
    obj = copy.deepcopy(obj)
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    if how == "delete":
        del parent[path[-1]]
    elif how == "add" and isinstance(parent[path[-1]], dict):
        parent[path[-1]]["extra"] = value
    elif how == "add" and isinstance(parent[path[-1]], list):
        parent[path[-1]].append(value)
    else:
        parent[path[-1]] = value
    return obj


def _get(obj: Any, path: tuple) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def _same_type(value: Any) -> st.SearchStrategy[Any]:
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.one_of(st.integers(-5, 5).map(lambda d: value + d), st.integers(), _HUGE_INTS)
    if isinstance(value, str):
        return st.one_of(
            st.text(max_size=70),
            st.just(value[:-1]),
            st.just(value + value[-1:]),
            st.sampled_from([OTHER.peer_id, "ab" * 32, "", "\x1b[2J"]),
        )
    if isinstance(value, list):
        return st.one_of(st.just(value[::-1]), st.just(value + value[-1:]), st.just(value[1:]))
    return json_values


@st.composite
def mutated_json(draw: Any, obj: Any, *, canonical: bool = True) -> bytes:
    """``obj`` as JSON with one node replaced, deleted, extended or swapped for a raw token."""
    path = draw(st.sampled_from(_paths(obj)))
    how = draw(st.sampled_from(("typed", "typed", "replace", "raw", "delete", "add")))
    if how == "delete" and not path:
        how = "replace"
    value = _PLACEHOLDER if how == "raw" else draw(json_values)
    if how == "typed":  # a value of the same type, so that the checks behind the schema are reached too
        value = draw(_same_type(_get(obj, path)))
    text = json.dumps(
        _edit(obj, path, how, value),
        sort_keys=canonical,
        ensure_ascii=False,
        separators=(",", ":") if canonical else (", ", ": "),
    )
    if how == "raw":
        text = text.replace(json.dumps(_PLACEHOLDER), draw(st.sampled_from(RAW_TOKENS)))
    return text.encode("utf-8", "surrogatepass")


def mutated_payload(base: bytes) -> st.SearchStrategy[bytes]:
    """Byte-level or JSON-level mutations of a canonical JSON payload."""
    return st.one_of(mutated_bytes(base), mutated_json(json.loads(base)))


def signed_values(value: dict, *, kind: str, run_id: str) -> st.SearchStrategy[Any]:
    """A signed DHT value ``{"p": payload, "s": signature}`` as anyone may write it: random values, and mutated
    payloads under the old signature or re-signed by OWNER (an insider: the checks behind the signature)."""
    return st.one_of(
        json_values,
        st.binary(max_size=64),
        mutated_payload(value["p"]).map(lambda p: {"p": p, "s": value["s"]}),
        mutated_payload(value["p"]).map(lambda p: {"p": p, "s": OWNER.sign(kind=kind, run_id=run_id, payload=p)}),
    )


OWNER_SUBKEYS = st.one_of(st.just(OWNER.peer_id), st.just(OTHER.peer_id), json_values)
"""The subkey of a signed value: its owner's peer ID, another's, or anything."""


# ------------------------------------------------------------------------------------------ in-memory streams
class FakeWriter:
    """The writer half of a stream, in memory (what a handler sends back ends up in ``sent``)."""

    def __init__(self) -> None:
        self.sent = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("stream closed")
        self.sent += data

    def writelines(self, data: Iterable[bytes]) -> None:  # as asyncio.StreamWriter: one vectored write
        for part in data:
            self.write(part)

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    async def wait_closed(self) -> None:
        return None


def reader_of(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def frame(header: bytes, payload: bytes = b"") -> bytes:
    return len(header).to_bytes(4, "big") + header + payload


def run_bounded(start: Any, bound_s: float) -> Any:
    """Run ``start()`` (a coroutine function: streams must be made inside the loop) in a fresh event loop;
    a TimeoutError here means the handler hung past its bound."""

    async def main() -> Any:
        return await asyncio.wait_for(start(), bound_s)

    return asyncio.run(main())


PEER = SimpleNamespace(peer_id=OTHER.peer_id)


# ========================================================================================== records
RECORD_REASONS = {
    "malformed",
    "oversized",
    "version",
    "peer id mismatch",
    "bad signature",
    "expired",
    "from the future",
    "bad lifetime",
}
RECORD_VALUE = sign_record(make_record(OWNER, issued_at=NOW - 10, lifetime_s=120), OWNER)


@st.composite
def record_values(draw: Any) -> tuple[Any, Any]:
    """(subkey, value): garbage, or the valid record with its payload, signature or subkey mutated."""
    kind = draw(st.sampled_from(("garbage", "payload", "resigned", "signature", "subkey")))
    subkey, value = OWNER.peer_id, dict(RECORD_VALUE)
    if kind == "garbage":
        return draw(st.one_of(json_values, st.text(max_size=60))), draw(
            st.one_of(
                json_values,
                st.binary(max_size=64),
                st.fixed_dictionaries(
                    {
                        "p": st.one_of(st.binary(max_size=300), json_values),
                        "s": st.one_of(st.binary(max_size=80), json_values),
                    }
                ),
            )
        )
    if kind in ("payload", "resigned"):
        value["p"] = draw(mutated_payload(RECORD_VALUE["p"]))
        if kind == "resigned":
            value["s"] = OWNER.sign(kind="swarm/record", run_id="", payload=value["p"])
    elif kind == "signature":
        value["s"] = draw(mutated_bytes(RECORD_VALUE["s"]))
    else:
        subkey = draw(st.one_of(st.just(OTHER.peer_id), st.text(max_size=60), json_values))
    return subkey, value


@fuzz(250, case=record_values())
@example(case=(OWNER.peer_id, {"p": b'{"v":' + b"1" * 5000 + b"}", "s": b"x" * 64}))
def test_parse_record_only_accepts_what_the_owner_signed(case):
    subkey, value = case
    try:
        record = parse_record(subkey, value, now=NOW)
    except RecordRejected as e:
        event(f"rejected: {e.reason}")
        assert e.reason in RECORD_REASONS, e
        return
    event("accepted")
    assert subkey == record.peer_id == OWNER.peer_id and record.payload() == value["p"]
    assert verify(public_key=OWNER.public_key, kind="swarm/record", run_id="", payload=value["p"], signature=value["s"])


_LIVE_RECORD = sign_record(make_record(OWNER, lifetime_s=300), OWNER)  # the validator uses the real clock
_PEERS_KEY_ID = DHTID.generate(source=peers_key(OWNER.peer_id)).to_bytes()


@fuzz(
    200,
    subkey=st.one_of(st.binary(max_size=40), mutated_bytes(MSGPackSerializer.dumps(OWNER.peer_id))),
    value=st.one_of(
        st.binary(max_size=200),
        mutated_bytes(MSGPackSerializer.dumps(_LIVE_RECORD), max_ops=2),
        mutated_json(json.loads(_LIVE_RECORD["p"])).map(
            lambda p: MSGPackSerializer.dumps({"p": p, "s": OWNER.sign(kind="swarm/record", run_id="", payload=p)})
        ),
    ),
)
def test_record_validator_refuses_mutated_msgpack_and_counts_it(subkey, value):
    validator = PeerRecordValidator()
    record = DHTRecord(key=_PEERS_KEY_ID, subkey=subkey, value=value, expiration_time=time.time() + 30)
    accepted = validator.validate(record)
    assert accepted is True or accepted is False
    assert sum(validator.rejections.counts.values()) == (0 if accepted else 1), validator.rejections.counts
    assert set(validator.rejections.counts) <= RECORD_REASONS | {"outlives its expiry"}


# ========================================================================================== status board
STATUS_REASONS = {
    "malformed",
    "oversized",
    "version",
    "non-canonical",
    "another run",
    "peer mismatch",
    "bad peer id",
    "bad signature",
    "from the future",
    "stale",
}
_STATUS = PeerStatus(
    peer=OWNER.peer_id,
    run=RUN,
    t=NOW - 5,
    state="training",
    round=7,
    step=70,
    samples_per_s_milli=1500,
    loss_milli=2310,
    val_loss_milli=None,
    last_group=LastGroup(
        group_id="g7",
        members=(OWNER.peer_id, OTHER.peer_id),
        outcome="ok",
        duration_ms=1200,
        bytes_sent=10,
        bytes_received=20,
    ),
    events=(StatusEvent(t=NOW - 6, kind="joined", detail="round 0"),),
)
STATUS_VALUE = sign_status(_STATUS, OWNER)


@fuzz(250, subkey=OWNER_SUBKEYS, value=signed_values(STATUS_VALUE, kind="swarm/status", run_id=RUN))
def test_parse_status_refuses_with_one_counted_reason(subkey, value):
    counter: Counter[str] = Counter()
    try:
        status = parse_status(subkey, value, run=RUN, now=NOW, counter=counter)
    except StatusRejected as e:
        event(f"rejected: {e.reason}")
        assert e.reason in STATUS_REASONS and counter == Counter({e.reason: 1}), (e, counter)
        return
    event("accepted")
    assert not counter and status.peer == subkey == OWNER.peer_id and status.payload() == value["p"]


# =============================================================================== matchmaking entries
ENTRY_REASONS = {"subkey is not a peer id", "malformed", "oversized", "bad signature", "expired", "outlives its expiry"}
MM_KEY = f"{RUN}.mm"
ENTRY_VALUE = sign_entry(OWNER, MM_KEY, bandwidth_class=3, region="eu", expires_at=NOW + 5)


@fuzz(
    250,
    subkey=OWNER_SUBKEYS,
    value=st.one_of(
        signed_values(ENTRY_VALUE, kind=ENTRY_KIND, run_id=MM_KEY),
        st.floats(NOW - 10, NOW + 7200).map(
            lambda x: sign_entry(OWNER, MM_KEY, bandwidth_class=3, region="eu", expires_at=x)
        ),  # well formed: the clock's checks
    ),
    expiration=st.one_of(st.just(NOW + 5.0), st.floats(allow_nan=True, allow_infinity=True)),
)
def test_a_matchmaking_entry_is_refused_with_one_counted_reason(subkey, value, expiration):
    """The matchmaking key's values as a reader takes them (`GroupAverager._parse_entry`): from anyone, with any
    subkey and the DHT's expiration, re-signed by an insider's key."""
    peer = SimpleNamespace(_admission=SimpleNamespace(identity=OTHER), rejected=Counter())
    entry = GroupAverager._parse_entry(
        peer, MM_KEY, subkey, SimpleNamespace(value=value, expiration_time=expiration), NOW
    )
    if entry is None:
        [(reason, count)] = peer.rejected.items()
        event(f"rejected: {reason}")
        assert count == 1 and reason.removeprefix("candidate ") in ENTRY_REASONS, peer.rejected
        return
    event("accepted")
    data = json.loads(value["p"])
    assert not peer.rejected and subkey == OWNER.peer_id and isinstance(entry, Entry)
    assert (
        entry == (data["r"], data["c"], "g" in data) and NOW < data["x"] / 1000 and expiration <= data["x"] / 1000 + 1
    )


# ========================================================================================== receipts
RECEIPT_REASONS = {
    "malformed",
    "oversized",
    "unsupported version",
    "members not sorted and unique",
    "peer not a member",
    "bad signature",
    "another run",
}
_MEMBERS = tuple(sorted(i.peer_id for i in (OWNER, OTHER, THIRD, FOURTH)))


def _receipt(signer: Identity, *, round_: int = 5, run: str = RUN) -> Any:
    return sign_receipt(
        Receipt(
            run=run,
            round=round_,
            group_id=f"group-{round_}",
            members=_MEMBERS,
            peer=signer.peer_id,
            samples=64,
            bytes_sent=1000,
            bytes_received=2000,
            ledger_seq=3,
            ledger_head="ab" * 32,
            t=NOW - 1,
        ),
        signer,
    )


RECEIPT_DICT = _receipt(OWNER).to_dict()


def _dict_mutation(obj: Any) -> st.SearchStrategy[Any]:
    """``obj`` (a JSON-able dict) with one node replaced by a random value, deleted or extended."""

    @st.composite
    def build(draw: Any) -> Any:
        path = draw(st.sampled_from(_paths(obj)))
        how = draw(st.sampled_from(("replace", "delete", "add") if path else ("replace", "add")))
        return _edit(obj, path, how, draw(json_values))

    return build()


@fuzz(
    250,
    data=st.one_of(
        json_values,
        st.binary(max_size=64),
        _dict_mutation(RECEIPT_DICT),
        mutated_bytes(canonical_json(RECEIPT_DICT)),
        mutated_json(RECEIPT_DICT),
    ),
    run_id=st.sampled_from([RUN, None, "another-run"]),
)
def test_verify_receipt_refuses_with_one_counted_reason(data, run_id):
    counter: Counter[str] = Counter()
    try:
        signed = verify_receipt(data, run_id=run_id, counter=counter)
    except ReceiptRejected as e:
        event(f"rejected: {e.reason}")
        assert e.reason in RECEIPT_REASONS and counter == Counter({e.reason: 1}), (e, counter)
        return
    assert not counter and signed.to_dict() == RECEIPT_DICT  # only the genuine receipt verifies


# ========================================================================================== manifests
MANIFEST_REASONS = {
    "oversized",
    "malformed",
    "unsupported version",
    "bad receipt",
    "another run's manifest",
    "missing signature",
    "signer not a participant",
    "bad signature",
    "below quorum",
}
_GROUP = sorted((OWNER, OTHER, THIRD, FOURTH), key=lambda i: i.peer_id)
_SHARD = ShardInfo(
    name="shard-00000",
    digest="cd" * 32,
    size_bytes=4096,
    tensors=(TensorInfo(name="w", dtype="float32", shape=(16, 16)),),
)
_MANIFEST = Manifest(
    run_id=RUN,
    step=5,
    round=5,
    task="charlm",
    config_digest="ef" * 32,
    parent="",
    shards=(_SHARD,),
    participants=_MEMBERS,
    metrics={"val_loss_milli": 2310},
    created_at=NOW - 2,
    contributions={p: 64 for p in _MEMBERS},
)


def _sealed(manifest: Manifest = _MANIFEST, signers: list[Identity] = _GROUP[:3]) -> SignedManifest:
    signed = SignedManifest(manifest=manifest, receipts=tuple(_receipt(i) for i in _GROUP))
    for signer in signers:
        signed = signed.with_signature(*sign_manifest(manifest, signer))
    return signed


MANIFEST_BYTES = _sealed().to_bytes()


@fuzz(
    200,
    data=st.one_of(st.binary(max_size=256), mutated_bytes(MANIFEST_BYTES), mutated_json(json.loads(MANIFEST_BYTES))),
)
@example(data=MANIFEST_BYTES.replace(b'"step":5', b'"step":' + b"5" * 5000))
@example(data=MANIFEST_BYTES.replace(b'"step":5', b'"step":' + b"[" * 1200 + b"]" * 1200))
def test_manifest_parser_refuses_with_one_counted_reason(data):
    try:
        SignedManifest.from_bytes(data)
    except ManifestRejected as e:
        assert e.reason in ("oversized", "malformed", "unsupported version", "bad receipt"), e
    counter: Counter[str] = Counter()
    try:
        manifest = verify_manifest(data, run_id=RUN, counter=counter)
    except ManifestRejected as e:
        event(f"rejected: {e.reason}")
        assert e.reason in MANIFEST_REASONS and counter == Counter({e.reason: 1}), (e, counter)
        return
    assert not counter and manifest == _MANIFEST


# ========================================================================================== checkpoint shards
SHARD_REASONS = {"not safetensors", "unexpected dtype", "size mismatch", "tensor names mismatch", "shape mismatch"}
SHARD_BYTES = safetensors_save(
    {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "steps": torch.arange(3, dtype=torch.int64),
        "mask": torch.tensor([True, False]),
    }
)
_HEADER_LEN = int.from_bytes(SHARD_BYTES[:8], "little")
_SHARD_HEADER = json.loads(SHARD_BYTES[8 : 8 + _HEADER_LEN])
_SHARD_DATA = SHARD_BYTES[8 + _HEADER_LEN :]
_SHARD_INFO = ShardInfo(
    name="shard-00000",
    digest=hashlib.sha256(SHARD_BYTES).hexdigest(),
    size_bytes=len(SHARD_BYTES),
    tensors=(
        TensorInfo(name="w", dtype="float32", shape=(3, 4)),
        TensorInfo(name="steps", dtype="int64", shape=(3,)),
        TensorInfo(name="mask", dtype="bool", shape=(2,)),
    ),
)


@st.composite
def mutated_shards(draw: Any) -> bytes:
    how = draw(st.sampled_from(("bytes", "header", "length")))
    if how == "bytes":
        return draw(mutated_bytes(SHARD_BYTES))
    if how == "length":
        return draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little") + SHARD_BYTES[8:]
    header = draw(mutated_json(_SHARD_HEADER, canonical=False))
    prefix = len(header) if draw(st.booleans()) else draw(st.integers(0, len(header) + 64))
    return prefix.to_bytes(8, "little") + header + _SHARD_DATA


@pytest.fixture(scope="module")
def shard_store(tmp_path_factory: pytest.TempPathFactory) -> CheckpointStore:
    return CheckpointStore(tmp_path_factory.mktemp("fuzz-store"))


def _shard_with_header(header: dict) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + _SHARD_DATA


@fuzz(250, data=mutated_shards())
@example(data=_shard_with_header({**_SHARD_HEADER, "w": {**_SHARD_HEADER["w"], "dtype": []}}))
def test_shard_loading_refuses_mutated_safetensors_with_one_counted_reason(shard_store, data):
    store = shard_store
    store.rejected.clear()
    digest = hashlib.sha256(data).hexdigest()
    try:
        path = store.put_shard_bytes(data, expected_digest=digest, expected_size_bytes=len(data))
    except ShardRejected as e:
        event(f"rejected: {e.reason}")
        assert e.reason in SHARD_REASONS and store.rejected == Counter({e.reason: 1}), (e, store.rejected)
        assert not store.has(digest)
    else:  # a file the strict header check accepts must load, with exactly the tensors it declares
        assert not store.rejected and path.read_bytes() == data
        declared = ShardInfo(name="s", digest=digest, size_bytes=len(data), tensors=parse_header(data))
        tensors = store.load_tensors(declared)
        assert sorted(tensors) == sorted(t.name for t in declared.tensors)
    # at rest: the mutated bytes stored under their own digest but checked against the genuine entry
    store.rejected.clear()
    store.shard_path(digest).write_bytes(data)
    at_rest = ShardInfo(name="s", digest=digest, size_bytes=_SHARD_INFO.size_bytes, tensors=_SHARD_INFO.tensors)
    try:
        loaded = store.load_tensors(at_rest)
    except ShardRejected as e:
        assert e.reason in SHARD_REASONS and store.rejected == Counter({e.reason: 1}), (e, store.rejected)
    else:
        assert {n: (str(t.dtype), tuple(t.shape)) for n, t in loaded.items()} == {
            "w": ("torch.float32", (3, 4)),
            "steps": ("torch.int64", (3,)),
            "mask": ("torch.bool", (2,)),
        }
    store.shard_path(digest).unlink()


# ========================================================================================== ledgers
@pytest.fixture(scope="module")
def pristine_ledger(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, Path]:
    folder = tmp_path_factory.mktemp("fuzz-ledger")
    path = folder / f"{OWNER.peer_id}.sqlite"
    with Ledger(path, identity=OWNER, run=RUN) as ledger:
        for step in range(5):
            ledger.append("train", {"step": step, "loss": 2.5 - step / 10, "note": "x" * 50}, t=NOW + step)
    with contextlib.closing(sqlite3.connect(path)) as conn:  # everything into the main file: no -wal to copy
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    copy_path = folder / "copy" / path.name
    copy_path.parent.mkdir()
    copy_path.write_bytes(path.read_bytes())
    assert verify_ledger(copy_path).num_entries == 5 and verify_ledger(copy_path).ok
    return path.read_bytes(), folder


def _check_ledger_file(path: Path) -> Any:
    verdict = verify_ledger(path)  # never raises on content
    try:
        entries = read_entries(path)
    except LedgerError:
        entries = None
    if entries is not None and verdict.ok:
        assert [e.seq for e in entries] == list(range(1, len(entries) + 1))
    try:
        Ledger(path, identity=OWNER, run=RUN).close()
    except LedgerError:
        pass
    return verdict


@fuzz(60, data=st.data())
def test_mutated_ledger_files_are_reported_never_raised(pristine_ledger, data):
    pristine, folder = pristine_ledger
    path = folder / f"case-{uuid.uuid4().hex}.sqlite"
    path.write_bytes(data.draw(mutated_bytes(pristine, max_ops=6)))
    try:
        _check_ledger_file(path)
    finally:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)


_LEDGER_COLUMNS = ("seq", "t_ms", "kind", "peer", "run", "body", "prev", "digest", "signature")


@fuzz(
    60,
    seq=st.integers(1, 5),
    column=st.sampled_from(_LEDGER_COLUMNS),
    value=st.one_of(
        st.none(),
        st.integers(),
        st.floats(),
        st.text(max_size=80),
        st.binary(max_size=40),
        st.sampled_from(
            [
                "{}",
                "[]",
                '{"a":' + "1" * 5000 + "}",
                "[" * 2000,
                "0" * 64,
                "f" * 128,
                GENESIS,
                OTHER.peer_id,
                "other-run",
            ]
        ),
    ),
)
def test_mutated_ledger_rows_are_blamed_never_raised(pristine_ledger, seq, column, value):
    pristine, folder = pristine_ledger
    # the owner's own file name in a folder of its own, so that only the edited row is wrong
    path = folder / f"rows-{uuid.uuid4().hex}" / f"{OWNER.peer_id}.sqlite"
    path.parent.mkdir()
    path.write_bytes(pristine)
    try:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            row = f"SELECT {', '.join(_LEDGER_COLUMNS)} FROM entries ORDER BY seq"
            before = conn.execute(row).fetchall()
            try:
                conn.execute(f"UPDATE entries SET {column} = ? WHERE seq = ?", (value, seq))
                conn.commit()
            except sqlite3.Error:
                return  # e.g. a duplicate seq: SQLite itself refused the edit
            if conn.execute(row).fetchall() == before:
                return  # SQLite stored an equal value (type affinity): no fault was injected
        verdict = _check_ledger_file(path)
        assert not verdict.ok and verdict.problems, f"an edit of {column} at seq {seq} went unnoticed"
    finally:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        path.parent.rmdir()


# ========================================================================================== identity keys
_KEY_FILE = b"swarm-ed25519-v1\n" + hashlib.sha256(b"fuzz/key").hexdigest().encode() + b"\n"
_WHITESPACE = st.sampled_from([b" ", b"  ", b"\t", b"\n", b"\r\n", b"\x0b", b"\x0c"])


@st.composite
def key_files(draw: Any) -> bytes:
    how = draw(st.sampled_from(("bytes", "whitespace", "random")))
    if how == "random":
        return draw(st.binary(max_size=100))
    if how == "bytes":
        return draw(mutated_bytes(_KEY_FILE, max_ops=2))
    start = draw(st.integers(0, len(_KEY_FILE) - 1))
    blank = draw(_WHITESPACE)
    return _KEY_FILE[:start] + blank + _KEY_FILE[start + len(blank) :]


@fuzz(200, contents=key_files(), mode=st.sampled_from([0o600, 0o400, 0o640, 0o604, 0o660, 0o644, 0o700]))
@example(contents=_KEY_FILE[:-3] + b"  \n", mode=0o600)  # a seed of 31 bytes once escaped as nacl's ValueError
def test_identity_key_loading_refuses_clearly_and_never_rewrites(tmp_path_factory, contents, mode):
    path = tmp_path_factory.getbasetemp() / f"key-{uuid.uuid4().hex}"
    path.write_bytes(contents)
    os.chmod(path, mode)
    try:
        loaded = Identity.load_or_create(path)
    except IdentityError as e:
        assert str(path) in str(e)
        if mode & 0o077:
            assert "accessible by other users" in str(e)
    else:
        assert not mode & 0o077 and len(loaded.public_key) == 32
    finally:
        assert path.read_bytes() == contents and (path.stat().st_mode & 0o777) == mode, "the key file was modified"
        path.unlink()


# ========================================================================================== averaging codecs
_CODEC_NUMEL = 300


@functools.cache
def _codec_message(name: str) -> bytes:
    """A valid message of codec ``name`` (made on first use, not at collection: int8 loads bitsandbytes)."""
    return get_codec(name).encode(torch.linspace(-3, 3, _CODEC_NUMEL))


@fuzz(150, name=st.sampled_from(["fp16", "fp32", "int8"]), data=st.data())
def test_codec_decode_of_mutated_messages_only_raises_value_error(name, data):
    message = data.draw(st.one_of(mutated_bytes(_codec_message(name)), st.binary(max_size=64)))
    try:
        out = get_codec(name).decode(message, numel=_CODEC_NUMEL)
    except ValueError:
        return
    assert out.dtype == torch.float32 and out.shape == (_CODEC_NUMEL,) and bool(torch.isfinite(out).all())


# ========================================================================================== averaging wire
AVG_NUMEL = 64
AVG_GROUP = "a1" * 16
_AVG_REASONS = {
    "truncated",
    "oversized header",
    "malformed header",
    "unknown op",
    "unknown group",
    "not a member",
    "wrong slice",
    "wrong codec",
    "wrong pieces",
    "bad size",
    "undecodable part",
    "late part",
    "duplicate part",
    "nudge from a peer not looking",
}


def _valid_part(codec: str) -> tuple[dict, bytes]:
    payload = get_codec(codec).encode(torch.linspace(-1, 1, AVG_NUMEL))
    return (
        {
            "op": "part",
            "group_id": AVG_GROUP,
            "index": 1,
            "numel": AVG_NUMEL,
            "weight": 2.0,
            "codec": codec,
            "pieces": 1,
            "payload_bytes": len(payload),
        },
        payload,
    )


@st.composite
def averaging_streams(draw: Any) -> tuple[str, bytes]:
    codec = draw(st.sampled_from(("fp32", "fp16", "int8")))
    how = draw(st.sampled_from(("random", "part", "part payload", "received", "join", "nudge", "raw")))
    header, payload = _valid_part(codec)
    if how == "random":
        return codec, draw(st.binary(max_size=96))
    if how == "received":
        header, payload = {"op": "received", "group_id": AVG_GROUP, "senders": [OTHER.peer_id, "x"]}, b""
    elif how == "join":
        header, payload = {"op": "join", "gather": {"round": 1}}, b""
    elif how == "nudge":
        header, payload = {"op": "nudge"}, b""
    if how == "part payload":
        return codec, frame(json.dumps(header).encode(), draw(mutated_bytes(payload)))
    if how == "raw":
        return codec, draw(mutated_bytes(frame(json.dumps(header).encode(), payload)))
    body = draw(mutated_json(header)) if draw(st.booleans()) else json.dumps(header).encode()
    return codec, frame(body, payload)


def _bare_averager(codec: str) -> tuple[GroupAverager, _ReduceState]:
    """The server half of a GroupAverager with one open slice to reduce (member 1 of OTHER, OWNER)."""
    averager = object.__new__(GroupAverager)
    averager.config = AveragingConfig(
        matchmaking_time_s=0.1,
        join_timeout_s=0.02,
        sender_timeout_s=0.02,
        agreement_timeout_s=0.02,
        reducer_timeout_s=0.05,
        round_timeout_s=1.0,
        codec=codec,
    )
    averager.rejected, averager.fault_hook, averager._dead = Counter(), None, False
    averager._states, averager._lobbies, averager._state_added = {}, {}, asyncio.Event()
    averager._activity = _Activity(rounds=1)  # in a round: the one of the open slice
    averager._admission = Admission(None, None, 0.0, averager.rejected)
    # drew a leader: a lobby probe is answered; in a window where OTHER is looking: its nudge is taken
    averager._window = _Window(key="fuzz", leader=OTHER.peer_id, looking={OTHER.peer_id})
    averager.peer_id = OWNER.peer_id
    group = Group(group_id=AVG_GROUP, members=(OTHER.peer_id, OWNER.peer_id), gathered={})
    state = _ReduceState(
        group=group,
        my_index=1,
        numel=AVG_NUMEL,
        weight=1.0,
        codec=codec,
        sender_deadline=time.monotonic() + 60,
        pieces=_Pieces([(0, AVG_NUMEL)]),
    )
    state.result.set_result(None)  # the slice "failed": a valid part is answered at once
    averager._states[AVG_GROUP] = state
    return averager, state


@fuzz(200, stream=averaging_streams(), outsider=st.booleans())
@example(stream=("fp32", frame(b"[" * 1200 + b"]" * 1200)), outsider=False)
@example(
    stream=("fp32", frame(canonical_json({**_valid_part("fp32")[0], "weight": 10**400}), _valid_part("fp32")[1])),
    outsider=False,
)
@example(stream=("fp32", frame(canonical_json({"op": "probe", "group_id": AVG_GROUP}))), outsider=False)
@example(stream=("fp32", frame(canonical_json({"op": "probe", "group_id": 5}))), outsider=True)
@example(stream=("fp32", frame(canonical_json({"group_id": "", "lobby": True, "op": "probe"}))), outsider=True)
@example(stream=("fp32", frame(canonical_json({"op": "nudge"}))), outsider=True)
@example(stream=("fp32", frame(canonical_json({"op": "nudge"}))), outsider=False)
def test_averaging_handler_rejects_every_bad_stream_with_one_counted_reason(stream, outsider):
    codec, data = stream

    async def serve() -> tuple[GroupAverager, _ReduceState, FakeWriter]:
        averager, state = _bare_averager(codec)
        writer = FakeWriter()
        peer = SimpleNamespace(peer_id=THIRD.peer_id if outsider else OTHER.peer_id)
        await averager._handle_stream(peer, reader_of(data), writer)
        return averager, state, writer

    averager, state, writer = run_bounded(serve, 1.0 + HANG_MARGIN_S)
    assert "internal error" not in averager.rejected, f"an unclear rejection: {averager.rejected}"
    assert set(averager.rejected) <= _AVG_REASONS, averager.rejected
    accepted = int(bool(state.parts) or bool(state.received_sets))
    not_leading = int(b'"not leading"' in writer.sent)
    # a probe or a looking member's nudge, answered (a part's slice "failed"; a leader's probe hears that this peer
    # drew another leader)
    probed = int(not accepted and (b'"status":"ok"' in writer.sent or b'"status":"another leader"' in writer.sent))
    if b'"op":"nudge"' in data.replace(b" ", b"") and b'"status":"ok"' in writer.sent:
        assert averager._window.wake.is_set() and not outsider, "a nudge was taken from a peer that is not looking"
    assert sum(averager.rejected.values()) + accepted + not_leading + probed == 1, (
        averager.rejected,
        writer.sent[:200],
    )
    assert writer.closed


def _a_join_to_lead() -> tuple[GroupAverager, _Lobby, asyncio.StreamReader, FakeWriter]:
    """A bare averager (OWNER) leading a lobby that expects OTHER, and OTHER's join on a stream it keeps open
    (made inside the running loop)."""
    averager, _ = _bare_averager("fp32")
    lobby = _Lobby(expected=frozenset({OTHER.peer_id}))
    averager._lobbies[OWNER.peer_id] = lobby
    reader = reader_of(frame(canonical_json({"gather": {}, "op": "join"})), eof=False)
    return averager, lobby, reader, FakeWriter()


def test_a_leader_keeps_the_join_stream_open_until_its_follower_has_read_the_group():
    """The leader's answer to a join counts the follower in the group. p2pd resets a stream whose local end
    closed, so closing right after the answer can lose it in flight; the follower, hearing nothing ("join
    failed: truncated", seen once in `make test`), would not come, and the group would wait out its sender
    deadline for its part. The leader holds the stream until the follower hangs up."""

    async def serve() -> tuple[bool, bytes, bool]:
        averager, lobby, reader, writer = _a_join_to_lead()
        handler = asyncio.create_task(averager._handle_stream(PEER, reader, writer))
        while OTHER.peer_id not in lobby.joined:
            await asyncio.sleep(0.01)
        members = tuple(sorted((OTHER.peer_id, OWNER.peer_id)))
        lobby.final.set_result(Group(group_id=AVG_GROUP, members=members, gathered={}))
        while b'"status":"ok"' not in writer.sent:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the follower has not read it yet
        held = not writer.closed and not handler.done()
        reader.feed_eof()  # the follower read the group and hung up
        await handler
        return held, bytes(writer.sent), writer.closed

    held, sent, closed = run_bounded(serve, 5.0)
    assert b'"members"' in sent and held, "the leader closed the stream before its follower had read the group"
    assert closed


def test_a_join_the_leader_stops_waiting_on_is_not_counted_in_a_group_formed_later():
    """A leader's join handler waits for the final group at most ``join_timeout_s + 1``; once it gives up, the
    follower hears nothing, so the lobby must not count it when the group forms after all."""

    async def serve() -> _Lobby:
        averager, lobby, reader, writer = _a_join_to_lead()  # join_timeout_s = 0.02: the handler waits 1.02 s
        await averager._handle_stream(PEER, reader, writer)  # the final group never comes in time
        assert writer.closed and not writer.sent
        return lobby

    lobby = run_bounded(serve, 5.0)
    assert OTHER.peer_id not in lobby.joined and OTHER.peer_id in lobby.quit, (lobby.joined, lobby.quit)


def _valid_reply(codec: str) -> bytes:
    """A reducer's reply to a part of 2 pieces: one tentative piece, ``revised``, both pieces, ``final``."""
    encode, out = get_codec(codec).encode, b""
    pieces = [encode(torch.linspace(-1, 1, AVG_NUMEL // 2)), encode(torch.linspace(1, 2, AVG_NUMEL // 2))]
    for k, data in (0, pieces[0]), ("revised", b""), (0, pieces[0]), (1, pieces[1]):
        header = {"status": "revised"} if k == "revised" else {"status": "piece", "k": k, "payload_bytes": len(data)}
        out += frame(canonical_json(header), data)
    return out + frame(canonical_json({"status": "final"}))


@fuzz(200, codec=st.sampled_from(("fp32", "int8")), data=st.data())
def test_a_senders_read_of_a_reducers_reply_takes_a_valid_one_and_refuses_the_rest_with_a_protocol_error(codec, data):
    """What a reducer sends back (pieces, perhaps revised, then final) is untrusted: a mutated reply ends in a
    ProtocolError (or a truncated stream), never a hang, a crash or a piece out of order or of the wrong size."""
    valid = _valid_reply(codec)
    reply = data.draw(st.one_of(st.just(valid), mutated_bytes(valid), st.binary(max_size=96)))
    bounds, codec_obj = [(0, AVG_NUMEL // 2), (AVG_NUMEL // 2, AVG_NUMEL)], get_codec(codec)

    async def read() -> torch.Tensor:
        return await GroupAverager._read_pieces(
            None, reader_of(reply), AVG_NUMEL, bounds, codec_obj, RoundRecord(round=1)
        )

    try:
        out = run_bounded(read, HANG_MARGIN_S)
    except (ProtocolError, asyncio.IncompleteReadError, ValueError):
        assert reply != valid, "the valid reply was refused"
        return
    assert out.shape == (AVG_NUMEL,) and bool(torch.isfinite(out).all())
    if reply == valid:
        expected = torch.cat([torch.linspace(-1, 1, AVG_NUMEL // 2), torch.linspace(1, 2, AVG_NUMEL // 2)])
        assert (out - expected).abs().max().item() <= 2 * codec_obj.max_abs_error(expected) + 1e-6


@fuzz(100, data=st.one_of(st.binary(max_size=64), mutated_bytes(frame(json.dumps(_valid_part("fp32")[0]).encode()))))
def test_averaging_read_header_raises_only_protocol_errors(data):
    async def read() -> dict:
        return await read_frame(reader_of(data), max_header_bytes=64 * 1024)

    try:
        header = run_bounded(read, HANG_MARGIN_S)
    except ProtocolError as e:
        assert e.reason in ("truncated", "oversized header", "malformed header"), e
    else:
        assert isinstance(header, dict)


# ========================================================================================== group metadata
_BINDING = OTHER.bind(OTHER.peer_id).to_dict()
_GATHER = {
    "round": 3,
    "samples": 64,
    "binding": _BINDING,
    "base": "ab" * 32,
    "t": NOW,
    "sealed": [4, "cd" * 32],
    "fresh": False,
}


@fuzz(150, gathered=st.one_of(json_values, _dict_mutation(_GATHER)))
@example(gathered={**_GATHER, "sealed": [99, "not a digest"]})
@example(gathered={**_GATHER, "t": 2**64})
def test_group_metadata_checks_never_raise(gathered):
    problem = rounds.gathered_problem(OTHER.peer_id, gathered)
    assert problem is None or isinstance(problem, str)
    if problem is None:  # accepted only with a valid binding of this very peer
        binding = PeerBinding.from_dict(gathered["binding"])
        assert binding.peer_id == OTHER.peer_id and binding.is_valid()
    # what the trainer derives from every member's metadata once a round is done must not raise either
    group = Group(
        group_id="g", members=(OTHER.peer_id, OWNER.peer_id), gathered={OTHER.peer_id: gathered, OWNER.peer_id: _GATHER}
    )
    record = RoundRecord(round=3, included=[OTHER.peer_id, OWNER.peer_id])
    agree = rounds.base_agreement_group(group, record, OWNER.peer_id)
    assert agree is None or agree.members == group.members
    assert isinstance(rounds.next_round(3, group.gathered), int)
    # every member builds the same manifest from everyone's metadata: one member's bad values must not make
    # that manifest invalid (it would stop the whole group from sealing, and from swapping receipts)
    seal = rounds.seal_fields(group, 2.5)
    Manifest(
        run_id=RUN,
        step=3,
        round=3,
        task="charlm",
        config_digest="ef" * 32,
        parent=seal.parent,
        shards=(),
        participants=tuple(sorted(seal.participants)),
        metrics=seal.metrics,
        created_at=seal.created_at,
        contributions=seal.contributions,
    )


# ========================================================================================== manifest gossip
def _gossip_verify(data: bytes) -> tuple[str, int]:
    manifest = verify_manifest(data, run_id=RUN, counter=Counter())
    return manifest.digest(), manifest.step


def _bare_gossip() -> ManifestGossip:
    """The receiving half of a ManifestGossip: its handler and checks, with nobody to forward to."""
    gossip = object.__new__(ManifestGossip)
    gossip.dht, gossip.run_id, gossip.verify, gossip.peers = None, RUN, _gossip_verify, lambda: []
    gossip.on_new, gossip.config = (lambda data, digest, step: None), GossipConfig(push_timeout_s=0.5)
    gossip.rejected, gossip.received, gossip.forwarded, gossip.newest = Counter(), 0, 0, None
    gossip._lock, gossip.peer_id = threading.Lock(), OWNER.peer_id
    gossip._forwarding, gossip.duplicates = set(), 0
    gossip.announce, gossip.holders = (lambda data, digest: True), (lambda data: ())  # __init__'s defaults
    return gossip


@fuzz(
    150,
    data=st.one_of(
        st.binary(max_size=64),
        mutated_bytes(frame(MANIFEST_BYTES)),
        mutated_json(json.loads(MANIFEST_BYTES)).map(frame),
        st.integers(MAX_MANIFEST_BYTES + 1, 2**32 - 1).map(lambda n: n.to_bytes(4, "big")),
    ),
)
@example(data=frame(MANIFEST_BYTES))
def test_gossip_handler_counts_every_refusal(data):
    gossip = _bare_gossip()

    async def serve_and_forward() -> None:  # the handler hands an accepted manifest to a forwarding task
        await gossip._serve(PEER, reader_of(data), FakeWriter())
        await asyncio.gather(*list(gossip._forwarding))

    run_bounded(serve_and_forward, 0.5 + HANG_MARGIN_S)
    _assert_accepted_or_refused_once(gossip)


def _assert_accepted_or_refused_once(gossip: ManifestGossip) -> None:
    accepted = int(gossip.newest is not None)
    assert sum(gossip.rejected.values()) + accepted == 1, gossip.rejected
    if accepted:
        assert gossip.newest[0] == _MANIFEST.step


@fuzz(
    150,
    data=st.one_of(
        st.binary(max_size=64),
        mutated_bytes(MANIFEST_BYTES),
        mutated_json(json.loads(MANIFEST_BYTES)),
        st.just(MANIFEST_BYTES + b" " * (MAX_MANIFEST_BYTES + 1 - len(MANIFEST_BYTES))),
    ),
)
@example(data=MANIFEST_BYTES)
def test_gossip_unary_handler_counts_every_refusal(data):
    """The push as one unary message (what peers send now): the same checks, one count per refusal."""
    gossip = _bare_gossip()

    async def serve_and_forward() -> None:
        assert await gossip._serve_unary(data, str(PEER.peer_id)) == b""
        await asyncio.gather(*list(gossip._forwarding))

    run_bounded(serve_and_forward, 0.5 + HANG_MARGIN_S)
    _assert_accepted_or_refused_once(gossip)


# ========================================================================================== shard exchange
_EX_DATA = bytes(range(256)) * 12
_EX_DIGEST = hashlib.sha256(_EX_DATA).hexdigest()
_EX_CONFIG = ExchangeConfig(chunk_bytes=1024, timeout_s=0.5)
_EX_REQUEST = {"digest": _EX_DIGEST, "offset": 1000, "length": 1024}


@st.composite
def exchange_streams(draw: Any) -> bytes:
    frames = []
    for _ in range(draw(st.integers(0, 3))):
        how = draw(st.sampled_from(("valid", "json", "bytes", "random")))
        if how == "valid":
            frames.append(frame(json.dumps(_EX_REQUEST).encode()))
        elif how == "json":
            frames.append(frame(draw(mutated_json(_EX_REQUEST))))
        elif how == "bytes":
            frames.append(draw(mutated_bytes(frame(json.dumps(_EX_REQUEST).encode()))))
        else:
            frames.append(draw(st.binary(max_size=40)))
    return b"".join(frames)


def _bare_shard_server() -> ShardServer:
    server = ShardServer(MemoryShardSource({_EX_DIGEST: _EX_DATA}), _EX_CONFIG, p2p=None)
    server._running = True
    return server


@fuzz(150, data=exchange_streams())
@example(data=frame(b"[" * 1200 + b"]" * 1200))
def test_shard_server_counts_every_refusal_and_serves_good_requests(data):
    server = _bare_shard_server()
    writer = FakeWriter()
    run_bounded(lambda: server._handle(PEER, reader_of(data), writer), _EX_CONFIG.timeout_s + HANG_MARGIN_S)
    assert "internal error" not in server.rejected, f"an unclear rejection: {server.rejected}"
    outcomes = sum(server.rejected.values()) + server.num_chunks_served
    assert (outcomes >= 1) == bool(data), (server.rejected, server.num_chunks_served)
    assert server.bytes_served == 1024 * server.num_chunks_served and writer.closed and server.num_active == 0


_OK_REPLY = {"status": "ok", "size": len(_EX_DATA), "length": 1024}


@fuzz(
    150,
    reply=st.one_of(
        st.binary(max_size=64),
        mutated_json(_OK_REPLY).map(lambda h: frame(h, _EX_DATA[:1024])),
        mutated_bytes(frame(json.dumps(_OK_REPLY).encode(), _EX_DATA[:1024])),
    ),
)
@example(reply=frame(b'{"status":[]}'))
def test_shard_client_reply_parser_fails_only_with_attempt_failed(reply):
    async def ask() -> Any:
        session = _Session(donor="donor", reader=reader_of(reply), writer=FakeWriter())
        return await session.request(_EX_DIGEST, 1000, 1024, 0.5)

    try:
        answer = run_bounded(ask, 0.5 + HANG_MARGIN_S)
    except _AttemptFailed as e:
        assert e.reason in ("malformed", "disconnected", "timeout"), e
        return
    assert answer.status in ("ok", "not found", "busy", "bad request")
    if answer.status == "ok":
        assert isinstance(answer.size, int) and len(answer.data) == 1024


# ========================================================================================== bandwidth probe
_PROBE_CONFIG = ProbeConfig(probe_bytes=512, max_request_bytes=4096, timeout_s=0.5, num_pings=2)
_PROBE_REASONS = {
    "unknown_op",
    "too_large",
    "truncated_header",
    "short_read",
    "timeout",
    "too_many_requests",
    "disconnected",
}
_GOOD_PROBE = b"P" + bytes(8) + b"D" + (512).to_bytes(8, "big") + b"U" + (16).to_bytes(8, "big") + bytes(16)


@fuzz(150, data=st.one_of(st.binary(max_size=80), mutated_bytes(_GOOD_PROBE)))
@example(data=_GOOD_PROBE)
def test_probe_server_ends_every_stream_served_or_with_one_counted_reason(data):
    server = ProbeServer(_PROBE_CONFIG, p2p=None)
    server._running = True
    run_bounded(lambda: server._handle(PEER, reader_of(data), FakeWriter()), _PROBE_CONFIG.timeout_s + HANG_MARGIN_S)
    assert "internal error" not in server.rejected, server.rejected
    assert set(server.rejected) <= _PROBE_REASONS
    assert server.num_served + sum(server.rejected.values()) == 1 and server.num_active == 0


@fuzz(100, reply=st.binary(max_size=120))
def test_probe_client_fails_only_with_probe_error(reply):
    class StubP2P:
        async def call_binary_stream_handler(self, peer: Any, protocol: str) -> Any:
            return None, reader_of(reply), FakeWriter()

    with pytest.raises(ProbeError) as info:  # the nonce is random: no random reply echoes it
        run_bounded(lambda: _probe(StubP2P(), OTHER.peer_id, _PROBE_CONFIG), _PROBE_CONFIG.timeout_s + HANG_MARGIN_S)
    assert info.value.reason in ("refused", "malformed", "disconnected")


# ========================================================================================== /metrics
_GOOD_SCRAPE = b"GET /metrics?name[]=swarm_fuzz_gauge HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n"
_METRICS_READ_S = 5.0


@pytest.fixture(scope="module")
def metrics_server() -> Any:
    from prometheus_client import CollectorRegistry, Gauge

    from bootstrap.metrics import serve_metrics

    registry = CollectorRegistry()
    Gauge("swarm_fuzz_gauge", "a gauge the scrapes read", registry=registry).set(7)
    with serve_metrics(registry, port=0) as server:
        yield server


def _http(port: int, request: bytes) -> bytes:
    """The whole answer to ``request`` on a fresh connection (the client then closes its side, so a half-sent
    request ends at once and the server's 10 s client timeout never runs); a hang fails the caller."""
    with socket.create_connection(("127.0.0.1", port), timeout=_METRICS_READ_S) as conn:
        conn.sendall(request)
        conn.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@fuzz(100, request=st.one_of(st.binary(max_size=200), mutated_bytes(_GOOD_SCRAPE)))
@example(request=_GOOD_SCRAPE)
def test_the_metrics_endpoint_ends_every_garbage_request_and_still_serves(metrics_server, request):
    """Anyone who reaches a peer's `--metrics-port` may send anything: each request is answered or closed within
    a bound (no hang: `_http` times out), and the next valid scrape still reads the gauge."""
    answer = _http(metrics_server.port, request)
    # a request line without a version is HTTP/0.9: its answer (an error page, or the metrics) has no status line
    event("closed" if not answer else "an HTTP/1 response" if answer.startswith(b"HTTP/") else "an HTTP/0.9 answer")
    scrape = _http(metrics_server.port, _GOOD_SCRAPE)
    assert scrape.startswith(b"HTTP/1.0 200") and b"swarm_fuzz_gauge 7.0" in scrape, scrape[:200]


# ========================================================================================== live handlers
@pytest.fixture(scope="module")
def live_dhts():
    dhts = [start_dht(host_maddrs=LOOPBACK, nat_port_map=False)]
    try:
        dhts.append(start_dht(visible_maddrs(dhts[0]), host_maddrs=LOOPBACK, nat_port_map=False))
        yield dhts
    finally:
        for dht in reversed(dhts):
            stop_dht(dht)


def run_with_replica(dht: Any, scenario: Any) -> Any:
    """Run ``scenario(p2p)`` in a fresh event loop with its own replica of ``dht``'s P2P."""

    async def main() -> Any:
        p2p = await open_p2p_replica(dht)
        try:
            return await scenario(p2p)
        finally:
            await p2p.shutdown()

    return asyncio.run(main())


async def send_raw(
    p2p: Any, peer_id: str, handler: str, data: bytes, *, hang_up: bool, bound_s: float
) -> tuple[bytes, float]:
    """Open a stream to ``handler`` and send ``data``. With ``hang_up``, close at once; otherwise wait
    (at most ``bound_s``) for the server's first reply bytes or its end of the stream, then close.
    Returns (what was read, seconds until then)."""
    started = time.monotonic()
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), handler)
    reply = b""
    try:
        writer.write(data)
        await writer.drain()
        if not hang_up:
            reply = await asyncio.wait_for(reader.read(1 << 16), bound_s)
    finally:
        writer.close()
    return reply, time.monotonic() - started


def moved(counter: Counter, before: Counter, reasons: tuple[str, ...], timeout_s: float = 5.0) -> str:
    """Wait until one of ``reasons`` was counted once more; return it."""

    def which() -> str | None:
        return next((r for r in reasons if counter[r] > before[r]), None)

    return wait_until(which, timeout_s, message=lambda: f"one of {reasons} to be counted (now {dict(counter)})")


async def send_cases(p2p: Any, peer_id: str, handler: str, counter: Counter, cases: list, bound_s: float) -> None:
    """Send each case (data, hang up at once, reasons one of which must be counted); all within bounds."""
    for data, hang_up, reasons in cases:
        before = counter.copy()
        _, elapsed_s = await send_raw(p2p, peer_id, handler, data, hang_up=hang_up, bound_s=bound_s)
        await asyncio.to_thread(moved, counter, before, reasons)
        assert elapsed_s < bound_s, (reasons, elapsed_s)
        assert sum(counter.values()) == sum(before.values()) + 1, (reasons, counter, before)


@pytest.mark.timeout(60)
def test_live_gossip_handler_survives_garbage_and_still_takes_a_sealed_manifest(live_dhts):
    config = GossipConfig(push_timeout_s=1.0, pull_interval_s=300.0)
    gossip = ManifestGossip(live_dhts[0], run_id=RUN, verify=_gossip_verify, peers=lambda: [], config=config)
    handler = f"swarm.gossip.v1.{RUN}"
    cases = [  # (what is sent, hang up at once, the reasons one of which must be counted)
        ((MAX_MANIFEST_BYTES + 1).to_bytes(4, "big"), False, ("oversized",)),
        (frame(b"\x00garbage\xff" * 10), False, ("manifest rejected",)),
        (frame(MANIFEST_BYTES.replace(b'"step":5', b'"step":' + b"5" * 5000)), False, ("manifest rejected",)),
        (frame(b"[" * 1200 + b"]" * 1200), False, ("manifest rejected",)),
        ((1000).to_bytes(4, "big") + b"x" * 10, False, ("truncated",)),  # then silent: cut off at push_timeout_s
        ((1000).to_bytes(4, "big") + b"x" * 10, True, ("truncated",)),  # the sender hangs up mid-frame
    ]
    try:

        async def scenario(p2p: Any) -> None:
            await send_cases(
                p2p, gossip.peer_id, handler, gossip.rejected, cases, config.push_timeout_s + HANG_MARGIN_S
            )
            assert gossip.newest is None and gossip.received == 3
            await send_raw(p2p, gossip.peer_id, handler, frame(MANIFEST_BYTES), hang_up=False, bound_s=HANG_MARGIN_S)

        run_with_replica(live_dhts[1], scenario)
        wait_until(lambda: gossip.newest is not None, 5.0, message="the sealed manifest to be taken")
        assert gossip.newest[0] == _MANIFEST.step and sum(gossip.rejected.values()) == len(cases)
    finally:
        gossip.close()


@pytest.mark.timeout(60)
def test_live_shard_server_survives_garbage_and_still_serves(live_dhts):
    config = ExchangeConfig(chunk_bytes=1024, timeout_s=1.0)
    exchange = ShardExchange(live_dhts[0], MemoryShardSource({_EX_DIGEST: _EX_DATA}), config)
    rejected = exchange.server.rejected
    cases = [
        (b"\xff\xff\xff\xff" + b"garbage", False, ("oversized header",)),  # a header length over the limit
        (frame(b"[" * 1200 + b"]" * 1200), False, ("malformed header",)),
        (frame(b'{"digest": 7}'), False, ("bad digest",)),
        (frame(json.dumps({**_EX_REQUEST, "offset": 10**300}).encode()), False, ("bad range",)),
        ((100).to_bytes(4, "big") + b"{" * 10, True, ("truncated", "disconnected")),
        (b"", False, ("timeout",)),  # a silent client: cut off at timeout_s
    ]
    try:

        async def scenario(p2p: Any) -> None:
            await send_cases(p2p, exchange.peer_id, SHARDS_PROTOCOL, rejected, cases, config.timeout_s + HANG_MARGIN_S)
            reply = await request_chunk(
                p2p, exchange.peer_id, digest=_EX_DIGEST, offset=1000, length=1024, timeout_s=5.0
            )
            assert reply.status == "ok" and reply.data == _EX_DATA[1000:2024]

        run_with_replica(live_dhts[1], scenario)
        assert "internal error" not in rejected and sum(rejected.values()) == len(cases), rejected
        # the server counts a chunk once its write is done, which may be after the client read the reply
        wait_until(lambda: exchange.server.num_chunks_served >= 1, 5.0, message="the served chunk to be counted")
        assert exchange.server.num_chunks_served == 1
    finally:
        exchange.close()


@pytest.mark.timeout(90)
def test_live_averaging_handler_survives_garbage_and_still_averages(live_dhts, caplog):
    config = AveragingConfig(
        matchmaking_time_s=1.0,
        join_timeout_s=2.0,
        sender_timeout_s=1.0,
        reducer_timeout_s=3.0,
        agreement_timeout_s=0.5,
        round_timeout_s=20.0,
        target_group_size=2,
        aggregator="mean",
        codec="fp32",
    )
    prefix = f"fuzz{uuid.uuid4().hex[:8]}"
    averagers = [GroupAverager(dht, prefix=prefix, config=config) for dht in live_dhts]
    target, handler = averagers[0], averagers[0]._handler_name
    part = {
        "op": "part",
        "group_id": "no-such-group",
        "index": 0,
        "numel": 4,
        "weight": 1.0,
        "codec": "fp32",
        "pieces": 1,
        "payload_bytes": 16,
    }
    cases = [
        (frame(b"{oops"), False, ("malformed header",)),
        (b"\x7f\xff\xff\xff", False, ("oversized header",)),
        (frame(b"[" * 1200 + b"]" * 1200), False, ("malformed header",)),
        (frame(b'{"op": "steal"}'), False, ("unknown op",)),
        (frame(json.dumps(part).encode()) + bytes(16), False, ("unknown group",)),
        ((50).to_bytes(4, "big") + b"{}", True, ("truncated",)),
    ]
    bound_s = config.sender_timeout_s + config.agreement_timeout_s + HANG_MARGIN_S
    try:

        async def scenario(p2p: Any) -> float:
            await send_cases(p2p, target.peer_id, handler, target.rejected, cases, bound_s)
            reply, silent_s = await send_raw(p2p, target.peer_id, handler, b"", hang_up=False, bound_s=bound_s)
            assert reply == b""  # the server hung up on a silent sender ...
            return silent_s

        with caplog.at_level(logging.DEBUG, logger="averaging.group"):
            silent_s = run_with_replica(live_dhts[1], scenario)
            assert config.sender_timeout_s - 0.5 < silent_s < bound_s  # ... at sender_timeout_s, and said why
            wait_until(
                lambda: any("ended" in r.getMessage() and "TimeoutError" in r.getMessage() for r in caplog.records),
                5.0,
                message="the silent stream's logged reason",
            )
        assert "internal error" not in target.rejected and sum(target.rejected.values()) == len(cases)

        # the service still averages: a real round between the two peers gives the weighted mean
        tensors = [torch.linspace(-1, 1, 1000), torch.linspace(3, 5, 1000)]
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda i: averagers[i].step(tensors[i], weight=float(i + 1)), range(2)))
        expected = (tensors[0] * 1 + tensors[1] * 2) / 3
        for averaged, record, _ in results:
            assert averaged is not None, record.failures
            torch.testing.assert_close(averaged, expected, rtol=0, atol=1e-5)
    finally:
        for averager in averagers:
            averager.close()


def test_the_mutators_do_mutate():
    """A fuzzer that fed only valid input would pass anything: the mutations reach the nasty tokens."""
    quiet = settings(
        database=None, max_examples=500, derandomize=True
    )  # a random search missed one token in a clean run
    assert find(mutated_bytes(b"abcdef"), lambda d: d != b"abcdef", settings=quiet) != b"abcdef"
    assert b"1" * 5000 in find(mutated_json({"a": [1]}), lambda d: b"1" * 5000 in d, settings=quiet)
    assert find(mutated_json({"a": [1]}), lambda d: b"[" * 1200 in d, settings=quiet)
