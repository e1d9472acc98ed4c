"""The training recipe's pure parts: the divergence guard, and the teacher task's data and learning."""

from __future__ import annotations

import pytest
import torch

from swarm._private.divergence import DivergenceGuard
from swarm.tasks import TeacherTask, get_task, known_tasks


def _feed(guard: DivergenceGuard, losses: list[float]) -> list[int]:
    """Indices at which the guard reported a rising streak."""
    return [i for i, loss in enumerate(losses) if guard.observe(loss, round_=i) is not None]


def test_guard_reports_three_rises_in_a_row_once_per_streak():
    guard = DivergenceGuard(rounds=3, min_rise=0.01)
    losses = [2.0, 1.5, 1.2, 1.3, 1.5, 2.0, 3.0, 8.0, 1.0, 1.1, 1.2, 1.3]
    assert _feed(guard, losses) == [5, 11]  # 1.2 -> 1.3 -> 1.5 -> 2.0; again after it fell to 1.0
    assert guard.reports == 2
    rising = DivergenceGuard(rounds=2).observe
    assert rising(1.0, round_=0) is None and rising(1.1, round_=1) is None
    report = rising(1.2, round_=2)
    assert report is not None and (report.rounds, report.start, report.now, report.round) == (2, 1.0, 1.2, 2)
    assert report.to_dict()["rise"] == pytest.approx(0.2)


def test_guard_stays_silent_on_a_falling_or_noisy_plateau_and_bad_values():
    guard = DivergenceGuard(rounds=3, min_rise=0.01)
    plateau = [1.2000, 1.2001, 1.2002, 1.2003, 1.2004, 1.1990, 1.2, 1.2001]  # rises of 0.03% in all
    assert _feed(guard, [3.0, 2.0, 1.5, *plateau]) == []
    assert _feed(guard, [float("nan"), None, float("inf")]) == []
    assert _feed(DivergenceGuard(rounds=0), [1.0, 2.0, 3.0, 4.0, 5.0]) == []  # off
    with pytest.raises(ValueError):
        DivergenceGuard(rounds=-1)


def test_teacher_task_is_registered_deterministic_and_sharded():
    assert "teacher" in known_tasks()
    task = get_task("teacher", preset="tiny")
    again = get_task("teacher", preset="tiny")
    a, b = task.build_model(seed=3), again.build_model(seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    x0, y0 = next(task.train_batches(shard_index=1, num_shards=4, seed=5))
    x1, y1 = next(again.train_batches(shard_index=1, num_shards=4, seed=5))
    assert torch.equal(x0, x1) and torch.equal(y0, y1) and x0.shape == (32, 32) and y0.dtype == torch.long
    bounds = [task.shard_bounds(i, 4) for i in range(4)]
    assert bounds[0][0] == 0 and bounds[-1][1] == task.config.train_size
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(3))
    # non-IID: the shards' label distributions differ
    _, labels, _, _ = __import__("swarm.tasks.teacher", fromlist=["_data"])._data(task.config)
    hist = [torch.bincount(labels[s:e], minlength=10).float() / (e - s) for s, e in bounds]
    assert max((hist[0] - h).abs().sum().item() for h in hist[1:]) > 0.2
    assert sum(v.size(0) for v, _ in task.val_batches()) == task.config.val_size
    with pytest.raises(ValueError):
        get_task("teacher", preset="tiny", hidden=0)
    with pytest.raises(ValueError, match="unknown teacher preset"):
        get_task("teacher", preset="huge")


def test_teacher_task_learns_in_a_few_hundred_steps():
    torch.manual_seed(0)
    task = TeacherTask.from_overrides("tiny")
    model = task.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = task.evaluate(model)
    for batch, _ in zip(task.train_batches(shard_index=0, num_shards=1), range(300)):
        task.loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert task.evaluate(model) < 0.7 * start
