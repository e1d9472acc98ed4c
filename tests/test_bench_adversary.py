"""benchmarks/adversary.py's machinery, not its figures: the CPU split that stands for an attacker on its own
machine, and the renice that must reach across the kernel's autogroups."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from benchmarks.adversary import _CoreSplit, _renice

_SPIN = "import time\nwhile True:\n    time.sleep(0.01)\n"


def _cpu_group(pid: int) -> str:
    """The cgroup v1 ``cpu`` group of ``pid`` ("/" for the root)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    return "/"


@pytest.mark.skipif(
    not (_CoreSplit.ROOT / "tasks").exists() or _cpu_group(os.getpid()) != "/",
    reason="no cgroup v1 cpu controller here, or this process is not in its root group (the split returns tasks there)",
)
def test_the_core_split_caps_both_sides_moves_the_adversary_and_leaves_nothing_behind():
    child = subprocess.Popen([sys.executable, "-c", _SPIN])
    try:
        before = _cpu_group(os.getpid())
        with _CoreSplit(1.5, 0.5) as split:
            hosts, adversary = split.groups["hosts"], split.groups["adversary"]
            assert int((hosts / "cpu.cfs_quota_us").read_text()) == int(
                1.5 * int((hosts / "cpu.cfs_period_us").read_text())
            )
            assert int((adversary / "cpu.cfs_quota_us").read_text()) == int(
                0.5 * int((adversary / "cpu.cfs_period_us").read_text())
            )
            assert _cpu_group(os.getpid()) == f"/{hosts.name}"  # what this process spawns now inherits it
            split.adversary(pid=child.pid)
            assert _cpu_group(child.pid) == f"/{adversary.name}"
            assert _cpu_group(os.getpid()) == f"/{hosts.name}"
        assert not hosts.exists() and not adversary.exists()
        assert _cpu_group(os.getpid()) == before == "/" and _cpu_group(child.pid) == "/"
    finally:
        child.kill()
        child.wait(timeout=10)


@pytest.mark.skipif(Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() != "1", reason="no autogroups")
def test_renice_lowers_the_autogroup_of_the_adversarys_session_not_only_its_processes():
    """A nice value only orders the processes of one session under autogroups: the session's group is reniced too."""
    child = subprocess.Popen([sys.executable, "-c", _SPIN], start_new_session=True)
    try:
        _renice(child.pid, 19)
        assert psutil.Process(child.pid).nice() == 19
        assert Path(f"/proc/{child.pid}/autogroup").read_text().split()[-1] == "19"
    finally:
        child.kill()
        child.wait(timeout=10)
