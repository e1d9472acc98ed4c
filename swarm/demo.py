"""`python -m swarm.demo`: a whole swarm on this machine, with a crash and a replacement.

Starts one bootstrap node and ``--peers`` contributing peers as separate OS processes on loopback,
trains ``charlm``, SIGKILLs one peer halfway, starts a replacement that catches up from the others,
and ends with a summary table, ``OUT/summary.json`` and the loss curve ``OUT/loss.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.table import Table

from swarm.events import read_events

_INITIAL_PEERS_LINE = re.compile(r"^--initial-peers\s+(.+)$")
LOSS_RATIO_TARGET = 0.8


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """The demo's shape."""

    peers: int = 4
    """Contributing peers started at the beginning."""
    duration: float = 120.0
    """Seconds of training, from the moment all peers are started. Longer on a loaded machine: the kill
    waits for the victim's second grouped round, and the replacement gets at least half of this after the kill and
    up to all of it, until it has synced, averaged once and holds its receipt of a sealed round."""
    out: str = "demo-out"
    """Output folder for logs, summary.json and loss.png."""
    task_preset: str = "tiny"
    """Size preset of charlm's model."""
    sync_every: int = 15
    """Local steps between averaging rounds."""
    kill: bool = True
    """SIGKILL one peer halfway (once it has averaged in two rounds) and start a replacement."""
    seed: int = 0
    """Seed of the model and data order."""

    def __post_init__(self) -> None:
        if self.peers < 2:
            raise ValueError(f"peers must be >= 2, got {self.peers!r}")
        if self.duration < 20:
            raise ValueError(f"duration must be >= 20 seconds, got {self.duration!r}")
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every!r}")


@dataclass(slots=True)
class _Child:
    name: str
    proc: subprocess.Popen
    started: float
    log: IO[bytes]
    events: Path | None = None
    killed_at: float | None = None


@dataclass(slots=True)
class _Swarm:
    config: DemoConfig
    out: Path
    console: Console
    children: list[_Child] = field(default_factory=list)
    initial_peers: list[str] = field(default_factory=list)

    def spawn(self, name: str, args: list[str], *, events: Path | None = None) -> _Child:
        log = open(self.out / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop_all)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", *args],
            stdout=subprocess.PIPE if events is None else log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        child = _Child(name=name, proc=proc, started=time.time(), log=log, events=events)
        self.children.append(child)
        return child

    def start_bootstrap(self, timeout_s: float = 60.0) -> None:
        child = self.spawn(
            "bootstrap",
            ["bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity", str(self.out / "bootstrap.id")],
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = child.proc.stdout.readline().decode(errors="replace").strip()
            if not line and child.proc.poll() is not None:
                break
            match = _INITIAL_PEERS_LINE.match(line)
            if match:
                self.initial_peers = match.group(1).split()
                return
        raise RuntimeError(
            f"the bootstrap node did not print its address within {timeout_s:.0f}s; see {self.out / 'bootstrap.log'}"
        )

    def start_peer(self, name: str, shard: int) -> _Child:
        cfg = self.config
        events = self.out / f"{name}.jsonl"
        args = [
            "swarm.peer",
            "--initial-peers",
            *self.initial_peers,
            "--run",
            "demo",
            "--task",
            "charlm",
            "--task-preset",
            cfg.task_preset,
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--shard-index",
            str(shard),
            "--num-shards",
            str(cfg.peers),
            "--seed",
            str(cfg.seed),
            "--sync-every",
            str(cfg.sync_every),
            "--target-group-size",
            str(cfg.peers),
            "--identity-key",
            str(self.out / f"{name}.key"),
            "--events",
            str(events),
            "--torch-threads",
            "1",
            "--no-progress",
            "--eval-batches",
            "4",
            "--eval-every",
            "1",  # the demo's loss curve: a point every round
            "--checkpoint-dir",
            str(self.out / "checkpoints"),
            "--ledger-dir",
            str(self.out / "ledgers"),
        ]
        return self.spawn(name, args, events=events)

    def stop_all(self, timeout_s: float = 30.0) -> None:
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.console.print(f"[yellow]{child.name} did not stop in time; killing it[/]")
                child.proc.kill()
                child.proc.wait(timeout=10)
            child.log.close()


def _caught_up(child: _Child) -> bool:
    """Whether `child` loaded the run's state, averaged in a group and holds its verified receipt of
    a sealed round (receipts come with the seal, after the round itself)."""
    events = read_events(child.events) if child.events else []
    joined = _last(events, "joined")
    grouped = any(e["event"] == "round" and (e.get("group_size") or 0) >= 2 for e in events)
    receipted = any(e["event"] == "receipt" for e in events)
    return bool(joined and joined.get("state_loaded") and grouped and receipted)


def _last_round(children: list[_Child]) -> int:
    rounds = [e["round"] for c in children if c.events for e in read_events(c.events) if e["event"] == "round"]
    return max(rounds, default=0)


def _grouped_rounds(child: _Child) -> int:
    events = read_events(child.events) if child.events else []
    return sum(1 for e in events if e["event"] == "round" and e.get("group_size", 1) > 1)


def run_demo(config: DemoConfig, console: Console) -> dict[str, Any]:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.jsonl"), *out.glob("*.log")]:
        stale.unlink()
    for stale_dir in ("checkpoints", "ledgers", "report"):  # a new demo is a new run
        shutil.rmtree(out / stale_dir, ignore_errors=True)
    swarm = _Swarm(config=config, out=out, console=console)
    t0 = time.time()
    try:
        with console.status("starting the bootstrap node"):
            swarm.start_bootstrap()
        console.print(f"bootstrap node at [cyan]{' '.join(swarm.initial_peers)}[/]")
        peers = [swarm.start_peer(f"peer{i}", shard=i) for i in range(config.peers)]
        train_start = time.time()
        killed, replacement, round_at_kill = None, None, None
        end_s, latest_s = config.duration, config.duration
        with console.status("training") as status:
            # past end_s, a replacement that has not yet synced and averaged (a loaded machine) gets until latest_s
            while (elapsed := time.time() - train_start) < end_s or (
                replacement is not None and not _caught_up(replacement) and elapsed < latest_s
            ):
                # the kill comes at half time, once the victim has two grouped rounds behind it (so its
                # contribution and receipts are on record; a loaded machine may need longer), and the
                # replacement then always gets half a run to join and catch up
                if (
                    config.kill
                    and killed is None
                    and elapsed >= config.duration / 2
                    and (_grouped_rounds(peers[-1]) >= 2 or elapsed >= config.duration)
                ):
                    end_s, latest_s = max(end_s, elapsed + config.duration / 2), elapsed + config.duration
                    killed = peers[-1]
                    round_at_kill = _last_round(peers)
                    killed.proc.send_signal(signal.SIGKILL)
                    killed.killed_at = time.time()
                    console.print(
                        f"[red]SIGKILLed {killed.name}[/] at {elapsed:.0f}s (round {round_at_kill}); "
                        f"starting a replacement"
                    )
                    replacement = swarm.start_peer(f"{killed.name}-replacement", shard=config.peers - 1)
                dead = [c.name for c in swarm.children if c is not killed and c.proc.poll() is not None]
                if dead:
                    raise RuntimeError(f"{', '.join(dead)} exited early; see the logs in {out}")
                status.update(f"training: {elapsed:.0f}/{end_s:.0f}s, round {_last_round(peers)}")
                time.sleep(1.0)  # a display refresh, not synchronisation
    finally:
        swarm.stop_all()
    summary = summarize(config, swarm, killed, replacement, round_at_kill, t0)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_losses(swarm, killed, replacement, out / "loss.png", t0)
    from swarm.report import ReportInputError, write_report

    try:
        summary["report"] = str(write_report(out / "ledgers", out=out / "report.html", title="Swarm demo").html)
    except ReportInputError as e:  # no peer wrote a ledger: the summary above still says what happened
        console.print(f"[yellow]no run report: {e}[/]")
        summary["report"] = None
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def summarize(
    config: DemoConfig,
    swarm: _Swarm,
    killed: _Child | None,
    replacement: _Child | None,
    round_at_kill: int | None,
    t0: float,
) -> dict[str, Any]:
    peers = [c for c in swarm.children if c.events is not None]
    events = {c.name: read_events(c.events) for c in peers}
    start_vals = [
        e["val_loss"]
        for c in peers
        if c is not replacement
        for e in events[c.name][:10]
        if e["event"] == "val" and e.get("val_loss") is not None
    ]
    end_vals = [
        last["val_loss"]
        for c in peers
        if c is not killed
        for last in [_last(events[c.name], "round")]
        if last and last.get("val_loss") is not None
    ]
    rounds = max((e["round"] for evs in events.values() for e in evs if e["event"] == "round"), default=0)
    summary: dict[str, Any] = {
        "val_loss_start": _mean(start_vals),
        "val_loss_end": _mean(end_vals),
        "rounds": rounds,
        "peers": config.peers,
        "killed_peer": killed.name if killed else None,
        "round_at_kill": round_at_kill,
        "replacement_synced_s": None,
        "duration_s": round(time.time() - t0, 1),
        "per_peer": {},
    }
    if replacement is not None:
        joined = _last(events[replacement.name], "joined")
        first = _first(events[replacement.name], "first_step")
        if joined and first and joined.get("state_loaded"):
            summary["replacement_synced_s"] = round(first["t"] - replacement.started, 2)
            summary["replacement_joined_round"] = joined["round"]
    for c in peers:
        evs = events[c.name]
        rounds_done = [e for e in evs if e["event"] == "round"]
        train = [e for e in evs if e["event"] == "train"]
        summary["per_peer"][c.name] = {
            "rounds": len(rounds_done),
            "steps": train[-1]["step"] if train else 0,
            "samples_per_s": round(_mean([e["samples_per_s"] for e in train[-5:]]) or 0.0, 1),
            "mean_group_size": round(_mean([e["group_size"] for e in rounds_done]) or 0.0, 2),
            "last_val_loss": rounds_done[-1].get("val_loss") if rounds_done else None,
        }
    if summary["val_loss_start"] and summary["val_loss_end"]:
        summary["val_loss_ratio"] = round(summary["val_loss_end"] / summary["val_loss_start"], 4)
    return summary


def _first(events: list[dict], kind: str) -> dict | None:
    return next((e for e in events if e["event"] == kind), None)


def _last(events: list[dict], kind: str) -> dict | None:
    return next((e for e in reversed(events) if e["event"] == kind), None)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def plot_losses(swarm: _Swarm, killed: _Child | None, replacement: _Child | None, path: Path, t0: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for child in swarm.children:
        if child.events is None:
            continue
        points = [
            (e["t"] - t0, e["val_loss"])
            for e in read_events(child.events)
            if e["event"] in ("val", "round") and e.get("val_loss") is not None
        ]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker=".", label=child.name, linestyle="--" if child is replacement else "-")
    if killed is not None and killed.killed_at:
        ax.axvline(killed.killed_at - t0, color="red", linestyle=":", label=f"{killed.name} SIGKILLed")
    ax.set(xlabel="seconds since start", ylabel="validation loss (charlm)", title="Swarm demo: validation loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def print_summary(summary: dict[str, Any], out: Path, console: Console) -> None:
    table = Table(title="Swarm demo summary")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key in (
        "val_loss_start",
        "val_loss_end",
        "val_loss_ratio",
        "rounds",
        "peers",
        "killed_peer",
        "round_at_kill",
        "replacement_joined_round",
        "replacement_synced_s",
        "duration_s",
    ):
        value = summary.get(key)
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    console.print(table)
    per_peer = Table(title="per peer")
    for column in ("peer", "rounds", "steps", "samples/s", "mean group", "last val loss"):
        per_peer.add_column(column, justify="right")
    for name, row in summary["per_peer"].items():
        per_peer.add_row(name, *(str(v) if not isinstance(v, float) else f"{v:.3f}" for v in row.values()))
    console.print(per_peer)
    console.print(f"wrote {out / 'summary.json'}, {out / 'loss.png'} and the run report {summary.get('report')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swarm.demo", description=__doc__.splitlines()[0])
    from bootstrap.cli import add_dataclass_arguments, dataclass_from_args

    add_dataclass_arguments(parser, DemoConfig)
    args = parser.parse_args(argv)
    console = Console()
    try:
        config = dataclass_from_args(DemoConfig, args)
    except ValueError as e:
        console.print(f"[bold red]error:[/] {e}")
        return 2
    summary = run_demo(config, console)
    print_summary(summary, Path(config.out), console)
    ratio = summary.get("val_loss_ratio")
    if ratio is None or ratio >= LOSS_RATIO_TARGET:
        console.print(f"[bold red]validation loss did not fall below {LOSS_RATIO_TARGET}x its start[/]")
        return 1
    if config.kill and summary["replacement_synced_s"] is None:
        console.print("[bold red]the replacement peer never trained on the run's state[/]")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
