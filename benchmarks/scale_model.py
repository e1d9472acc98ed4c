"""A model of one Swarm run at 50 to 10,000 peers, checked against real DHT nodes at 50 and 100.

    python -m benchmarks.scale_model [--sizes 50 100 1000 10000] [--measure 50 100] [--gets 5]

The model (no processes; seconds even for 10,000 peers) follows what the code does:

* **DHT**: Kademlia as hivemind 1.1.12 runs it: 160-bit node IDs, buckets of k = 20, beam search with
  a beam of 20 and 4 workers. Every read Swarm makes is ``get(latest=True)``: it does not stop at the
  first value, it visits the beam's 20 nearest nodes of the key (``traverse_dht``); a store visits them
  too, then stores on the 5 nearest. The simulated routing tables are ideal (each bucket holds up to 20
  nodes of its subtree), so hops and visits are a lower bound of what a young network does.
* **Matchmaking**: a looking peer stores its entry once and reads its key ``gets`` times a window
  (every 0.1 s of a 2 s window: up to 20); every node a read or a store visits serves it once. The
  figure is finds served per node per round (every peer looking once): its mean and its maximum over
  the nodes, with one key for the run and with keys sharded by `AveragingConfig.shard_size`
  (averaging.group). With one key, the nodes nearest that key serve every read of the run; sharded,
  no key has more than about ``shard_size`` peers, whatever the run's size.
* **Gossip**: push to ``fanout`` random peers plus the successor on the ring of peer IDs, each peer
  forwarding news once (swarm.checkpoint.gossip). A push is ``job_s`` seconds of CPU work (both daemons,
  both ends' Python) and a gamma-distributed delay (the rest: the wire, waits that are not work). Deployed,
  every peer has its own machine. In benchmarks.gossip every peer shares this one: the pushes in flight
  share its busy cores (processor sharing, as the kernel shares CPU among runnable processes), so a
  push's time grows with the spread's own load. ``job_s`` and the cores are measured at 50 peers (the
  benchmark counts every process's CPU over each spread); the delay's mean and shape are fitted there, to
  the median time to half the peers and the mean pushes from the publisher to the last peer reached
  (benchmarks.gossip follows each peer's first copy back). The 50-peer time to all and every 100-peer
  figure are predictions.
* **Bytes per peer per round**: the butterfly all-reduce (2(g-1)/g of the model in int8), the
  matchmaking reads (every node holding the key returns all its entries), a sealed manifest pushed to
  ``fanout + 1`` peers, and one capability query (the records live under
  `bootstrap.records.PEERS_SHARDS` keys by peer ID; a query reads them all, and every holder returns
  all of its key's records). A record refresh (every 15 s) is a store, whose traversal is answered
  with the whole value of the record's one key: a shard's worth of records. A complete query still grows
  with the network (70 MB at 10,000 peers), as any list of every peer does.

The check (``--measure``): N real DHT nodes on loopback (each its DHT process and p2pd, as in
benchmarks.gossip), a counter inside each DHT process on its local storage's ``get`` (every find
request a node serves reads its storage once for the key); each peer stores its matchmaking entry and
reads its key ``gets`` times, as a window does, once with one key and once sharded; finds served per
node are set beside the model's for the same N and ``gets``. The gossip figures are checked against
benchmarks/results/gossip_50peers_cpu_20261206.json and gossip_100peers_cpu_20261206.json, when present.
"""

from __future__ import annotations

import argparse
import bisect
import concurrent.futures
import dataclasses
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from averaging.config import AveragingConfig
from averaging.group import matchmaking_key, shard_count, shard_of
from benchmarks._common import run_metadata, save_result
from bootstrap.records import PEERS_SHARDS

RESULTS = Path(__file__).parent / "results" / "scale_model.json"
GOSSIP_RESULTS = {
    50: Path(__file__).parent / "results" / "gossip_50peers_cpu_20261206.json",
    100: Path(__file__).parent / "results" / "gossip_100peers_cpu_20261206.json",
}
"""benchmarks.gossip runs with the CPU of every process counted (``cpu_spreads``, ``cpu_idle``)."""
ID_BITS = 160
BUCKET = 20  # hivemind DHTNode bucket_size, and the beam of every traversal
WORKERS = 4  # hivemind DEFAULT_NUM_WORKERS
REPLICAS = 5  # hivemind DHTNode num_replicas
ENTRY_BYTES = 260  # a signed matchmaking entry as stored (payload, 64-byte signature, subkey, expiry)
RECORD_BYTES = 1172  # a signed capability record (benchmarks/results/peers_graph.json)
MANIFEST_BYTES = 3200  # a sealed manifest with a group's 8 signatures
PEER_ENTRY_BYTES = 45  # one (node ID, peer ID) in a find reply
TOLERANCE = 0.25
PROBE_PREFIX = "swarm_scale"


# ------------------------------------------------------------------------------------ DHT
def _dht_id(source: str) -> int:
    from hivemind.dht.routing import DHTID

    return int(DHTID.generate(source=source))


class Kademlia:
    """``n`` nodes with random IDs and ideal k-buckets, built lazily (a bucket when a traversal asks)."""

    def __init__(self, n: int, seed: int) -> None:
        rng = random.Random(seed)
        self.ids = sorted(rng.getrandbits(ID_BITS) for _ in range(n))
        self._buckets: dict[tuple[int, int], list[int]] = {}
        self._seed = seed

    def _bucket(self, node: int, depth: int) -> list[int]:
        """Up to BUCKET nodes that share the first ``depth`` bits with ``node`` and differ at the next."""
        key = (node, depth)
        if key not in self._buckets:
            shift = ID_BITS - depth - 1
            prefix = ((node >> shift) ^ 1) << shift
            lo, hi = bisect.bisect_left(self.ids, prefix), bisect.bisect_left(self.ids, prefix + (1 << shift))
            span = self.ids[lo:hi]
            if len(span) > BUCKET:
                span = random.Random(hash((self._seed, node, depth))).sample(span, BUCKET)
            self._buckets[key] = span
        return self._buckets[key]

    def neighbours(self, node: int, target: int, count: int = BUCKET) -> list[int]:
        """The ``count`` nodes nearest ``target`` (XOR) in ``node``'s routing table."""
        known: list[int] = []
        for depth in range(ID_BITS):
            bucket = self._bucket(node, depth)
            known.extend(bucket)
            if depth > 2 * math.log2(len(self.ids) + 1) + 8:  # deeper buckets are empty
                break
        return heapq.nsmallest(count, known, key=lambda x: x ^ target)

    def traverse(self, start: int, target: int) -> tuple[list[int], int]:
        """hivemind's beam search for ``target`` from ``start`` with latest=True: visits until the beam's
        BUCKET nearest nodes are all visited. Returns (the visited nodes, rounds of WORKERS requests)."""
        candidates = set(self.neighbours(start, target))
        visited: list[int] = []
        seen = {start}
        rounds = 0
        while True:
            beam = heapq.nsmallest(BUCKET, candidates, key=lambda x: x ^ target)
            todo = [x for x in beam if x not in seen][:WORKERS]
            if not todo:
                return visited, rounds
            rounds += 1
            for node in todo:
                seen.add(node)
                visited.append(node)
                candidates.update(self.neighbours(node, target))


@dataclass
class Load:
    """Finds served per node in one matchmaking round (every peer looks once)."""

    mean: float
    max: float
    p99: float
    visits_per_read: float
    hops: float


def matchmaking_load(n: int, gets: int, shard_size: int, *, seed: int = 0, per_key: int = 12) -> Load:
    """Every peer stores once and reads ``gets`` times its key. Up to ``per_key`` peers of each key are
    traversed; the nodes they visit are charged for all of that key's peers (scaled)."""
    dht = Kademlia(n, seed)
    shards = shard_count(n, shard_size)
    keys = [_dht_id(matchmaking_key("run", shards, s)) for s in range(shards)]
    looking: dict[int, list[int]] = {}
    for peer in dht.ids:
        looking.setdefault(shard_of(str(peer), 0, shards), []).append(peer)
    rng = random.Random(seed + 1)
    served: Counter = Counter()
    visits, hops = [], []
    for shard, peers in looking.items():
        sample = peers if len(peers) <= per_key else rng.sample(peers, per_key)
        scale = len(peers) / len(sample)
        for peer in sample:
            visited, rounds = dht.traverse(peer, keys[shard])
            visits.append(len(visited))
            hops.append(rounds)
            for node in visited:
                served[node] += (gets + 1) * scale  # the store's traversal visits the same nodes as a read
        for peer in peers:
            served[peer] += gets + 1  # each read looks in the local storage first
    counts = sorted(served.get(node, 0) for node in dht.ids)
    return Load(
        mean=statistics.mean(counts),
        max=counts[-1],
        p99=counts[min(len(counts) - 1, int(0.99 * len(counts)))],
        visits_per_read=statistics.mean(visits),
        hops=statistics.mean(hops),
    )


# ------------------------------------------------------------------------------------ gossip
def gossip_spread(
    n: int,
    fanout: int,
    delay_s: float,
    *,
    shape: float = 1.0,
    job_s: float = 0.0,
    cores: float | None = None,
    repeats: int = 200,
    seed: int = 0,
) -> dict[str, float]:
    """Push gossip with a ring successor: median seconds to half and to all peers, rounds to all (every
    push of a round landing before the next), and pushes from the publisher to the last peer reached
    along the path that reached it first (``hops_to_all``, what benchmarks.gossip measures).

    A push is a gamma-distributed delay of mean ``delay_s`` (``shape`` 1 is exponential, larger is less
    spread out), then ``job_s`` CPU seconds of work (both daemons, both ends' Python). With ``cores``
    None every peer has its own machine, so the work only adds ``job_s``. With ``cores`` every peer lives
    on one machine of that many free cores, as in benchmarks.gossip: the pushes being worked on share them
    (processor sharing, as the kernel's scheduler shares CPU among runnable processes; a push never gets
    more than one core), so a push's time grows with the pushes in flight. A peer forwards once its
    first copy is done."""
    rng = random.Random(seed)
    to_half, to_all, rounds_all, hops_all = [], [], [], []
    for _ in range(repeats):
        done, hops = _one_spread(n, fanout, delay_s, shape, job_s, cores, rng)
        times = sorted(done)
        to_half.append(times[n // 2])
        to_all.append(times[-1])
        hops_all.append(max(hops))
        rounds_all.append(_synchronous_rounds(n, fanout, rng))
    return {
        "to_half_s": statistics.median(to_half),
        "to_all_s": statistics.median(to_all),
        "to_all_p99_s": sorted(to_all)[int(0.99 * (len(to_all) - 1))],
        "rounds_to_all": statistics.median(rounds_all),
        "hops_to_all": statistics.median(hops_all),
        "hops_to_all_mean": statistics.mean(hops_all),
    }


def _one_spread(
    n: int, fanout: int, delay_s: float, shape: float, job_s: float, cores: float | None, rng: random.Random
) -> tuple[list[float], list[int]]:
    """One spread of `gossip_spread`: when each peer had its first copy, and the pushes that brought it."""
    done, hops = [math.inf] * n, [0] * n
    arriving: list[tuple[float, int, int]] = []  # (time the push's work starts, target, its hops)
    earliest = [math.inf] * n  # own machines: a push later than one already on its way never brings a first copy

    def forward(peer: int, t: float) -> None:
        targets = set(rng.sample(range(n), min(fanout, n - 1))) | {(peer + 1) % n}
        targets.discard(peer)
        for target in targets:
            at = t + (rng.gammavariate(shape, delay_s / shape) if delay_s > 0 else 0.0)
            if cores is None:
                if at > earliest[target]:
                    continue
                earliest[target] = at
            heapq.heappush(arriving, (at, target, hops[peer] + 1))

    def accept(target: int, t: float, hop: int) -> None:
        if done[target] == math.inf:
            done[target], hops[target] = t, hop
            forward(target, t)

    origin = rng.randrange(n)
    done[origin] = 0.0
    forward(origin, 0.0)
    if cores is None:
        while arriving:
            t, target, hop = heapq.heappop(arriving)
            accept(target, t + job_s, hop)
    else:
        # processor sharing in virtual time: a push in flight gets min(1, cores / k) of a core
        working: list[tuple[float, int, int]] = []  # (virtual time it is done, target, its hops)
        t = virtual = 0.0
        while arriving or working:
            rate = min(1.0, cores / len(working)) if working else 0.0
            t_done = t + (working[0][0] - virtual) / rate if working else math.inf
            if arriving and arriving[0][0] <= t_done:
                t_next, target, hop = heapq.heappop(arriving)
                virtual, t = virtual + rate * (t_next - t), t_next
                heapq.heappush(working, (virtual + job_s, target, hop))
            else:
                virtual, t = virtual + rate * (t_done - t), t_done
                _, target, hop = heapq.heappop(working)
                accept(target, t, hop)
    return done, hops


def _synchronous_rounds(n: int, fanout: int, rng: random.Random) -> int:
    """Rounds to reach all ``n`` when every push of a round lands before the next (the generations)."""
    have, new, rounds = {0}, {0}, 0
    while len(have) < n:
        rounds += 1
        reached = set()
        for peer in new:
            reached.update(rng.sample(range(n), min(fanout, n - 1)))
            reached.add((peer + 1) % n)
        new = reached - have
        have |= new
    return rounds


SHAPES = (1.0, 2.0, 4.0, 8.0)
DELAYS_S = (0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06)


@dataclass(frozen=True)
class PushCost:
    """What a push costs, from a benchmarks.gossip run: ``job_s`` and ``cores`` measured (CPU accounting),
    ``delay_s`` and ``shape`` fitted."""

    job_s: float
    """CPU seconds a push costs (the gossip process, both daemons, the DHT processes; per push received)."""
    cores: float
    """Cores a spread kept busy on the measuring machine (all its processes together)."""
    delay_s: float = 0.0
    """Mean of the rest of a push's time (the wire and the waits that are not CPU work)."""
    shape: float = 1.0


def host_cost(result: dict) -> PushCost | None:
    """The measured half of :class:`PushCost` from a benchmarks.gossip run (medians over its spreads); None
    for a run without CPU figures."""
    spreads = [c for c in result.get("cpu_spreads", ()) if c.get("pushes_received") and c.get("wall_s")]
    if not spreads:
        return None

    def total(c: dict) -> float:
        return c["main_cpu_s"] + c["p2pd_cpu_s"] + c["dht_cpu_s"]

    return PushCost(
        job_s=statistics.median(total(c) / c["pushes_received"] for c in spreads),
        cores=statistics.median(total(c) / c["wall_s"] for c in spreads),
    )


def fit_push(n: int, fanout: int, result: dict) -> PushCost | None:
    """:class:`PushCost` for a benchmarks.gossip run of ``n`` peers on one machine: the CPU work and the busy
    cores as measured, then the delay (of :data:`DELAYS_S`) and the shape (of :data:`SHAPES`) whose
    shared-host spread comes nearest the run's median time to half and mean pushes to the last peer
    (relative errors, squared and summed). Two figures fitted, two parameters."""
    cost = host_cost(result)
    if cost is None or result.get("hops_to_all_mean") is None:
        return None
    half, hops = result["to_half_s_median"], result["hops_to_all_mean"]

    def error(delay: float, shape: float) -> float:
        model = gossip_spread(n, fanout, delay, shape=shape, job_s=cost.job_s, cores=cost.cores, repeats=100)
        return ((model["to_half_s"] - half) / half) ** 2 + ((model["hops_to_all_mean"] - hops) / hops) ** 2

    delay, shape = min(((d, k) for d in DELAYS_S for k in SHAPES), key=lambda pair: error(*pair))
    return dataclasses.replace(cost, delay_s=delay, shape=shape)


# ------------------------------------------------------------------------------------ bytes
def bytes_per_round(n: int, load: Load, *, params: float, group: int, gets: int, shard_size: int, fanout: int) -> dict:
    """What one peer sends plus receives in one round, by part (bytes)."""
    per_key = n / shard_count(n, shard_size)
    holders = min(REPLICAS + 1, n)  # the replicas and the cache_nearest copy return the key's entries
    find = load.visits_per_read * (100 + BUCKET * PEER_ENTRY_BYTES)
    matchmaking = (gets + 1) * (find + holders * per_key * ENTRY_BYTES)
    allreduce = 2 * 2 * (group - 1) / group * params * (1 + 4 / 4096)  # int8 + absmax per block; sent + received
    gossip = 2 * (fanout + 1) * MANIFEST_BYTES
    capability = PEERS_SHARDS * find + holders * n * RECORD_BYTES
    refresh = find + holders * math.ceil(n / PEERS_SHARDS) * RECORD_BYTES
    return {
        "allreduce": allreduce,
        "matchmaking": matchmaking,
        "gossip": gossip,
        "capability_query": capability,
        "total": allreduce + matchmaking + gossip + capability,
        # not per round: every record refresh (15 s) is a store, whose traversal is answered with its shard
        # key's whole value by every holder it visits
        "capability_refresh_per_15_s": refresh,
    }


# ------------------------------------------------------------------------------------ measurement
async def _count_storage_reads(_dht: Any, node: Any) -> bool:
    """Inside a DHT process: count reads of its local storage by key (every find it serves reads it)."""
    storage = node.protocol.storage
    if getattr(storage, "_scale_counts", None) is None:
        storage._scale_counts = Counter()
        original = storage.get

        def get(key_id: Any, *args: Any, **kwargs: Any) -> Any:
            storage._scale_counts[key_id.to_bytes().hex()] += 1
            return original(key_id, *args, **kwargs)

        storage.get = get
    return True


async def _read_counts(_dht: Any, node: Any) -> dict[str, int]:
    counts = dict(node.protocol.storage._scale_counts)
    node.protocol.storage._scale_counts.clear()
    return counts


def measure(n: int, gets: int, shard_size: int, console: Console) -> dict[str, Any]:
    """Finds served per node per matchmaking round on ``n`` real DHT nodes, one key and sharded."""
    from hivemind.dht.routing import DHTID
    from hivemind.utils.timed_storage import get_dht_time

    from benchmarks.gossip import check_memory, start_dhts
    from bootstrap import stop_dht

    check_memory(n)
    dhts: list = []
    out: dict[str, Any] = {"peers": n, "gets": gets, "shard_size": shard_size}
    try:
        dhts = start_dhts(n, console)
        for dht in dhts:
            dht.run_coroutine(_count_storage_reads)
        peer_ids = [str(dht.peer_id) for dht in dhts]
        for label, size in (("one key", 0), ("sharded", shard_size)):
            shards = shard_count(n, size)
            prefix = f"{PROBE_PREFIX}_{label.replace(' ', '_')}_{n}"
            keys = [matchmaking_key(prefix, shards, shard_of(p, 0, shards)) for p in peer_ids]
            for dht in dhts:
                dht.run_coroutine(_read_counts)  # from zero

            def look(i: int, keys: list[str] = keys) -> None:
                expiration = get_dht_time() + 30
                dhts[i].store(keys[i], {"c": 0, "r": ""}, expiration, subkey=peer_ids[i])
                for _ in range(gets):
                    dhts[i].get(keys[i], latest=True)

            started = time.monotonic()
            with console.status(f"{n} peers, {label}: every peer looks once"):
                with concurrent.futures.ThreadPoolExecutor(16) as pool:
                    list(pool.map(look, range(n)))
            elapsed = time.monotonic() - started
            key_ids = {DHTID.generate(source=k).to_bytes().hex() for k in keys}
            served = []
            for dht in dhts:
                counts = dht.run_coroutine(_read_counts)
                served.append(sum(v for k, v in counts.items() if k in key_ids))
            served.sort()
            out[label] = {
                "keys": shards,
                "mean": statistics.mean(served),
                "max": served[-1],
                "p99": served[min(len(served) - 1, int(0.99 * len(served)))],
                "seconds": elapsed,
            }
    finally:
        for dht in dhts:
            stop_dht(dht)
    return out


# ------------------------------------------------------------------------------------ main
def _within(predicted: float, measured: float) -> bool:
    return abs(predicted - measured) <= TOLERANCE * measured


def checks(measured: list[dict], gossip: dict[int, dict], fanout: int) -> tuple[list[dict], PushCost | None]:
    rows = []
    for m in measured:
        for label in ("one key", "sharded"):
            size = 0 if label == "one key" else m["shard_size"]
            model = matchmaking_load(m["peers"], m["gets"], size)
            for figure in ("mean", "max"):
                predicted, got = getattr(model, figure), m[label][figure]
                rows.append(
                    {
                        "check": f"{m['peers']} peers, {label} ({m[label]['keys']} keys): finds served per node, {figure}",
                        "model": predicted,
                        "measured": got,
                        "ok": _within(predicted, got),
                    }
                )
    push = fit_push(50, fanout, gossip[50]) if 50 in gossip else None
    if push is not None:
        for n, result in sorted(gossip.items()):
            model = gossip_spread(n, fanout, push.delay_s, shape=push.shape, job_s=push.job_s, cores=push.cores)
            for figure, key in (
                ("median seconds to half", "to_half_s_median"),
                ("median seconds to all", "to_all_s_median"),
                ("pushes from the publisher to the last peer (mean)", "hops_to_all_mean"),
            ):
                if n == 50 and key != "to_all_s_median":
                    continue  # the fitted figures
                if result.get(key) is None:
                    continue
                predicted = model[key.removesuffix("_median")]
                rows.append(
                    {
                        "check": f"{n} peers on this machine: gossip, {figure}",
                        "model": predicted,
                        "measured": result[key],
                        "ok": _within(predicted, result[key]),
                    }
                )
    return rows, push


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_model", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 100, 1000, 10_000])
    parser.add_argument("--measure", type=int, nargs="*", default=[50, 100], help="real DHT runs (none: model only)")
    parser.add_argument("--gets", type=int, default=5, help="reads a peer makes of its key in a measured window")
    parser.add_argument("--window-gets", type=int, default=20, help="reads a peer makes in a default 2 s window")
    parser.add_argument("--measure-shard-size", type=int, default=16, help="shard size of the measured runs")
    parser.add_argument("--params", type=float, default=25e6, help="model parameters, for bytes per round")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    console = Console(width=max(Console().width, 180))
    fanout = 8
    shard_size = AveragingConfig().shard_size
    group = AveragingConfig().target_group_size

    measured = [measure(n, args.gets, args.measure_shard_size, console) for n in args.measure]
    gossip = {n: json.loads(p.read_text()) for n, p in GOSSIP_RESULTS.items() if p.exists()}
    gossip = {n: g for n, g in gossip.items() if g.get("peers") == n and g.get("fanout") == fanout}
    rows, push = checks(measured, gossip, fanout)
    push = push or PushCost(job_s=0.0, cores=1.0, delay_s=0.05)

    table_rows = []
    for n in args.sizes:
        one = matchmaking_load(n, args.window_gets, 0)
        sharded = matchmaking_load(n, args.window_gets, shard_size)
        # deployed: every peer its own machine
        spread = gossip_spread(
            n, fanout, push.delay_s, shape=push.shape, job_s=push.job_s, repeats=50 if n > 1000 else 200
        )
        table_rows.append(
            {
                "peers": n,
                "dht_hops": sharded.hops,
                "finds_per_read": sharded.visits_per_read,
                "gossip_rounds_to_all": spread["rounds_to_all"],
                "gossip_to_all_s": spread["to_all_s"],
                "gossip_to_all_p99_s": spread["to_all_p99_s"],
                "mm_keys": shard_count(n, shard_size),
                "mm_per_node_one_key": {"mean": one.mean, "max": one.max},
                "mm_per_node_sharded": {"mean": sharded.mean, "max": sharded.max},
                "bytes_per_peer": bytes_per_round(
                    n,
                    sharded,
                    params=args.params,
                    group=group,
                    gets=args.window_gets,
                    shard_size=shard_size,
                    fanout=fanout,
                ),
            }
        )
    result = {
        **run_metadata("scale_model", argv),
        "config": vars(args),
        "shard_size": shard_size,
        "fanout": fanout,
        "gossip_push": dataclasses.asdict(push),
        "measured": measured,
        "checks": rows,
        "passed": all(r["ok"] for r in rows),
        "table": table_rows,
    }
    print_tables(result, console)
    console.print(f"saved {save_result(args.out, result)}")
    return 0 if result["passed"] else 1


def _push_text(push: dict) -> str:
    return (
        f"{push['job_s'] * 1e3:.2f} ms of CPU (a spread here kept {push['cores']:.2f} cores busy), "
        f"then a gamma delay of mean {push['delay_s'] * 1e3:.1f} ms, shape {push['shape']:g}"
    )


def print_tables(result: dict[str, Any], console: Console) -> None:
    check = Table(title=f"scale model against measurements (within {TOLERANCE:.0%})")
    for column in ("check", "model", "measured", "ok"):
        check.add_column(column, justify="left" if column == "check" else "right")
    for r in result["checks"]:
        check.add_row(r["check"], f"{r['model']:.3g}", f"{r['measured']:.3g}", "ok" if r["ok"] else "MISS")
    console.print(check)
    table = Table(
        title=f"the model at scale (shard_size {result['shard_size']}, a push: {_push_text(result['gossip_push'])})"
    )
    for column in (
        "peers",
        "DHT hops",
        "finds/read",
        "gossip rounds",
        "to all (s)",
        "mm keys",
        "finds/node one key (mean/max)",
        "sharded (mean/max)",
        "MB/peer/round (allreduce+mm+gossip+caps)",
        "MB/record refresh",
    ):
        table.add_column(column, justify="right")
    for r in result["table"]:
        b = r["bytes_per_peer"]
        table.add_row(
            str(r["peers"]),
            f"{r['dht_hops']:.1f}",
            f"{r['finds_per_read']:.1f}",
            f"{r['gossip_rounds_to_all']:.0f}",
            f"{r['gossip_to_all_s']:.2f}",
            str(r["mm_keys"]),
            f"{r['mm_per_node_one_key']['mean']:.0f}/{r['mm_per_node_one_key']['max']:.0f}",
            f"{r['mm_per_node_sharded']['mean']:.0f}/{r['mm_per_node_sharded']['max']:.0f}",
            f"{b['total'] / 1e6:.1f} ({b['allreduce'] / 1e6:.1f}+{b['matchmaking'] / 1e6:.2f}+"
            f"{b['gossip'] / 1e6:.2f}+{b['capability_query'] / 1e6:.2f})",
            f"{b['capability_refresh_per_15_s'] / 1e6:.3f}",
        )
    console.print(table)


if __name__ == "__main__":
    sys.exit(main())
