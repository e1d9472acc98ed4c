"""Capability records, the resource graph and run discovery.

Unit tests feed forged, expired, oversized and malformed records to the parser; DHT tests run real
hivemind DHTs on loopback in this process and attack a live record from a peer that does not run
our validator, then check the attack was refused where it landed *and* the real record survived.
"""

import dataclasses
import hashlib
import json
import time
import types

import hivemind
import pytest
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration

from bootstrap import stop_dht, visible_maddrs
from bootstrap.identity import Identity
from bootstrap.network import start_swarm_dht
from bootstrap.records import RecordBook, live_records, verified_records
from peers import (
    MAX_RECORD_BYTES,
    PEERS_KEYS,
    Advertiser,
    PeerRecord,
    PeerRecordValidator,
    RecordRejected,
    Requirements,
    ResourceGraph,
    dht_record_rejections,
    parse_record,
    peers_key,
    pick_run,
    probe_hardware,
    probe_software,
    score_peers,
    sign_record,
    summarize_runs,
)
from peers.testing import NO_REQUIREMENTS, make_record, record_builder
from swarm.tasks import get_task
from tests.helpers import python_cmd, spawn, terminate_all, wait_until

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


# ------------------------------------------------------------------------------------------- parsing
def test_record_round_trip_and_size():
    ident = Identity.generate()
    value = sign_record(make_record(ident), ident)
    record = parse_record(ident.peer_id, value)
    assert record == make_record(ident, issued_at=record.issued_at)
    size = len(MSGPackSerializer.dumps(value))
    print(f"one capability record: {size} bytes on the wire (payload {len(value['p'])})")
    assert size < MAX_RECORD_BYTES


def _rejected(subkey, value) -> str:
    with pytest.raises(RecordRejected) as info:
        parse_record(subkey, value)
    return info.value.reason


def test_forged_records_are_rejected():
    victim, attacker = Identity.generate(), Identity.generate()
    genuine = sign_record(make_record(victim), victim)
    # the attacker signs a record naming the victim's peer ID and key with its own key
    forged = {"p": genuine["p"], "s": attacker.sign(kind="swarm/record", run_id="", payload=genuine["p"])}
    assert _rejected(victim.peer_id, forged) == "bad signature"
    # ...or puts its own key in a record for the victim's subkey
    own = make_record(attacker)
    claim = dataclasses.replace(own, peer_id=victim.peer_id)
    value = {"p": claim.payload(), "s": attacker.sign(kind="swarm/record", run_id="", payload=claim.payload())}
    assert _rejected(victim.peer_id, value) == "peer id mismatch"
    # ...or stores its own valid record under the victim's subkey
    assert _rejected(victim.peer_id, sign_record(own, attacker)) == "peer id mismatch"
    # a signature made for another purpose (domain) does not verify as a record
    other_domain = {"p": genuine["p"], "s": victim.sign(kind="swarm/manifest", run_id="", payload=genuine["p"])}
    assert _rejected(victim.peer_id, other_domain) == "bad signature"


def test_expired_future_and_overlong_records_are_rejected():
    ident = Identity.generate()
    now = int(time.time())
    assert (
        _rejected(ident.peer_id, sign_record(make_record(ident, issued_at=now - 100, lifetime_s=45), ident))
        == "expired"
    )
    assert _rejected(ident.peer_id, sign_record(make_record(ident, issued_at=now + 3600), ident)) == "from the future"
    assert _rejected(ident.peer_id, sign_record(make_record(ident, lifetime_s=10**6), ident)) == "bad lifetime"


@pytest.mark.parametrize(
    "value",
    [
        None,
        b"bytes",
        {"p": b"{}"},
        {"p": "str", "s": b"x"},
        {"p": b"not json", "s": b"x" * 64},
        {"p": b"{}", "s": b"x" * 64},
        {"p": b"[1,2]", "s": b"x" * 64},
        {"p": b'{"v": 1}', "s": b"x" * 64},
        {"p": b"\xff\xfe", "s": b"x" * 64},
        {"p": b"[" * 100_000, "s": b""},
    ],
)
def test_malformed_records_are_rejected(value):
    assert _rejected("12D3KooWx", value) in ("malformed", "oversized")


def test_oversized_and_non_canonical_records_are_rejected():
    ident = Identity.generate()
    value = sign_record(make_record(ident), ident)
    assert _rejected(ident.peer_id, {"p": value["p"] + b" " * MAX_RECORD_BYTES, "s": value["s"]}) == "oversized"
    spaced = json.dumps(json.loads(value["p"]), indent=1).encode()
    signed = {"p": spaced, "s": ident.sign(kind="swarm/record", run_id="", payload=spaced)}
    assert _rejected(ident.peer_id, signed) == "malformed"  # one record, one byte string: no malleability
    bad_type = json.loads(value["p"])
    bad_type["seq"] = "1"
    payload = json.dumps(bad_type, sort_keys=True, separators=(",", ":")).encode()
    assert (
        _rejected(ident.peer_id, {"p": payload, "s": ident.sign(kind="swarm/record", run_id="", payload=payload)})
        == "malformed"
    )


# ------------------------------------------------------------------------------------------- scoring
def test_score_ranks_fit_throughput_and_requirements():
    a, b, c = Identity.generate(), Identity.generate(), Identity.generate()
    fast, slow = make_record(a, samples_milli=9000), make_record(b, samples_milli=1000)
    huge = Requirements(min_memory_bytes=2**40, dtype="fp32", min_swarm_version="", min_torch_version="")
    ranked = score_peers([slow, fast])
    assert [p.record.peer_id for p in ranked] == [a.peer_id, b.peer_id]
    assert all(0 < p.score <= 100 for p in ranked)
    unfit = score_peers([make_record(c)], huge)
    assert unfit[0].fit == 0 and unfit[0].score == 0


def test_pick_run_prefers_the_biggest_run_this_peer_fits_and_says_why():
    huge = Requirements(min_memory_bytes=2**60, dtype="fp32", min_swarm_version="", min_torch_version="")
    records = [make_record(Identity.generate(), run="crowded", requirements=huge) for _ in range(3)]
    records += [make_record(Identity.generate(), run="small") for _ in range(1)]
    records += [make_record(Identity.generate(), run="medium") for _ in range(2)]
    runs = summarize_runs(records)
    assert {r.name: r.num_peers for r in runs} == {"crowded": 3, "small": 1, "medium": 2}
    picked, reasons = pick_run(runs, probe_hardware("cpu"), probe_software())
    assert picked.name == "medium"
    assert "picked run 'medium'" in reasons[0]
    assert any("skipped run 'crowded'" in line and "GiB" in line for line in reasons)
    newer = Requirements(min_memory_bytes=0, dtype="fp32", min_swarm_version="99.0", min_torch_version="")
    none, why = pick_run(
        summarize_runs([make_record(Identity.generate(), requirements=newer)]), probe_hardware("cpu"), probe_software()
    )
    assert none is None and "needs swarm >= 99.0" in why[0]


# ------------------------------------------------------------------------------------------- DHT
@pytest.fixture
def network():
    """Two Swarm DHT nodes (with the record validator) and a plain hivemind DHT (an attacker without it)."""
    dhts = []
    try:
        first = start_swarm_dht(Identity.generate(), host_maddrs=LOOPBACK)
        dhts.append(first)
        initial = visible_maddrs(first)
        dhts.append(start_swarm_dht(Identity.generate(), initial_peers=initial, host_maddrs=LOOPBACK))
        dhts.append(hivemind.DHT(initial_peers=initial, start=True, host_maddrs=list(LOOPBACK), nat_port_map=False))
        yield dhts
    finally:
        for dht in dhts:
            stop_dht(dht)


def _validator_rejections(dht) -> dict:
    """What the record validator inside this DHT node refused, by reason."""
    return dht_record_rejections(dht)


@pytest.mark.timeout(120)
def test_no_peer_can_overwrite_replay_or_withdraw_another_peers_record(network):
    honest_dht, reader_dht, attacker_dht = network
    victim = Identity.generate()
    # the victim publishes through the honest node with its own key (records are checked by content, not by node)
    victim_value = sign_record(make_record(victim, seq=7), victim)
    expires = json.loads(victim_value["p"])["expires_at"]
    assert honest_dht.store(peers_key(victim.peer_id), victim_value, expiration_time=expires, subkey=victim.peer_id)

    attacker = Identity.generate()
    attacks = {
        "own record under the victim's subkey": sign_record(make_record(attacker), attacker),
        "forged 'left' record": {
            "p": make_record(victim, state="left", seq=8).payload(),
            "s": attacker.sign(
                kind="swarm/record", run_id="", payload=make_record(victim, state="left", seq=8).payload()
            ),
        },
        "garbage": {"p": b"garbage", "s": b"x" * 64},
    }
    for name, value in attacks.items():
        assert not attacker_dht.store(
            peers_key(victim.peer_id), value, expiration_time=expires + 30, subkey=victim.peer_id
        ), name
    # replay: the victim's own genuine record, kept alive past its signed expiry
    assert not attacker_dht.store(
        peers_key(victim.peer_id), victim_value, expiration_time=expires + 60, subkey=victim.peer_id
    )
    # the victim's genuine record moved to another shard's key (where a reader of one shard would miss it)
    other_shard = next(key for key in PEERS_KEYS if key != peers_key(victim.peer_id))
    assert not attacker_dht.store(other_shard, victim_value, expiration_time=expires, subkey=victim.peer_id)

    rejected = _validator_rejections(honest_dht)
    rejected_reader = _validator_rejections(reader_dht)
    # each Swarm node was asked to store each forgery once, and refused it once, with the forgery's own reason
    expected = {"peer id mismatch": 1, "bad signature": 1, "malformed": 1, "outlives its expiry": 1, "wrong shard": 1}
    assert rejected == expected and rejected_reader == expected, (rejected, rejected_reader)

    records = ResourceGraph(reader_dht).records()
    assert [(r.peer_id, r.seq, r.state) for r in records] == [(victim.peer_id, 7, "training")]


def test_readers_take_a_record_only_from_its_own_shard():
    """A plain hivemind node stores anything anywhere; a reader refuses a record found under another
    shard's key (counted), and takes it under its own (the negative control), each peer once."""
    victim = Identity.generate()
    value = sign_record(make_record(victim), victim)
    entry = ValueWithExpiration({victim.peer_id: ValueWithExpiration(value, time.time() + 30)}, time.time() + 30)
    own = peers_key(victim.peer_id)
    other = next(key for key in PEERS_KEYS if key != own)
    refused: list[str] = []

    def read(found):
        return live_records(found, run=None, now=time.time(), on_rejected=lambda e, _subkey: refused.append(e.reason))

    assert read({other: entry, own: None}) == [] and refused == ["wrong shard"]
    assert [r.peer_id for r in read({own: entry, other: None})] == [victim.peer_id] and refused == ["wrong shard"]
    assert len(read({own: entry, other: entry})) == 1 and refused == ["wrong shard"] * 2
    assert {peers_key(Identity.generate().peer_id) for _ in range(200)} == set(PEERS_KEYS)  # every shard is used


def test_a_reader_keeps_a_verified_record_until_it_expires_or_is_replaced():
    """One DHT read can miss a live record; a RecordBook keeps what it verified until the record's own
    expiry. A newer record replaces it, a signed withdrawal hides the peer at once, a replayed older
    record changes nothing, an expired one goes, and a flood of identities is capped."""
    peer = Identity.generate()
    key = peers_key(peer.peer_id)
    now = int(time.time())
    refused: list[str] = []

    def found(record):
        value = {peer.peer_id: ValueWithExpiration(sign_record(record, peer), now + 60)}
        return {key: ValueWithExpiration(value, now + 60)}

    book = RecordBook()

    def read(result, at=now):
        book.add(verified_records(result, now=at, on_rejected=lambda e, _subkey: refused.append(e.reason)), now=at)
        return [(r.seq, r.state) for r in book.live(run=None, now=at)]

    first = make_record(peer, issued_at=now - 10, seq=1)  # expires at now + 35
    assert read(found(first)) == [(1, "training")]
    assert live_records({key: None}, run=None, now=now, on_rejected=print) == []  # the read alone misses it
    assert read({key: None}) == [(1, "training")]  # ... the book does not
    assert book.live(run="r", now=now) and not book.live(run="other", now=now)
    assert read({key: None}, at=now + 35) == []  # its own expiry
    second = make_record(peer, issued_at=now, seq=2)
    assert read(found(second)) == [(2, "training")]
    assert read(found(first)) == [(2, "training")]  # a replayed older record changes nothing
    assert read(found(make_record(peer, issued_at=now + 1, seq=3, state="left"))) == []  # withdrawn at once
    assert read(found(second)) == [] and refused == []

    capped = RecordBook(max_records=2)
    others = [Identity.generate() for _ in range(3)]
    capped.add([make_record(p, issued_at=now, lifetime_s=30 + i) for i, p in enumerate(others)], now=now)
    assert {r.peer_id for r in capped.live(run=None, now=now)} == {p.peer_id for p in others[1:]}


def test_a_burst_of_refreshes_never_carries_a_record_past_its_expiry(monkeypatch):
    """Each record must expire after the previous one, in whole seconds; so a heartbeat that published
    faster than once a second stepped each expiration a second further, and a killed peer outlived
    ``expiry_s`` (seen 5.04 s after its kill with expiry 4 s + refresh 1 s, in CI)."""
    stored = []

    def store_within(dht, key, value, *, subkey, expiration_time, timeout_s):
        stored.append((time.time(), expiration_time))

    monkeypatch.setattr("bootstrap.heartbeat.store_within", store_within)
    ident = Identity.generate()
    advertiser = Advertiser(types.SimpleNamespace(), ident, record_builder(ident), refresh_s=0.02, expiry_s=3)
    advertiser.start()
    deadline = time.monotonic() + 2.2
    while time.monotonic() < deadline:  # a round's state changes: refresh_now as often as it likes
        advertiser.refresh_now()
        time.sleep(0.01)
    advertiser.close(withdraw=False)
    assert 2 <= len(stored) <= 4, f"{len(stored)} publications in 2.2 s"  # the burst fired, once a second
    ahead = [expiration - signed_at for signed_at, expiration in stored]
    assert all(0 < a <= 3 for a in ahead), f"expirations ahead of their signing: {ahead}"


@pytest.mark.timeout(120)
def test_advertiser_heartbeat_and_clean_withdrawal(network):
    honest_dht, reader_dht, _ = network
    ident = Identity.generate()
    build = record_builder(ident)
    # the advertiser needs a DHT whose peer ID is its identity, as a Trainer has
    own_dht = start_swarm_dht(ident, initial_peers=visible_maddrs(honest_dht), host_maddrs=LOOPBACK)
    try:
        advertiser = Advertiser(own_dht, ident, build, refresh_s=0.5, expiry_s=5).start()
        graph = ResourceGraph(reader_dht)
        wait_until(lambda: any(r.seq >= 3 for r in graph.records()), timeout_s=20, message="heartbeats")
        advertiser.close()
        assert advertiser.last_record.state == "left"
        assert graph.records() == [], "a withdrawn peer must vanish at once"
        advertiser.close()  # idempotent
    finally:
        stop_dht(own_dht)


def _charlm_digest(preset: str) -> str:
    return hashlib.sha256(
        json.dumps(get_task("charlm", preset=preset).config_dict(), sort_keys=True).encode()
    ).hexdigest()


@pytest.mark.timeout(180)
def test_requirements_refusal_and_auto_pick_with_real_peers(network, tmp_path):
    honest_dht, _, _ = network
    initial = visible_maddrs(honest_dht)
    huge = Requirements(min_memory_bytes=2**60, dtype="fp32", min_swarm_version="", min_torch_version="")
    advertisers = []
    owned = []
    try:
        for run, requirements in (("too-big", huge), ("too-big", huge), ("open", NO_REQUIREMENTS)):
            ident = Identity.generate()
            dht = start_swarm_dht(ident, initial_peers=initial, host_maddrs=LOOPBACK)
            owned.append(dht)
            build = record_builder(ident, run=run, requirements=requirements, digest=_charlm_digest("tiny"))
            advertisers.append(Advertiser(dht, ident, build, refresh_s=5, expiry_s=30).start())

        common = [
            "-m",
            "swarm.peer",
            "--initial-peers",
            *initial,
            "--host-maddrs",
            *LOOPBACK,
            "--no-progress",
            "--torch-threads",
            "1",
            "--task-preset",
            "tiny",
            "--load-state-timeout-s",
            "5",
        ]
        refused = spawn(python_cmd(*common, "--run", "too-big", "--identity-key", str(tmp_path / "a")))
        picker = spawn(python_cmd(*common, "--identity-key", str(tmp_path / "b"), "--max-steps", "3"))
        for child in (refused, picker):
            wait_until(lambda c=child: c.returncode is not None, timeout_s=120, message=child.describe)
            child.join_output()
        assert refused.returncode == 2, refused.describe()
        assert "cannot join run 'too-big'" in refused.stderr() and "GiB" in refused.stderr(), refused.describe()
        assert picker.returncode == 0, picker.describe()
        assert "picked run 'open'" in picker.stderr() and "skipped run 'too-big'" in picker.stderr()
    finally:
        for advertiser in advertisers:
            advertiser.close()
        for dht in owned:
            stop_dht(dht)


@pytest.mark.timeout(120)
def test_peers_list_json_schema(network):
    honest_dht, _, _ = network
    ident = Identity.generate()
    own_dht = start_swarm_dht(ident, initial_peers=visible_maddrs(honest_dht), host_maddrs=LOOPBACK)
    build = record_builder(ident)
    advertiser = Advertiser(own_dht, ident, build, refresh_s=5, expiry_s=30).start()
    try:
        children = {  # both commands at once
            key: spawn(python_cmd("-m", "peers", *args, "--initial-peers", *visible_maddrs(honest_dht), "--json"))
            for args, key in ((["list", "--run", "r"], "peers"), (["runs"], "runs"))
        }
        for key, child in children.items():
            wait_until(lambda c=child: c.returncode is not None, timeout_s=60, message=child.describe)
            child.join_output()
            assert child.returncode == 0, child.describe()
            data = json.loads(child.stdout())
            assert set(data) == {key, "query_s", "rejected"}
            assert len(data[key]) == 1
            if key == "peers":
                (entry,) = data["peers"]
        assert set(entry) == {"peer_id", "score", "fit", "record"}
        assert entry["peer_id"] == ident.peer_id
        assert set(entry["record"]) == {f.name for f in dataclasses.fields(PeerRecord)}
        assert set(entry["record"]["hardware"]) >= {"accelerator", "memory_total_bytes", "memory_free_bytes"}
    finally:
        advertiser.close()
        stop_dht(own_dht)


def test_validator_ignores_other_keys():
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord

    validator = PeerRecordValidator()
    other = DHTRecord(
        key=DHTID.generate(source="something else").to_bytes(), subkey=b"", value=b"x", expiration_time=time.time() + 10
    )
    assert validator.validate(other)
    assert not validator.rejections.counts


def test_validator_remembers_a_parsed_record_but_checks_its_clock_and_expiration_every_time(monkeypatch):
    """The validator parses and verifies a record once (a reader gets it from several holders); a
    remembered record is still refused once expired, or stored to outlive its signed expiry."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord

    import bootstrap.records

    peer = Identity.generate()
    record = make_record(peer, lifetime_s=45)
    value = MSGPackSerializer.dumps(sign_record(record, peer))
    key = DHTID.generate(source=peers_key(peer.peer_id)).to_bytes()
    subkey = MSGPackSerializer.dumps(peer.peer_id)
    validator = PeerRecordValidator(cache_size=1)
    parses = []
    monkeypatch.setattr(bootstrap.records, "parse_record", lambda *a, **k: parses.append(1) or parse_record(*a, **k))

    def validate(expiration_time, value=value):
        return validator.validate(DHTRecord(key=key, subkey=subkey, value=value, expiration_time=expiration_time))

    assert validate(record.expires_at) and validate(record.expires_at) and len(parses) == 1  # parsed once
    assert not validate(record.expires_at + 60) and validator.rejections.counts == {"outlives its expiry": 1}
    assert not validate(float("nan")) and validator.rejections.counts == {"outlives its expiry": 2}
    later = record.expires_at + 1.0
    monkeypatch.setattr(bootstrap.records, "time", types.SimpleNamespace(time=lambda: later))  # this module's clock
    assert not validate(record.expires_at) and validator.rejections.counts["expired"] == 1 and len(parses) == 1
    other = Identity.generate()  # the cache holds one record: a second one evicts the first
    other_value = MSGPackSerializer.dumps(sign_record(make_record(other, issued_at=int(later)), other))
    assert not validate(record.expires_at, value=other_value)  # another peer's record under this subkey
    assert validator.rejections.counts["peer id mismatch"] == 1 and len(parses) == 2


@pytest.mark.timeout(240)
@pytest.mark.heavy(seconds=13)
def test_real_peers_measure_bandwidth_and_a_killed_peer_vanishes_in_time(bootstrap_node, tmp_path):
    refresh_s, expiry_s = 1, 4
    common = [
        "-m",
        "swarm.peer",
        "--initial-peers",
        *bootstrap_node,
        "--host-maddrs",
        *LOOPBACK,
        "--no-progress",
        "--torch-threads",
        "1",
        "--task-preset",
        "tiny",
        "--run",
        "bw",
        "--duration-s",
        "120",
        "--record-refresh-s",
        str(refresh_s),
        "--record-expiry-s",
        str(expiry_s),
        "--sync-every",
        "20",
    ]
    peers = [spawn(python_cmd(*common, "--identity-key", str(tmp_path / f"k{i}"))) for i in range(2)]
    reader = start_swarm_dht(Identity.generate(), initial_peers=bootstrap_node, host_maddrs=LOOPBACK)
    try:
        graph = ResourceGraph(reader)

        def measured():
            records = graph.records(run="bw")
            done = len(records) == 2 and all(r.perf.upload_kbps and r.perf.rtt_us is not None for r in records)
            return records if done else None

        records = wait_until(
            measured,
            timeout_s=120,
            interval_s=0.5,
            message=lambda: f"records: {graph.records()}; {peers[0].describe()}",
        )
        assert all(r.perf.samples_per_s_milli > 0 or r.run.round == 0 for r in records)
        victim = peers[1]
        victim.popen.kill()
        victim.popen.wait(timeout=10)
        killed_at = last_seen = time.monotonic()

        def vanished() -> bool:  # a read's own time is not the record's: the bound is on the reads that saw it
            nonlocal last_seen
            began = time.monotonic()
            if len(graph.records(run="bw")) == 1:
                return True
            last_seen = began
            return False

        wait_until(vanished, timeout_s=expiry_s + refresh_s + 10, interval_s=0.1)
        vanish_s, seen_s = time.monotonic() - killed_at, last_seen - killed_at
        print(f"killed peer vanished after {vanish_s:.2f} s; last read that saw it began at {seen_s:.2f} s")
        assert seen_s <= expiry_s + refresh_s, f"seen {seen_s:.2f} s after the kill > expiry + refresh"
    finally:
        stop_dht(reader)
        terminate_all(peers, timeout_s=30)


@pytest.mark.timeout(120)
def test_the_bootstrap_node_refuses_forged_records(bootstrap_node):
    """A client without our validators can only reach the bootstrap node: its forged record and a plain
    value are refused there, while a genuine record it relays is stored (the negative control)."""
    client = hivemind.DHT(
        initial_peers=bootstrap_node, start=True, client_mode=True, host_maddrs=list(LOOPBACK), nat_port_map=False
    )
    try:
        victim, attacker = Identity.generate(), Identity.generate()
        forged = sign_record(make_record(attacker), attacker)
        expires = time.time() + 30
        assert not client.store("some/other/key", b"no owner", expiration_time=expires)  # bootstrap.owned
        assert not client.store(peers_key(victim.peer_id), forged, expiration_time=expires, subkey=victim.peer_id)
        assert not client.store(peers_key("x"), {"p": b"junk", "s": b""}, expiration_time=expires, subkey="x")
        genuine = sign_record(make_record(victim), victim)
        assert client.store(peers_key(victim.peer_id), genuine, expiration_time=expires, subkey=victim.peer_id)
    finally:
        client.shutdown()
