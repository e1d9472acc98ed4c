"""The chaos runner (benchmarks.chaos): its checks can fail, and an 80-second chaos run on the namespace
test hosts passes every one of them with every fault having fired (TESTMATRIX rows 5, 6, 7, 17, 18, 20).

The full run (`python -m benchmarks.chaos --duration 600 --peers 6`, with its no-chaos arm for the
steps/min ratio) is too long for `make test`; its figures are in RESILIENCE.md. The short run uses a 15 s
round deadline (a cut that lands inside a round stalls its members until the deadline: seen, 31 s of a
30 s partition) and a 25 s partition, and judges three timing-sensitive checks in a weaker form (below).
"""

from __future__ import annotations

import copy
import os
import shutil
from types import SimpleNamespace

import pytest
from rich.console import Console

from benchmarks.chaos import (
    ChaosConfig,
    _Arm,
    build_parser,
    checks,
    config_from_args,
    partition_summary,
    restarts_summary,
    run,
)

_NETNS = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


def _passing_summary() -> dict:
    """A chaos summary that passes every check (the shape `summarize` returns)."""
    return {
        "progress": {"steps": 900, "steps_per_min": 450.0, "val_loss_initial": 4.2, "val_loss_final": 2.9},
        "checkpoints": {"stores": 4, "manifests": 12, "complete": 8, "problems": []},
        "ledgers": {"ledgers": 4, "entries": 300, "problems": []},
        "kills": [{"victim": "peer1.0", "vanish_s": 0.4}, {"victim": "bootstrap", "vanish_s": 0.3}],
        "orphans": [],
        "exits": [],
        "stops": {"peers": 4, "exit_0": 4, "clean": 4, "max_seconds": 3.0, "max_children_gone_s": 0.2},
        "rss": {"peers_measured": 2, "growth_mib": {}, "max_growth_mib": 20.0},
        "rounds": {"attempted": 40, "grouped": 36, "ratio": 0.9},
        "partition": {
            "slot": 2,
            "isolated_side_steps": 120,
            "other_side_grouped_rounds": 5,
            "rounds_to_remerge": 1,
            "seconds_to_remerge": 4.0,
        },
        "restarts": {
            "settled": 3,
            "settled_joined": 3,
            "settled_state_verified": 3,
            "after_bootstrap_loss": 1,
            "after_bootstrap_loss_joined": 1,
            "after_bootstrap_loss_grouped": 1,
        },
        "bootstrap_killed_at_s": 60.0,
        "joiners": {"joiners": 3, "verified": 3, "join_s_max": 9.0, "download_x_floor_max": 1.3},
        "slow_host": {
            "slot": 1,
            "mbit": 10.0,
            "grouped_rounds": 6,
            "median_round_s": 4.0,
            "others_median_round_s": 3.0,
        },
    }


# each: (what breaks, how the summary shows it, the check that must fail)
_BREAKAGES = [
    ("no progress", lambda s: s["progress"].update(steps=0, steps_per_min=0.0), "progress"),
    ("loss rose", lambda s: s["progress"].update(val_loss_final=4.5), "validation loss fell"),
    ("bad checkpoint", lambda s: s["checkpoints"]["problems"].append("x: bad signature"), "every checkpoint verifies"),
    ("no checkpoint", lambda s: s["checkpoints"].update(manifests=0, complete=0), "every checkpoint verifies"),
    ("bad ledger", lambda s: s["ledgers"]["problems"].append("x: edited"), "every ledger verifies"),
    (
        "peer crashed",
        lambda s: s["exits"].append({"peer": "peer2.0", "exit_code": 1, "last_line": "Traceback"}),
        "no peer exited on its own",
    ),
    ("orphan", lambda s: s["orphans"].append("peer1.0: pid 7 p2pd"), "no orphaned process"),
    ("slow reaper", lambda s: s["kills"][0].update(vanish_s=9.0), "no orphaned process"),
    ("unclean stop", lambda s: s["stops"].update(exit_0=3, clean=3), "SIGTERM stops every peer cleanly"),
    ("RSS grew", lambda s: s["rss"].update(max_growth_mib=500.0), "RSS growth per peer"),
    ("rounds failed", lambda s: s["rounds"].update(grouped=4, ratio=0.1), "rounds grouped / attempted"),
    ("never re-merged", lambda s: s["partition"].update(rounds_to_remerge=None), "re-merge after partition"),
    ("late re-merge", lambda s: s["partition"].update(rounds_to_remerge=3), "re-merge after partition"),
    (
        "cut-off side stalled",
        lambda s: s["partition"].update(isolated_side_steps=0),
        "both sides trained during the partition",
    ),
    ("no kill fired", lambda s: s.update(kills=[s["kills"][1]]), "peers killed and restarted"),
    ("restart never joined", lambda s: s["restarts"].update(settled_joined=2), "peers killed and restarted"),
    ("no join after loss", lambda s: s["restarts"].update(after_bootstrap_loss_joined=0), "joins after bootstrap loss"),
    ("joiner without state", lambda s: s["joiners"].update(verified=2), "joiners under load get verified state"),
    ("slow host dropped", lambda s: s["slow_host"].update(grouped_rounds=0), "slow host keeps averaging"),
]


def test_every_flag_lands_in_its_config_field() -> None:
    assert config_from_args(build_parser().parse_args([])) == ChaosConfig()
    config = config_from_args(build_parser().parse_args(["--round-timeout-s", "12", "--overlap", "--seed", "3"]))
    assert (config.averaging_timeout_s, config.overlap, config.seed) == (12.0, True, 3)


def test_a_healthy_summary_passes_every_check() -> None:
    config = ChaosConfig(peers=4)
    results = checks(config, _passing_summary(), baseline=None)
    assert [c["check"] for c in results if c["ok"] is not True] == []


@pytest.mark.parametrize("what, breaks, check", _BREAKAGES, ids=[b[0] for b in _BREAKAGES])
def test_each_check_fails_when_its_figure_is_bad(what: str, breaks, check: str) -> None:
    summary = copy.deepcopy(_passing_summary())
    breaks(summary)
    failed = [c["check"] for c in checks(ChaosConfig(peers=4), summary, baseline=None) if c["ok"] is False]
    assert failed == [check], what


def test_progress_is_judged_against_the_no_chaos_arm() -> None:
    config = ChaosConfig(peers=4, min_progress_ratio=0.5)
    baseline = {"progress": {"steps_per_min": 1000.0}}
    summary = _passing_summary()
    result = {c["check"]: c["ok"] for c in checks(config, summary, baseline=baseline)}
    assert result["progress vs no-chaos"] is False  # 450 < 0.5 x 1000
    baseline["progress"]["steps_per_min"] = 800.0
    assert {c["check"]: c["ok"] for c in checks(config, summary, baseline=baseline)}["progress vs no-chaos"] is True


def test_the_re_merge_counts_the_rounds_that_began_after_the_heal() -> None:
    """The round in flight when the link comes back looked for its group while cut off: it is not one of the
    rounds after the heal (seed 1 at 2c32628: it ended 1.3 s after the heal, alone)."""

    def round_(t: float, group_size: int) -> dict:
        return {"event": "round", "t": t, "duration_s": 4.0, "group_size": group_size}

    cut_off = [round_(95.0, 1), round_(101.0, 1), round_(106.0, 1), round_(111.0, 3)]  # heal at 100
    other = [round_(t, 3) for t in (80.0, 90.0, 110.0)]
    arm = SimpleNamespace(
        partition={"slot": 1, "cut_at": 70.0, "healed_at": 100.0},
        t0=0.0,
        t_end=200.0,
        incarnations=[
            SimpleNamespace(slot=1, started=0.0, killed_at=None, read=lambda: cut_off),
            SimpleNamespace(slot=0, started=0.0, killed_at=None, read=lambda: other),
        ],
    )
    part = partition_summary(arm)
    assert part["rounds_to_remerge"] == 2  # 106 and 111 began after the heal
    assert part["rounds_ended_after_heal_to_remerge"] == 3  # the old count took in the round ending at 101
    assert part["seconds_to_remerge"] == 11.0
    assert part["other_side_grouped_rounds"] == 2  # 80 and 90 lie in the cut


def test_the_cut_off_peer_is_spared_from_kills_until_a_round_that_began_after_the_heal_grouped() -> None:
    """The chaos arm's re-merge (which ends the cut-off peer's immunity to kills) is the summary's: CI of stop
    57 killed it 4 s after the heal, once the round in flight at the heal had ended grouped, and the run had no
    re-merge round to count."""
    rounds = [{"event": "round", "t": 101.0, "duration_s": 4.0, "group_size": 2}]  # heal at 100: in flight
    cut_off = SimpleNamespace(slot=1, read=lambda: rounds, first=lambda event: {"event": event})
    other = SimpleNamespace(slot=0, read=lambda: [], first=lambda event: {"event": event})
    arm = SimpleNamespace(partition={"slot": 1, "healed_at": 100.0}, live=lambda: [cut_off, other])
    assert not _Arm._remerged(arm)
    assert _Arm.victims(arm) == [other]
    rounds.append({"event": "round", "t": 106.0, "duration_s": 4.0, "group_size": 3})  # began at 102
    assert _Arm._remerged(arm)
    arm.partition["remerged"] = True
    assert _Arm.victims(arm) == [cut_off, other]


def test_a_restart_after_the_bootstrap_loss_that_joined_counts_however_soon_it_was_killed() -> None:
    """Seed 8 of the 80 s run restarted two peers after the bootstrap node's death; both joined with verified
    state and both were killed within 30 s. Judged on settled restarts alone that read "0/0 joined", a failure.
    A restart that did not join is judged only once it lived long enough to have joined."""

    def restart(number: int, started: float, lived: float, joined: bool) -> SimpleNamespace:
        events = [{"event": "joined", "t": started + 5.0, "state_verified": True}] if joined else []
        events.append({"event": "first_step", "t": started + 6.0})
        return SimpleNamespace(
            name=f"peer0.{number}",
            number=number,
            started=started,
            killed_at=started + lived,
            read=lambda: events,
            first=lambda event: next((e for e in events if e["event"] == event), None),
        )

    arm = SimpleNamespace(
        bootstrap_killed_at=40.0,
        t0=0.0,
        t_end=80.0,
        config=SimpleNamespace(peers=4),
        incarnations=[restart(1, 10.0, 31.0, True), restart(2, 45.0, 12.0, True), restart(3, 58.0, 18.0, True)],
    )
    summary = restarts_summary(arm)
    assert (summary["after_bootstrap_loss"], summary["after_bootstrap_loss_joined"]) == (2, 2)
    assert summary["settled"] == 1  # the other check still judges settled restarts only
    arm.incarnations.append(restart(4, 60.0, 10.0, False))  # killed before it could have joined: not judged
    assert restarts_summary(arm)["after_bootstrap_loss"] == 2
    arm.incarnations[-1] = restart(4, 45.0, 35.0, False)  # lived long enough and never joined: a failure
    summary = restarts_summary(arm)
    assert (summary["after_bootstrap_loss"], summary["after_bootstrap_loss_joined"]) == (3, 2)
    config = ChaosConfig()
    result = {c["check"]: c["ok"] for c in checks(config, {**_passing_summary(), "restarts": summary}, baseline=None)}
    assert result["joins after bootstrap loss"] is False


# Judged by the full run (RESILIENCE.md) against the matrix's bounds; in a 80-second run they depend on where
# the kills land (three runs here: a cut inside a round stalled the majority side for the whole cut; a
# re-merge took 4 rounds; no restart after the bootstrap's death lived 30 s), so the test checks weaker
# forms of them below.
_TIMING_SENSITIVE = {
    "re-merge after partition",
    "both sides trained during the partition",
    "joins after bootstrap loss",
}


@pytest.mark.skipif(not _NETNS, reason="the chaos run needs network namespaces (root, ip, tc)")
@pytest.mark.heavy(seconds=100, timed=True)
def test_short_chaos_run_survives_every_fault(tmp_path) -> None:
    config = ChaosConfig(
        duration_s=80,
        peers=4,
        seed=7,
        baseline_s=0,
        kill_every_s=13,
        partition_s=25,
        joiners=0,
        lab="netns",
        sync_every=10,
        averaging_timeout_s=15,
    )
    result = run(config, work=tmp_path, console=Console(width=200))
    chaos = result["chaos"]
    # the faults fired: kills (and restarts), the partition, the slow host, the bootstrap node's death
    peer_kills = [k for k in chaos["kills"] if k["victim"] != "bootstrap"]
    assert len(peer_kills) >= 3, chaos["kills"]
    assert chaos["restarts"]["restarts"] == len(peer_kills)
    assert chaos["partition"] is not None and chaos["partition"]["seconds"] >= 25
    assert chaos["slow_host"] is not None
    assert chaos["bootstrap_killed_at_s"] is not None
    assert any(k["via"] == "live peers" for k in peer_kills), "no peer restarted after the bootstrap node died"
    failed = [c for c in result["checks"] if c["ok"] is False and c["check"] not in _TIMING_SENSITIVE]
    assert not failed, f"failed checks: {failed}; logs in {tmp_path}"
    # the timing-sensitive ones, in the form a 80-second run on a shared machine always owes
    part = chaos["partition"]
    assert part["isolated_side_steps"] > 0, part  # the cut-off peer kept training
    assert part["rounds_to_remerge"] is not None, part  # and was back in a group before the end
    after_loss = [r for r in chaos["restarts"]["rows"] if r["after_bootstrap_loss"] and r["lived_s"] >= 20]
    assert all(r["joined"] for r in after_loss), after_loss  # joined through live peers, not the dead node
