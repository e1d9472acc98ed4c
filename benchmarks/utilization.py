"""Compute utilization: how much of a peer's time goes to training, blocking rounds against overlapped ones.

For each preset and number of peers, in one run:

* ``plain``: as many plain training loops of the same model (charlm, the inner optimizer and batches of
  ``swarm.peer``, one torch thread each) running at once on this machine: the steps/s a peer could make
  if the swarm cost nothing. Sharing the cores cancels out; the swarm's daemons, codecs and DHT work
  count against it.
* for each link (netns test hosts shaped to ``--links`` Mbit/s, 0 unshaped) and each mode (``blocking``,
  ``overlapped``, ``overlapped-plain``: overlapped with ``--no-overlap-eager``, ``verified``: blocking with
  ``--verify-work``): a bootstrap node and the peers (``swarm.peer``, their defaults otherwise) train
  ``--steps`` steps each. A peer's rate is its steps from its first grouped round to its last step, over
  that time; utilization is the mean peer rate over the mean plain rate. Also: each round's time by
  phase (median), the share of rounds that grouped, and the validation loss once training has ended
  (the global parameters, the last round landed: equal samples in both modes).
* with ``--repeats N``: all of it N times, the plain loops again before each repeat and the modes' order
  rotated by one each time; a second table gives each arm's median utilization and range.

Prints a table and writes JSON (default benchmarks/results/utilization.json)::

    .venv/bin/python -m benchmarks.utilization --links 0,100,20 --peers 2,4 --presets small
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from benchmarks._common import make_lab, run_metadata, save_result, signals_unwind, start_bootstrap_node
from swarm.events import read_events

RESULTS = Path(__file__).parent / "results" / "utilization.json"
RUN = "utilization"
_WARMUP_STEPS = 10
KEEP_LOGS = False
"""Keep each arm's peer logs, events and ledgers (``--keep-logs``)."""
PEER_FLAGS: list[str] = []
"""Extra swarm.peer flags for every peer (``--peer-flags``)."""


def plain_worker(preset: str, steps: int, shard: int, num_shards: int, out: Path) -> None:
    """One plain loop: swarm.peer's model, inner optimizer and batches, no swarm; writes its steps/s."""
    import torch

    from swarm.peer import PeerConfig, make_inner_optimizer
    from swarm.tasks import get_task

    torch.set_num_threads(1)
    config = PeerConfig(task_preset=preset)
    task = get_task(config.task, preset=preset)
    torch.manual_seed(config.seed)
    model = task.build_model(seed=config.seed)
    optimizer = make_inner_optimizer(config, model.parameters())
    batches = task.train_batches(shard_index=shard, num_shards=num_shards, seed=config.seed)
    began = cpu_began = None
    for step in range(steps + _WARMUP_STEPS):
        if step == _WARMUP_STEPS:
            began, cpu_began = time.perf_counter(), time.process_time()
        task.loss(model, next(batches)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    rate = steps / (time.perf_counter() - began)
    out.write_text(json.dumps({"steps_per_s": rate, "cpu_s_per_step": (time.process_time() - cpu_began) / steps}))


def _plain(preset: str, peers: int, steps: int, work: Path, timeout_s: float) -> tuple[float, float]:
    """Steps/s of each of ``peers`` plain loops running at once (mean), and their CPU seconds per step."""
    import subprocess

    outs = [work / f"plain{i}.json" for i in range(peers)]
    argv = [sys.executable, "-m", "benchmarks.utilization", "--plain-worker", preset, str(steps)]
    procs = [subprocess.Popen([*argv, str(i), str(peers), str(out)]) for i, out in enumerate(outs)]
    for proc in procs:
        if proc.wait(timeout=timeout_s) != 0:
            raise RuntimeError(f"a plain loop failed (exit {proc.returncode})")
    results = [json.loads(out.read_text()) for out in outs]
    return statistics.mean(r["steps_per_s"] for r in results), statistics.mean(r["cpu_s_per_step"] for r in results)


MODE_FLAGS = {
    "blocking": [],
    "overlapped": ["--overlap"],
    "overlapped-plain": ["--overlap", "--no-overlap-eager"],  # the phase starts from the local parameters
    "verified": ["--verify-work"],
}
"""swarm.peer flags of each mode: ``verified`` is blocking rounds with verified work (its default check rate)."""


def _peer_argv(slot: int, peers: int, preset: str, steps: int, maddrs: list[str], host: Any, work: Path, mode: str):
    return [*_base_argv(slot, peers, preset, steps, maddrs, host, work), *MODE_FLAGS[mode]]


def _base_argv(slot: int, peers: int, preset: str, steps: int, maddrs: list[str], host: Any, work: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "swarm.peer",
        "--initial-peers",
        *maddrs,
        "--run",
        RUN,
        "--task",
        "charlm",
        "--task-preset",
        preset,
        "--host-maddrs",
        host.maddr(0),
        "--shard-index",
        str(slot),
        "--num-shards",
        str(peers),
        "--identity-key",
        str(work / f"peer{slot}.key"),
        "--events",
        str(work / f"peer{slot}.jsonl"),
        "--torch-threads",
        "1",
        "--no-progress",
        "--max-steps",
        str(steps),
        "--eval-every",
        "0",  # no validation while training (a plain loop has none either); once at the end
        "--target-group-size",
        str(peers),
        "--checkpoint-dir",
        str(work / "checkpoints"),
        "--ledger-dir",
        str(work / "ledgers"),
        *PEER_FLAGS,
    ]


class CpuMeter:
    """CPU seconds of each peer's process tree by part: the peer's own process (training and the round),
    its DHT process, its p2pd and the rest (the watchdog), sampled every half second while the peers run,
    so that the CPU of a window (from the first grouped round to the last step) can be taken apart."""

    def __init__(self, pids: list[int]) -> None:
        self._roots = pids
        self._series: dict[int, tuple[int, str, list[tuple[float, float]]]] = {}  # pid -> (peer, part, samples)

    def sample(self) -> None:
        now = time.time()  # the clock of the peers' events
        for peer, pid in enumerate(self._roots):
            try:
                root = psutil.Process(pid)
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for proc in tree:
                try:
                    times = proc.cpu_times()
                    if proc.pid not in self._series:
                        self._series[proc.pid] = (peer, self._part(proc, root), [])
                except psutil.Error:
                    continue
                self._series[proc.pid][2].append((now, times.user + times.system))

    @staticmethod
    def _part(proc: psutil.Process, root: psutil.Process) -> str:
        if proc.pid == root.pid:
            return "peer"
        if proc.name() == "p2pd":
            return "p2pd"
        return "other" if "lifetime" in " ".join(proc.cmdline()) else "dht"

    def window(self, peer: int, begin: float, end: float) -> dict[str, float]:
        """CPU seconds of ``peer``'s processes, by part, between the samples nearest ``begin`` and ``end``."""
        out: dict[str, float] = {}
        for owner, part, samples in self._series.values():
            inside = [cpu for t, cpu in samples if begin <= t <= end]
            if owner == peer and len(inside) >= 2:
                out[part] = out.get(part, 0.0) + inside[-1] - inside[0]
        return out


def _peer_figures(events: list[dict]) -> dict[str, Any]:
    rounds = [e for e in events if e["event"] == "round"]
    grouped = [e for e in rounds if (e.get("group_size") or 0) >= 2]
    train = [e for e in events if e["event"] == "train"]
    final = [e for e in events if e["event"] == "val" and e.get("final")]
    if not grouped or not train:
        return {"steps_per_s": None, "grouped": 0, "rounds": len(rounds)}
    first, last = grouped[0], train[-1]
    rate = (last["step"] - first["step"]) / max(last["t"] - first["t"], 1e-9)
    window = (first["t"], last["t"])
    phases: dict[str, list[float]] = {}
    for e in rounds:
        for phase, seconds in ((e.get("record") or {}).get("phase_s") or {}).items():
            phases.setdefault(phase, []).append(seconds)
    checks = [e for e in events if e["event"] == "work_check"]
    return {
        "steps_per_s": rate,
        "window": window,
        "window_steps": max(1, last["step"] - first["step"]),
        "rounds": len(rounds),
        "grouped": len(grouped),
        "grouped_per_min": 60 * len(grouped) / max(last["t"] - first["t"], 1e-9),
        "work_checks": len(checks),
        "work_checks_passed": sum(bool(e.get("ok")) for e in checks),
        # what an honest run must never have: each check that did not pass, and each exclusion, with its reason
        "work_not_passed": [{k: e.get(k) for k in ("round", "prover", "reason")} for e in checks if not e.get("ok")],
        "work_excluded": [{k: e.get(k) for k in ("peer", "reason")} for e in events if e["event"] == "work_excluded"],
        "round_s": statistics.median(e["duration_s"] for e in rounds),
        "phase_s": {phase: statistics.median(values) for phase, values in phases.items()},
        "val_loss": final[-1]["val_loss"] if final else None,
    }


def _swarm(
    *, preset: str, peers: int, steps: int, link: float, mode: str, lab_kind: str, console: Console
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="swarm-utilization-"))
    lab, fallback = make_lab(lab_kind, rate_mbit=link, num_hosts=peers + 1, console=console)
    with lab:
        _, maddrs = start_bootstrap_node(lab, peers, work=work, timeout_s=120)
        if maddrs is None:
            raise RuntimeError(f"the bootstrap node did not start; see {work / 'bootstrap.log'}")
        procs = [
            lab.spawn(
                slot,
                _peer_argv(slot, peers, preset, steps, maddrs, lab.hosts[slot], work, mode),
                log=work / f"peer{slot}.log",
            )
            for slot in range(peers)
        ]
        deadline = time.monotonic() + 60 + steps * peers  # generous: a peer makes >= 1 step/s here
        meter = CpuMeter([proc.pid for proc in procs])
        for proc in procs:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the peers did not finish {steps} steps in time; see the logs in {work}")
                meter.sample()
                time.sleep(0.5)
            if proc.returncode != 0:
                raise RuntimeError(f"a peer exited {proc.returncode}; see the logs in {work}")
    figures = [_peer_figures(read_events(work / f"peer{slot}.jsonl")) for slot in range(peers)]
    for slot, figure in enumerate(figures):
        if figure.get("window"):
            cpu = meter.window(slot, *figure["window"])
            figure["cpu_s_per_step"] = {part: seconds / figure["window_steps"] for part, seconds in cpu.items()}
    for slot, f in enumerate(figures):
        for item in f.get("work_not_passed", []) + f.get("work_excluded", []):
            console.print(f"  [red]peer {slot}: a check did not pass or a peer was excluded: {item}[/]")
    if KEEP_LOGS:
        console.print(f"  logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    rates = [f["steps_per_s"] for f in figures]
    losses = [f["val_loss"] for f in figures if f.get("val_loss") is not None]
    return {
        "lab": lab.kind,
        "lab_fallback": fallback,
        "steps_per_s": statistics.mean(rates) if None not in rates else None,
        "grouped_share": sum(f["grouped"] for f in figures) / max(1, sum(f["rounds"] for f in figures)),
        "grouped_per_min": statistics.mean(f.get("grouped_per_min", 0.0) for f in figures),
        "work_checks": sum(f.get("work_checks", 0) for f in figures),
        "work_checks_passed": sum(f.get("work_checks_passed", 0) for f in figures),
        "work_not_passed": [item for f in figures for item in f.get("work_not_passed", [])],
        "round_s": statistics.median(f["round_s"] for f in figures if "round_s" in f),
        "phase_s": {
            phase: statistics.median(f["phase_s"][phase] for f in figures if phase in f.get("phase_s", {}))
            for phase in ("matchmaking", "allreduce", "total")
            if any(phase in f.get("phase_s", {}) for f in figures)
        },
        "val_loss": statistics.mean(losses) if losses else None,
        "cpu_s_per_step": {
            part: statistics.mean(f.get("cpu_s_per_step", {}).get(part, 0.0) for f in figures)
            for part in sorted({part for f in figures for part in f.get("cpu_s_per_step", {})})
        },
        "per_peer": figures,
    }


def arm_order(modes: list[str], repeat: int) -> list[str]:
    """The modes in the order repeat ``repeat`` runs them: rotated by one each repeat, so that over
    ``len(modes)`` repeats every mode runs in every position once (two runs at stop 54 suggested that the arm
    run first after the plain loops pays more CPU a step; four rotated repeats put it down to noise)."""
    shift = repeat % len(modes)
    return modes[shift:] + modes[:shift]


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (preset, peers, link, mode) over the repeats: median, lowest and highest utilization."""
    arms: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        arms.setdefault((row["preset"], row["peers"], row["link_mbit"], row["mode"]), []).append(row)
    out = []
    for (preset, peers, link, mode), runs in arms.items():
        values = [r["utilization"] for r in runs if r["utilization"] is not None]
        losses = [r["val_loss"] for r in runs if r["val_loss"] is not None]
        out.append(
            {
                "preset": preset,
                "peers": peers,
                "link_mbit": link,
                "mode": mode,
                "runs": len(runs),
                "utilization_median": statistics.median(values) if values else None,
                "utilization_min": min(values, default=None),
                "utilization_max": max(values, default=None),
                "positions": [r["position"] for r in runs],
                "val_loss_median": statistics.median(losses) if losses else None,
            }
        )
    return out


def run(
    *,
    presets: list[str],
    peer_counts: list[int],
    links: list[float],
    modes: list[str],
    steps: int,
    lab: str,
    repeats: int = 1,
) -> dict[str, Any]:
    console = Console()
    rows = []
    for preset in presets:
        for peers in peer_counts:
            for repeat in range(repeats):
                # the plain loops again before each repeat: the machine's speed drifts over a long run
                with tempfile.TemporaryDirectory(prefix="swarm-plain-") as tmp:
                    plain, plain_cpu = _plain(preset, peers, steps, Path(tmp), timeout_s=60 + steps * peers)
                console.print(
                    f"{preset}, {peers} plain loops (repeat {repeat + 1}/{repeats}):"
                    f" {plain:.2f} steps/s each, {plain_cpu:.3f} CPU s a step"
                )
                for link in links:
                    for position, mode in enumerate(arm_order(modes, repeat)):
                        arm = _swarm(
                            preset=preset, peers=peers, steps=steps, link=link, mode=mode, lab_kind=lab, console=console
                        )
                        rate = arm["steps_per_s"]
                        row = {
                            "preset": preset,
                            "peers": peers,
                            "link_mbit": link,
                            "mode": mode,
                            "repeat": repeat,
                            "position": position,
                            "plain_steps_per_s": plain,
                            "plain_cpu_s_per_step": plain_cpu,
                        }
                        row.update(arm)
                        row["utilization"] = rate / plain if rate else None
                        rows.append(row)
                        console.print(
                            f"  {link or 'unshaped'} Mbit/s, {mode}: {rate or 0:.2f} steps/s,"
                            f" utilization {row['utilization'] or 0:.3f}, val loss {arm['val_loss']}; CPU s a step: "
                            + ", ".join(f"{part} {seconds:.3f}" for part, seconds in arm["cpu_s_per_step"].items())
                            + f" (plain loop {plain_cpu:.3f})"
                        )
    return {
        "steps": steps,
        "repeats": repeats,
        "peer_flags": list(PEER_FLAGS),
        "rows": rows,
        "summary": summarize(rows),
    }


def print_table(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"compute utilization: steps/s of a peer over a plain loop's ({result['steps']} steps each)")
    columns = ("preset", "peers", "link", "mode", "steps/s", "plain", "utilization", "round s", "matchmaking s")
    for column in (*columns, "grouped", "grouped/min", "checks ok", "val loss"):
        table.add_column(column, justify="right")
    for r in result["rows"]:
        table.add_row(
            r["preset"],
            str(r["peers"]),
            f"{r['link_mbit']:g} Mbit/s" if r["link_mbit"] else f"unshaped ({r['lab']})",
            r["mode"],
            f"{r['steps_per_s'] or 0:.2f}",
            f"{r['plain_steps_per_s']:.2f}",
            f"{r['utilization'] or 0:.3f}",
            f"{r['round_s']:.2f}",
            f"{r['phase_s'].get('matchmaking', 0):.2f}",
            f"{r['grouped_share']:.2f}",
            f"{r.get('grouped_per_min', 0):.2f}",
            f"{r.get('work_checks_passed', 0)}/{r.get('work_checks', 0)}",
            "-" if r["val_loss"] is None else f"{r['val_loss']:.4f}",
        )
    console.print(table)
    if result.get("repeats", 1) > 1:
        summary = Table(title=f"over {result['repeats']} repeats, each mode's order rotated (median, lowest-highest)")
        for column in ("preset", "peers", "link", "mode", "runs", "utilization", "range", "positions", "val loss"):
            summary.add_column(column, justify="right")
        for r in result["summary"]:
            summary.add_row(
                r["preset"],
                str(r["peers"]),
                f"{r['link_mbit']:g} Mbit/s" if r["link_mbit"] else "unshaped",
                r["mode"],
                str(r["runs"]),
                f"{r['utilization_median'] or 0:.3f}",
                f"{r['utilization_min'] or 0:.3f}-{r['utilization_max'] or 0:.3f}",
                ",".join(str(p) for p in r["positions"]),
                "-" if r["val_loss_median"] is None else f"{r['val_loss_median']:.4f}",
            )
        console.print(summary)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--plain-worker"]:
        preset, steps, shard, num_shards, out = argv[1:6]
        plain_worker(preset, int(steps), int(shard), int(num_shards), Path(out))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.utilization", description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="small", help="charlm presets, comma-separated (default: %(default)s)")
    parser.add_argument("--peers", default="2", help="numbers of peers, comma-separated (default: %(default)s)")
    parser.add_argument("--links", default="0,100,20", help="Mbit/s per link, 0 unshaped (default: %(default)s)")
    parser.add_argument("--modes", default="blocking,overlapped", help="(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="steps per peer and plain loop (default: %(default)s)")
    parser.add_argument("--lab", choices=("auto", "netns", "loopback"), default="auto", help="(default: %(default)s)")
    parser.add_argument("--peer-flags", default="", help="extra swarm.peer flags, e.g. '--checkpoint-every 0'")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every arm this many times, the plain loops before each repeat and the modes' order rotated"
        " by one each time (default: %(default)s)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON result (default: %(default)s)")
    parser.add_argument("--keep-logs", action="store_true", help="keep each arm's logs, events and ledgers")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not set(modes) <= set(MODE_FLAGS) or args.steps < 20 or args.repeats < 1:
        parser.error(f"--modes: some of {', '.join(MODE_FLAGS)}; --steps: at least 20; --repeats: at least 1")
    PEER_FLAGS[:] = shlex.split(args.peer_flags)
    global KEEP_LOGS
    KEEP_LOGS = args.keep_logs
    console = Console()
    try:
        with signals_unwind():
            result = run(
                presets=[p.strip() for p in args.presets.split(",") if p.strip()],
                peer_counts=[int(p) for p in args.peers.split(",")],
                links=[float(x) for x in args.links.split(",")],
                modes=modes,
                steps=args.steps,
                lab=args.lab,
                repeats=args.repeats,
            )
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    except RuntimeError as e:
        console.print(f"[red]{e}[/]")
        return 1
    result["meta"] = run_metadata("utilization", argv)
    print_table(result, console)
    console.print(f"wrote {save_result(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
