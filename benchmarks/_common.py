"""What every benchmark's JSON carries about the run that produced it."""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil


def process_tree(pid: int | None) -> list[psutil.Process]:
    """``pid`` and its live descendants (its DHT child, p2pd, a watchdog); empty when it is gone or None."""
    if pid is None:
        return []
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def is_stopped(proc: psutil.Process) -> bool:
    """Whether ``proc`` is stopped (SIGSTOP); False once it is gone."""
    try:
        return proc.status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def run_metadata(name: str, argv: list[str] | None, **extra: Any) -> dict[str, Any]:
    """Benchmark name, date, machine, versions and the exact command (``python -m benchmarks.NAME ...``)."""
    import hivemind
    import torch

    return {
        "benchmark": name,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "hivemind": hivemind.__version__,
        **extra,
        "command": shlex.join([sys.executable, "-m", f"benchmarks.{name}", *(sys.argv[1:] if argv is None else argv)]),
    }


def make_lab(kind: str, *, rate_mbit: float, num_hosts: int, console: Any) -> tuple[Any, str | None]:
    """The lab to run on (kind: auto, netns or loopback), and why it is loopback when auto found no
    shaped test hosts (None otherwise). ``rate_mbit`` 0 leaves netns links unshaped."""
    from benchmarks import netlab

    if kind == "loopback":
        return netlab.loopback_lab(num_hosts), None
    try:
        return netlab.netns_lab(num_hosts, rate_mbit=rate_mbit or None), None
    except netlab.LabUnavailable as e:
        if kind == "netns":
            raise
        console.print(f"[yellow]no shaped test hosts ({e}); running on loopback[/]")
        return netlab.loopback_lab(num_hosts), str(e)


@contextmanager
def signals_unwind() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl+C, so every finally block (and the lab's close) runs."""

    def handler(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def save_result(path: str | Path, result: Any) -> Path:
    """Write a benchmark's result as indented JSON (creating the folder); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    return out


_INITIAL_PEERS = re.compile(r"--initial-peers\s+(/\S+(?:\s+/\S+)*)")


def start_bootstrap_node(
    lab: Any, host: int, *, work: Path, port: int = 0, env: dict[str, str] | None = None, timeout_s: float
) -> tuple[Any, list[str] | None]:
    """Start ``python -m bootstrap`` on lab host ``host`` (its log and identity in ``work``) and wait for the
    ``--initial-peers`` line it prints: ``(process, maddrs)``, maddrs None if it exited or printed none
    within ``timeout_s`` (the log is ``work/bootstrap.log``)."""
    log = work / "bootstrap.log"
    proc = lab.spawn(
        host,
        [
            sys.executable,
            "-m",
            "bootstrap",
            "--host-maddrs",
            lab.hosts[host].maddr(port),
            "--identity",
            str(work / "bootstrap.id"),
            "--refresh-period-s",
            "300",
        ],
        log=log,
        env=env,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = _INITIAL_PEERS.search(log.read_text(errors="replace")) if log.exists() else None
        if match:
            return proc, match.group(1).split()
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    return proc, None


def rising(curve: list[tuple[float, float]], *, tolerance: float = 0.02) -> bool:
    """A validation curve [(samples, loss), ...] rose more than ``tolerance`` above its running minimum
    somewhere in its second half (training that drifts away, not a plateau's noise)."""
    best = math.inf
    half = curve[-1][0] / 2 if curve else 0
    for seen, loss in curve:
        if seen >= half and loss > best * (1 + tolerance):
            return True
        best = min(best, loss)
    return False
