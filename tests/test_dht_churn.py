"""TESTMATRIX rows 16-17 at test size (benchmarks/dht_churn.py): 20 DHT peers joined through a
`python -m bootstrap` node; 2 of them (10%) crash at once (SIGKILL of their DHT process and p2pd);
lookups of stored keys and capability queries from live peers still succeed (>= 99%); then the bootstrap
node is SIGKILLed and a new peer joins through one live peer's address only.

The test checks that the faults fired on its own, through the benchmark's observer: at the moment the
lookups start, every victim process (one p2pd per victim among them) is gone, and at the moment the late
joiner starts, the bootstrap node's whole process tree is gone and the joiner's initial peers name one
live peer and not the bootstrap node.
"""

from __future__ import annotations

import os
from typing import Any

import psutil
import pytest
from helpers import p2pd_pids

from benchmarks.dht_churn import DHTChurnConfig, run

SEED = 16_17
CONFIG = DHTChurnConfig(
    peers=20,
    kill_fraction=0.1,
    keys=40,
    baseline_lookups=0,
    lookups=100,
    queries=10,
    parallel=8,
    phase_timeout_s=30.0,
    seed=SEED,
)


def _running(entry: dict[str, Any]) -> bool:
    """Whether the process described by a fault event (pid + create time) still runs; zombies are dead."""
    try:
        proc = psutil.Process(entry["pid"])
        return abs(proc.create_time() - entry["create_time"]) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.heavy(seconds=31, timed=True)
def test_dht_survives_churn_and_a_new_peer_joins_after_bootstrap_loss() -> None:
    seen: dict[str, Any] = {}

    def observe(moment: str, facts: dict[str, Any]) -> None:
        if moment == "peers_crashed":
            victims = [e for e in facts["events"] if e["phase"] == "peer_crash"]
            seen["victim_procs"] = [p for e in victims for p in e["procs"]]
            seen["victims_running"] = [p for p in seen["victim_procs"] if _running(p)]
        elif moment == "joining":
            (bootstrap,) = [e for e in facts["events"] if e["phase"] == "bootstrap_crash"]
            seen["bootstrap_procs"] = bootstrap["procs"]
            seen["bootstrap_running"] = [p for p in bootstrap["procs"] if _running(p)]
            seen["joining"] = facts

    p2pd_before = set(p2pd_pids(os.getpid()))
    result = run(CONFIG, observe=observe)
    why = f"seed {SEED}; checks: {result['checks']}"

    # the faults fired, exactly once per victim and once for the bootstrap node
    assert result["faults"]["fired"] == {"peer_crash": 2, "bootstrap_crash": 1}, why
    assert len(result["kill"]["victims"]) == 2 and result["kill"]["all_landed"], why
    names = sorted(p["name"] for p in seen["victim_procs"])
    assert names.count("p2pd") == 2 and len(names) == 4, names  # each victim: its DHT process and its p2pd
    assert seen["victims_running"] == [], seen["victims_running"]  # gone before the first lookup

    # churn: lookups and capability queries from live peers still succeed
    lookups, queries = result["after_kill"]["lookups"], result["after_kill"]["queries"]
    assert lookups["lookups"] == CONFIG.lookups and lookups["success_rate"] >= 0.99, (lookups, why)
    assert queries["completeness"] >= 0.99 and queries["expected_per_query"] == 18, (queries, why)

    # bootstrap loss: the joiner came in through a live peer while the bootstrap node was dead
    join, joining = result["join"], seen["joining"]
    assert "p2pd" in [p["name"] for p in seen["bootstrap_procs"]], seen["bootstrap_procs"]  # its whole tree
    assert seen["bootstrap_running"] == [] and join["bootstrap_alive_at_join"] == [], (seen["bootstrap_running"], join)
    assert joining["initial_peers"] and all(
        m.endswith(f"/p2p/{joining['via_peer_id']}") for m in joining["initial_peers"]
    ), joining
    assert joining["via_peer_id"] not in result["kill"]["victim_peer_ids"]
    assert not any(joining["bootstrap_peer_id"] in m for m in joining["initial_peers"]), joining
    assert join["joined"] and join["record_published"], join
    assert join["reads"]["success_rate"] >= 0.99, (join["reads"], why)
    assert join["sees_all_live_s"] is not None and join["first_query_completeness"] >= 0.99, join
    assert join["checkers_seeing_joiner"] == len(join["checkers"]) > 0, join

    assert result["passed"], why
    assert set(p2pd_pids(os.getpid())) <= p2pd_before  # every DHT this run started is stopped
