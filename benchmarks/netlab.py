"""Test hosts for benchmarks and tests: N hosts on loopback, or N network namespaces joined by a
bridge, each host's link optionally shaped with `tc ... tbf` (uplink and downlink).

    python -m benchmarks.netlab selftest [--hosts 2] [--rate-mbit 100]   # build, measure, tear down
    python -m benchmarks.netlab cleanup                                  # remove labs of dead owners

Layout of a netns lab: a hub namespace `<prefix>hub` holds the bridge `br0`; host i lives in the
namespace `<prefix>h<i>` with `eth0` = 10.77.0.(10+i)/24 (by default) and `lo` up; `eth0` is one end
of a veth pair whose other end `v<i>` sits on the bridge. Shaping puts `tbf rate R burst 256kb
latency 100ms` on both ends. The prefix `swl<owner pid><letter>` keeps parallel labs apart and lets
`cleanup_stale` find the labs of dead owners. Addresses exist only inside the lab's namespaces.

A lab owns the processes it spawns and removes them, its namespaces and its links on `close()`,
when its `with` block ends, on SIGINT/SIGTERM (then the signal takes its usual course) and at exit.
Standard library only, so that this file also runs inside a namespace as its own traffic tool.
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NAME_PREFIX = "swl"
_NAME_RE = re.compile(rf"^{NAME_PREFIX}(?P<pid>\d+)(?P<seq>[a-z])")
_CMD_TIMEOUT_S = 10.0
_GRACE_S = 10.0
_KILL_WAIT_S = 5.0
_POLL_S = 0.02
_TBF = ["burst", "256kb", "latency", "100ms"]
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class LabUnavailable(RuntimeError):
    """This machine cannot build the lab asked for; the message says why (not root, no `ip`/`tc`, ...)."""


def _run(argv: list[str], *, timeout_s: float = _CMD_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command to completion; a failure or a timeout raises RuntimeError naming it and its stderr."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"`{' '.join(argv)}` did not finish within {timeout_s} s") from err
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done


@dataclass(frozen=True)
class Host:
    """One test host: a network namespace with its own `eth0`, or this machine's loopback."""

    index: int
    name: str
    """namespace name, e.g. "swl4242ah0"; "" on loopback"""
    ip: str
    """the host's address: "10.77.0.11", ...; "127.0.0.1" on loopback"""
    iface: str | None
    """the interface inside the namespace ("eth0"); None on loopback"""

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` made to run inside this host (unchanged on loopback)."""
        return ["ip", "netns", "exec", self.name, *argv] if self.name else list(argv)

    def env(self) -> dict[str, str]:
        """Environment a process on this host needs (gloo must be told its interface)."""
        return {"GLOO_SOCKET_IFNAME": self.iface} if self.iface else {}

    def maddr(self, port: int = 0) -> str:
        return f"/ip4/{self.ip}/tcp/{port}"

    def counters(self) -> dict[str, int]:
        """Bytes this host's interface sent and received so far: {"tx_bytes", "rx_bytes"}.

        Raises LabUnavailable on loopback, which has no per-host interface.
        """
        if not self.iface:
            raise LabUnavailable("byte counters need a netns lab: loopback hosts share one interface")
        stats = f"/sys/class/net/{self.iface}/statistics"
        out = _run(self.wrap(["cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"])).stdout.split()
        return {"tx_bytes": int(out[0]), "rx_bytes": int(out[1])}


# ---- processes -------------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a live process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[2])


def _pid_alive(pid: int) -> bool:
    """True if `pid` runs; a zombie is dead (nobody may reap it here: pid 1 is not always an init)."""
    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def _live_in_groups(pgids: set[int]) -> list[int]:
    """Live (non-zombie) processes whose process group is one of `pgids`."""
    if not pgids:
        return []
    live = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None and stat[0] != "Z" and stat[1] in pgids:
                live.append(int(entry))
    return live


def _signal_all(pgids: set[int], pids: set[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _stop_all(procs: list[subprocess.Popen], stray_pids: set[int], *, grace_s: float) -> None:
    """SIGTERM the process groups of `procs` and the `stray_pids`, wait up to `grace_s`, SIGKILL the rest."""
    pgids = {proc.pid for proc in procs}  # spawned with start_new_session: pgid == pid
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, _KILL_WAIT_S)):
        _signal_all(pgids, stray_pids, sig)
        deadline = time.monotonic() + wait_s
        while True:
            for proc in procs:
                proc.poll()  # reap our own children so that they do not linger as zombies
            stray_pids = {pid for pid in stray_pids if _pid_alive(pid)}
            if not _live_in_groups(pgids) and not stray_pids:
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
    left = sorted(set(_live_in_groups(pgids)) | stray_pids)
    print(f"netlab: processes {left} survived SIGKILL for {_KILL_WAIT_S} s", file=sys.stderr)


# ---- namespaces and links --------------------------------------------------------------------------


def _netns_names() -> list[str]:
    # lines look like "swl4242ah0 (id: 3)" or just "swl4242ah0"
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def _link_names() -> list[str]:
    # `ip -o link` lines look like "7: swl4242ae0@if6: <BROADCAST,...> ..."
    names = []
    for line in _run(["ip", "-o", "link"]).stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            names.append(parts[1].strip().split("@")[0])
    return names


def _netns_pids(name: str) -> set[int]:
    done = _run(["ip", "netns", "pids", name], check=False)
    return {int(tok) for tok in done.stdout.split() if tok.isdigit()}


def _remove(prefix: str) -> list[str]:
    """Delete every namespace and root-namespace link whose name starts with `prefix`; return their names."""
    removed = []
    for name in _netns_names():
        if name.startswith(prefix):
            _run(["ip", "netns", "del", name])
            removed.append(name)
    for name in _link_names():
        if name.startswith(prefix):
            _run(["ip", "link", "del", name], check=False)  # deleting one veth end removes its peer too
            removed.append(name)
    return removed


def _leftovers(prefix: str) -> list[str]:
    return [name for name in _netns_names() + _link_names() if name.startswith(prefix)]


# ---- open labs: signal handlers and atexit ---------------------------------------------------------

_OPEN_LABS: list[Lab] = []
_REGISTRY_LOCK = threading.RLock()
_PREVIOUS_HANDLERS: dict[int, Any] = {}
_ATEXIT_REGISTERED = False


def _close_all_quietly() -> None:
    with _REGISTRY_LOCK:
        labs = list(_OPEN_LABS)
    for lab in labs:
        try:
            lab.close()
        except Exception as err:  # cleanup on the way out must reach every lab
            print(f"netlab: closing {lab.prefix or 'loopback lab'} failed: {err}", file=sys.stderr)


def _on_signal(signum: int, frame: Any) -> None:
    """Close every open lab, then let the signal take the course it had before the first lab opened."""
    previous = _PREVIOUS_HANDLERS.get(signum, signal.SIG_DFL)
    _close_all_quietly()
    if callable(previous):
        previous(signum, frame)  # e.g. default_int_handler raises KeyboardInterrupt
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    raise SystemExit(128 + signum)  # only reached if the signal did not end the process


def _register(lab: Lab) -> None:
    global _ATEXIT_REGISTERED
    with _REGISTRY_LOCK:
        _OPEN_LABS.append(lab)
        if not _ATEXIT_REGISTERED:
            atexit.register(_close_all_quietly)
            _ATEXIT_REGISTERED = True
        if len(_OPEN_LABS) == 1 and threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                current = signal.getsignal(sig)
                if current is not _on_signal and current != signal.SIG_IGN:  # an ignored signal stays ignored
                    _PREVIOUS_HANDLERS[sig] = signal.SIG_DFL if current is None else current
                    signal.signal(sig, _on_signal)


def _unregister(lab: Lab) -> None:
    with _REGISTRY_LOCK:
        if lab in _OPEN_LABS:
            _OPEN_LABS.remove(lab)
        if _OPEN_LABS or threading.current_thread() is not threading.main_thread():
            return  # off the main thread our handler stays; with no lab open it just forwards the signal
        for sig, previous in list(_PREVIOUS_HANDLERS.items()):
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, previous)
            del _PREVIOUS_HANDLERS[sig]


def _new_prefix() -> str:
    """`swl<pid><letter>`, with a letter that no open lab of this process and no existing name uses."""
    with _REGISTRY_LOCK:
        taken = {lab.prefix for lab in _OPEN_LABS}
    existing = _netns_names() + _link_names()
    for letter in "abcdefghijklmnopqrstuvwxyz":
        prefix = f"{NAME_PREFIX}{os.getpid()}{letter}"
        if prefix not in taken and not any(name.startswith(prefix) for name in existing):
            return prefix
    raise LabUnavailable(f"26 labs of pid {os.getpid()} are open or left over; close some or run cleanup")


# ---- the lab ---------------------------------------------------------------------------------------


class Lab:
    """N test hosts; a context manager that owns the processes it spawns. Build with `loopback_lab` or
    `netns_lab`. Also closes on SIGINT/SIGTERM (installed while a lab is open) and at exit."""

    def __init__(self, *, kind: str, hosts: list[Host], rate_mbit: float | None, prefix: str = "") -> None:
        self.kind = kind
        self.rate_mbit = rate_mbit
        self.hosts = hosts
        self.prefix = prefix
        """the start of every namespace and link name of this lab ("" on loopback)"""
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        _register(self)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Lab(kind={self.kind!r}, prefix={self.prefix!r}, hosts={len(self.hosts)}, rate_mbit={self.rate_mbit})"

    def _host(self, host: int) -> Host:
        if not 0 <= host < len(self.hosts):
            raise ValueError(f"host must be in [0, {len(self.hosts)}), got {host}")
        return self.hosts[host]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")

    def spawn(
        self, host: int, argv: list[str], *, log: Path | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """Start `argv` inside host `host` in a new session (its own process group), with environment
        os.environ + host.env() + env and stdout/stderr into `log` (appended) or /dev/null. The lab owns it:
        `stop(proc)` or `close()` SIGTERMs its whole group, waits, then SIGKILLs."""
        self._check_open()
        target = self._host(host)
        full_env = {**os.environ, **target.env(), **(env or {})}
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # the child keeps its own copy
        try:
            proc = subprocess.Popen(
                target.wrap(argv),
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if log is not None:
                out.close()
        self._procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, *, grace_s: float = _GRACE_S) -> int | None:
        """SIGTERM the process group of `proc` (one this lab spawned), SIGKILL it after `grace_s`;
        return its exit code."""
        _stop_all([proc], set(), grace_s=grace_s)
        if proc in self._procs:
            self._procs.remove(proc)
        return proc.poll()

    def _ends(self, host: int) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of host `host`'s link: its eth0 and the hub-side veth."""
        target = self._host(host)
        if self.kind != "netns":
            raise LabUnavailable(f"a {self.kind} lab has no links to shape or cut; use netns_lab")
        return [(target.name, "eth0"), (f"{self.prefix}hub", f"v{host}")]

    def set_rate(self, host: int, rate_mbit: float | None) -> None:
        """Shape host `host`'s link to `rate_mbit` both ways (tbf), or remove the shaping (None)."""
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0 or None, got {rate_mbit}")
        if self.kind != "netns" and rate_mbit is None:
            return
        self._check_open()
        for netns, dev in self._ends(host):
            if rate_mbit is not None:
                rate = f"{max(1, round(rate_mbit * 1000))}kbit"
                _run(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, *_TBF])
            elif " tbf " in _run(["tc", "-n", netns, "qdisc", "show", "dev", dev]).stdout:
                _run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"])

    def set_link(self, host: int, up: bool) -> None:
        """Cut (up=False) or heal (up=True) host `host`'s link, at both ends."""
        self._check_open()
        for netns, dev in self._ends(host):
            _run(["ip", "-n", netns, "link", "set", dev, "up" if up else "down"])

    def close(self) -> None:
        """Stop every process of the lab (and any other process left in its namespaces), delete its
        namespaces and links. Idempotent. Raises RuntimeError if a name with the lab's prefix survives."""
        if self._closed:
            return
        self._closed = True
        blocked = threading.current_thread() is threading.main_thread()
        if blocked:  # a Ctrl+C now must not cut the cleanup short; it is delivered when we are done
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            stray = set()
            if self.kind == "netns":
                for host in self.hosts:
                    stray |= _netns_pids(host.name)
            _stop_all(self._procs, stray, grace_s=_GRACE_S)
            self._procs.clear()
            left = self._delete() if self.kind == "netns" else []
        finally:
            _unregister(self)
            if blocked:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        if left:
            raise RuntimeError(
                f"{self!r}: {left} remain after close; remove them with "
                f"`python -m benchmarks.netlab cleanup` once this process has exited"
            )

    def _delete(self) -> list[str]:
        _remove(self.prefix)
        left = _leftovers(self.prefix)
        if left:  # a namespace still being torn down by the kernel may need a second try
            _remove(self.prefix)
            left = _leftovers(self.prefix)
        return left


def loopback_lab(num_hosts: int) -> Lab:
    """`num_hosts` hosts that all are this machine's 127.0.0.1; unshaped, nothing to set up."""
    if num_hosts < 1:
        raise ValueError(f"num_hosts must be >= 1, got {num_hosts}")
    hosts = [Host(index=i, name="", ip="127.0.0.1", iface=None) for i in range(num_hosts)]
    return Lab(kind="loopback", hosts=hosts, rate_mbit=None)


def _preflight() -> None:
    if os.geteuid() != 0:
        raise LabUnavailable(f"netns labs need root (euid is {os.geteuid()}); run as root or use loopback_lab")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise LabUnavailable(f"`{tool}` is not installed (apt-get install iproute2); use loopback_lab")


def netns_lab(num_hosts: int, *, rate_mbit: float | None, subnet: str = "10.77.0.0/24") -> Lab:
    """`num_hosts` hosts in their own network namespaces on one bridge, host i at subnet[10+i], each
    link shaped to `rate_mbit` both ways (None: unshaped). Raises LabUnavailable with the reason
    when this machine cannot build it (not root, no `ip`/`tc`, namespace creation failed)."""
    network = ipaddress.ip_network(subnet)
    if num_hosts < 1 or 10 + num_hosts >= network.num_addresses - 1:
        raise ValueError(f"num_hosts must be in [1, {network.num_addresses - 11}] for subnet {subnet}, got {num_hosts}")
    if rate_mbit is not None and not rate_mbit > 0:
        raise ValueError(f"rate_mbit must be > 0 or None, got {rate_mbit}")
    _preflight()
    prefix = _new_prefix()
    hosts = [Host(index=i, name=f"{prefix}h{i}", ip=str(network[10 + i]), iface="eth0") for i in range(num_hosts)]
    lab = Lab(kind="netns", hosts=hosts, rate_mbit=rate_mbit, prefix=prefix)
    try:
        _build(lab, network.prefixlen)
        for i in range(num_hosts):
            lab.set_rate(i, rate_mbit)
    except BaseException as err:
        try:
            lab.close()
        except Exception as close_err:
            print(f"netlab: {close_err}", file=sys.stderr)
        if isinstance(err, Exception):
            raise LabUnavailable(f"could not build a {num_hosts}-host netns lab: {err}") from err
        raise
    return lab


def _build(lab: Lab, prefixlen: int) -> None:
    hub = f"{lab.prefix}hub"
    _run(["ip", "netns", "add", hub])
    _run(["ip", "-n", hub, "link", "set", "lo", "up"])
    _run(["ip", "-n", hub, "link", "add", "br0", "type", "bridge"])
    _run(["ip", "-n", hub, "link", "set", "br0", "up"])
    for host in lab.hosts:
        veth = f"v{host.index}"
        _run(["ip", "netns", "add", host.name])
        # both ends are created inside their namespaces: no name ever appears in the root namespace
        _run(["ip", "link", "add", "eth0", "netns", host.name, "type", "veth", "peer", "name", veth, "netns", hub])
        _run(["ip", "-n", hub, "link", "set", veth, "master", "br0"])
        _run(["ip", "-n", hub, "link", "set", veth, "up"])
        _run(["ip", "-n", host.name, "addr", "add", f"{host.ip}/{prefixlen}", "dev", "eth0"])
        _run(["ip", "-n", host.name, "link", "set", "eth0", "up"])
        _run(["ip", "-n", host.name, "link", "set", "lo", "up"])


def cleanup_stale() -> list[str]:
    """Remove the namespaces and links of labs whose owner process is dead, after killing any process
    still running in them; return the names removed. Labs of live owners are left alone."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return []
    stale = set()
    for name in _netns_names() + _link_names():
        match = _NAME_RE.match(name)
        if match and not _pid_alive(int(match["pid"])):
            stale.add(match.group(0))
    removed = []
    for prefix in sorted(stale):
        pids = set()
        for name in _netns_names():
            if name.startswith(prefix):
                pids |= _netns_pids(name)
        _stop_all([], pids, grace_s=1.0)
        removed += _remove(prefix)
    return removed


# ---- traffic tools (run inside the hosts) ----------------------------------------------------------

_CHUNK = bytes(1 << 20)


def _recv_exact(conn: socket.socket, num_bytes: int) -> bytes:
    data = b""
    while len(data) < num_bytes:
        part = conn.recv(num_bytes - len(data))
        if not part:
            raise ConnectionError(f"peer closed after {len(data)} of {num_bytes} bytes")
        data += part
    return data


def _serve(conn: socket.socket) -> None:
    """One connection: b"e" then echo single bytes until EOF; b"d" + 8-byte size, then drain and ack."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mode = _recv_exact(conn, 1)
    if mode == b"e":
        while byte := conn.recv(1):
            conn.sendall(byte)
        return
    remaining = int.from_bytes(_recv_exact(conn, 8), "big")
    buffer = bytearray(1 << 20)
    while remaining > 0:
        got = conn.recv_into(buffer, min(remaining, len(buffer)))
        if not got:
            raise ConnectionError(f"peer closed with {remaining} bytes to go")
        remaining -= got
    conn.sendall(b"k")


def sink_main(port: int) -> None:
    """Serve connections (one at a time) on 0.0.0.0:`port` until killed."""
    with socket.create_server(("0.0.0.0", port), reuse_port=False) as server:
        while True:
            conn, _ = server.accept()
            with conn:
                try:
                    _serve(conn)
                except ConnectionError as err:
                    print(f"sink: {err}", file=sys.stderr, flush=True)


def _connect(ip: str, port: int, deadline: float) -> socket.socket:
    while True:
        try:
            conn = socket.create_connection((ip, port), timeout=max(0.1, deadline - time.monotonic()))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return conn
        except OSError as err:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"cannot connect to {ip}:{port}: {err}; is the sink running?") from err
            time.sleep(_POLL_S)  # polling for the sink to listen, under a deadline


def source_main(ip: str, port: int, *, num_bytes: int, num_pings: int, timeout_s: float) -> dict[str, float]:
    """Measure the round-trip time (median of `num_pings` 1-byte echoes) and the time to send `num_bytes`
    until the sink acknowledges it received them all."""
    deadline = time.monotonic() + timeout_s
    with _connect(ip, port, deadline) as conn:
        conn.sendall(b"e")
        rtts = []
        for _ in range(num_pings):
            started = time.perf_counter()
            conn.sendall(b"x")
            _recv_exact(conn, 1)
            rtts.append(time.perf_counter() - started)
    with _connect(ip, port, deadline) as conn:
        started = time.perf_counter()
        conn.sendall(b"d" + num_bytes.to_bytes(8, "big"))
        view, remaining = memoryview(_CHUNK), num_bytes
        while remaining > 0:
            conn.sendall(view[: min(remaining, len(view))])
            remaining -= min(remaining, len(view))
        _recv_exact(conn, 1)
        seconds = time.perf_counter() - started
    return {
        "num_bytes": num_bytes,
        "seconds": seconds,
        "mbit_s": num_bytes * 8 / seconds / 1e6,
        "rtt_ms": 1e3 * statistics.median(rtts) if rtts else float("nan"),
    }


def measure_tcp(
    lab: Lab, *, src: int = 0, dst: int = 1, num_bytes: int = 12_000_000, num_pings: int = 20, timeout_s: float = 60.0
) -> dict[str, float]:
    """One TCP transfer of `num_bytes` from host `src` to host `dst` (a sink the lab spawns and stops):
    {"num_bytes", "seconds", "mbit_s", "rtt_ms"}, timed by the sender until the sink's acknowledgement."""
    port = 5201
    if lab.kind == "loopback":
        with socket.socket() as probe:  # a port that was free a moment ago
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    sink = lab.spawn(dst, [sys.executable, __file__, "_sink", "--port", str(port)])
    try:
        argv = [
            sys.executable,
            __file__,
            "_source",
            "--ip",
            lab.hosts[dst].ip,
            "--port",
            str(port),
            "--bytes",
            str(num_bytes),
            "--pings",
            str(num_pings),
            "--timeout-s",
            str(timeout_s),
        ]
        done = _run(lab.hosts[src].wrap(argv), timeout_s=timeout_s + 10)
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        lab.stop(sink, grace_s=2.0)


# ---- CLI -------------------------------------------------------------------------------------------


def _selftest(num_hosts: int, rate_mbit: float | None, num_bytes: int | None) -> int:
    if num_bytes is None:  # about a second on the shaped link, at least 4 MB
        num_bytes = max(4_000_000, int((rate_mbit or 100) * 1e6 / 8))
    started = time.perf_counter()
    rows = []
    with netns_lab(num_hosts, rate_mbit=rate_mbit) as lab:
        built_s = time.perf_counter() - started
        if rate_mbit is not None:  # the unshaped transfer after it is the negative control
            rows.append((f"shaped at {rate_mbit:g} Mbit/s", measure_tcp(lab, num_bytes=num_bytes)))
            for host in range(num_hosts):
                lab.set_rate(host, None)
        rows.append(("unshaped", measure_tcp(lab, num_bytes=num_bytes)))
        prefix = lab.prefix
    print(f"lab {prefix}: {num_hosts} hosts built in {built_s:.2f} s; {num_bytes / 1e6:.1f} MB from host 0 to host 1")
    for label, row in rows:
        print(f"  {label:<24} {row['mbit_s']:9.1f} Mbit/s in {row['seconds']:.3f} s, RTT {row['rtt_ms']:.3f} ms")
    left = _leftovers(prefix)
    print(f"  torn down: {'nothing left' if not left else left}")
    shaped = rows[0][1]
    if rate_mbit is not None and not 0.7 * rate_mbit <= shaped["mbit_s"] <= 1.1 * rate_mbit:
        print(f"FAIL: shaped throughput is not within [0.7, 1.1] x {rate_mbit} Mbit/s", file=sys.stderr)
        return 1
    return 1 if left else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.netlab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("cleanup", help="remove namespaces and links of labs whose owner process is dead")
    selftest = sub.add_parser("selftest", help="build a lab, measure host 0 -> host 1, tear it down")
    selftest.add_argument("--hosts", type=int, default=2, help="number of hosts (>= 2)")
    selftest.add_argument("--rate-mbit", type=float, default=100.0, help="link rate; 0 for unshaped")
    selftest.add_argument("--bytes", type=int, default=None, help="transfer size (default: ~1 s at the rate)")
    sink = sub.add_parser("_sink", help=argparse.SUPPRESS)
    sink.add_argument("--port", type=int, required=True)
    source = sub.add_parser("_source", help=argparse.SUPPRESS)
    source.add_argument("--ip", required=True)
    source.add_argument("--port", type=int, required=True)
    source.add_argument("--bytes", type=int, required=True)
    source.add_argument("--pings", type=int, default=20)
    source.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    if args.command == "cleanup":
        removed = cleanup_stale()
        print(f"removed {len(removed)}: {' '.join(removed)}" if removed else "nothing stale")
        return 0
    if args.command == "selftest":
        if args.hosts < 2:
            parser.error(f"--hosts must be >= 2, got {args.hosts}")
        try:
            return _selftest(args.hosts, args.rate_mbit or None, args.bytes)
        except LabUnavailable as err:
            print(f"netlab unavailable: {err}", file=sys.stderr)
            return 2
    if args.command == "_sink":
        sink_main(args.port)
        return 0
    result = source_main(args.ip, args.port, num_bytes=args.bytes, num_pings=args.pings, timeout_s=args.timeout_s)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
