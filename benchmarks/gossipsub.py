"""Our push gossip against libp2p GossipSub (the p2pd daemon's ``-pubsub``), side by side on the same peers.

    python -m benchmarks.gossipsub [--peers 50] [--repeats 12] [--junk 200]

Every peer is a real DHT node whose daemon also runs GossipSub (`bootstrap.pubsub.PubSubP2P`, passed to
``hivemind.DHT(p2p=...)``), so both arms use the same daemons and the same connections. In one run:

* **spread**: a sealed manifest (776 bytes, two signatures) published at one peer, seconds until every
  peer has accepted it (verified it), for ``--repeats`` manifests, by push gossip (`ManifestGossip`,
  fanout 8 + ring successor, verify before forwarding) and by GossipSub (the daemon relays, every
  subscriber verifies what it is delivered);
* **junk**: one peer (an insider with a valid key) sends ``--junk`` forged manifests (same size, bad
  signatures). With push gossip it must push each to every peer it wants to reach and nobody forwards
  it; with GossipSub it publishes each once and the mesh delivers it to every subscriber before any
  check. Reported: deliveries to honest peers per junk message the attacker sent, and the spread of a
  real manifest while the junk flows.

The gossip services and subscriptions of all peers live in this process, as in benchmarks/gossip.py.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import hivemind
import psutil
from rich.console import Console
from rich.table import Table

from benchmarks._common import run_metadata, save_result, signals_unwind
from benchmarks.gossip import LOOPBACK, RUN, TARGET_S, _sealed, _verify, check_memory
from bootstrap import stop_dht
from bootstrap.identity import Identity
from bootstrap.pubsub import PubSubP2P, Subscription, publish, subscribe, topic_peers
from swarm.checkpoint.gossip import GossipConfig, ManifestGossip

RESULTS = Path(__file__).parent / "results" / "gossipsub.json"
TOPIC = f"swarm/{RUN}/manifests"
_POLL_S = 0.02
_START_TIMEOUT_S = 60.0


class _Loop:
    """One event loop in a thread: the daemons' owners and every subscription reader live on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gossipsub-bench", daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout_s: float = _START_TIMEOUT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5.0)


class _Arrivals:
    """Per manifest step, when each peer accepted it; and per peer, junk delivered and refused."""

    def __init__(self, num_peers: int) -> None:
        self.accepted: dict[int, dict[int, float]] = {}
        self.junk = [0] * num_peers
        self._lock = threading.Lock()

    def accept(self, step: int, peer: int) -> None:
        with self._lock:
            self.accepted.setdefault(step, {}).setdefault(peer, time.monotonic())

    def count(self, step: int) -> int:
        with self._lock:
            return len(self.accepted.get(step, ()))

    def times(self, step: int) -> list[float]:
        with self._lock:
            return list(self.accepted.get(step, {}).values())


def _start(num_peers: int, loop: _Loop, console: Console) -> tuple[list[PubSubP2P], list[hivemind.DHT]]:
    daemons: list[PubSubP2P] = []
    dhts: list[hivemind.DHT] = []
    initial: list[str] = []
    with console.status(f"starting {num_peers} DHT nodes over GossipSub daemons") as status:
        while len(dhts) < num_peers:
            p2p = loop.run(PubSubP2P.create(initial_peers=initial or None, host_maddrs=LOOPBACK, nat_port_map=False))
            daemons.append(p2p)
            dhts.append(hivemind.DHT(p2p=p2p, initial_peers=initial or None, start=True))
            if not initial:
                initial = [str(m) for m in loop.run(p2p.get_visible_maddrs())]
            status.update(f"starting {num_peers} DHT nodes over GossipSub daemons: {len(dhts)}")
    return daemons, dhts


async def _read(subscription: Subscription, peer: int, arrivals: _Arrivals) -> None:
    async for message in subscription:
        try:
            _digest, step = _verify(message.data)
        except ValueError:
            arrivals.junk[peer] += 1
            continue
        arrivals.accept(step, peer)


def _wait(arrivals: _Arrivals, step: int, num_peers: int, started: float, timeout_s: float) -> list[float]:
    while arrivals.count(step) < num_peers and time.monotonic() - started < timeout_s:
        time.sleep(_POLL_S)
    return sorted(t - started for t in arrivals.times(step) if t - started <= timeout_s)


def _junk(size: int, i: int) -> bytes:
    """A forged manifest: a real one's bytes with its signatures' hex digits changed."""
    data = bytearray(_sealed(10_000 + i, [Identity.generate()]))
    at = data.rfind(b'"signatures"')
    for k in range(at + 40, min(at + 100, len(data))):
        if chr(data[k]) in "0123456789abcdef":
            data[k] = ord("0") if data[k] != ord("0") else ord("1")
    return bytes(data[:size]) if size < len(data) else bytes(data)


def run(num_peers: int, repeats: int, junk: int, console: Console, timeout_s: float = 30.0) -> dict[str, Any]:
    loop = _Loop()
    daemons: list[PubSubP2P] = []
    dhts: list[hivemind.DHT] = []
    gossips: list[ManifestGossip] = []
    subscriptions: list[Subscription] = []
    push, sub = _Arrivals(num_peers), _Arrivals(num_peers)
    signers = [Identity.generate(), Identity.generate()]
    try:
        daemons, dhts = _start(num_peers, loop, console)
        ids: list[str] = []
        origin = [0]

        def on_new(step: int, i: int) -> None:
            push.accept(step, i)

        gossips = [
            ManifestGossip(
                d,
                run_id=RUN,
                verify=_verify,
                peers=lambda: ids,
                on_new=lambda data, digest, step, i=i: on_new(step, i),
                config=GossipConfig(),
                announce=lambda data, digest, i=i: i == origin[0],
            )
            for i, d in enumerate(dhts)
        ]
        ids.extend(g.peer_id for g in gossips)
        with console.status("subscribing every peer"):
            subscriptions = [loop.run(subscribe(p, TOPIC)) for p in daemons]
            for i, s in enumerate(subscriptions):
                asyncio.run_coroutine_threadsafe(_read(s, i, sub), loop.loop)
            started = time.monotonic()
            while time.monotonic() - started < timeout_s:
                meshed = sum(len(loop.run(topic_peers(p, TOPIC))) > 0 for p in daemons)
                if meshed == num_peers:
                    break
                time.sleep(0.2)
            mesh_s = time.monotonic() - started
            time.sleep(2.0)  # two gossipsub heartbeats: the mesh is grafted
            topic_degree = [len(loop.run(topic_peers(p, TOPIC))) for p in daemons]

        spreads: dict[str, list[list[float]]] = {"push": [], "gossipsub": []}
        for step in range(1, repeats + 1):
            publisher = step % num_peers
            data = _sealed(step, signers)
            with console.status(f"manifest {step}/{repeats}: push"):
                origin[0] = publisher
                started = time.monotonic()
                thread = threading.Thread(target=gossips[publisher].publish, args=(data,), daemon=True)
                thread.start()
                spreads["push"].append(_wait(push, step, num_peers, started, timeout_s))
                thread.join(timeout_s)
            with console.status(f"manifest {step}/{repeats}: gossipsub"):
                started = time.monotonic()
                loop.run(publish(daemons[publisher], TOPIC, data))
                spreads["gossipsub"].append(_wait(sub, step, num_peers, started, timeout_s))

        flood = _flood(loop, daemons, gossips, push, sub, junk, signers, repeats, timeout_s, console)
        received = sum(g.received for g in gossips)
    finally:
        for s in subscriptions:
            loop.run(s.close(), 5.0)
        for g in gossips:
            g.close()
        for d in dhts:
            stop_dht(d)
        for p in daemons:
            try:
                loop.run(p.shutdown(), 10.0)
            except Exception:  # a daemon that died already
                pass
        loop.close()
    return {
        "peers": num_peers,
        "repeats": repeats,
        "record_bytes": len(_sealed(1, signers)),
        "mesh_formed_s": mesh_s,
        "topic_degree": {"min": min(topic_degree), "median": statistics.median(topic_degree), "max": max(topic_degree)},
        "arms": {name: _summary(arrivals, num_peers) for name, arrivals in spreads.items()},
        "push_received": received,
        "junk": flood,
        "target_s": TARGET_S,
    }


def _flood(
    loop: _Loop,
    daemons: list[PubSubP2P],
    gossips: list[ManifestGossip],
    push: _Arrivals,
    sub: _Arrivals,
    junk: int,
    signers: list[Identity],
    repeats: int,
    timeout_s: float,
    console: Console,
) -> dict[str, Any]:
    """The attacker is the last peer; it sends ``junk`` forged manifests each way, then again while a real
    manifest spreads from peer 0."""
    attacker, n = len(daemons) - 1, len(daemons)
    messages = [_junk(1172, i) for i in range(junk)]
    honest = [i for i in range(n) if i != attacker]
    # push gossip: the attacker sends every junk message to fanout + 1 peers (what a forwarder does)
    fanout = GossipConfig().fanout + 1
    rejected_before = sum(sum(g.rejected.values()) for g in gossips)
    service = gossips[attacker]._service

    async def push_all(batch: list[bytes], offset: int) -> None:
        for k, data in enumerate(batch):
            targets = [gossips[honest[(offset + k * fanout + j) % len(honest)]].peer_id for j in range(fanout)]
            await asyncio.gather(*(service.call_unary(t, data) for t in targets), return_exceptions=True)

    async def publish_all(batch: list[bytes]) -> None:
        for data in batch:
            await publish(daemons[attacker], TOPIC, data)

    with console.status(f"junk: {junk} forged manifests by push"):
        started = time.monotonic()
        service.submit(push_all(messages, 0)).result(timeout_s * 4)
        push_send_s = time.monotonic() - started
        deadline = time.monotonic() + timeout_s
        while sum(sum(g.rejected.values()) for g in gossips) - rejected_before < junk * fanout:
            if time.monotonic() > deadline:
                break
            time.sleep(_POLL_S)
        push_rejected = sum(sum(g.rejected.values()) for g in gossips) - rejected_before
    junk_before = sum(sub.junk[i] for i in honest)
    with console.status(f"junk: {junk} forged manifests by gossipsub"):
        started = time.monotonic()
        loop.run(publish_all(messages), timeout_s * 4)
        sub_send_s = time.monotonic() - started
        deadline = time.monotonic() + timeout_s
        while sum(sub.junk[i] for i in honest) - junk_before < junk * len(honest) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        sub_delivered = sum(sub.junk[i] for i in honest) - junk_before

    # a real manifest from peer 0 while the attacker floods (each way)
    step = repeats + 1
    data = _sealed(step, signers)
    with console.status("spread under a junk flood: push"):
        flooding = service.submit(push_all(messages, 1))
        started = time.monotonic()
        thread = threading.Thread(target=gossips[0].publish, args=(data,), daemon=True)
        thread.start()
        push_under = _wait(push, step, n, started, timeout_s)
        flooding.result(timeout_s * 4)
        thread.join(timeout_s)
    with console.status("spread under a junk flood: gossipsub"):
        flooding = asyncio.run_coroutine_threadsafe(publish_all(messages), loop.loop)
        started = time.monotonic()
        loop.run(publish(daemons[0], TOPIC, data))
        sub_under = _wait(sub, step, n, started, timeout_s)
        flooding.result(timeout_s * 4)
    return {
        "messages": junk,
        "push": {
            "attacker_sends": junk * fanout,
            "delivered_to_honest": push_rejected,
            "per_junk_message": push_rejected / junk if junk else None,
            "send_s": push_send_s,
            "spread_under_flood_s": push_under[-1] if len(push_under) == n else None,
        },
        "gossipsub": {
            "attacker_sends": junk,
            "delivered_to_honest": sub_delivered,
            "per_junk_message": sub_delivered / junk if junk else None,
            "send_s": sub_send_s,
            "spread_under_flood_s": sub_under[-1] if len(sub_under) == n else None,
        },
    }


def _summary(arrivals: list[list[float]], num_peers: int) -> dict[str, Any]:
    complete = [a[-1] for a in arrivals if len(a) == num_peers]
    return {
        "to_all_s": [a[-1] if len(a) == num_peers else None for a in arrivals],
        "complete_spreads": len(complete),
        "to_all_s_median": statistics.median(complete) if complete else None,
        "to_all_s_max": max(complete) if len(complete) == len(arrivals) else None,
        "to_half_s_median": statistics.median(a[num_peers // 2] for a in arrivals if len(a) > num_peers // 2),
        "within_target": sum(t < TARGET_S for t in complete),
    }


def print_table(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"push gossip vs GossipSub on loopback: {result['peers']} peers, same daemons")
    table.add_column("figure")
    for name in result["arms"]:
        table.add_column(name, justify="right")
    arms = result["arms"].values()
    table.add_row(
        "to all peers, median / max (s)", *(f"{_fmt(a['to_all_s_median'])} / {_fmt(a['to_all_s_max'])}" for a in arms)
    )
    table.add_row("to half the peers, median (s)", *(_fmt(a["to_half_s_median"]) for a in arms))
    table.add_row(
        f"spreads to all within {result['target_s']:.0f} s",
        *(f"{a['within_target']}/{result['repeats']}" for a in arms),
    )
    junk = result["junk"]
    table.add_row("junk: attacker's sends", *(str(junk[name]["attacker_sends"]) for name in result["arms"]))
    table.add_row(
        "junk: deliveries to honest peers", *(str(junk[name]["delivered_to_honest"]) for name in result["arms"])
    )
    table.add_row(
        "junk: deliveries per junk message", *(_fmt(junk[name]["per_junk_message"]) for name in result["arms"])
    )
    table.add_row(
        "spread to all during the flood (s)", *(_fmt(junk[name]["spread_under_flood_s"]) for name in result["arms"])
    )
    console.print(table)
    console.print(f"mesh formed in {result['mesh_formed_s']:.2f} s; topic peers per daemon {result['topic_degree']}")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gossipsub", description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--junk", type=int, default=200, help="forged manifests the attacker sends each way")
    parser.add_argument("--out", default=str(RESULTS), help="JSON output path (default: %(default)s)")
    args = parser.parse_args(argv)
    console = Console()
    logging.getLogger("swarm.checkpoint.manifest").setLevel(logging.ERROR)  # a warning per refused junk manifest
    try:
        if args.peers < 3 or args.repeats < 1 or args.junk < 0:
            raise ValueError(f"need peers >= 3, repeats >= 1, junk >= 0; got {args.peers}, {args.repeats}, {args.junk}")
        check_memory(args.peers)
    except ValueError as e:
        console.print(f"[bold red]error:[/] {e}")
        return 2
    try:
        with signals_unwind():  # SIGTERM unwinds too: every DHT and daemon stops
            result = {
                **run_metadata("gossipsub", argv, memory_total_bytes=psutil.virtual_memory().total),
                "config": {"peers": args.peers, "repeats": args.repeats, "junk": args.junk},
                **run(args.peers, args.repeats, args.junk, console),
            }
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    print_table(result, console)
    console.print(f"wrote {save_result(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
