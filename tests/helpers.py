"""Helpers for tests that spawn Swarm processes (bootstrap nodes, peers) and watch them.

Everything here polls with a deadline; nothing sleeps for a fixed time to synchronise.

* `spawn(cmd)` starts a process whose stdout/stderr are drained by background threads into
  `Child.stdout_lines` / `Child.stderr_lines`, so a chatty child never blocks on a full pipe.
* `read_line_matching(child, pattern, timeout_s)` waits for a matching output line.
* `wait_until(predicate, timeout_s)` polls any condition.
* `terminate(child, timeout_s)` stops a process (SIGTERM by default) and returns its exit code;
  `terminate_all(children, timeout_s)` signals them all at once, then waits for each.
* `descendants(pid)`, `p2pd_pids(pid)`, `alive(pids)` inspect process trees (psutil).
* `free_port()`, `bootstrap_cmd(...)`, `start_bootstrap(...)` for bootstrap nodes.
* `parse_python(source)`: `ast.parse`, safe beside other threads that parse (see its docstring).
"""

from __future__ import annotations

import ast
import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TypeVar

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
INITIAL_PEERS_RE = re.compile(r"^--initial-peers (?P<maddrs>/\S+(?: /\S+)*)$")
T = TypeVar("T")


def parse_python(source: str, filename: str = "<source>") -> ast.Module:
    """``ast.parse(source)``, tried again on CPython 3.11's spurious "AST constructor recursion depth mismatch"
    SystemError: the AST converter's depth counter is per interpreter, so a parse on another thread at the same
    moment (torch.jit.script compiling a model on a trainer's thread left by an earlier test) can trip it
    (python/cpython#106905). Any other error, and that one a third time, is raised."""
    for attempt in range(3):
        try:
            return ast.parse(source, filename)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


_PORTS = random.SystemRandom()  # not the `random` module's state, which a test may seed


def _ephemeral_low(default: int = 32768) -> int:
    """The lowest port of the kernel's ephemeral range (the ports it hands to every ``/tcp/0`` bind)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, drawn at random from below the kernel's ephemeral
    range. A port the OS picked for a ``/tcp/0`` bind is in that range, so the next daemon that starts with
    ``/tcp/0`` (a p2pd of this test or of the other worker's) may be given it before the test's own server
    binds it: that happened in a clean-clone `make test`, where a metrics scrape reached a p2pd
    ("BadStatusLine: /multistream/1.0.0"). Below the range only another `free_port` can pick it."""
    low = _ephemeral_low()
    if low > 4096:
        for _ in range(200):
            port = _PORTS.randrange(max(1024, low - 12_000), low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:  # taken: draw again
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # an odd range: what the OS gives
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    *,
    interval_s: float = 0.05,
    message: str | Callable[[], str] = "condition",
) -> T:
    """Poll `predicate` until it returns a truthy value and return that value.

    Raises `TimeoutError` naming `message` (a string, or a callable for a late-computed one)
    if it stays falsy for `timeout_s` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise TimeoutError(f"{text} not reached within {timeout_s:.1f} s")
        time.sleep(interval_s)


@dataclass
class Child:
    """A spawned process plus everything it has printed so far (lines without trailing newline)."""

    popen: subprocess.Popen
    cmd: Sequence[str]
    stdout_lines: list[str] = field(default_factory=list)
    stderr_lines: list[str] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _threads: list[threading.Thread] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def stdout(self) -> str:
        with self._cond:
            return "\n".join(self.stdout_lines)

    def stderr(self) -> str:
        with self._cond:
            return "\n".join(self.stderr_lines)

    def join_output(self, timeout_s: float = 5.0) -> None:
        """Wait until both output streams are closed (the process and its heirs closed them)."""
        for thread in self._threads:
            thread.join(timeout_s)

    def describe(self) -> str:
        """Command, exit code and the tail of the output, for assertion messages."""
        if self.popen.poll() is not None:
            self.join_output(timeout_s=2.0)  # an exited process's last lines (a traceback) may still be in the pipe
        return (
            f"cmd={' '.join(self.cmd)}\nreturncode={self.returncode}\n"
            f"--- stdout ---\n{self.stdout()[-3000:]}\n--- stderr ---\n{self.stderr()[-3000:]}"
        )


def _drain(stream: IO[str], lines: list[str], cond: threading.Condition) -> None:
    for line in stream:
        with cond:
            lines.append(line.rstrip("\n"))
            cond.notify_all()
    stream.close()
    with cond:
        cond.notify_all()


def spawn(
    cmd: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    start_new_session: bool = False,
) -> Child:
    """Start `cmd` (stdin from /dev/null, text output captured line by line) and return a `Child`.

    The environment is `os.environ` plus `env` (so the session's leak marker is inherited), with
    `PYTHONUNBUFFERED=1`; `cwd` defaults to the repository root. With `start_new_session` the child
    leads its own process group, so `os.killpg(child.pid, SIGINT)` imitates Ctrl+C in a terminal.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    popen = subprocess.Popen(
        list(cmd),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        env=full_env,
        cwd=cwd or REPO_ROOT,
        start_new_session=start_new_session,
    )
    child = Child(popen=popen, cmd=list(cmd))
    for stream, lines in ((popen.stdout, child.stdout_lines), (popen.stderr, child.stderr_lines)):
        thread = threading.Thread(target=_drain, args=(stream, lines, child._cond), daemon=True)
        thread.start()
        child._threads.append(thread)
    return child


def read_line_matching(
    child: Child, pattern: str | re.Pattern[str], timeout_s: float, *, stream: str = "stdout"
) -> re.Match[str]:
    """Wait for the first line of `stream` ("stdout"/"stderr") that `pattern` matches (re.search).

    Raises `AssertionError` with the child's output if the process exits first, `TimeoutError`
    if nothing matches within `timeout_s`.
    """
    regex = re.compile(pattern)
    lines = child.stdout_lines if stream == "stdout" else child.stderr_lines
    deadline = time.monotonic() + timeout_s
    seen = 0
    with child._cond:
        while True:
            for line in lines[seen:]:
                if match := regex.search(line):
                    return match
            seen = len(lines)
            if child.popen.poll() is not None and not any(t.is_alive() for t in child._threads):
                raise AssertionError(f"process exited before printing {regex.pattern!r}\n{child.describe()}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no line matching {regex.pattern!r} within {timeout_s:.1f} s\n{child.describe()}")
            child._cond.wait(min(remaining, 0.1))


def terminate(child: Child | subprocess.Popen, timeout_s: float = 10.0, *, sig: int | None = signal.SIGTERM) -> int:
    """Send `sig` (unless already exited; None sends nothing), wait up to `timeout_s`, return the exit code.

    If the process is still running after `timeout_s`, it is SIGKILLed and `AssertionError` is
    raised: a process that ignores SIGTERM is a bug the test should report.
    """
    popen = child.popen if isinstance(child, Child) else child
    if sig is not None and popen.poll() is None:
        popen.send_signal(sig)
    try:
        return popen.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait(timeout=10)
        raise AssertionError(f"pid {popen.pid} did not exit within {timeout_s:.1f} s of signal {sig}") from None


def terminate_all(children: Sequence[Child | subprocess.Popen], timeout_s: float = 10.0) -> list[int]:
    """`terminate` for several processes: SIGTERM to all at once (peers leave together, as a cluster's
    shutdown does), then wait for each within one shared `timeout_s`; returns their exit codes.

    Every process is waited for (stragglers SIGKILLed) before `AssertionError` names those that ignored it.
    """
    popens = [c.popen if isinstance(c, Child) else c for c in children]
    for popen in popens:
        if popen.poll() is None:
            popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    stuck, stacks = [], []
    for child, popen in zip(children, popens):
        try:
            popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            popen.send_signal(signal.SIGABRT)  # spawn's PYTHONFAULTHANDLER: every thread's stack on stderr
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=5)
            popen.kill()
            popen.wait(timeout=10)
            stuck.append(popen.pid)
            if isinstance(child, Child):
                stacks.append(child.describe())
    if stuck:
        shown = "\n".join(stacks)
        raise AssertionError(f"pids {stuck} did not exit within {timeout_s:.1f} s of SIGTERM\n{shown}")
    return [popen.returncode for popen in popens]


def expect_success(children: Sequence[Child], timeout_s: float) -> None:
    """Wait for each child to exit by itself within ``timeout_s`` and assert it exited 0 (its output in the
    message); whatever happens, every child is then stopped (`terminate_all`)."""
    try:
        for child in children:
            wait_until(lambda c=child: c.returncode is not None, timeout_s=timeout_s, message=child.describe)
            assert child.returncode == 0, child.describe()
    finally:
        terminate_all(children, timeout_s=15)


def descendants(pid: int) -> list[psutil.Process]:
    """Live descendants of `pid` (empty if it is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def p2pd_pids(pid: int) -> list[int]:
    """Pids of the `p2pd` daemons below `pid`."""
    found = []
    for proc in descendants(pid):
        try:
            if proc.name() == "p2pd":
                found.append(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def is_alive(proc: psutil.Process) -> bool:
    """True while `proc` runs (zombies and recycled pids count as gone)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def alive(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """The subset of `procs` that is still running."""
    return [proc for proc in procs if is_alive(proc)]


def python_cmd(*args: str) -> list[str]:
    """`[sys.executable, *args]`: run with the interpreter of the test session."""
    return [sys.executable, *args]


def bootstrap_cmd(*, port: int, identity: str | os.PathLike[str], extra: Sequence[str] = ()) -> list[str]:
    """Command line of a loopback-only bootstrap node on `port` with identity file `identity`."""
    return python_cmd(
        "-m", "bootstrap", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--identity", str(identity), *extra
    )


@dataclass
class BootstrapNode:
    """A running `python -m bootstrap` subprocess and the addresses it printed."""

    child: Child
    maddrs: list[str]

    @property
    def peer_id(self) -> str:
        return self.maddrs[0].rsplit("/p2p/", 1)[1]


def start_bootstrap(
    identity: str | os.PathLike[str], *, port: int | None = None, extra: Sequence[str] = (), timeout_s: float = 30.0
) -> BootstrapNode:
    """Spawn a bootstrap node and wait (up to `timeout_s`) for its `--initial-peers` line.

    The caller owns the node: stop it with `terminate(node.child)`. On timeout the node is killed.
    """
    child = spawn(bootstrap_cmd(port=port or free_port(), identity=identity, extra=extra))
    try:
        match = read_line_matching(child, INITIAL_PEERS_RE, timeout_s)
    except BaseException:
        if child.popen.poll() is None:
            child.popen.kill()
            child.popen.wait(timeout=10)
        raise
    return BootstrapNode(child=child, maddrs=match["maddrs"].split())
