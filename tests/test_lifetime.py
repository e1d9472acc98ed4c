"""A SIGKILLed Swarm process takes its DHT child and p2pd with it (TESTMATRIX row 20: hard kill)."""

from __future__ import annotations

import json
import signal
import textwrap
import threading
import time

import psutil
import pytest
from helpers import alive, python_cmd, read_line_matching, spawn, terminate, wait_until

from bootstrap.lifetime import StopSignal

# Runs in a subprocess: reaper first, then a DHT (forked DHT child + its p2pd), then report the
# tree and idle (bounded) until the test kills us.
_VICTIM = textwrap.dedent(
    """
    import json, os, threading
    import hivemind, psutil
    from bootstrap.lifetime import start_reaper

    reaper = start_reaper()
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
    tree = [p for p in psutil.Process().children(recursive=True) if p.pid != reaper.pid]
    info = {"reaper": reaper.pid, "tree": [{"pid": p.pid, "name": p.name()} for p in tree]}
    print("TREE " + json.dumps(info), flush=True)
    threading.Event().wait(120)
    """
)


@pytest.mark.timeout(60)
def test_sigkill_reaps_dht_child_and_p2pd() -> None:
    victim = spawn(python_cmd("-c", _VICTIM))
    try:
        info = json.loads(read_line_matching(victim, r"^TREE (.*)$", timeout_s=30)[1])
    except BaseException:
        terminate(victim, timeout_s=10, sig=signal.SIGKILL)
        raise
    names = {entry["name"] for entry in info["tree"]}
    assert "p2pd" in names, f"expected the DHT's p2pd among the descendants, got {info['tree']}"
    assert len(info["tree"]) >= 2, f"expected the DHT child and p2pd, got {info['tree']}"
    tree = [psutil.Process(entry["pid"]) for entry in info["tree"]]
    reaper = psutil.Process(info["reaper"])
    assert alive(tree) == tree, "the victim's children must be alive right before the kill"
    assert alive([reaper]) == [reaper], "the reaper must be running before the kill"

    killed_at = time.monotonic()
    victim.popen.kill()
    assert victim.popen.wait(timeout=10) == -signal.SIGKILL

    wait_until(lambda: not alive(tree), timeout_s=5.0, message=lambda: f"orphans {[p.pid for p in alive(tree)]} gone")
    reaped_s = time.monotonic() - killed_at
    wait_until(lambda: not alive([reaper]), timeout_s=5.0, message="reaper exit")
    print(f"reaper removed {len(tree)} orphans ({sorted(names)}) {reaped_s:.2f} s after SIGKILL")


@pytest.mark.timeout(30)
def test_start_reaper_is_idempotent_and_exits_with_a_clean_parent() -> None:
    script = textwrap.dedent(
        """
        from bootstrap.lifetime import start_reaper
        first, second = start_reaper(), start_reaper()
        assert first is second
        print("REAPER", first.pid, flush=True)
        """
    )
    child = spawn(python_cmd("-c", script))
    reaper_pid = int(read_line_matching(child, r"^REAPER (\d+)$", timeout_s=20)[1])
    assert child.popen.wait(timeout=20) == 0, child.describe()
    # nothing to reap: the watchdog notices its parent is gone and exits on its own
    wait_until(
        lambda: not psutil.pid_exists(reaper_pid) or not alive([psutil.Process(reaper_pid)]),
        timeout_s=5.0,
        message="reaper exit",
    )


def test_start_reaper_rejects_bad_intervals() -> None:
    from bootstrap.lifetime import start_reaper

    with pytest.raises(ValueError, match="poll_interval_s"):
        start_reaper(poll_interval_s=0)
    with pytest.raises(ValueError, match="grace_s"):
        start_reaper(grace_s=-1)


_ARMED_CHILD = textwrap.dedent(
    """
    import threading
    from bootstrap.lifetime import set_parent_death_signal
    assert set_parent_death_signal()
    print("ARMED", flush=True)
    threading.Event().wait(60)
    """
)
# starts the child above (same stdout), reports its pid and waits (bounded) to be killed
_PARENT_OF_ARMED = textwrap.dedent(
    """
    import subprocess, sys, threading
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
    print("CHILD", child.pid, flush=True)
    threading.Event().wait(60)
    """
)


@pytest.mark.timeout(30)
def test_parent_death_signal_kills_the_child_with_its_parent() -> None:
    parent = spawn(python_cmd("-c", _PARENT_OF_ARMED, _ARMED_CHILD))
    child = psutil.Process(int(read_line_matching(parent, r"^CHILD (\d+)$", timeout_s=20)[1]))
    read_line_matching(parent, r"^ARMED$", timeout_s=20)
    parent.popen.kill()
    parent.popen.wait(timeout=10)
    wait_until(lambda: not alive([child]), timeout_s=5.0, message="child exit after its parent's SIGKILL")


# A signal that lands inside a string eval (a namedtuple being built by a lazy import: the bootstrap
# node's CI flake) with a handler that raises KeyboardInterrupt: CPython 3.11 then exits by SIGINT
# (-2) even though the exception was caught. StopSignal raises nothing on the first signal.
_SIGNAL_IN_EVAL = textwrap.dedent(
    """
    import signal, sys
    from bootstrap.lifetime import StopSignal

    def raising(signum, frame):
        raise KeyboardInterrupt

    stop = StopSignal()
    if sys.argv[1] == "raising":
        signal.signal(signal.SIGTERM, raising)
    else:
        stop.install()
    try:
        eval("__import__('signal').raise_signal(signal.SIGTERM)", {"signal": signal})
    except KeyboardInterrupt:
        print("caught KeyboardInterrupt", flush=True)
    print(f"stop requested: {stop.event.is_set()} by {stop.signal_name}", flush=True)
    stop.restore()
    """
)


@pytest.mark.parametrize("handler", ["raising", "StopSignal"])
def test_a_signal_inside_eval_exits_0_only_with_stop_signal(handler: str) -> None:
    child = spawn(python_cmd("-c", _SIGNAL_IN_EVAL, handler))
    returncode = terminate(child, timeout_s=30, sig=None)
    child.join_output()
    if handler == "raising":  # the hazard is real: the fault fired and was caught, yet the exit is -2
        assert "caught KeyboardInterrupt" in child.stdout() and returncode == -signal.SIGINT, child.describe()
    else:
        assert child.stdout().splitlines() == ["stop requested: True by SIGTERM"] and returncode == 0, child.describe()


@pytest.mark.parametrize("second_interrupts", [True, False])
def test_stop_signal_second_signal_interrupts_only_if_asked(second_interrupts: bool) -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    called = []
    with StopSignal(second_interrupts=second_interrupts) as stop:
        stop.on_stop.append(lambda: called.append(True))
        signal.raise_signal(signal.SIGINT)
        assert stop.event.is_set() and stop.signal_name == "SIGINT" and called == [True]
        signal.raise_signal(signal.SIGTERM)  # at once: the same request delivered twice (`timeout`, a process group)
        assert called == [True] and stop.signal_name == "SIGINT"
        stop.SAME_REQUEST_S = 0.0  # from now on another signal is the user insisting
        if second_interrupts:
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGTERM)
        else:
            signal.raise_signal(signal.SIGTERM)
        assert called == [True] and stop.signal_name == "SIGINT"
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_signal_that_lands_inside_the_handler_neither_deadlocks_nor_counts_as_insisting() -> None:
    """Python runs signal handlers between bytecodes of the main thread, a handler's own included, so a second
    signal (``timeout`` signals its child, then the child's process group) can land while the first's handler is
    inside `event.set()`, holding the event's lock. Emulated here: the nested call runs while that lock is held.
    Before `_fired`, the nested call took the lock again and the process hung for good (seen: a `swarm.peer` under
    `setsid timeout` stuck in `_handle` until SIGKILL)."""
    stop = StopSignal()
    nested: list[bool] = []

    class Landing(threading.Event):
        def set(self) -> None:
            with self._cond:  # what Event.set holds
                if not nested:
                    nested.append(True)
                    stop._handle(signal.SIGTERM, None)  # the second signal lands here
                self._flag = True
                self._cond.notify_all()

    stop.event = Landing()
    done = threading.Event()

    def first() -> None:
        stop._handle(signal.SIGINT, None)
        done.set()

    threading.Thread(target=first, daemon=True).start()
    assert done.wait(5), "the nested handler deadlocked on the event's lock"
    assert nested == [True] and stop.event.is_set() and stop.signal_name == "SIGINT"


# torch's libshm starts `torch_shm_manager` at a process's first shared tensor (hivemind's first MPFuture,
# inside `hivemind.DHT.__init__`) and reads its handshake; a signal that interrupts that read leaves the thread
# spinning in `start_manager()` at full CPU, for good (a Ctrl+C 2.6-2.9 s into `swarm.peer`'s start-up hung it
# in 3 of 8 tries). The child starts its first shared tensor once SIGINTs, caught by a counting handler, are
# already arriving, and the test keeps sending them every 0.5 ms while it allocates.
_FIRST_SHARED_TENSOR = textwrap.dedent(
    """
    import signal, sys, time
    caught = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    import hivemind, torch  # hivemind sets torch's "file_system" sharing strategy
    from bootstrap.node import start_shm_manager

    print("READY", flush=True)
    deadline = time.monotonic() + 20
    while not caught and time.monotonic() < deadline:
        time.sleep(0.001)
    if sys.argv[1] == "start_shm_manager":
        start_shm_manager()
    torch.empty(1, dtype=torch.uint8).share_memory_()
    print(f"SHARED after {len(caught)} signals", flush=True)
    """
)


def _cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["start_shm_manager", "raw (negative control)"])
def test_signals_during_the_first_shared_tensor_do_not_hang_start_up(path: str) -> None:
    child = spawn(python_cmd("-c", _FIRST_SHARED_TENSOR, path.split()[0]))
    try:
        read_line_matching(child, r"^READY$", timeout_s=30)
        bombard_until = time.monotonic() + 3.0
        while child.popen.poll() is None and time.monotonic() < bombard_until and "SHARED" not in child.stdout():
            child.popen.send_signal(signal.SIGINT)
            time.sleep(0.0005)
        if path == "start_shm_manager":
            match = read_line_matching(child, r"^SHARED after (\d+) signals$", timeout_s=10)
            assert int(match[1]) >= 1, child.describe()
            assert terminate(child, timeout_s=10, sig=None) == 0, child.describe()
        else:  # the hazard is real: signals landed (the fault fired) and the thread spins in start_manager
            assert child.popen.poll() is None and "SHARED" not in child.stdout(), child.describe()
            before = _cpu_s(child.pid)
            time.sleep(1.0)  # a CPU-time sample, not a synchronisation
            assert _cpu_s(child.pid) - before > 0.5, "the hung child should spin at full CPU"
    finally:
        if child.popen.poll() is None:
            terminate(child, timeout_s=10, sig=signal.SIGKILL)


# Runs in a subprocess: the check is registered first, so it runs last (atexit is last in, first out), after
# the freeze that start_dht registered (once, however many DHTs the process starts).
_FROZEN_AT_EXIT = textwrap.dedent(
    """
    import atexit, gc
    atexit.register(lambda: print(f"FROZEN {gc.get_freeze_count()}", flush=True))
    from bootstrap import start_dht, stop_dht
    from bootstrap.lifetime import freeze_heap_at_exit

    for _ in range(2):
        stop_dht(start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False))
    freeze_heap_at_exit()
    print(f"RUNNING {gc.get_freeze_count()}", flush=True)
    """
)


@pytest.mark.timeout(60)
def test_a_process_that_started_a_dht_freezes_its_heap_once_at_exit_only() -> None:
    child = spawn(python_cmd("-c", _FROZEN_AT_EXIT))
    assert terminate(child, timeout_s=45, sig=None) == 0, child.describe()
    child.join_output()
    lines = child.stdout().splitlines()
    assert lines[0] == "RUNNING 0" and lines[1].startswith("FROZEN ") and len(lines) == 2, child.describe()
    assert int(lines[1].split()[1]) > 100_000, child.describe()  # torch and hivemind's objects
