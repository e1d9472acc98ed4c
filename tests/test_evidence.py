"""The evidence of real runs: ledgers, receipts in sealed manifests, the live status board, metrics, the report.

Two end-to-end checks on loopback with real `swarm.peer` processes:
* a short `python -m swarm.demo` (a peer SIGKILLed and replaced): every ledger verifies, receipts back
  each peer's contribution and agree with the sealed manifests, and the HTML report shows every plot;
* two peers training: `--metrics-port` serves the documented metrics and `swarm.status --once --json`
  shows both peers, their group and the sealed checkpoint, while the run goes on.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarm.checkpoint.manifest import SignedManifest, verify_manifest
from swarm.ledger import find_ledgers, read_entries, verify_ledger
from swarm.metrics import METRIC_NAMES
from swarm.report import PNG_NAMES
from tests.helpers import free_port, python_cmd, spawn, terminate_all, wait_until


@pytest.mark.timeout(300)
@pytest.mark.heavy(seconds=44, timed=True)
def test_demo_run_leaves_verifiable_ledgers_receipts_and_a_report(tmp_path):
    out = tmp_path / "demo"
    demo = spawn(python_cmd("-m", "swarm.demo", "--peers", "3", "--duration", "34", "--out", str(out)))
    wait_until(lambda: demo.returncode is not None, timeout_s=240, message=demo.describe)
    assert demo.returncode == 0, demo.describe()

    ledgers = find_ledgers(out / "ledgers")
    assert len(ledgers) == 4, ledgers  # 3 peers + the replacement of the SIGKILLed one
    verdicts = [verify_ledger(path) for path in ledgers]
    assert all(v.ok for v in verdicts), [v.problems for v in verdicts if not v.ok]
    verify = spawn(python_cmd("-m", "swarm.ledger", "verify", str(out / "ledgers")))
    wait_until(lambda: verify.returncode is not None, timeout_s=60, message=verify.describe)
    assert verify.returncode == 0, verify.describe()

    entries = {path: read_entries(path) for path in ledgers}
    kinds = {e.kind for es in entries.values() for e in es}
    assert {"start", "joined", "round", "receipt", "checkpoint_sealed", "state_synced", "stop"} <= kinds, kinds
    killed = [path for path, es in entries.items() if es[-1].kind != "stop"]
    assert len(killed) == 1, "exactly the SIGKILLed peer's ledger ends without a stop entry"
    # TESTMATRIX row 18: the peers stopped by SIGTERM, whatever they were doing, left no partial file behind
    stopped = [es[0].peer for path, es in entries.items() if path not in killed]
    folders = [out / "checkpoints" / "demo" / peer for peer in stopped]
    assert all((folder / "shards").is_dir() for folder in folders), folders  # they sealed into these
    partial = [p for folder in folders for p in folder.rglob("*") if p.name.startswith(".tmp-")]
    assert partial == [], partial

    receipts = spawn(
        python_cmd("-m", "swarm.ledger", "receipts", "--run", "demo", "--dir", str(out / "ledgers"), "--json")
    )
    wait_until(lambda: receipts.returncode is not None, timeout_s=60, message=receipts.describe)
    assert receipts.returncode == 0, receipts.describe()
    receipts.join_output()
    rows = json.loads(receipts.stdout())["peers"]
    assert len(rows) == 4 and all(row["samples"] > 0 and row["rounds"] > 0 for row in rows), rows
    assert all(row["witnessed"] >= 1 for row in rows), "each peer's receipts are held by another member too"
    own_rounds = {
        path: {e.body["round"] for e in es if e.kind == "round" and not e.body["solo"]} for path, es in entries.items()
    }
    for path, es in entries.items():  # every grouped round of a peer that finished is backed by its receipt
        mine = {
            e.body["receipt"]["round"] for e in es if e.kind == "receipt" and e.body["receipt"]["peer"] == es[0].peer
        }
        if path not in killed:
            assert own_rounds[path] == mine, (path.name, own_rounds[path] - mine)

    sealed = [
        SignedManifest.from_bytes(f.read_bytes()) for f in (out / "checkpoints" / "demo").glob("*/manifests/*.json")
    ]
    assert sealed, "no sealed manifest on disk"
    with_receipts = [s for s in sealed if s.receipts]
    assert with_receipts, "sealed manifests carry no receipts"
    for signed in with_receipts:
        verify_manifest(signed, run_id="demo")  # signatures, quorum and every receipt
        for item in signed.receipts:
            assert item.receipt.samples == signed.manifest.contributions[item.receipt.peer]

    html = (out / "report.html").read_text()
    for name in PNG_NAMES.values():
        png = out / "report" / name
        assert name in html and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def _scrape(url: str) -> list:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return list(text_string_to_metric_families(text))


def _rounds_ok(url: str) -> float:
    try:
        samples = [s for family in _scrape(url) for s in family.samples]
    except OSError:
        return 0.0
    return sum(s.value for s in samples if s.name == "swarm_rounds_total" and s.labels.get("outcome") == "ok")


@pytest.mark.timeout(240)
@pytest.mark.heavy(seconds=19)
def test_metrics_and_status_board_of_a_live_run(bootstrap_node, tmp_path):
    port = free_port()
    peers = []
    for i in range(2):
        extra = ["--metrics-port", str(port)] if i == 0 else []
        peers.append(
            spawn(
                python_cmd(
                    "-m",
                    "swarm.peer",
                    "--initial-peers",
                    *bootstrap_node,
                    "--run",
                    "live",
                    "--task-preset",
                    "tiny",
                    "--host-maddrs",
                    "/ip4/127.0.0.1/tcp/0",
                    "--shard-index",
                    str(i),
                    "--num-shards",
                    "2",
                    "--identity-key",
                    str(tmp_path / f"p{i}.key"),
                    "--torch-threads",
                    "1",
                    "--no-progress",
                    "--sync-every",
                    "10",
                    "--target-group-size",
                    "2",
                    "--record-refresh-s",
                    "2",
                    "--record-expiry-s",
                    "8",
                    "--checkpoint-dir",
                    str(tmp_path / "ckpt"),
                    "--ledger-dir",
                    str(tmp_path / "ledgers"),
                    "--duration-s",
                    "120",
                    "--eval-every",
                    "1",  # the board's validation loss from the first rounds on
                    *extra,
                )
            )
        )
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        wait_until(lambda: _rounds_ok(url) >= 2, timeout_s=150, message=lambda: peers[0].describe())
        families = _scrape(url)
        served = {family.name for family in families}  # the parser drops a counter's "_total"
        assert {name.removesuffix("_total") for name in METRIC_NAMES} <= served, served
        samples = [s for family in families for s in family.samples]
        values = {s.name: s.value for s in samples if not s.labels}
        assert values["swarm_round"] >= 2 and values["swarm_step"] >= 20 and values["swarm_bytes_sent_total"] > 0
        assert values["swarm_peers_known"] >= 1 and values["swarm_samples_total"] > 0
        assert values["swarm_checkpoints_sealed_total"] >= 1

        def board() -> dict | None:
            status = spawn(
                python_cmd(
                    "-m", "swarm.status", "--initial-peers", *bootstrap_node, "--run", "live", "--once", "--json"
                )
            )
            wait_until(lambda: status.returncode is not None, timeout_s=60, message=status.describe)
            assert status.returncode == 0, status.describe()
            status.join_output()
            snapshot = json.loads(status.stdout())
            ready = len(snapshot["peers"]) == 2 and snapshot["groups"] and snapshot["checkpoint"]
            return snapshot if ready else None

        snapshot = wait_until(board, timeout_s=60, message="the board never showed 2 peers, a group and a checkpoint")
        assert {p["state"] for p in snapshot["peers"]} == {"training"}
        assert len(snapshot["groups"][0]["members"]) == 2
        assert snapshot["checkpoint"]["step"] >= 1 and len(snapshot["checkpoint"]["signers"]) == 2
        assert snapshot["progress"]["round"] >= 2 and snapshot["progress"]["val_loss"] is not None
        assert any(e["kind"] == "joined" for e in snapshot["events"])
    finally:
        terminate_all(peers, timeout_s=30)
    assert [p.returncode for p in peers] == [0, 0], [p.describe() for p in peers]
    for path in find_ledgers(tmp_path / "ledgers"):
        assert verify_ledger(path).ok and read_entries(Path(path))[-1].kind == "stop"
