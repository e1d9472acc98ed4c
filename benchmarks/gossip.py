"""Time for a sealed manifest to reach every one of N peers by epidemic push, on loopback.

    python -m benchmarks.gossip [--peers 20] [--fanout 3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console

from bootstrap import start_dht, stop_dht, visible_maddrs
from swarm.checkpoint import Manifest, SignedManifest, sign_manifest, verify_manifest
from swarm.checkpoint.gossip import GossipConfig, ManifestGossip
from swarm.identity import Identity

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RESULTS = Path(__file__).parent / "results" / "gossip.json"
RUN = "gossip-bench"


def _sealed(step: int, signers: list[Identity]) -> bytes:
    manifest = Manifest(version=1, run_id=RUN, step=step, round=step, task="charlm", config_digest="a" * 64,
                        parent="", shards=(), participants=tuple(sorted(s.peer_id for s in signers)), metrics={},
                        created_at=1_800_000_000 + step)
    signed = SignedManifest(manifest=manifest, signatures={})
    for signer in signers:
        signed = signed.with_signature(*sign_manifest(manifest, signer))
    return signed.to_bytes()


def _verify(data: bytes) -> tuple[str, int]:
    manifest = verify_manifest(data, run_id=RUN)
    return manifest.digest(), manifest.step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gossip", description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=20)
    parser.add_argument("--fanout", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    console = Console()
    dhts, gossips, ids = [start_dht(host_maddrs=LOOPBACK, nat_port_map=False)], [], []
    try:
        initial = visible_maddrs(dhts[0])
        dhts += [start_dht(initial, host_maddrs=LOOPBACK, nat_port_map=False) for _ in range(args.peers - 1)]
        gossips = [ManifestGossip(d, run_id=RUN, verify=_verify, peers=lambda: ids,
                                  config=GossipConfig(fanout=args.fanout)) for d in dhts]
        ids.extend(g.peer_id for g in gossips)
        signers = [Identity.generate(), Identity.generate()]
        times = []
        for step in range(1, args.repeats + 1):
            started = time.monotonic()
            gossips[step % args.peers].publish(_sealed(step, signers))
            deadline = started + 60
            while not all(g.newest is not None and g.newest[0] == step for g in gossips):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"step {step} did not reach every peer")
                time.sleep(0.005)
            times.append(time.monotonic() - started)
    finally:
        for gossip in gossips:
            gossip.close()
        for dht in dhts:
            stop_dht(dht)
    result = {"peers": args.peers, "fanout": args.fanout, "to_all_s_median": statistics.median(times),
              "to_all_s_max": max(times)}
    console.print(result)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
