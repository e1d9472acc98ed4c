"""A contributing peer leaves cleanly on SIGTERM/SIGINT, and a SIGKILLed one leaves no orphans."""

import signal

import psutil
import pytest

from swarm.events import read_events
from tests.helpers import alive, descendants, python_cmd, spawn, terminate, wait_until


def _start_standalone_peer(tmp_path):
    events = tmp_path / "peer.jsonl"
    child = spawn(
        python_cmd(
            "-m",
            "swarm.peer",
            "--run",
            "life",
            "--task-preset",
            "tiny",
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--identity-key",
            str(tmp_path / "k"),
            "--events",
            str(events),
            "--torch-threads",
            "1",
            "--no-progress",
            "--sync-every",
            "5",
            "--round-timeout-s",
            "10",
            "--load-state-timeout-s",
            "5",
        )
    )
    wait_until(
        lambda: any(e["event"] == "first_step" for e in read_events(events)) or child.returncode is not None,
        timeout_s=90,
        message=child.describe,
    )
    assert child.returncode is None, child.describe()
    tree = descendants(child.pid)
    names = {p.name() for p in tree}
    assert "p2pd" in names, f"expected a p2pd below the peer, got {names}"
    assert len(tree) >= 3, f"expected the reaper, the DHT child and p2pd, got {[(p.pid, p.name()) for p in tree]}"
    return child, tree, events


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_leaves_cleanly(tmp_path, sig):
    child, tree, events = _start_standalone_peer(tmp_path)
    assert terminate(child, timeout_s=30, sig=sig) == 0, child.describe()
    wait_until(lambda: not alive(tree), timeout_s=5, message=lambda: f"left behind: {alive(tree)}")
    stop = [e for e in read_events(events) if e["event"] == "stop"]
    assert stop and stop[0]["signal"] == sig.name


@pytest.mark.timeout(120)
def test_sigkill_leaves_no_orphans_within_5_s(tmp_path):
    child, tree, _ = _start_standalone_peer(tmp_path)
    p2pd = [p for p in tree if p.name() == "p2pd"]
    child.popen.send_signal(signal.SIGKILL)
    child.popen.wait(timeout=10)
    # the hard kill really happened, and the children were alive right after it
    assert child.popen.returncode == -signal.SIGKILL
    assert all(isinstance(p, psutil.Process) for p in p2pd)
    wait_until(lambda: not alive(tree), timeout_s=5, message=lambda: f"orphans: {alive(tree)}")
