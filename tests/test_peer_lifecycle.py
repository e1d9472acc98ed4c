"""A contributing peer leaves cleanly on SIGTERM/SIGINT, and a SIGKILLed one leaves no orphans."""

import signal

import psutil
import pytest

from swarm.events import read_events
from tests.helpers import alive, descendants, python_cmd, spawn, terminate, wait_until


def _start_standalone_peer(tmp_path, env=None):
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
        ),
        env=env,
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
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV], ids=["SIGKILL", "a crash (SIGSEGV)"])
def test_a_killed_or_crashed_peer_leaves_no_orphans_within_5_s(tmp_path, sig):
    """A killed or crashed peer leaves no children behind; a crash in native code leaves its threads' Python
    stacks on stderr (swarm.peer enables faulthandler itself: the one spawn sets through the environment is off)."""
    child, tree, _ = _start_standalone_peer(tmp_path, env={"PYTHONFAULTHANDLER": ""})
    p2pd = [p for p in tree if p.name() == "p2pd"]
    child.popen.send_signal(sig)
    child.popen.wait(timeout=10)
    # the hard kill really happened, and the children were alive right after it
    assert child.popen.returncode == -sig
    assert all(isinstance(p, psutil.Process) for p in p2pd)
    wait_until(lambda: not alive(tree), timeout_s=5, message=lambda: f"orphans: {alive(tree)}")
    if sig == signal.SIGSEGV:
        wait_until(
            lambda: "Fatal Python error: Segmentation fault" in child.stderr(), timeout_s=5, message=child.describe
        )
        assert 'File "' in child.stderr().split("Fatal Python error")[1], child.describe()


def test_a_wait_on_the_network_runtime_ends_at_a_stop_request_or_its_deadline():
    import concurrent.futures
    import threading
    import time

    from bootstrap import Stopped
    from bootstrap.runtime import result_within

    cancel, never = threading.Event(), concurrent.futures.Future()
    threading.Timer(0.3, cancel.set).start()
    started = time.monotonic()
    with pytest.raises(Stopped):
        result_within(never, timeout_s=60, cancel=cancel)
    assert time.monotonic() - started < 1.0 and never.cancelled()
    late = concurrent.futures.Future()
    with pytest.raises(TimeoutError):
        result_within(late, timeout_s=0.3, cancel=threading.Event())
    assert late.cancelled()
    failed = concurrent.futures.Future()  # the work itself timed out: at once, not by polling until the deadline
    failed.set_exception(TimeoutError("the work's own"))
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        result_within(failed, timeout_s=30, cancel=threading.Event())
    assert time.monotonic() - started < 1.0
    done = concurrent.futures.Future()
    done.set_result(7)
    assert result_within(done, timeout_s=0, cancel=cancel) == 7  # a result that is in wins over a stop


@pytest.mark.timeout(60)
def test_a_stop_request_while_the_trainer_syncs_its_state_ends_the_join(tmp_path, monkeypatch):
    """A Trainer joining looks for the run's newest sealed state, up to ``load_state_timeout_s`` (60 s by
    default, beyond a supervisor's grace): a stop request (``cancel``, swarm.peer's SIGTERM) ends it at once,
    the constructor raises Stopped and nothing of the trainer is left running."""
    import asyncio
    import threading
    import time

    import torch

    from bootstrap import Stopped
    from bootstrap.runtime import NetworkRuntime
    from swarm.checkpoint.gossip import ManifestGossip
    from swarm.trainer import Trainer

    searching = threading.Event()

    async def a_search_that_never_ends(self):  # the fault: a DHT index read that does not return
        searching.set()
        await asyncio.sleep(3600)

    monkeypatch.setattr(ManifestGossip, "_from_index", a_search_that_never_ends)
    cancel = threading.Event()
    threading.Thread(target=lambda: searching.wait(30) and cancel.set(), daemon=True).start()
    model = torch.nn.Linear(4, 2)
    started = time.monotonic()
    with pytest.raises(Stopped):
        Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            run="stopped-joining",
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            checkpoint_dir=str(tmp_path / "ck"),
            ledger_dir=str(tmp_path / "ledgers"),
            identity_key=str(tmp_path / "k"),
            load_state_timeout_s=60,
            cancel=cancel,
        )
    assert searching.is_set(), "the state sync never began: the fault did not fire"
    assert time.monotonic() - started < 20, "the join ran on after the stop request"
    assert NetworkRuntime.count() == 0, "the trainer's network runtime is still running"
