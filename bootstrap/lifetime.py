"""Children die with their parent: a small watchdog process that reaps a dead parent's process tree.

hivemind runs its DHT and averager as forked children and the DHT child runs the go daemon `p2pd`.
If our process is SIGKILLed they are orphaned and keep answering in the DHT as if we were alive.
`start_reaper()` spawns `python -m bootstrap.lifetime --parent PID`, which

* polls the parent (4 Hz by default) and keeps a snapshot of its descendants (psutil `Process`
  objects, whose create time guards against pid reuse), adding new children as they appear;
* once the parent is gone (or a zombie), also collects the descendants of the snapshotted processes
  and every process that inherited the parent's lifetime token (see `LIFETIME_TOKENS_ENV`), so a
  `p2pd` spawned after the last snapshot is not missed;
* sends SIGTERM to all of them, waits up to `grace_s`, SIGKILLs the rest and exits.

The watchdog runs in its own session, so a Ctrl+C sent to the terminal's process group does not kill
it before it has done its job, and imports nothing but psutil (`bootstrap/__init__` is lazy).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import gc
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

from bootstrap._private import procs

__all__ = [
    "LIFETIME_TOKENS_ENV",
    "StopSignal",
    "Stopped",
    "freeze_heap_at_exit",
    "set_parent_death_signal",
    "start_reaper",
]

LIFETIME_TOKENS_ENV = "SWARM_LIFETIME_TOKENS"
"""Environment variable holding a `:`-separated list of tokens, one per reaped ancestor.

`start_reaper()` appends its own token to `os.environ`, so every process exec'd afterwards by this
process or its descendants inherits it, even one that was never in a snapshot.
"""

_READY_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1

_lock = threading.Lock()
_reaper: tuple[int, subprocess.Popen] | None = None  # (pid of the process that started it, reaper)


_freeze_registered = False


def freeze_heap_at_exit() -> None:
    """At interpreter exit, move every live object out of the garbage collector's reach (`gc.freeze`); once a
    process.

    A process with torch and hivemind loaded holds about a million objects, and CPython's last collections over
    them (in ``finalize_modules``, after every ``atexit`` handler) took 1.5-2 s of each peer's exit on this
    machine, and over 5 s under load: a user's script Ctrl+C'd on ``swarm.Trainer`` left the run in 0.2 s,
    then took 1.8 s more to exit (0.4 s in all with this). Objects are still freed when their last reference
    goes; what is skipped is collecting cycles at exit, whose ``__del__`` Python does not promise to run then.
    Registered when a DHT starts, so the handler runs after the ones registered later (they run first).
    """
    global _freeze_registered
    with _lock:
        if not _freeze_registered:
            atexit.register(gc.freeze)
            _freeze_registered = True


def start_reaper(*, poll_interval_s: float = 0.25, grace_s: float = 2.0) -> subprocess.Popen:
    """Start the watchdog that kills this process's descendants once this process dies.

    Idempotent per process: a second call returns the same `Popen` while that watchdog runs (its
    arguments are then ignored). Returns only after the watchdog has taken its first snapshot.
    Children spawned less than `poll_interval_s` before a SIGKILL are still found if they were
    exec'd (they carry the lifetime token) or are descendants of an already-known process.
    Raises `ValueError` for non-positive intervals and `RuntimeError` if the watchdog does not
    come up within 30 s.
    """
    global _reaper
    if not poll_interval_s > 0:
        raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s!r}")
    if not grace_s >= 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s!r}")
    with _lock:
        if _reaper is not None and _reaper[0] == os.getpid() and _reaper[1].poll() is None:
            return _reaper[1]
        _install_fork_hook()
        token = uuid.uuid4().hex
        tokens = [t for t in os.environ.get(LIFETIME_TOKENS_ENV, "").split(":") if t]
        os.environ[LIFETIME_TOKENS_ENV] = ":".join([*tokens, token])
        reaper = _spawn_watchdog(token, poll_interval_s=poll_interval_s, grace_s=grace_s)
        _reaper = (os.getpid(), reaper)
        return reaper


_fork_hook_installed = False


def _install_fork_hook() -> None:
    """Make every child this process forks (without exec: hivemind's DHT and averager) die with it.

    The watchdog finds exec'd children by their token and others by its snapshots, but a child
    forked less than one poll interval before a SIGKILL is in no snapshot yet; the kernel's parent
    death signal closes that gap.
    """
    global _fork_hook_installed
    if not _fork_hook_installed:
        os.register_at_fork(before=_note_forking_thread, after_in_child=_die_with_parent)
        _fork_hook_installed = True


_forked_from_main_thread = False


def _note_forking_thread() -> None:
    global _forked_from_main_thread
    _forked_from_main_thread = threading.current_thread() is threading.main_thread()


def _die_with_parent() -> None:
    # Linux sends the signal when the forking *thread* exits: only safe for forks from the main thread
    if not _forked_from_main_thread:
        return
    parent = os.getppid()
    if set_parent_death_signal(signal.SIGKILL) and os.getppid() != parent:
        os._exit(1)  # the parent died between our fork and the prctl call


def _spawn_watchdog(token: str, *, poll_interval_s: float, grace_s: float) -> subprocess.Popen:
    me = psutil.Process()
    read_fd, write_fd = os.pipe()
    env = dict(os.environ)
    # make `-m bootstrap.lifetime` importable even when the package is not installed
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable,
        "-m",
        "bootstrap.lifetime",
        "--parent",
        str(me.pid),
        "--parent-create-time",
        repr(me.create_time()),
        "--token",
        token,
        "--poll-interval-s",
        repr(poll_interval_s),
        "--grace-s",
        repr(grace_s),
        "--ready-fd",
        str(write_fd),
    ]
    try:
        reaper = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=env,
            pass_fds=(write_fd,),
            start_new_session=True,
        )
    finally:
        os.close(write_fd)
    try:
        _await_ready(read_fd, reaper)
    finally:
        os.close(read_fd)
    return reaper


def _await_ready(read_fd: int, reaper: subprocess.Popen) -> None:
    readable, _, _ = select.select([read_fd], [], [], _READY_TIMEOUT_S)
    if readable and os.read(read_fd, 1) == b"1":
        return
    reaper.kill()
    reaper.wait(timeout=5)
    raise RuntimeError(
        f"lifetime reaper (pid {reaper.pid}) did not start within {_READY_TIMEOUT_S:.0f} s "
        f"(exit code {reaper.returncode}); children of this process would outlive it"
    )


class Stopped(KeyboardInterrupt):
    """Raised at a well-defined point (e.g. `swarm.Trainer.step`) once a `StopSignal` has fired; the
    argument is the signal's name. A KeyboardInterrupt, so ``except Exception`` does not swallow it."""


class StopSignal:
    """SIGINT and SIGTERM as a request to stop: the first sets `event`; nothing is raised where it lands.

    A handler that raises KeyboardInterrupt can land anywhere, and one that lands inside a string
    `eval`/`exec` (a namedtuple or dataclass being built by a lazy import) makes CPython 3.11 exit by
    SIGINT (code -2) at the very end, even after the exception was caught and handled. So the first
    signal only sets `event`, records `signal_name` and runs the `on_stop` callbacks (in the handler:
    keep them short and non-blocking, e.g. `loop.call_soon_threadsafe`); the owner polls or waits on
    `event`. A second signal while stopping raises KeyboardInterrupt if `second_interrupts` (the user
    insists) and is ignored otherwise; one within `SAME_REQUEST_S` of the first is the same request
    delivered twice and is ignored (``timeout`` signals its child and then the child's process group,
    which holds the child too). A forked child (the DHT, an averager) that inherited the handler dies by
    the signal, as if it had never been set.

    A signal can land while the handler itself runs (Python runs handlers between bytecodes of the main
    thread, a handler's included): `_fired` is set first, before `event.set()` takes the event's lock, so
    a nested call never waits on that lock, which the call it interrupted holds (a deadlock before).

    Use as a context manager: it installs the handlers on entry and restores the previous ones on exit.
    """

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)
    SAME_REQUEST_S = 1.0
    """A second signal this soon after the first is the first delivered again, not the user insisting."""

    def __init__(self, *, second_interrupts: bool = True) -> None:
        self.event = threading.Event()
        self._fired: float | None = None
        """When the first signal came (monotonic), set before anything that takes a lock."""
        self.signal_name: str | None = None
        self.on_stop: list[Callable[[], object]] = []
        self.second_interrupts = second_interrupts
        self._pid = os.getpid()
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignal:
        self._pid = os.getpid()
        for sig in self._SIGNALS:
            self._previous.setdefault(sig, signal.signal(sig, self._handle))
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before `install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def ignore(self) -> None:
        """Ignore both signals from now on (a bounded clean-up that must not be cut short)."""
        for sig in self._SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def __enter__(self) -> StopSignal:
        return self.install()

    def __exit__(self, *exc_info: object) -> None:
        self.restore()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if os.getpid() != self._pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        now = time.monotonic()
        if self._fired is not None or self.event.is_set():
            if self.second_interrupts and (self._fired is None or now - self._fired >= self.SAME_REQUEST_S):
                raise KeyboardInterrupt  # the user insists (or set the event by other means, then signalled)
            return
        self._fired = now
        self.signal_name = signal.Signals(signum).name
        self.event.set()
        for callback in self.on_stop:
            callback()


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `sig` to the calling process when its parent dies (Linux only).

    Call it in a child right after fork. Caveat: Linux fires it when the parent *thread* that forked
    this process exits, not only the whole parent process. Returns False (and does nothing) where
    `prctl(PR_SET_PDEATHSIG)` is unavailable.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


# --- the watchdog process ---------------------------------------------------------------------


def _parent_alive(parent: psutil.Process | None) -> bool:
    return parent is not None and not procs.is_gone(parent)


def _remember(known: dict[int, psutil.Process], found: list[psutil.Process], me: int) -> None:
    for proc in found:
        old = known.get(proc.pid)
        # same pid with another create time: the old one died and the pid was reused by a new child
        if proc.pid != me and (old is None or procs.is_gone(old)):
            known[proc.pid] = proc


def _prune(known: dict[int, psutil.Process]) -> None:
    for pid in [pid for pid, proc in known.items() if procs.is_gone(proc)]:
        del known[pid]


def _carriers_of(token: str, me: int) -> list[psutil.Process]:
    """Processes whose environment carries `token`, i.e. exec'd descendants of the dead parent."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if token in proc.environ().get(LIFETIME_TOKENS_ENV, "").split(":"):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found


def _find_parent(pid: int, create_time: float) -> psutil.Process | None:
    try:
        parent = psutil.Process(pid)
        # a different create time means our parent already died and its pid was reused
        return parent if abs(parent.create_time() - create_time) < 1e-3 else None
    except psutil.NoSuchProcess:
        return None


def watch(
    parent_pid: int,
    *,
    parent_create_time: float,
    token: str,
    poll_interval_s: float,
    grace_s: float,
    ready_fd: int | None = None,
) -> int:
    """Body of the watchdog: follow the parent's tree until it dies, then reap it. Returns 0."""
    me = os.getpid()
    parent = _find_parent(parent_pid, parent_create_time)
    known: dict[int, psutil.Process] = {}
    while _parent_alive(parent):
        _remember(known, procs.descendants(parent), me)
        _prune(known)
        if ready_fd is not None:
            with contextlib.suppress(OSError):  # the parent may have stopped waiting
                os.write(ready_fd, b"1")
                os.close(ready_fd)
            ready_fd = None
        time.sleep(poll_interval_s)
    # the parent's own list of children is gone with it: look below what we knew, and for exec'd
    # latecomers that inherited the token
    for proc in list(known.values()):
        _remember(known, procs.descendants(proc), me)
    _remember(known, _carriers_of(token, me), me)
    procs.terminate_all(known.values(), grace_s)
    return 0


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bootstrap.lifetime",
        description="Watchdog: once --parent dies, terminate every descendant it had.",
    )
    parser.add_argument("--parent", dest="parent_pid", type=int, required=True, help="pid of the process to watch")
    parser.add_argument("--parent-create-time", type=float, required=True, help="its psutil create_time")
    parser.add_argument("--token", required=True, help=f"this reaper's token in ${LIFETIME_TOKENS_ENV}")
    parser.add_argument("--poll-interval-s", type=float, default=0.25, help="seconds between snapshots")
    parser.add_argument("--grace-s", type=float, default=2.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--ready-fd", type=int, default=None, help="fd to write b'1' to after the 1st snapshot")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    # our own group/session is separate, but be explicit: only the parent's death ends this process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return watch(**vars(args))


if __name__ == "__main__":
    sys.exit(main())
