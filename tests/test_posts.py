"""A group's posts (seal signatures, receipts) go to its members directly; the DHT is the fallback.

Two live DHT nodes, one `GroupPosts` each (as every `CheckpointManager` has), and a third peer ID that
does not exist: a post reaches a live member directly (and not the DHT), a member that cannot be reached
makes the sender store it in the DHT (the fault fires: the DHT holds it), and a reader takes the DHT's
copy once it has waited `DHT_AFTER_S`, not before. Strangers' garbage is refused with a counted reason,
each post is filed under its authenticated sender, and one sender's flood only pushes out its own posts.
"""

from __future__ import annotations

import time

import pytest

from bootstrap import start_dht, stop_dht, visible_maddrs
from bootstrap.dhtcalls import latest_within
from bootstrap.identity import Identity, canonical_json
from swarm.checkpoint import posts as posts_module
from swarm.checkpoint.posts import MAX_KEYS_PER_SENDER, MAX_POST_BYTES, GroupPosts
from swarm.checkpoint.sync import receipts_key, seal_key
from tests.helpers import wait_until

RUN = "posts-test"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
PREFIXES = (seal_key(RUN, ""), receipts_key(RUN, ""))


@pytest.fixture(scope="module")
def pair():
    dhts = [start_dht(host_maddrs=LOOPBACK, nat_port_map=False)]
    boxes: list[GroupPosts] = []
    try:
        dhts.append(start_dht(visible_maddrs(dhts[0]), host_maddrs=LOOPBACK, nat_port_map=False))
        boxes = [GroupPosts(dht, run_id=RUN, prefixes=PREFIXES) for dht in dhts]
        yield dhts, boxes
    finally:
        for box in boxes:
            box.close()
        for dht in reversed(dhts):
            stop_dht(dht)


@pytest.mark.timeout(60)
def test_a_post_reaches_a_live_member_directly_and_one_it_cannot_reach_goes_to_the_dht(pair, monkeypatch):
    (dht_a, dht_b), (a, b) = pair
    me, them = str(dht_a.peer_id), str(dht_b.peer_id)
    absent = Identity.generate().peer_id  # a member that is gone
    key = seal_key(RUN, "1" * 64)
    a.post(key, "sig-a", sender=me, to=[me, them])
    assert b.received(key) == {me: "sig-a"}  # filed under the caller's authenticated peer ID
    assert a.read(key, since=time.monotonic()) == [(me, "sig-a")]  # the sender's own post is read back too
    assert latest_within(dht_a, key, timeout_s=10) is None  # everyone took it: nothing went to the DHT

    lost = seal_key(RUN, "2" * 64)
    a.post(lost, "sig-a2", sender=me, to=[me, them, absent])  # the fault: one member cannot be reached
    stored = wait_until(lambda: latest_within(dht_b, lost, timeout_s=10), 10, message="the DHT's copy")
    assert {peer: item.value for peer, item in stored.value.items()} == {me: "sig-a2"}  # the fallback fired
    # a reader that did not get it directly takes the DHT's copy once it has waited DHT_AFTER_S, not before
    b.discard(lost)
    assert b.read(lost, since=time.monotonic()) == []
    assert b.read(lost, since=time.monotonic() - posts_module.DHT_AFTER_S) == [(me, "sig-a2")]


@pytest.mark.timeout(60)
def test_garbage_posts_are_refused_with_a_reason_and_the_inbox_keeps_working(pair):
    (dht_a, _), (a, b) = pair
    me = str(dht_a.peer_id)
    them = str(pair[0][1].peer_id)
    cases = [
        (b"x" * (MAX_POST_BYTES + 1), "oversized"),
        (b"\xff\xfe not json", "malformed"),
        (b'{"k": "a", "v": 1.5}', "malformed"),  # floats are refused
        (b'{"k": 1, "v": 1}', "malformed"),
        (b'{"k": "swarm/other-run/seal/x", "v": "sig"}', "another key"),
        (b'{"k": "' + seal_key(RUN, "3" * 64).encode() + b'", "v": 1, "extra": 2}', "malformed"),
    ]
    for data, reason in cases:
        before = b.rejected[reason]
        assert a._service.submit(a._service.call_unary(them, data)).result(timeout=10) == b""
        assert b.rejected[reason] == before + 1, (reason, b.rejected)
    good = canonical_json({"k": seal_key(RUN, "4" * 64), "v": "sig"})
    assert a._service.submit(a._service.call_unary(them, good)).result(timeout=10) == b"ok"
    assert b.received(seal_key(RUN, "4" * 64)) == {me: "sig"}


@pytest.mark.timeout(60)
def test_a_flooding_sender_only_pushes_out_its_own_oldest_posts(pair):
    (dht_a, dht_b), (a, b) = pair
    me, them = str(dht_a.peer_id), str(dht_b.peer_id)
    keep = receipts_key(RUN, "kept")
    b.post(keep, {"r": 1}, sender=them, to=[them])  # another sender's post (here: b's own)
    keys = [receipts_key(RUN, f"flood{i}") for i in range(3 * MAX_KEYS_PER_SENDER)]
    for key in keys:
        assert a.send(key, {"r": 0}, to=[them]) == {them}
    held = [key for key in keys if me in b.received(key)]
    assert held == keys[-MAX_KEYS_PER_SENDER:]  # its newest stay, its oldest gave way
    assert b.received(keep) == {them: {"r": 1}}  # the others' posts are untouched


@pytest.mark.timeout(60)
def test_a_post_that_comes_between_a_read_and_the_wait_ends_the_wait_at_once(pair):
    """The sealer reads the posts, then waits for more: a post that lands between the two must end the wait at
    once, not after its whole timeout (before stop 62 `wait` took no ``since`` and missed it, waiting 0.2 s a
    time). The negative control: with no post since, the wait runs out its timeout."""
    (dht_a, dht_b), (a, b) = pair
    me, them = str(dht_a.peer_id), str(dht_b.peer_id)
    key = seal_key(RUN, "5" * 64)
    seen = b.arrivals
    assert b.read(key, since=time.monotonic()) == []  # the read: nothing yet
    a.post(key, "sig-a5", sender=me, to=[me, them])  # lands before the wait begins
    assert b.received(key) == {me: "sig-a5"}
    began = time.monotonic()
    b.wait(5.0, since=seen)
    assert time.monotonic() - began < 0.5
    seen = b.arrivals
    began = time.monotonic()
    b.wait(0.3, since=seen)  # nothing comes: the timeout
    assert time.monotonic() - began >= 0.29
