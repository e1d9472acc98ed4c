"""Session-wide guard against leaked processes, plus fixtures for bootstrap nodes.

Leak guard (autouse, session scope): every process spawned during the session inherits the marker
`SWARM_TEST_SESSION=<uuid>` in its environment (hivemind passes `os.environ` on to `p2pd`). At the
end of the session, any process that is (a) still a descendant of pytest, or (b) a `p2pd` or other
process carrying this session's marker that did not exist at the start (i.e. an orphan), is
SIGKILLed and the session fails with the list of leaked pids and command lines. Processes from other
sessions on the same machine (no marker, or another marker) are left alone. Leaks get a few seconds
to exit on their own first, since a reaper needs up to a poll interval plus its grace period.

One torch thread a process: the session runs two pytest workers and dozens of peer processes on a
few cores, and torch's default (a thread a core in every process) oversubscribes them, so an in-process
test beside a run of peers slowed 15-fold (81 s against 5 s alone). As torchrun does for several workers on
one host, `OMP_NUM_THREADS` defaults to 1 for the workers and every process they start; a test that needs
another count sets it (`torch.set_num_threads`, `--torch-threads`), and `OMP_NUM_THREADS=N make test`
overrides the default.

Fixtures: `free_port` (a function), `bootstrap_node` (a running loopback bootstrap node; yields
its list of `--initial-peers` maddrs). More helpers live in `tests/helpers.py`.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator

# before anything imports torch (no plugin does before this file; tests/test_architecture.py checks the result),
# and inherited by every child
os.environ.setdefault("OMP_NUM_THREADS", "1")

import psutil  # noqa: E402
import pytest  # noqa: E402
from helpers import BootstrapNode, alive, start_bootstrap, terminate  # noqa: E402
from helpers import free_port as _free_port  # noqa: E402

SESSION_ENV = "SWARM_TEST_SESSION"
_LEAK_GRACE_S = 5.0
# interpreter-lifetime helpers that exit with pytest itself
_BENIGN_CMDLINE_PARTS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "torch_shm_manager")


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()) or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "?"


def _carries_marker(proc: psutil.Process, token: str) -> bool:
    try:
        return proc.environ().get(SESSION_ENV) == token
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return False


def _is_benign(proc: psutil.Process, me: int) -> bool:
    cmdline = _cmdline(proc)
    if any(part in cmdline for part in _BENIGN_CMDLINE_PARTS):
        return True
    # a lifetime reaper that watches pytest itself exits when pytest does: that is its job
    return "bootstrap.lifetime" in cmdline and f"--parent {me} " in f"{cmdline} "


def _leaked(token: str, me: int, existing: set[tuple[int, float]]) -> list[psutil.Process]:
    found = {proc.pid: proc for proc in psutil.Process(me).children(recursive=True)}
    for proc in psutil.process_iter():
        if proc.pid != me and proc.pid not in found and _carries_marker(proc, token):
            found[proc.pid] = proc
    leaks = []
    for proc in alive(found.values()):
        try:
            key = (proc.pid, proc.create_time())
        except psutil.NoSuchProcess:
            continue
        if key not in existing and not _is_benign(proc, me):
            leaks.append(proc)
    return leaks


def _snapshot_existing() -> set[tuple[int, float]]:
    existing = set()
    for proc in psutil.process_iter():
        try:
            existing.add((proc.pid, proc.create_time()))
        except psutil.NoSuchProcess:
            continue
    return existing


@pytest.fixture(scope="session", autouse=True)
def no_leaked_processes() -> Iterator[None]:
    """Fail the session if it leaves processes behind (see the module docstring)."""
    token = uuid.uuid4().hex
    previous = os.environ.get(SESSION_ENV)
    os.environ[SESSION_ENV] = token
    existing = _snapshot_existing()
    me = os.getpid()
    yield
    try:
        deadline = time.monotonic() + _LEAK_GRACE_S
        leaks = _leaked(token, me, existing)
        while leaks and time.monotonic() < deadline:
            time.sleep(0.1)
            leaks = _leaked(token, me, existing)
        if leaks:
            report = "\n".join(f"  pid {proc.pid}: {_cmdline(proc)}" for proc in leaks)
            for proc in leaks:
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    continue
            pytest.fail(f"{len(leaks)} process(es) leaked by the test session (now SIGKILLed):\n{report}")
    finally:
        if previous is None:
            os.environ.pop(SESSION_ENV, None)
        else:
            os.environ[SESSION_ENV] = previous


@pytest.fixture(name="free_port")
def free_port_fixture() -> Callable[[], int]:
    """A function returning a TCP port on 127.0.0.1 that was free a moment ago."""
    return _free_port


@pytest.fixture(scope="session")
def bootstrap_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """One loopback bootstrap node (`python -m bootstrap`) for the session, started on first use; yields
    its `--initial-peers` maddrs. Tests on it keep apart by run name (or averaging prefix), as runs on
    one network do.

    Teardown sends SIGTERM and requires exit code 0 within 15 s.
    """
    node: BootstrapNode = start_bootstrap(tmp_path_factory.mktemp("bootstrap") / "bootstrap.id")
    try:
        yield node.maddrs
    finally:
        returncode = terminate(node.child, timeout_s=15)
    assert returncode == 0, node.child.describe()


@pytest.fixture(scope="session", autouse=True)
def private_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every process of the session gets an empty HOME: default identity keys and checkpoint folders
    (~/.swarm/...) land in a temporary directory, never in the user's."""
    previous = os.environ.get("HOME")
    os.environ["HOME"] = str(tmp_path_factory.mktemp("home"))
    yield
    if previous is not None:
        os.environ["HOME"] = previous


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Schedule `make test`'s two workers (pytest-xdist, `--dist loadgroup`).

    The `heavy` tests come first, longest first (stable otherwise), so the long end-to-end runs start
    at once and the short tests fill in around them. The `heavy(timed=True)` ones (fixed-duration runs
    with kills and deadlines: chaos, demo, churn) all go to one worker, so two of them never share the
    two cores; the other worker runs everything else beside them."""

    def weight(item: pytest.Item) -> float:
        marker = item.get_closest_marker("heavy")
        return -float(marker.kwargs.get("seconds", 1)) if marker is not None else 0.0

    items.sort(key=weight)
    for item in items:
        marker = item.get_closest_marker("heavy")
        if marker is not None and marker.kwargs.get("timed"):
            item.add_marker(pytest.mark.xdist_group("timed"))
