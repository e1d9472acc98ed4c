"""State download for a joiner, side by side in one run: our verified shard exchange from 1 and from 3
donors, and hivemind's (unverified) `load_state_from_peers` of the same tensors.

    python -m benchmarks.state_sync [--numel 25000000]   # 25M fp32 = 100 MB

Our figure includes writing every shard into the joiner's store (digest checked on arrival) and
loading the state back from it (digests checked again); hivemind's is the download alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from hivemind.averaging import DecentralizedAverager
from rich.console import Console
from rich.table import Table

from bootstrap import start_dht, stop_dht, visible_maddrs
from swarm.checkpoint import CheckpointStore
from swarm.checkpoint.exchange import ShardExchange
from swarm.checkpoint.sync import StoreShardSource

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RESULTS = Path(__file__).parent / "results" / "state_sync.json"


class _Donor(DecentralizedAverager):
    def __init__(self, *args, state, **kwargs):
        self._state = state
        super().__init__(*args, **kwargs)

    def get_current_state(self):
        return {"step": 1}, self._state, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.state_sync", description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    args = parser.parse_args(argv)
    console = Console()
    generator = torch.Generator().manual_seed(0)
    chunks = 8
    state = {f"param/{i}": torch.randn(args.numel // chunks, generator=generator) for i in range(chunks)}
    size_mb = sum(t.numel() * 4 for t in state.values()) / 1e6
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dhts = [start_dht(host_maddrs=LOOPBACK, nat_port_map=False)]
        exchanges = []
        try:
            dhts += [start_dht(visible_maddrs(dhts[0]), host_maddrs=LOOPBACK, nat_port_map=False) for _ in range(3)]
            donor_stores = [CheckpointStore(Path(tmp) / f"donor{i}") for i in range(3)]
            shards = [store.put_tensors(state, max_shard_bytes=16 << 20) for store in donor_stores][0]
            exchanges = [ShardExchange(d, StoreShardSource(s)) for d, s in zip(dhts[1:], donor_stores)]
            for num_donors in (1, 3):
                joiner_store = CheckpointStore(Path(tmp) / f"joiner{num_donors}")
                joiner = ShardExchange(dhts[0], StoreShardSource(joiner_store))
                try:
                    started = time.perf_counter()
                    data, report = joiner.fetch({s.digest: s.size_bytes for s in shards},
                                                [e.peer_id for e in exchanges[:num_donors]], timeout_s=600)
                    for shard in shards:
                        joiner_store.put_shard_bytes(data[shard.digest], expected_digest=shard.digest)
                    loaded = {}
                    for shard in shards:
                        loaded.update(joiner_store.load_tensors(shard))
                    seconds = time.perf_counter() - started
                finally:
                    joiner.close()
                assert all(torch.equal(loaded[k], v) for k, v in state.items())
                rows.append({"system": f"ours, {num_donors} donor(s), verified", "seconds": seconds,
                             "mb_per_s": size_mb / seconds})
            donors = [_Donor([torch.zeros(1)], d, start=True, prefix="bench_state", state=list(state.values()),
                             allow_state_sharing=True, declare_state_period=5, next_chunk_timeout=60,
                             min_matchmaking_time=5.0, request_timeout=3.0)
                      for d in dhts[1:2]]
            # same class as the donor: hivemind names its RPC handlers after the averager's class
            joiner = _Donor([torch.zeros(1)], dhts[0], start=True, prefix="bench_state", state=[],
                                           allow_state_sharing=False, next_chunk_timeout=60,
                                           min_matchmaking_time=5.0, request_timeout=3.0)
            try:
                deadline = time.monotonic() + 30
                result = None
                started = time.perf_counter()
                while result is None and time.monotonic() < deadline:  # wait for the donor's DHT declaration
                    started = time.perf_counter()
                    result = joiner.load_state_from_peers(timeout=300)
                seconds = time.perf_counter() - started
                if result is None:
                    raise RuntimeError("hivemind's state download found no donor")
                rows.append({"system": "hivemind load_state_from_peers, 1 donor, unverified", "seconds": seconds,
                             "mb_per_s": size_mb / seconds})
            finally:
                joiner.shutdown()
                for donor in donors:
                    donor.shutdown()
        finally:
            for exchange in exchanges:
                exchange.close()
            for dht in dhts:
                stop_dht(dht)
    table = Table(title=f"joiner state download on loopback: {size_mb:.0f} MB")
    for column in ("system", "seconds", "MB/s"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["system"], f"{row['seconds']:.2f}", f"{row['mb_per_s']:.0f}")
    console.print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"size_mb": size_mb, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
