"""The status board: each peer publishes a small signed status; anyone reads the run's board.

Publication. Every peer of run ``RUN`` keeps one entry under the DHT key ``swarm/RUN/status``
(:func:`status_key`) with its own peer ID as subkey. The value is ``{"p": payload, "s": signature}``:
``payload`` is canonical JSON (:func:`bootstrap.identity.canonical_json`, ints and strings only) of ::

    {"v": 1, "peer": PEER_ID, "run": RUN, "t": unix_s, "state": str, "round": int, "step": int,
     "samples_per_s_milli": int, "loss_milli": int | null, "val_loss_milli": int | null,
     "last_group": {"group_id": str, "members": [PEER_ID, ...], "outcome": str, "duration_ms": int,
                    "bytes_sent": int, "bytes_received": int} | null,
     "events": [{"t": unix_s, "kind": str, "detail": str}, ...],       # at most 16, detail <= 200 chars
     "work": {"checks": int, "passed": int, "failed": int, "refused": int, "excluded": [PEER_ID, ...]} | null}

(``work``: the peer's verified-work checks, `swarm.work`; null when it does not verify work)
and ``signature`` is the peer's Ed25519 signature of it (kind ``swarm/status``, run id ``RUN``).
:class:`StatusPublisher` refreshes the entry every ``refresh_s`` and soon after every noted event;
the entry expires ``expiry_s`` after it was stored, so a dead peer's status vanishes by itself.

Reading. Entries are untrusted: :func:`parse_status` accepts one only if it has exactly the fields
above with their types and sizes, is canonical, names this run and the subkey's peer, carries a
valid signature by the key inside that peer ID, and is not from the future. Every refusal is
counted by reason in the reader's counter and logged once per (reason, peer).

Snapshot. :func:`snapshot` joins the capability records (:class:`peers.ResourceGraph`), the status
entries and the newest sealed checkpoint of the run's manifest index into one JSON-able dict
(``schema_version`` :data:`SCHEMA_VERSION`; times are unix seconds, ``null`` means unknown)::

    {"schema_version": 2, "run": str, "t": float, "heartbeat_s": float,
     "peers": [{"peer": str, "state": str, "round": int|null, "step": int|null,
                "samples_per_s": float|null, "loss": float|null, "val_loss": float|null,
                "device": {"accelerator": str, "name": str, "count": int, "memory_total_bytes": int}|null,
                "region": str|null, "record_age_s": float|null, "status_age_s": float|null,
                "heartbeat_missed": bool,
                "work": {"checks": int, "passed": int, "failed": int, "refused": int, "excluded": [str]}|null},
               ...],                                                             # sorted by peer
     "groups": [{"group_id": str, "round": int, "members": [str], "outcome": str, "duration_s": float,
                 "bytes_sent": int, "bytes_received": int, "reported_by": [str]}, ...],  # newest first
     "progress": {"round": int|null, "step": int|null, "loss": float|null, "val_loss": float|null,
                  "samples_per_s": float, "num_peers": int},
     "checkpoint": {"step": int, "round": int, "digest": str, "signers": [str], "participants": [str],
                    "metrics": {str: int}, "created_at": int, "announced_by": int} | null,
     "events": [{"t": int, "peer": str, "kind": str, "detail": str, "source": "peer"|"observer"}, ...],
     "rejected": {reason: int}, "errors": [str]}

``peers`` is every peer with a live capability record in the run or a valid status (status figures
win over the record's; ``heartbeat_missed``: the status is older than 2 ``heartbeat_s``). ``groups``
is every peer's last group, one entry per group id (bytes summed over the members that reported it,
``round`` the newest round they report). ``progress`` takes the maximum round and step and the loss
and validation loss of the most advanced peer that reports one. ``events`` (newest first, at most
30) merges the peers' own events with those observed by comparing with the ``previous`` snapshot:
``peer joined``, ``heartbeat missed`` (a record or status vanished or went stale), ``peer left``,
``group re-formed`` (a peer's new group has other members than its last one) and ``checkpoint
sealed`` (a newer sealed step). ``rejected`` counts the status entries refused in this snapshot;
``errors`` says which part of the board could not be read (e.g. a DHT timeout).

CLI: ``python -m swarm.status --initial-peers MADDR... --run NAME [--once] [--json] [--refresh-s 2]``
joins the DHT as a client and prints one snapshot (``--once``; ``--json`` for scripts) or runs a live
dashboard until Ctrl+C or SIGTERM (with ``--json``: one JSON line per refresh).
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import math
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hivemind import DHT
from hivemind.utils.timed_storage import ValueWithExpiration

from bootstrap import DHTStartError, StopSignal, parse_initial_peers, stop_dht
from bootstrap.dhtcalls import latest_within
from bootstrap.envelope import INT64_MAX, JsonFields, Signable, check_int, check_str, expect_keys, unwrap_signed
from bootstrap.errors import Rejected
from bootstrap.heartbeat import Heartbeat
from bootstrap.identity import Identity, verify
from bootstrap.records import PeerRecord
from peers.graph import ResourceGraph
from swarm.checkpoint.gossip import index_key
from swarm.checkpoint.manifest import ManifestRejected, SignedManifest, public_key_from_peer_id, verify_manifest

logger = logging.getLogger("swarm.status")  # the same name when run as __main__

STATUS_KIND = "swarm/status"
STATUS_VERSION = 2
"""2: the ``work`` field (verified-work checks) joined the payload."""
SCHEMA_VERSION = 2
"""2: each peer's ``work`` (its verified-work checks)."""
MAX_STATUS_BYTES = 16384
"""Payload plus signature; a status above this is refused by readers (and never published)."""
MAX_EVENTS = 16
MAX_DETAIL_CHARS = 200
MAX_KIND_CHARS = 64
MAX_GROUP_MEMBERS = 128
CLOCK_SKEW_S = 30
MAX_STATUS_AGE_S = 900
"""A status signed longer ago than this is a replay (live peers refresh every ``refresh_s``)."""
MIN_PUBLISH_INTERVAL_S = 2.0
"""Bursts of noted events are coalesced into at most one publication per this interval (every DHT store
is ~20 KB of traversal for a ~700-byte entry: at 0.5 s a peer published after every round)."""
DEFAULT_HEARTBEAT_S = 15.0
MAX_TIMELINE_EVENTS = 30
MAX_GROUPS = 32
SNAPSHOT_FIELDS = frozenset(
    {"state", "round", "step", "samples_per_s_milli", "loss_milli", "val_loss_milli", "last_group", "work"}
)
"""The keys a publisher's ``snapshot()`` callback returns (the payload less v, peer, run, t, events)."""

_LOGGED: set[tuple[str, str]] = set()
_MAX_ID_CHARS = 128
_MAX_STATE_CHARS = 32
_PAYLOAD_KEYS = frozenset({"v", "peer", "run", "t", "events"}) | SNAPSHOT_FIELDS
_GROUP_KEYS = frozenset({"group_id", "members", "outcome", "duration_ms", "bytes_sent", "bytes_received"})
_EVENT_KEYS = frozenset({"t", "kind", "detail"})
_WORK_KEYS = frozenset({"checks", "passed", "failed", "refused", "excluded"})


def status_key(run: str) -> str:
    """The DHT key of run ``run``'s status board."""
    return f"swarm/{run}/status"


def milli(value: float | None) -> int | None:
    """``value`` in integer thousandths (signed payloads hold no floats); None for None, NaN or inf."""
    if value is None or not math.isfinite(value):
        return None
    return max(-INT64_MAX, min(INT64_MAX, round(value * 1000)))


# ------------------------------------------------------------------------------------------ schema
@dataclass(frozen=True, kw_only=True, slots=True)
class StatusEvent(JsonFields):
    """Something a peer noted about itself (joined, checkpoint sealed, failure, ...)."""

    t: int
    """When it happened, unix seconds."""
    kind: str
    """Short label, e.g. ``"joined"`` or ``"group re-formed"``."""
    detail: str = ""
    """Free text, at most :data:`MAX_DETAIL_CHARS` characters."""

    def __post_init__(self) -> None:
        check_int("event t", self.t)
        check_str("event kind", self.kind, max_chars=MAX_KIND_CHARS, allow_empty=False, printable=True)
        check_str("event detail", self.detail, max_chars=MAX_DETAIL_CHARS, allow_empty=True, printable=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class LastGroup(JsonFields):
    """The averaging group of the peer's last round, as that peer saw it."""

    group_id: str
    """The group's id (hex or any short printable string)."""
    members: tuple[str, ...]
    """Peer IDs of the group, unique."""
    outcome: str
    """How the round ended for this peer, e.g. ``"ok"``, ``"solo"``, ``"failed"``."""
    duration_ms: int
    """Wall time of the round, milliseconds."""
    bytes_sent: int
    """What this peer sent during the round."""
    bytes_received: int
    """What this peer received during the round."""

    def __post_init__(self) -> None:
        check_str("last_group.group_id", self.group_id, max_chars=_MAX_ID_CHARS, allow_empty=True, printable=True)
        check_str("last_group.outcome", self.outcome, max_chars=MAX_KIND_CHARS, allow_empty=True, printable=True)
        if not isinstance(self.members, tuple) or len(self.members) > MAX_GROUP_MEMBERS:
            raise ValueError(
                f"last_group.members must be a tuple of at most {MAX_GROUP_MEMBERS} peer IDs, got {self.members!r:.80}"
            )
        for member in self.members:
            check_str("last_group.members[]", member, max_chars=_MAX_ID_CHARS, allow_empty=False, printable=True)
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"last_group.members must be unique, got {self.members!r:.80}")
        for name in ("duration_ms", "bytes_sent", "bytes_received"):
            check_int(f"last_group.{name}", getattr(self, name))


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkTally(JsonFields):
    """A peer's verified-work checks so far (``swarm.work``): what it replayed and whom it excluded."""

    checks: int
    passed: int
    failed: int
    refused: int
    """Checks whose prover did not serve its replay inputs."""
    excluded: tuple[str, ...] = ()
    """Peers this peer excluded from its groups (failed checks, confirmed accusations, false accusers)."""

    def __post_init__(self) -> None:
        for name in ("checks", "passed", "failed", "refused"):
            check_int(f"work.{name}", getattr(self, name))
        if not isinstance(self.excluded, tuple) or len(self.excluded) > MAX_EVENTS:
            raise ValueError(f"work.excluded must be a tuple of at most {MAX_EVENTS} peer IDs")
        for peer in self.excluded:
            check_str("work.excluded[]", peer, max_chars=_MAX_ID_CHARS, allow_empty=False, printable=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerStatus(Signable):
    """One peer's status, exactly as signed (see the module docstring)."""

    v: int = STATUS_VERSION
    """Schema version; only :data:`STATUS_VERSION` is accepted."""
    peer: str
    """The publishing peer's ID (its DHT subkey)."""
    run: str
    """The run (bound into the signature)."""
    t: int
    """When the status was signed, unix seconds."""
    state: str
    """What the peer is doing, e.g. ``"training"``."""
    round: int
    """The peer's current averaging round."""
    step: int
    """The peer's optimizer step."""
    samples_per_s_milli: int
    """Training throughput, thousandths of a sample per second."""
    loss_milli: int | None
    """Latest training loss, thousandths (None: none yet)."""
    val_loss_milli: int | None
    """Latest validation loss, thousandths (None: none yet)."""
    last_group: LastGroup | None
    """The group of the last round (None: no round yet)."""
    events: tuple[StatusEvent, ...] = ()
    """The last :data:`MAX_EVENTS` events the peer noted, oldest first."""
    work: WorkTally | None = None
    """Its verified-work checks (None: the peer does not verify work)."""

    def __post_init__(self) -> None:
        check_int("v", self.v)
        check_str("peer", self.peer, max_chars=_MAX_ID_CHARS, allow_empty=False, printable=True)
        check_str("run", self.run, max_chars=_MAX_ID_CHARS, allow_empty=False, printable=True)
        check_str("state", self.state, max_chars=_MAX_STATE_CHARS, allow_empty=False, printable=True)
        for name in ("t", "round", "step", "samples_per_s_milli"):
            check_int(name, getattr(self, name))
        for name in ("loss_milli", "val_loss_milli"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=-INT64_MAX)
        if self.last_group is not None and not isinstance(self.last_group, LastGroup):
            raise ValueError(f"last_group must be a LastGroup or None, got {self.last_group!r:.80}")
        if not isinstance(self.events, tuple) or len(self.events) > MAX_EVENTS:
            raise ValueError(f"events must be a tuple of at most {MAX_EVENTS} events, got {len(self.events)!r}")
        if not all(isinstance(e, StatusEvent) for e in self.events):
            raise ValueError("events must hold StatusEvent items")
        if self.work is not None and not isinstance(self.work, WorkTally):
            raise ValueError(f"work must be a WorkTally or None, got {self.work!r:.80}")


def sign_status(status: PeerStatus, identity: Identity) -> dict[str, bytes]:
    """The DHT value for ``status``; ValueError if it is not ``identity``'s or is too big."""
    if status.peer != identity.peer_id:
        raise ValueError(f"peer: a status can only be signed by its own peer's key, got {status.peer!r}")
    payload = status.payload()
    if len(payload) + 64 > MAX_STATUS_BYTES:
        raise ValueError(f"status payload is {len(payload)} bytes, above the {MAX_STATUS_BYTES}-byte limit")
    return {"p": payload, "s": identity.sign(kind=STATUS_KIND, run_id=status.run, payload=payload)}


# ------------------------------------------------------------------------------------------ parsing
class StatusRejected(Rejected):
    """A status entry was refused; ``reason`` is a short fixed label (the counter key)."""


def parse_status(
    subkey: Any, value: Any, *, run: str, now: float | None = None, counter: Counter[str] | None = None
) -> PeerStatus:
    """Validate one untrusted board entry of run ``run``; raise StatusRejected (counted, logged once).

    Reasons: ``malformed``, ``oversized``, ``version``, ``non-canonical``, ``another run``,
    ``peer mismatch``, ``bad peer id``, ``bad signature``, ``from the future``, ``stale``. Each
    refusal is counted in the caller's ``counter`` (if given).
    """
    try:
        return _parse(subkey, value, run=run, now=time.time() if now is None else now)
    except StatusRejected as e:
        _count(e, subkey, Counter() if counter is None else counter)
        raise


def _count(error: StatusRejected, subkey: Any, counter: Counter[str]) -> None:
    counter[error.reason] += 1
    peer = str(subkey)[:60]
    if (error.reason, peer) not in _LOGGED and len(_LOGGED) < 10_000:
        _LOGGED.add((error.reason, peer))
        logger.warning("refused a status entry for %r: %s", peer, error)


def _parse(subkey: Any, value: Any, *, run: str, now: float) -> PeerStatus:
    payload, signature = unwrap_signed(value, max_bytes=MAX_STATUS_BYTES, rejected=StatusRejected)
    status = _status_from_payload(payload)  # refuses another version first: its fields may differ
    if status.payload() != payload:
        raise StatusRejected("non-canonical", "payload is not canonical JSON of itself")
    if status.run != run:
        raise StatusRejected("another run", f"run {status.run!r}, expected {run!r}")
    if status.peer != subkey:
        raise StatusRejected("peer mismatch", f"subkey {str(subkey)[:60]!r}, status of {status.peer!r}")
    try:
        public_key = public_key_from_peer_id(status.peer)
    except ValueError as e:
        raise StatusRejected("bad peer id", str(e)) from None
    if not verify(public_key=public_key, kind=STATUS_KIND, run_id=run, payload=payload, signature=signature):
        raise StatusRejected("bad signature", f"not signed by {status.peer}")
    _check_time(status.t, now)
    return status


def _status_from_payload(payload: bytes) -> PeerStatus:
    try:
        obj = json.loads(payload)
        if isinstance(obj, dict) and obj.get("v") != STATUS_VERSION:
            raise StatusRejected("version", f"v={str(obj.get('v'))[:20]}")
        expect_keys(obj, set(_PAYLOAD_KEYS), "status", StatusRejected)
        group, events, work = obj["last_group"], obj["events"], obj["work"]
        if not isinstance(events, list) or len(events) > MAX_EVENTS:
            raise ValueError(f"events must be a list of at most {MAX_EVENTS}")
        return PeerStatus(
            **{
                **obj,
                "last_group": None if group is None else _group_from_obj(group),
                "events": tuple(_event_from_obj(e) for e in events),
                "work": None if work is None else _work_from_obj(work),
            }
        )
    except StatusRejected:
        raise
    except (ValueError, TypeError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise StatusRejected("malformed", str(e)[:200]) from None


def _group_from_obj(obj: Any) -> LastGroup:
    expect_keys(obj, set(_GROUP_KEYS), "last_group", StatusRejected)
    if not isinstance(obj["members"], list):
        raise ValueError("last_group.members must be a list")
    return LastGroup(**{**obj, "members": tuple(obj["members"])})


def _work_from_obj(obj: Any) -> WorkTally:
    expect_keys(obj, set(_WORK_KEYS), "work", StatusRejected)
    if not isinstance(obj["excluded"], list):
        raise ValueError("work.excluded must be a list")
    return WorkTally(**{**obj, "excluded": tuple(obj["excluded"])})


def _event_from_obj(obj: Any) -> StatusEvent:
    expect_keys(obj, set(_EVENT_KEYS), "event", StatusRejected)
    return StatusEvent(**obj)


def _check_time(t: int, now: float) -> None:
    if t > now + CLOCK_SKEW_S:
        raise StatusRejected("from the future", f"signed {t - now:.0f} s ahead")
    if t < now - MAX_STATUS_AGE_S:
        raise StatusRejected("stale", f"signed {now - t:.0f} s ago")


# ------------------------------------------------------------------------------------------ publishing
class StatusPublisher(Heartbeat):
    """Keeps this peer's signed status on the run's board (see the module docstring).

    ``snapshot()`` returns the fields in :data:`SNAPSHOT_FIELDS` (``last_group`` as a dict or a
    :class:`LastGroup`); it is called from the publisher's thread. One background thread publishes
    every ``refresh_s`` and soon after :meth:`note` (at most one publication per
    :data:`MIN_PUBLISH_INTERVAL_S`). :meth:`close` withdraws nothing: the entry expires.
    """

    what = "status"
    min_interval_s = MIN_PUBLISH_INTERVAL_S

    def __init__(
        self,
        dht: DHT,
        identity: Identity,
        *,
        run: str,
        snapshot: Callable[[], dict[str, Any]],
        refresh_s: float = 15.0,
        expiry_s: float = 45.0,
        store_timeout_s: float = 10.0,
    ):
        check_str("run", run, max_chars=_MAX_ID_CHARS, allow_empty=False, printable=True)
        super().__init__(
            dht,
            identity,
            status_key(run),
            refresh_s=refresh_s,
            expiry_s=expiry_s,
            store_timeout_s=store_timeout_s,
            thread_name=f"swarm-status-{run}",
        )
        self.run, self.snapshot = run, snapshot
        self.what = f"status for run {run!r}"  # named in the log of a failed publication, as before
        self._events: collections.deque[StatusEvent] = collections.deque(maxlen=MAX_EVENTS)
        self._events_lock = threading.Lock()

    @property
    def last_status(self) -> PeerStatus | None:
        return self.last

    def note(self, kind: str, detail: str = "") -> None:
        """Record an event (the last :data:`MAX_EVENTS` are kept) and publish soon."""
        check_str("kind", kind, max_chars=MAX_KIND_CHARS, allow_empty=False, printable=True)
        clean = "".join(c if c.isprintable() else " " for c in str(detail))[:MAX_DETAIL_CHARS]
        with self._events_lock:
            self._events.append(StatusEvent(t=int(time.time()), kind=kind, detail=clean))
        self.publish_soon()

    def events(self) -> tuple[StatusEvent, ...]:
        with self._events_lock:
            return tuple(self._events)

    def _signed(self, now: float, expiration: float) -> tuple[PeerStatus, dict[str, bytes]]:
        status = self._build()
        return status, sign_status(status, self.identity)

    def _build(self) -> PeerStatus:
        fields = self.snapshot()
        if not isinstance(fields, dict) or set(fields) != SNAPSHOT_FIELDS:
            found = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
            raise ValueError(f"snapshot() must return the fields {sorted(SNAPSHOT_FIELDS)}, got {found}")
        group, work = fields["last_group"], fields["work"]
        if isinstance(group, dict):
            group = LastGroup(**{**group, "members": tuple(group.get("members", ()))})
        if isinstance(work, dict):
            work = WorkTally(**{**work, "excluded": tuple(work.get("excluded", ()))})
        return PeerStatus(
            peer=self.identity.peer_id,
            run=self.run,
            t=int(time.time()),
            events=self.events(),
            **{**fields, "last_group": group, "work": work},
        )


# ------------------------------------------------------------------------------------------ reading
def read_statuses(
    dht: DHT, run: str, *, timeout_s: float = 10.0, now: float | None = None
) -> tuple[dict[str, PeerStatus], Counter[str]]:
    """The valid status entries of ``run`` by peer ID, and the refused ones counted by reason.

    Raises TimeoutError if the DHT does not answer.
    """
    found = latest_within(dht, status_key(run), timeout_s=timeout_s)
    statuses: dict[str, PeerStatus] = {}
    rejected: Counter[str] = Counter()
    if found is None or not isinstance(found.value, dict):
        return statuses, rejected
    for subkey, item in found.value.items():
        value = item.value if isinstance(item, ValueWithExpiration) else item
        try:
            statuses[subkey] = parse_status(subkey, value, run=run, now=now, counter=rejected)
        except StatusRejected:
            continue
    return statuses, rejected


_MANIFEST_CACHE: collections.OrderedDict[str, dict[str, Any] | None] = collections.OrderedDict()
_MANIFEST_CACHE_SIZE = 64


def _checked_manifest(data: Any, run: str) -> dict[str, Any] | None:
    """The board's view of one announced manifest, or None if it is not sealed (verified once per bytes)."""
    if not isinstance(data, bytes):
        return None
    key = hashlib.sha256(run.encode() + b"\x00" + data).hexdigest()
    if key not in _MANIFEST_CACHE:
        try:
            manifest = verify_manifest(data, run_id=run)
            signers = sorted(SignedManifest.from_bytes(data).signatures)
            _MANIFEST_CACHE[key] = {
                "step": manifest.step,
                "round": manifest.round,
                "digest": manifest.digest(),
                "signers": signers,
                "participants": list(manifest.participants),
                "metrics": dict(manifest.metrics),
                "created_at": manifest.created_at,
            }
        except (ManifestRejected, ValueError):  # counted and logged by verify_manifest
            _MANIFEST_CACHE[key] = None
        while len(_MANIFEST_CACHE) > _MANIFEST_CACHE_SIZE:
            _MANIFEST_CACHE.popitem(last=False)
    return _MANIFEST_CACHE[key]


def newest_checkpoint(dht: DHT, run: str, *, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """The highest-step sealed manifest announced in the run's index, as in the snapshot schema."""
    found = latest_within(dht, index_key(run), timeout_s=timeout_s)
    if found is None or not isinstance(found.value, dict):
        return None
    views = []
    for item in found.value.values():
        value = item.value if isinstance(item, ValueWithExpiration) else item
        view = _checked_manifest(value.get("manifest") if isinstance(value, dict) else None, run)
        if view is not None:
            views.append(view)
    if not views:
        return None
    best = max(views, key=lambda v: (v["step"], v["digest"]))
    return {**best, "announced_by": sum(1 for v in views if v["digest"] == best["digest"])}


# ------------------------------------------------------------------------------------------ snapshot
_GRAPHS: weakref.WeakKeyDictionary[DHT, ResourceGraph] = weakref.WeakKeyDictionary()


def _records(dht: DHT, run: str, timeout_s: float) -> dict[str, PeerRecord]:
    # one graph per DHT, so that a bad record is logged once, not on every refresh of the board
    graph = _GRAPHS.setdefault(dht, ResourceGraph(dht))
    return {r.peer_id: r for r in graph.records(run=run, timeout_s=timeout_s)}


def _from_milli(value: int | None) -> float | None:
    return None if value is None else value / 1000


def _device(record: PeerRecord | None) -> dict[str, Any] | None:
    if record is None:
        return None
    hw = record.hardware
    return {
        "accelerator": hw.accelerator,
        "name": hw.name,
        "count": hw.count,
        "memory_total_bytes": hw.memory_total_bytes,
    }


def _peer_row(
    peer: str, record: PeerRecord | None, status: PeerStatus | None, *, now: float, heartbeat_s: float
) -> dict[str, Any]:
    status_age_s = None if status is None else round(now - status.t, 1)
    run_info = record.run if record is not None else None
    if status is not None:
        round_, step, speed = status.round, status.step, status.samples_per_s_milli / 1000
    else:
        round_ = run_info.round if run_info else None
        step = run_info.step if run_info else None
        speed = record.perf.samples_per_s_milli / 1000 if record is not None else None
    if status is not None:
        state = status.state
    else:
        state = record.state if record is not None else "unknown"
    return {
        "peer": peer,
        "state": state,
        "round": round_,
        "step": step,
        "samples_per_s": speed,
        "loss": _from_milli(status.loss_milli) if status else None,
        "val_loss": _from_milli(status.val_loss_milli) if status else None,
        "device": _device(record),
        "region": record.network.region if record is not None else None,
        "record_age_s": None if record is None else round(now - record.issued_at, 1),
        "status_age_s": status_age_s,
        "heartbeat_missed": status_age_s is not None and status_age_s > 2 * heartbeat_s,
        "work": status.work.to_dict() if status is not None and status.work is not None else None,
    }


def _groups(statuses: dict[str, PeerStatus]) -> list[dict[str, Any]]:
    by_id: dict[str, dict[str, Any]] = {}
    outcomes: dict[str, Counter[str]] = {}
    for peer, status in sorted(statuses.items(), key=lambda kv: -kv[1].t):
        group = status.last_group
        if group is None:
            continue
        entry = by_id.setdefault(
            group.group_id,
            {
                "group_id": group.group_id,
                "round": status.round,
                "members": sorted(group.members),
                "outcome": "",
                "duration_s": 0.0,
                "bytes_sent": 0,
                "bytes_received": 0,
                "reported_by": [],
            },
        )
        entry["round"] = max(entry["round"], status.round)
        entry["duration_s"] = max(entry["duration_s"], group.duration_ms / 1000)
        entry["bytes_sent"] += group.bytes_sent
        entry["bytes_received"] += group.bytes_received
        entry["reported_by"].append(peer)
        outcomes.setdefault(group.group_id, Counter())[group.outcome] += 1
    for group_id, entry in by_id.items():
        entry["outcome"] = min(outcomes[group_id].items(), key=lambda kv: (-kv[1], kv[0]))[0]
        entry["reported_by"].sort()
    return sorted(by_id.values(), key=lambda g: (-g["round"], g["group_id"]))[:MAX_GROUPS]


def _latest(statuses: dict[str, PeerStatus], field: str) -> float | None:
    reporting = [s for s in statuses.values() if getattr(s, field) is not None]
    if not reporting:
        return None
    return _from_milli(getattr(max(reporting, key=lambda s: (s.step, s.t)), field))


def _progress(peers: list[dict[str, Any]], statuses: dict[str, PeerStatus]) -> dict[str, Any]:
    rounds = [p["round"] for p in peers if p["round"] is not None]
    steps = [p["step"] for p in peers if p["step"] is not None]
    return {
        "round": max(rounds, default=None),
        "step": max(steps, default=None),
        "loss": _latest(statuses, "loss_milli"),
        "val_loss": _latest(statuses, "val_loss_milli"),
        "samples_per_s": round(sum(p["samples_per_s"] or 0.0 for p in peers), 3),
        "num_peers": len(peers),
    }


def _observer_event(now: float, peer: str, kind: str, detail: str) -> dict[str, Any]:
    return {"t": int(now), "peer": peer, "kind": kind, "detail": detail[:MAX_DETAIL_CHARS], "source": "observer"}


def _said_left(events: list[dict[str, Any]], peer: str) -> bool:
    """Whether ``peer``'s own last word was that it left (and not that it joined again)."""

    def last(kind: str) -> float:
        return max(
            (e["t"] for e in events if e["peer"] == peer and e["kind"] == kind and e["source"] == "peer"),
            default=-math.inf,
        )

    return last("left") > -math.inf and last("left") >= last("joined")


def _peer_changes(board: dict[str, Any], previous: dict[str, Any]) -> list[dict[str, Any]]:
    now, events = board["t"], []
    before = {p["peer"]: p for p in previous.get("peers", [])}
    after = {p["peer"]: p for p in board["peers"]}
    for peer in sorted(after.keys() - before.keys()):
        events.append(_observer_event(now, peer, "peer joined", f"state {after[peer]['state']}"))
    for peer in sorted(before.keys() - after.keys()):
        if _said_left(previous.get("events", []), peer):
            events.append(_observer_event(now, peer, "peer left", "its record and status are gone"))
        else:
            events.append(_observer_event(now, peer, "heartbeat missed", "its record and status vanished"))
    for peer in sorted(after.keys() & before.keys()):
        if after[peer]["heartbeat_missed"] and not before[peer]["heartbeat_missed"]:
            events.append(
                _observer_event(now, peer, "heartbeat missed", f"status is {after[peer]['status_age_s']:.0f} s old")
            )
    return events


def _group_changes(board: dict[str, Any], previous: dict[str, Any]) -> list[dict[str, Any]]:
    old_groups = previous.get("groups", [])
    old_ids = {g["group_id"] for g in old_groups}
    old_by_reporter = {peer: g for g in old_groups for peer in g["reported_by"]}
    events = []
    for group in board["groups"]:
        if group["group_id"] in old_ids:
            continue
        olds = [old_by_reporter[p] for p in group["reported_by"] if p in old_by_reporter]
        was = set().union(*(old["members"] for old in olds))
        now_members = set(group["members"])
        if olds and was != now_members:
            detail = (
                f"round {group['round']}: {len(now_members)} members (+{len(now_members - was)} "
                f"-{len(was - now_members)}), group {group['group_id'][:12]}"
            )
            events.append(_observer_event(board["t"], "", "group re-formed", detail))
    return events


def _checkpoint_change(board: dict[str, Any], previous: dict[str, Any]) -> list[dict[str, Any]]:
    new, old = board["checkpoint"], previous.get("checkpoint")
    if new is None or (old is not None and new["step"] <= old["step"]):
        return []
    detail = f"step {new['step']}, {new['digest'][:12]}, {len(new['signers'])} signer(s)"
    return [_observer_event(board["t"], "", "checkpoint sealed", detail)]


def _timeline(
    board: dict[str, Any], statuses: dict[str, PeerStatus], previous: dict[str, Any] | None
) -> list[dict[str, Any]]:
    events = [
        {"t": e.t, "peer": peer, "kind": e.kind, "detail": e.detail, "source": "peer"}
        for peer, status in statuses.items()
        for e in status.events
    ]
    if previous is not None:
        events += previous.get("events", [])
        events += _peer_changes(board, previous) + _group_changes(board, previous) + _checkpoint_change(board, previous)
    unique = {(e["t"], e["peer"], e["kind"], e["detail"], e["source"]): e for e in events}
    return sorted(unique.values(), key=lambda e: (-e["t"], e["peer"], e["kind"]))[:MAX_TIMELINE_EVENTS]


def _read_parts(dht: DHT, run: str, *, timeout_s: float, now: float) -> tuple[dict, dict, Counter, Any, list]:
    """Records, statuses, rejections, checkpoint, errors: each part fails on its own."""
    errors: list[str] = []
    records, statuses, rejected, checkpoint = {}, {}, Counter(), None
    try:
        records = _records(dht, run, timeout_s)
    except Exception as e:  # a DHT timeout or a dead DHT: show what else can be read
        errors.append(f"capability records: {e!r}")
    try:
        statuses, rejected = read_statuses(dht, run, timeout_s=timeout_s, now=now)
    except Exception as e:
        errors.append(f"status board: {e!r}")
    try:
        checkpoint = newest_checkpoint(dht, run, timeout_s=timeout_s)
    except Exception as e:
        errors.append(f"checkpoint index: {e!r}")
    return records, statuses, rejected, checkpoint, errors


def snapshot(
    dht: DHT,
    run: str,
    *,
    previous: dict[str, Any] | None = None,
    heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    timeout_s: float = 10.0,
) -> dict[str, Any]:
    """The run as the swarm sees it now (schema in the module docstring); never raises on DHT content.

    With ``previous`` (the last snapshot), changes since then are added to the event timeline and
    earlier observed events are kept.
    """
    now = time.time()
    records, statuses, rejected, checkpoint, errors = _read_parts(dht, run, timeout_s=timeout_s, now=now)
    peers = [
        _peer_row(peer, records.get(peer), statuses.get(peer), now=now, heartbeat_s=heartbeat_s)
        for peer in sorted(records.keys() | statuses.keys())
    ]
    board: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "run": run,
        "t": round(now, 3),
        "heartbeat_s": heartbeat_s,
        "peers": peers,
        "groups": _groups(statuses),
        "progress": _progress(peers, statuses),
        "checkpoint": checkpoint,
        "events": [],
        "rejected": dict(rejected),
        "errors": errors,
    }
    board["events"] = _timeline(board, statuses, previous)
    return board


# ------------------------------------------------------------------------------------------ CLI
EXIT_BAD_INPUT = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class BoardConfig:
    """What `python -m swarm.status` shows and how often (one flag per field)."""

    initial_peers: tuple[str, ...]
    """Any live peer of the network (multiaddrs ending in /p2p/PEER_ID)."""
    run: str
    """The run to show."""
    once: bool = False
    """Print one snapshot and exit instead of a live dashboard."""
    json: bool = False
    """Print JSON for scripts (with --once: one object; else one line per refresh)."""
    refresh_s: float = 2.0
    """Seconds between two refreshes of the dashboard."""
    timeout_s: float = 30.0
    """Deadline to join the DHT, and of each DHT query."""
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    """The peers' status refresh period: a status older than twice this is a missed heartbeat."""

    def __post_init__(self) -> None:
        check_str("run", self.run, max_chars=_MAX_ID_CHARS, allow_empty=False, printable=True)
        for name in ("refresh_s", "timeout_s", "heartbeat_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def build_parser() -> Any:
    import argparse

    from bootstrap.cli import add_dataclass_arguments

    parser = argparse.ArgumentParser(
        prog="python -m swarm.status",
        description="Live status board of one run: peers, groups, progress, "
        "the last sealed checkpoint and recent events.",
    )
    add_dataclass_arguments(parser, BoardConfig)
    return parser


def _error(message: object) -> int:
    print(f"swarm.status: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


def _start_client(config: BoardConfig, cancel: threading.Event) -> DHT:
    from bootstrap.network import start_swarm_dht

    # a throwaway key: the board only reads, and must not claim the user's peer identity
    return start_swarm_dht(
        Identity.generate(),
        initial_peers=config.initial_peers,
        client_mode=True,
        host_maddrs=("/ip4/127.0.0.1/tcp/0",),
        connect_timeout_s=config.timeout_s,
        cancel=cancel,
    )


def _show(dht: DHT, config: BoardConfig, stop: threading.Event) -> int:
    """Print the board (once, or until ``stop``); returns how many peers of the run the first board shows."""
    from rich.console import Console

    from swarm._private.status_view import render_board

    def take(previous: dict[str, Any] | None) -> dict[str, Any]:
        return snapshot(dht, config.run, previous=previous, heartbeat_s=config.heartbeat_s, timeout_s=config.timeout_s)

    board = take(None)
    found = len(board["peers"])
    if config.json:
        print(json.dumps(board, indent=2 if config.once else None), flush=True)
        while not config.once and not stop.wait(config.refresh_s):
            board = take(board)
            print(json.dumps(board), flush=True)
        return found
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    if config.once or not console.is_terminal:
        # a pipe or a log file gets one full board per refresh instead of a redrawn screen
        console.print(render_board(board))
        while not config.once and not stop.wait(config.refresh_s):
            board = take(board)
            console.print(render_board(board))
        return found
    _live(console, board, take, config.refresh_s, stop)
    return found


def _live(console: Any, board: dict[str, Any], take: Callable, refresh_s: float, stop: threading.Event) -> None:
    from rich.live import Live

    from swarm._private.status_view import render_board

    with Live(render_board(board), console=console, auto_refresh=False, transient=False) as live:
        while not stop.wait(refresh_s):
            board = take(board)
            live.update(render_board(board), refresh=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m swarm.status`; returns the exit code (0; 1 when ``--once`` found no peer of
    the run; 2 on bad input)."""
    from bootstrap.cli import dataclass_from_args

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = dataclass_from_args(BoardConfig, args)
        config = dataclass_from_args(BoardConfig, args, initial_peers=tuple(parse_initial_peers(config.initial_peers)))
    except ValueError as e:
        return _error(e)
    with StopSignal() as stop:  # the first signal: close the board; a second one: interrupt what runs
        return _run(config, stop)


def _run(config: BoardConfig, stop: StopSignal) -> int:
    try:
        dht = _start_client(config, stop.event)
    except (ValueError, DHTStartError) as e:
        return _error(e)
    except KeyboardInterrupt:  # Ctrl+C while joining: start_dht has cleaned up
        return 0
    found = -1
    try:
        if not stop.event.is_set():
            found = _show(dht, config, stop.event)
    except KeyboardInterrupt:
        pass
    finally:
        stop.ignore()  # the (bounded) clean-up must not be cut short
        stop_dht(dht)
    if config.once and found == 0:  # one look that matched nothing: say so (a live board waits for peers)
        print(
            f"swarm.status: no peer of run {config.run!r} found in the DHT within {config.timeout_s:g} s; "
            f"check --run (names are case-sensitive) and --initial-peers",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
