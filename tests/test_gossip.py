"""Sealed manifests spread by epidemic push to every peer; forgeries die at the first hop; a peer that
was away finds the newest manifest in the run's DHT index."""

import contextlib
import time
from collections import Counter
from pathlib import Path

import pytest
from hivemind.utils.timed_storage import get_dht_time

from bootstrap import start_dht, stop_dht, visible_maddrs
from bootstrap.dhtcalls import latest_within, store_within
from bootstrap.identity import Identity
from swarm.checkpoint import Manifest, SignedManifest, sign_manifest, verify_manifest
from swarm.checkpoint.gossip import GossipConfig, ManifestGossip, index_key
from tests.helpers import wait_until

NUM_PEERS = 8
RUN = "gossip-test"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def sealed_manifest(step: int, signers: list[Identity], *, run: str = RUN, config_digest: str = "a" * 64) -> bytes:
    manifest = Manifest(
        version=1,
        run_id=run,
        step=step,
        round=step,
        task="charlm",
        config_digest=config_digest,
        parent="",
        shards=(),
        participants=tuple(sorted(s.peer_id for s in signers)),
        metrics={"val_loss_micro": 2_500_000},
        created_at=1_800_000_000 + step,
    )
    signed = SignedManifest(manifest=manifest, signatures={})
    for signer in signers:
        signed = signed.with_signature(*sign_manifest(manifest, signer))
    return signed.to_bytes()


def verify(data: bytes) -> tuple[str, int]:
    manifest = verify_manifest(data, run_id=RUN)
    return manifest.digest(), manifest.step


@pytest.fixture(scope="module")
def swarm_of_gossips():
    dhts = [start_dht(host_maddrs=LOOPBACK, nat_port_map=False)]
    gossips = []
    try:
        initial = visible_maddrs(dhts[0])
        dhts += [start_dht(initial, host_maddrs=LOOPBACK, nat_port_map=False) for _ in range(NUM_PEERS - 1)]
        ids: list[str] = []
        for dht in dhts:
            gossips.append(
                ManifestGossip(dht, run_id=RUN, verify=verify, peers=lambda: ids, config=GossipConfig(fanout=3))
            )
        ids.extend(g.peer_id for g in gossips)
        yield dhts, gossips
    finally:
        for gossip in gossips:
            gossip.close()
        for dht in dhts:
            stop_dht(dht)


@pytest.mark.timeout(120)
def test_a_sealed_manifest_reaches_every_peer_and_forgeries_do_not(swarm_of_gossips):
    dhts, gossips = swarm_of_gossips
    signers = [Identity.generate(), Identity.generate()]
    data = sealed_manifest(5, signers)
    started = time.monotonic()
    assert gossips[0].publish(data)
    wait_until(
        lambda: all(g.newest is not None and g.newest[0] == 5 for g in gossips),
        timeout_s=30,
        message=lambda: f"reached {sum(g.newest is not None for g in gossips)} of {NUM_PEERS}",
    )
    print(f"sealed manifest reached all {NUM_PEERS} peers in {time.monotonic() - started:.3f} s")
    assert sum(g.received for g in gossips) >= NUM_PEERS - 1

    # a manifest below quorum (one signature) and another run's manifest are refused, never stored
    below_quorum = sealed_manifest(6, signers[:1])
    other_run = sealed_manifest(7, signers, run="another-run")
    rejected_before = sum(g.rejected.total() for g in gossips)
    assert not gossips[1].publish(below_quorum)
    assert not gossips[1].publish(other_run)
    assert sum(g.rejected.total() for g in gossips) == rejected_before + 2
    assert all(g.newest[0] == 5 for g in gossips)

    # an old manifest presented again is not news and is not forwarded (counted once the forwards of
    # step 5 still in flight have finished: a peer can hold it before its sender's push has returned)
    wait_until(lambda: not any(g._forwarding for g in gossips), timeout_s=30, message="forwards in flight")
    # the copies of step 5 a peer got after its first were dropped by their bytes, before verifying
    duplicates, received = sum(g.duplicates for g in gossips), sum(g.received for g in gossips)
    assert 0 < duplicates <= received - (NUM_PEERS - 1), (duplicates, received)
    forwarded = sum(g.forwarded for g in gossips)
    assert not gossips[2].publish(sealed_manifest(3, signers))
    assert sum(g.forwarded for g in gossips) == forwarded


@pytest.mark.timeout(120)
def test_a_peer_that_was_away_finds_the_newest_manifest_in_the_index(swarm_of_gossips):
    dhts, gossips = swarm_of_gossips
    signers = [Identity.generate(), Identity.generate()]
    assert gossips[0].publish(sealed_manifest(9, signers))
    wait_until(
        lambda: all(g.newest is not None and g.newest[0] == 9 for g in gossips),
        timeout_s=30,
        message="step 9 everywhere",
    )
    late_dht = start_dht(visible_maddrs(dhts[0]), host_maddrs=LOOPBACK, nat_port_map=False)
    late = ManifestGossip(late_dht, run_id=RUN, verify=verify, peers=lambda: [])
    try:
        data = wait_until(late.fetch_newest_from_index, timeout_s=30, message="the index")
        assert verify(data)[1] == 9
    finally:
        late.close()
        stop_dht(late_dht)


@pytest.mark.timeout(120)
def test_a_manifest_is_never_pushed_to_the_group_that_sealed_it(swarm_of_gossips):
    _dhts, gossips = swarm_of_gossips
    holders = {g.peer_id for g in gossips[4:]}  # they signed it: they hold it already
    received = [g.received for g in gossips]
    for g in gossips:
        g.holders = lambda data: holders
    try:
        assert gossips[0].publish(sealed_manifest(11, [Identity.generate(), Identity.generate()]))
        wait_until(
            lambda: all(g.newest is not None and g.newest[0] == 11 for g in gossips[:4]),
            timeout_s=30,
            message="step 11 spread",
        )
        wait_until(lambda: not any(g._forwarding for g in gossips), timeout_s=30, message="forwards in flight")
        assert sum(g.received - r for g, r in zip(gossips[1:4], received[1:4])) >= 3  # the others were pushed it
        assert [g.received - r for g, r in zip(gossips[4:], received[4:])] == [0] * 4  # the holders never
    finally:
        for g in gossips:
            g.holders = lambda data: ()


@pytest.mark.timeout(120)
def test_the_ring_reaches_every_peer_even_when_the_random_pushes_reach_none(swarm_of_gossips, monkeypatch):
    """Each peer forwards news to its successor on the ring of peer IDs too, so a peer the random fanout
    missed hears it one hop after its predecessor. Here the random pushes go nowhere at all: only the
    ring spreads the manifest, and every peer is pushed it (not pulled: the push counters rise)."""
    dhts, gossips = swarm_of_gossips
    draws = []
    monkeypatch.setattr("swarm.checkpoint.gossip.random.sample", lambda seq, k: draws.append(k) or [])
    received = [g.received for g in gossips]
    assert gossips[0].publish(sealed_manifest(1000, [Identity.generate(), Identity.generate()]))
    wait_until(
        lambda: all(g.newest is not None and g.newest[0] == 1000 for g in gossips),
        timeout_s=30,
        message="step 1000 along the ring",
    )
    assert len(draws) >= NUM_PEERS - 1 and all(k > 0 for k in draws)  # the fault fired: no random target
    assert all(g.received > r for g, r in zip(gossips[1:], received[1:])), "every peer was pushed it"


def test_a_member_accepts_its_own_seal_before_it_has_seen_its_co_signers_records():
    """Sybil guard: a manifest counts only signers with live records in the run, except on a seal this
    peer signed itself (it averaged with that group and checked each co-signature), so a member whose
    record cache is older than its partner's record still keeps, announces and serves its own seal."""
    from swarm.checkpoint.sync import CheckpointManager

    me, partner, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    manager = CheckpointManager.__new__(CheckpointManager)  # _verify only: no DHT needed
    manager.identity, manager.run_id, manager.task, manager.config_digest = me, RUN, "charlm", "a" * 64
    manager.run_peers = lambda: set()  # neither co-signer's record has been read yet
    manager.manifest_rejections = Counter()
    ours = sealed_manifest(4, [me, partner])
    assert manager._verify(ours)[1] == 4
    with pytest.raises(ValueError, match="unknown signers"):  # the same for a group this peer was not in
        manager._verify(sealed_manifest(4, [partner, stranger]))
    manager.run_peers = lambda: {partner.peer_id, stranger.peer_id}
    assert manager._verify(sealed_manifest(4, [partner, stranger]))[1] == 4


@pytest.mark.timeout(120)
def test_a_seal_and_close_end_in_bounded_time_when_the_dht_process_died(tmp_path, monkeypatch) -> None:
    """A DHT whose process died never answers: sealing (store of this peer's signature, reads of the others')
    must give up after its deadline, and `close` must return soon: a terminal's Ctrl+C kills the DHT's process and
    its daemon with the peer, whose leave then waited 5 s a handler on calls no one would answer."""
    import os
    import signal

    import psutil
    import torch

    from bootstrap.network import start_swarm_dht
    from swarm.checkpoint import posts, sync
    from tests.helpers import descendants

    monkeypatch.setattr(posts, "DHT_TIMEOUT_S", 0.5)
    me, partner = Identity.generate(), Identity.generate()
    dht = start_swarm_dht(me, host_maddrs=LOOPBACK)
    tree = descendants(dht.pid)
    manager = sync.CheckpointManager(
        dht, identity=me, run_id=RUN, task="teacher", config_digest="a" * 64, directory=tmp_path, keep_last=2,
        run_peers=set, seal_timeout_s=2.0, receipt_timeout_s=1.0,
    )  # fmt: skip
    try:
        os.kill(dht.pid, signal.SIGKILL)  # the fault: the DHT's process is gone, and its daemon with it
        for process in tree:
            with contextlib.suppress(Exception):
                process.kill()
        dht.join(10)
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert not dht.is_alive() and tree and not alive, (tree, alive)
        seal = sync.SealRequest(
            state={"w": torch.zeros(4)}, step=1, participants=tuple(sorted([me.peer_id, partner.peer_id])),
            created_at=int(time.time()), parent="",
        )  # fmt: skip
        started = time.monotonic()
        assert manager.finish_round_async(receipt=None, seal=seal).result(timeout=30) is False  # not sealed
        assert time.monotonic() - started < 15
        started = time.monotonic()
        manager.close()  # its handlers' farewells to the dead daemon are cut to 0.5 s each (`closing_timeout`)
        assert time.monotonic() - started < 5
    finally:
        for process in tree:
            with contextlib.suppress(Exception):
                process.kill()
        stop_dht(dht)


def _lone_manager(me: Identity, directory: Path) -> tuple:
    """A DHT of its own and a `CheckpointManager` on it (the sealer's tests: their work is replaced)."""
    from bootstrap.network import start_swarm_dht
    from swarm.checkpoint import sync

    dht = start_swarm_dht(me, host_maddrs=LOOPBACK)
    manager = sync.CheckpointManager(
        dht, identity=me, run_id=RUN, task="teacher", config_digest="a" * 64, directory=directory, keep_last=2,
        run_peers=set, seal_timeout_s=30.0, receipt_timeout_s=1.0,
    )  # fmt: skip
    return dht, manager


def test_flush_waits_for_the_last_rounds_work_and_a_stop_request_ends_the_wait(tmp_path, monkeypatch) -> None:
    """`Trainer.finish` waits (`CheckpointManager.flush`) for the sealer's last work, so the state a run ends at is
    sealed; a stop request (Ctrl+C) ends that wait within 0.1 s. The work here blocks until released."""
    import threading

    import torch

    from swarm.checkpoint import sync

    me = Identity.generate()
    dht, manager = _lone_manager(me, tmp_path)
    release, stop, done = threading.Event(), threading.Event(), []

    def work(receipt: object, round_: int) -> bool:
        release.wait(30)
        done.append(round_)
        return True

    monkeypatch.setattr(manager, "_finish_round", work)
    try:
        assert manager.flush()  # nothing submitted: at once
        for step in (1, 2):
            seal = sync.SealRequest(
                state={"w": torch.zeros(2)}, step=step, participants=(me.peer_id,), created_at=1, parent=""
            )
            manager.finish_round_async(receipt=None, seal=seal)
        threading.Timer(0.3, stop.set).start()
        started = time.monotonic()
        assert manager.flush(cancel=stop) is False  # still at work: the stop request ended the wait
        assert 0.25 < time.monotonic() - started < 2.0 and done == []
        threading.Timer(0.3, release.set).start()
        assert manager.flush() is True and done == [1, 2]  # the last work submitted, so all before it too
    finally:
        release.set()
        manager.close()
        stop_dht(dht)


def test_a_seal_overtaken_while_it_waits_for_the_sealer_is_dropped_at_once(tmp_path, monkeypatch) -> None:
    """Rounds that come faster than the disk seals them (a large model): a seal still waiting for the sealer when
    a newer round comes is dropped at once, so the sealer's queue holds one copy of the state, not one a round
    (before stop 62 each waited in the queue with its copy until the sealer skipped it). The sealer is held on
    round 1's seal while rounds 2-4 come; then it seals round 4, the newest, and neither 2 nor 3."""
    import gc
    import threading

    import torch

    from swarm.checkpoint import sync

    me = Identity.generate()
    dht, manager = _lone_manager(me, tmp_path)
    holding, release, sealed = threading.Event(), threading.Event(), []

    def seal_(seal: sync.SealRequest, receipts: object) -> bool:
        holding.set()
        release.wait(30)
        sealed.append(seal.step)
        return True

    monkeypatch.setattr(manager, "_seal", seal_)
    shape = (4321,)  # this test's states, told apart from every other tensor in the process

    def copies() -> int:
        """Tensors of this test's states alive anywhere in the process, clones included."""
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and tuple(o.shape) == shape)

    try:
        for step in (1, 2, 3, 4):
            seal = sync.SealRequest(
                state={"w": torch.zeros(shape)}, step=step, participants=(me.peer_id,), created_at=1, parent=""
            )
            manager.finish_round_async(receipt=None, seal=seal)
            del seal
            if step == 1:  # the fault: the sealer is busy with round 1 while the next rounds come
                assert holding.wait(10), "the sealer never took up round 1"
        assert copies() == 2, "only round 1's state (being sealed) and round 4's (waiting) may be kept"
        release.set()
        assert manager.flush() is True and sealed == [1, 4]
    finally:
        release.set()
        manager.close()
        stop_dht(dht)


@pytest.mark.timeout(120)
def test_a_fresh_joiner_offered_an_old_manifest_as_newest_still_ends_on_the_newest(swarm_of_gossips):
    """TESTMATRIX row 13 for a peer that trusts no manifest yet: an insider replays an old, validly signed
    manifest, pushed to the joiner first and written as its own entry of the run's index (the only entry it
    can write: the others are owner-bound). The joiner takes the newest the index holds, as `load_newest`
    does (the index, then publish), and the old one is not news to anyone."""
    dhts, gossips = swarm_of_gossips
    signers = [Identity.generate(), Identity.generate()]
    newest = max((g.newest[0] for g in gossips if g.newest is not None), default=10) + 10
    assert gossips[0].publish(sealed_manifest(newest, signers))
    wait_until(lambda: all(g.newest is not None and g.newest[0] == newest for g in gossips), timeout_s=30,
               message="the newest everywhere")  # fmt: skip
    old = sealed_manifest(4, signers)
    insider = gossips[1]
    problem = store_within(
        insider.dht, index_key(RUN), {"step": 4, "digest": verify(old)[0], "manifest": old},
        subkey=insider.peer_id, expiration_time=get_dht_time() + 3600, timeout_s=10,
    )  # fmt: skip
    assert problem is None, problem
    late_dht = start_dht(visible_maddrs(dhts[0]), host_maddrs=LOOPBACK, nat_port_map=False)
    late = ManifestGossip(late_dht, run_id=RUN, verify=verify, peers=lambda: [])
    try:
        entries = wait_until(
            lambda: (found := latest_within(late_dht, index_key(RUN), timeout_s=10)) and found.value,
            timeout_s=30,
            message="the index",
        )
        assert 4 in {item.value["step"] for item in entries.values()}  # the fault is in place
        assert late.publish(old) and late.newest[0] == 4  # pushed first: a joiner with nothing takes it
        data = wait_until(late.fetch_newest_from_index, timeout_s=30, message="the index")
        assert verify(data)[1] == newest
        late.publish(data)
        assert late.newest[0] == newest
        assert not gossips[2].publish(old)  # old news to a peer that holds the newest
    finally:
        late.close()
        stop_dht(late_dht)


@pytest.mark.timeout(120)
def test_a_peer_refuses_a_pushed_manifest_of_another_model_or_of_unknown_signers(swarm_of_gossips, tmp_path):
    """TESTMATRIX row 12 on the sync path, live: a `CheckpointManager` is pushed, over P2P, validly signed
    manifests that only its own checks refuse (another model's config digest; signers with no live record in
    the run), each counted once and never taken as its newest; the same manifest from known signers is."""
    from bootstrap.network import start_swarm_dht
    from swarm.checkpoint import sync

    dhts, gossips = swarm_of_gossips
    me, signers, known = Identity.generate(), [Identity.generate(), Identity.generate()], set()
    dht = start_swarm_dht(me, initial_peers=visible_maddrs(dhts[0]), host_maddrs=LOOPBACK)
    manager = sync.CheckpointManager(
        dht, identity=me, run_id=RUN, task="charlm", config_digest="a" * 64, directory=tmp_path, keep_last=2,
        run_peers=lambda: known,
    )  # fmt: skip
    pusher, peers = gossips[0], gossips[0].peers
    pusher.peers = lambda: [me.peer_id]  # it pushes to this peer alone
    try:
        step = max((g.newest[0] for g in gossips if g.newest is not None), default=10) + 10
        cases = [("another model", {"config_digest": "b" * 64}), ("unknown signers", {})]
        for i, (reason, fields) in enumerate(cases, start=1):
            assert pusher.publish(sealed_manifest(step + i, signers, **fields))
            wait_until(lambda reason=reason: manager.gossip.rejected[reason] == 1, timeout_s=30,
                       message=lambda reason=reason: f"{reason}: {manager.gossip.rejected}")  # fmt: skip
        assert manager.gossip.newest is None and sum(manager.gossip.rejected.values()) == 2
        known.update(s.peer_id for s in signers)  # the negative control: their records are live now
        assert pusher.publish(sealed_manifest(step + 3, signers))
        wait_until(lambda: manager.gossip.newest is not None, timeout_s=30, message="the good manifest")
        assert manager.gossip.newest[0] == step + 3 and sum(manager.gossip.rejected.values()) == 2
    finally:
        pusher.peers = peers
        manager.close()
        stop_dht(dht)
