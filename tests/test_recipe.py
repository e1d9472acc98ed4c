"""The training recipe's pure parts: the divergence guard, and the teacher task's data and learning."""

from __future__ import annotations

from typing import Any

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


def test_outer_settings_follow_the_sync_interval_and_explicit_fields_win():
    from swarm.recipe import OuterSettings, outer_settings
    from swarm.trainer import TrainerConfig

    assert outer_settings(15) == OuterSettings(lr=0.5, momentum=0.5)
    assert outer_settings(50) == outer_settings(150) == OuterSettings(lr=1.0, momentum=0.0)
    assert outer_settings(500) == OuterSettings(lr=0.7, momentum=0.9)
    assert TrainerConfig(run="r", sync_every=15).outer() == OuterSettings(lr=0.5, momentum=0.5)
    assert TrainerConfig(run="r", sync_every=15, outer_lr=1.0, outer_momentum=0.0).outer() == OuterSettings(1.0, 0.0)
    assert TrainerConfig(run="r", sync_every=500, outer_lr=0.3).outer() == OuterSettings(lr=0.3, momentum=0.9)
    with pytest.raises(ValueError, match="outer_momentum"):
        TrainerConfig(run="r", outer_momentum=1.0)
    with pytest.raises(ValueError, match="sync_every"):
        outer_settings(0)


def test_warm_up_scales_one_step_and_restores_the_users_learning_rate():
    from swarm.recipe import step_with_lr_factor, warmup_factor

    assert [warmup_factor(s, 4) for s in (1, 2, 4, 9)] == [0.25, 0.5, 1.0, 1.0]
    assert warmup_factor(1, 0) == 1.0
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2 * 0.25)  # the reference: the scaled rate throughout
    x = torch.randn(8, 4)
    for _ in range(3):
        for model in (a, b):
            model(x).pow(2).mean().backward()
        step_with_lr_factor(opt_a, 0.25)
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    assert opt_a.param_groups[0]["lr"] == 1e-2  # restored
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=0)


def test_a_rising_streak_reaches_the_status_board_and_the_report():
    from swarm._private.evidence import _status_note
    from swarm.report import TIMELINE_KINDS

    rising = DivergenceGuard(rounds=2).observe
    rising(1.0, round_=1)
    rising(1.2, round_=2)
    report = rising(1.5, round_=3)
    assert report is not None
    kind, detail = _status_note("diverging", report.to_dict())
    assert kind == "val loss rising" and "1.000 -> 1.500" in detail
    assert "diverging" in TIMELINE_KINDS


def test_a_scaled_step_unscales_keeps_the_warm_up_and_skips_an_inf_step_where_the_plain_optimizer_would_not():
    """fp16 mixed precision (`swarm.ScaledStep`): after ``scaler.scale(loss).backward()``, the trainer's inner step
    must equal the plain step on the unscaled gradients, under the warm-up factor, with the learning rate restored;
    the plain optimizer on the same gradients (the negative control) would step 2^16 times as far."""
    from swarm import ScaledStep
    from swarm.recipe import inner_step

    x = torch.tensor([1.0, -2.0, 3.0])

    def arm(scaled: bool, plain_on_scaled: bool = False) -> tuple[torch.Tensor, torch.amp.GradScaler]:
        param = torch.nn.Parameter(torch.tensor([0.5, 0.25, -1.0]))
        optimizer = torch.optim.SGD([param], lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1000)
        loss = (param * x).sum()
        (scaler.scale(loss) if scaled or plain_on_scaled else loss).backward()
        inner_step(ScaledStep(optimizer, scaler) if scaled else optimizer, 1, 4)  # warm-up: lr x 1/4 this step
        assert optimizer.param_groups[0]["lr"] == 0.1 and param.grad is None
        return param.detach(), scaler

    start = torch.tensor([0.5, 0.25, -1.0])
    reference, _ = arm(scaled=False)
    torch.testing.assert_close(reference, start - 0.025 * x)
    scaled, scaler = arm(scaled=True)
    assert torch.equal(scaled, reference) and scaler.get_scale() == 2.0**16
    plain, _ = arm(scaled=False, plain_on_scaled=True)
    torch.testing.assert_close(start - plain, 2.0**16 * (start - reference))

    param = torch.nn.Parameter(start.clone())  # an overflow: the step is skipped and the scale halved
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scaler.scale((param * torch.tensor([1.0, float("inf"), 1.0])).sum()).backward()
    inner_step(ScaledStep(optimizer, scaler), 200, 4)
    assert torch.equal(param.detach(), start) and scaler.get_scale() == 2.0**15


@pytest.mark.parametrize(
    ("precision", "capability", "hip", "expected"),
    [
        ("auto", (9, 0), None, torch.bfloat16),
        ("auto", (8, 0), None, torch.bfloat16),
        ("auto", (7, 5), None, torch.float16),  # T4, RTX 20xx: tensor cores without bf16
        ("auto", (7, 0), None, torch.float16),  # V100
        ("auto", (6, 1), None, None),  # GTX 10xx: no tensor cores
        ("auto", (6, 1), "6.2", torch.bfloat16),  # ROCm
        ("fp16", (9, 0), None, torch.float16),
        ("bf16", (7, 5), None, torch.bfloat16),  # asked for: taken as asked
        ("fp32", (9, 0), None, None),
    ],
)
def test_autocast_dtype_picks_what_the_gpu_computes_natively(monkeypatch, precision, capability, hip, expected):
    """``swarm.peer`` used bf16 autocast on every GPU; torch runs bf16 on GPUs before compute capability 8.0
    emulated (their tensor cores compute fp16). Now, with ``auto``: bf16 where native, fp16 (with a loss scaler)
    on 7.x, fp32 below; an explicit choice is taken as asked."""
    from swarm.recipe import autocast_dtype

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert autocast_dtype(precision, torch.device("cuda")) == expected
    assert autocast_dtype("auto", torch.device("cpu")) is None
    with pytest.raises(ValueError, match="precision"):
        autocast_dtype("fp8", torch.device("cpu"))


def test_a_peer_in_fp16_runs_its_forward_in_fp16_and_steps_through_its_loss_scaler():
    """`swarm.peer --precision fp16` (what auto picks on a V100 or a T4), on this CPU: the forward runs in fp16,
    the backward is scaled by the runner's GradScaler (the gradients are 2^16 times those of the same forward
    backpropagated unscaled, but where that underflowed), and the inner step goes through it (`ScaledStep`: the gradients unscaled, the
    scale kept). The default on a CPU (the control) is fp32 with the plain optimizer."""
    from swarm import ScaledStep
    from swarm.peer import PeerConfig, PeerRunner
    from swarm.recipe import inner_step
    from swarm.trainer import TrainerConfig

    def runner(precision: str) -> PeerRunner:
        config = PeerConfig(task="charlm", task_preset="tiny", device="cpu", precision=precision, shard_index=0)
        return PeerRunner(TrainerConfig(run="precision"), config, stop=None, identity=None)

    def forward_dtypes(peer: PeerRunner, batch: Any) -> set[torch.dtype]:
        seen: set[torch.dtype] = set()
        hooks = [m.register_forward_hook(lambda m, i, o: seen.add(o.dtype)) for m in peer.model.modules()
                 if isinstance(m, torch.nn.Linear)]  # fmt: skip
        try:
            peer._backward(batch)
        finally:
            for hook in hooks:
                hook.remove()
        return seen

    plain = runner("auto")
    batch = next(plain._batches())
    assert plain.precision_name == "fp32" and plain.scaler is None and isinstance(plain.optimizer, torch.optim.AdamW)
    assert forward_dtypes(plain, batch) == {torch.float32}

    fp16, reference = runner("fp16"), runner("fp16")
    assert fp16.precision_name == "fp16" and isinstance(fp16.optimizer, ScaledStep)
    assert fp16.optimizer.scaler is fp16.scaler and fp16.scaler.get_scale() == 2.0**16
    assert forward_dtypes(fp16, batch) == {torch.float16}
    x, y = batch
    with reference._autocast():
        reference.task.loss(reference.forward, (x, y)).backward()  # the same forward, unscaled
    scaled = [p.grad for p in fp16.model.parameters()]
    unscaled = [p.grad for p in reference.model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in scaled)
    # equal but where the unscaled fp16 backward underflowed (what the scale is for): compared as whole tensors
    errors = [((s - u * 2.0**16).norm() / (u * 2.0**16).norm()).item() for s, u in zip(scaled, unscaled)]
    assert max(errors) < 1e-2, errors
    before = [p.detach().clone() for p in fp16.model.parameters()]
    inner_step(fp16.optimizer, 1, 0)
    assert fp16.scaler.get_scale() == 2.0**16  # no inf: the step was taken, the scale kept
    assert all(p.grad is None for p in fp16.model.parameters())
    moved = max((p.detach() - b).abs().max().item() for p, b in zip(fp16.model.parameters(), before))
    assert 0 < moved <= 1.1 * 3e-3  # AdamW's first step: at most about its learning rate per coordinate
