"""`python -m peers list|runs --initial-peers ...`: the live resource graph and the open runs.

    python -m peers list --initial-peers /ip4/.../p2p/Qm... [--run NAME] [--json]
    python -m peers runs --initial-peers /ip4/.../p2p/Qm... [--json]

Joins the DHT as a client (it stores nothing and serves nothing), reads and verifies every
capability record, prints a table (or JSON for scripts), and leaves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from bootstrap.cli import command_parser

EXIT_BAD_INPUT = 2


_COMMANDS = {
    "list": "live peers with their capabilities and placement score",
    "runs": "open runs advertised by their peers",
}
"""The subcommands and their help."""


def build_parser() -> argparse.ArgumentParser:
    parser, commands = command_parser("python -m peers", __doc__, _COMMANDS)
    for name, cmd in commands.items():
        cmd.add_argument(
            "--initial-peers", nargs="+", required=True, metavar="MADDR", help="any live peer of the network"
        )
        cmd.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table")
        cmd.add_argument("--timeout-s", type=float, default=30.0, help="deadline to connect and query")
        if name == "list":
            cmd.add_argument("--run", default=None, help="only the peers of this run, scored for it")
    return parser


def peer_to_json(scored: Any) -> dict[str, Any]:
    return {
        "peer_id": scored.record.peer_id,
        "score": scored.score,
        "fit": scored.fit,
        "record": dataclasses.asdict(scored.record),
    }


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


def _mbps(kbps: int | None) -> str:
    return "-" if kbps is None else f"{kbps / 1000:.0f} Mbit/s"


def peers_table(peers: list[Any]) -> Table:
    table = Table(title=f"Swarm peers ({len(peers)} live)")
    for column in (
        "peer",
        "accelerator",
        "memory free/total",
        "bandwidth up/down",
        "reachability",
        "state",
        "run",
        "samples/s",
        "region",
        "uptime",
        "score",
    ):
        table.add_column(column, justify="right" if column in ("samples/s", "uptime", "score") else "left")
    for p in peers:
        r = p.record
        table.add_row(
            r.peer_id[-12:],
            f"{r.hardware.accelerator}: {r.hardware.name[:28]}",
            f"{_gib(r.hardware.memory_free_bytes)}/{_gib(r.hardware.memory_total_bytes)}",
            f"{_mbps(r.perf.upload_kbps)}/{_mbps(r.perf.download_kbps)}",
            r.network.reachability,
            r.state,
            r.run.name if r.run else "-",
            f"{r.perf.samples_per_s_milli / 1000:.1f}",
            r.network.region or "-",
            f"{r.trust.uptime_s}s",
            f"{p.score:.1f}",
        )
    return table


def runs_table(runs: list[Any]) -> Table:
    table = Table(title=f"Open runs ({len(runs)})")
    for column in ("run", "task", "peers", "round", "step", "samples/s", "needs memory", "dtype"):
        table.add_column(column)
    for run in runs:
        table.add_row(
            run.name,
            f"{run.task}/{run.task_preset}",
            str(run.num_peers),
            str(run.round),
            str(run.step),
            f"{run.samples_per_s:.1f}",
            _gib(run.requirements.min_memory_bytes),
            run.requirements.dtype,
        )
    return table


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(stderr=True)
    logging.basicConfig(level=logging.WARNING)
    from bootstrap import DHTStartError, parse_initial_peers, stop_dht
    from bootstrap.identity import Identity
    from bootstrap.network import start_swarm_dht
    from peers.graph import ResourceGraph

    try:
        initial_peers = parse_initial_peers(args.initial_peers)
        dht = start_swarm_dht(
            Identity.generate(),
            initial_peers=initial_peers,
            client_mode=True,
            host_maddrs=("/ip4/127.0.0.1/tcp/0",),
            connect_timeout_s=args.timeout_s,
        )
    except (ValueError, DHTStartError) as e:
        console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        return EXIT_BAD_INPUT
    try:
        graph = ResourceGraph(dht)
        started = time.perf_counter()
        if args.command == "list":
            result: Any = graph.peers(run=args.run, timeout_s=args.timeout_s)
            payload = {"peers": [peer_to_json(p) for p in result]}
        else:
            result = graph.runs(timeout_s=args.timeout_s)
            payload = {"runs": [dataclasses.asdict(r) for r in result]}
        payload.update(query_s=round(time.perf_counter() - started, 3), rejected=dict(graph.rejections.counts))
        if args.json:
            print(json.dumps(payload, indent=2))
        else:
            out = Console()
            if not out.is_terminal:
                out = Console(width=160)
            out.print(peers_table(result) if args.command == "list" else runs_table(result))
        return 0
    finally:
        stop_dht(dht)


if __name__ == "__main__":
    sys.exit(main())
