"""DHT churn and bootstrap loss (TESTMATRIX rows 16-17): kill 10% of the DHT peers at once; lookups and
capability queries must still succeed (>= 99%); then kill the bootstrap node and join a new peer through
a live peer's address.

    python -m benchmarks.dht_churn [--peers 30] [--kill-fraction 0.1] [--lookups 300] [--seed N]

The bootstrap node is `python -m bootstrap`, a separate OS process. Every peer is a real DHT node (its
own DHT process and p2pd, started by `bootstrap.network.start_swarm_dht` with its `Identity`) that publishes
a signed capability record with `peers.Advertiser`; their advertisers live in this process, as in
benchmarks.peers_graph. All peers join through the bootstrap node.

1. ``--keys`` key/values are stored (under the writer's subkey), key i by peer i mod N; ``--baseline-lookups`` lookups
   measure the DHT before any fault (a control, not a check).
2. A crash: ``--kill-fraction`` of the peers (at least one) are SIGKILLed at once, each its DHT process
   and its p2pd together: what the others see when the machine under a peer dies. Nothing withdraws
   anything (their advertisers stop without a ``left`` record), and every killed pid is checked gone.
   A peer's main process only matters to the DHT through its advertiser, so it is not spawned:
   a child interpreter per victim would cost seconds of imports per peer on a small machine.
   ``--death freeze`` SIGSTOPs them instead: silent like a lost machine, so every RPC to them waits
   for hivemind's 3 s ``wait_timeout`` instead of being refused at once (SIGKILLed at the end).
3. Right after the kill (before any record refresh re-replicates anything): ``--lookups`` lookups of
   stored keys (``latest=True``, as every lookup in Swarm), each from a random live peer that neither
   stored nor read that key before, so no lookup is answered from the reader's own cache; and
   ``--queries`` capability queries (`peers.ResourceGraph`), each from a random live peer, counting
   every live peer's record found.
4. The bootstrap node is SIGKILLed with its whole process tree; once it is gone, a new peer starts with
   only one random live peer's visible addresses as ``initial_peers``. It must read every stored key,
   its capability query must see every live peer, and live peers must see its record.

The seed picks the victims, the readers and the peer the joiner comes through; identities and DHT IDs
are new on every run. Rates pass at ``--min-rate`` (0.99); every wait is bounded by ``--phase-timeout-s``. Prints a table,
writes JSON (benchmarks/results/dht_churn.json) and exits 1 when a check fails (2 on bad flags).
Ctrl+C or SIGTERM stops every DHT, p2pd and the bootstrap node.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from hivemind import DHT
from hivemind.utils import get_dht_time
from rich.console import Console
from rich.table import Table

from benchmarks._common import is_stopped, process_tree, run_metadata, save_result
from bootstrap import DHTStartError, stop_dht, visible_maddrs
from bootstrap.cli import add_dataclass_arguments, dataclass_from_args
from bootstrap.identity import Identity
from bootstrap.network import start_swarm_dht
from peers import Advertiser, ResourceGraph
from peers.testing import record_builder

RESULTS = Path(__file__).parent / "results" / "dht_churn.json"
REPO_ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
_INITIAL_PEERS = re.compile(r"^--initial-peers (/\S+(?: /\S+)*)$", re.MULTILINE)
_POLL_S = 0.1
_KEY_TTL_S = 3600.0
_NUM_CHECKERS = 5


@dataclass(frozen=True, kw_only=True, slots=True)
class DHTChurnConfig:
    """The benchmark's shape; one flag per field."""

    peers: int = 30
    """DHT peers on loopback (each its own DHT process and p2pd), joined through the bootstrap node."""
    kill_fraction: float = 0.1
    """Fraction of the peers crashed at once (rounded, at least one; at least one peer survives)."""
    death: str = "kill"
    """kill: SIGKILL each victim's DHT process and p2pd; freeze: SIGSTOP them (silent, like a lost machine)."""
    keys: int = 100
    """Plain key/values stored before the kill, key i by peer i mod peers."""
    baseline_lookups: int = 100
    """Lookups before the kill (the control; 0: none)."""
    lookups: int = 300
    """Lookups of stored keys after the kill, each from a random live peer that never held that key."""
    queries: int = 20
    """Capability queries after the kill, each from a random live peer."""
    parallel: int = 8
    """Lookups in flight at once."""
    refresh_s: float = 15.0
    """Heartbeat of every peer's capability record."""
    expiry_s: float = 45.0
    """Lifetime of a capability record."""
    lookup_timeout_s: float = 10.0
    """A lookup or query that has not answered after this long counts as failed."""
    phase_timeout_s: float = 60.0
    """Bound of every other wait (bootstrap start, all records visible, processes gone, the join)."""
    min_rate: float = 0.99
    """Pass mark of every success rate and completeness."""
    wait_timeout_s: float = 3.0
    """hivemind's RPC timeout in every peer's DHT node (its default: 3 s); a frozen peer costs this per RPC."""
    blacklist_s: float = 5.0
    """How long every peer's DHT node skips a peer that did not answer (hivemind's default: 5 s, doubling)."""
    seed: int = 0
    """Seed of the victims, readers and the peer the late joiner joins through."""

    def __post_init__(self) -> None:
        if self.peers < 3:
            raise ValueError(f"peers must be >= 3 (a victim, a reader and a peer to join through), got {self.peers!r}")
        if not 0 < self.kill_fraction < 1:
            raise ValueError(f"kill_fraction must be in (0, 1), got {self.kill_fraction!r}")
        if self.death not in ("kill", "freeze"):
            raise ValueError(f"death must be kill or freeze, got {self.death!r}")
        for name in ("keys", "lookups", "queries", "parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not (0 < self.wait_timeout_s and 0 <= self.blacklist_s):
            raise ValueError(f"wait_timeout_s must be > 0 and blacklist_s >= 0, got {self}")
        if self.baseline_lookups < 0:
            raise ValueError(f"baseline_lookups must be >= 0, got {self.baseline_lookups!r}")
        if not 0 < self.refresh_s < self.expiry_s:
            raise ValueError(f"refresh_s must be in (0, expiry_s={self.expiry_s!r}), got {self.refresh_s!r}")
        for name in ("lookup_timeout_s", "phase_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 < self.min_rate <= 1:
            raise ValueError(f"min_rate must be in (0, 1], got {self.min_rate!r}")

    @property
    def num_victims(self) -> int:
        return min(self.peers - 2, max(1, round(self.peers * self.kill_fraction)))


class BenchmarkFailed(RuntimeError):
    """The swarm never reached a state the benchmark waits for (the message says which)."""


@dataclass(slots=True)
class FaultLog:
    """Every fault injected, keyed by (target, phase), with the pids it hit and whether they are gone."""

    fired: dict[str, int] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)

    def record(self, *, target: str, phase: str, signal_name: str, procs: list[dict[str, Any]]) -> None:
        """Count one fault; ``procs`` as `_describe` wrote them before the signal."""
        self.fired[phase] = self.fired.get(phase, 0) + 1
        self.events.append({"target": target, "phase": phase, "signal": signal_name, "procs": procs})


@dataclass(slots=True)
class _Peer:
    name: str
    identity: Identity
    dht: DHT
    advertiser: Advertiser | None = None
    graph: ResourceGraph | None = None
    crash_procs: list[psutil.Process] = field(default_factory=list)
    """Its DHT process and p2pd, once crashed (psutil objects: a recycled pid is never signalled)."""

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def crashed(self) -> bool:
        return bool(self.crash_procs)

    def finish_crash(self) -> None:
        """SIGKILL a crashed victim's processes (frozen ones are still there), so that RPCs to it fail at once."""
        if self.crashed:
            _signal_tree(self.crash_procs, signal.SIGKILL)
            self.dht.join(timeout=1.0)  # reap the forked DHT process; its orphaned p2pd goes to init

    def close(self) -> None:
        self.finish_crash()
        if self.advertiser is not None:
            self.advertiser.close(withdraw=False)  # the benchmark ends; nobody reads the records any more
        if self.dht.exitcode is None:  # a reaped DHT's pid may belong to another process by now
            stop_dht(self.dht)


# ------------------------------------------------------------------------------------ processes
def _describe(procs: list[psutil.Process]) -> list[dict[str, Any]]:
    """pid, create time (which tells a recycled pid apart) and name of each process, while it still runs."""
    return [{"pid": p.pid, "create_time": p.create_time(), "name": _name(p)} for p in procs]


def _signal_tree(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):  # psutil checks the create time: no recycled pid is hit
            proc.send_signal(sig)


def _is_gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> float:
    """Poll ``predicate`` until it is truthy; seconds it took. Raises BenchmarkFailed naming ``what``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise BenchmarkFailed(f"{what} not reached within {timeout_s:.0f} s")
        time.sleep(_POLL_S)
    return time.monotonic() - started


class _Bootstrap:
    """A `python -m bootstrap` node on loopback; its output goes to files under ``work``."""

    def __init__(self, work: Path, timeout_s: float):
        self.log = work / "bootstrap.log"
        with open(work / "bootstrap.out", "w") as out, open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bootstrap",
                    "--host-maddrs",
                    LOOPBACK[0],
                    "--identity",
                    str(work / "bootstrap.id"),
                    "--refresh-period-s",
                    "300",
                    "--log-level",
                    "WARNING",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=REPO_ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        started = time.monotonic()
        try:
            self.maddrs = self._await_maddrs(work / "bootstrap.out", timeout_s)
        except BaseException:  # also Ctrl+C or SIGTERM while it starts: the caller has no handle to stop it yet
            with _signals_deferred():
                self.stop()
            raise
        self.start_s = time.monotonic() - started
        self.peer_id = self.maddrs[0].rsplit("/p2p/", 1)[1]

    def _await_maddrs(self, out: Path, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while not (match := _INITIAL_PEERS.search(out.read_text(errors="replace"))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BenchmarkFailed(
                    f"the bootstrap node printed no --initial-peers line within {timeout_s:.0f} s "
                    f"(exit code {self.proc.returncode}): {self.log.read_text()[-1000:]}"
                )
            time.sleep(_POLL_S)
        return match.group(1).split()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL whatever of its process tree is left; safe to call twice."""
        tree = process_tree(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        _signal_tree([p for p in tree if not _is_gone(p)], signal.SIGKILL)  # whatever ignored SIGTERM
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def _crash(procs: list[psutil.Process], death: str) -> None:
    _signal_tree(procs, signal.SIGKILL if death == "kill" else signal.SIGSTOP)


def _fault_landed(procs: list[psutil.Process], death: str) -> bool:
    return all(_is_gone(p) if death == "kill" else (_is_gone(p) or is_stopped(p)) for p in procs)


# ------------------------------------------------------------------------------------ peers
def _start_peer(name: str, initial_peers: Sequence[str], config: DHTChurnConfig) -> _Peer:
    identity = Identity.generate()
    dht = start_swarm_dht(
        identity,
        initial_peers=initial_peers,
        host_maddrs=LOOPBACK,
        connect_timeout_s=config.phase_timeout_s,
        wait_timeout=config.wait_timeout_s,
        blacklist_time=config.blacklist_s,
    )
    peer = _Peer(name=name, identity=identity, dht=dht, graph=ResourceGraph(dht))
    try:
        peer.advertiser = Advertiser(
            dht, identity, record_builder(identity), refresh_s=config.refresh_s, expiry_s=config.expiry_s
        ).start()
    except BaseException:  # the caller never got the peer: stop it here
        with _signals_deferred():
            peer.close()
        raise
    return peer


def _seen(peer: _Peer, timeout_s: float) -> set[str] | None:
    """Peer IDs of the live records one capability query from ``peer`` returns; None if it failed."""
    try:
        return {r.peer_id for r in peer.graph.records(timeout_s=timeout_s)}
    except Exception:  # a DHT timeout or a dead pipe: the query failed
        return None


def _store_keys(peers: list[_Peer], num_keys: int, token: str, timeout_s: float) -> dict[str, str]:
    """Store ``num_keys`` key/values, key i by peer i mod N under its own subkey (every Swarm record is
    owner-bound, bootstrap.owned); the keys that were stored, with their values."""
    expiration = get_dht_time() + _KEY_TTL_S
    futures = []
    for i in range(num_keys):
        key, value, writer = f"dht-churn/{token}/key{i}", f"value {i} of {token}", peers[i % len(peers)]
        future = writer.dht.store(key, value, expiration, subkey=writer.identity.peer_id, return_future=True)
        futures.append((key, value, future))
    stored, deadline = {}, time.monotonic() + timeout_s
    for key, value, future in futures:
        with contextlib.suppress(Exception):
            if future.result(timeout=max(0.0, deadline - time.monotonic())):
                stored[key] = value
    return stored


def _lookups(
    pairs: list[tuple[_Peer, str]], expected: dict[str, str], *, parallel: int, timeout_s: float
) -> dict[str, Any]:
    """Look each key up (latest=True) from its reader, ``parallel`` at a time; success rate and times."""
    outcomes: dict[str, int] = {"found": 0, "missing": 0, "wrong_value": 0, "timeout": 0, "error": 0}
    times, failures = [], []
    for start in range(0, len(pairs), parallel):
        batch = []
        for reader, key in pairs[start : start + parallel]:
            done_at: list[float] = []
            future = reader.dht.get(key, latest=True, return_future=True)
            future.add_done_callback(lambda _f, d=done_at: d.append(time.monotonic()))
            batch.append((reader, key, future, time.monotonic(), done_at))
        for reader, key, future, started, done_at in batch:
            try:
                found = future.result(timeout=max(0.0, started + timeout_s - time.monotonic()))
                values = [v.value for v in found.value.values()] if found and isinstance(found.value, dict) else []
                outcome = "missing" if found is None else "found" if values == [expected[key]] else "wrong_value"
            except TimeoutError:
                outcome = "timeout"
                future.cancel()
            except Exception as e:
                outcome = f"error: {e!r}"
            outcomes[outcome if outcome in outcomes else "error"] += 1
            if done_at:
                times.append(done_at[0] - started)
            if outcome != "found":
                failures.append({"reader": reader.name, "key": key, "outcome": outcome})
    return {
        "lookups": len(pairs),
        **outcomes,
        "success_rate": outcomes["found"] / max(1, len(pairs)),
        **_time_stats(times),
        "failures": failures[:20],
    }


def _time_stats(times: list[float]) -> dict[str, float | None]:
    if not times:
        return {"seconds_median": None, "seconds_p95": None, "seconds_max": None}
    ordered = sorted(times)
    return {
        "seconds_median": statistics.median(ordered),
        "seconds_p95": ordered[int(0.95 * (len(ordered) - 1))],
        "seconds_max": ordered[-1],
    }


def _pairs(
    readers: list[_Peer],
    keys: list[str],
    count: int,
    storer_of: dict[str, str],
    used: set[tuple[str, str]],
    rng: random.Random,
) -> list[tuple[_Peer, str]]:
    """``count`` (reader, key) pairs never used before, the reader never the key's storer.

    A node keeps what it stored or found in its local cache; a repeated pair would measure that cache.
    """
    pairs: list[tuple[_Peer, str]] = []
    candidates = [(r, k) for r in readers for k in keys if r.name != storer_of[k] and (r.name, k) not in used]
    for reader, key in rng.sample(candidates, min(count, len(candidates))):
        used.add((reader.name, key))
        pairs.append((reader, key))
    return pairs


def _queries(
    readers: list[_Peer], expected: set[str], count: int, rng: random.Random, timeout_s: float
) -> dict[str, Any]:
    """``count`` capability queries from random ``readers``: the share of ``expected`` records each saw."""
    found, failed, per_query, times = 0, 0, [], []
    for _ in range(count):
        reader = rng.choice(readers)
        started = time.monotonic()
        seen = _seen(reader, timeout_s)
        times.append(time.monotonic() - started)
        failed += seen is None
        hits = len((seen or set()) & expected)
        found += hits
        per_query.append(hits / len(expected))
    return {
        "queries": count,
        "expected_per_query": len(expected),
        "failed_queries": failed,
        "completeness": found / (count * len(expected)),
        "completeness_min": min(per_query),
        **_time_stats(times),
        "rejections": sum(sum(r.graph.rejections.counts.values()) for r in readers),
    }


# ------------------------------------------------------------------------------------ the run
Observer = Callable[[str, dict[str, Any]], None]
"""Called as ``observe(moment, facts)`` at "peers_crashed" (once the victims' processes are gone or stopped,
before any lookup) and at "joining" (right before the late joiner starts), so a test can check them itself."""


def run(config: DHTChurnConfig, console: Console | None = None, *, observe: Observer | None = None) -> dict[str, Any]:
    """Run the scenario (module docstring): figures, checks, faults fired and seconds per phase.

    Stops every DHT, p2pd and the bootstrap node before it returns or raises.
    """
    observe = observe or (lambda _moment, _facts: None)
    console = console or Console(quiet=True)
    rng = random.Random(config.seed)
    token = f"{config.seed}-{os.getpid()}-{time.time_ns()}"
    work = Path(tempfile.mkdtemp(prefix="dht-churn-"))
    faults, phases = FaultLog(), _Phases(console)
    bootstrap: _Bootstrap | None = None
    peers: list[_Peer] = []
    started = time.monotonic()
    try:
        with phases("bootstrap_start", "starting the bootstrap node"):
            bootstrap = _Bootstrap(work, config.phase_timeout_s)
        with phases("peers_start", f"starting {config.peers} peers"):
            setup = _start_swarm(config, bootstrap, peers)
        with phases("store", f"storing {config.keys} keys"):
            stored = _store_keys(peers, config.keys, token, config.phase_timeout_s)
        storer_of = {f"dht-churn/{token}/key{i}": peers[i % len(peers)].name for i in range(config.keys)}
        keys, used, baseline = sorted(stored), set(), None
        if config.baseline_lookups:
            with phases("baseline_lookups", f"{config.baseline_lookups} lookups before the kill"):
                baseline = _lookups(
                    _pairs(peers, keys, config.baseline_lookups, storer_of, used, rng),
                    stored,
                    parallel=config.parallel,
                    timeout_s=config.lookup_timeout_s,
                )
        with phases("kill", f"crashing {config.num_victims} peers"):
            victims = rng.sample(peers, config.num_victims)
            kill = _kill_peers(victims, config, faults)
        observe("peers_crashed", {"events": list(faults.events), "victims": [v.peer_id for v in victims]})
        live = [p for p in peers if not p.crashed]
        with phases("lookups_after_kill", f"{config.lookups} lookups after the kill"):
            after_lookups = _lookups(
                _pairs(live, keys, config.lookups, storer_of, used, rng),
                stored,
                parallel=config.parallel,
                timeout_s=config.lookup_timeout_s,
            )
        with phases("queries_after_kill", f"{config.queries} capability queries after the kill"):
            after_queries = _queries(live, {p.peer_id for p in live}, config.queries, rng, config.lookup_timeout_s)
        with phases("bootstrap_loss_and_join", "killing the bootstrap node; a new peer joins through a live peer"):
            join = _bootstrap_loss(config, bootstrap, live, peers, stored, faults, rng, observe)
        survivors = [p for p in peers if not p.crashed]  # with the joiner
        result = {
            "peers": config.peers,
            "victims": len(victims),
            "keys_stored": len(stored),
            "setup": setup,
            "baseline": baseline,
            "kill": kill,
            "heartbeats": {
                "published": sum(p.advertiser.published for p in survivors),
                "failed": sum(p.advertiser.failures for p in survivors),
            },
            "after_kill": {"lookups": after_lookups, "queries": after_queries},
            "join": join,
            "faults": {"fired": faults.fired, "events": faults.events},
        }
        result["checks"] = _checks(config, result)
        result["passed"] = all(c["ok"] for c in result["checks"])
    finally:
        with _signals_deferred(), phases("cleanup", "stopping every DHT and the bootstrap node"):
            for peer in peers:
                peer.finish_crash()  # first: a heartbeat stuck on a frozen victim would hold up its close
            for peer in peers:
                peer.close()
            if bootstrap is not None:
                bootstrap.stop()
            shutil.rmtree(work, ignore_errors=True)
    return {**result, "phases_s": phases.seconds, "seconds": time.monotonic() - started}


class _Phases:
    """Times each phase of the run (seconds by name) and shows it as a rich status."""

    def __init__(self, console: Console):
        self.console, self.seconds = console, {}

    @contextlib.contextmanager
    def __call__(self, name: str, text: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            with self.console.status(text):
                yield
        finally:
            self.seconds[name] = time.monotonic() - started


def _start_swarm(config: DHTChurnConfig, bootstrap: _Bootstrap, peers: list[_Peer]) -> dict[str, Any]:
    """Start the peers (appended to ``peers`` as they come up) and wait until one query sees every record."""
    started = time.monotonic()
    for i in range(config.peers):
        peers.append(_start_peer(f"peer{i}", bootstrap.maddrs, config))
    peers_start_s = time.monotonic() - started
    expected = {p.peer_id for p in peers}
    reader = peers[len(peers) // 2]
    all_visible_s = _wait_for(
        lambda: expected <= (_seen(reader, config.lookup_timeout_s) or set()),
        config.phase_timeout_s,
        f"every one of {config.peers} records visible",
    )
    return {
        "bootstrap_start_s": bootstrap.start_s,
        "peers_start_s": peers_start_s,
        "all_visible_s": all_visible_s,
        "bootstrap_peer_id": bootstrap.peer_id,
    }


def _kill_peers(victims: list[_Peer], config: DHTChurnConfig, faults: FaultLog) -> dict[str, Any]:
    """Crash every victim at once: its advertiser stops (no withdrawal), its DHT process and p2pd die."""
    trees = {v.name: process_tree(v.dht.pid) for v in victims}
    described = {name: _describe(tree) for name, tree in trees.items()}
    for victim in victims:
        victim.advertiser.close(withdraw=False)
    signal_name = "SIGKILL" if config.death == "kill" else "SIGSTOP"
    for victim in victims:
        _crash(trees[victim.name], config.death)
        victim.crash_procs = trees[victim.name]
        faults.record(target=victim.name, phase="peer_crash", signal_name=signal_name, procs=described[victim.name])
    procs = [p for tree in trees.values() for p in tree]
    landed_s = _wait_for(
        lambda: _fault_landed(procs, config.death),
        config.phase_timeout_s,
        f"every victim process {'gone' if config.death == 'kill' else 'stopped'}",
    )
    if config.death == "kill":
        for victim in victims:
            victim.dht.join(timeout=1.0)  # reap the forked DHT process (its p2pd, orphaned, goes to init)
    return {
        "victims": [v.name for v in victims],
        "victim_peer_ids": [v.peer_id for v in victims],
        "death": config.death,
        "processes": len(procs),
        "p2pd": sum(d["name"] == "p2pd" for ds in described.values() for d in ds),
        "landed_s": landed_s,
        "all_landed": _fault_landed(procs, config.death),
    }


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.NoSuchProcess:
        return "?"


def _bootstrap_loss(
    config: DHTChurnConfig,
    bootstrap: _Bootstrap,
    live: list[_Peer],
    peers: list[_Peer],
    stored: dict[str, str],
    faults: FaultLog,
    rng: random.Random,
    observe: Observer,
) -> dict[str, Any]:
    """SIGKILL the bootstrap node's whole tree, then join a new peer through one live peer's addresses."""
    tree = process_tree(bootstrap.proc.pid)
    described = _describe(tree)
    _signal_tree(tree, signal.SIGKILL)
    faults.record(target="bootstrap", phase="bootstrap_crash", signal_name="SIGKILL", procs=described)
    bootstrap.proc.wait(timeout=config.phase_timeout_s)
    gone_s = _wait_for(lambda: all(_is_gone(p) for p in tree), config.phase_timeout_s, "bootstrap node gone")

    via = rng.choice(live)
    initial_peers = visible_maddrs(via.dht)
    bootstrap_alive = [p.pid for p in tree if not _is_gone(p)]
    result: dict[str, Any] = {
        "bootstrap_processes": len(tree),
        "bootstrap_gone_s": gone_s,
        "bootstrap_alive_at_join": bootstrap_alive,
        "via": via.name,
        "via_peer_id": via.peer_id,
        "initial_peers": initial_peers,
        "initial_peers_name_bootstrap": any(bootstrap.peer_id in m for m in initial_peers),
    }
    observe(
        "joining",
        {
            "events": list(faults.events),
            "bootstrap_peer_id": bootstrap.peer_id,
            "via_peer_id": via.peer_id,
            "initial_peers": list(initial_peers),
        },
    )
    started = time.monotonic()
    try:
        joiner = _start_peer("joiner", initial_peers, config)
    except DHTStartError as e:
        return {**result, "joined": False, "error": str(e), "join_s": time.monotonic() - started}
    peers.append(joiner)  # stopped with the others
    result.update(
        joined=True,
        join_s=time.monotonic() - started,
        joiner_peer_id=joiner.peer_id,
        record_published=joiner.advertiser.published > 0,
    )
    return {**result, **_joiner_figures(joiner, live, stored, config, rng)}


def _joiner_figures(
    joiner: _Peer, live: list[_Peer], stored: dict[str, str], config: DHTChurnConfig, rng: random.Random
) -> dict[str, Any]:
    """Right after the join: do live peers see its record, does it see theirs, can it read every key."""
    joined_at = time.monotonic()
    # seconds from the join until each checker's query shows the joiner's record (the checkers poll in turn)
    checkers = rng.sample(live, min(_NUM_CHECKERS, len(live)))
    since_join, queries_needed = [], []
    for checker in checkers:
        count = [0]

        def sees_joiner(c: _Peer = checker, count: list[int] = count) -> bool:
            count[0] += 1
            return joiner.peer_id in (_seen(c, config.lookup_timeout_s) or set())

        seen = _bounded_wait(sees_joiner, max(0.0, joined_at + config.phase_timeout_s - time.monotonic()))
        since_join.append(None if seen is None else time.monotonic() - joined_at)
        queries_needed.append(count[0] if seen is not None else None)
    expected = {p.peer_id for p in live}
    queried_at = time.monotonic()
    first = _seen(joiner, config.lookup_timeout_s) or set()
    sees_all = (
        expected <= first
        or _bounded_wait(lambda: expected <= (_seen(joiner, config.lookup_timeout_s) or set()), config.phase_timeout_s)
        is not None
    )
    sees_all_s = time.monotonic() - queried_at if sees_all else None
    reads = _lookups(
        [(joiner, k) for k in sorted(stored)], stored, parallel=config.parallel, timeout_s=config.lookup_timeout_s
    )
    return {
        "checkers": [c.name for c in checkers],
        "checkers_seeing_joiner": sum(s is not None for s in since_join),
        "checker_queries_needed": queries_needed,
        "visible_to_checkers_s": None if None in since_join else max(since_join),
        "first_query_completeness": len(first & expected) / len(expected),
        "sees_all_live_s": sees_all_s,
        "reads": reads,
    }


def _bounded_wait(predicate: Callable[[], Any], timeout_s: float) -> float | None:
    """Seconds until ``predicate`` holds, or None if it did not within ``timeout_s``."""
    try:
        return _wait_for(predicate, timeout_s, "condition")
    except BenchmarkFailed:
        return None


def _checks(config: DHTChurnConfig, result: dict[str, Any]) -> list[dict[str, Any]]:
    rate = config.min_rate
    after, join, kill = result["after_kill"], result["join"], result["kill"]
    reads = join.get("reads") or {}
    checks = [
        ("keys stored before the fault", result["keys_stored"], config.keys, result["keys_stored"] == config.keys),
        (
            "victims crashed (fault fired)",
            f"{result['faults']['fired'].get('peer_crash', 0)}/{result['victims']}",
            f"{result['victims']}/{result['victims']}, each with its p2pd, all {'gone' if config.death == 'kill' else 'stopped'}",
            result["faults"]["fired"].get("peer_crash") == result["victims"] == kill["p2pd"] and kill["all_landed"],
        ),
        (
            "lookup success after the kill",
            after["lookups"]["success_rate"],
            rate,
            after["lookups"]["success_rate"] >= rate,
        ),
        (
            "capability completeness after the kill",
            after["queries"]["completeness"],
            rate,
            after["queries"]["completeness"] >= rate,
        ),
        (
            "bootstrap dead when the joiner starts",
            not join["bootstrap_alive_at_join"],
            True,
            result["faults"]["fired"].get("bootstrap_crash") == 1 and not join["bootstrap_alive_at_join"],
        ),
        (
            "joiner's initial peers: one live peer only",
            join["via"],
            "not the bootstrap",
            bool(join["initial_peers"]) and not join["initial_peers_name_bootstrap"],
        ),
        ("joined through a live peer", join["joined"], True, join["joined"]),
        ("joiner reads the stored keys", reads.get("success_rate", 0.0), rate, reads.get("success_rate", 0.0) >= rate),
        (
            "joiner's query sees every live peer (s)",
            join.get("sees_all_live_s"),
            f"<= {config.phase_timeout_s:g}",
            join.get("sees_all_live_s") is not None,
        ),
        (
            "live peers see the joiner's record (s)",
            join.get("visible_to_checkers_s"),
            f"<= {config.phase_timeout_s:g}",
            join.get("visible_to_checkers_s") is not None,
        ),
    ]
    return [{"check": name, "value": value, "target": target, "ok": bool(ok)} for name, value, target, ok in checks]


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Ignore SIGINT/SIGTERM during clean-up (main thread only), so a second Ctrl+C cannot cut it short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ------------------------------------------------------------------------------------ CLI
def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return "-" if value is None else str(value)


def print_table(result: dict[str, Any], console: Console) -> None:
    cfg = result["config"]
    table = Table(
        title=f"DHT churn on loopback: {result['peers']} peers, {result['victims']} crashed "
        f"({cfg['death']}), then the bootstrap node (seed {cfg['seed']})"
    )
    for column, justify in (("figure", "left"), ("value", "right"), ("target", "right"), ("ok", "center")):
        table.add_column(column, justify=justify)
    setup, after, join = result["setup"], result["after_kill"], result["join"]
    rows = [
        ("bootstrap node start (s)", setup["bootstrap_start_s"]),
        ("peers start (s)", setup["peers_start_s"]),
        ("all records visible (s)", setup["all_visible_s"]),
    ]
    if result["baseline"]:
        rows.append(("before the kill: lookup success", result["baseline"]["success_rate"]))
        rows.append(
            (
                "before the kill: lookup s median / max",
                f"{_fmt(result['baseline']['seconds_median'])} / {_fmt(result['baseline']['seconds_max'])}",
            )
        )
    rows += [
        ("after the kill: lookups", after["lookups"]["lookups"]),
        (
            "after the kill: lookup s median / p95 / max",
            " / ".join(_fmt(after["lookups"][k]) for k in ("seconds_median", "seconds_p95", "seconds_max")),
        ),
        ("after the kill: queries (failed)", f"{after['queries']['queries']} ({after['queries']['failed_queries']})"),
        ("after the kill: query completeness min", after["queries"]["completeness_min"]),
        (
            "record heartbeats of live peers: published / failed",
            f"{result['heartbeats']['published']} / {result['heartbeats']['failed']}",
        ),
        ("bootstrap node gone (s)", join["bootstrap_gone_s"]),
        ("joined via", join["via"]),
        ("join: DHT up and connected (s)", join.get("join_s")),
        ("joiner's first query completeness", join.get("first_query_completeness")),
        (
            "live peers seeing the joiner (queries each needed)",
            f"{join.get('checkers_seeing_joiner', 0)}/{len(join.get('checkers', []))} "
            f"({', '.join(_fmt(n) for n in join.get('checker_queries_needed', []))})",
        ),
    ]
    for name, value in rows:
        table.add_row(name, _fmt(value), "", "")
    table.add_row("seconds per phase", "\n".join(f"{k} {v:.1f}" for k, v in result["phases_s"].items()), "", "")
    for check in result["checks"]:
        table.add_row(
            check["check"],
            _fmt(check["value"]),
            _fmt(check["target"]),
            "[green]yes[/]" if check["ok"] else "[bold red]NO[/]",
        )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dht_churn", description=__doc__.splitlines()[0])
    add_dataclass_arguments(parser, DHTChurnConfig)
    parser.add_argument("--out", default=str(RESULTS), help="JSON output path (default: %(default)s)")
    args = parser.parse_args(argv)
    console = Console()
    try:
        config = dataclass_from_args(DHTChurnConfig, args)
    except ValueError as e:
        console.print(f"[bold red]error:[/] {e}")
        return 2
    main_pid = os.getpid()

    def on_sigterm(signum: int, _frame: object) -> None:
        if os.getpid() != main_pid:  # a forked DHT process inherited this handler: die as if it had none
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        sys.exit(143)  # unwind: every DHT, p2pd and the bootstrap node stop

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        result = {**run_metadata("dht_churn", argv), "config": asdict(config), **run(config, console)}
    except BenchmarkFailed as e:
        console.print(f"[bold red]failed (seed {config.seed}):[/] {e}")
        return 1
    except KeyboardInterrupt:
        console.print("interrupted; every DHT, p2pd and the bootstrap node are stopped")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_table(result, console)
    out = save_result(args.out, result)
    console.print(f"wrote {out}; {result['seconds']:.1f} s")
    if not result["passed"]:
        console.print(f"[bold red]a check failed[/] (seed {config.seed}; rerun with --seed {config.seed})")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
