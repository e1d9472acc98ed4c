"""benchmarks.utilization's pure helpers: the rotated order of the arms and the summary over repeats (the
benchmark itself trains real peers for minutes; it is run by hand, see benchmarks/README.md section 11)."""

import pytest

from benchmarks.utilization import arm_order, main, summarize


def test_over_as_many_repeats_as_modes_each_mode_runs_once_in_each_position():
    modes = ["blocking", "overlapped", "verified"]
    orders = [arm_order(modes, repeat) for repeat in range(6)]
    assert orders[0] == modes and orders[1] == ["overlapped", "verified", "blocking"]
    for mode in modes:
        assert sorted(order.index(mode) for order in orders[:3]) == [0, 1, 2]
    assert orders[3:] == orders[:3]


def test_the_summary_takes_the_median_and_range_of_each_arm_over_its_repeats():
    modes = ["blocking", "overlapped"]
    utilization = {"blocking": [0.80, 0.92, 0.90], "overlapped": [0.93, 0.89, None]}  # None: the arm never grouped
    rows = [
        {"preset": "small", "peers": 2, "link_mbit": 0.0, "mode": mode, "repeat": repeat, "val_loss": 2.0}
        | {"position": arm_order(modes, repeat).index(mode), "utilization": utilization[mode][repeat]}
        for repeat in range(3)
        for mode in modes
    ]
    summary = {s["mode"]: s for s in summarize(rows)}
    assert summary["blocking"]["utilization_median"] == pytest.approx(0.90)
    assert (summary["blocking"]["utilization_min"], summary["blocking"]["utilization_max"]) == (0.80, 0.92)
    assert summary["blocking"]["positions"] == [0, 1, 0] and summary["overlapped"]["positions"] == [1, 0, 1]
    assert summary["overlapped"]["runs"] == 3 and summary["overlapped"]["utilization_median"] == pytest.approx(0.91)


def test_repeats_must_be_at_least_one(capsys):
    with pytest.raises(SystemExit):
        main(["--repeats", "0"])
    assert "--repeats: at least 1" in capsys.readouterr().err
