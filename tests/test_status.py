"""The status board: signed status entries, the strict reader, the publisher, snapshots and the CLI.

Unit tests feed forged, foreign, stale, oversized and mistyped entries to the parser and check each
is refused *and counted*. Snapshot tests run on an in-memory stand-in for the DHT (it only stores and
returns values) to check the derived timeline event by event. The integration test publishes a
real status through a loopback DHT next to a forged entry, then reads the board with
`python -m swarm.status --once --json` and with the live dashboard, stopped by SIGTERM and Ctrl+C.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from hivemind.utils.timed_storage import ValueWithExpiration

from bootstrap import stop_dht
from bootstrap.cli import dataclass_flags
from bootstrap.identity import Identity
from bootstrap.network import start_swarm_dht
from bootstrap.owned import OwnerBoundValidator
from peers import Advertiser, peers_key, sign_record
from peers.testing import make_record, record_builder
from swarm.checkpoint.gossip import index_key
from swarm.checkpoint.manifest import Manifest, SignedManifest, sign_manifest
from swarm.status import (
    MAX_EVENTS,
    MAX_STATUS_BYTES,
    SCHEMA_VERSION,
    STATUS_KIND,
    BoardConfig,
    LastGroup,
    PeerStatus,
    StatusEvent,
    StatusPublisher,
    StatusRejected,
    WorkTally,
    build_parser,
    main,
    milli,
    parse_status,
    sign_status,
    snapshot,
    status_key,
)
from tests.helpers import alive, descendants, python_cmd, read_line_matching, spawn, terminate, wait_until

RUN = "board"
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
# Adding, renaming or removing a flag is a decision: update this list in the same change.
STATUS_FLAGS = ["--initial-peers", "--run", "--once", "--json", "--refresh-s", "--timeout-s", "--heartbeat-s"]


def _status(identity: Identity, **overrides: Any) -> PeerStatus:
    fields: dict[str, Any] = dict(
        peer=identity.peer_id,
        run=RUN,
        t=int(time.time()),
        state="training",
        round=7,
        step=70,
        samples_per_s_milli=12_500,
        loss_milli=2_310,
        val_loss_milli=2_400,
        last_group=LastGroup(
            group_id="g" * 16,
            members=(identity.peer_id, "12D3KooWother"),
            outcome="ok",
            duration_ms=1_500,
            bytes_sent=1_000,
            bytes_received=2_000,
        ),
        events=(StatusEvent(t=int(time.time()), kind="joined", detail="round 0"),),
        work=WorkTally(checks=5, passed=4, failed=1, refused=0, excluded=("12D3KooWcheater",)),
    )
    return PeerStatus(**{**fields, **overrides})


def _signed_raw(identity: Identity, obj: Any, *, run: str = RUN) -> dict[str, bytes]:
    """A correctly signed entry whose payload is ``obj`` serialised exactly as given (may be non-canonical)."""
    payload = obj if isinstance(obj, bytes) else json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return {"p": payload, "s": identity.sign(kind=STATUS_KIND, run_id=run, payload=payload)}


def _reason(subkey: Any, value: Any) -> str:
    """The refusal reason, checking that exactly one refusal was counted in the caller's counter."""
    counter: Counter[str] = Counter()
    with pytest.raises(StatusRejected) as info:
        parse_status(subkey, value, run=RUN, counter=counter)
    assert counter == Counter({info.value.reason: 1})
    return info.value.reason


# ------------------------------------------------------------------------------------------ parser
def test_a_good_status_round_trips():
    ident = Identity.generate()
    status = _status(ident)
    value = sign_status(status, ident)
    counter: Counter[str] = Counter()
    assert parse_status(ident.peer_id, value, run=RUN, counter=counter) == status
    assert counter == Counter()
    print(f"one status entry: {len(value['p']) + len(value['s'])} bytes")
    full = _status(ident, events=tuple(StatusEvent(t=1, kind="k" * 64, detail="d" * 200) for _ in range(MAX_EVENTS)))
    assert len(sign_status(full, ident)["p"]) + 64 < MAX_STATUS_BYTES, "a full status must fit"


def test_forged_foreign_and_replayed_statuses_are_refused_and_counted():
    victim, attacker = Identity.generate(), Identity.generate()
    genuine = sign_status(_status(victim), victim)
    # the victim's payload, signed by the attacker
    assert (
        _reason(
            victim.peer_id, {"p": genuine["p"], "s": attacker.sign(kind=STATUS_KIND, run_id=RUN, payload=genuine["p"])}
        )
        == "bad signature"
    )
    # the victim's key, but a signature made for another kind of object or another run
    for kind, run in (("swarm/record", RUN), (STATUS_KIND, "other")):
        value = {"p": genuine["p"], "s": victim.sign(kind=kind, run_id=run, payload=genuine["p"])}
        assert _reason(victim.peer_id, value) == "bad signature"
    # the attacker's own valid status under the victim's subkey
    assert _reason(victim.peer_id, sign_status(_status(attacker), attacker)) == "peer mismatch"
    # a valid status of another run
    assert _reason(victim.peer_id, sign_status(_status(victim, run="other"), victim)) == "another run"
    # from the future, or an old one replayed
    assert _reason(victim.peer_id, sign_status(_status(victim, t=int(time.time()) + 120), victim)) == "from the future"
    assert _reason(victim.peer_id, sign_status(_status(victim, t=int(time.time()) - 3600), victim)) == "stale"
    # a subkey that is not an Ed25519 peer ID (its key cannot be recovered)
    rsa_like = "QmVekjsvS68BRG1RfmybbEmgNmt8Yk1Anpan5uqYmkmczq"
    assert _reason(rsa_like, _signed_raw(victim, _status(victim).to_dict() | {"peer": rsa_like})) == "bad peer id"


def test_non_canonical_and_oversized_statuses_are_refused():
    ident = Identity.generate()
    obj = _status(ident).to_dict()
    assert _reason(ident.peer_id, _signed_raw(ident, json.dumps(obj, sort_keys=True).encode())) == "non-canonical"
    unsorted = json.dumps(dict(reversed(list(obj.items()))), separators=(",", ":")).encode()
    assert _reason(ident.peer_id, _signed_raw(ident, unsorted)) == "non-canonical"
    huge = {**obj, "state": "x" * MAX_STATUS_BYTES}
    assert _reason(ident.peer_id, _signed_raw(ident, huge)) == "oversized"
    assert _reason(ident.peer_id, _signed_raw(ident, {**obj, "v": 3})) == "version"
    old_schema = {k: v for k, v in obj.items() if k != "work"}  # v1: before the work field
    assert _reason(ident.peer_id, _signed_raw(ident, {**old_schema, "v": 1})) == "version"


def _mutations(obj: dict[str, Any]) -> dict[str, Any]:
    group, event, work = obj["last_group"], obj["events"][0], obj["work"]
    return {
        "work excluded not a list": {**obj, "work": {**work, "excluded": "a,b"}},
        "negative work count": {**obj, "work": {**work, "failed": -1}},
        "work field missing": {**obj, "work": {k: v for k, v in work.items() if k != "refused"}},
        "too many excluded": {**obj, "work": {**work, "excluded": ["p"] * (MAX_EVENTS + 1)}},
        "bool for an int": {**obj, "round": True},
        "string for an int": {**obj, "step": "70"},
        "float for an int": {**obj, "loss_milli": 2.5},
        "negative count": {**obj, "samples_per_s_milli": -1},
        "extra field": {**obj, "admin": 1},
        "missing field": {k: v for k, v in obj.items() if k != "val_loss_milli"},
        "too many events": {**obj, "events": [event] * (MAX_EVENTS + 1)},
        "long detail": {**obj, "events": [{**event, "detail": "d" * 201}]},
        "escape in detail": {**obj, "events": [{**event, "detail": "\x1b[2J"}]},
        "empty kind": {**obj, "events": [{**event, "kind": ""}]},
        "members not a list": {**obj, "last_group": {**group, "members": "a,b"}},
        "duplicate members": {**obj, "last_group": {**group, "members": ["a", "a"]}},
        "group field missing": {**obj, "last_group": {k: v for k, v in group.items() if k != "outcome"}},
        "group not an object": {**obj, "last_group": [group]},
        "payload not an object": [obj],
    }


@pytest.mark.parametrize("name", sorted(_mutations(_status(Identity.generate()).to_dict())))
def test_mistyped_statuses_are_malformed(name):
    ident = Identity.generate()
    bad = _mutations(_status(ident).to_dict())[name]
    assert _reason(ident.peer_id, _signed_raw(ident, bad)) == "malformed"


@pytest.mark.parametrize(
    "value",
    [None, b"x", {"p": b"{}"}, {"p": "text", "s": b"s"}, {"p": b"\xff", "s": b"s"}, {"p": b"[" * 10_000, "s": b""}],
)
def test_garbage_values_are_malformed_or_oversized(value):
    assert _reason(Identity.generate().peer_id, value) in ("malformed", "oversized")


def test_a_refusal_is_logged_once_per_reason_and_peer(caplog):
    victim, attacker = Identity.generate(), Identity.generate()
    forged = sign_status(_status(attacker), attacker)
    with caplog.at_level("WARNING", logger="swarm.status"):
        for _ in range(3):
            with pytest.raises(StatusRejected):
                parse_status(victim.peer_id, forged, run=RUN)
    assert sum("peer mismatch" in r.getMessage() for r in caplog.records) == 1


def test_dataclasses_name_the_bad_field():
    ident = Identity.generate()
    for overrides, field in (
        ({"round": -1}, "round"),
        ({"state": ""}, "state"),
        ({"loss_milli": 1.5}, "loss_milli"),
        ({"events": (1,)}, "events"),
    ):
        with pytest.raises(ValueError, match=field):
            _status(ident, **overrides)
    with pytest.raises(ValueError, match="members"):
        LastGroup(group_id="g", members=("a", "a"), outcome="ok", duration_ms=1, bytes_sent=0, bytes_received=0)
    with pytest.raises(ValueError, match="peer"):
        sign_status(_status(ident), Identity.generate())
    assert milli(2.3456) == 2346 and milli(None) is None and milli(float("nan")) is None


# ------------------------------------------------------------------------------------------ publisher
class MemoryDHT:
    """Stores and returns values like hivemind's DHT (``return_future=True``), in memory; records each store."""

    def __init__(self) -> None:
        self.data: dict[str, dict[Any, tuple[Any, float]]] = {}
        self.stores: list[tuple[float, str, Any, float]] = []

    def store(self, key: str, value: Any, expiration_time: float, subkey: Any = None, return_future: bool = False):
        self.data.setdefault(key, {})[subkey] = (value, expiration_time)
        self.stores.append((time.monotonic(), key, value, expiration_time))
        return _done(True)

    def get(self, key: str, latest: bool = False, return_future: bool = False):
        entries = self.data.get(key)
        if not entries:
            return _done(None)
        found = {subkey: ValueWithExpiration(value, exp) for subkey, (value, exp) in entries.items()}
        return _done(ValueWithExpiration(found, max(exp for _, exp in entries.values())))

    def remove(self, key: str, subkey: Any) -> None:
        self.data.get(key, {}).pop(subkey, None)

    def run_coroutine(self, coroutine: Any, return_future: bool = False):
        """Runs ``coroutine(dht, node)`` as hivemind does in its DHT process, with a node that reads this store."""
        dht = self

        class Node:
            async def get_many(self, keys: Any, **_kwargs: Any) -> dict[str, Any]:
                return {key: dht.get(key).result() for key in keys}

        result = asyncio.run(coroutine(self, Node()))
        return _done(result) if return_future else result


def _done(result: Any) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(result)
    return future


TALLY = {"checks": 7, "passed": 6, "failed": 1, "refused": 0, "excluded": ["12D3KooWcheater"]}


def _fields(**overrides: Any) -> dict[str, Any]:
    return {
        "state": "training",
        "round": 1,
        "step": 10,
        "samples_per_s_milli": 1000,
        "loss_milli": 3000,
        "val_loss_milli": None,
        "last_group": None,
        "work": None,
        **overrides,
    }


def test_publisher_coalesces_bursts_and_keeps_the_last_events():
    dht, ident = MemoryDHT(), Identity.generate()
    publisher = StatusPublisher(dht, ident, run=RUN, snapshot=_fields, refresh_s=30, expiry_s=60).start()
    try:
        wait_until(lambda: publisher.published >= 1, timeout_s=10, message="first publication")
        for i in range(50):
            publisher.note("failure", f"burst {i}\nline two")
        wait_until(
            lambda: (
                publisher.last_status
                and publisher.last_status.events
                and publisher.last_status.events[-1].detail == "burst 49 line two"
            ),
            timeout_s=10,
            message="the burst published",
        )
    finally:
        publisher.close()
    assert not publisher._thread.is_alive()
    times = [t for t, *_ in dht.stores]
    assert 2 <= len(times) <= 3, f"50 notes must coalesce into one or two publications, got {len(times)}"
    assert min(b - a for a, b in zip(times, times[1:])) >= 0.45, times
    events = publisher.last_status.events
    assert len(events) == MAX_EVENTS and events[0].detail == "burst 34 line two"
    expirations = [exp for *_, exp in dht.stores]
    assert expirations == sorted(set(expirations)), "each entry must outlive the previous one"
    stored = dht.data[status_key(RUN)][ident.peer_id][0]
    assert parse_status(ident.peer_id, stored, run=RUN) == publisher.last_status
    publisher.close()  # idempotent
    assert publisher.start() is publisher and not publisher._thread.is_alive(), "a closed publisher stays closed"


def test_publisher_heartbeat_and_refusal_of_a_bad_snapshot():
    dht, ident = MemoryDHT(), Identity.generate()
    publisher = StatusPublisher(dht, ident, run=RUN, snapshot=_fields, refresh_s=0.2, expiry_s=5).start()
    try:
        wait_until(lambda: len(dht.stores) >= 3, timeout_s=10, message="three heartbeats")
    finally:
        publisher.close()
    bad = StatusPublisher(dht, ident, run=RUN, snapshot=lambda: {"state": "training"})
    assert not bad.publish_now() and bad.failures == 1
    wrong_type = StatusPublisher(dht, ident, run=RUN, snapshot=lambda: _fields(step=1.5))
    assert not wrong_type.publish_now() and wrong_type.failures == 1
    with pytest.raises(ValueError, match="kind"):
        publisher.note("")
    with pytest.raises(ValueError, match="refresh_s"):
        StatusPublisher(dht, ident, run=RUN, snapshot=_fields, refresh_s=10, expiry_s=5)


# ------------------------------------------------------------------------------------------ snapshot
def _check_schema(board: dict[str, Any]) -> None:
    """Exact keys and JSON types of a snapshot (the module docstring of swarm.status)."""
    assert set(board) == {
        "schema_version",
        "run",
        "t",
        "heartbeat_s",
        "peers",
        "groups",
        "progress",
        "checkpoint",
        "events",
        "rejected",
        "errors",
    }
    assert board["schema_version"] == SCHEMA_VERSION and isinstance(board["run"], str)
    opt_int, opt_num = (int, type(None)), (int, float, type(None))
    for p in board["peers"]:
        assert set(p) == {
            "peer",
            "state",
            "round",
            "step",
            "samples_per_s",
            "loss",
            "val_loss",
            "device",
            "region",
            "record_age_s",
            "status_age_s",
            "heartbeat_missed",
            "work",
        }
        assert p["work"] is None or set(p["work"]) == {"checks", "passed", "failed", "refused", "excluded"}
        assert isinstance(p["peer"], str) and isinstance(p["state"], str) and isinstance(p["heartbeat_missed"], bool)
        assert all(isinstance(p[k], opt_int) for k in ("round", "step"))
        assert all(
            isinstance(p[k], opt_num) for k in ("samples_per_s", "loss", "val_loss", "record_age_s", "status_age_s")
        )
        assert p["device"] is None or set(p["device"]) == {"accelerator", "name", "count", "memory_total_bytes"}
    for g in board["groups"]:
        assert set(g) == {
            "group_id",
            "round",
            "members",
            "outcome",
            "duration_s",
            "bytes_sent",
            "bytes_received",
            "reported_by",
        }
        assert isinstance(g["members"], list) and isinstance(g["bytes_sent"], int)
    assert set(board["progress"]) == {"round", "step", "loss", "val_loss", "samples_per_s", "num_peers"}
    if board["checkpoint"] is not None:
        assert set(board["checkpoint"]) == {
            "step",
            "round",
            "digest",
            "signers",
            "participants",
            "metrics",
            "created_at",
            "announced_by",
        }
    for e in board["events"]:
        assert set(e) == {"t", "peer", "kind", "detail", "source"} and e["source"] in ("peer", "observer")
        assert isinstance(e["t"], int)
    assert len(board["events"]) <= 30
    assert all(isinstance(v, int) for v in board["rejected"].values()) and isinstance(board["errors"], list)
    json.dumps(board)


def _publish(dht: MemoryDHT, identity: Identity, **overrides: Any) -> None:
    status = _status(identity, **overrides)
    dht.store(status_key(RUN), sign_status(status, identity), time.time() + 60, subkey=identity.peer_id)


def _seal(dht: MemoryDHT, signers: list[Identity], step: int) -> str:
    manifest = Manifest(
        version=1,
        run_id=RUN,
        step=step,
        round=step,
        task="charlm",
        config_digest="c" * 64,
        parent="",
        shards=(),
        participants=tuple(sorted(s.peer_id for s in signers)),
        metrics={"val_loss_micro": 2_300_000},
        created_at=int(time.time()),
    )
    signed = SignedManifest(manifest=manifest, signatures={})
    for signer in signers:
        signed = signed.with_signature(*sign_manifest(manifest, signer))
    for signer in signers:
        dht.store(
            index_key(RUN),
            {"step": step, "digest": manifest.digest(), "manifest": signed.to_bytes()},
            time.time() + 60,
            subkey=signer.peer_id,
        )
    return manifest.digest()


def _group(group_id: str, members: list[Identity]) -> LastGroup:
    return LastGroup(
        group_id=group_id,
        members=tuple(sorted(m.peer_id for m in members)),
        outcome="ok",
        duration_ms=800,
        bytes_sent=100,
        bytes_received=200,
    )


def _observed(board: dict[str, Any]) -> set[tuple[str, str]]:
    return {(e["kind"], e["peer"]) for e in board["events"] if e["source"] == "observer"}


def test_snapshot_merges_records_statuses_and_checkpoints_and_derives_events():
    dht = MemoryDHT()
    a, b, c = Identity.generate(), Identity.generate(), Identity.generate()
    dht.store(peers_key(a.peer_id), sign_record(make_record(a, run=RUN), a), time.time() + 60, subkey=a.peer_id)
    _publish(dht, a, round=3, step=30, last_group=_group("g1", [a, b]))
    _publish(dht, b, round=3, step=31, loss_milli=1_900, last_group=_group("g1", [a, b]))
    board0 = snapshot(dht, RUN, heartbeat_s=1.0)
    _check_schema(board0)
    assert [p["peer"] for p in board0["peers"]] == sorted([a.peer_id, b.peer_id])
    row_a = next(p for p in board0["peers"] if p["peer"] == a.peer_id)
    assert row_a["device"]["accelerator"] == "cpu" and row_a["record_age_s"] is not None and row_a["step"] == 30
    (group,) = board0["groups"]
    assert group["reported_by"] == sorted([a.peer_id, b.peer_id]) and group["bytes_sent"] == 200
    assert board0["progress"]["step"] == 31 and board0["progress"]["loss"] == 1.9
    assert board0["checkpoint"] is None and not _observed(board0), "nothing to compare the first snapshot with"
    assert {(e["kind"], e["peer"]) for e in board0["events"]} == {("joined", a.peer_id), ("joined", b.peer_id)}

    # c joins, a and c re-form a group without b, a checkpoint is sealed
    _publish(dht, c, round=4, step=40, last_group=_group("g2", [a, c]))
    _publish(dht, a, round=4, step=40, last_group=_group("g2", [a, c]))
    digest = _seal(dht, [a, c], step=40)
    board1 = snapshot(dht, RUN, previous=board0, heartbeat_s=1.0)
    _check_schema(board1)
    assert _observed(board1) == {("peer joined", c.peer_id), ("group re-formed", ""), ("checkpoint sealed", "")}
    assert [g["group_id"] for g in board1["groups"]] == ["g2", "g1"], "newest round first"
    checkpoint = board1["checkpoint"]
    assert (checkpoint["step"], checkpoint["digest"], checkpoint["announced_by"]) == (40, digest, 2)
    assert checkpoint["signers"] == sorted([a.peer_id, c.peer_id]) and checkpoint["metrics"]["val_loss_micro"]

    # b vanishes, a goes stale, c says it left and vanishes; nothing new is sealed
    dht.remove(status_key(RUN), b.peer_id)
    _publish(dht, a, t=int(time.time()) - 5, round=4, step=40, last_group=_group("g2", [a, c]))
    _publish(dht, c, events=(StatusEvent(t=int(time.time()), kind="left", detail="SIGTERM"),))
    board2 = snapshot(dht, RUN, previous=board1, heartbeat_s=1.0)
    dht.remove(status_key(RUN), c.peer_id)
    board3 = snapshot(dht, RUN, previous=board2, heartbeat_s=1.0)
    _check_schema(board3)
    assert _observed(board3) - _observed(board1) == {
        ("heartbeat missed", b.peer_id),
        ("heartbeat missed", a.peer_id),
        ("peer left", c.peer_id),
    }
    assert _observed(board1) <= _observed(board3), "observed events stay on the timeline"
    assert [p["peer"] for p in board3["peers"] if p["heartbeat_missed"]] == [a.peer_id]
    times = [e["t"] for e in board3["events"]]
    assert times == sorted(times, reverse=True)


def test_snapshot_counts_forged_entries_and_ignores_bad_manifests():
    dht = MemoryDHT()
    victim, attacker = Identity.generate(), Identity.generate()
    forged = {
        "p": _status(victim).payload(),
        "s": attacker.sign(kind=STATUS_KIND, run_id=RUN, payload=_status(victim).payload()),
    }
    dht.store(status_key(RUN), forged, time.time() + 60, subkey=victim.peer_id)
    dht.store(status_key(RUN), b"garbage", time.time() + 60, subkey="junk")
    _seal(dht, [victim, attacker], step=5)
    dht.store(index_key(RUN), {"manifest": b"{}"}, time.time() + 60, subkey="junk")
    board = snapshot(dht, RUN)
    _check_schema(board)
    assert board["peers"] == [] and board["rejected"] == {"bad signature": 1, "malformed": 1}
    assert board["checkpoint"]["step"] == 5


# ------------------------------------------------------------------------------------------ CLI
def test_status_flags_are_frozen_and_bad_input_exits_2(capsys):
    assert dataclass_flags(BoardConfig) == STATUS_FLAGS
    parser_flags = {s for a in build_parser()._actions for s in a.option_strings if s.startswith("--")}
    assert parser_flags == set(STATUS_FLAGS) | {"--help", "--no-once", "--no-json"}
    assert main(["--initial-peers", "/ip4/1.2.3/tcp/x", "--run", RUN, "--once"]) == 2
    assert "/ip4/1.2.3/tcp/x" in capsys.readouterr().err
    assert (
        main(
            [
                "--initial-peers",
                "/ip4/127.0.0.1/tcp/1/p2p/QmVekjsvS68BRG1RfmybbEmgNmt8Yk1Anpan5uqYmkmczq",
                "--run",
                RUN,
                "--refresh-s",
                "0",
            ]
        )
        == 2
    )
    assert "refresh_s" in capsys.readouterr().err


@pytest.fixture(scope="module")
def live_board(bootstrap_node):
    """One peer publishing its record and status on the session's bootstrap node, and a forged status
    entry beside it."""
    ident, victim, attacker = Identity.generate(), Identity.generate(), Identity.generate()
    dht = publisher = advertiser = None
    try:
        dht = start_swarm_dht(ident, initial_peers=bootstrap_node, host_maddrs=LOOPBACK)
        advertiser = Advertiser(dht, ident, record_builder(ident, run=RUN), refresh_s=10, expiry_s=60).start()
        group = {
            "group_id": "feed" * 8,
            "members": sorted([ident.peer_id, victim.peer_id]),
            "outcome": "ok",
            "duration_ms": 1234,
            "bytes_sent": 4096,
            "bytes_received": 8192,
        }
        publisher = StatusPublisher(
            dht,
            ident,
            run=RUN,
            snapshot=lambda: _fields(last_group=group, step=42, work=TALLY),
            refresh_s=10,
            expiry_s=60,
        ).start()
        publisher.note("joined", "round 0")
        publisher.note("checkpoint sealed", "step 40, 2 signers")
        wait_until(
            lambda: publisher.last_status is not None and len(publisher.last_status.events) == 2,
            timeout_s=20,
            message="the status with both events published",
        )
        # under the victim's subkey the DHT itself refuses it (owner-bound records, tests/test_owned.py);
        # an insider may write its own subkey, so the reader re-verifies the status inside: a forged one
        payload = _status(victim).payload()
        forged = {"p": payload, "s": attacker.sign(kind=STATUS_KIND, run_id=RUN, payload=payload)}
        assert not dht.store(status_key(RUN), forged, expiration_time=time.time() + 60, subkey=victim.peer_id)
        dht.add_validators([OwnerBoundValidator(attacker)])
        payload = _status(attacker).payload()
        forged = {"p": payload, "s": victim.sign(kind=STATUS_KIND, run_id=RUN, payload=payload)}
        assert dht.store(status_key(RUN), forged, expiration_time=time.time() + 60, subkey=attacker.peer_id)
        yield SimpleNamespace(maddrs=bootstrap_node, ident=ident, victim=victim, attacker=attacker, group=group)
    finally:
        for part in (publisher, advertiser):
            if part is not None:
                part.close()
        if dht is not None:
            stop_dht(dht)


def _run_once(maddrs: list[str]) -> dict[str, Any]:
    child = spawn(
        python_cmd(
            "-m", "swarm.status", "--initial-peers", *maddrs, "--run", RUN, "--once", "--json", "--timeout-s", "20"
        )
    )
    wait_until(lambda: child.returncode is not None, timeout_s=60, message=child.describe)
    child.join_output()
    assert child.returncode == 0, child.describe()
    return json.loads(child.stdout())


@pytest.mark.timeout(120)
def test_cli_once_json_shows_the_published_peer_and_not_the_forgery(live_board):
    board = _run_once(live_board.maddrs)
    _check_schema(board)
    ident = live_board.ident.peer_id
    (peer,) = board["peers"]
    assert (peer["peer"], peer["state"], peer["step"]) == (ident, "training", 42)
    assert peer["device"] is not None and peer["status_age_s"] is not None and not peer["heartbeat_missed"]
    assert peer["work"] == TALLY  # the verified-work checks reach the board as signed
    (group,) = board["groups"]
    assert group["group_id"] == live_board.group["group_id"] and group["members"] == live_board.group["members"]
    assert group["reported_by"] == [ident] and group["duration_s"] == 1.234
    assert {(e["peer"], e["kind"], e["source"]) for e in board["events"]} == {
        (ident, "checkpoint sealed", "peer"),
        (ident, "joined", "peer"),
    }
    assert board["rejected"] == {"bad signature": 1}, "the forged entry must be refused and counted"
    assert live_board.victim.peer_id not in json.dumps(board["peers"])
    assert live_board.attacker.peer_id not in json.dumps(board["peers"])
    assert board["progress"]["num_peers"] == 1 and board["errors"] == []


@pytest.mark.timeout(120)
def test_cli_once_on_a_run_nobody_trains_says_so_and_exits_1(bootstrap_node):
    child = spawn(
        python_cmd(
            "-m",
            "swarm.status",
            "--initial-peers",
            *bootstrap_node,
            "--run",
            "no-such-run",
            "--once",
            "--timeout-s",
            "5",
        )
    )
    wait_until(lambda: child.returncode is not None, timeout_s=60, message=child.describe)
    child.join_output()
    assert child.returncode == 1, child.describe()
    assert "no peer of run 'no-such-run' found in the DHT" in " ".join(child.stderr().split()), child.describe()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl+C"])
def test_live_dashboard_stops_cleanly(live_board, how):
    child = spawn(
        python_cmd("-m", "swarm.status", "--initial-peers", *live_board.maddrs, "--run", RUN, "--refresh-s", "0.5"),
        start_new_session=how == "Ctrl+C",
    )
    try:
        read_line_matching(child, r"peers \(1\)", timeout_s=60)
        tree = descendants(child.pid)
        assert any(p.name() == "p2pd" for p in tree), "the dashboard runs its own client DHT"
        if how == "Ctrl+C":
            os.killpg(child.pid, signal.SIGINT)  # a terminal sends it to the whole foreground group
        code = terminate(child, timeout_s=20, sig=signal.SIGTERM if how == "SIGTERM" else None)
    finally:
        if child.returncode is None:
            terminate(child, timeout_s=20)
    child.join_output()
    assert code == 0, child.describe()
    assert "Traceback" not in child.stderr(), child.describe()
    wait_until(lambda: not alive(tree), timeout_s=10, message="the dashboard's DHT processes gone")
