"""Chaos run: a swarm trains charlm on the test hosts while peers are SIGKILLed and restarted, a host
is cut off, a host is slow and the bootstrap node dies; then every check of TESTMATRIX rows 5, 6, 7, 8,
17, 18 and 20 is made on what the processes left behind.

    python -m benchmarks.chaos --duration 600 --peers 6 [--seed N] [--baseline-s S] [--lab auto]

Two arms on fresh labs, one after the other: a no-chaos run of ``--baseline-s`` seconds (default: as
long as the chaos run; 0 skips it), then the chaos run of ``--duration`` seconds. Both start their
clock when every peer has taken its first training step. Each peer runs ``swarm.peer`` on its own
lab host (a network namespace with a 100 Mbit/s link; loopback when the machine has none, and then
the partition and the slow host are skipped and say so). Faults of the chaos arm, drawn from
``--seed``:

* every ~``--kill-every-s`` (uniform 0.75-1.25x) a random joined peer's main process is SIGKILLed,
  as in a crash; once its children (DHT process, p2pd) are gone it is restarted on the same host
  with the same identity, so it resumes its ledger and checkpoint store and must sync the run's state;
* at 25% of the run one host's link goes down for ``--partition-s`` seconds, then comes back (that
  peer is spared from kills until it is in a group again);
* one other host is shaped to ``--slow-mbit`` for the whole run;
* at 50% the bootstrap node is SIGKILLed; restarted peers then join through live peers' addresses;
* at 75% ``--joiners`` new peers (default 3) start at once on hosts of their own and must sync the
  run's verified state from the training peers.

Checks (printed as a table, written to JSON; the exit code is 1 when one fails):
progress (steps/min against the no-chaos arm), validation loss fell, every checkpoint in every
peer's store verifies (signatures, quorum, shard hashes), every ledger verifies, no orphaned process
(a killed peer's children exit within 5 s; SIGTERM at the end stops every peer with
exit code 0), RSS growth per peer, rounds completed / attempted, rounds to re-merge after the
partition (counting the cut-off peer's rounds that began after the heal), restarts that joined after the
bootstrap died, the joiners' verified state and download time against its floor (bytes / link rate), and
the slow host's round time.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from benchmarks._common import make_lab, process_tree, run_metadata, save_result, signals_unwind, start_bootstrap_node
from swarm.events import read_events

RESULTS = Path(__file__).parent / "results" / "chaos.json"
_DOWNLOADED = re.compile(r"downloaded (\d+) bytes of checkpoint shards from (\d+) donor\(s\) in ([\d.]+)s")
_POLL_S = 0.2
_RSS_EVERY_S = 5.0
_TRAIN_EVENT_STEPS = 10  # swarm.peer writes a "train" event every 10 local steps
_BASE_PORT = 40000
_STOP_GRACE_S = 40.0
_SETTLE_S = 30.0  # a restart that lived this long must have joined (they join in 4-15 s here)


@dataclass(frozen=True, kw_only=True, slots=True)
class ChaosConfig:
    """The chaos run's shape, faults and pass thresholds."""

    duration_s: float = 600.0
    """Length of the chaos arm, from every peer's first training step."""
    peers: int = 6
    """Training peers, each on its own lab host (the bootstrap node gets one more)."""
    seed: int = 0
    """Seed of every random choice (kill times and victims, partitioned and slow hosts)."""
    baseline_s: float = -1.0
    """Length of the no-chaos arm (negative: as long as the chaos arm; 0: no baseline, no progress ratio)."""
    kill_every_s: float = 20.0
    """Mean seconds between SIGKILLs (each drawn uniformly in 0.75-1.25x this)."""
    joiners: int = 3
    """Peers that join at once at 75% of the chaos arm (TESTMATRIX row 8), each on a host of its own."""
    partition_s: float = 30.0
    """How long one host's link is down (0: no partition)."""
    slow_mbit: float = 10.0
    """Link rate of the slow host (0: none)."""
    rate_mbit: float = 100.0
    """Link rate of every other host."""
    lab: str = "auto"
    """auto (network namespaces, else loopback), netns or loopback."""
    preset: str = "tiny"
    """charlm size preset."""
    sync_every: int = 20
    """Local steps between averaging rounds."""
    overlap: bool = False
    """Overlapped rounds (swarm.peer --overlap): a round runs while the peer trains on."""
    matchmaking_time_s: float = 2.0
    sender_timeout_s: float = 5.0
    averaging_timeout_s: float = 30.0
    """The peers' round deadline (their default): how long a round a fault lands in can stall training."""
    eval_batches: int = 4
    """Validation batches per evaluation."""
    min_progress_ratio: float = 0.5
    """Chaos steps/min must be at least this fraction of the no-chaos arm's."""
    min_round_ratio: float = 0.5
    """Grouped rounds / attempted rounds of the chaos arm must be at least this."""
    max_remerge_rounds: int = 2
    """The partitioned peer must be in a group again within this many rounds after the heal."""
    max_vanish_s: float = 5.0
    """A SIGKILLed peer's children (DHT process, p2pd) must exit within this."""
    max_rss_growth_mib: float = 150.0
    """RSS growth allowed per peer process tree (from 60 s after its start to its end; peers that lived
    at least 150 s)."""
    startup_timeout_s: float = 240.0
    """Bound of the start-up (every peer's first step) and of each peer's stop."""
    keep_logs: bool = False
    """Keep logs, events, ledgers and checkpoints (always kept when a check fails)."""

    def __post_init__(self) -> None:
        if self.peers < 3:
            raise ValueError(f"peers must be >= 3, got {self.peers!r}")
        if self.lab not in ("auto", "netns", "loopback"):
            raise ValueError(f"lab must be auto, netns or loopback, got {self.lab!r}")
        for name in (
            "duration_s",
            "kill_every_s",
            "startup_timeout_s",
            "max_vanish_s",
            "matchmaking_time_s",
            "sender_timeout_s",
            "averaging_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("partition_s", "slow_mbit", "rate_mbit", "min_progress_ratio", "min_round_ratio"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.joiners < 0:
            raise ValueError(f"joiners must be >= 0, got {self.joiners!r}")
        if self.sync_every < 1 or self.eval_batches < 1 or self.max_remerge_rounds < 1:
            raise ValueError("sync_every, eval_batches and max_remerge_rounds must be >= 1")
        if self.partition_s and self.partition_s >= 0.5 * self.duration_s:
            raise ValueError(f"partition_s ({self.partition_s}) must be under half of duration_s ({self.duration_s})")

    @property
    def slots(self) -> int:
        """Peer hosts: the starting peers, then the joiners' (the bootstrap node's host comes after them)."""
        return self.peers + self.joiners

    @property
    def baseline_seconds(self) -> float:
        return self.duration_s if self.baseline_s < 0 else self.baseline_s


class ChaosFailed(RuntimeError):
    """The swarm could not even be started or stopped as the run needs (the message says where the logs are)."""


@dataclass(slots=True)
class _Incarnation:
    """One process of a peer slot (a slot is a lab host; a restart is a new incarnation on it)."""

    slot: int
    number: int
    proc: Any
    started: float
    events: Path
    log: Path
    port: int
    initial_peers: list[str]
    killed_at: float | None = None
    stopped: dict[str, Any] | None = None
    rss: list[tuple[float, int]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"peer{self.slot}.{self.number}"

    def read(self) -> list[dict[str, Any]]:
        return read_events(self.events)

    def first(self, event: str) -> dict[str, Any] | None:
        return next((e for e in self.read() if e["event"] == event), None)

    @property
    def alive(self) -> bool:
        return self.killed_at is None and self.stopped is None


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    live = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                live.append(proc)
        except psutil.Error:
            pass
    return live


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> tuple[float, list[psutil.Process]]:
    """Seconds until every process of ``procs`` exited (polled), and those still running at the deadline."""
    started = time.monotonic()
    while (live := _running(procs)) and time.monotonic() - started < timeout_s:
        time.sleep(0.05)
    return time.monotonic() - started, live


def _rss_bytes(pid: int) -> int | None:
    total = 0
    for proc in process_tree(pid):
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total or None


class _Arm:
    """One swarm on one lab: the bootstrap node, the peer slots and their incarnations, the faults."""

    def __init__(self, config: ChaosConfig, *, lab: Any, work: Path, run: str, chaos: bool, console: Console):
        self.config, self.lab, self.work, self.run, self.chaos, self.console = (config, lab, work, run, chaos, console)
        self.rng = random.Random(config.seed)
        self.bootstrap: Any = None
        self.bootstrap_maddrs: list[str] = []
        self.incarnations: list[_Incarnation] = []
        self.kills: list[dict[str, Any]] = []
        self.orphans: list[str] = []
        self.timeline: list[dict[str, Any]] = []
        self.partition: dict[str, Any] | None = None
        self.slow_slot: int | None = None
        self.bootstrap_killed_at: float | None = None
        self.joined_at: float | None = None
        self.exits: list[dict[str, Any]] = []
        self.t0 = self.t_end = 0.0

    # ---- processes ----------------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        return {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "COLUMNS": "400"}

    def note(self, what: str, **fields: Any) -> None:
        self.timeline.append({"t": time.time(), "what": what, **fields})
        offset = f"{time.time() - self.t0:6.1f}s" if self.t0 else "  start"
        self.console.print(f"  [dim]{offset}[/] {what} {' '.join(f'{k}={v}' for k, v in fields.items())}")

    def start_bootstrap(self) -> None:
        self.bootstrap, maddrs = start_bootstrap_node(
            self.lab,
            self.config.slots,
            work=self.work,
            port=_BASE_PORT,
            env=self._env(),
            timeout_s=self.config.startup_timeout_s,
        )
        if maddrs is None:
            raise ChaosFailed(f"the bootstrap node printed no --initial-peers line; see {self.work / 'bootstrap.log'}")
        self.bootstrap_maddrs = maddrs

    def spawn(self, slot: int) -> _Incarnation:
        cfg = self.config
        number = sum(i.slot == slot for i in self.incarnations)
        name = f"peer{slot}.{number}"
        port = _BASE_PORT + 1 + number  # a fresh port: the killed incarnation's p2pd may still hold the old one
        initial = self._initial_peers(exclude=slot)
        argv = [
            sys.executable,
            "-m",
            "swarm.peer",
            "--initial-peers",
            *initial,
            "--run",
            self.run,
            "--task",
            "charlm",
            "--task-preset",
            cfg.preset,
            "--host-maddrs",
            self.lab.hosts[slot].maddr(port),
            "--shard-index",
            str(slot),
            "--num-shards",
            str(cfg.slots),
            "--seed",
            "0",
            "--sync-every",
            str(cfg.sync_every),
            "--target-group-size",
            str(cfg.peers),
            "--sender-timeout-s",
            str(cfg.sender_timeout_s),
            "--matchmaking-time-s",
            str(cfg.matchmaking_time_s),
            "--round-timeout-s",
            str(cfg.averaging_timeout_s),
            "--identity-key",
            str(self.work / f"peer{slot}.key"),
            "--events",
            str(self.work / f"{name}.jsonl"),
            "--torch-threads",
            "1",
            "--no-progress",
            "--eval-batches",
            str(cfg.eval_batches),
            "--eval-every",
            "1",  # each slot's last validation loss is its last round's (the "validation loss fell" check)
            "--checkpoint-dir",
            str(self.work / "checkpoints"),
            "--ledger-dir",
            str(self.work / "ledgers"),
            *(["--overlap"] if cfg.overlap else []),
        ]
        log = self.work / f"{name}.log"
        incarnation = _Incarnation(
            slot=slot,
            number=number,
            proc=None,
            started=time.time(),
            events=self.work / f"{name}.jsonl",
            log=log,
            port=port,
            initial_peers=initial,
        )
        incarnation.proc = self.lab.spawn(slot, argv, log=log, env=self._env())
        self.incarnations.append(incarnation)
        return incarnation

    def _initial_peers(self, *, exclude: int) -> list[str]:
        """The bootstrap node while it lives, and up to three live, joined peers' addresses (as a user
        would list several): a peer starting just before the bootstrap node dies must still get in."""
        cut = self.partition["slot"] if self.partition and not self.partition.get("healed_at") else None
        candidates = [i for i in self.live() if i.slot not in (exclude, cut)]
        self.rng.shuffle(candidates)
        maddrs = [] if self.bootstrap_killed_at is not None else list(self.bootstrap_maddrs)
        joined = [(inc, event) for inc in candidates if (event := inc.first("joined")) and event.get("peer_id")]
        for inc, event in joined[:3]:
            maddrs.append(f"{self.lab.hosts[inc.slot].maddr(inc.port)}/p2p/{event['peer_id']}")
        # nobody joined to point at (cannot happen with 3+ peers unless all restart at once): the dead
        # bootstrap node's address makes the peer exit, which the run reports as a failure
        return maddrs or list(self.bootstrap_maddrs)

    def live(self) -> list[_Incarnation]:
        return [i for i in self.incarnations if i.alive]

    def check_alive(self) -> None:
        for inc in self.live():
            if inc.proc.poll() is not None:
                raise ChaosFailed(f"{inc.name} exited on its own (code {inc.proc.poll()}); see {inc.log}")

    def restart_exited(self) -> None:
        """A peer that exited on its own during the run is a failure to report (with its log's last line),
        not a reason to stop the run: note it and start it again, as its owner would."""
        for inc in self.live():
            if (code := inc.proc.poll()) is not None:
                inc.killed_at = time.time()
                lines = inc.log.read_text(errors="replace").strip().splitlines() if inc.log.exists() else []
                self.exits.append(
                    {
                        "peer": inc.name,
                        "t": inc.killed_at - self.t0,
                        "exit_code": code,
                        "last_line": " ".join(lines[-1].split())[:300] if lines else "",
                    }
                )
                self.note("exited on its own", peer=inc.name, code=code, restarted=self.spawn(inc.slot).name)

    def start(self) -> None:
        self.start_bootstrap()
        for slot in range(self.config.peers):
            self.spawn(slot)
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not all(i.first("first_step") for i in self.live()):
            self.check_alive()
            if time.monotonic() > deadline:
                raise ChaosFailed(
                    f"not every peer took a first step within {self.config.startup_timeout_s:.0f}s; see {self.work}"
                )
            time.sleep(_POLL_S)
        self.t0 = time.time()

    # ---- faults -------------------------------------------------------------------------------------

    def kill(self, victim: _Incarnation) -> None:
        """SIGKILL the victim's main process, time its children's exit, restart it on its host."""
        tree = process_tree(victim.proc.pid)
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.killed_at = time.time()
        victim.proc.wait(timeout=10)
        vanish_s, left = _wait_gone(tree, timeout_s=2 * self.config.max_vanish_s)
        self._record_orphans(victim.name, left)
        replacement = self.spawn(victim.slot)
        self.kills.append(
            {
                "victim": victim.name,
                "t": victim.killed_at - self.t0,
                "lived_s": victim.killed_at - victim.started,
                "children": len(tree) - 1,
                "vanish_s": vanish_s,
                "orphans": len(left),
                "replacement": replacement.name,
                "via": "bootstrap + peers" if self.bootstrap_killed_at is None else "live peers",
            }
        )
        self.note("SIGKILL", victim=victim.name, children_gone_s=f"{vanish_s:.2f}", restarted=replacement.name)

    def _record_orphans(self, owner: str, left: list[psutil.Process]) -> None:
        for proc in left:
            try:
                self.orphans.append(f"{owner}: pid {proc.pid} {proc.name()}")
                proc.kill()
            except psutil.Error:
                pass

    def kill_bootstrap(self) -> None:
        tree = process_tree(self.bootstrap.pid)
        os.kill(self.bootstrap.pid, signal.SIGKILL)
        self.bootstrap_killed_at = time.time()
        self.bootstrap.wait(timeout=10)
        vanish_s, left = _wait_gone(tree, timeout_s=2 * self.config.max_vanish_s)
        self._record_orphans("bootstrap", left)
        self.kills.append(
            {
                "victim": "bootstrap",
                "t": self.bootstrap_killed_at - self.t0,
                "children": len(tree) - 1,
                "vanish_s": vanish_s,
                "orphans": len(left),
            }
        )
        self.note("SIGKILL bootstrap node", children_gone_s=f"{vanish_s:.2f}")

    def victims(self) -> list[_Incarnation]:
        spared = self.partition["slot"] if self.partition and not self.partition.get("remerged") else None
        return [i for i in self.live() if i.slot != spared and i.first("joined")]

    def _remerged(self) -> bool:
        part = self.partition
        inc = next((i for i in self.live() if i.slot == part["slot"]), None)
        return inc is not None and any(
            e["event"] == "round" and _began_after(e, part["healed_at"]) and (e.get("group_size") or 0) >= 2
            for e in inc.read()
        )

    def drive(self) -> None:
        """The chaos arm's schedule (or, without chaos, just the clock), sampling RSS on the way."""
        cfg, duration = self.config, self.config.duration_s if self.chaos else self.config.baseline_seconds
        self.t_end = self.t0 + duration
        next_kill = self.t0 + cfg.kill_every_s * self.rng.uniform(0.75, 1.25)
        netns = self.lab.kind == "netns"
        part_at = self.t0 + 0.25 * duration if self.chaos and netns and cfg.partition_s else math.inf
        boot_at = self.t0 + 0.5 * duration if self.chaos else math.inf
        join_at = self.t0 + 0.75 * duration if self.chaos and cfg.joiners else math.inf
        if self.chaos and netns and cfg.slow_mbit:
            self.slow_slot = self.rng.randrange(cfg.peers)
            self.lab.set_rate(self.slow_slot, cfg.slow_mbit)
            self.note("slow host", slot=self.slow_slot, mbit=cfg.slow_mbit)
        next_rss = 0.0
        while (now := time.time()) < self.t_end:
            self.restart_exited()
            if now >= next_rss:
                for inc in self.live():
                    if (rss := _rss_bytes(inc.proc.pid)) is not None:
                        inc.rss.append((now, rss))
                next_rss = now + _RSS_EVERY_S
            if now >= part_at:
                part_at = math.inf
                # a joined peer: one still starting would only fail to reach its initial peers and exit
                joined = sorted({i.slot for i in self.victims() if i.slot < cfg.peers and i.slot != self.slow_slot})
                slot = self.rng.choice(joined or [s for s in range(cfg.peers) if s != self.slow_slot])
                self.lab.set_link(slot, False)
                self.partition = {"slot": slot, "cut_at": now, "heal_at": now + cfg.partition_s}
                self.note("partition: link down", slot=slot)
            part = self.partition
            if part and "healed_at" not in part and now >= part["heal_at"]:
                self.lab.set_link(part["slot"], True)
                part["healed_at"] = time.time()
                self.note("partition: link up", slot=part["slot"])
            if part and part.get("healed_at") and not part.get("remerged") and self._remerged():
                part["remerged"] = True
                self.note("partition: re-merged", slot=part["slot"])
            if now >= boot_at:
                boot_at = math.inf
                self.kill_bootstrap()
            if now >= join_at:
                join_at = math.inf
                self.joined_at = time.time()
                names = [self.spawn(slot).name for slot in range(cfg.peers, cfg.slots)]
                self.note("joiners started at once", peers=",".join(names))
            if self.chaos and now >= next_kill and now < self.t_end - 15:
                candidates = self.victims()
                if candidates:
                    self.kill(self.rng.choice(candidates))
                    next_kill = time.time() + cfg.kill_every_s * self.rng.uniform(0.75, 1.25)
                else:
                    next_kill = now + 1.0
            time.sleep(_POLL_S)

    def stop(self) -> None:
        """SIGTERM every live peer's main process (as `kill PID` would), then the bootstrap node."""
        if self.partition and "healed_at" not in self.partition:
            self.lab.set_link(self.partition["slot"], True)
            self.partition["healed_at"] = time.time()
        live = self.live()
        trees = {inc.name: process_tree(inc.proc.pid) for inc in live}
        # a peer signalled while Python is still importing has started nothing yet; the signal's default
        # action ends it (exit code -SIGTERM), which leaves nothing behind either
        importing = {inc.name for inc in live if len(trees[inc.name]) <= 1 and not inc.first("start")}
        started = time.monotonic()
        for inc in live:
            inc.proc.send_signal(signal.SIGTERM)
        for inc in live:
            try:
                code = inc.proc.wait(timeout=max(1.0, _STOP_GRACE_S - (time.monotonic() - started)))
            except Exception:
                code = None
            clean = code == 0 or (code == -signal.SIGTERM and inc.name in importing)
            inc.stopped = {"exit_code": code, "clean": clean, "seconds": time.monotonic() - started}
            vanish_s, left = _wait_gone(trees[inc.name], timeout_s=self.config.max_vanish_s)
            inc.stopped["children_gone_s"] = vanish_s
            self._record_orphans(inc.name, left)
        if self.bootstrap is not None and self.bootstrap.poll() is None:
            tree = process_tree(self.bootstrap.pid)
            self.bootstrap.send_signal(signal.SIGTERM)
            try:
                self.bootstrap.wait(timeout=_STOP_GRACE_S)
            except Exception:
                pass
            self._record_orphans("bootstrap", _wait_gone(tree, timeout_s=self.config.max_vanish_s)[1])


# ---- analysis ---------------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _rounds(inc: _Incarnation, *, start: float, end: float) -> list[dict[str, Any]]:
    return [e for e in inc.read() if e["event"] == "round" and start <= e["t"] <= end]


def progress(arm: _Arm) -> dict[str, Any]:
    """Steps trained in the arm's window, and the validation loss at its start and end."""
    steps = sum(
        _TRAIN_EVENT_STEPS * sum(1 for e in inc.read() if e["event"] == "train" and arm.t0 <= e["t"] <= arm.t_end)
        for inc in arm.incarnations
    )
    minutes = (arm.t_end - arm.t0) / 60
    genesis = [inc.first("val") for inc in arm.incarnations if inc.number == 0 and inc.slot < arm.config.peers]
    initial = [v["val_loss"] for v in genesis if v and _finite(v.get("val_loss"))]
    final = []
    for slot in range(arm.config.slots):
        last = [
            e["val_loss"]
            for inc in arm.incarnations
            if inc.slot == slot
            for e in _rounds(inc, start=arm.t0, end=arm.t_end)
            if _finite(e.get("val_loss"))
        ]
        if last:
            final.append(last[-1])
    return {
        "steps": steps,
        "steps_per_min": steps / minutes,
        "val_loss_initial": _median(initial),
        "val_loss_final": _median(final),
        "val_loss_final_per_slot": final,
    }


def rounds_summary(arm: _Arm) -> dict[str, Any]:
    every = [e for inc in arm.incarnations for e in _rounds(inc, start=arm.t0, end=arm.t_end)]
    grouped = [e for e in every if (e.get("group_size") or 0) >= 2]
    return {
        "attempted": len(every),
        "grouped": len(grouped),
        "ratio": len(grouped) / len(every) if every else 0.0,
        "median_group_size": _median([e["group_size"] for e in grouped]),
        "median_round_s": _median([e["duration_s"] for e in grouped]),
        "max_round_s": max((e["duration_s"] for e in grouped), default=None),
        "failures_by_reason": failure_reasons(every),
    }


def failure_reasons(rounds: list[dict[str, Any]], most: int = 12) -> dict[str, int]:
    """How often each (phase: reason) appears in the rounds' records, the ``most`` commonest; a reason's
    free-form tail (from a "(" or "[" on, and past 70 characters) is cut so that alike failures count together."""
    counts: Counter = Counter()
    for event in rounds:
        record = event.get("record")
        for failure in record.get("failures", []) if isinstance(record, dict) else []:
            if isinstance(failure, dict):
                reason = re.split(r"[(\[]", str(failure.get("reason", "")))[0].strip()[:70]
                counts[f"{failure.get('phase')}: {reason}"] += 1
    return dict(counts.most_common(most))


def _began_after(round_event: dict[str, Any], t: float) -> bool:
    """A round event (time-stamped at its end) began after ``t``: after a partition's heal, a round that began
    before it looked for its group before it could see the other side. The chaos arm spares the cut-off peer
    from kills until such a round grouped, the rule `partition_summary` counts re-merge rounds by (CI of stop
    57: a round in flight at the heal ended grouped, the peer was killed 4 s later, before one that began
    after the heal could, and the run had no re-merge to count)."""
    return round_event["t"] - (round_event.get("duration_s") or 0.0) > t


def partition_summary(arm: _Arm) -> dict[str, Any] | None:
    part = arm.partition
    if part is None:
        return None
    cut, healed = part["cut_at"], part.get("healed_at", arm.t_end)
    cut_off = [
        i for i in arm.incarnations if i.slot == part["slot"] and i.started < healed and (i.killed_at or math.inf) > cut
    ]
    isolated_steps = sum(
        _TRAIN_EVENT_STEPS for inc in cut_off for e in inc.read() if e["event"] == "train" and cut <= e["t"] <= healed
    )
    others = [
        e
        for inc in arm.incarnations
        if inc.slot != part["slot"]
        for e in _rounds(inc, start=cut, end=healed)
        if (e.get("group_size") or 0) >= 2
    ]
    # a round after the heal is one that began after it: the round in flight when the link comes back looked
    # for its group before it could see the other side (its end is what the event's time stamps)
    ended_after = sorted(
        (e for inc in cut_off for e in inc.read() if e["event"] == "round" and e["t"] > healed), key=lambda e: e["t"]
    )
    after = [e for e in ended_after if _began_after(e, healed)]

    def to_first_group(rounds: list[dict[str, Any]]) -> int | None:
        return next((k + 1 for k, e in enumerate(rounds) if (e.get("group_size") or 0) >= 2), None)

    count, count_ended = to_first_group(after), to_first_group(ended_after)
    return {
        "slot": part["slot"],
        "t": cut - arm.t0,
        "seconds": healed - cut,
        "isolated_side_steps": isolated_steps,
        "other_side_grouped_rounds": len(others),
        "rounds_to_remerge": count,
        "seconds_to_remerge": None if count is None else after[count - 1]["t"] - healed,
        "rounds_ended_after_heal_to_remerge": count_ended,
    }


def restarts_summary(arm: _Arm) -> dict[str, Any]:
    restarts = [i for i in arm.incarnations if i.number > 0]
    rows = []
    for inc in restarts:
        joined, first_step = inc.first("joined"), inc.first("first_step")
        grouped = next((e for e in inc.read() if e["event"] == "round" and (e.get("group_size") or 0) >= 2), None)
        # the slot trains nothing from its predecessor's kill (the restart is spawned then) to its first step
        began = min(first_step["t"], arm.t_end) if first_step else (inc.killed_at or arm.t_end)
        rows.append(
            {
                "name": inc.name,
                "after_bootstrap_loss": arm.bootstrap_killed_at is not None and inc.started > arm.bootstrap_killed_at,
                "joined": joined is not None,
                "state_verified": bool(joined and joined.get("state_verified")),
                "join_s": joined["t"] - inc.started if joined else None,
                "first_grouped_round_s": grouped["t"] - inc.started if grouped else None,
                "lived_s": (inc.killed_at or arm.t_end) - inc.started,
                "down_s": max(0.0, began - max(inc.started, arm.t0)),
            }
        )
    settled = [r for r in rows if r["lived_s"] >= _SETTLE_S]
    down_s = sum(r["down_s"] for r in rows)
    # a restart after the bootstrap node's death shows the join through live peers once it joined, however soon
    # it was killed after; one that did not join is judged only once it lived long enough to have joined (the
    # 80 s run of seed 8 restarted two after the death, both joined with verified state, and both were killed
    # within 30 s: judged on settled restarts alone, that was "0/0 joined", a failure)
    after_loss = [r for r in rows if r["after_bootstrap_loss"] and (r["joined"] or r["lived_s"] >= _SETTLE_S)]
    return {
        "restarts": len(rows),
        "settled": len(settled),
        "settled_joined": sum(r["joined"] for r in settled),
        "settled_state_verified": sum(r["state_verified"] for r in settled),
        "after_bootstrap_loss": len(after_loss),
        "after_bootstrap_loss_joined": sum(r["joined"] for r in after_loss),
        "after_bootstrap_loss_grouped": sum(r["first_grouped_round_s"] is not None for r in after_loss),
        "join_s_median": _median([r["join_s"] for r in rows if r["join_s"] is not None]),
        "join_s_max": max((r["join_s"] for r in rows if r["join_s"] is not None), default=None),
        "down_s": down_s,
        "down_fraction": down_s / max(arm.config.peers * (arm.t_end - arm.t0), 1e-9),
        "rows": rows,
    }


def joiners_summary(arm: _Arm) -> dict[str, Any] | None:
    """The peers that joined at once (row 8): time to join, the state download against its floor."""
    if arm.joined_at is None:
        return None
    rate = arm.lab.rate_mbit if arm.lab.kind == "netns" else None
    rows = []
    for inc in (i for i in arm.incarnations if i.number == 0 and i.slot >= arm.config.peers):
        joined = inc.first("joined")
        match = _DOWNLOADED.search(inc.log.read_text(errors="replace")) if inc.log.exists() else None
        size, donors, seconds = (int(match[1]), int(match[2]), float(match[3])) if match else (None, None, None)
        floor = size * 8 / (rate * 1e6) if size and rate else None
        rows.append(
            {
                "name": inc.name,
                "joined": joined is not None,
                "state_verified": bool(joined and joined.get("state_verified")),
                "join_s": joined["t"] - inc.started if joined else None,
                "state_bytes": size,
                "donors": donors,
                "download_s": seconds,
                "floor_s": floor,
                "download_x_floor": seconds / floor if seconds is not None and floor else None,
            }
        )
    return {
        "at_s": arm.joined_at - arm.t0,
        "joiners": len(rows),
        "verified": sum(r["state_verified"] for r in rows),
        "join_s_max": max((r["join_s"] for r in rows if r["join_s"] is not None), default=None),
        "download_x_floor_max": max((r["download_x_floor"] for r in rows if r["download_x_floor"]), default=None),
        "rows": rows,
    }


def rss_summary(arm: _Arm) -> dict[str, Any]:
    growth, series = {}, {}
    for inc in arm.incarnations:
        samples = [(t - inc.started, rss) for t, rss in inc.rss]
        if not samples or samples[-1][0] < 150:
            continue
        early = [rss for age, rss in samples if 60 <= age <= 75] or [samples[0][1]]
        late = [rss for _, rss in samples[-3:]]
        growth[inc.name] = (statistics.mean(late) - statistics.mean(early)) / 2**20
        every = -(-len(samples) // 60)  # at most 60 points (and the last): a step (a sync, a served state) or a slope
        picked = samples[::every] if (len(samples) - 1) % every == 0 else samples[::every] + samples[-1:]
        series[inc.name] = [[round(age, 1), round(rss / 2**20, 1)] for age, rss in picked]
    return {
        "peers_measured": len(growth),
        "growth_mib": growth,
        "series_mib": series,  # [age s, RSS MiB] of each measured peer
        "max_growth_mib": max(growth.values()) if growth else None,
        "median_rss_mib": _median([rss / 2**20 for inc in arm.incarnations for _, rss in inc.rss]),
    }


def slow_summary(arm: _Arm) -> dict[str, Any] | None:
    if arm.slow_slot is None:
        return None
    mine = [
        e for inc in arm.incarnations if inc.slot == arm.slow_slot for e in _rounds(inc, start=arm.t0, end=arm.t_end)
    ]
    others = [
        e for inc in arm.incarnations if inc.slot != arm.slow_slot for e in _rounds(inc, start=arm.t0, end=arm.t_end)
    ]
    return {
        "slot": arm.slow_slot,
        "mbit": arm.config.slow_mbit,
        "grouped_rounds": sum((e.get("group_size") or 0) >= 2 for e in mine),
        "median_round_s": _median([e["duration_s"] for e in mine]),
        "others_median_round_s": _median([e["duration_s"] for e in others]),
    }


def verify_checkpoints(root: Path, run: str) -> dict[str, Any]:
    """Every sealed manifest in every peer's store: signatures and quorum; and every shard the store
    holds re-hashed. A store also keeps manifests it learned by gossip from groups it was not in,
    without their shards (it fetches those only to resume from them): "manifest only", not a fault."""
    from swarm.checkpoint import CheckpointStore, SignedManifest
    from swarm.checkpoint.manifest import ManifestRejected, verify_manifest
    from swarm.checkpoint.store import ShardRejected

    total, complete, problems = 0, 0, []
    folders = sorted(p for p in (root / run).glob("*") if p.is_dir()) if (root / run).exists() else []
    for folder in folders:
        store = CheckpointStore(folder)
        for digest in store.list_manifests():
            total += 1
            try:
                manifest = verify_manifest(SignedManifest.from_bytes(store.get_manifest(digest)), run_id=run)
                missing = {shard.digest for shard in store.missing_shards(manifest)}
                for shard in manifest.shards:
                    if shard.digest not in missing:
                        store.load_tensors(shard)  # re-hashes it and checks its header against the manifest
                complete += not missing
            except (ManifestRejected, ShardRejected, ValueError, OSError) as e:
                problems.append(f"{folder.name[:12]}/{digest[:12]}: {e}")
    return {"stores": len(folders), "manifests": total, "complete": complete, "problems": problems}


def verify_ledgers(root: Path) -> dict[str, Any]:
    from swarm.ledger import find_ledgers, verify_ledger

    verdicts = [verify_ledger(path) for path in find_ledgers(root)] if root.exists() else []
    return {
        "ledgers": len(verdicts),
        "entries": sum(v.num_entries for v in verdicts),
        "problems": [f"{v.path.name}: {v.problems[0]}" for v in verdicts if not v.ok],
    }


def summarize(arm: _Arm) -> dict[str, Any]:
    stops = [i.stopped for i in arm.incarnations if i.stopped]
    return {
        "window_s": arm.t_end - arm.t0,
        "progress": progress(arm),
        "rounds": rounds_summary(arm),
        "partition": partition_summary(arm),
        "slow_host": slow_summary(arm),
        "restarts": restarts_summary(arm),
        "joiners": joiners_summary(arm),
        "kills": arm.kills,
        "exits": arm.exits,
        "orphans": arm.orphans,
        "rss": rss_summary(arm),
        "stops": {
            "peers": len(stops),
            "exit_0": sum(s["exit_code"] == 0 for s in stops),
            "clean": sum(bool(s.get("clean")) for s in stops),
            "max_seconds": max((s["seconds"] for s in stops), default=None),
            "max_children_gone_s": max((s["children_gone_s"] for s in stops), default=None),
        },
        "bootstrap_killed_at_s": arm.bootstrap_killed_at - arm.t0 if arm.bootstrap_killed_at else None,
        "checkpoints": verify_checkpoints(arm.work / "checkpoints", arm.run),
        "ledgers": verify_ledgers(arm.work / "ledgers"),
        "timeline": arm.timeline,
    }


def checks(config: ChaosConfig, chaos: dict[str, Any], baseline: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each check: name, the figure, the bound, and whether it passed (None: not applicable here)."""
    out: list[dict[str, Any]] = []

    def add(name: str, figure: str, bound: str, ok: bool | None) -> None:
        out.append({"check": name, "figure": figure, "bound": bound, "ok": ok})

    prog = chaos["progress"]
    down = (chaos.get("restarts") or {}).get("down_fraction")  # from a kill to its replacement's first step
    if baseline is not None:
        ratio = prog["steps_per_min"] / max(baseline["progress"]["steps_per_min"], 1e-9)
        add(
            "progress vs no-chaos",
            f"{prog['steps_per_min']:.0f} vs {baseline['progress']['steps_per_min']:.0f} steps/min ({ratio:.2f}x)"
            + (f"; restarting slots idle {down:.0%} of the peer-seconds" if down is not None else ""),
            f">= {config.min_progress_ratio:.2f}x",
            ratio >= config.min_progress_ratio,
        )
    else:
        add("progress", f"{prog['steps_per_min']:.0f} steps/min", "> 0 (no baseline arm)", prog["steps"] > 0)
    initial, final = prog["val_loss_initial"], prog["val_loss_final"]
    add(
        "validation loss fell",
        f"{_fmt(initial)} -> {_fmt(final)}",
        "final < initial",
        initial is not None and final is not None and final < initial,
    )
    exits = chaos.get("exits", [])
    add(
        "no peer exited on its own",
        f"{len(exits)}"
        + (
            f" (first: {exits[0]['peer']} code {exits[0]['exit_code']}: {exits[0]['last_line'][:120]})" if exits else ""
        ),
        "0",
        not exits,
    )
    cps = chaos["checkpoints"]
    add(
        "every checkpoint verifies",
        f"{cps['manifests'] - len(cps['problems'])}/{cps['manifests']} in "
        f"{cps['stores']} stores ({cps.get('complete', 0)} with every shard held and re-hashed)",
        "all, >= 1 complete",
        cps.get("complete", 0) >= 1 and not cps["problems"],
    )
    led = chaos["ledgers"]
    add(
        "every ledger verifies",
        f"{led['ledgers'] - len(led['problems'])}/{led['ledgers']} ({led['entries']} entries)",
        f"all, >= {config.peers}",
        led["ledgers"] >= config.peers and not led["problems"],
    )
    vanish = [k["vanish_s"] for k in chaos["kills"]]
    add(
        "no orphaned process",
        f"{len(chaos['orphans'])} orphans; children gone <= {_fmt(max(vanish, default=None))}s after SIGKILL",
        f"0; <= {config.max_vanish_s:g}s",
        not chaos["orphans"] and all(v <= config.max_vanish_s for v in vanish),
    )
    stops = chaos["stops"]
    clean = stops.get("clean", stops["exit_0"])
    add(
        "SIGTERM stops every peer cleanly",
        f"{clean}/{stops['peers']} clean ({stops['exit_0']} exit 0, the rest "
        f"still importing) in <= {_fmt(stops['max_seconds'])}s",
        "all",
        stops["peers"] > 0 and clean == stops["peers"],
    )
    growth = [arm["rss"]["max_growth_mib"] for arm in (chaos, baseline) if arm and "rss" in arm]
    growth = [g for g in growth if g is not None]
    figure = f"max {_fmt(chaos['rss']['max_growth_mib'])} MiB over {chaos['rss']['peers_measured']} peer(s)"
    if baseline is not None and "rss" in baseline:
        figure += (
            f"; no-chaos arm: max {_fmt(baseline['rss']['max_growth_mib'])} MiB over "
            f"{baseline['rss']['peers_measured']}"
        )
    add(
        "RSS growth per peer",
        figure,
        f"<= {config.max_rss_growth_mib:g} MiB",
        max(growth) <= config.max_rss_growth_mib if growth else None,
    )
    rounds = chaos["rounds"]
    add(
        "rounds grouped / attempted",
        f"{rounds['grouped']}/{rounds['attempted']} ({rounds['ratio']:.2f})",
        f">= {config.min_round_ratio:.2f}",
        rounds["ratio"] >= config.min_round_ratio,
    )
    part = chaos["partition"]
    if part is None:
        add("re-merge after partition", "no partition (needs a netns lab)", "-", None)
    else:
        add(
            "both sides trained during the partition",
            f"cut-off side {part['isolated_side_steps']} steps, "
            f"other side {part['other_side_grouped_rounds']} grouped rounds",
            "> 0 each",
            part["isolated_side_steps"] > 0 and part["other_side_grouped_rounds"] > 0,
        )
        add(
            "re-merge after partition",
            f"{part['rounds_to_remerge']} round(s), {_fmt(part['seconds_to_remerge'])}s after the heal",
            f"<= {config.max_remerge_rounds} rounds",
            part["rounds_to_remerge"] is not None and part["rounds_to_remerge"] <= config.max_remerge_rounds,
        )
    restarts = chaos["restarts"]
    kills = [k for k in chaos["kills"] if k["victim"] != "bootstrap"]
    add(
        "peers killed and restarted",
        f"{len(kills)} kills; {restarts['settled_joined']}/{restarts['settled']} settled "
        f"restarts joined ({restarts['settled_state_verified']} with verified state)",
        ">= 1 kill; all joined",
        len(kills) >= 1 and restarts["settled_joined"] == restarts["settled"],
    )
    if chaos["bootstrap_killed_at_s"] is None:
        add("joins after bootstrap loss", "bootstrap not killed", "-", None)
    else:
        add(
            "joins after bootstrap loss",
            f"{restarts['after_bootstrap_loss_joined']}/{restarts['after_bootstrap_loss']} "
            f"joined, {restarts['after_bootstrap_loss_grouped']} grouped",
            "all joined, >= 1",
            restarts["after_bootstrap_loss"] >= 1
            and restarts["after_bootstrap_loss_joined"] == restarts["after_bootstrap_loss"],
        )
    joiners = chaos.get("joiners")
    if joiners is not None:
        add(
            "joiners under load get verified state",
            f"{joiners['verified']}/{joiners['joiners']} at once, joined in <= "
            f"{_fmt(joiners['join_s_max'])}s; download <= {_fmt(joiners['download_x_floor_max'])}x its floor",
            "all verified",
            joiners["joiners"] > 0 and joiners["verified"] == joiners["joiners"],
        )
    slow = chaos["slow_host"]
    if slow is None:
        add("slow host keeps averaging", "no slow host (needs a netns lab)", "-", None)
    else:
        add(
            "slow host keeps averaging",
            f"{slow['grouped_rounds']} grouped rounds at {slow['mbit']:g} Mbit/s; round "
            f"{_fmt(slow['median_round_s'])}s vs others {_fmt(slow['others_median_round_s'])}s",
            ">= 1 grouped",
            slow["grouped_rounds"] >= 1,
        )
    return out


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# ---- running it ------------------------------------------------------------------------------------


def run_arm(config: ChaosConfig, *, chaos: bool, work: Path, console: Console) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    lab, fallback = make_lab(config.lab, rate_mbit=config.rate_mbit, num_hosts=config.slots + 1, console=console)
    name = "chaos" if chaos else "no-chaos"
    with lab:
        arm = _Arm(config, lab=lab, work=work, run=f"chaos-{name}", chaos=chaos, console=console)
        console.print(
            f"[bold]{name} arm[/]: {config.peers} peers on {lab.kind} hosts, "
            f"{config.duration_s if chaos else config.baseline_seconds:.0f}s"
        )
        try:
            arm.start()
            arm.note("every peer is training")
            arm.drive()
        finally:
            arm.stop()
        summary = summarize(arm)
    return {"lab": lab.kind, "lab_fallback_reason": fallback, **summary}


def run(config: ChaosConfig, *, work: Path, console: Console) -> dict[str, Any]:
    baseline = None
    if config.baseline_seconds > 0:
        baseline = run_arm(config, chaos=False, work=work / "no-chaos", console=console)
    chaos = run_arm(config, chaos=True, work=work / "chaos", console=console)
    result = {"config": asdict(config), "baseline": baseline, "chaos": chaos}
    result["checks"] = checks(config, chaos, baseline)
    result["passed"] = all(c["ok"] is not False for c in result["checks"])
    return result


def print_tables(result: dict[str, Any], console: Console) -> None:
    cfg, chaos = result["config"], result["chaos"]
    table = Table(
        title=f"chaos run: {cfg['peers']} peers, {cfg['duration_s']:.0f}s on {chaos['lab']} hosts, seed {cfg['seed']}"
    )
    for column in ("check", "figure", "bound", "result"):
        table.add_column(column)
    for c in result["checks"]:
        verdict = {True: "[green]ok[/]", False: "[bold red]FAILED[/]", None: "[yellow]n/a[/]"}[c["ok"]]
        table.add_row(c["check"], c["figure"], c["bound"], verdict)
    console.print(table)
    kills = Table(title="kills")
    for column in ("t (s)", "victim", "lived (s)", "children", "gone after (s)", "restarted as", "joined via"):
        kills.add_column(column)
    for k in chaos["kills"]:
        kills.add_row(
            f"{k['t']:.1f}",
            k["victim"],
            _fmt(k.get("lived_s")),
            str(k["children"]),
            f"{k['vanish_s']:.2f}",
            k.get("replacement", "-"),
            k.get("via", "-"),
        )
    console.print(kills)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n\n")[0])
    defaults = ChaosConfig()
    parser.add_argument(
        "--duration",
        dest="duration_s",
        type=float,
        default=defaults.duration_s,
        help="seconds of the chaos arm (default: %(default)s)",
    )
    parser.add_argument("--peers", type=int, default=defaults.peers)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--baseline-s",
        type=float,
        default=defaults.baseline_s,
        help="seconds of the no-chaos arm (negative: as long as --duration; 0: none)",
    )
    parser.add_argument("--kill-every-s", type=float, default=defaults.kill_every_s)
    parser.add_argument("--joiners", type=int, default=defaults.joiners)
    parser.add_argument("--partition-s", type=float, default=defaults.partition_s)
    parser.add_argument("--slow-mbit", type=float, default=defaults.slow_mbit)
    parser.add_argument("--rate-mbit", type=float, default=defaults.rate_mbit)
    parser.add_argument("--lab", default=defaults.lab, choices=("auto", "netns", "loopback"))
    parser.add_argument("--preset", default=defaults.preset)
    parser.add_argument("--sync-every", type=int, default=defaults.sync_every)
    parser.add_argument("--overlap", action="store_true", help="overlapped rounds (swarm.peer --overlap)")
    parser.add_argument(
        "--round-timeout-s", dest="averaging_timeout_s", type=float, default=defaults.averaging_timeout_s
    )
    parser.add_argument("--max-rss-growth-mib", type=float, default=defaults.max_rss_growth_mib)
    parser.add_argument("--min-progress-ratio", type=float, default=defaults.min_progress_ratio)
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--work-dir", type=Path, default=None, help="where logs and stores go (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON result (default: %(default)s)")
    return parser


def config_from_args(args: argparse.Namespace) -> ChaosConfig:
    """The ChaosConfig the parsed flags describe (every flag but --work-dir and --out is a field)."""
    return ChaosConfig(**{k: v for k, v in vars(args).items() if k not in ("work_dir", "out")})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    console = Console()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="swarm-chaos-"))
    console.print(f"seed {config.seed}; logs in {work}")
    result, ok = None, False
    try:
        with signals_unwind():
            result = run(config, work=work, console=console)
        ok = result["passed"]
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; every process and namespace of the lab was removed[/]")
        return 130
    except ChaosFailed as e:
        console.print(f"[bold red]chaos run failed:[/] {e}")
        return 1
    finally:
        if ok and not config.keep_logs and args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            console.print(f"logs, events, ledgers and checkpoints kept in {work}")
    result["meta"] = run_metadata("chaos", argv)
    print_tables(result, console)
    save_result(args.out, result)
    console.print(f"wrote {args.out}")
    if not ok:
        console.print(f"[bold red]chaos checks failed[/] (seed {config.seed})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
