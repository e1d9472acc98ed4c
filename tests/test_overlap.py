"""Overlapped rounds (`swarm.overlap`): the round runs beside the inner steps, one round late.

The algorithm is checked end to end against a single-process replay in tests/test_swarm.py
(``diloco-overlapped``); here: the background thread, its errors and a lone overlapped trainer.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from swarm.overlap import Overlap
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


@pytest.mark.timeout(120)
def test_a_lone_overlapped_trainer_trains_on_and_leaves_with_no_round_thread(tmp_path) -> None:
    """Alone with plain averaging (outer lr 1, no momentum) one round late, a peer's model is just its local
    training: each sync point must leave the model where the inner steps took it."""
    from swarm.trainer import Trainer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
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
            model(torch.randn(8, 4)).pow(2).mean().backward()
            results.append(trainer.step(num_samples=8))
            if step % 2 == 0:  # a sync point: the model is where the inner steps took it
                assert len(at_sync) == step // 2
                for got, want in zip(model.parameters(), at_sync[-1]):
                    torch.testing.assert_close(got.detach(), want, atol=1e-6, rtol=0)
        synced = [r for r in results if r is not None]
        assert results[1] is None and len(synced) == 2  # sync points at steps 2, 4, 6; the first joins nothing
        assert [r.group_size for r in synced] == [1, 1] and [r.round for r in synced] == [1, 2]
        assert trainer.round == 2
        assert any(t.name == "swarm-round" for t in threading.enumerate())  # the third round is in flight
    finally:
        began = time.monotonic()
        trainer.shutdown(reason="test")
    assert time.monotonic() - began < 10.0
    wait_until(
        lambda: not any(t.name == "swarm-round" for t in threading.enumerate()), 10.0, message="a round thread is left"
    )
