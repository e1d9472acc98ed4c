"""Smoke test of benchmarks.convergence: a tiny four-arm run on loopback writes every curve and the
table; plus the pure helpers (interpolated samples-to-loss, the step plan). Checks structure, not speed."""

from __future__ import annotations

import json

import pytest

from benchmarks.convergence import ARMS, ConvergenceConfig, Plan, main, samples_to_reach

TABLE_KEYS = {
    "arm",
    "peers",
    "samples",
    "final_val_loss",
    "rising",
    "loss_ratio_to_dp",
    "bytes_reduction_vs_dp",
    "samples_to_solo_loss",
    "samples_ratio_to_solo",
    "bytes_sent",
    "bytes_source",
    "bytes_per_sample",
    "fp32_every_step_bytes_per_sample",
    "bytes_reduction_vs_fp32_every_step",
    "wall_s",
    "train_s",
}


def test_samples_to_reach_interpolates_the_first_crossing():
    curve = [
        {"samples": 0, "val_loss": 4.0},
        {"samples": 100, "val_loss": 3.0},
        {"samples": 200, "val_loss": 2.0},
        {"samples": 300, "val_loss": 2.5},
    ]
    assert samples_to_reach(curve, 2.5) == pytest.approx(150.0)
    assert samples_to_reach(curve, 4.0) == 0.0
    assert samples_to_reach(curve, 1.9) is None


def test_plan_gives_every_arm_the_same_whole_rounds():
    plan = Plan.of(ConvergenceConfig(preset="tiny", samples=60000, peers=4, sync_every=15))
    assert (plan.rounds, plan.steps_per_peer, plan.solo_steps) == (62, 930, 3720)
    assert plan.samples == 4 * 930 * 16 == 59520
    with pytest.raises(ValueError, match="less than one round"):
        Plan.of(ConvergenceConfig(samples=100, peers=2, sync_every=5))


@pytest.mark.timeout(300)  # 30 s alone, 38-126 s in make test beside the chaos run: no timing is checked
@pytest.mark.heavy(seconds=43)
def test_four_arms_on_loopback_write_curves_and_table(tmp_path):
    out = tmp_path / "convergence.json"
    code = main(
        [
            "--preset",
            "tiny",
            "--peers",
            "2",
            "--samples",
            "320",
            "--sync-every",
            "5",
            "--setting",
            "loopback",
            "--eval-batches",
            "2",
            "--arm-timeout-s",
            "120",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["setting"] == "loopback"
    assert set(result["arms"]) == set(ARMS)
    plan = result["plan"]
    for name in ARMS:
        curve = result["arms"][name]["curve"]
        assert curve[0]["samples"] == 0, name
        assert curve[-1]["samples"] == plan["samples"] == 320, name
        assert all(p["val_loss"] > 0 for p in curve), name
        assert len(curve) == plan["rounds"] + 1, name  # one evaluation per round of all peers, plus the start
    assert [row["arm"] for row in result["table"]] == list(ARMS)
    for row in result["table"]:
        assert set(row) == TABLE_KEYS
    ours = next(row for row in result["table"] if row["arm"] == "ours")
    assert ours["bytes_sent"] > 0 and ours["fp32_every_step_bytes_per_sample"] > 0
    assert result["arms"]["ours"]["rounds"] == 2 * plan["rounds"]
    assert len(result["ours_vs_hivemind"]["loss_at_equal_samples"]) == plan["rounds"] + 1
    assert (tmp_path / "convergence.png").stat().st_size > 0
