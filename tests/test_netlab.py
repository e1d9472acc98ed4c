"""benchmarks/netlab.py: shaped links shape (and unshaped ones do not), byte counters count, a cut link
cuts, and every way a lab ends (close, SIGTERM to its owner, cleanup after a SIGKILLed owner) leaves no
namespace, link or process behind. The netns tests need root and skip with the reason otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers import read_line_matching, spawn, terminate, wait_until

from benchmarks import netlab
from benchmarks.netlab import LabUnavailable, loopback_lab, measure_tcp, netns_lab

PAYLOAD_BYTES = 12_000_000


@pytest.fixture(scope="module")
def netns_ok() -> None:
    if os.geteuid() != 0:
        pytest.skip(f"netns labs need root (euid {os.geteuid()})")
    try:
        netns_lab(1, rate_mbit=None).close()
    except LabUnavailable as err:
        pytest.skip(f"cannot build a netns lab here: {err}")


def _names_with(prefix: str) -> list[str]:
    """Namespaces and root-namespace links whose name starts with `prefix`, read straight from `ip`."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=True)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10, check=True)
    names = [line.split()[0] for line in netns.stdout.splitlines() if line.strip()]
    names += [line.split(":")[1].strip().split("@")[0] for line in links.stdout.splitlines() if ":" in line]
    return [name for name in names if name.startswith(prefix)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _connects(lab: netlab.Lab, src: int, dst: int, port: int) -> bool:
    """One TCP connect from host `src` to host `dst`:`port` with a 1 s timeout."""
    code = f"import socket; socket.create_connection(({lab.hosts[dst].ip!r}, {port}), timeout=1.0).close()"
    done = subprocess.run(lab.hosts[src].wrap([sys.executable, "-c", code]), capture_output=True, timeout=10)
    return done.returncode == 0


def test_shaping_fires_and_unshaped_is_much_faster(netns_ok: None) -> None:
    with netns_lab(2, rate_mbit=100) as lab:
        shaped = measure_tcp(lab, num_bytes=PAYLOAD_BYTES)
        for host in range(2):
            lab.set_rate(host, None)
        unshaped = measure_tcp(lab, num_bytes=PAYLOAD_BYTES)
    report = f"shaped {shaped}, unshaped {unshaped}"
    assert 70 <= shaped["mbit_s"] <= 110, report
    assert unshaped["mbit_s"] > 300, report


def test_counters_count_the_bytes_sent(netns_ok: None) -> None:
    with netns_lab(2, rate_mbit=None) as lab:
        before = [host.counters() for host in lab.hosts]
        measure_tcp(lab, num_bytes=PAYLOAD_BYTES, num_pings=0)
        after = [host.counters() for host in lab.hosts]
    sent = after[0]["tx_bytes"] - before[0]["tx_bytes"]
    received = after[1]["rx_bytes"] - before[1]["rx_bytes"]
    # headers add a few percent; much more would mean the counters read something else
    for value in (sent, received):
        assert PAYLOAD_BYTES <= value <= 1.1 * PAYLOAD_BYTES, (sent, received)


def test_set_link_cuts_and_heals(netns_ok: None) -> None:
    port = 5301
    with netns_lab(2, rate_mbit=None) as lab:
        lab.spawn(1, [sys.executable, netlab.__file__, "_sink", "--port", str(port)])
        wait_until(lambda: _connects(lab, 0, 1, port), 10, message="sink on host 1 reachable")
        lab.set_link(1, False)
        operstate = subprocess.run(
            lab.hosts[1].wrap(["cat", "/sys/class/net/eth0/operstate"]), capture_output=True, text=True, timeout=10
        ).stdout.strip()
        assert operstate == "down"
        started = time.monotonic()
        assert not _connects(lab, 0, 1, port)
        assert time.monotonic() - started < 5
        lab.set_link(1, True)
        wait_until(lambda: _connects(lab, 0, 1, port), 10, message="host 1 reachable after healing")


def test_close_removes_names_and_kills_process_groups(netns_ok: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netlab, "_GRACE_S", 0.5)  # one child ignores SIGTERM: SIGKILL follows the grace
    lab = netns_lab(2, rate_mbit=50)
    prefix = lab.prefix
    assert len(_names_with(prefix)) == 3  # hub + 2 hosts: the check below can see what it checks
    polite = lab.spawn(0, ["sh", "-c", "sleep 1000 & sleep 1000 & wait"])
    stubborn = lab.spawn(1, ["sh", "-c", "trap '' TERM; sleep 1000 & sleep 1000 & wait"])
    stray = subprocess.Popen(lab.hosts[1].wrap(["sleep", "1000"]))  # not spawned by the lab, but inside it
    tree = wait_until(
        lambda: (
            [psutil.Process(p.pid) for p in (polite, stubborn)]
            + [c for p in (polite, stubborn) for c in psutil.Process(p.pid).children()]
            if all(len(psutil.Process(p.pid).children()) == 2 for p in (polite, stubborn))
            else None
        ),
        10,
        message="both shells started their sleeps",
    )
    lab.close()
    lab.close()  # idempotent
    assert stray.wait(timeout=5) is not None
    assert [proc.pid for proc in tree if _alive(proc.pid)] == []
    assert _names_with(prefix) == []
    with pytest.raises(RuntimeError, match="closed"):
        lab.spawn(0, ["true"])


_OWNER = """
import signal, sys, time
from benchmarks.netlab import netns_lab
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whatever pytest inherited
lab = netns_lab(2, rate_mbit=None)
proc = lab.spawn(0, ["sleep", "1000"])
print("ready", lab.prefix, proc.pid, flush=True)
if sys.argv[1] == "exit":
    sys.exit(3)  # without closing the lab: atexit must
time.sleep(60)
"""


@pytest.mark.parametrize("ending", ["SIGTERM", "SIGINT", "exit"])
def test_an_owner_ending_removes_everything(netns_ok: None, ending: str) -> None:
    owner = spawn([sys.executable, "-c", _OWNER, ending])
    match = read_line_matching(owner, r"^ready (\S+) (\d+)$", 20)
    prefix, sleeper = match[1], int(match[2])
    if ending == "exit":
        assert terminate(owner, 15, sig=None) == 3
    else:
        assert len(_names_with(prefix)) == 3 and _alive(sleeper)
        sig = getattr(signal, ending)
        # the handler cleaned up, then the signal took its usual course (KeyboardInterrupt for SIGINT)
        assert terminate(owner, 15, sig=sig) == -sig, owner.describe()
    wait_until(
        lambda: not _names_with(prefix) and not _alive(sleeper),
        10,
        message=lambda: f"{_names_with(prefix)} removed and sleep {sleeper} gone",
    )


def test_cleanup_stale_removes_a_killed_owners_lab(netns_ok: None) -> None:
    owner = spawn([sys.executable, "-c", _OWNER])
    match = read_line_matching(owner, r"^ready (\S+) (\d+)$", 20)
    prefix, sleeper = match[1], int(match[2])
    assert terminate(owner, 10, sig=signal.SIGKILL) == -signal.SIGKILL
    left = _names_with(prefix)
    assert len(left) == 3 and _alive(sleeper)  # SIGKILL leaves the lab behind: something to clean
    removed = netlab.cleanup_stale()
    assert set(left) <= set(removed)
    assert _names_with(prefix) == []
    wait_until(lambda: not _alive(sleeper), 10, message=f"orphaned sleep {sleeper} killed")


def test_loopback_lab() -> None:
    handlers = [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)]
    with loopback_lab(2) as lab:
        host = lab.hosts[1]
        assert (lab.kind, lab.rate_mbit, host.index, host.name, host.ip, host.iface) == (
            "loopback",
            None,
            1,
            "",
            "127.0.0.1",
            None,
        )
        argv = ["echo", "hi"]
        assert host.wrap(argv) == argv and host.env() == {}
        assert host.maddr(1234) == "/ip4/127.0.0.1/tcp/1234"
        with pytest.raises(LabUnavailable):
            host.counters()
        with pytest.raises(LabUnavailable):
            lab.set_link(0, False)
        with pytest.raises(LabUnavailable):
            lab.set_rate(0, 100)
        lab.set_rate(0, None)  # nothing to remove
        assert measure_tcp(lab, num_bytes=1_000_000)["mbit_s"] > 0
        sleeper = lab.spawn(0, ["sleep", "1000"])
        assert signal.getsignal(signal.SIGTERM) is netlab._on_signal
    assert sleeper.poll() == -signal.SIGTERM
    assert [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)] == handlers


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="num_hosts"):
        netns_lab(0, rate_mbit=None)
    with pytest.raises(ValueError, match="rate_mbit"):
        netns_lab(2, rate_mbit=-1)
    with pytest.raises(ValueError, match="num_hosts"):
        loopback_lab(0)
