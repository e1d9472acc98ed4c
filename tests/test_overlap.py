"""Overlapped rounds (`swarm.overlap`): the round runs beside the inner steps and lands when it ends.

The algorithm is checked end to end against a single-process replay in tests/test_swarm.py
(``diloco-overlapped``); here: the background thread, its errors and a lone overlapped trainer.
"""

from __future__ import annotations

import stat
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from bootstrap.identity import Identity, IdentityError
from swarm.overlap import Overlap
from swarm.rounds import RoundBook, prelaunch_due
from tests.helpers import wait_until


def test_the_round_runs_beside_the_caller_and_its_result_or_error_comes_back_at_the_join() -> None:
    overlap, release = Overlap(join_timeout_s=10.0), threading.Event()
    overlap.launch(torch.zeros(3), lambda: release.wait(10.0) and "averaged")
    assert overlap.in_flight and not release.is_set()  # launch did not wait for the round
    with pytest.raises(RuntimeError, match="still in flight"):
        overlap.launch(torch.zeros(3), lambda: None)
    release.set()
    assert overlap.join(interrupt=lambda: None) == "averaged"
    assert not overlap.in_flight and overlap.join(interrupt=lambda: None) is None

    def fails() -> None:
        raise ValueError("the round broke")

    overlap.launch(torch.zeros(3), fails)
    with pytest.raises(ValueError, match="the round broke"):  # raised on the training thread, not lost
        overlap.join(interrupt=lambda: None)


def test_a_round_past_its_deadline_is_interrupted_at_the_join() -> None:
    overlap, interrupted = Overlap(join_timeout_s=0.2), threading.Event()
    overlap.launch(torch.zeros(1), lambda: interrupted.wait(10.0) and "late")
    assert overlap.join(interrupt=interrupted.set) == "late"  # the fault fired: interrupt was called
    assert interrupted.is_set() and overlap.waited_s >= 0.2


def test_progress_is_measured_from_where_the_phase_started() -> None:
    overlap = Overlap(join_timeout_s=1.0)
    base, local = torch.tensor([1.0, 2.0]), [torch.tensor([0.5, 1.0])]
    assert torch.equal(overlap.progress(local, lambda: base), torch.tensor([0.5, 1.0]))  # first phase: from the global
    overlap.start = torch.tensor([3.0, 3.0])
    assert torch.equal(overlap.progress(local, lambda: base), torch.tensor([2.5, 2.0]))


def test_a_round_is_prelaunched_only_after_a_grouped_round_and_never_first() -> None:
    """A process's first round joins at its sync point: prelaunched, the members' sync points were as far
    apart as their starts, and the round failed for all of them at the sender deadline (chaos no-chaos
    arms: round 1 failed, 6 of 6 peers, in every overlapped run of 2026-12-06)."""
    book = RoundBook(started_at=0.0, last_sync_end=0.0, divergence=None, next_sync=20)
    due = partial(prelaunch_due, book, lead=3, in_flight=False)
    assert not due(local_step=17, grouped=0)  # the first round of this process: never
    assert not due(local_step=16, grouped=1)  # too early
    assert due(local_step=17, grouped=1) and due(local_step=19, grouped=4)
    assert not prelaunch_due(book, local_step=17, lead=3, grouped=1, in_flight=True)  # one round at a time
    book.solo_streak = 1
    assert not due(local_step=17, grouped=1)  # the last round found no group: join at the sync point


@pytest.mark.timeout(120)
def test_a_lone_overlapped_trainer_trains_on_and_leaves_with_no_round_thread(tmp_path) -> None:
    """Alone with plain averaging (outer lr 1, no momentum) one round late, a peer's model is just its local
    training: each sync point must leave the model where the inner steps took it. Its inner steps go through a
    gradient scaler (`swarm.ScaledStep`, as for fp16), whose scale grows every 2 steps only if they do."""
    from swarm.recipe import ScaledStep
    from swarm.trainer import Trainer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    trainer = Trainer(
        model,
        ScaledStep(torch.optim.SGD(model.parameters(), lr=0.1), scaler),
        run="lone-overlap",
        overlap=True,
        outer_lr=1.0,
        outer_momentum=0.0,
        sync_every=2,
        inner_warmup_steps=0,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        checkpoint_dir=str(tmp_path / "ck"),
        ledger_dir=str(tmp_path / "ledgers"),
        matchmaking_time_s=0.3,
        join_timeout_s=0.5,
        round_timeout_s=5.0,
        load_state=False,
    )
    results, at_sync = [], []
    trainer.before_sync.append(lambda round_, local: at_sync.append([t.clone() for t in local]))
    try:
        for step in range(1, 7):
            scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
            results.append(trainer.step(num_samples=8))
            if step % 2 == 0:  # a sync point: the model is where the inner steps took it
                assert len(at_sync) == step // 2
                for got, want in zip(model.parameters(), at_sync[-1]):
                    torch.testing.assert_close(got.detach(), want, atol=1e-6, rtol=0)
        synced = [r for r in results if r is not None]
        assert results[1] is None and len(synced) == 2  # sync points at steps 2, 4, 6; the first joins nothing
        assert [r.group_size for r in synced] == [1, 1] and [r.round for r in synced] == [1, 2]
        assert trainer.round == 2 and scaler.get_scale() == 2.0**13  # 6 steps through the scaler
        assert any(t.name == "swarm-round" for t in threading.enumerate())  # the third round is in flight
    finally:
        began = time.monotonic()
        trainer.shutdown(reason="test")
    assert time.monotonic() - began < 10.0
    wait_until(
        lambda: not any(t.name == "swarm-round" for t in threading.enumerate()), 10.0, message="a round thread is left"
    )


@pytest.mark.timeout(120)
def test_a_round_that_ends_between_sync_points_lands_under_the_progress_made_since(tmp_path) -> None:
    """Alone, with outer lr 0.5 (no momentum) and an inner step of exactly -0.1 per step: at each sync point the
    model moves to where the outer step of its own progress puts it (the eager start; alone, where the round will
    land), the solo round halves that phase's progress in the global state; when it lands at step 5 the model is
    the new global state plus step 5's progress, and the next pseudo-gradient is measured from the global state."""
    from swarm.trainer import Trainer

    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        run="lone-landing",
        identity_key=tmp_path / "me.key",  # (also checked: the documented identity argument, see the end)
        overlap=True,
        outer_lr=0.5,
        outer_momentum=0.0,
        sync_every=4,
        inner_warmup_steps=0,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        checkpoint_dir=str(tmp_path / "ck"),
        ledger_dir=str(tmp_path / "ledgers"),
        matchmaking_time_s=0.3,
        join_timeout_s=0.5,
        round_timeout_s=5.0,
        load_state=False,
    )

    def step() -> object:
        model.weight.grad = torch.ones_like(model.weight)  # the inner step: weight -= 0.1
        return trainer.step(num_samples=1)

    try:
        assert [step() for _ in range(4)] == [None] * 4  # the sync point: progress 0.4 sent, nothing to join
        torch.testing.assert_close(model.weight.detach(), torch.full((1, 2), 0.8))  # eager: 1 - 0.5 x 0.4
        overlap = trainer._runner.overlap
        wait_until(lambda: overlap.ended, 30.0, message="the solo round did not end")
        landed = step()  # step 5 is no sync point: the round lands here
        assert landed is not None and landed.group_size == 1 and trainer.rounds_in_flight == 0
        # global: 1 - 0.5 x 0.4 = 0.8; the model: 0.8 - 0.1 (step 5's progress)
        torch.testing.assert_close(trainer.outer.global_flat(), torch.full((2,), 0.8))
        torch.testing.assert_close(model.weight.detach(), torch.full((1, 2), 0.7))
        assert [step() for _ in range(3)][-1] is None  # steps 6-8 (to 0.4); 8 is a sync point, nothing to join
        torch.testing.assert_close(model.weight.detach(), torch.full((1, 2), 0.6))  # eager: 0.8 - 0.5 x 0.4
        torch.testing.assert_close(overlap.start, torch.full((2,), 0.6))  # round 2 carries 0.8 - 0.4
        assert trainer.finish() is not None  # it lands: 0.8 - 0.5 x 0.4, and finish leaves it in the model
        torch.testing.assert_close(model.weight.detach(), torch.full((1, 2), 0.6))
    finally:
        trainer.shutdown(reason="test")
    # identity_key=: the key file is created private, and a restart that loads it is the same peer
    key = tmp_path / "me.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert Identity.load_or_create(key).peer_id == trainer.peer_id == trainer.identity.peer_id


def test_an_identity_key_others_can_read_is_refused_before_anything_starts(tmp_path) -> None:
    from swarm.trainer import Trainer

    key = tmp_path / "shared.key"
    Identity.load_or_create(key)
    key.chmod(0o644)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(IdentityError, match="accessible by other users"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), run="r", identity_key=key)
    with pytest.raises(TypeError, match="not both"):
        Trainer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), run="r", identity=Identity.generate(), identity_key=key
        )
    assert Identity.of(None, None).path == Path.home() / ".swarm" / "identity.key"  # swarm.peer's default
