"""A verifier's replays in a process of their own: for tasks whose training draws random numbers, and for
provers that trained with another number of torch threads or at another CPU kernel level.

torch has one CPU random generator per process. A replay reseeds it and draws from it (dropout), and so
does this peer's own training, on another thread: in one process each would take numbers from the
other's stream, so a replay would not match an honest prover, and this peer's own committed phase would
not replay either. torch's thread count and CPU kernel level (AVX512, AVX2, DEFAULT, ...) are per process
too, and a replay must use the prover's: CPU reductions split their sums by thread, and kernels of another
level round differently (``tests/test_work.py``: all three, with negative controls).

`Replayer.replay` has the signature of `swarm.verify.replay` and runs it in a child process
(``python -m swarm.replayer``), started by `Replayer.start` (`swarm.work` does when its checks begin) or at the first
replay, and kept: a JSON header and the replay inputs' safetensors bytes go to its stdin, the replayed
boundary's safetensors bytes come back on its stdout, each message in the frame layout of `bootstrap.framing`
(a length, a JSON header, the payload it announces in ``"bytes"``); no pickle. The child rebuilds the task by
the name it was built from (`WorkSpec.task_name`: a built-in name, an installed entry point or
``package.module:factory``, importable in the child as in its parent: the child gets the parent's
``sys.path``) and its config (the registry's convention: a factory that takes the config's fields as
keywords), refuses a task whose description differs from the parent's, runs at the niceness it is given,
replays with the prover's number of threads and at its kernel level (the commitment names both; the level
through ``ATEN_CPU_CAPABILITY``, one process per level: a level this CPU lacks raises `CannotReplayHere`), and
exits when its stdin closes (the peer stopped, or died). `swarm.work` uses it for a task whose
``random_in_training`` is true or unknown (a task from another package that does not say), and for a
prover whose thread count or level is not this process's.

Every wait is bounded: a reply that does not come within ``timeout_s`` (or a child that died) raises
`ReplayerError` and the child is killed; the next replay starts a new one. That error is this peer's
failure, never the prover's: `swarm.work` records no verdict for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO

import torch

from bootstrap.envelope import from_dict
from bootstrap.framing import LENGTH
from swarm.verify import (
    MAX_BOUNDARIES,
    MAX_INPUT_BYTES,
    Boundary,
    Commitment,
    ReplayInputs,
    WorkRejected,
    cpu_capability,
    replay,
)

logger = logging.getLogger(__name__)

_MAX_HEADER = 1 << 20
_ID_CHARS = 128


class ReplayerError(RuntimeError):
    """The replay process failed (did not start, died, timed out, answered nonsense): this peer's fault."""


class CannotReplayHere(ReplayerError):
    """This machine cannot replay at the prover's CPU kernel level (it lacks it, or torch knows no such level)."""


def random_in_training(task: Any) -> bool:
    """Whether ``task``'s training step may draw random numbers: its own ``random_in_training`` when it says
    (the built-in tasks do: charlm with dropout), else True (replayed apart, to be safe)."""
    value = getattr(task, "random_in_training", True)
    return value if isinstance(value, bool) else True


class Replayer:
    """`swarm.verify.replay` in a child process (see the module docstring). One caller at a time (a lock)."""

    def __init__(
        self, *, nice: int = 0, cpu: str | None = None, task_name: str | None = None, timeout_s: float = 600.0
    ) -> None:
        self.nice, self.cpu, self.task_name, self.timeout_s = nice, cpu, task_name, timeout_s
        """``cpu``: the CPU kernel level the child runs torch at (``ATEN_CPU_CAPABILITY``); None: this machine's.
        ``task_name``: the name the child rebuilds the task by (`swarm.tasks.get_task`: a built-in name, an
        installed entry point or ``package.module:factory``); None: the task's own ``name``."""
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.started = 0
        """Child processes started (one, unless one failed)."""

    def replay(
        self, task: Any, commitment: Commitment, segment: int, start: Boundary, *, streams: Any = None
    ) -> Boundary:
        """As `swarm.verify.replay` (``streams`` is unused: the child keeps its own positioned streams).
        WorkRejected where that raises it; ReplayerError when the child fails."""
        header = {
            "task": self.task_name or task.name,
            "config": task.config_dict(),
            "overrides": _overrides(task),
            "commitment": commitment.to_dict(),
            "segment": segment,
        }
        data = ReplayInputs(start, torch.empty(0)).to_bytes()
        with self._lock:
            deadline = time.monotonic() + self.timeout_s
            proc = self._running()
            try:  # a `close` meanwhile closes these pipes: OSError or ValueError here
                _write_all(proc.stdin.fileno(), _frame(header, data), deadline)
                answer, body = _read_message(proc.stdout.fileno(), deadline)
            except (OSError, EOFError, ValueError, TimeoutError) as e:
                _end(proc, gently=False)
                self._proc = None
                raise ReplayerError(f"the replay process failed: {e!r}"[:300]) from None
        if "rejected" in answer:
            raise WorkRejected(str(answer["rejected"])[:50], str(answer.get("detail", ""))[:200])
        if "unavailable" in answer:
            raise CannotReplayHere(str(answer["unavailable"])[:200])
        if not answer.get("ok"):
            raise ReplayerError(f"the replay process could not replay: {str(answer.get('error'))[:200]}")
        try:
            return ReplayInputs.from_bytes(body).start
        except WorkRejected as e:
            raise ReplayerError(f"the replay process sent malformed state: {e}") from None

    def start(self) -> None:
        """Start the child now (it imports torch and builds the task while this peer trains), not at the first
        replay, which would then wait for that inside the round's check backpressure."""
        with self._lock:
            self._running()

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the child's stdin (it exits), and kill it if it has not within ``timeout_s``; no replay starts
        one after this. Not under the lock: a replay in progress on another thread (a shutdown whose worker
        did not stop in time) then fails on the closed pipes instead of holding the shutdown."""
        self._closed = True
        proc, self._proc = self._proc, None
        _end(proc, gently=True, timeout_s=timeout_s)

    def _running(self) -> subprocess.Popen:
        if self._closed:
            raise ReplayerError("the replayer is closed")
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        _end(self._proc, gently=False)
        self._proc = None
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        if self.cpu is not None:
            env["ATEN_CPU_CAPABILITY"] = self.cpu.lower()
        # the niceness it is to have, from the process's (this thread's may be raised already: the worker's)
        target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + max(0, self.nice))
        proc = subprocess.Popen(
            [sys.executable, "-m", "swarm.replayer", str(target)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # its warnings go where this peer's go
            env=env,
            start_new_session=True,  # Ctrl+C reaches the peer, which closes the child's stdin
        )
        for stream in (proc.stdin, proc.stdout):
            flags = fcntl.fcntl(stream.fileno(), fcntl.F_GETFL)
            fcntl.fcntl(stream.fileno(), fcntl.F_SETFL, flags | os.O_NONBLOCK)
        self._proc, self.started = proc, self.started + 1
        return proc


def _end(proc: subprocess.Popen | None, *, gently: bool, timeout_s: float = 5.0) -> None:
    """End a child: ``gently``, close its stdin (it exits after the job in hand) and kill it only if it has not
    within ``timeout_s``; otherwise kill it at once (it failed). Then close its pipes."""
    if proc is None:
        return
    with contextlib.suppress(OSError):
        if gently:
            proc.stdin.close()
        else:
            proc.kill()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout_s)
    for stream in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError):
            stream.close()


def _overrides(task: Any) -> dict[str, Any]:
    """The task's config as keyword overrides of its factory (a dataclass config: its fields)."""
    config = getattr(task, "config", None)
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else {}


def _frame(header: dict, payload: bytes) -> bytes:
    """One message in `bootstrap.framing`'s layout: the header announces its payload's size."""
    data = json.dumps({**header, "bytes": len(payload)}).encode()
    return LENGTH.pack(len(data)) + data + payload


def _write_all(fd: int, data: bytes, deadline: float) -> None:
    view = memoryview(data)
    while view:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the replay process does not read")
        _, writable, _ = select.select([], [fd], [], remaining)
        if writable:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                continue


def _read_exactly(fd: int, size: int, deadline: float) -> bytes:
    parts, got = [], 0
    while got < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("no answer from the replay process in time")
        readable, _, _ = select.select([fd], [], [], remaining)
        if not readable:
            continue
        try:
            chunk = os.read(fd, min(size - got, 1 << 20))
        except BlockingIOError:
            continue
        if not chunk:
            raise EOFError("the replay process ended")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _read_message(fd: int, deadline: float) -> tuple[dict, bytes]:
    """The child's answer: its header and the payload the header announces (ValueError if malformed)."""
    (size,) = LENGTH.unpack(_read_exactly(fd, LENGTH.size, deadline))
    if size > _MAX_HEADER:
        raise ValueError(f"a header of {size} bytes (at most {_MAX_HEADER})")
    header = json.loads(_read_exactly(fd, size, deadline))
    payload_bytes = header.get("bytes") if isinstance(header, dict) else None
    if type(payload_bytes) is not int or not 0 <= payload_bytes <= MAX_INPUT_BYTES:
        raise ValueError("the replay process answered nonsense")
    return header, _read_exactly(fd, payload_bytes, deadline)


# ------------------------------------------------------------------------------------ the child
class _Unavailable(Exception):
    pass


def _read_blocking(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if data is None or len(data) < size:
        raise EOFError
    return data


def _serve(nice: int) -> None:
    """The child, at niceness ``nice``: replay jobs from stdin until it closes (its parent's, never the network's)."""
    from swarm.tasks import get_task
    from swarm.verify import Streams

    with contextlib.suppress(OSError):
        if nice > os.getpriority(os.PRIO_PROCESS, 0):
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    stdin = sys.stdin.buffer
    stdout = os.fdopen(os.dup(1), "wb")  # the answers; anything the task prints goes to stderr instead
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    tasks: dict[str, tuple[Any, Streams]] = {}
    while True:
        try:
            (size,) = LENGTH.unpack(_read_blocking(stdin, LENGTH.size))
            header = json.loads(_read_blocking(stdin, size)) if size <= _MAX_HEADER else {}
            size = header.get("bytes", -1)
            data = _read_blocking(stdin, size) if 0 <= size <= MAX_INPUT_BYTES else None
        except EOFError:
            return
        if data is None:
            return  # not its parent's framing: nothing more can be read in step
        answer: dict[str, Any] = {"ok": True}
        body = b""
        try:
            described = json.dumps(header["config"], sort_keys=True)
            if described not in tasks:
                task = get_task(header["task"], **header["overrides"])
                if json.dumps(task.config_dict(), sort_keys=True) != described:
                    raise ValueError("the task built here differs from the peer's")
                tasks[described] = (task, Streams(task))
            task, streams = tasks[described]
            commitment = from_dict(
                Commitment, header["commitment"], "commitment", max_str=_ID_CHARS, max_items=MAX_BOUNDARIES
            )
            start = ReplayInputs.from_bytes(data).start
            if cpu_capability() != commitment.cpu:
                raise _Unavailable(f"the prover's CPU kernel level {commitment.cpu!r:.40}, here {cpu_capability()}")
            torch.set_num_threads(commitment.threads)  # the prover's: reductions split their sums by thread
            replayed = replay(task, commitment, int(header["segment"]), start, streams=streams)
            body = ReplayInputs(replayed, torch.empty(0)).to_bytes()
        except _Unavailable as e:
            answer = {"unavailable": str(e)}
        except WorkRejected as e:
            answer = {"rejected": e.reason, "detail": str(e)}
        except Exception as e:  # reported to the parent, which records no verdict
            answer = {"error": repr(e)[:300]}
        stdout.write(_frame(answer, body))
        stdout.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
