"""Churn recovery: N `swarm.peer` processes train charlm; one is SIGKILLed inside a round, and a
replacement is later started on its host.

    python -m benchmarks.churn [--peers 8] [--lab auto] [--rate-mbit 100] [--preset tiny] [--repeats 1]

Each peer (and the bootstrap node) runs on its own lab host (benchmarks.netlab): a network namespace
whose link is shaped to ``--rate-mbit`` when the machine allows it (root, ``ip``, ``tc``), else
loopback (``--lab auto`` falls back and says so in the table and the JSON).

Measured for each kill (``--repeats`` kills in one swarm; the replacement of one is the victim of the
next):

* recovery: seconds from the SIGKILL to each survivor's next completed round (its ``round`` event),
  against the target ``sender_timeout_s + 1`` (judged on the survivors whose round dealt with the
  victim: it was in their group, or their round record names it in a failure); with the survivors'
  usual round time before the kill, their round's phases, and how the death was noticed;
* the replacement's time to train: from starting its process to its first training step on the
  run's state (``first_step`` event), against ``1.5 x floor + 5 s`` where the floor is the sealed
  checkpoint's size (the shards it downloaded, read from its checkpoint store) over the link rate;
  split into interpreter start and imports, DHT join and set-up, the state sync (download, as logged
  by the checkpoint manager, and the rest: manifest lookup, verification, loading), and the first
  evaluation and step.

How a kill lands inside a round: the victim runs with ``--dump-dir``, so `swarm.peer` writes
``local_roundNNNN.safetensors`` at the very start of each averaging round (its ``before_sync`` hook,
before matchmaking). The benchmark polls that folder every 10 ms and SIGKILLs the victim's process
``--kill-delay-s`` later (default 1 s: inside the matchmaking window, after the victim announced
itself in the DHT, so the others draw it into their group and must find out that it is dead). Only
the peer's main process is killed, as in a crash; its reaper then removes its DHT child and p2pd.
Its sockets close with it, so the others see resets at once; ``--death host`` (netns) first cuts the
host's link, so that the peer falls silent like a lost machine and the others wait for timeouts.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks._common import make_lab, run_metadata, save_result, signals_unwind, start_bootstrap_node
from benchmarks.netlab import LabUnavailable
from bootstrap.cli import add_dataclass_arguments, dataclass_from_args
from swarm.events import read_events

RESULTS = Path(__file__).parent / "results" / "churn.json"
RUN = "churn-bench"
_DOWNLOADED = re.compile(r"downloaded (\d+) bytes of checkpoint shards from (\d+) donor\(s\) in ([\d.]+)s")
_POLL_S = 0.2
_KILL_POLL_S = 0.01


@dataclass(frozen=True, kw_only=True, slots=True)
class ChurnConfig:
    """The benchmark's shape."""

    peers: int = 8
    """Training peers (each on its own lab host; the bootstrap node gets one more host)."""
    lab: str = "auto"
    """auto (shaped network namespaces, else loopback), netns (fail without them) or loopback."""
    rate_mbit: float = 100.0
    """Link rate of every host on netns labs (0: unshaped)."""
    preset: str = "tiny"
    """charlm size preset of the model (tiny, small, default)."""
    sync_every: int = 20
    """Local steps between averaging rounds."""
    sender_timeout_s: float = 10.0
    """The peers' sender timeout: a member silent this long after the group formed is dropped."""
    matchmaking_time_s: float = 2.0
    """The peers' matchmaking window."""
    kill_delay_s: float = 1.0
    """Seconds between the victim entering a round and its SIGKILL."""
    death: str = "process"
    """process: SIGKILL the peer (its sockets close, the others see resets at once); host (netns only):
    cut the host's link first, so the peer falls silent like a lost machine and the others wait for
    their timeouts; the link is healed before the replacement starts."""
    warmup_rounds: int = 2
    """Grouped rounds every live peer completes before a kill."""
    repeats: int = 1
    """Kills (each followed by a replacement), in one swarm."""
    phase_timeout_s: float = 300.0
    """Bound of every wait (start-up, a round, the replacement's sync)."""
    keep_logs: bool = False
    """Keep the peers' logs, events, ledgers and checkpoints (always kept when the benchmark fails)."""

    def __post_init__(self) -> None:
        if self.peers < 3:
            raise ValueError(f"peers must be >= 3 (two survivors to average), got {self.peers!r}")
        if self.lab not in ("auto", "netns", "loopback"):
            raise ValueError(f"lab must be auto, netns or loopback, got {self.lab!r}")
        if self.rate_mbit < 0:
            raise ValueError(f"rate_mbit must be >= 0, got {self.rate_mbit!r}")
        for name in ("sync_every", "repeats", "warmup_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("sender_timeout_s", "matchmaking_time_s", "phase_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.death not in ("process", "host"):
            raise ValueError(f"death must be process or host, got {self.death!r}")
        if self.death == "host" and self.lab == "loopback":
            raise ValueError("death=host cuts a host's link: it needs --lab netns (or auto on a machine that has it)")
        if self.kill_delay_s < 0:
            raise ValueError(f"kill_delay_s must be >= 0, got {self.kill_delay_s!r}")


class BenchmarkFailed(RuntimeError):
    """The swarm did not do what the benchmark waits for (the message says what and where the logs are)."""


@dataclass(slots=True)
class _Peer:
    name: str
    host: int
    proc: Any
    started: float
    events: Path
    log: Path
    dump: Path | None
    killed_at: float | None = None

    def read(self) -> list[dict[str, Any]]:
        return read_events(self.events)

    def peer_id(self) -> str | None:
        joined = next((e for e in self.read() if e["event"] == "joined"), None)
        return joined.get("peer_id") if joined else None


@dataclass(slots=True)
class _Swarm:
    """The lab, the bootstrap node and the peers; everything is started through the lab, which owns it."""

    config: ChurnConfig
    lab: Any
    work: Path
    initial_peers: list[str] = field(default_factory=list)
    peers: list[_Peer] = field(default_factory=list)
    _count: int = 0

    @property
    def bootstrap_host(self) -> int:
        return self.config.peers

    def _env(self) -> dict[str, str]:
        # COLUMNS: rich must not wrap the log lines this benchmark parses
        return {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "COLUMNS": "400"}

    def start_bootstrap(self) -> None:
        _, maddrs = start_bootstrap_node(
            self.lab, self.bootstrap_host, work=self.work, env=self._env(), timeout_s=self.config.phase_timeout_s
        )
        if maddrs is None:
            raise BenchmarkFailed(
                f"the bootstrap node printed no --initial-peers line; see {self.work / 'bootstrap.log'}"
            )
        self.initial_peers = maddrs

    def start_peer(self, host: int, *, dump: bool) -> _Peer:
        cfg, self._count = self.config, self._count + 1
        name = f"peer{host}" if self._count <= cfg.peers else f"peer{host}-r{self._count - cfg.peers}"
        events, log = self.work / f"{name}.jsonl", self.work / f"{name}.log"
        dump_dir = self.work / f"{name}-rounds" if dump else None
        argv = [
            sys.executable,
            "-m",
            "swarm.peer",
            "--initial-peers",
            *self.initial_peers,
            "--run",
            RUN,
            "--task",
            "charlm",
            "--task-preset",
            cfg.preset,
            "--host-maddrs",
            self.lab.hosts[host].maddr(0),
            "--shard-index",
            str(host),
            "--num-shards",
            str(cfg.peers),
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
            "--identity-key",
            str(self.work / f"{name}.key"),
            "--events",
            str(events),
            "--torch-threads",
            "1",
            "--no-progress",
            "--eval-batches",
            "2",
            "--checkpoint-dir",
            str(self.work / "checkpoints"),
            "--ledger-dir",
            str(self.work / "ledgers"),
        ]
        if dump_dir is not None:
            argv += ["--dump-dir", str(dump_dir)]
        started = time.time()
        proc = self.lab.spawn(host, argv, log=log, env=self._env())
        peer = _Peer(name=name, host=host, proc=proc, started=started, events=events, log=log, dump=dump_dir)
        self.peers.append(peer)
        return peer

    def live(self) -> list[_Peer]:
        return [p for p in self.peers if p.killed_at is None]

    def check_alive(self) -> None:
        dead = [p for p in self.live() if p.proc.poll() is not None]
        if dead:
            raise BenchmarkFailed(
                f"{', '.join(p.name for p in dead)} exited early (code {dead[0].proc.poll()}); see {dead[0].log}"
            )

    def wait(self, what: str, predicate: Callable[[], Any]) -> Any:
        """Poll ``predicate`` (a truthy value ends the wait) with the phase deadline; peers must stay alive."""
        deadline = time.monotonic() + self.config.phase_timeout_s
        while True:
            value = predicate()
            if value:
                return value
            self.check_alive()
            if time.monotonic() > deadline:
                raise BenchmarkFailed(
                    f"timed out after {self.config.phase_timeout_s:.0f}s waiting for {what}; "
                    f"see the logs in {self.work}"
                )
            time.sleep(_POLL_S)


def _grouped_rounds(events: list[dict[str, Any]], *, after: float = 0.0) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "round" and e["t"] > after and (e.get("group_size") or 0) >= 2]


def _steady(swarm: _Swarm, since: float) -> bool:
    """Every live peer has completed warmup_rounds grouped rounds after ``since``."""
    need = swarm.config.warmup_rounds
    return all(len(_grouped_rounds(p.read(), after=max(since, p.started))) >= need for p in swarm.live())


def _wait_for_round_start(swarm: _Swarm, victim: _Peer) -> tuple[float, int]:
    """Block until the victim enters its next averaging round; returns (unix time it did, round)."""
    assert victim.dump is not None
    seen = set(victim.dump.glob("local_round*.safetensors")) if victim.dump.exists() else set()

    def new_file() -> Path | None:
        if not victim.dump.exists():
            return None
        fresh = sorted(set(victim.dump.glob("local_round*.safetensors")) - seen)
        return fresh[-1] if fresh else None

    deadline = time.monotonic() + swarm.config.phase_timeout_s
    while (path := new_file()) is None:
        swarm.check_alive()
        if time.monotonic() > deadline:
            raise BenchmarkFailed(f"{victim.name} did not start a round within {swarm.config.phase_timeout_s:.0f}s")
        time.sleep(_KILL_POLL_S)
    round_ = int(re.search(r"(\d+)", path.stem).group(1))
    return path.stat().st_mtime, round_


def _kill(swarm: _Swarm, victim: _Peer) -> dict[str, Any]:
    round_started, round_ = _wait_for_round_start(swarm, victim)
    time.sleep(max(0.0, round_started + swarm.config.kill_delay_s - time.time()))
    if swarm.config.death == "host":
        swarm.lab.set_link(victim.host, False)
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.killed_at = time.time()
    victim.proc.wait(timeout=10)
    return {
        "victim": victim.name,
        "victim_peer_id": victim.peer_id(),
        "victim_round": round_,
        "kill_offset_s": victim.killed_at - round_started,
    }


def _recovery(swarm: _Swarm, victim: _Peer, before: float) -> dict[str, Any]:
    """Each survivor's first round completed after the kill, and how it noticed the death.

    A survivor is "affected" when the victim was in its round's group or its round record names the
    victim in a failure; others (a separate group, or still computing their local steps) only show how
    far apart the peers' rounds were."""
    killed_at, victim_id = victim.killed_at, victim.peer_id()

    def firsts() -> dict[str, dict] | None:
        found = {}
        for peer in swarm.live():
            done = [e for e in peer.read() if e["event"] == "round" and e["t"] > killed_at]
            if not done:
                return None
            found[peer.name] = done[0]
        return found

    rounds = swarm.wait("the survivors' next round after the kill", firsts)
    baseline = [
        e["duration_s"] for p in swarm.live() for e in _grouped_rounds(p.read(), after=before) if e["t"] < killed_at
    ]
    per_survivor = {}
    for name, event in rounds.items():
        record = event.get("record") or {}
        failures = [f for f in record.get("failures", []) if f.get("peer") == victim_id]
        in_group = victim_id in (record.get("members") or [])
        per_survivor[name] = {
            "seconds": event["t"] - killed_at,
            "round": event["round"],
            "group_size": event["group_size"],
            "round_duration_s": event["duration_s"],
            "outcome": record.get("outcome"),
            "round_started_after_kill_s": event["t"] - killed_at - event["duration_s"],
            "phase_s": record.get("phase_s") or {},
            "victim_in_group": in_group,
            "affected": in_group or bool(failures),
            "victim_failures": [f"{f.get('phase')}: {str(f.get('reason'))[:80]}" for f in failures],
        }
    seconds = [r["seconds"] for r in per_survivor.values()]
    affected = [r["seconds"] for r in per_survivor.values() if r["affected"]]
    return {
        "survivors_next_round_s": seconds,
        "survivors_next_round_s_max": max(seconds),
        "survivors_next_round_s_median": statistics.median(seconds),
        "affected_survivors": len(affected),
        "affected_next_round_s_max": max(affected) if affected else None,
        "survivors_grouped": sum(r["group_size"] >= 2 for r in per_survivor.values()),
        "noticed_in": sorted({f.split(":")[0] for r in per_survivor.values() for f in r["victim_failures"]}),
        "baseline_round_s_median": statistics.median(baseline) if baseline else None,
        "per_survivor": per_survivor,
    }


def _read_ledger(swarm: _Swarm, peer_id: str) -> dict[str, Any]:
    """The replacement's first start / state_synced / joined ledger entries (body and unix time)."""
    from swarm.ledger import default_ledger_path, read_entries

    entries = read_entries(default_ledger_path(swarm.work / "ledgers", run=RUN, peer_id=peer_id))
    found: dict[str, Any] = {}
    for entry in entries:
        if entry.kind in ("start", "state_synced", "joined") and entry.kind not in found:
            found[entry.kind] = {"t": entry.t, **entry.body}
    return found


def _state_bytes(swarm: _Swarm, peer_id: str, manifest_digest: str) -> int:
    """Size of the sealed checkpoint the replacement resumed from (the shards it had to download)."""
    from swarm.checkpoint import CheckpointStore, SignedManifest

    store = CheckpointStore(swarm.work / "checkpoints" / RUN / peer_id)
    manifest = SignedManifest.from_bytes(store.get_manifest(manifest_digest)).manifest
    return sum(shard.size_bytes for shard in manifest.shards)


def _replacement(swarm: _Swarm, host: int, killed_at: float) -> tuple[_Peer, dict[str, Any]]:
    """Start a replacement on ``host``; time its way to training on the run's state, phase by phase."""
    peer = swarm.start_peer(host, dump=True)
    rate = swarm.lab.rate_mbit if swarm.lab.kind == "netns" else None

    def first_step() -> dict | None:
        return next((e for e in peer.read() if e["event"] == "first_step"), None)

    first = swarm.wait(f"{peer.name}'s first training step", first_step)
    events = peer.read()
    start = next(e for e in events if e["event"] == "start")
    joined = next(e for e in events if e["event"] == "joined")
    grouped = swarm.wait(f"{peer.name}'s first grouped round", lambda: _grouped_rounds(peer.read()))
    result: dict[str, Any] = {
        "replacement": peer.name,
        "started_after_kill_s": peer.started - killed_at,
        "state_loaded": bool(joined.get("state_loaded")),
        "state_verified": bool(joined.get("state_verified")),
        "time_to_train_s": first["t"] - peer.started,
        "first_grouped_round_s": grouped[0]["t"] - peer.started,
        "phases_s": {"interpreter_and_imports": start["t"] - peer.started},
    }
    ledger = _read_ledger(swarm, joined["peer_id"])
    synced = ledger.get("state_synced")
    if synced is not None:
        sync_started = synced["t"] - synced["seconds"]
        download = _logged_download(peer.log)
        result["phases_s"].update(
            {
                "dht_join_and_setup": sync_started - start["t"],
                "state_download": download["seconds"] if download else None,
                "state_lookup_verify_load": synced["seconds"] - (download["seconds"] if download else 0.0),
                "first_eval_and_step": first["t"] - max(joined["t"], synced["t"]),
            }
        )
        state_bytes = _state_bytes(swarm, joined["peer_id"], synced["manifest"])
        result.update(
            {
                "state_bytes": state_bytes,
                "downloaded_bytes": download["bytes"] if download else None,
                "donors": download["donors"] if download else None,
                "sealed_step": synced["step"],
            }
        )
    else:  # it trained from the genesis state: there was no sealed checkpoint to sync
        result["phases_s"]["dht_join_setup_and_lookup"] = joined["t"] - start["t"]
        result["phases_s"]["first_eval_and_step"] = first["t"] - joined["t"]
        result["state_bytes"] = None
    floor = result["state_bytes"] * 8 / (rate * 1e6) if rate and result.get("state_bytes") else None
    result["floor_s"] = floor
    result["target_s"] = 1.5 * (floor or 0.0) + 5.0
    result["within_target"] = result["time_to_train_s"] <= result["target_s"]
    return peer, result


def _logged_download(log: Path) -> dict[str, Any] | None:
    match = _DOWNLOADED.search(log.read_text(errors="replace")) if log.exists() else None
    if match is None:
        return None
    return {"bytes": int(match.group(1)), "donors": int(match.group(2)), "seconds": float(match.group(3))}


def _cycle(swarm: _Swarm, index: int, console: Console) -> dict[str, Any]:
    cfg = swarm.config
    victim = swarm.live()[-1]
    with console.status(f"kill {index + 1}: waiting for {cfg.warmup_rounds} grouped rounds on every peer"):
        swarm.wait("every peer's warm-up rounds", lambda: _steady(swarm, since=0.0))
        warm_since = time.time()
        swarm.wait("one more round on every peer", lambda: _steady_once(swarm, warm_since))
    with console.status(f"kill {index + 1}: waiting for {victim.name} to enter a round"):
        kill = _kill(swarm, victim)
    console.print(f"[red]SIGKILLed {victim.name}[/] {kill['kill_offset_s']:.2f}s into its round {kill['victim_round']}")
    with console.status(f"kill {index + 1}: waiting for the survivors' next round"):
        recovery = _recovery(swarm, victim, before=warm_since)
    if cfg.death == "host":
        swarm.lab.set_link(victim.host, True)
    with console.status(f"kill {index + 1}: replacement on host {victim.host} syncing"):
        _, replacement = _replacement(swarm, victim.host, victim.killed_at)
    return {"kill": kill, "recovery": recovery, "replacement": replacement}


def _steady_once(swarm: _Swarm, since: float) -> bool:
    return all(_grouped_rounds(p.read(), after=since) for p in swarm.live())


def run(config: ChurnConfig, console: Console, work: Path) -> dict[str, Any]:
    lab, fallback = make_lab(config.lab, rate_mbit=config.rate_mbit, num_hosts=config.peers + 1, console=console)
    if config.death == "host" and lab.kind != "netns":
        lab.close()
        raise BenchmarkFailed(f"--death host needs a netns lab; this machine has none ({fallback})")
    cycles: list[dict[str, Any]] = []
    with lab:
        swarm = _Swarm(config=config, lab=lab, work=work)
        with console.status(f"starting the bootstrap node and {config.peers} peers ({lab.kind})"):
            swarm.start_bootstrap()
            for host in range(config.peers):
                swarm.start_peer(host, dump=host == config.peers - 1)
        for index in range(config.repeats):
            cycles.append(_cycle(swarm, index, console))
    return {
        "lab": lab.kind,
        "rate_mbit": lab.rate_mbit if lab.kind == "netns" else None,
        "lab_fallback_reason": fallback,
        "cycles": cycles,
        "summary": _summary(config, cycles),
    }


def _summary(config: ChurnConfig, cycles: list[dict[str, Any]]) -> dict[str, Any]:
    # the survivors that had to deal with the death (else all of them: nobody noticed it)
    recovery = [
        c["recovery"]["affected_next_round_s_max"] or c["recovery"]["survivors_next_round_s_max"] for c in cycles
    ]
    ttt = [c["replacement"]["time_to_train_s"] for c in cycles]
    target = config.sender_timeout_s + 1.0
    return {
        "recovery_s_median": statistics.median(recovery),
        "recovery_s_max": max(recovery),
        "recovery_target_s": target,
        "recovery_within_target": sum(r <= target for r in recovery),
        "time_to_train_s_median": statistics.median(ttt),
        "time_to_train_s_max": max(ttt),
        "replacement_within_target": sum(c["replacement"]["within_target"] for c in cycles),
        "replacements_synced": sum(c["replacement"]["state_verified"] for c in cycles),
        "kills": len(cycles),
    }


def print_tables(result: dict[str, Any], console: Console) -> None:
    cfg, rate, cycles = result["config"], result["rate_mbit"], result["cycles"]
    where = f"{result['lab']}" + (f", {rate:g} Mbit/s" if rate else ", unshaped")
    kills = [f"kill {i + 1}" for i in range(len(cycles))]
    recovery = [
        (
            "victim's round, killed after (s)",
            lambda c: f"{c['kill']['victim_round']}, {c['kill']['kill_offset_s']:.2f}",
        ),
        (
            "survivors' next round (s)",
            lambda c: (
                f"{min(c['recovery']['survivors_next_round_s']):.2f}-{c['recovery']['survivors_next_round_s_max']:.2f}"
            ),
        ),
        (
            "  of those that noticed the death (s)",
            lambda c: (
                f"{c['recovery']['affected_survivors']} peers, max {_fmt(c['recovery']['affected_next_round_s_max'])}"
            ),
        ),
        ("target: sender timeout + 1 (s)", lambda c: f"{cfg['sender_timeout_s'] + 1:.1f}"),
        ("usual round before (s)", lambda c: _fmt(c["recovery"]["baseline_round_s_median"])),
        ("slowest survivor's phases (s)", lambda c: _phases(c["recovery"])),
        ("death noticed in", lambda c: ", ".join(c["recovery"]["noticed_in"]) or "-"),
        ("survivors grouped", lambda c: f"{c['recovery']['survivors_grouped']}/{len(c['recovery']['per_survivor'])}"),
    ]
    console.print(
        _figures_table(
            f"churn: {cfg['peers']} peers, charlm {cfg['preset']}, {where}, death={cfg['death']}",
            kills,
            recovery,
            cycles,
        )
    )
    phases = (
        "interpreter_and_imports",
        "dht_join_and_setup",
        "state_download",
        "state_lookup_verify_load",
        "first_eval_and_step",
    )
    replacement = [
        ("time to train (s)", lambda c: f"{c['replacement']['time_to_train_s']:.2f}"),
        ("floor: state / link rate (s)", lambda c: _fmt(c["replacement"]["floor_s"])),
        ("target: 1.5 floor + 5 (s)", lambda c: f"{c['replacement']['target_s']:.2f}"),
        *(
            (f"  {name.replace('_', ' ')} (s)", lambda c, n=name: _fmt(c["replacement"]["phases_s"].get(n)))
            for name in phases
        ),
        (
            "state (MB), donors",
            lambda c: f"{_fmt((c['replacement']['state_bytes'] or 0) / 1e6)}, {c['replacement'].get('donors')}",
        ),
        ("verified sealed state", lambda c: str(c["replacement"]["state_verified"])),
        ("first grouped round (s)", lambda c: f"{c['replacement']['first_grouped_round_s']:.2f}"),
    ]
    console.print(_figures_table("replacement: from process start", kills, replacement, cycles))


def _phases(recovery: dict[str, Any]) -> str:
    slowest = max(recovery["per_survivor"].values(), key=lambda r: r["seconds"])
    short = {"matchmaking": "mm", "allreduce": "ar", "total": "total"}  # allreduce: the last attempt
    text = " ".join(f"{short[k]} {v:.2f}" for k, v in slowest.get("phase_s", {}).items() if k in short) or "-"
    return f"{text} ({slowest.get('outcome')})"


def _figures_table(title: str, columns: list[str], rows: list, cycles: list[dict[str, Any]]) -> Table:
    table = Table(title=title)
    table.add_column("figure")
    for column in columns:
        table.add_column(column, justify="right")
    for label, cell in rows:
        table.add_row(label, *(cell(c) for c in cycles))
    return table


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.churn", description=__doc__.splitlines()[0])
    add_dataclass_arguments(parser, ChurnConfig)
    parser.add_argument("--out", default=str(RESULTS), help="JSON output path (default: %(default)s)")
    args = parser.parse_args(argv)
    console = Console()
    try:
        config = dataclass_from_args(ChurnConfig, args)
    except ValueError as e:
        console.print(f"[bold red]error:[/] {e}")
        return 2
    work = Path(tempfile.mkdtemp(prefix="swarm-churn-"))
    ok = False
    try:
        with signals_unwind():
            result = {**run_metadata("churn", argv), "config": asdict(config), **run(config, console, work)}
        ok = True
    except BenchmarkFailed as e:
        console.print(f"[bold red]churn benchmark failed:[/] {e}")
        return 1
    except LabUnavailable as e:
        console.print(f"[bold red]no test hosts:[/] {e}; use --lab auto or --lab loopback")
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; every process and namespace of the lab was removed[/]")
        return 130
    finally:
        if ok and not config.keep_logs:
            shutil.rmtree(work, ignore_errors=True)
        else:
            console.print(f"logs, events and ledgers kept in {work}")
    print_tables(result, console)
    out = save_result(args.out, result)
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
