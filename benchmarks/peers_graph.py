"""Resource-graph figures: record size, query completeness and time with N peers, and how long a
SIGKILLed peer stays visible (must be <= record expiry + one refresh period).

    python -m benchmarks.peers_graph [--peers 20] [--refresh-s 15] [--expiry-s 45]

Every peer is a real DHT node (its own p2pd) publishing a signed record on a heartbeat; the
killed one is a separate OS process, so nothing of it survives to withdraw its record.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hivemind.utils.serializer import MSGPackSerializer
from rich.console import Console
from rich.table import Table

from bootstrap import stop_dht, visible_maddrs
from peers import Advertiser, ResourceGraph, sign_record
from peers.testing import record_builder
from swarm.identity import Identity
from swarm.network import start_swarm_dht

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
RESULTS = Path(__file__).parent / "results" / "peers_graph.json"

_CHILD = """
import sys, time, threading
from bootstrap import start_reaper
from peers.testing import record_builder
from peers import Advertiser
from swarm.identity import Identity
from swarm.network import start_swarm_dht
start_reaper()  # once this process is SIGKILLed, its DHT child and p2pd must go too
ident = Identity.generate()
dht = start_swarm_dht(ident, initial_peers=sys.argv[1:-2], host_maddrs=("/ip4/127.0.0.1/tcp/0",))
Advertiser(dht, ident, record_builder(ident), refresh_s=float(sys.argv[-2]), expiry_s=float(sys.argv[-1])).start()
print(ident.peer_id, flush=True)
threading.Event().wait(600)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers_graph", description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=20)
    parser.add_argument("--refresh-s", type=float, default=15.0)
    parser.add_argument("--expiry-s", type=float, default=45.0)
    parser.add_argument("--queries", type=int, default=10)
    args = parser.parse_args(argv)
    console = Console()
    result = run(args.peers, args.refresh_s, args.expiry_s, args.queries, console)
    table = Table(title="resource graph on loopback")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {RESULTS}")
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
                advertisers.append(Advertiser(dht, ident, record_builder(ident), refresh_s=refresh_s,
                                              expiry_s=expiry_s).start())
        record_bytes = len(MSGPackSerializer.dumps(sign_record(advertisers[0].last_record, advertisers[0].identity)))
        expected = {a.identity.peer_id for a in advertisers}
        reader = ResourceGraph(dhts[len(dhts) // 2])
        times, completeness = [], []
        for _ in range(num_queries):
            started = time.perf_counter()
            seen = {r.peer_id for r in reader.records()}
            times.append(time.perf_counter() - started)
            completeness.append(len(seen & expected) / len(expected))

        victim = subprocess.Popen([sys.executable, "-c", _CHILD, *initial, str(refresh_s), str(expiry_s)],
                                  stdout=subprocess.PIPE, text=True)
        victim_id = victim.stdout.readline().strip()
        deadline = time.monotonic() + 60
        while victim_id not in {r.peer_id for r in reader.records()}:
            if time.monotonic() > deadline:
                raise RuntimeError("the victim peer never appeared in the graph")
            time.sleep(0.2)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        killed_at = time.monotonic()
        with console.status("waiting for the killed peer to vanish"):
            while victim_id in {r.peer_id for r in reader.records()}:
                if time.monotonic() - killed_at > expiry_s + refresh_s + 30:
                    raise RuntimeError("the killed peer did not vanish")
                time.sleep(0.2)
        vanish_s = time.monotonic() - killed_at
        return {"peers": num_peers, "record_bytes": record_bytes, "queries": num_queries,
                "completeness_min": min(completeness), "query_s_median": statistics.median(times),
                "query_s_max": max(times), "refresh_s": refresh_s, "expiry_s": expiry_s,
                "killed_peer_vanish_s": vanish_s, "vanish_bound_s": expiry_s + refresh_s,
                "within_bound": vanish_s <= expiry_s + refresh_s}
    finally:
        if victim is not None and victim.poll() is None:
            victim.kill()
        for advertiser in advertisers:
            advertiser.close(withdraw=False)
        for dht in dhts:
            stop_dht(dht)


if __name__ == "__main__":
    sys.exit(main())
