"""Rounds under attack (TESTMATRIX rows 21 and 22): grouped rounds per minute beside an adversary, in one run.

Three `swarm.peer` peers (charlm tiny, their defaults, loopback) train one run. Once every peer has
grouped, the benchmark counts grouped rounds (a peer's round whose group had >= 2 members, summed over
the peers) in consecutive windows of ``--window-s`` seconds:

* ``clean``: no adversary;
* ``outsider``: a plain hivemind DHT node (no Swarm code, no validator) writes, twice a second,
  ``--fakes`` fake candidates to the run's matchmaking key and fake status and manifest-index entries
  under the same peer IDs, and a plain value over each of the three keys (to hide them); issue 15's
  measured attack: before signed entries the peers' 51 grouped rounds in a minute fell to 4. Swarm
  nodes refuse all of it (bootstrap.owned: no record that its subkey's owner did not sign);
* ``outsider-mm``: the same outsider on the matchmaking key only (what issue 15 measured);
* ``sybils``: ``--fakes`` real Ed25519 identities with valid capability records of the run write
  signed matchmaking entries twice a second, through a DHT node that owner-signs for them, and never
  join a group;
* ``frozen``: no adversary, but the last peer's whole process group (its main process, DHT child, p2pd
  and watchdog) is SIGSTOPped for the window and SIGCONTed after it: silent like a machine that was
  suspended or lost its link without a reset (TESTMATRIX row 23, matchmaking with a frozen member). Its
  grouped rounds are compared with the other peers' own in the clean windows (``vs clean``); they also get
  the frozen peer's CPU share, so each window's steps per peer are shown beside it;
* ``cpu control``: no adversary, but a process that spins as many cores as the outsider's DHT node and
  p2pd used in the ``outsider`` window (the adversary runs on the same 2 cores): the outsider's cost
  beyond the CPU it takes from the machine is its ratio to this window;
* ``clean again``: no adversary, to see the drift of the machine over the run.

The adversary shares this machine's 2 cores with the peers, which a real attacker on its own machine
does not: ``--adversary-nice 19`` runs its processes (DHT node, p2pd, the CPU control's burner) at the
lowest CPU priority, so they take only the cycles the peers leave (and the flood slows with them);
``--adversary-cores X`` gives the adversary X cores of its own and the peers the rest, in every window,
as an attacker on its own machine. Each window reports the write cycles the adversary completed, to show
whether the flood kept its rate.

Each adversary window reports its ratio to the mean of the two clean windows. Prints a table and
writes JSON (default benchmarks/results/adversary.json)::

    .venv/bin/python -m benchmarks.adversary --window-s 60
    .venv/bin/python -m benchmarks.adversary --window-s 60 --peer-flags "--members-only --suspect-s 30"
    .venv/bin/python -m benchmarks.adversary --window-s 60 --windows "clean,outsider,clean again" --adversary-cores 0.5
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import hivemind
import psutil
from hivemind.utils.timed_storage import get_dht_time
from rich.console import Console
from rich.table import Table

from averaging.group import matchmaking_key
from averaging.membership import sign_entry
from benchmarks._common import is_stopped, process_tree, run_metadata, save_result, signals_unwind, start_bootstrap_node
from benchmarks.netlab import loopback_lab
from bootstrap.identity import Identity
from bootstrap.owned import OwnerBoundValidator
from bootstrap.records import peers_key, sign_record
from peers.testing import make_record
from swarm.checkpoint.gossip import index_key
from swarm.config import averaging_prefix
from swarm.events import read_events
from swarm.status import status_key

RESULTS = Path(__file__).parent / "results" / "adversary.json"
_PEERS = 3
_WRITE_EVERY_S = 0.5
_ENTRY_LIFETIME_S = 5.0
_RECORD_LIFETIME_S = 120


class Adversary:
    """Writes fake or Sybil entries under the run's keys from its own hivemind node, in a thread."""

    def __init__(self, initial_peers: list[str], run: str, kind: str, count: int, nice: int = 0) -> None:
        self.key, self.kind = matchmaking_key(averaging_prefix(run), 1, 0), kind  # the run's trainers' key
        self.identities = [Identity.generate() for _ in range(count)]
        # an outsider's node checks and signs nothing; a Sybil's node owner-signs for its keys
        validators = [OwnerBoundValidator(*self.identities)] if kind == "sybils" else []
        self.dht = hivemind.DHT(
            initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, record_validators=validators
        )
        self.hidden_keys = (self.key, status_key(run), index_key(run))
        _renice(self.dht.pid, nice)
        self.run, self.writes = run, 0
        self._stop, self._started = threading.Event(), threading.Event()
        self.tid: int | None = None
        self._thread = threading.Thread(target=self._loop, name=f"adversary-{kind}", daemon=True)

    def start(self) -> None:
        if self.kind == "sybils":  # real identities, each with a valid, signed capability record of the run
            for identity in self.identities:
                record = make_record(identity, run=self.run, lifetime_s=_RECORD_LIFETIME_S)
                self.dht.store(
                    peers_key(identity.peer_id),
                    sign_record(record, identity),
                    record.expires_at,
                    subkey=identity.peer_id,
                )
        self._thread.start()
        self._started.wait(timeout=10)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.cpu_s = self._cpu_s()
        self.dht.shutdown()

    def _cpu_s(self) -> float:
        """CPU seconds of the adversary's DHT process and its p2pd so far (they share the 2 cores)."""
        total = 0.0
        for proc in process_tree(self.dht.pid):
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system
        return total

    def _loop(self) -> None:
        self.tid = threading.get_native_id()
        self._started.set()
        while not self._stop.is_set():
            expiration = get_dht_time() + _ENTRY_LIFETIME_S
            for identity in self.identities:
                if self.kind == "sybils":
                    value: Any = sign_entry(identity, self.key, bandwidth_class=0, region="", expires_at=expiration)
                else:  # what an outsider can write: entries under peer IDs that look real, signed by no one
                    value = {"t": time.time(), "c": 0, "r": ""}
                    for key in self.hidden_keys[1:] if self.kind == "outsider" else ():
                        fake = {"p": b"{}", "s": b"\0" * 64}
                        self.dht.store(
                            key, fake, expiration_time=expiration, subkey=identity.peer_id, return_future=True
                        )
                self.dht.store(self.key, value, expiration_time=expiration, subkey=identity.peer_id, return_future=True)
            if self.kind == "outsider":  # a plain value with a later expiry would replace a whole dictionary
                for key in self.hidden_keys:
                    self.dht.store(key, "hidden", expiration_time=expiration + 60, return_future=True)
            self.writes += 1
            self._stop.wait(_WRITE_EVERY_S)


def _peer_argv(run: str, slot: int, initial: list[str], work: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "swarm.peer",
        "--initial-peers",
        *initial,
        "--run",
        run,
        "--task",
        "charlm",
        "--task-preset",
        "tiny",
        "--host-maddrs",
        "/ip4/127.0.0.1/tcp/0",
        "--shard-index",
        str(slot),
        "--num-shards",
        str(_PEERS),
        "--identity-key",
        str(work / f"peer{slot}.key"),
        "--events",
        str(work / f"peer{slot}.jsonl"),
        "--torch-threads",
        "1",
        "--no-progress",
        "--checkpoint-dir",
        str(work / "checkpoints"),
        "--ledger-dir",
        str(work / "ledgers"),
        *extra,
    ]


def _counts(work: Path, start: float, end: float) -> tuple[list[int], list[int]]:
    """Each peer's grouped rounds that ended in [start, end), and the inner steps it took then (the step of its
    last round before ``end`` minus that of its last round before ``start``), from one read of its events."""
    grouped, steps = [], []
    for slot in range(_PEERS):
        rounds = [e for e in read_events(work / f"peer{slot}.jsonl") if e["event"] == "round"]
        grouped.append(sum(1 for e in rounds if start <= e["t"] < end and (e.get("group_size") or 0) >= 2))
        before = [e["step"] for e in rounds if e["t"] < start] or [0]
        until = [e["step"] for e in rounds if e["t"] < end] or [0]
        steps.append(max(until) - max(before))
    return grouped, steps


WINDOWS = ("clean", "outsider-mm", "outsider", "cpu control", "sybils", "frozen", "clean again")
_BURN = """
import sys, time
share = float(sys.argv[1])
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.01 * share:
        pass
    time.sleep(0.01 * (1 - share))
"""


def _renice(pid: int, nice: int) -> None:
    """Lower the CPU priority of ``pid`` and its children (p2pd) to ``nice`` (0: leave it).

    With the kernel's autogroups on (``/proc/sys/kernel/sched_autogroup_enabled``, the default of most
    distributions), a nice value only orders the processes of one session: each session gets a fair share of
    the cores whatever its processes' nice values. The peers run in sessions of their own, the adversary in
    this benchmark's, so a per-process nice left it its whole share (0.46-0.63 cores at "nice 19", stop 59);
    the session's autogroup is reniced too (this benchmark's main thread, which only reads the peers' event
    files, with it)."""
    if not nice:
        return
    for proc in process_tree(pid):
        with contextlib.suppress(psutil.Error):
            proc.nice(nice)
        with contextlib.suppress(OSError):
            Path(f"/proc/{proc.pid}/autogroup").write_text(str(nice))


class _CoreSplit:
    """Two machines on one host: the peers and the bootstrap node on ``host_cores``, the adversary on
    ``adversary_cores`` of its own, in every window (CFS quotas of the cgroup v1 ``cpu`` controller).

    Without it the adversary's processes take their cores from the peers': a flood at full rate spun 0.46-0.48
    cores of the 2, and the peers' own processes lost 0.57 cores (stop 59), so a window measured the attacker's
    CPU on this host as much as what its records cost the swarm. A real attacker floods from its own machine.
    This benchmark's process joins the hosts' group at once (the peers it spawns inherit it); the adversary's
    DHT process, its p2pd, its writing thread and the CPU control's burner are moved to the other."""

    ROOT = Path("/sys/fs/cgroup/cpu")

    def __init__(self, host_cores: float, adversary_cores: float) -> None:
        if not (self.ROOT / "tasks").exists():
            raise RuntimeError(f"--adversary-cores needs the cgroup v1 cpu controller at {self.ROOT}")
        self.quotas = {"hosts": host_cores, "adversary": adversary_cores}
        self.groups = {name: self.ROOT / f"swarm-{name}-{os.getpid()}" for name in self.quotas}

    def __enter__(self) -> _CoreSplit:
        try:
            for name, group in self.groups.items():
                group.mkdir()
                period = int((group / "cpu.cfs_period_us").read_text())
                (group / "cpu.cfs_quota_us").write_text(str(int(self.quotas[name] * period)))
            (self.groups["hosts"] / "cgroup.procs").write_text(str(os.getpid()))
        except BaseException:
            self.__exit__()  # a group made before the failure goes too
            raise
        return self

    def adversary(self, pid: int | None = None, tid: int | None = None) -> None:
        """Moves process ``pid`` with its children (or the single thread ``tid``) to the adversary's cores."""
        group = self.groups["adversary"]
        if tid is not None:
            (group / "tasks").write_text(str(tid))
        for proc in process_tree(pid):
            with contextlib.suppress(OSError):
                (group / "cgroup.procs").write_text(str(proc.pid))

    def __exit__(self, *exc: object) -> None:
        for group in self.groups.values():  # every task back to the root group, then the groups go
            with contextlib.suppress(OSError):
                for tid in (group / "tasks").read_text().split():
                    with contextlib.suppress(OSError):
                        (self.ROOT / "tasks").write_text(tid)
            deadline = time.monotonic() + 10
            while group.exists():
                try:
                    group.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)


class _Freezer:
    """SIGSTOPs one peer's process group (main process, DHT child, p2pd, watchdog) for a window."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.pgid, self.cpu_s, self.writes = proc.pid, 0.0, None  # the lab starts each peer in its own session
        self.stopped = 0

    def start(self) -> None:
        os.killpg(self.pgid, signal.SIGSTOP)
        group = [p for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == self.pgid]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(is_stopped(p) for p in group):
            time.sleep(0.05)
        self.stopped = sum(is_stopped(p) for p in group)
        if self.stopped < 3:  # main, DHT child, p2pd at least: the fault must have fired
            raise RuntimeError(f"froze {self.stopped} of the peer's processes, expected >= 3")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGCONT)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


class _Burner:
    """A process that keeps ``cores`` (<= 1) of a core busy, in 10 ms slices."""

    def __init__(self, cores: float, nice: int = 0) -> None:
        self.cores = min(1.0, max(0.0, cores))
        self.cpu_s, self.writes = 0.0, None
        self._proc = subprocess.Popen([sys.executable, "-c", _BURN, str(self.cores)])
        _renice(self._proc.pid, nice)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(self._proc.pid).cpu_times()
            self.cpu_s = times.user + times.system
        self._proc.kill()
        self._proc.wait(timeout=10)


def run(
    *,
    window_s: float,
    fakes: int,
    work: Path,
    console: Console,
    peer_flags: list[str],
    windows_run=WINDOWS,
    nice: int = 0,
    adversary_cores: float | None = None,
) -> dict[str, Any]:
    run_name = "adversary"
    windows: list[dict[str, Any]] = []
    split = (
        _CoreSplit((os.cpu_count() or 2) - adversary_cores, adversary_cores)
        if adversary_cores
        else contextlib.nullcontext()
    )
    with split, loopback_lab(_PEERS + 1) as lab:
        _, maddrs = start_bootstrap_node(lab, _PEERS, work=work, timeout_s=120)
        if maddrs is None:
            raise RuntimeError(f"the bootstrap node did not start; see {work / 'bootstrap.log'}")
        procs = [
            lab.spawn(slot, _peer_argv(run_name, slot, maddrs, work, peer_flags), log=work / f"peer{slot}.log")
            for slot in range(_PEERS)
        ]
        deadline = time.time() + 240
        while not all(_counts(work, 0, time.time() + 1)[0]):
            if time.time() > deadline:
                raise RuntimeError(f"the peers did not all group within 240 s; see the logs in {work}")
            time.sleep(1.0)
        console.print("every peer has grouped; measuring")
        for name in windows_run:
            adversary: Adversary | _Burner | _Freezer | None = None
            if name == "frozen":
                adversary = _Freezer(procs[-1])
            elif name == "cpu control":
                outsider = [w for w in windows if w["window"] == "outsider"]
                adversary = _Burner(outsider[-1]["adversary_cpu_cores"] if outsider else 0.5, nice)
            elif not name.startswith("clean"):
                adversary = Adversary(maddrs, run_name, name, fakes, nice)
            try:
                if adversary is not None:
                    adversary.start()
                    if isinstance(split, _CoreSplit) and isinstance(adversary, Adversary):
                        split.adversary(pid=adversary.dht.pid, tid=adversary.tid)
                    elif isinstance(split, _CoreSplit) and isinstance(adversary, _Burner):
                        split.adversary(pid=adversary._proc.pid)
                start = time.time()
                time.sleep(window_s)  # the window's wall-clock length is what is measured
                end = time.time()
            finally:
                if adversary is not None:
                    adversary.stop()
            counts, steps = _counts(work, start, end)
            live = _PEERS - 1 if name == "frozen" else _PEERS  # the frozen peer's own rounds are not counted
            per_min = sum(counts[:live]) * 60 / (end - start)
            cpu = adversary.cpu_s / (end - start) if adversary is not None else 0.0
            writes = getattr(adversary, "writes", None)
            windows.append(
                {
                    "window": name,
                    "grouped_per_peer": counts,
                    "counted_peers": live,
                    "seconds": end - start,
                    "steps_per_peer": steps,
                    "grouped_per_min": per_min,
                    "adversary_cpu_cores": cpu,
                    "adversary_write_cycles": writes,
                }
            )
            console.print(
                f"  {name}: {counts} grouped rounds per peer, {per_min:.1f} per minute of {live} peers; steps"
                f" {steps}; adversary {cpu:.2f} cores,"
                f" {writes if writes is not None else '-'} write cycles"
            )
    for w in windows:  # against the same peers' grouped rounds in the clean windows
        clean = statistics.mean(
            sum(c["grouped_per_peer"][: w["counted_peers"]]) * 60 / c["seconds"]
            for c in windows
            if c["window"].startswith("clean")
        )
        w["ratio_to_clean"] = w["grouped_per_min"] / clean if clean else None
    return {
        "peers": _PEERS,
        "fakes": fakes,
        "window_s": window_s,
        "peer_flags": peer_flags,
        "adversary_nice": nice,
        "adversary_cores": adversary_cores,
        "windows": windows,
    }


def print_table(result: dict[str, Any], console: Console) -> None:
    flags = " ".join(result["peer_flags"]) or "defaults"
    table = Table(
        title=f"grouped rounds per minute, {result['peers']} swarm.peer peers ({flags}), {result['fakes']} fakes"
    )
    columns = (
        "window",
        "grouped rounds per peer",
        "steps per peer",
        "per minute",
        "vs clean",
        "adversary CPU (cores)",
        "write cycles",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for w in result["windows"]:
        ratio = w["ratio_to_clean"]
        table.add_row(
            w["window"],
            str(w["grouped_per_peer"]),
            str(w.get("steps_per_peer", "-")),
            f"{w['grouped_per_min']:.1f}",
            "-" if ratio is None else f"{ratio:.2f}x",
            f"{w.get('adversary_cpu_cores', 0.0):.2f}",
            "-" if w.get("adversary_write_cycles") is None else str(w["adversary_write_cycles"]),
        )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.adversary", description=__doc__.split("\n\n")[0])
    parser.add_argument("--window-s", type=float, default=60.0, help="length of each window (default: %(default)s)")
    parser.add_argument("--fakes", type=int, default=24, help="fake candidates or Sybils (default: %(default)s)")
    parser.add_argument("--peer-flags", default="", help="extra swarm.peer flags, e.g. '--members-only --suspect-s 30'")
    parser.add_argument(
        "--adversary-nice",
        type=int,
        default=0,
        help="CPU nice of the adversary's processes, 0-19 (default: %(default)s)",
    )
    parser.add_argument(
        "--adversary-cores",
        type=float,
        default=None,
        help="give the adversary this many cores of its own and the peers the rest, in every window (cgroup v1"
        " cpu quotas; default: all share the machine)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON result (default: %(default)s)")
    parser.add_argument(
        "--windows", default=",".join(WINDOWS), help="comma-separated windows, in order (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    console = Console()
    work = Path(tempfile.mkdtemp(prefix="swarm-adversary-"))
    try:
        with signals_unwind():
            flags = shlex.split(args.peer_flags)
            names = tuple(n.strip() for n in args.windows.split(",") if n.strip())
            unknown = [n for n in names if n not in WINDOWS]
            if args.adversary_cores is not None and not 0 < args.adversary_cores < (os.cpu_count() or 2):
                parser.error(f"--adversary-cores must be in (0, {os.cpu_count()}), got {args.adversary_cores}")
            if not 0 <= args.adversary_nice <= 19:
                parser.error(f"--adversary-nice must be in [0, 19], got {args.adversary_nice}")
            if unknown or not any(n.startswith("clean") for n in names):
                parser.error(f"--windows: need a clean window, and only {', '.join(WINDOWS)}; got {args.windows!r}")
            result = run(
                window_s=args.window_s,
                fakes=args.fakes,
                work=work,
                console=console,
                peer_flags=flags,
                windows_run=names,
                nice=args.adversary_nice,
                adversary_cores=args.adversary_cores,
            )
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted; logs kept in {work}[/]")
        return 130
    except RuntimeError as e:
        console.print(f"[red]{e}[/]")
        return 1
    result["meta"] = run_metadata("adversary", argv)
    print_table(result, console)
    console.print(f"wrote {save_result(args.out, result)}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
