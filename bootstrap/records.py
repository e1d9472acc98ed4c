"""Signed capability records: what one peer can do, as published in the DHT.

A record lives under one of the :data:`PEERS_SHARDS` DHT keys :data:`PEERS_KEYS`, the one `peers_key` picks
from the peer's ID, with the peer's own peer ID as subkey. Its value
is ``{"p": payload, "s": signature}``: ``payload`` is canonical JSON (sorted keys, ints and strings
only), ``signature`` is the peer's Ed25519 signature over it (domain ``swarm/record``). The peer ID is
derived from the public key inside the payload, so a record is accepted only when

* the signature verifies, and the public key derives the payload's peer ID, and the subkey is it;
* it is not expired, not issued in the future, and lives at most :data:`MAX_LIFETIME_S`;
* it is at most :data:`MAX_RECORD_BYTES` and matches the schema exactly (no missing or extra field);
* it is stored under its own shard's key (`peers_key`).

Why shards: with one key, the few nodes nearest it answer every capability query and every record
refresh of the whole network with all of its records (a store's traversal is answered with the value
too), so their load grows with the network. Spread over 16 keys, a refresh is answered with a
sixteenth of the records, and the load of queries falls on 16 neighbourhoods of the DHT. A query reads
all the shards in one traversal (`bootstrap.dhtcalls.latest_many_within`).

:class:`PeerRecordValidator` applies the same rules inside every Swarm DHT node, on store and on
get, so no peer can overwrite, withdraw or replay another peer's record: only the key's owner can
sign a record for its subkey, and a replayed old record loses to the newer one (later expiry) or
is refused outright once expired.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration

from bootstrap.envelope import RejectionLog, from_dict, unwrap_signed
from bootstrap.errors import Rejected
from bootstrap.identity import Identity, canonical_json, peer_id_from_public_key, verify

logger = logging.getLogger(__name__)

PEERS_SHARDS = 16
"""How many DHT keys the capability records are spread over (by the hash of the peer ID)."""
PEERS_KEYS = tuple(f"swarm/peers/{shard:x}" for shard in range(PEERS_SHARDS))
"""Every capability-record key: a complete query reads them all."""
RECORD_KIND = "swarm/record"
RECORD_VERSION = 1
MAX_RECORD_BYTES = 8192
MAX_LIFETIME_S = 300
CLOCK_SKEW_S = 30
STATES = ("joining", "training", "idle", "left")
REACHABILITY = ("public", "private", "relayed", "client-only")


class RecordRejected(Rejected):
    """A capability record failed validation; ``reason`` is a short, countable label."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """What the machine has; memory in bytes."""

    accelerator: str
    """cpu or cuda."""
    name: str
    """Accelerator name (GPU model, or the CPU model on CPU peers)."""
    count: int
    """Number of accelerators (CPU peers: 1)."""
    memory_total_bytes: int
    """Accelerator memory (CPU peers: RAM)."""
    memory_free_bytes: int
    """Free accelerator memory (CPU peers: available RAM)."""
    bf16: bool
    """bf16 compute supported."""
    fp16: bool
    """fp16 compute supported."""
    cpu_model: str
    """CPU model name."""
    cpu_cores: int
    """Logical CPU cores."""
    ram_total_bytes: int
    """System RAM."""
    ram_available_bytes: int
    """Available system RAM."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Software:
    """Versions of what the peer runs."""

    python: str
    torch: str
    cuda: str
    hivemind: str
    swarm: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Performance:
    """Measured figures (integers, so that the signed payload never holds a float)."""

    samples_per_s_milli: int
    """Training throughput on the run's task, in thousandths of a sample per second (0: not measured yet)."""
    upload_kbps: int | None
    """Median measured upload bandwidth to probed peers, kbit/s."""
    download_kbps: int | None
    """Median measured download bandwidth from probed peers, kbit/s."""
    rtt_us: int | None
    """Median round-trip time to probed peers, microseconds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Network:
    """How to reach the peer."""

    reachability: str
    """public, private (LAN/loopback only), relayed or client-only."""
    maddrs: tuple[str, ...]
    """Multiaddrs the peer listens on or announces."""
    region: str | None
    """Free-form region label (--region), or None."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Trust:
    """Signals of reliability, as claimed by the peer (later checked against receipts)."""

    uptime_s: int
    rounds_completed: int
    checkpoints_cosigned: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Requirements:
    """What a run asks of a peer that joins it."""

    min_memory_bytes: int
    """Free accelerator memory (or available RAM on CPU peers) needed."""
    dtype: str
    """fp32, or bf16 (the peer must support it)."""
    min_swarm_version: str
    """Oldest swarm version that may join."""
    min_torch_version: str
    """Oldest torch version that may join."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunInfo:
    """The run a peer trains, as advertised by that peer."""

    name: str
    task: str
    task_preset: str
    config_digest: str
    """SHA-256 of the task's config; peers of one run must agree on it."""
    requirements: Requirements
    round: int
    step: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerRecord:
    """One peer's signed capability record (the payload; the signature travels beside it)."""

    v: int
    peer_id: str
    public_key: str
    """Ed25519 public key, hex."""
    issued_at: int
    """Unix seconds."""
    expires_at: int
    """Unix seconds; readers drop the record after this."""
    seq: int
    """Increases with every record the peer publishes."""
    state: str
    """joining, training, idle or left (a withdrawn record)."""
    run: RunInfo | None
    hardware: Hardware
    software: Software
    perf: Performance
    network: Network
    available_until: int | None
    """Declared availability, unix seconds; None: until stopped."""
    trust: Trust

    def payload(self) -> bytes:
        return canonical_json(dataclasses.asdict(self))

    def is_live(self, now: float | None = None) -> bool:
        return self.state != "left" and (now if now is not None else time.time()) < self.expires_at


def peers_key(peer_id: str) -> str:
    """The key of ``peer_id``'s capability record: one of :data:`PEERS_KEYS`, by the SHA-256 of the ID."""
    digest = hashlib.sha256(peer_id.encode()).digest()
    return PEERS_KEYS[int.from_bytes(digest[:4], "big") % PEERS_SHARDS]


def sign_record(record: PeerRecord, identity: Identity) -> dict[str, bytes]:
    """The DHT value for ``record``: payload plus its signature."""
    if record.peer_id != identity.peer_id or record.public_key != identity.public_key.hex():
        raise ValueError("a record can only be signed by the key of the peer it describes")
    payload = record.payload()
    if len(payload) + 64 > MAX_RECORD_BYTES:
        raise ValueError(f"record is {len(payload)} bytes, above the {MAX_RECORD_BYTES}-byte limit")
    return {"p": payload, "s": identity.sign(kind=RECORD_KIND, run_id="", payload=payload)}


def parse_record(subkey: Any, value: Any, *, now: float | None = None) -> PeerRecord:
    """Validate an untrusted (subkey, value) pair from the DHT; raise RecordRejected with the reason."""
    now = time.time() if now is None else now
    payload, signature = unwrap_signed(value, max_bytes=MAX_RECORD_BYTES, rejected=RecordRejected)
    try:
        data = json.loads(payload)
        record = from_dict(PeerRecord, data, "record")
    except (ValueError, TypeError, RecursionError) as e:
        raise RecordRejected("malformed", str(e)[:200]) from None
    if record.v != RECORD_VERSION:
        raise RecordRejected("version", f"v={record.v}")
    if canonical_json(data) != payload:  # the same bytes as record.payload(): from_dict took data field for field
        raise RecordRejected("malformed", "payload is not canonical")
    try:
        public_key = bytes.fromhex(record.public_key)
        derived = peer_id_from_public_key(public_key)
    except ValueError:
        raise RecordRejected("malformed", "bad public key") from None
    if derived != record.peer_id or subkey != record.peer_id:
        raise RecordRejected("peer id mismatch", f"subkey {str(subkey)[:60]!r}, record {record.peer_id!r}")
    if not verify(public_key=public_key, kind=RECORD_KIND, run_id="", payload=payload, signature=signature):
        raise RecordRejected("bad signature", record.peer_id)
    _check_times(record, now)
    _check_enums(record)
    return record


def verified_records(
    found: Mapping[str, Any], *, now: float, on_rejected: Callable[[RecordRejected, Any], None]
) -> list[PeerRecord]:
    """The verified records in ``found``, the untrusted result of a DHT read of :data:`PEERS_KEYS`
    (key -> None, or a dictionary value), withdrawn (``left``) ones included; each refusal (a record
    under another shard's key included) goes to ``on_rejected``. Each peer comes once: a subkey is
    unique within a key, and a record counts only under its own shard's key."""
    records = []
    for key, result in found.items():
        if result is None or not isinstance(getattr(result, "value", None), dict):
            continue
        for subkey, item in result.value.items():
            value = item.value if isinstance(item, ValueWithExpiration) else item
            try:
                record = parse_record(subkey, value, now=now)
                _check_shard(record, key)
            except RecordRejected as e:
                on_rejected(e, subkey)
                continue
            records.append(record)
    return records


def live_records(
    found: Mapping[str, Any], *, run: str | None, now: float, on_rejected: Callable[[RecordRejected, Any], None]
) -> list[PeerRecord]:
    """The live records (of ``run``'s peers, if given) among :func:`verified_records`."""
    return [r for r in verified_records(found, now=now, on_rejected=on_rejected) if _wanted(r, run, now)]


def _wanted(record: PeerRecord, run: str | None, now: float) -> bool:
    return record.is_live(now) and (run is None or (record.run is not None and record.run.name == run))


class RecordBook:
    """The newest verified record of each peer a reader has seen, kept until its own signed expiry.

    Why: one DHT read can miss a record that is live. A holder may have missed the record's last
    store, or answer from a partial cached copy of the shard (hivemind's ``rpc_find`` prefers its cache
    when the cache's latest entry expires later), or be dropped whole by the reader because one entry of
    its dictionary failed validation. At 100 peers one read in ten missed a record whose refresh was in
    flight (benchmarks/README.md section 12).

    Why it is sound: a record certifies itself (the peer's signature over its content and its own
    expiry); the DHT only carries it. Holding it until ``expires_at`` shows nothing a DHT holder would
    not have served. The newer of two records of one peer is the one that expires later (the DHT's own
    rule; the advertiser makes each record outlive the previous one, its withdrawal included), so a
    signed ``left`` record hides the peer at once, a replayed older record changes nothing, and a dead
    peer vanishes when its last record expires, as it would from the DHT.
    """

    def __init__(self, max_records: int = 100_000):
        self.max_records = max_records
        self._records: dict[str, PeerRecord] = {}

    def add(self, records: Iterable[PeerRecord], *, now: float) -> None:
        """Keep each of ``records`` (verified) that is newer than what is held of its peer; drop the expired."""
        for record in records:
            held = self._records.get(record.peer_id)
            if held is None or (record.expires_at, record.seq) > (held.expires_at, held.seq):
                self._records[record.peer_id] = record
        self._records = {p: r for p, r in self._records.items() if r.expires_at > now}
        if len(self._records) > self.max_records:  # a flood of identities: keep those that live longest
            kept = sorted(self._records.values(), key=lambda r: r.expires_at)[-self.max_records :]
            self._records = {r.peer_id: r for r in kept}

    def live(self, *, run: str | None, now: float) -> list[PeerRecord]:
        """The held records that are live (of ``run``'s peers, if given)."""
        return [r for r in self._records.values() if _wanted(r, run, now)]

    def read(
        self, found: Mapping[str, Any], *, run: str | None, on_rejected: Callable[[RecordRejected, Any], None]
    ) -> list[PeerRecord]:
        """Add the verified records of ``found`` (as :func:`verified_records` takes it); the live records
        held now (of ``run``'s peers, if given)."""
        now = time.time()
        self.add(verified_records(found, now=now, on_rejected=on_rejected), now=now)
        return self.live(run=run, now=now)


def _check_shard(record: PeerRecord, key: str) -> None:
    if peers_key(record.peer_id) != key:
        raise RecordRejected("wrong shard", f"{record.peer_id} belongs under {peers_key(record.peer_id)}, not {key}")


def _check_times(record: PeerRecord, now: float) -> None:
    if record.expires_at <= now:
        raise RecordRejected("expired", f"{now - record.expires_at:.0f} s ago")
    if record.issued_at > now + CLOCK_SKEW_S:
        raise RecordRejected("from the future", f"issued {record.issued_at - now:.0f} s ahead")
    if not 0 < record.expires_at - record.issued_at <= MAX_LIFETIME_S:
        raise RecordRejected("bad lifetime", f"{record.expires_at - record.issued_at} s")


def _check_enums(record: PeerRecord) -> None:
    if record.state not in STATES:
        raise RecordRejected("malformed", f"state {record.state!r}")
    if record.network.reachability not in REACHABILITY:
        raise RecordRejected("malformed", f"reachability {record.network.reachability!r}")
    if record.run is not None and record.run.requirements.dtype not in ("fp32", "bf16"):
        raise RecordRejected("malformed", f"dtype {record.run.requirements.dtype!r}")


@functools.cache
def capability_key_ids() -> dict[bytes, str]:
    """Each of :data:`PEERS_KEYS` by its DHT id (as a validator sees a record's key)."""
    return {DHTID.generate(source=key).to_bytes(): key for key in PEERS_KEYS}


def record_rejections() -> RejectionLog:
    """A fresh count of rejected capability records by reason (each logged once per reason and peer)."""
    return RejectionLog("capability record", routine=frozenset({"expired"}))


class PeerRecordValidator(RecordValidatorBase):
    """Enforces :func:`parse_record` inside the DHT for the :data:`PEERS_KEYS`, each record under its own
    shard's key; other keys pass through.

    Also refuses a record whose DHT expiration outlives the signed ``expires_at``, so a valid record
    cannot be kept alive past its own expiry.
    """

    def __init__(self, cache_size: int = 4096) -> None:
        self._keys = capability_key_ids()
        self.rejections = record_rejections()
        self.cache_size = cache_size
        self._parsed: OrderedDict[tuple[bytes, bytes, bytes], PeerRecord] = OrderedDict()
        """Records that passed every check but the clock, by (key, subkey, value): a reader gets each record
        from several holders, and each holder gets it again with every replica's store."""

    def validate(self, record: DHTRecord) -> bool:
        key = self._keys.get(record.key)
        if key is None:
            return True
        subkey: Any = "?"
        try:
            cache_key = (record.key, record.subkey, record.value)
            parsed = self._parsed.get(cache_key)
            if parsed is None:
                subkey = MSGPackSerializer.loads(record.subkey)
                value = MSGPackSerializer.loads(record.value)
                parsed = parse_record(subkey, value)
                _check_shard(parsed, key)
                self._remember(cache_key, parsed)
            else:
                subkey = parsed.peer_id
                self._parsed.move_to_end(cache_key)
                _check_times(parsed, time.time())
            if not record.expiration_time <= parsed.expires_at + 1:  # NaN too: it would never expire in storage
                raise RecordRejected("outlives its expiry", f"{record.expiration_time - parsed.expires_at:.0f} s")
        except RecordRejected as e:
            self.rejections.reject(e, where="DHT", source=subkey)
            return False
        except Exception as e:  # msgpack raises many types on garbage
            self.rejections.reject(RecordRejected("malformed", repr(e)[:200]), where="DHT", source=subkey)
            return False
        return True

    def _remember(self, cache_key: tuple[bytes, bytes, bytes], parsed: PeerRecord) -> None:
        self._parsed[cache_key] = parsed
        if len(self._parsed) > self.cache_size:
            self._parsed.popitem(last=False)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, PeerRecordValidator)


async def _rejections_in_node(_dht: Any, node: Any, kind: type) -> dict[str, int]:
    validator = node.protocol.record_validator
    # hivemind wraps several validators in a CompositeValidator; look inside it
    for candidate in getattr(validator, "_validators", [validator]):
        if isinstance(candidate, kind):
            return dict(candidate.rejections.counts)
    return {}


def validator_rejections(dht: Any, kind: type, *, timeout_s: float = 10.0) -> dict[str, int]:
    """What this DHT node's validator of class ``kind`` (one with a ``rejections`` RejectionLog) refused,
    on store or on get, by reason; {} if the node has none."""
    coroutine = functools.partial(_rejections_in_node, kind=kind)
    return dht.run_coroutine(coroutine, return_future=True).result(timeout=timeout_s)


def dht_record_rejections(dht: Any, *, timeout_s: float = 10.0) -> dict[str, int]:
    """Capability records that this DHT node's validator refused (on store or on get), by reason."""
    return validator_rejections(dht, PeerRecordValidator, timeout_s=timeout_s)
