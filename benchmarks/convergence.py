"""Convergence side by side in one run: one peer alone, data parallelism, our swarm, hivemind's Optimizer.

    python -m benchmarks.convergence [--task charlm|teacher] [--preset tiny] [--samples 60000] [--peers 4]
                                     [--sync-every 10] [--setting netns|loopback]
                                     [--out benchmarks/results/convergence.json]

Four arms train the same model (same task, preset and seed) on the same data for the same total
number of samples S, one after the other, all with the same inner optimizer: AdamW with swarm.peer's
learning rate, weight decay and inner warm-up (``TrainerConfig.inner_warmup_steps``):

* ``solo``: one process, plain AdamW on the whole training split (shard 0 of 1, the union of the
  swarm's shards), S samples;
* ``dp``: the reference, synchronous data parallelism: ``--peers`` processes in one torch.distributed
  gloo group (``DistributedDataParallel``), process i on shard i of N, gradients all-reduced in fp32
  every step, so one step takes the global batch N x batch; S samples in all;
* ``ours``: a bootstrap node and ``--peers`` ``python -m swarm.peer`` processes, peer i on shard i
  of N, each training S/N samples (``--max-steps``), averaging every ``--sync-every`` steps, with
  swarm.peer's defaults except the bandwidth probe (off: a one-off 1 MiB-each-way measurement per
  peer pair that a run of a few minutes cannot amortise);
* ``hivemind``: a plain hivemind DHT node and N workers (``benchmarks._hivemind_trainer``), the same
  AdamW wrapped in ``hivemind.Optimizer(use_local_updates=True)`` with one epoch per
  ``sync_every`` local steps of each peer (its settings and why: ``make_hivemind_optimizer`` there).
  The workers wait for each other once their optimizers are built (a start barrier), so no peer
  trains epochs alone while the others start up; our peers need none (a round waits for a group).

Every process evaluates the same fixed validation batches; the x axis is samples seen by the whole
arm (N x a peer's own samples for the swarms). Reported: validation loss against samples (table,
JSON with the raw curves, PNG), the samples each swarm needs to reach the solo peer's final loss
(linear interpolation; None: not reached) and their ratio to the solo samples, bytes sent per sample
against fp32 averaging every step (2(N-1)/N x 4 bytes x params / batch per peer-step), and wall time.

Setting ``netns`` (default when root) runs each process on its own lab host (benchmarks.netlab,
unshaped), so the bytes are every peer host's interface tx counters; ``loopback`` cannot count
bytes per process: ours falls back to its round records (averaging payload only) and hivemind's are
unknown. Every process, namespace and link is removed on exit, Ctrl+C and SIGTERM.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks import netlab
from benchmarks._common import rising, save_result
from swarm.events import read_events
from swarm.recipe import DEFAULT_SYNC_EVERY, INNER_WARMUP_STEPS  # swarm.peer's warm-up, given to every arm

RESULTS = Path(__file__).parent / "results" / "convergence.json"
ARMS = ("solo", "dp", "ours", "hivemind")
LR = 3e-3
"""Inner AdamW learning rate of every arm (swarm.peer's default)."""
WEIGHT_DECAY = 0.01
SAMPLES_RATIO_TARGET = 1.1
LOSS_RATIO_TO_DP_TARGET = 1.05
"""Final validation loss of our swarm at most this many times the data-parallel arm's (issue 13)."""
BYTES_REDUCTION_VS_DP_TARGET = 25.0
"""Our swarm sends at least this many times fewer bytes per sample than fp32 data parallelism."""
_INITIAL_PEERS = re.compile(r"^--initial-peers\s+(/\S+(?:\s+/\S+)*)\s*$", re.MULTILINE)
_CHILD_ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True, kw_only=True, slots=True)
class ConvergenceConfig:
    """What the convergence benchmark trains and where."""

    task: str = "charlm"
    """Task of swarm.tasks to train (charlm, teacher)."""
    preset: str = "tiny"
    """Size preset of the task (charlm: tiny, small, default; teacher: tiny, default)."""
    samples: int = 61000
    """Total training samples of each arm (rounded down to whole averaging rounds of all peers)."""
    peers: int = 4
    """Peers of each swarm arm."""
    sync_every: int = DEFAULT_SYNC_EVERY
    """Local steps per peer between averaging rounds (ours) / per hivemind epoch (default: swarm.peer's)."""
    setting: str = ""
    """netns (each process on its own lab host, exact byte counts) or loopback; empty: netns when root."""
    out: str = str(RESULTS)
    """JSON output path; the plot goes beside it (same name, .png)."""
    eval_batches: int = 8
    """Validation batches per evaluation (charlm's fixed validation set has 8, teacher's 4)."""
    seed: int = 0
    """Seed of the initial model and of the batch order."""
    arm_timeout_s: float = 3600.0
    """Deadline of one arm, from its first process start to its last process exit."""
    keep_logs: bool = False
    """Keep the processes' logs and event files (always kept when an arm fails)."""

    def __post_init__(self) -> None:
        from swarm.tasks import get_task

        get_task(self.task, preset=self.preset)  # an unknown task or preset raises ValueError
        if self.peers < 2:
            raise ValueError(f"peers must be >= 2, got {self.peers!r}")
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every!r}")
        if self.setting not in ("", "netns", "loopback"):
            raise ValueError(f"setting must be netns or loopback, got {self.setting!r}")
        if self.eval_batches < 1:
            raise ValueError(f"eval_batches must be >= 1, got {self.eval_batches!r}")
        if not self.arm_timeout_s > 0:
            raise ValueError(f"arm_timeout_s must be > 0, got {self.arm_timeout_s!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The step budget every arm gets, from the config."""

    batch_size: int
    steps_per_peer: int
    solo_steps: int
    rounds: int

    @property
    def samples(self) -> int:
        return self.solo_steps * self.batch_size

    @classmethod
    def of(cls, config: ConvergenceConfig) -> Plan:
        from swarm.tasks import get_task

        batch_size = get_task(config.task, preset=config.preset).config.batch_size
        rounds = config.samples // (config.peers * batch_size * config.sync_every)
        if rounds < 1:
            raise ValueError(
                f"samples={config.samples} is less than one round of every peer "
                f"({config.peers} peers x batch {batch_size} x sync_every {config.sync_every} = "
                f"{config.peers * batch_size * config.sync_every}); raise --samples"
            )
        steps_per_peer = rounds * config.sync_every
        return cls(
            batch_size=batch_size,
            steps_per_peer=steps_per_peer,
            solo_steps=config.peers * steps_per_peer,
            rounds=rounds,
        )


# --- processes ------------------------------------------------------------------------------------


class ArmFailed(RuntimeError):
    """A process of an arm failed or the arm ran past its deadline."""


def _python(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _wait_initial_peers(proc: subprocess.Popen, log: Path, timeout_s: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        match = _INITIAL_PEERS.search(text)
        if match:
            return match.group(1).split()
        if proc.poll() is not None:
            raise ArmFailed(f"the DHT node exited with code {proc.returncode} before printing its address; see {log}")
        time.sleep(0.1)
    raise ArmFailed(f"the DHT node did not print its address within {timeout_s:.0f} s; see {log}")


def _wait_all(
    procs: dict[str, subprocess.Popen], logs: dict[str, Path], *, deadline: float, status: Any, what: str, progress: Any
) -> None:
    """Wait for every process to exit 0 before `deadline`; raise ArmFailed naming the first that did not."""
    while True:
        codes = {name: proc.poll() for name, proc in procs.items()}
        failed = [name for name, code in codes.items() if code not in (None, 0)]
        if failed:
            name = failed[0]
            raise ArmFailed(f"{what}: {name} exited with code {codes[name]}; see {logs[name]}")
        if all(code == 0 for code in codes.values()):
            return
        if time.monotonic() > deadline:
            running = [name for name, code in codes.items() if code is None]
            raise ArmFailed(
                f"{what}: {', '.join(running)} still running at the deadline (--arm-timeout-s); see {logs[running[0]]}"
            )
        status.update(f"{what}: {progress()}")
        time.sleep(0.5)


def _tx_bytes(lab: netlab.Lab, hosts: list[int]) -> dict[int, int] | None:
    if lab.kind != "netns":
        return None
    return {host: lab.hosts[host].counters()["tx_bytes"] for host in hosts}


def _last_step(path: Path) -> int:
    steps = [e.get("step", 0) for e in read_events(path) if e["event"] in ("val", "round", "train")]
    return max(steps, default=0)


@dataclass(slots=True)
class _ArmRun:
    """What running one arm left behind: its event files, byte counters and times."""

    events: dict[str, Path]
    wall_s: float
    tx_before: dict[int, int] | None
    tx_after: dict[int, int] | None
    peer_hosts: list[int]


def _run_procs(
    lab: netlab.Lab,
    specs: dict[str, tuple[int, list[str], Path]],
    *,
    work: Path,
    what: str,
    config: ConvergenceConfig,
    total_steps: int,
    console: Console,
    dht_argv: list[str] | None = None,
) -> _ArmRun:
    """Start a DHT node on host 0 (when `dht_argv` is given), then each spec's argv on its host with the
    node's `--initial-peers` appended, and wait for all of them to exit 0; read the tx byte counters of
    the spec hosts before and after. specs: name -> (host, argv, events file)."""
    peer_hosts = sorted({host for host, _, _ in specs.values()})
    tx_before = _tx_bytes(lab, peer_hosts)
    started = time.monotonic()
    deadline = started + config.arm_timeout_s
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    dht = None
    try:
        initial: list[str] = []
        if dht_argv is not None:
            logs["dht"] = work / f"{what}-dht.log"
            dht = lab.spawn(0, dht_argv, log=logs["dht"], env=_CHILD_ENV)
            initial = ["--initial-peers", *_wait_initial_peers(dht, logs["dht"])]
        for name, (host, argv, _) in specs.items():
            logs[name] = work / f"{what}-{name}.log"
            procs[name] = lab.spawn(host, [*argv, *initial], log=logs[name], env=_CHILD_ENV)

        def progress() -> str:
            done = sum(_last_step(path) for _, _, path in specs.values())
            return f"{done}/{total_steps} steps, {time.monotonic() - started:.0f} s"

        with console.status(what) as status:
            _wait_all(procs, logs, deadline=deadline, status=status, what=what, progress=progress)
        wall_s = time.monotonic() - started
        tx_after = _tx_bytes(lab, peer_hosts)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                lab.stop(proc)
        if dht is not None:
            lab.stop(dht)
    return _ArmRun(
        events={name: path for name, (_, _, path) in specs.items()},
        wall_s=wall_s,
        tx_before=tx_before,
        tx_after=tx_after,
        peer_hosts=peer_hosts,
    )


def _worker_argv(role: str, config: ConvergenceConfig, *extra: str) -> list[str]:
    return _python(
        "benchmarks._hivemind_trainer",
        role,
        "--task",
        config.task,
        "--preset",
        config.preset,
        "--seed",
        str(config.seed),
        "--eval-batches",
        str(config.eval_batches),
        "--lr",
        str(LR),
        "--weight-decay",
        str(WEIGHT_DECAY),
        "--lr-warmup-steps",
        str(INNER_WARMUP_STEPS),
        *extra,
    )


def run_solo(lab: netlab.Lab, config: ConvergenceConfig, plan: Plan, work: Path, console: Console) -> _ArmRun:
    events = work / "solo.jsonl"
    argv = _worker_argv(
        "solo",
        config,
        "--shard-index",
        "0",
        "--num-shards",
        "1",
        "--steps",
        str(plan.solo_steps),
        "--eval-every",
        str(config.peers * config.sync_every),
        "--log",
        str(events),
    )
    return _run_procs(
        lab,
        {"solo": (1, argv, events)},
        work=work,
        what="solo",
        config=config,
        total_steps=plan.solo_steps,
        console=console,
    )


def run_dp(lab: netlab.Lab, config: ConvergenceConfig, plan: Plan, work: Path, console: Console) -> _ArmRun:
    """Synchronous data parallelism (gloo, DDP): one step of N x batch per step, steps_per_peer steps."""
    specs = {}
    for i in range(config.peers):  # rank i on host 1 + i; rank 0's host serves the TCPStore
        events = work / f"dp-peer{i}.jsonl"
        argv = _worker_argv(
            "dp",
            config,
            "--ip",
            lab.hosts[1].ip,
            "--shard-index",
            str(i),
            "--num-shards",
            str(config.peers),
            "--peers",
            str(config.peers),
            "--steps",
            str(plan.steps_per_peer),
            "--eval-every",
            str(config.sync_every),
            "--ready-dir",
            str(work / "dp-rendezvous"),
            "--log",
            str(events),
        )
        specs[f"peer{i}"] = (1 + i, argv, events)
    return _run_procs(
        lab, specs, work=work, what="dp", config=config, console=console, total_steps=config.peers * plan.steps_per_peer
    )


def run_ours(lab: netlab.Lab, config: ConvergenceConfig, plan: Plan, work: Path, console: Console) -> _ArmRun:
    specs = {}
    for i in range(config.peers):
        host = lab.hosts[1 + i]
        events = work / f"ours-peer{i}.jsonl"
        argv = _python(
            "swarm.peer",
            "--run",
            "convergence",
            "--task",
            config.task,
            "--task-preset",
            config.preset,
            "--host-maddrs",
            host.maddr(0),
            "--shard-index",
            str(i),
            "--num-shards",
            str(config.peers),
            "--seed",
            str(config.seed),
            "--sync-every",
            str(config.sync_every),
            "--target-group-size",
            str(config.peers),
            "--max-steps",
            str(plan.steps_per_peer),
            "--lr",
            str(LR),
            "--weight-decay",
            str(WEIGHT_DECAY),
            "--eval-batches",
            str(config.eval_batches),
            "--eval-every",
            "1",  # the curve: every round, as the data parallel arm evaluates every sync_every steps
            # a one-off 1 MiB-each-way probe per peer pair: a short benchmark cannot amortise it
            "--bandwidth-probe-period-s",
            "0",
            "--identity-key",
            str(work / f"ours-peer{i}.key"),
            "--events",
            str(events),
            "--checkpoint-dir",
            str(work / "checkpoints"),
            "--ledger-dir",
            str(work / "ledgers"),
            "--torch-threads",
            "1",
            "--no-progress",
            "--log-level",
            "WARNING",
        )
        specs[f"peer{i}"] = (1 + i, argv, events)
    bootstrap = _python("bootstrap", "--host-maddrs", lab.hosts[0].maddr(0), "--identity", str(work / "bootstrap.id"))
    return _run_procs(
        lab,
        specs,
        work=work,
        what="ours",
        config=config,
        console=console,
        total_steps=config.peers * plan.steps_per_peer,
        dht_argv=bootstrap,
    )


def run_hivemind(lab: netlab.Lab, config: ConvergenceConfig, plan: Plan, work: Path, console: Console) -> _ArmRun:
    from swarm.trainer import TrainerConfig

    defaults = TrainerConfig(run="defaults").averaging
    specs = {}
    for i in range(config.peers):
        host = lab.hosts[1 + i]
        events = work / f"hivemind-peer{i}.jsonl"
        argv = _worker_argv(
            "hivemind",
            config,
            "--host-maddrs",
            host.maddr(0),
            "--shard-index",
            str(i),
            "--num-shards",
            str(config.peers),
            "--steps",
            str(plan.steps_per_peer),
            "--eval-every",
            str(config.sync_every),
            "--peers",
            str(config.peers),
            "--sync-every",
            str(config.sync_every),
            "--log",
            str(events),
            "--run-id",
            "convergence",
            "--ready-dir",
            str(work / "hivemind-ready"),
            # the same timeouts as our peers use (TrainerConfig's defaults)
            "--matchmaking-time-s",
            str(defaults.matchmaking_time_s),
            "--averaging-timeout-s",
            str(defaults.round_timeout_s),
            "--sender-timeout-s",
            str(defaults.sender_timeout_s),
            "--reducer-timeout-s",
            str(defaults.reducer_timeout_s),
        )
        specs[f"peer{i}"] = (1 + i, argv, events)
    dht = _python("benchmarks._hivemind_trainer", "dht", "--host-maddrs", lab.hosts[0].maddr(0))
    return _run_procs(
        lab,
        specs,
        work=work,
        what="hivemind",
        config=config,
        console=console,
        total_steps=config.peers * plan.steps_per_peer,
        dht_argv=dht,
    )


# --- figures --------------------------------------------------------------------------------------


def _val_points(path: Path) -> list[dict[str, Any]]:
    """(step, val_loss) of one process: worker `val` events, or a Swarm peer's start `val` and `round`s."""
    points = {}
    for e in read_events(path):
        if e["event"] in ("val", "round") and e.get("val_loss") is not None:
            points[int(e["step"])] = float(e["val_loss"])  # a later value at the same step wins
    return [{"step": step, "val_loss": loss} for step, loss in sorted(points.items())]


def arm_curve(events: dict[str, Path], *, num_peers: int, batch_size: int) -> tuple[list[dict], dict[str, list]]:
    """Mean validation loss over the arm's processes at each step all of them evaluated, against the
    samples seen by the whole arm (num_peers x step x batch); and the raw per-process points."""
    per_process = {name: _val_points(path) for name, path in events.items()}
    by_step: dict[int, list[float]] = {}
    for points in per_process.values():
        for p in points:
            by_step.setdefault(p["step"], []).append(p["val_loss"])
    curve = [
        {"samples": num_peers * step * batch_size, "val_loss": sum(v) / len(v), "num_values": len(v)}
        for step, v in sorted(by_step.items())
        if len(v) == len(per_process)
    ]
    return curve, per_process


def samples_to_reach(curve: list[dict], target: float) -> float | None:
    """Samples at which the curve first falls to `target`, interpolated linearly; None if it never does."""
    for i, point in enumerate(curve):
        if point["val_loss"] <= target:
            if i == 0:
                return float(point["samples"])
            prev = curve[i - 1]
            frac = (prev["val_loss"] - target) / (prev["val_loss"] - point["val_loss"])
            return prev["samples"] + frac * (point["samples"] - prev["samples"])
    return None


def fp32_every_step_bytes_per_sample(*, num_peers: int, num_params: int, batch_size: int) -> float:
    """Bytes each peer sends per sample when it all-reduces fp32 parameters (or gradients) after every step."""
    return 2 * (num_peers - 1) / num_peers * 4 * num_params / batch_size


def _num_params(events: dict[str, Path]) -> int | None:
    for path in events.values():
        for e in read_events(path):
            if e["event"] == "start" and e.get("params"):
                return int(e["params"])
    return None


def _train_s(events: dict[str, Path]) -> float | None:
    """From the first process's step-0 evaluation to the last process's final evaluation."""
    firsts, lasts = [], []
    for path in events.values():
        times = [e["t"] for e in read_events(path) if e["event"] in ("val", "round") and e.get("val_loss") is not None]
        if times:
            firsts.append(min(times))
            lasts.append(max(times))
    return max(lasts) - min(firsts) if firsts else None


def _ours_rounds(events: dict[str, Path]) -> dict[str, Any]:
    rounds = [e for path in events.values() for e in read_events(path) if e["event"] == "round"]
    records = [e["record"] for e in rounds if e.get("record")]
    return {
        "rounds": len(rounds),
        "mean_group_size": sum(e["group_size"] for e in rounds) / len(rounds) if rounds else None,
        "rounds_alone": sum(1 for e in rounds if e["group_size"] <= 1),
        # a record's bytes_sent counts only the parts this peer sent out; the averaged slices it served
        # back are the other members' bytes_received: together they are what all peers put on the wire
        "payload_bytes_sent": sum(int(r.get("bytes_sent", 0)) + int(r.get("bytes_received", 0)) for r in records),
    }


def _hivemind_rounds(events: dict[str, Path]) -> dict[str, Any]:
    done = [e for path in events.values() for e in read_events(path) if e["event"] == "done"]
    averaged = sum(e.get("averaged", 0) for e in done)
    groups = [e["mean_group"] * e["averaged"] for e in done if e.get("mean_group")]
    epochs = [e.get("epoch", 0) for path in events.values() for e in read_events(path) if e["event"] == "val"]
    return {
        "epochs": max(epochs, default=0),
        "averaging_rounds": averaged,
        "averaging_failed": sum(e.get("failed", 0) for e in done),
        "mean_group_size": sum(groups) / averaged if averaged else None,
    }


def summarize_arm(name: str, run: _ArmRun, *, num_peers: int, batch_size: int) -> dict[str, Any]:
    curve, per_process = arm_curve(run.events, num_peers=num_peers, batch_size=batch_size)
    result: dict[str, Any] = {
        "peers": num_peers,
        "curve": curve,
        "per_process": per_process,
        "samples": curve[-1]["samples"] if curve else 0,
        "final_val_loss": curve[-1]["val_loss"] if curve else None,
        "wall_s": run.wall_s,
        "train_s": _train_s(run.events),
        "tx_bytes": None,
        "tx_bytes_per_host": None,
    }
    if run.tx_before is not None and run.tx_after is not None:
        per_host = {str(h): run.tx_after[h] - run.tx_before[h] for h in run.peer_hosts}
        result["tx_bytes_per_host"] = per_host
        result["tx_bytes"] = sum(per_host.values())
    if name == "ours":
        result.update(_ours_rounds(run.events))
    elif name == "hivemind":
        result.update(_hivemind_rounds(run.events))
    return result


def _bytes_sent(name: str, arm: dict[str, Any]) -> tuple[int | None, str]:
    """Bytes the arm's peers sent, and where the figure comes from."""
    if name == "solo":
        return 0, "none (no network)"
    if arm["tx_bytes"] is not None:
        return arm["tx_bytes"], "netns tx counters of every peer host"
    if name == "ours":
        return arm.get("payload_bytes_sent"), "round records (averaging payload only, no DHT/gossip/checkpoints)"
    return None, "unknown on loopback"


def compare(arms: dict[str, dict], *, num_params: int, batch_size: int, num_peers: int) -> list[dict[str, Any]]:
    """One table row per arm: final loss (and its ratio to the data-parallel arm's), samples to the solo
    loss, bytes per sample (and how many times fewer than the data-parallel arm's) and wall time."""
    solo, dp = arms["solo"], arms["dp"]
    target = solo["final_val_loss"]
    dp_sent, _ = _bytes_sent("dp", dp)
    dp_per_sample = dp_sent / dp["samples"] if dp_sent and dp["samples"] else None
    reference = fp32_every_step_bytes_per_sample(num_peers=num_peers, num_params=num_params, batch_size=batch_size)
    rows = []
    for name in ARMS:
        arm = arms[name]
        if name == "solo":
            reach: float | None = float(solo["samples"])
        else:
            reach = samples_to_reach(arm["curve"], target) if target is not None else None
        sent, source = _bytes_sent(name, arm)
        per_sample = sent / arm["samples"] if sent is not None and arm["samples"] else None
        final = arm["final_val_loss"]
        rows.append(
            {
                "arm": name,
                "peers": 1 if name == "solo" else num_peers,
                "samples": arm["samples"],
                "final_val_loss": final,
                "rising": rising([(p["samples"], p["val_loss"]) for p in arm["curve"]]),
                "loss_ratio_to_dp": final / dp["final_val_loss"]
                if final is not None and dp["final_val_loss"]
                else None,
                "bytes_reduction_vs_dp": dp_per_sample / per_sample if dp_per_sample and per_sample else None,
                "samples_to_solo_loss": reach,
                "samples_ratio_to_solo": reach / solo["samples"] if reach is not None and solo["samples"] else None,
                "bytes_sent": sent,
                "bytes_source": source,
                "bytes_per_sample": per_sample,
                "fp32_every_step_bytes_per_sample": None if name == "solo" else reference,
                "bytes_reduction_vs_fp32_every_step": reference / per_sample if per_sample and name != "solo" else None,
                "wall_s": arm["wall_s"],
                "train_s": arm["train_s"],
            }
        )
    return rows


# --- output ---------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def print_table(rows: list[dict[str, Any]], *, title: str, console: Console) -> None:
    table = Table(title=title)
    for column in (
        "arm",
        "samples",
        "final loss",
        "x dp loss",
        "rising",
        "to solo loss",
        "x solo",
        "bytes sent",
        "B/sample",
        "fewer B than dp",
        "fp32/step B/sample",
        "fewer bytes",
        "wall s",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        reach = row["samples_to_solo_loss"]
        reduction = row["bytes_reduction_vs_fp32_every_step"]
        table.add_row(
            row["arm"],
            str(row["samples"]),
            _fmt(row["final_val_loss"], ".4f"),
            _fmt(row["loss_ratio_to_dp"], ".3f"),
            "yes" if row["rising"] else "no",
            "not reached" if reach is None else f"{reach:.0f}",
            _fmt(row["samples_ratio_to_solo"], ".2f"),
            _fmt(row["bytes_sent"]),
            _fmt(row["bytes_per_sample"], ".0f"),
            "-" if row["bytes_reduction_vs_dp"] is None else f"{row['bytes_reduction_vs_dp']:.1f}x",
            _fmt(row["fp32_every_step_bytes_per_sample"], ".0f"),
            "-" if reduction is None else f"{reduction:.0f}x",
            _fmt(row["wall_s"], ".1f"),
        )
    console.print(table)
    for row in rows:
        if row["arm"] != "solo":
            console.print(
                f"  {row['arm']}: bytes from {row['bytes_source']}; training {_fmt(row['train_s'], '.1f')} s "
                f"of {_fmt(row['wall_s'], '.1f')} s wall",
                highlight=False,
            )


def plot(arms: dict[str, dict], path: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    labels = {
        "solo": "one peer alone",
        "dp": "data parallel (gloo, every step)",
        "ours": "Swarm (ours)",
        "hivemind": "hivemind Optimizer",
    }
    for name in ARMS:
        curve = arms[name]["curve"]
        if curve:
            ax.plot([p["samples"] for p in curve], [p["val_loss"] for p in curve], marker=".", label=labels[name])
    final = arms["solo"]["final_val_loss"]
    if final is not None:
        ax.axhline(final, color="grey", linestyle=":", label=f"solo final loss {final:.3f}")
    ax.set(xlabel="training samples seen (all peers)", ylabel="validation loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _versions() -> dict[str, str]:
    import hivemind
    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__, "hivemind": hivemind.__version__}


def open_lab(setting: str, num_hosts: int, console: Console) -> netlab.Lab:
    """The lab for `setting` ("" picks netns when root); an explicit netns that cannot be built raises."""
    if setting == "loopback" or (setting == "" and os.geteuid() != 0):
        return netlab.loopback_lab(num_hosts)
    try:
        return netlab.netns_lab(num_hosts, rate_mbit=None)
    except netlab.LabUnavailable as e:
        if setting == "netns":
            raise
        console.print(f"[yellow]no netns lab ({e}); running on loopback[/]")
        return netlab.loopback_lab(num_hosts)


def ours_vs_hivemind(arms: dict[str, dict]) -> dict[str, Any]:
    """Both swarms' losses at the sample counts where both evaluated, and at the end."""
    hivemind = {p["samples"]: p["val_loss"] for p in arms["hivemind"]["curve"]}
    common = [
        [p["samples"], p["val_loss"], hivemind[p["samples"]]] for p in arms["ours"]["curve"] if p["samples"] in hivemind
    ]
    ours_final, hivemind_final = arms["ours"]["final_val_loss"], arms["hivemind"]["final_val_loss"]
    return {
        "final_val_loss_ours": ours_final,
        "final_val_loss_hivemind": hivemind_final,
        "ours_at_most_hivemind": None if ours_final is None or hivemind_final is None else ours_final <= hivemind_final,
        "loss_at_equal_samples": common,
        "loss_at_equal_samples_columns": ["samples", "ours", "hivemind"],
    }


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run(config: ConvergenceConfig, console: Console, *, command: str) -> dict[str, Any]:
    """Run the three arms and return the result (also written to config.out and its .png)."""
    plan = Plan.of(config)
    out = Path(config.out)
    work = Path(tempfile.mkdtemp(prefix="swarm-convergence-"))
    failed = True
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM unwinds like Ctrl+C: the lab closes
    try:
        with open_lab(config.setting, config.peers + 1, console) as lab:
            console.print(
                f"convergence: {lab.kind} lab, {config.peers} peers, {config.task}/{config.preset}, "
                f"{plan.samples} samples per arm ({plan.steps_per_peer} steps per peer, {plan.rounds} "
                f"rounds of {config.sync_every}); logs in {work}",
                highlight=False,
            )
            runs = {"solo": run_solo(lab, config, plan, work, console)}
            console.print(f"  solo done in {runs['solo'].wall_s:.0f} s")
            runs["dp"] = run_dp(lab, config, plan, work, console)
            console.print(f"  dp done in {runs['dp'].wall_s:.0f} s")
            runs["ours"] = run_ours(lab, config, plan, work, console)
            console.print(f"  ours done in {runs['ours'].wall_s:.0f} s")
            runs["hivemind"] = run_hivemind(lab, config, plan, work, console)
            console.print(f"  hivemind done in {runs['hivemind'].wall_s:.0f} s")
            setting = lab.kind
        failed = False
    finally:
        signal.signal(signal.SIGTERM, previous)
        if failed or config.keep_logs:
            console.print(f"logs kept in {work}")
    arms = {
        name: summarize_arm(
            name, runs[name], num_peers=1 if name == "solo" else config.peers, batch_size=plan.batch_size
        )
        for name in ARMS
    }
    num_params = _num_params(runs["solo"].events) or 0
    rows = compare(arms, num_params=num_params, batch_size=plan.batch_size, num_peers=config.peers)
    result = {
        "benchmark": "convergence",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        **_versions(),
        "command": command,
        "config": dataclasses.asdict(config),
        "setting": setting,
        "plan": {**dataclasses.asdict(plan), "samples": plan.samples},
        "num_params": num_params,
        "lr": LR,
        "weight_decay": WEIGHT_DECAY,
        "inner_warmup_steps": INNER_WARMUP_STEPS,
        "reference": {
            "fp32_every_step_bytes_per_sample": fp32_every_step_bytes_per_sample(
                num_peers=config.peers, num_params=num_params, batch_size=plan.batch_size
            ),
            "formula": "2(N-1)/N * 4 bytes * num_params / batch_size (per peer-step)",
        },
        "targets": {
            "loss_ratio_to_dp_max": LOSS_RATIO_TO_DP_TARGET,
            "bytes_reduction_vs_dp_min": BYTES_REDUCTION_VS_DP_TARGET,
            "samples_ratio_to_solo_max": SAMPLES_RATIO_TARGET,
            "ours_final_val_loss_at_most_hivemind": True,
        },
        "table": rows,
        "ours_vs_hivemind": ours_vs_hivemind(arms),
        "arms": arms,
        "plot": str(out.with_suffix(".png")),
        "logs": str(work) if config.keep_logs else None,
    }
    save_result(out, result)
    plot(arms, out.with_suffix(".png"), title=f"{config.task}/{config.preset}: {config.peers} peers, {setting}")
    if not config.keep_logs:
        shutil.rmtree(work, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    from bootstrap.cli import add_dataclass_arguments, dataclass_from_args

    parser = argparse.ArgumentParser(prog="python -m benchmarks.convergence", description=__doc__.splitlines()[0])
    add_dataclass_arguments(parser, ConvergenceConfig)
    args = parser.parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=140)  # the table's columns in a log file
    try:
        config = dataclass_from_args(ConvergenceConfig, args)
        Plan.of(config)
    except ValueError as e:
        console.print(f"[bold red]error:[/] {e}")
        return 2
    command = "python -m benchmarks.convergence " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        result = run(config, console, command=command.strip())
    except netlab.LabUnavailable as e:
        console.print(f"[bold red]error:[/] {e}; pass --setting loopback")
        return 2
    except ArmFailed as e:
        console.print(f"[bold red]error:[/] {e}")
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; every process and namespace was removed[/]")
        return 130
    print_table(
        result["table"],
        console=console,
        title=f"convergence on {config.task}/{config.preset}: {config.peers} peers, {result['setting']}, "
        f"{result['plan']['samples']} samples per arm",
    )
    ours = next(r for r in result["table"] if r["arm"] == "ours")
    hm = next(r for r in result["table"] if r["arm"] == "hivemind")
    console.print(
        f"ours vs hivemind at {ours['samples']} samples: final val loss {_fmt(ours['final_val_loss'], '.4f')}"
        f" vs {_fmt(hm['final_val_loss'], '.4f')}",
        highlight=False,
    )
    if ours["loss_ratio_to_dp"] is not None:
        console.print(
            f"ours vs data parallel: {ours['loss_ratio_to_dp']:.3f}x its final val loss (target <= "
            f"{LOSS_RATIO_TO_DP_TARGET}), {_fmt(ours['bytes_reduction_vs_dp'], '.1f')}x fewer bytes per sample "
            f"(target >= {BYTES_REDUCTION_VS_DP_TARGET})",
            highlight=False,
        )
    console.print(f"wrote {config.out} and {result['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
