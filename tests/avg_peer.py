"""One averaging peer as its own OS process, for tests that SIGKILL a peer mid-round.

    python tests/avg_peer.py --initial-peers MADDR --index I --out DIR [--kill-phase send|reduce|matchmaking] [--prefix P] [--peers N]

Averages torch.randn(numel) seeded by (seed, index) with weight index+1 (fp32, mean) and writes
DIR/result{I}.safetensors plus DIR/record{I}.json. With --kill-phase it SIGKILLs itself there.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from averaging import AveragingConfig, FaultInjector, GroupAverager
from bootstrap import start_dht, start_reaper, stop_dht


def _wait_for_the_others(out_dir: Path, index: int, peers: int, peer_id: str, timeout_s: float = 60.0) -> set[str]:
    """Start the round together, and know who the others are (a peer that starts it late on a loaded machine,
    or whose entry a read missed, would otherwise draw another group): the peers' IDs, each written by its peer."""
    (out_dir / f"ready{index}.tmp").write_text(peer_id)
    (out_dir / f"ready{index}.tmp").rename(out_dir / f"ready{index}")  # whole, or not there
    deadline = time.monotonic() + timeout_s
    while not all((out_dir / f"ready{i}").exists() for i in range(peers)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not all {peers} peers were up within {timeout_s:.0f} s")
        time.sleep(0.05)  # polling files with a deadline
    return {(out_dir / f"ready{i}").read_text() for i in range(peers)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--numel", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-phase", default=None)
    parser.add_argument("--prefix", default="killtest", help="the averaging key prefix (one per test)")
    parser.add_argument("--peers", type=int, default=1, help="wait until this many peers are up in --out")
    args = parser.parse_args()
    start_reaper()
    dht = start_dht(args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
    config = AveragingConfig(
        matchmaking_time_s=2.0,
        sender_timeout_s=4.0,
        reducer_timeout_s=8.0,
        agreement_timeout_s=2.0,
        round_timeout_s=40.0,
        aggregator="mean",
        min_group_size=2,
        codec="fp32",
    )
    averager = GroupAverager(dht, prefix=args.prefix, config=config)
    # the run's live members, as a trainer passes them (`GroupAverager.step`'s ``expected``)
    members = _wait_for_the_others(Path(args.out), args.index, args.peers, averager.peer_id)
    if args.kill_phase:
        faults = FaultInjector()
        faults.attach(averager, f"peer{args.index}")
        faults.add(f"peer{args.index}", 1, args.kill_phase, "kill")
    tensor = torch.randn(args.numel, generator=torch.Generator().manual_seed(args.seed * 1000 + args.index))
    try:
        out, record, _ = averager.step(tensor, weight=float(args.index + 1), expected=members)
        out_dir = Path(args.out)
        if out is not None:
            save_file({"result": out}, str(out_dir / f"result{args.index}.safetensors"))
        (out_dir / f"record{args.index}.json").write_text(json.dumps({**record.to_dict(), "peer_id": averager.peer_id}))
    finally:
        averager.close()
        stop_dht(dht)


if __name__ == "__main__":
    main()
