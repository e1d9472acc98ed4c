"""Verified work (swarm.verify, swarm.work): commitments, spot-check replays, verdicts, exclusion.

The pure tests run peers' phases in one process and check them against a single-process replay;
the end-to-end test runs honest peers and cheaters as separate processes of a user's script on
`swarm.Trainer` and requires every cheater, and a lying verifier, to be excluded by the honest peers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from averaging.group import part_digest, part_statement, piece_bounds, sign_part, slice_bounds
from bootstrap import stop_dht, visible_maddrs
from bootstrap.framing import LENGTH, write_blob
from bootstrap.identity import Identity
from bootstrap.network import start_swarm_dht
from swarm import verify
from swarm import work as work_module
from swarm.config import TaskInfo, WorkConfig, averaging_prefix
from swarm.recipe import inner_step
from swarm.replayer import CannotReplayHere, Replayer, ReplayerError, random_in_training
from swarm.tasks import get_task
from swarm.work import WorkChecks, WorkSpec, _Standing
from tests.helpers import Child, python_cmd, spawn, terminate_all, wait_until

RUN = "verified-work"
TASK = get_task("teacher", preset="tiny")
DIGEST = TaskInfo.of(TASK, "tiny").config_digest
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
STEPS, SEGMENT, WARMUP = 10, 5, 4


class SimPeer:
    """One peer of an in-process run: its own model, AdamW, shard and recorder; ``cheat`` as in the script."""

    def __init__(self, shard: int, cheat: str = "") -> None:
        self.identity, self.cheat, self.shard = Identity.generate(), cheat, shard
        self.model = TASK.build_model(seed=0)
        self.params = verify.trainable(self.model)
        self.optimizer = torch.optim.AdamW(self.params, lr=3e-3, weight_decay=0.01)
        self.recorder = verify.WorkRecorder(
            TASK, peer=self.identity.peer_id, shard_index=shard, num_shards=8, segment_steps=SEGMENT
        )
        self.batches, self.other = (
            self.recorder.batches(),
            TASK.train_batches(shard_index=(shard + 1) % 8, num_shards=8),
        )
        self.step = 0
        self.last: verify.SignedCommitment | None = None

    def phase(self, base: torch.Tensor, round_: int) -> tuple[verify.SignedCommitment, torch.Tensor]:
        """Train one phase from ``base`` (the model holds it) and commit; (commitment, end parameters)."""
        self.recorder.begin(self.params, self.optimizer, first_step=self.step + 1)
        for i in range(STEPS):
            batch = next(self.batches)
            if self.cheat == "shard":
                batch = next(self.other)
            skips = self.cheat in ("free", "stale") or (self.cheat == "partial" and i >= STEPS - SEGMENT)
            if not skips:  # "partial": trains its phase's first segment, not its last
                TASK.loss(self.model, batch).backward()
            self.step += 1
            inner_step(self.optimizer, self.step, WARMUP)
            self.recorder.stepped(self.params, self.optimizer)
        signed = self.recorder.commit(
            self.params, self.optimizer, base=base, identity=self.identity, run=RUN, round_=round_,
            task_digest=DIGEST, samples=STEPS * 32, warmup_steps=WARMUP,
        )  # fmt: skip
        if self.cheat == "stale" and self.last is not None:  # last round's work, signed for this round
            old = self.last.commitment
            signed = verify.sign_commitment(_replace(old, round=round_), self.identity)
            self.recorder.kept[round_] = self.recorder.kept[old.round]
        self.last = signed
        return signed, verify.flat_params(self.params)

    def load(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            offset = 0
            for p in self.params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


def _replace(commitment: verify.Commitment, **fields) -> verify.Commitment:
    return verify.Commitment(
        **{**commitment.to_dict(), "params": commitment.params, "inner": commitment.inner, **fields}
    )


def _run(peers: list[SimPeer], rounds: int, *, rate: float) -> list[tuple[SimPeer, SimPeer, tuple]]:
    """Rounds of plain averaging over ``peers``; every drawn check: (prover, verifier, (ok, reason, digest))."""
    base, results = verify.flat_params(peers[0].params), []
    for round_ in range(rounds):
        done = {}
        for peer in peers:
            peer.load(base)
            done[peer.identity.peer_id] = (peer, *peer.phase(base, round_))
        commitments = {
            pid: verify.verify_commitment(signed.to_dict(), run=RUN).commitment for pid, (_, signed, _) in done.items()
        }
        seed = hashlib.sha256(f"round {round_}".encode()).hexdigest()
        for a in verify.draw_checks(seed, commitments, rate=rate):
            prover, verifier = done[a.prover][0], done[a.verifier][0]
            inputs = prover.recorder.inputs(round_, a.segment)
            wire = verify.ReplayInputs.from_bytes(inputs.to_bytes()) if inputs is not None else None
            outcome = verify.check(TASK, DIGEST, commitments[a.prover], a.segment, wire, base=base)
            results.append((prover, verifier, outcome, a.segment))
        base = torch.stack([end for _, _, end in done.values()]).mean(0)
    return results


def test_honest_work_replays_exactly_over_200_checked_contributions() -> None:
    peers = [SimPeer(shard) for shard in range(4)]
    results = _run(peers, 50, rate=1.0)
    assert len(results) >= 200
    failures = [(outcome, segment) for _, _, outcome, segment in results if not outcome[0]]
    assert failures == []  # 0 false accusations
    assert {segment for *_, segment in results} == {0, 1}  # both segments of a phase were drawn


@pytest.mark.parametrize(
    ("cheat", "reason"),
    [("free", "replay differs"), ("shard", "replay differs"), ("stale", "not from the round's base")],
)
def test_a_cheater_fails_every_check_and_honest_peers_pass(cheat: str, reason: str) -> None:
    peers = [SimPeer(0), SimPeer(1), SimPeer(2, cheat)]
    results = _run(peers, 3, rate=1.0)
    by_prover = {}
    for prover, verifier, outcome, _ in results:
        assert prover is not verifier
        by_prover.setdefault(prover.cheat, []).append(outcome)
    assert all(ok for ok, *_ in by_prover[""])
    cheated = by_prover[cheat][1:] if cheat == "stale" else by_prover[cheat]  # stale: from its second round on
    assert cheated and all(not ok and why == reason for ok, why, _ in cheated), cheated


def test_a_peer_that_skips_one_segment_is_caught_exactly_when_that_segment_is_drawn() -> None:
    """The bound on a partial cheater (verify's module docstring): it trains the first of its phase's two
    segments and skips the second, so a check catches it exactly when it draws the skipped segment: with
    probability f = 1/2 a check, ``rate x f`` a round. Drawn over 12 rounds: every check of the skipped
    segment fails, every check of the trained one passes, and honest peers pass."""
    peers = [SimPeer(0), SimPeer(1), SimPeer(2, "partial")]
    results = _run(peers, 12, rate=1.0)
    cheater = [(segment, outcome[:2]) for prover, _, outcome, segment in results if prover.cheat == "partial"]
    assert {segment for segment, _ in cheater} == {0, 1}  # both drawn: the test sees both sides of the bound
    assert all(
        outcome == ((True, "match") if segment == 0 else (False, "replay differs")) for segment, outcome in cheater
    )
    assert all(outcome[0] for prover, _, outcome, _ in results if not prover.cheat)


@pytest.mark.parametrize("steps", [40, 70])
def test_a_long_phase_gets_longer_segments_and_a_longer_one_than_expected_is_not_committed(steps: int) -> None:
    peer = SimPeer(0)
    peer.recorder.segment_steps = 1
    base = verify.flat_params(peer.params)
    peer.recorder.begin(peer.params, peer.optimizer, first_step=1, expected_steps=40)  # 40 / 32: 2 steps a segment
    for step in range(1, steps + 1):
        TASK.loss(peer.model, next(peer.batches)).backward()
        inner_step(peer.optimizer, step, WARMUP)
        peer.recorder.stepped(peer.params, peer.optimizer)
        assert len(peer.recorder.phase.boundaries) <= verify.MAX_BOUNDARIES  # memory stays bounded
    signed = peer.recorder.commit(
        peer.params, peer.optimizer, base=base, identity=peer.identity, run=RUN, round_=0,
        task_digest=DIGEST, samples=steps, warmup_steps=WARMUP,
    )  # fmt: skip
    if steps > 2 * (verify.MAX_BOUNDARIES - 1):
        assert signed is None  # 35 segments: more than a commitment may name
        return
    commitment = verify.verify_commitment(signed.to_dict(), run=RUN).commitment
    assert (commitment.segment_steps, commitment.segments) == (2, 20)
    wire = verify.ReplayInputs.from_bytes(peer.recorder.inputs(0, 13).to_bytes())
    assert verify.check(TASK, DIGEST, commitment, 13, wire, base=base)[:2] == (True, "match")
    streams = verify.Streams(TASK)  # a verifier's streams, reused: forward from where they stopped, or from the start
    for segment in (2, 13, 19, 0, 7):
        inputs = peer.recorder.inputs(0, segment)
        assert verify.check(TASK, DIGEST, commitment, segment, inputs, base=base, streams=streams)[0], segment
    assert verify.check(TASK, DIGEST, commitment, 13, wire, base=base, streams=streams)[0]


def test_a_lying_verifier_is_shown_wrong_by_a_third_replay() -> None:
    honest, liar = SimPeer(0), SimPeer(1)
    base = verify.flat_params(honest.params)
    signed, _ = honest.phase(base, 0)
    inputs = honest.recorder.inputs(0, 1)
    lie = verify.verify_verdict(verify.verdict_of(liar.identity, signed.commitment, 1, (False, "replay differs", "")))
    assert verify.arbitrate(TASK, DIGEST, signed, lie, inputs, base=base) == "verifier"
    truth = verify.check(TASK, DIGEST, signed.commitment, 1, inputs, base=base)
    fair = verify.verify_verdict(verify.verdict_of(liar.identity, signed.commitment, 1, truth))
    assert truth[0] and verify.arbitrate(TASK, DIGEST, signed, fair, inputs, base=base) == "agree"
    cheat = SimPeer(2, "free")
    cheat.load(base)
    bad, _ = cheat.phase(base, 0)
    accusation = verify.check(TASK, DIGEST, bad.commitment, 0, cheat.recorder.inputs(0, 0), base=base)
    verdict = verify.verify_verdict(verify.verdict_of(honest.identity, bad.commitment, 0, accusation))
    assert not accusation[0]
    assert verify.arbitrate(TASK, DIGEST, bad, verdict, cheat.recorder.inputs(0, 0), base=base) == "prover"


def test_untrusted_commitments_verdicts_and_inputs_are_refused_with_a_reason() -> None:
    peer = SimPeer(0)
    base = verify.flat_params(peer.params)
    signed, _ = peer.phase(base, 0)
    data = signed.to_dict()
    assert verify.verify_commitment(json.dumps(data).encode(), run=RUN).commitment == signed.commitment
    forged = {**data, "commitment": {**data["commitment"], "samples": 10**6}}
    cases = {
        "bad signature": forged,
        "another run": data,
        "malformed": {**data, "commitment": {**data["commitment"], "params": data["commitment"]["params"][:1]}},
    }
    for reason, value in cases.items():
        with pytest.raises(verify.WorkRejected) as caught:
            verify.verify_commitment(value, run="other" if reason == "another run" else RUN)
        assert caught.value.reason == reason
    for garbage in (b"", b"\x00" * 16, b"{}" * 10, json.dumps({"verdict": {}}).encode()):
        with pytest.raises(verify.WorkRejected):
            verify.verify_verdict(garbage)
        with pytest.raises(verify.WorkRejected):
            verify.ReplayInputs.from_bytes(garbage)
    inputs = peer.recorder.inputs(0, 0)
    bent = verify.ReplayInputs(
        verify.Boundary(inputs.start.params, verify.InnerState(inputs.start.inner.tensors, "[{}]")), inputs.end_params
    )
    assert (
        verify.check(TASK, DIGEST, signed.commitment, 0, bent, base=base)[1]
        == "served start differs from the commitment"
    )
    assert verify.check(TASK, DIGEST, signed.commitment, 0, None, base=base)[1] == "inputs refused"
    assert verify.check(TASK, "0" * 64, signed.commitment, 0, inputs, base=base)[1] == "another task"
    # a commitment that would keep its verifier busy for ever (a billion steps to replay, or to skip) is not
    # replayed at all (the check fails at once)
    endless = _replace(signed.commitment, steps=10**9, segment_steps=10**9 // 2)
    far = _replace(signed.commitment, stream_start=2**40)
    for bad in (endless, far):
        assert verify.check(TASK, DIGEST, bad, 0, inputs, base=base)[1] == "not replayable"


def test_the_draw_is_the_same_everywhere_and_never_self_verifies() -> None:
    peers = [SimPeer(i) for i in range(5)]
    base = verify.flat_params(peers[0].params)
    commitments = {p.identity.peer_id: p.phase(base, 0)[0].commitment for p in peers}
    draws = [verify.draw_checks(f"seed {i}", commitments, rate=0.6) for i in range(200)]
    assert draws[7] == verify.draw_checks("seed 7", dict(reversed(list(commitments.items()))), rate=0.6)
    checked = sum(len(d) for d in draws) / (200 * len(peers))
    assert 0.5 < checked < 0.7
    assert all(a.prover != a.verifier and 0 <= a.segment < 2 for d in draws for a in d)
    assert verify.draw_checks("x", dict(list(commitments.items())[:1]), rate=1.0) == []


def test_a_provers_draw_is_salted_by_the_last_pieces_of_the_result_but_not_by_its_own_slice() -> None:
    """Known before the all-reduce, the draw would tell a prover which reducer checks the part it sends (it
    could send another update to all the others). Each prover's draw is salted by the last piece of every slice
    of the round's result (`work_module.result_salts`: known only once every member sent all of its part) but
    its own slice (whose aggregate it could choose to steer its draw). Without salts (the negative control) a
    prover's verifier is the same whatever the result."""
    peers = [SimPeer(i) for i in range(4)]
    base = verify.flat_params(peers[0].params)
    commitments = {p.identity.peer_id: p.phase(base, 0)[0].commitment for p in peers}
    members = sorted(commitments)
    averaged = torch.randn(4000, generator=torch.Generator().manual_seed(0))
    salts = work_module.result_salts(averaged, members, piece_numel=300)
    lo, hi = slice_bounds(4000, 4)[1]
    own = averaged.clone()
    own[hi - 1] += 1.0  # the last piece of member 1's own slice
    changed = work_module.result_salts(own, members, 300)
    assert changed[members[1]] == salts[members[1]]
    assert all(changed[m] != salts[m] for m in members if m != members[1])
    early = averaged.clone()
    early[lo + piece_bounds(hi - lo, 300)[-1][0] - 1] += 1.0  # just before that slice's last piece
    assert work_module.result_salts(early, members, 300) == salts
    salted, unsalted = set(), set()
    for i in range(60):
        result = torch.randn(4000, generator=torch.Generator().manual_seed(i))
        for a in verify.draw_checks(
            "seed", commitments, rate=1.0, salts=work_module.result_salts(result, members, 300)
        ):
            salted |= {a.verifier} if a.prover == members[0] else set()
        unsalted |= {a.verifier for a in verify.draw_checks("seed", commitments, rate=1.0) if a.prover == members[0]}
    assert salted == set(members[1:]) and len(unsalted) == 1


def test_a_verifier_checks_a_prover_less_once_it_passed_enough_of_its_checks_itself() -> None:
    config = WorkConfig(check_rate=0.9, trusted_rate=0.25, trust_after=4)
    peers = [SimPeer(i) for i in range(3)]
    base = verify.flat_params(peers[0].params)
    commitments = {p.identity.peer_id: p.phase(base, 0)[0].commitment for p in peers}
    _, honest, cheat = sorted(commitments)
    standing = _Standing()
    standing.passed[honest] = config.trust_after  # four of its checks passed here; `cheat` has passed none
    rates = {honest: config.trusted_rate, cheat: config.check_rate}
    draws = [
        verify.draw_checks(f"seed {i}", commitments, rate=lambda p, _: standing.rate(config, p)) for i in range(2000)
    ]
    for prover in (honest, cheat):
        drawn = [d for d in draws if any(a.prover == prover for a in d)]
        verified_by = {a.verifier for d in draws for a in d if a.prover == prover}
        assert abs(len(drawn) / 2000 - rates[prover]) < 0.04 and len(verified_by) == 2
    # a flat rate draws exactly what the callable draws at that rate (the draw itself did not change)
    assert verify.draw_checks("s", commitments, rate=0.6) == verify.draw_checks("s", commitments, rate=lambda *_: 0.6)
    with pytest.raises(ValueError, match="trusted_rate"):
        WorkConfig(trusted_rate=1.5)


def test_same_bits_is_what_equal_digests_mean() -> None:
    a = torch.tensor([0.0, 1.5, float("nan")])
    assert verify.same_bits(a, a.clone()) and verify.params_digest(a) == verify.params_digest(a.clone())
    signed_zero = torch.tensor([-0.0, 1.5, float("nan")])  # equal values, other bytes: other digests
    assert not verify.same_bits(a, signed_zero) and verify.params_digest(a) != verify.params_digest(signed_zero)
    assert not verify.same_bits(a, a.double()) and not verify.same_bits(a, a[:2])


def test_a_prover_keeps_its_last_phases_and_recent_older_ones_within_a_byte_budget(monkeypatch) -> None:
    recorder = verify.WorkRecorder(TASK, peer="p", shard_index=0, num_shards=1)
    now = [1000.0]
    monkeypatch.setattr(verify.time, "monotonic", lambda: now[0])
    boundary = verify.Boundary(torch.zeros(256), verify.InnerState({"0.exp_avg": torch.zeros(256)}, "[]"))  # 2 KiB
    for round_, age_s in enumerate([50.0, 20.0, 10.0, 5.0, 1.0, 0.0]):
        recorder.kept[round_] = verify.Phase(0, 0, [boundary], segment_steps=1, committed_at=now[0] - age_s)
    recorder.forget(3)  # by count alone, as before
    assert list(recorder.kept) == [3, 4, 5]
    for round_, age_s in enumerate([50.0, 20.0, 10.0]):
        recorder.kept[round_] = verify.Phase(0, 0, [boundary], segment_steps=1, committed_at=now[0] - age_s)
    recorder.kept = dict(sorted(recorder.kept.items()))
    recorder.forget(3, keep_for_s=30.0, max_bytes=1 << 20)  # the one older than 30 s goes
    assert list(recorder.kept) == [1, 2, 3, 4, 5]
    recorder.forget(3, keep_for_s=30.0, max_bytes=4 * 2048)  # over the byte budget: the oldest go first
    assert list(recorder.kept) == [2, 3, 4, 5]
    now[0] += 60.0
    recorder.forget(3, keep_for_s=30.0, max_bytes=1 << 20)  # all old now: the last 3 stay whatever their age
    assert list(recorder.kept) == [3, 4, 5]


def test_a_check_rounds_behind_is_still_run_while_the_prover_keeps_its_phase() -> None:
    """Under load a verifier's checks fall rounds behind its own rounds. Skipped as late after `KEEP_ROUNDS`
    rounds, they let a cheater into rounds more (seen: a stale update in 6 of an honest peer's rounds, bar 5);
    a prover keeps phases younger than `KEEP_FOR_S` too, so a check is late only once it also waited
    `LATE_AFTER_S`."""
    checks = object.__new__(WorkChecks)
    checks._lag, checks.counts = work_module._Lag(newest_round=10), Counter()
    now = time.monotonic()
    assert not checks._late(9, now - 1000)  # one round behind: never late
    assert not checks._late(5, now)  # five rounds behind, drawn just now: asked for
    assert not checks._late(5, now - work_module.LATE_AFTER_S + 1)
    assert checks.counts["late"] == 0
    assert checks._late(5, now - work_module.LATE_AFTER_S - 1)  # waited too long: the prover may have dropped it
    assert checks._late(5)  # a check with no time (one asked again): by rounds alone
    assert checks.counts["late"] == 2


def test_the_worker_runs_re_checks_of_accusations_before_routine_checks_and_stops_between_jobs() -> None:
    """A re-check settles an exclusion, a routine check may only start one: queued behind a round's routine
    checks (one link window each), a re-check of a published verdict came rounds late (seen: a cheater in 6
    of an honest peer's rounds, bar 5)."""
    counts: Counter[str] = Counter()
    worker = work_module._Worker("test worker", counts)
    busy, ran = threading.Event(), []
    worker.submit(busy.wait, 10.0)  # holds the worker while the others queue
    for name in ("routine 1", "routine 2"):
        worker.submit(ran.append, name)
    worker.submit(ran.append, "re-check", priority=work_module._Worker.URGENT)
    worker.submit(ran.append, "routine 3")
    busy.set()
    wait_until(lambda: len(ran) == 4, 10)
    assert ran == ["re-check", "routine 1", "routine 2", "routine 3"]
    started, release = threading.Event(), threading.Event()
    worker.submit(lambda: (started.set(), release.wait(10.0)))
    assert started.wait(10)
    worker.submit(ran.append, "after stop")  # stop: the jobs still queued behind the one running are not run
    worker.stop()
    release.set()
    worker.join(10)
    assert not worker.thread.is_alive() and ran[-1] == "routine 3" and counts["internal error"] == 0


def _work_checks(
    dht, identity: Identity, spec: WorkSpec, params: list, *, warmup_steps: int = 0, exclude=lambda *_: None
) -> WorkChecks:
    """A trainer's `WorkChecks` of 4-step phases (segments of 2) in run RUN, ``params`` trained by AdamW."""
    return WorkChecks(
        dht,
        identity,
        spec,
        WorkConfig(verify_work=True, segment_steps=2),
        run=RUN,
        warmup_steps=warmup_steps,
        exclude=exclude,
        require=lambda _: None,
        record=lambda *_: None,
        params=params,
        optimizer=torch.optim.AdamW(params, lr=3e-3),
        first_step=1,
        sync_every=4,
    )


def test_replay_inputs_travel_in_chunks_and_only_between_the_verifiers_rounds(monkeypatch) -> None:
    monkeypatch.setattr(work_module, "CHUNK_BYTES", 4096)  # teacher tiny's inputs are a few chunks of this
    ids = [Identity.generate(), Identity.generate()]
    dhts = [start_swarm_dht(ids[0], host_maddrs=LOOPBACK)]
    dhts.append(start_swarm_dht(ids[1], initial_peers=visible_maddrs(dhts[0]), host_maddrs=LOOPBACK))
    checks: list[WorkChecks] = []
    model = TASK.build_model(seed=0)
    replayer = None
    try:
        for dht, identity in zip(dhts, ids):
            params = verify.trainable(model if not checks else TASK.build_model(seed=0))
            spec = WorkSpec(task=TASK, task_digest=DIGEST, shard_index=len(checks), num_shards=8)
            checks.append(_work_checks(dht, identity, spec, params, warmup_steps=WARMUP))
        prover, verifier = checks
        base = verify.flat_params(prover.params)
        for step, batch in zip(range(1, 5), prover.batches()):
            TASK.loss(model, batch).backward()
            inner_step(prover.optimizer, step, WARMUP)
            prover.stepped()
        end = verify.flat_params(prover.params)
        signed = prover.commit(SimpleNamespace(state=base, delta=base - end), samples=4, round_=0)
        commitment = verify.verify_commitment(signed, run=RUN).commitment
        prover.begin(first_step=5)
        expected = prover.recorder.inputs(0, 1).to_bytes()
        assert len(expected) > 3 * 4096

        verifier._lag.quiet.clear()  # the verifier's round is in flight: its check's transfer waits
        fetched: dict = {}
        fetch = threading.Thread(target=lambda: fetched.update(inputs=verifier._fetch(ids[0].peer_id, 0, 1)))
        fetch.start()
        fetch.join(1.0)
        assert fetch.is_alive() and not fetched and prover.counts["served chunks"] == 0
        verifier._lag.quiet.set()  # the round ended
        fetch.join(60)
        assert not fetch.is_alive() and fetched["inputs"].to_bytes() == expected
        assert prover.counts["served chunks"] == -(-len(expected) // 4096)
        assert verify.check(TASK, DIGEST, commitment, 1, fetched["inputs"], base=base)[:2] == (True, "match")
        # the same check with replays in a process of their own (a task that draws random numbers does so)
        replayer, verifier.replays.random = verifier.replays.replayer(verify.cpu_capability()), True
        verifier._check_one(commitment, signed, 1, base)
        assert verifier.counts["passed"] == 1 and replayer.started == 1, verifier.counts
        verifier.replays.random = False
        # require_verified: a commitment at a CPU kernel level this peer cannot replay is refused (it would
        # escape every check here), an honest one is admitted
        assert verifier._policy(ids[0].peer_id, {"work": signed}) is None
        elsewhere = verify.sign_commitment(_replace(commitment, cpu="NOSUCHLEVEL"), ids[0]).to_dict()
        assert "cannot replay (NOSUCHLEVEL)" in verifier._policy(ids[0].peer_id, {"work": elsewhere})
        # and a check of it gives no verdict, and starts no process for that level
        verifier._check_one(_replace(commitment, cpu="NOSUCHLEVEL"), elsewhere, 1, base)
        assert verifier.counts["cannot replay here"] == 1 and list(verifier.replays.apart) == [verify.cpu_capability()]
        assert verifier.counts["checks"] == 1, verifier.counts
        # a chunk cut off mid-stream (p2pd resets a stream whose serving end went away) is a link failure, asked
        # again, never the prover's answer: before, it counted as malformed inputs, a refusal, and an exclusion
        cuts: list[int] = []

        async def cut_once(writer, data: bytes) -> None:
            if cuts:
                return await write_blob(writer, data)
            cuts.append(len(data))
            writer.write(LENGTH.pack(len(data)) + data[: len(data) // 2])
            await writer.drain()
            writer.transport.abort()

        monkeypatch.setattr(work_module, "write_blob", cut_once)
        assert verifier._fetch(ids[0].peer_id, 0, 1).to_bytes() == expected
        assert cuts == [4096] and not any(key.startswith("rejected") for key in verifier.counts), verifier.counts
        monkeypatch.undo()
        monkeypatch.setattr(work_module, "CHUNK_BYTES", 4096)
        assert verifier._fetch(ids[0].peer_id, 7, 0) is None  # a phase it does not have: refused, not unreachable
        assert ids[0].peer_id not in verifier._lag.unreachable
        # a phase it dropped for newer ones answers "forgotten": a refusal when asked at once (the verifier's own
        # round is 1), a skip when the verifier's round moved 2 on while it asked (`_late`)
        prover.recorder.kept = {5: prover.recorder.kept.pop(0)}
        prover._served.clear()
        with pytest.raises(work_module._Forgotten):
            verifier._fetch(ids[0].peer_id, 0, 1)
        verifier._lag.newest_round = 1
        verifier._check_one(commitment, signed, 1, base)
        assert verifier.counts["refused"] == 1 and ids[0].peer_id in verifier.standing.excluded
        own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # replays yield the CPU to training
        assert os.getpriority(os.PRIO_PROCESS, verifier._worker.thread.native_id) == min(19, own + 10)
        assert os.getpriority(os.PRIO_PROCESS, replayer._proc.pid) == min(19, own + 10)
    finally:
        for item in checks:
            item.close()
        for dht in dhts:
            stop_dht(dht)
    assert replayer._proc is None  # closed with the checks


SCRIPT = """
import json, sys, torch, swarm
from pathlib import Path
from swarm import verify
from swarm.config import TaskInfo
from swarm.tasks import get_task
from swarm.work import WorkSpec

mode, key, shard, ledgers, *initial_peers = sys.argv[1:]
task = get_task("teacher", preset="tiny")
info = TaskInfo.of(task, "tiny")
model = task.build_model(seed=0)
spec = WorkSpec(task=task, task_digest=info.config_digest, shard_index=int(shard), num_shards=8)
other = task.train_batches(shard_index=(int(shard) + 1) % 8, num_shards=8)
with swarm.Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), run="verified", identity_key=key,
                   initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], ledger_dir=ledgers,
                   checkpoint_every=0, sync_every=10, target_group_size=8, round_timeout_s=10.0, load_state=False,
                   verify_work=True, require_verified=True, task_info=info,
                   work=None if mode == "custom" else spec) as trainer:
    work = trainer.work
    print("PEER", trainer.peer_id, flush=True)
    if mode == "liar":  # trains honestly, and accuses every other member of every round
        honest_after_round = work.after_round
        def lying(group, base, *args):
            honest_after_round(group, base, *args)
            for peer, gathered in group.gathered.items():
                if str(peer) != trainer.peer_id and isinstance(gathered, dict) and gathered.get("work"):
                    c = verify.verify_commitment(gathered["work"]).commitment
                    work._publish({**verify.verdict_of(work.identity, c, 0, (False, "replay differs", "")),
                                   "work": gathered["work"]})
        work.after_round = lying
    if mode == "tamper":  # trains and commits honestly, but averages another update (its own, negated) with one
        # peer only, the target the test names once every peer is up; every other reducer gets its true update
        averager, target = trainer.group_averager, Path(ledgers).parent / "target"
        honest_write = averager._write_pieces
        async def tampered(writer, header, part, bounds, codec, record, peer):
            hit = target.exists() and peer == target.read_text()
            await honest_write(writer, header, -part if hit else part, bounds, codec, record, peer)
        averager._write_pieces = tampered
    stale = None
    own = task.train_batches(shard_index=int(shard), num_shards=8)  # a custom data loop: nothing to replay
    for batch in (own if mode == "custom" else work.batches()):
        if mode == "shard":
            task.loss(model, next(other)).backward()
        elif mode == "stale" and stale is not None:
            if trainer.local_step % 10 == 9:  # the last step of the phase: last round's update, again
                with torch.no_grad():
                    for p, g, d in zip(trainer.outer.params, trainer.outer.global_params(), stale):
                        p.copy_(g - d)
        elif mode != "free":
            task.loss(model, batch).backward()
        if mode == "stale" and stale is None and trainer.local_step % 10 == 9:
            stale = [g - p.detach() for p, g in zip(trainer.outer.params, trainer.outer.global_params())]
        result = trainer.step(num_samples=len(batch[1]))
        if result is not None:
            phases = {k: round(v, 2) for k, v in (result.record.phase_s if result.record else {}).items()}
            included = list(result.record.included) if result.record and result.group_size > 1 else []
            line = {"round": result.round, "group": result.group_size, "included": included, "phases": phases,
                    "excluded": work.standing.excluded if work else {}, "refused": work.standing.refused if work else {},
                    "counts": dict(work.counts) if work else {}}
            print("ROUND", json.dumps(line), flush=True)
"""

CHEATS = ("honest", "honest", "free", "shard", "stale")
LIAR = ("honest", "honest", "liar", "custom", "tamper")


def _rounds(child: Child) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in child.stdout_lines if line.startswith("ROUND ")]


@pytest.mark.timeout(300)
@pytest.mark.heavy(seconds=45, timed=True)
@pytest.mark.parametrize("modes", [CHEATS, LIAR], ids=["cheaters", "liar-unverified-tamperer"])
def test_cheaters_and_a_lying_verifier_are_excluded_within_5_rounds(bootstrap_node, tmp_path: Path, modes) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    children = []
    try:
        for index, mode in enumerate(modes):
            args = [
                mode,
                str(tmp_path / f"{index}.key"),
                str(index),
                str(tmp_path / f"ledgers{index}"),
                *bootstrap_node,
            ]
            children.append(spawn(python_cmd(str(script), *args)))
        ids = {}
        for child, mode in zip(children, modes):
            line = wait_until(
                lambda c=child: next((x for x in c.stdout_lines if x.startswith("PEER ")), None),
                60,
                message=child.describe,
            )
            ids[line.split()[1]] = mode
        # the tamperer's target: the first honest peer (the other sees only its true update, and must be shown)
        target = next(pid for pid, mode in ids.items() if mode == "honest")
        (tmp_path / "target").write_text(target)
        cheaters = {pid for pid, mode in ids.items() if mode not in ("honest", "custom")}
        unverified = {pid for pid, mode in ids.items() if mode == "custom"}
        honest = [c for c, mode in zip(children, modes) if mode == "honest"]

        def all_excluded() -> bool:
            last = [(_rounds(c) or [{}])[-1] for c in honest]
            refused = set().union(*(r.get("refused", {}) for r in last))  # by whichever honest peer it asked
            return all(cheaters <= set(r.get("excluded", {})) for r in last) and unverified <= refused

        wait_until(all_excluded, 200, interval_s=0.5, message=lambda: str([_rounds(c)[-3:] for c in honest]))
    finally:
        codes = terminate_all(children, timeout_s=20)
    # a clean leave with checks in flight (a replay on the worker thread must not abort the process at exit)
    assert codes == [0] * len(children), [(mode, code) for mode, code in zip(modes, codes)]
    for child, me in zip(honest, [pid for pid, mode in ids.items() if mode == "honest"]):
        rounds = _rounds(child)
        excluded, refused = rounds[-1]["excluded"], rounds[-1]["refused"]
        assert not set(excluded) & {pid for pid, mode in ids.items() if mode == "honest"}
        # a cheater's updates went into this honest peer's rounds at most 5 times before it was excluded here
        # (the tamperer's true update went into the rounds of a peer it is not targeting)
        poisoning = {p for p in cheaters if ids[p] != "tamper" or me == target}
        mixed = {pid: sum(pid in r["included"] for r in rounds) for pid in poisoning | unverified}
        assert max(mixed.values()) <= 5, {ids[p]: n for p, n in mixed.items()}
        assert all(mixed[pid] == 0 for pid in unverified), mixed  # refused up front, by this peer or its leader
        for pid in cheaters:  # once excluded here, never in this peer's groups again
            since = next(i for i, r in enumerate(rounds) if pid in r["excluded"])
            assert all(pid not in r["included"] for r in rounds[since + 1 :]), ids[pid]
        reasons = {ids[pid]: why for pid, why in excluded.items()}
        assert "falsely" in reasons.get("liar", "falsely"), reasons
        assert all("verified work required" in why for why in refused.values()), refused
        cheats = {mode: why for mode, why in reasons.items() if mode != "liar"}
        assert all("replay" in why or "base" in why for mode, why in cheats.items() if mode != "tamper"), reasons
        # its work replays: its target catches it by what it sent, and shows the others the part it signed
        why = "(its part of this peer's slice)" if me == target else "(the part it signed), confirmed here"
        assert "tamper" not in modes or f"not its committed update {why}" in cheats["tamper"], reasons
        counts = rounds[-1]["counts"]
        fired = counts.get("failed", 0) + counts.get("confirmed", 0) + counts.get("liars", 0)
        assert fired >= 1, counts  # the faults fired and were seen here


def test_an_unbound_accusation_is_judged_on_the_part_the_prover_signed() -> None:
    """An accusation that a prover averaged another update than it committed (`UNBOUND`) comes with the prover's
    signed statement of the part the accuser received. An arbiter that was in no group with either (it holds
    neither the round's base nor a part of its own) judges it on that statement against the committed update:
    the honest part shows the accuser lied, a tampered one (signed by the prover) excludes the prover. A
    statement the prover did not sign, or one of another commitment, proves nothing: nobody is excluded."""
    arbiter_id, prover_id = Identity.generate(), Identity.generate()
    accusers = [Identity.generate() for _ in range(4)]
    dht = start_swarm_dht(arbiter_id, host_maddrs=LOOPBACK)
    excluded: dict[str, str] = {}
    spec = WorkSpec(task=TASK, task_digest=DIGEST, shard_index=1, num_shards=2)
    arbiter = _work_checks(
        dht, arbiter_id, spec, verify.trainable(TASK.build_model(seed=0)), exclude=excluded.setdefault
    )
    try:
        signed, recorder, base = _a_committed_phase(TASK, DIGEST, identity=prover_id)
        commitment = signed.commitment
        arbiter._inputs = lambda prover, round_, segment: recorder.inputs(round_, segment)  # served as asked
        assert commitment.params[0] not in arbiter.replays.bases  # not in that round's group
        delta = base - recorder.inputs(0, 1).end_params
        lo, hi = 5, delta.numel() - 7  # the accuser's slice

        def shown(values, *, label=commitment.digest(), signer=prover_id) -> dict:
            statement = part_statement(
                group_id="g", index=1, lo=lo, hi=hi, codec="int8", piece_numel=100, weight=float(commitment.samples),
                sha256=part_digest(values, "int8", 100), label=label,
            )  # fmt: skip
            return {"statement": statement.to_dict(), "signature": sign_part(signer, averaging_prefix(RUN), statement)}

        def accusation(accuser: Identity, part: dict) -> dict:
            verdict = verify.verdict_of(accuser, commitment, 1, (False, work_module.UNBOUND, ""))
            return {**verdict, "work": signed.to_dict(), "part": part}

        honest, tampered = delta[lo:hi], -delta[lo:hi]
        arbiter._recheck(accusation(accusers[0], shown(tampered, signer=accusers[0])))  # not the prover's word
        arbiter._recheck(accusation(accusers[1], shown(tampered, label="0" * 64)))  # another commitment's
        assert not excluded and arbiter.counts["rejected:unbound without its signed part"] == 2, arbiter.counts
        arbiter._recheck(accusation(accusers[2], shown(honest)))
        assert list(excluded) == [accusers[2].peer_id] and "falsely" in excluded[accusers[2].peer_id], excluded
        arbiter._recheck(accusation(accusers[3], shown(tampered)))
        assert list(excluded) == [accusers[2].peer_id, prover_id.peer_id], excluded
        assert (
            "the part it signed" in excluded[prover_id.peer_id] and work_module.UNBOUND in excluded[prover_id.peer_id]
        )
        assert arbiter.counts["liars"] == 1 and arbiter.counts["confirmed"] == 1, arbiter.counts
    finally:
        arbiter.close()
        stop_dht(dht)


def _a_committed_phase(
    task, digest: str, *, steps: int = 4, beside: Callable[[], None] | None = None, identity: Identity | None = None
) -> tuple[verify.SignedCommitment, verify.WorkRecorder, torch.Tensor]:
    """One committed phase of ``steps`` steps (segments of 2) of ``task``, shard 0 of 2, from the seed-0 model:
    (signed commitment, recorder, base), by ``identity`` (a new one by default). ``beside`` loops on a thread
    meanwhile, seen running before the phase begins. PROVE_AT_A_LEVEL runs it in a process of its own."""
    identity, model = identity or Identity.generate(), task.build_model(seed=0)
    params = verify.trainable(model)
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    recorder = verify.WorkRecorder(task, peer=identity.peer_id, shard_index=0, num_shards=2, segment_steps=2)
    base, batches = verify.flat_params(params), recorder.batches()
    stop, looped = threading.Event(), threading.Event()

    def loop() -> None:
        while not stop.is_set():
            beside()
            looped.set()

    thread = threading.Thread(target=loop, daemon=True)
    if beside is not None:
        thread.start()
        assert looped.wait(60), "the work beside the training never ran"
    recorder.begin(params, optimizer, first_step=1)
    for step in range(1, steps + 1):
        task.loss(model, next(batches)).backward()
        inner_step(optimizer, step, 0)
        recorder.stepped(params, optimizer)
    stop.set()
    if beside is not None:
        thread.join(60)
    signed = recorder.commit(
        params, optimizer, base=base, identity=identity, run=RUN, round_=0, task_digest=digest, samples=steps,
        warmup_steps=0,
    )  # fmt: skip
    return signed, recorder, base


def test_a_task_with_dropout_replays_apart_from_the_training_beside_it(request) -> None:
    """Verified work with dropout (issue 18). torch has one CPU random generator per process: a replay on a
    thread beside this peer's own training reseeds it and draws from it, so the training's dropout masks
    leave its seeded stream and its own committed segments no longer replay (the negative control). Replays
    in `swarm.replayer`'s process leave the training's stream alone: every segment replays bit for bit, and
    the child's replay equals one done here. That process also replays a prover that trained with another
    number of torch threads than the verifier has, with the prover's number."""
    task = get_task("charlm", preset="tiny", dropout=0.1)
    digest = TaskInfo.of(task, "tiny").config_digest
    assert random_in_training(task) and not random_in_training(TASK)
    request.addfinalizer(functools.partial(torch.set_num_threads, torch.get_num_threads()))
    torch.set_num_threads(2)  # the provers'

    def phase(beside=None) -> tuple[verify.Commitment, verify.WorkRecorder, torch.Tensor]:
        """One committed phase of 8 steps (segments of 2), ``beside`` looping on a thread meanwhile."""
        signed, recorder, base = _a_committed_phase(task, digest, steps=8, beside=beside)
        return signed.commitment, recorder, base

    def replayed(commitment, recorder, base, replayer=None) -> list[bool]:
        return [
            verify.check(task, digest, commitment, k, recorder.inputs(0, k), base=base, replayer=replayer)[0]
            for k in range(commitment.segments)
        ]

    replayer = Replayer()
    other, other_recorder, other_base = phase()  # the work a verifier replays beside its own training
    start = other_recorder.inputs(0, 1).start
    here = verify.replay(task, other, 1, start)
    assert replayed(other, other_recorder, other_base) == [True] * 4  # alone, every segment replays

    def in_thread() -> None:
        verify.replay(task, other, 1, start)

    assert not all(replayed(*phase(beside=in_thread))), "the negative control: a replay beside broke the stream"

    try:
        apart = replayer.replay(task, other, 1, start)
        assert verify.params_digest(apart.params) == verify.params_digest(here.params)
        assert apart.inner.digest() == here.inner.digest()

        def in_its_process() -> None:
            replayer.replay(task, other, 1, start)

        assert replayed(*phase(beside=in_its_process)) == [True] * 4
        # torch's CPU reductions split their sums by thread: a verifier with another thread count than the
        # prover's replays differently (the negative control), so it replays in the replayer's process, with
        # the prover's count (the commitment names it)
        assert other.threads == 2
        torch.set_num_threads(1)
        assert not all(replayed(other, other_recorder, other_base)), "the negative control: 1 thread against 2"
        assert replayed(other, other_recorder, other_base, replayer.replay) == [True] * 4
        assert replayer.started == 1
    finally:
        replayer.close()
    assert replayer._proc is None
    with pytest.raises(ReplayerError):  # closed: no replay starts a process again (a late one at shutdown)
        replayer.replay(task, other, 1, start)
    assert replayer._proc is None and replayer.started == 1


PROVE_AT_A_LEVEL = """
import json, sys, torch
from pathlib import Path
sys.path.insert(0, sys.argv[3])  # the repository: its tests
from swarm import verify
from swarm.tasks import get_task
from tests.test_work import _a_committed_phase

out = Path(sys.argv[1])
torch.set_num_threads(1)
signed, recorder, base = _a_committed_phase(get_task("charlm", preset="tiny"), sys.argv[2])
(out / "signed.json").write_text(json.dumps(signed.to_dict()))
(out / "base.st").write_bytes(verify.ReplayInputs(recorder.inputs(0, 0).start, base).to_bytes())
for k in range(signed.commitment.segments):
    (out / f"{k}.st").write_bytes(recorder.inputs(0, k).to_bytes())
"""


def test_a_task_named_by_its_module_path_is_rebuilt_by_that_name_in_the_replay_process(monkeypatch) -> None:
    """A task from ``package.module:factory`` whose own name is another: the example package's `mlp`, which does
    not say whether its training draws random numbers, so its replays run in `swarm.replayer`'s process. That
    process rebuilds the task by the name it was built from (`WorkSpec.task_name`, carried by `_Replays`) and
    every segment replays. By the task's own name (the negative control: what the process was told before) it
    cannot build the task: an error of this peer's, never a verdict."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples" / "swarm_mlp_task"))
    name = "swarm_mlp_task:MLPTask.from_overrides"  # the child gets this process's sys.path
    task = get_task(name, preset="tiny")
    digest = TaskInfo.of(task, "tiny").config_digest
    assert task.name == "mlp" and random_in_training(task)
    signed, recorder, base = _a_committed_phase(task, digest)
    commitment = signed.commitment
    replays = work_module._Replays(verify.Streams(task), task_name=name)
    replayer = replays.replayer(verify.cpu_capability())
    try:
        assert replayer.task_name == name
        replayer.task_name = None
        with pytest.raises(ReplayerError, match="unknown task 'mlp'"):
            verify.check(task, digest, commitment, 0, recorder.inputs(0, 0), base=base, replayer=replayer.replay)
        replayer.task_name = name
        checked = [
            verify.check(task, digest, commitment, k, recorder.inputs(0, k), base=base, replayer=replayer.replay)[0]
            for k in range(commitment.segments)
        ]
        assert checked == [True] * commitment.segments == [True] * 2
        assert replayer.started == 1  # one process answered both
    finally:
        replays.close()


def test_a_prover_at_another_cpu_kernel_level_is_replayed_at_its_level(tmp_path: Path) -> None:
    """Kernels of another CPU level (AVX2, AVX512, or none: DEFAULT) round differently, so a verifier on a newer
    CPU than its prover's accused it (the negative control: a prover at the DEFAULT level, replayed here at
    this machine's). The commitment names the level, and the verifier replays in a process whose torch runs
    at it (``ATEN_CPU_CAPABILITY``); a level that this machine lacks or torch does not know is "cannot
    replay here", never a verdict."""
    task = get_task("charlm", preset="tiny")
    digest = TaskInfo.of(task, "tiny").config_digest
    script = tmp_path / "prove.py"
    script.write_text(PROVE_AT_A_LEVEL)
    repo = str(Path(__file__).resolve().parents[1])
    child = spawn(python_cmd(str(script), str(tmp_path), digest, repo), env={"ATEN_CPU_CAPABILITY": "default"})
    wait_until(lambda: child.popen.poll() is not None, 120, message=child.describe)
    assert child.popen.returncode == 0, child.describe()
    commitment = verify.verify_commitment((tmp_path / "signed.json").read_bytes(), run=RUN).commitment
    assert commitment.cpu == "DEFAULT" and commitment.threads == 1
    assert verify.cpu_capability() != "DEFAULT", "this test needs a CPU with vector kernels"
    base = verify.ReplayInputs.from_bytes((tmp_path / "base.st").read_bytes()).end_params
    inputs = [verify.ReplayInputs.from_bytes((tmp_path / f"{k}.st").read_bytes()) for k in range(commitment.segments)]

    def replayed(replayer=None) -> list[bool]:
        return [
            verify.check(task, digest, commitment, k, inputs[k], base=base, replayer=replayer)[0]
            for k in range(commitment.segments)
        ]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the prover's count: only the level differs
    try:
        assert not all(replayed()), "the negative control: replayed at this machine's level"
    finally:
        torch.set_num_threads(threads)
    at_its_level = Replayer(cpu=commitment.cpu)
    try:
        assert replayed(at_its_level.replay) == [True] * commitment.segments
        with pytest.raises(CannotReplayHere):  # the process checks the level it runs at against the claim
            claimed = _replace(commitment, cpu="NOSUCHLEVEL")
            verify.check(task, digest, claimed, 0, inputs[0], base=base, replayer=at_its_level.replay)
        assert at_its_level.started == 1
    finally:
        at_its_level.close()
