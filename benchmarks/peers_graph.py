"""Resource-graph figures: record size, capability query completeness and time with N peers, memory
per peer, and how long a SIGKILLed peer stays visible (must be <= record expiry + one refresh period).

    python -m benchmarks.peers_graph [--peers 50] [--refresh-s 15] [--expiry-s 45] [--queries 10]

A query is a long-lived `ResourceGraph`'s, as a trainer or `swarm.peer` makes them: it keeps each
verified record until the record expires (`bootstrap.records.RecordBook`). Beside each, a fresh graph
makes the same DHT read with nothing kept (``one_read_*``; ``missed_records`` names what it missed).
Every peer is a real DHT node (its own DHT process and p2pd) publishing a signed record on a
heartbeat (under its shard's key, `bootstrap.records.peers_key`); their advertisers live in this
process, and ``refresh_failures`` counts the heartbeats whose store did not complete within its 10 s.
Memory per peer is its DHT process plus its p2pd (psutil; see benchmarks.gossip). The killed peer is a separate OS process, so nothing of it survives
to withdraw its record. Above 50 peers the benchmark first checks that the machine has the memory.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
from hivemind.utils.serializer import MSGPackSerializer
from rich.console import Console
from rich.table import Table

from benchmarks._common import run_metadata, save_result
from benchmarks.gossip import check_memory, memory_rows, peer_memory
from bootstrap import stop_dht, visible_maddrs
from bootstrap.identity import Identity
from bootstrap.network import start_swarm_dht
from peers import PEERS_SHARDS, Advertiser, ResourceGraph, dht_record_rejections, peers_key, sign_record
from peers.testing import record_builder

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
RESULTS = Path(__file__).parent / "results" / "peers_graph.json"

_CHILD = """
import sys, time, threading
from bootstrap import start_reaper
from peers.testing import record_builder
from peers import Advertiser
from bootstrap.identity import Identity
from bootstrap.network import start_swarm_dht
start_reaper()  # once this process is SIGKILLed, its DHT child and p2pd must go too
ident = Identity.generate()
dht = start_swarm_dht(ident, initial_peers=sys.argv[1:-2], host_maddrs=("/ip4/127.0.0.1/tcp/0",))
Advertiser(dht, ident, record_builder(ident), refresh_s=float(sys.argv[-2]), expiry_s=float(sys.argv[-1])).start()
print(ident.peer_id, flush=True)
threading.Event().wait(600)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers_graph", description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=50)
    parser.add_argument("--refresh-s", type=float, default=15.0)
    parser.add_argument("--expiry-s", type=float, default=45.0)
    parser.add_argument("--queries", type=int, default=10)
    parser.add_argument("--out", default=str(RESULTS), help="JSON output path (default: %(default)s)")
    args = parser.parse_args(argv)
    console = Console()
    try:
        if args.peers < 2 or args.queries < 1:
            raise ValueError(f"need peers >= 2 and queries >= 1, got {args.peers} and {args.queries}")
        check_memory(args.peers)
    except ValueError as e:
        console.print(f"[bold red]error:[/] {e}")
        return 2
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: every DHT and p2pd stops
    try:
        memory = psutil.virtual_memory().total
        result = {
            **run_metadata("peers_graph", argv, memory_total_bytes=memory),
            "config": {k: v for k, v in vars(args).items() if k != "out"},
            **run(args.peers, args.refresh_s, args.expiry_s, args.queries, console),
        }
    finally:
        signal.signal(signal.SIGTERM, previous)
    table = Table(title=f"resource graph on loopback: {args.peers} peers")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key in (
        "record_bytes",
        "shards",
        "refreshes",
        "refresh_failures",
        "all_visible_s",
        "failed_queries",
        "completeness_min",
        "query_s_median",
        "query_s_max",
        "one_read_completeness_min",
        "one_read_query_s_median",
        "killed_peer_vanish_s",
        "vanish_bound_s",
        "within_bound",
    ):
        value = result[key]
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    for label, value in memory_rows(result["memory"]):
        table.add_row(label, value)
    console.print(table)
    out = save_result(args.out, result)
    console.print(f"wrote {out}")
    return 0


def run(num_peers: int, refresh_s: float, expiry_s: float, num_queries: int, console: Console) -> dict:
    dhts, advertisers, victim = [], [], None
    try:
        first = start_swarm_dht(Identity.generate(), host_maddrs=LOOPBACK)
        dhts.append(first)
        initial = visible_maddrs(first)
        with console.status(f"starting {num_peers} peers"):
            for _ in range(num_peers):
                ident = Identity.generate()
                dht = start_swarm_dht(ident, initial_peers=initial, host_maddrs=LOOPBACK)
                dhts.append(dht)
                advertisers.append(
                    Advertiser(dht, ident, record_builder(ident), refresh_s=refresh_s, expiry_s=expiry_s).start()
                )
        record_bytes = len(MSGPackSerializer.dumps(sign_record(advertisers[0].last_record, advertisers[0].identity)))
        expected = {a.identity.peer_id for a in advertisers}
        reader = ResourceGraph(dhts[len(dhts) // 2])
        all_visible_s = _until_all_visible(reader, expected, timeout_s=expiry_s + 60)
        memory = peer_memory(dhts)
        times, completeness, failed, missing = [], [], [], []
        one_read_times, one_read_completeness = [], []
        for _ in range(num_queries):
            started = time.perf_counter()
            seen = _seen(reader)
            times.append(time.perf_counter() - started)
            completeness.append(len(seen & expected) / len(expected) if seen is not None else 0.0)
            if seen is None:
                failed.append(times[-1])
            # the same read by a fresh graph, with no record kept from earlier reads
            started = time.perf_counter()
            once = _seen(ResourceGraph(reader.dht))
            one_read_times.append(time.perf_counter() - started)
            one_read_completeness.append(len(once & expected) / len(expected) if once is not None else 0.0)
            if once is not None and expected - once:  # which records a read missed, and whether each is published
                missing.append(_missing(expected - once, advertisers, dhts))

        victim = subprocess.Popen(
            [sys.executable, "-c", _CHILD, *initial, str(refresh_s), str(expiry_s)], stdout=subprocess.PIPE, text=True
        )
        victim_id = victim.stdout.readline().strip()
        deadline = time.monotonic() + 60
        while victim_id not in (_seen(reader) or set()):
            if time.monotonic() > deadline:
                raise RuntimeError("the victim peer never appeared in the graph")
            time.sleep(0.2)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        killed_at = time.monotonic()
        with console.status("waiting for the killed peer to vanish"):
            while (seen := _seen(reader)) is None or victim_id in seen:
                if time.monotonic() - killed_at > expiry_s + refresh_s + 30:
                    raise RuntimeError("the killed peer did not vanish")
                time.sleep(0.2)
        vanish_s = time.monotonic() - killed_at
        return {
            "shards": PEERS_SHARDS,
            "refreshes": sum(a.published for a in advertisers),
            "refresh_failures": sum(a.failures for a in advertisers),
            "peers": num_peers,
            "record_bytes": record_bytes,
            "queries": num_queries,
            "all_visible_s": all_visible_s,
            "completeness": completeness,
            "query_s": times,
            "failed_queries": len(failed),
            "one_read_completeness": one_read_completeness,
            "one_read_query_s": one_read_times,
            "one_read_completeness_min": min(one_read_completeness),
            "one_read_query_s_median": statistics.median(one_read_times),
            "missed_records": missing,
            "reader_node_rejections": dht_record_rejections(reader.dht),
            "completeness_min": min(completeness),
            "query_s_median": statistics.median(times),
            "query_s_max": max(times),
            "refresh_s": refresh_s,
            "expiry_s": expiry_s,
            "memory": memory,
            "killed_peer_vanish_s": vanish_s,
            "vanish_bound_s": expiry_s + refresh_s,
            "within_bound": vanish_s <= expiry_s + refresh_s,
        }
    finally:
        if victim is not None and victim.poll() is None:
            victim.kill()
        for advertiser in advertisers:
            advertiser.close(withdraw=False)
        for dht in dhts:
            stop_dht(dht)


def _seen(reader: ResourceGraph) -> set[str] | None:
    """Peer IDs of the live records one query returns; None when the query failed (a DHT timeout)."""
    try:
        return {r.peer_id for r in reader.records()}
    except (TimeoutError, concurrent.futures.TimeoutError) as e:
        logging.getLogger(__name__).info("a resource-graph query failed: %r", e)
        return None


def _missing(peers: set[str], advertisers: list[Advertiser], dhts: list) -> list[dict]:
    """For each record a query missed: its shard, how old its last publication is, and whether a second
    query from another node finds it."""
    by_id = {a.identity.peer_id: a for a in advertisers}
    again = _seen(ResourceGraph(dhts[1])) or set()
    return [
        {
            "peer": peer,
            "shard": peers_key(peer),
            "published": by_id[peer].published,
            "failures": by_id[peer].failures,
            "record_age_s": time.time() - by_id[peer].last_record.issued_at if by_id[peer].last_record else None,
            "found_from_another_node": peer in again,
        }
        for peer in sorted(peers)
    ]


def _until_all_visible(reader: ResourceGraph, expected: set[str], timeout_s: float) -> float:
    """Seconds from now (the last advertiser started) until one query returns every record."""
    started = time.monotonic()
    while not expected <= (_seen(reader) or set()):
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"not every record became visible within {timeout_s:.0f}s")
        time.sleep(0.1)
    return time.monotonic() - started


if __name__ == "__main__":
    sys.exit(main())
