"""Time for a sealed manifest to reach every one of N peers by epidemic push on loopback, and the
memory each peer takes.

    python -m benchmarks.gossip [--peers 50] [--fanout 8] [--repeats 5] [--idle-s 10]

Every peer is a real DHT node (its own DHT process and p2pd) with its own `ManifestGossip`; the
gossip services of all peers live in this process (one thread and event loop each), which is what
fits N = 50 on a small machine: a peer costs its DHT process and its p2pd, measured with psutil
(RSS, and USS/PSS, which do not count the pages a forked DHT process shares with this one). A
deployed peer also has its own Python main process (torch, the trainer), not counted here.
The CPU time of every process (this one, the DHT processes, the daemons) is counted over ``--idle-s``
seconds of the idle swarm and over each spread (``cpu_idle``, ``cpu_spreads``): benchmarks.scale_model
takes a push's CPU cost on this machine from it. Above 50 peers the benchmark first checks that the
machine has the memory for them.
"""

from __future__ import annotations

import argparse
import logging
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from benchmarks._common import run_metadata, save_result
from bootstrap import start_dht, stop_dht, visible_maddrs
from bootstrap.identity import Identity
from swarm.checkpoint import Manifest, SignedManifest, sign_manifest, verify_manifest
from swarm.checkpoint.gossip import GossipConfig, ManifestGossip

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RESULTS = Path(__file__).parent / "results" / "gossip.json"
RUN = "gossip-bench"
TARGET_S = 2.0
PEER_MEMORY_ESTIMATE_BYTES = 150 << 20
"""A conservative bound of one peer's unique memory here (DHT process + p2pd: about 110 MB PSS measured)."""
_POLL_S = 0.05


def _sealed(step: int, signers: list[Identity]) -> bytes:
    manifest = Manifest(
        version=1,
        run_id=RUN,
        step=step,
        round=step,
        task="charlm",
        config_digest="a" * 64,
        parent="",
        shards=(),
        participants=tuple(sorted(s.peer_id for s in signers)),
        metrics={},
        created_at=1_800_000_000 + step,
    )
    signed = SignedManifest(manifest=manifest, signatures={})
    for signer in signers:
        signed = signed.with_signature(*sign_manifest(manifest, signer))
    return signed.to_bytes()


def _verify(data: bytes) -> tuple[str, int]:
    manifest = verify_manifest(data, run_id=RUN)
    return manifest.digest(), manifest.step


# ------------------------------------------------------------------------------------ memory
def check_memory(num_peers: int) -> None:
    """Refuse to start more than 50 peers when the machine does not have the memory for them."""
    available = psutil.virtual_memory().available
    need = num_peers * PEER_MEMORY_ESTIMATE_BYTES
    if num_peers > 50 and need > 0.7 * available:
        raise ValueError(
            f"{num_peers} peers need about {need / 2**30:.1f} GiB, but only {available / 2**30:.1f} "
            f"GiB are available (keeping 30% free); use --peers 50 or fewer"
        )


def _mem(proc: psutil.Process) -> dict[str, int]:
    info = proc.memory_full_info()
    return {"rss": info.rss, "uss": info.uss, "pss": getattr(info, "pss", info.uss)}


def _peer_processes(dht: Any) -> tuple[psutil.Process, list[psutil.Process]]:
    """A peer's DHT process and its p2pd (none found: empty). Raises psutil.Error if the process is gone."""
    dht_proc = psutil.Process(dht.pid)
    return dht_proc, [c for c in dht_proc.children(recursive=True) if c.name() == "p2pd"]


def peer_memory(dhts: list) -> dict[str, Any]:
    """Memory of each peer (its DHT process plus that process's p2pd) and of this process, in bytes."""
    per_peer = []
    for dht in dhts:
        try:
            dht_proc, p2pd = _peer_processes(dht)
            python, daemon = _mem(dht_proc), _mem(p2pd[0]) if p2pd else {"rss": 0, "uss": 0, "pss": 0}
        except psutil.Error:
            continue
        per_peer.append({"python": python, "p2pd": daemon, **{k: python[k] + daemon[k] for k in python}})
    main = _mem(psutil.Process())

    def mean(key: str) -> float:
        return statistics.mean(p[key] for p in per_peer) if per_peer else 0.0

    return {
        "peers_measured": len(per_peer),
        "per_peer_rss_mean": mean("rss"),
        "per_peer_uss_mean": mean("uss"),
        "per_peer_pss_mean": mean("pss"),
        "p2pd_rss_mean": statistics.mean(p["p2pd"]["rss"] for p in per_peer) if per_peer else 0.0,
        "python_rss_mean": statistics.mean(p["python"]["rss"] for p in per_peer) if per_peer else 0.0,
        "main_process": main,
        "main_process_pss_per_peer": main["pss"] / max(1, len(per_peer)),
        "per_peer": per_peer,
    }


def peer_processes(dhts: list) -> dict[str, list[psutil.Process]]:
    """This process, every peer's DHT process and every peer's p2pd, for CPU accounting."""
    groups: dict[str, list[psutil.Process]] = {"main": [psutil.Process()], "dht": [], "p2pd": []}
    for dht in dhts:
        try:
            dht_proc, p2pd = _peer_processes(dht)
        except psutil.Error:
            continue
        groups["dht"].append(dht_proc)
        groups["p2pd"].extend(p2pd)
    return groups


def cpu_seconds(groups: dict[str, list[psutil.Process]]) -> dict[str, float]:
    """User + system CPU seconds each group of processes has used so far (a process gone counts 0)."""
    totals = {}
    for name, procs in groups.items():
        total = 0.0
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        totals[name] = total
    return totals


def _cpu_delta(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """CPU seconds each group used between two snapshots, and the cores each kept busy on average."""
    used = {name: after[name] - before[name] for name in before}
    return {
        "wall_s": wall_s,
        **{f"{k}_cpu_s": v for k, v in used.items()},
        **{f"{k}_cores": v / wall_s for k, v in used.items()},
    }


def memory_rows(memory: dict[str, Any]) -> list[tuple[str, str]]:
    mib = 2**20
    return [
        (
            "RSS per peer: DHT process + p2pd (MiB)",
            f"{memory['per_peer_rss_mean'] / mib:.0f} ({memory['python_rss_mean'] / mib:.0f} + "
            f"{memory['p2pd_rss_mean'] / mib:.0f})",
        ),
        (
            "USS / PSS per peer (MiB)",
            f"{memory['per_peer_uss_mean'] / mib:.0f} / {memory['per_peer_pss_mean'] / mib:.0f}",
        ),
        (
            "this process: RSS, PSS per peer (MiB)",
            f"{memory['main_process']['rss'] / mib:.0f}, {memory['main_process_pss_per_peer'] / mib:.1f}",
        ),
    ]


def start_dhts(num_peers: int, console: Console) -> list:
    """``num_peers`` loopback DHT nodes, all joined through the first; appended to as they start."""
    dhts: list = []
    with console.status(f"starting {num_peers} DHT nodes") as status:
        dhts.append(start_dht(host_maddrs=LOOPBACK, nat_port_map=False))
        initial = visible_maddrs(dhts[0])
        while len(dhts) < num_peers:
            dhts.append(start_dht(initial, host_maddrs=LOOPBACK, nat_port_map=False))
            status.update(f"starting {num_peers} DHT nodes: {len(dhts)}")
    return dhts


# ------------------------------------------------------------------------------------ spread
def _spread_once(
    gossips: list[ManifestGossip],
    publisher: int,
    step: int,
    signers: list[Identity],
    timeout_s: float,
    accepted: dict[int, dict[int, float]],
) -> list[float]:
    """Publish manifest ``step`` at one peer; seconds until each peer held it, sorted (only the peers it
    reached within ``timeout_s``). A peer's time is taken where it accepts the manifest (its ``on_new``,
    in its gossip thread), not by a poller: with 100 peers' gossip threads in this one process, a poller
    got the GIL every 0.2-0.5 s and saw arrivals that late."""
    data = _sealed(step, signers)
    started = time.monotonic()
    # publish() returns once its own pushes are done: run it beside the wait
    publishing = threading.Thread(target=gossips[publisher].publish, args=(data,), daemon=True)
    publishing.start()
    while len(accepted.get(step, ())) < len(gossips) and time.monotonic() - started < timeout_s:
        time.sleep(_POLL_S)
    publishing.join(timeout=timeout_s)
    return sorted(t - started for t in dict(accepted.get(step, {})).values() if t - started <= timeout_s)


def _hops(sources: dict[int, str | None], ids: list[str]) -> dict[int, int | None]:
    """Each reached peer's number of pushes from the publisher (0), along the push that brought it the
    manifest first; None for a peer that had it from the DHT index (a pull, not a push)."""
    index = {peer_id: i for i, peer_id in enumerate(ids)}
    hops: dict[int, int | None] = {}

    def depth(i: int, seen: frozenset = frozenset()) -> int | None:
        if i not in hops:
            source = sources.get(i)
            parent = index.get(source) if source is not None else None
            if source is None:
                hops[i] = 0
            elif parent is None or parent in seen or parent not in sources:
                hops[i] = None
            else:
                above = depth(parent, seen | {i})
                hops[i] = None if above is None else above + 1
        return hops[i]

    for i in sources:
        depth(i)
    return hops


def _hops_to_last(hops: dict[int, int | None], num_peers: int) -> int | None:
    """Pushes to the last peer of a spread that reached every peer by pushes alone; None otherwise."""
    return max(hops.values()) if len(hops) == num_peers and None not in hops.values() else None


class _DestroyedTasks(logging.Handler):
    """Counts asyncio's "Task was destroyed but it is pending!" reports: a handler task that the garbage
    collector took mid-flight (a push that was never forwarded)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "Task was destroyed but it is pending" in record.getMessage():
            self.count += 1


def run(
    num_peers: int, fanout: int, repeats: int, console: Console, timeout_s: float = 30.0, idle_s: float = 10.0
) -> dict[str, Any]:
    dhts, gossips, ids = [], [], []
    destroyed = _DestroyedTasks()
    logging.getLogger("asyncio").addHandler(destroyed)
    try:
        dhts = start_dhts(num_peers, console)
        with console.status("starting the gossip services"):
            # as in a run (swarm.checkpoint.sync: ANNOUNCERS of the sealing group), only the peer that
            # publishes a manifest writes it into the DHT index; the peers it reaches only forward it
            origin = [0]
            accepted: dict[int, dict[int, float]] = {}

            sources: dict[int, dict[int, str | None]] = {}

            def on_new(data: bytes, digest: str, step: int, i: int) -> None:
                accepted.setdefault(step, {}).setdefault(i, time.monotonic())
                newest = gossips[i].newest
                sources.setdefault(step, {}).setdefault(i, newest[3] if newest is not None else None)

            gossips = [
                ManifestGossip(
                    d,
                    run_id=RUN,
                    verify=_verify,
                    peers=lambda: ids,
                    on_new=lambda data, digest, step, i=i: on_new(data, digest, step, i),
                    config=GossipConfig(fanout=fanout),
                    announce=lambda data, digest, i=i: i == origin[0],
                )
                for i, d in enumerate(dhts)
            ]
        ids.extend(g.peer_id for g in gossips)
        memory = peer_memory(dhts)
        signers = [Identity.generate(), Identity.generate()]
        procs = peer_processes(dhts)
        with console.status(f"CPU of the idle swarm ({idle_s:.0f} s)"):
            before, started = cpu_seconds(procs), time.monotonic()
            time.sleep(idle_s)  # a measuring window, not a synchronisation
            idle = _cpu_delta(before, cpu_seconds(procs), time.monotonic() - started)
        arrivals, hops, spread_cpu = [], [], []
        for step in range(1, repeats + 1):
            origin[0] = step % num_peers
            pushes = sum(g.received for g in gossips)
            with console.status(f"manifest {step}/{repeats}"):
                before, started = cpu_seconds(procs), time.monotonic()
                arrivals.append(_spread_once(gossips, step % num_peers, step, signers, timeout_s, accepted))
                spread_cpu.append(
                    {
                        **_cpu_delta(before, cpu_seconds(procs), time.monotonic() - started),
                        "pushes_received": sum(g.received for g in gossips) - pushes,
                    }
                )
            hops.append(_hops(sources.get(step, {}), ids))
        counters = {
            "received": sum(g.received for g in gossips),
            "forwarded": sum(g.forwarded for g in gossips),
            "duplicates_dropped_unverified": sum(g.duplicates for g in gossips),
            "rejected": sum(sum(g.rejected.values()) for g in gossips),
            "handler_tasks_destroyed": destroyed.count,
        }
    finally:
        for gossip in gossips:
            gossip.close()
        for dht in dhts:
            stop_dht(dht)
        logging.getLogger("asyncio").removeHandler(destroyed)
    complete = [a[-1] for a in arrivals if len(a) == num_peers]
    to_last = [_hops_to_last(h, num_peers) for h in hops]
    complete_hops = [h for h in to_last if h is not None]
    pull = GossipConfig().pull_interval_s
    return {
        "peers": num_peers,
        "fanout": fanout,
        "repeats": repeats,
        "pull_interval_s": pull,
        "timeout_s": timeout_s,
        "to_all_s": [a[-1] if len(a) == num_peers else None for a in arrivals],
        "complete_spreads": len(complete),
        "to_all_s_median": statistics.median(complete) if complete else None,
        "to_all_s_max": max(complete) if len(complete) == repeats else None,
        "to_half_s_median": statistics.median(a[num_peers // 2] for a in arrivals if len(a) > num_peers // 2),
        "reached_within_target": [sum(t < TARGET_S for t in a) for a in arrivals],
        "target_s": TARGET_S,
        "within_target": sum(t < TARGET_S for t in complete),
        "arrivals_s": arrivals,
        "hops": hops,
        "hops_to_all": to_last,
        "hops_to_all_median": statistics.median(complete_hops) if complete_hops else None,
        "hops_to_all_mean": statistics.mean(complete_hops) if complete_hops else None,
        "counters": counters,
        "memory": memory,
        "cpu_idle": idle,
        "cpu_spreads": spread_cpu,
    }


def print_table(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"manifest gossip on loopback: {result['peers']} peers, fanout {result['fanout']}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("to all peers, each spread (s)", " ".join(_fmt(t) for t in result["to_all_s"]))
    table.add_row("to half the peers, median (s)", _fmt(result["to_half_s_median"]))
    table.add_row(
        "pushes from the publisher to the last peer, each spread",
        " ".join("-" if h is None else str(h) for h in result["hops_to_all"]),
    )
    table.add_row(
        f"spreads within the {result['target_s']:.0f} s target",
        f"{result['within_target']}/{result['repeats']} (complete within {result['timeout_s']:.0f} s: "
        f"{result['complete_spreads']})",
    )
    table.add_row(
        f"peers reached within {result['target_s']:.0f} s, each spread",
        " ".join(str(n) for n in result["reached_within_target"]),
    )
    table.add_row("gossip handler tasks lost to the GC", str(result["counters"]["handler_tasks_destroyed"]))
    for label, value in memory_rows(result["memory"]):
        table.add_row(label, value)
    console.print(table)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gossip", description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=50)
    parser.add_argument("--fanout", type=int, default=GossipConfig().fanout)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--idle-s", type=float, default=10.0, help="seconds the idle swarm's CPU is counted before the spreads"
    )
    parser.add_argument("--out", default=str(RESULTS), help="JSON output path (default: %(default)s)")
    args = parser.parse_args(argv)
    console = Console()
    try:
        if args.peers < 2 or args.repeats < 1 or args.idle_s <= 0:
            raise ValueError(
                f"need peers >= 2, repeats >= 1 and idle-s > 0, got {args.peers}, {args.repeats} and {args.idle_s}"
            )
        check_memory(args.peers)
    except ValueError as e:
        console.print(f"[bold red]error:[/] {e}")
        return 2
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: every DHT and p2pd stops
    try:
        result = {
            **run_metadata("gossip", argv, memory_total_bytes=psutil.virtual_memory().total),
            "config": {"peers": args.peers, "fanout": args.fanout, "repeats": args.repeats},
            **run(args.peers, args.fanout, args.repeats, console, idle_s=args.idle_s),
        }
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_table(result, console)
    out = save_result(args.out, result)
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
