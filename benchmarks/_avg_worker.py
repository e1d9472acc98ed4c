"""One peer of `benchmarks.averaging_round`, as its own OS process on its own lab host.

    python -m benchmarks._avg_worker --mode ours|hivemind|gloo --rank I --world N --numel K --ip IP --dir DIR
        [--codec fp32|fp16|int8] [--repeats R] [--timeout-s T] [--matchmaking-s S] [--victim RANK]

Averages `make_tensor(seed, rank, numel)` with the other N-1 workers, R times, each time from the same
values. Rendezvous through files in DIR (the parent and every worker run on this one machine, so they
share the file system and the wall clock):

  * rank 0 writes DIR/rendezvous.json (its DHT's addresses, or the port of its gloo TCPStore); the
    others poll for it and join;
  * before repeat r each worker writes DIR/ready-r-I; the parent answers with DIR/go-r holding a common
    wall-clock start time; every worker sleeps until then and starts its round;
  * after the round it writes DIR/result-r-I.json: when its round began and ended (wall clock), bytes,
    CPU seconds of its process tree, and a checksum of the result (its sum and the values at
    `sample_indices`), from which the parent checks the mean against its own reference;
  * after the last repeat it waits for DIR/exit (written by the parent once it has every result), so
    that no peer leaves while another still reads a reply from it.

With --victim V (mode ours), worker V SIGKILLs itself in the last repeat 0.3 s after it is about to send
its first part (no part sent), after writing DIR/death.json with the wall-clock time; every worker of
that run uses short fault timeouts (sender 5 s).
Every wait is bounded by --timeout-s; a worker that times out exits with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch

NUM_SAMPLES = 4096
"""Result values the parent checks elementwise (at fixed random indices), besides the sum."""
POLL_S = 0.005


class RendezvousTimeout(TimeoutError):
    pass


# --------------------------------------------------------------------------------------------- shared with the parent
def make_tensor(seed: int, rank: int, numel: int) -> torch.Tensor:
    """The fp32 vector worker `rank` averages (the parent regenerates it for its reference)."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed * 1000 + rank))


def sample_indices(numel: int) -> torch.Tensor:
    return torch.randint(0, numel, (min(NUM_SAMPLES, numel),), generator=torch.Generator().manual_seed(12345))


def checksum(result: torch.Tensor) -> dict[str, Any]:
    flat = result.detach().reshape(-1).float().contiguous()
    return {
        "sum": float(flat.double().sum()),
        "samples": flat[sample_indices(flat.numel())].tolist(),
        "digest": hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16],
    }


def write_json(path: Path, obj: Any) -> None:
    """Atomic: a poller never reads a half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def wait_json(path: Path, deadline: float, *, alive: Callable[[], None] | None = None) -> Any:
    """Poll for `path` until `deadline` (time.monotonic()); `alive` may raise to stop waiting early."""
    while not path.exists():
        if time.monotonic() > deadline:
            raise RendezvousTimeout(f"no {path.name} in {path.parent} before the deadline")
        if alive is not None:
            alive()
        time.sleep(POLL_S)
    return json.loads(path.read_text())


def cpu_seconds_by_name() -> dict[str, float]:
    """user+system CPU seconds of this process and its descendants (DHT, p2pd, averager), by name."""
    me = psutil.Process()
    totals: dict[str, float] = {}
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            name = "p2pd" if "p2pd" in proc.name() else "python"
            totals[name] = totals.get(name, 0.0) + times.user + times.system
    return totals


# --------------------------------------------------------------------------------------------- peers
class _Peer:
    """One method's peer: the constructor joins the others, `round` averages once, `close` leaves."""

    def round(self, tensor: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, Any]]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _start_dht(args: argparse.Namespace, deadline: float):
    from bootstrap import start_dht, visible_maddrs

    host = [f"/ip4/{args.ip}/tcp/0"]
    rendezvous = Path(args.dir) / "rendezvous.json"
    if args.rank == 0:
        dht = start_dht(host_maddrs=host, nat_port_map=False)
        write_json(rendezvous, {"maddrs": visible_maddrs(dht)})
        return dht
    maddrs = wait_json(rendezvous, deadline)["maddrs"]
    return start_dht(
        maddrs, host_maddrs=host, nat_port_map=False, connect_timeout_s=max(1.0, deadline - time.monotonic())
    )


class _Ours(_Peer):
    def __init__(self, args: argparse.Namespace, deadline: float):
        from averaging import AveragingConfig, GroupAverager, get_codec

        self.dht = _start_dht(args, deadline)
        if args.victim is None:
            config = AveragingConfig(
                matchmaking_time_s=args.matchmaking_s,
                aggregator="mean",
                codec=args.codec,
                max_weight_ratio=None,
                max_weight=1e6,
                min_group_size=args.world,
                target_group_size=args.world,
                sender_timeout_s=args.sender_timeout_s,
                reducer_timeout_s=2 * args.sender_timeout_s,
                round_timeout_s=args.timeout_s,
                **({} if args.piece_numel is None else {"piece_numel": args.piece_numel}),
            )
        else:  # the old benchmark's figure: a dead sender costs about the sender timeout
            config = AveragingConfig(
                matchmaking_time_s=args.matchmaking_s,
                aggregator="mean",
                codec=args.codec,
                max_weight_ratio=None,
                max_weight=1e6,
                min_group_size=2,
                target_group_size=args.world,
                sender_timeout_s=5.0,
                reducer_timeout_s=10.0,
                agreement_timeout_s=2.0,
                round_timeout_s=60.0,
            )
        self.averager = GroupAverager(self.dht, prefix="avgbench", config=config)
        # the first int8 encode imports bitsandbytes (about 0.5 s of CPU, 1.3 s before it skipped TorchInductor,
        # on the averager's event loop, where it stalls joins and streams): a one-off start-up cost, paid here
        # rather than in a round
        codec = get_codec(args.codec)
        codec.decode(codec.encode(torch.ones(8192)), numel=8192)
        if args.victim == args.rank:
            self.averager.fault_hook = _killer(Path(args.dir) / "death.json", args.repeats)

    def round(self, tensor):
        out, record, _ = self.averager.step(tensor, weight=1.0)
        return out, {
            "outcome": record.outcome,
            "bytes_sent": record.bytes_sent,
            "bytes_received": record.bytes_received,
            "phase_s": record.phase_s,
            "members": len(record.members),
            "included": len(record.included),
            "failures": record.failures,
            "revised_slices": self.averager.revised_slices,
        }

    def close(self):
        from bootstrap import stop_dht

        self.averager.close()
        stop_dht(self.dht)


def _killer(death_file: Path, round_to_die: int):
    async def hook(round_: int, phase: str, _peer: str) -> None:
        if round_ == round_to_die and phase == "send":
            # the group has formed; a pause lets every follower read the leader's answer first, so that
            # the victim dies as a sender (no part sent) whether or not it led the matchmaking
            await asyncio.sleep(0.3)
            write_json(death_file, {"wall": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


class _Hivemind(_Peer):
    def __init__(self, args: argparse.Namespace, deadline: float):
        from hivemind.averaging import DecentralizedAverager

        self.dht = _start_dht(args, deadline)
        t = args.timeout_s
        # HIVEMIND.md: its timeouts default to None (a silent peer stalls forever); request_timeout must be
        # below min_matchmaking_time
        self.averager = DecentralizedAverager(
            [torch.zeros(args.numel)],
            self.dht,
            start=True,
            prefix="avgbench",
            target_group_size=args.world,
            min_group_size=args.world,
            min_matchmaking_time=args.matchmaking_s,
            request_timeout=min(3.0, args.matchmaking_s / 2),
            allreduce_timeout=t,
            next_chunk_timeout=args.sender_timeout_s,
            sender_timeout=args.sender_timeout_s,
            reducer_timeout=2 * args.sender_timeout_s,
        )
        self.timeout_s = t

    def round(self, tensor):
        with self.averager.get_tensors() as tensors:
            tensors[0].copy_(tensor)
        try:
            gathered = self.averager.step(weight=1.0, timeout=self.timeout_s)
            outcome = "ok" if gathered is not None else "failed"
        except Exception as e:  # hivemind raises on a failed round when retries run out
            outcome = f"failed: {e!r}"[:200]
        if outcome != "ok":
            return None, {"outcome": outcome}
        with self.averager.get_tensors() as tensors:
            result = tensors[0].clone()
        return result, {"outcome": "ok", "members": len(gathered)}

    def close(self):
        from bootstrap import stop_dht

        self.averager.shutdown()
        stop_dht(self.dht)


class _Gloo(_Peer):
    def __init__(self, args: argparse.Namespace, deadline: float):
        import torch.distributed as dist

        if args.ip.startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback hosts carry no interface name
        timeout = timedelta(seconds=max(1.0, deadline - time.monotonic()))
        rendezvous = Path(args.dir) / "rendezvous.json"
        if args.rank == 0:  # port 0: the store picks a free port, no race with other benchmarks
            store = dist.TCPStore(args.ip, 0, args.world, is_master=True, timeout=timeout, wait_for_workers=False)
            write_json(rendezvous, {"port": store.port})
        else:
            port = wait_json(rendezvous, deadline)["port"]
            store = dist.TCPStore(args.ip_rank0, port, args.world, is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo", store=store, rank=args.rank, world_size=args.world, timeout=timedelta(seconds=args.timeout_s)
        )
        self.dist, self.world = dist, args.world
        self.buffer = torch.empty(args.numel)

    def round(self, tensor):
        self.buffer.copy_(tensor)
        self.dist.barrier()
        began = time.time()  # gloo's group is fixed: time the all-reduce from the barrier's exit
        self.dist.all_reduce(self.buffer)
        self.buffer.div_(self.world)
        return self.buffer, {"outcome": "ok", "began_wall": began}

    def close(self):
        self.dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- main
def _repeat(peer: _Peer, tensor: torch.Tensor, args: argparse.Namespace, repeat: int, deadline: float) -> None:
    out = Path(args.dir)
    write_json(out / f"ready-{repeat}-{args.rank}", {"pid": os.getpid()})
    start_wall = wait_json(out / f"go-{repeat}", deadline)["start_wall"]
    time.sleep(max(0.0, start_wall - time.time()))
    cpu_before = cpu_seconds_by_name()
    result, info = peer.round(tensor)
    end_wall = time.time()
    cpu_after = cpu_seconds_by_name()
    info.setdefault("began_wall", start_wall)
    info.update(
        rank=args.rank,
        repeat=repeat,
        start_wall=start_wall,
        end_wall=end_wall,
        round_s=end_wall - info["began_wall"],
        cpu_s={k: v - cpu_before.get(k, 0.0) for k, v in cpu_after.items()},
        checksum=checksum(result) if result is not None else None,
    )
    write_json(out / f"result-{repeat}-{args.rank}.json", info)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._avg_worker", description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("ours", "hivemind", "gloo"), required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--ip", required=True, help="this host's address")
    parser.add_argument("--ip-rank0", default=None, help="rank 0's host address (gloo); default --ip")
    parser.add_argument("--dir", required=True, help="rendezvous and results folder")
    parser.add_argument("--codec", choices=("fp32", "fp16", "int8"), default="fp32")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=120.0, help="bound on every wait and on one round")
    parser.add_argument("--matchmaking-s", type=float, default=2.0)
    parser.add_argument(
        "--sender-timeout-s",
        type=float,
        default=30.0,
        help="ours' sender_timeout_s; hivemind's sender_timeout and next_chunk_timeout (reducer: 2x)",
    )
    parser.add_argument("--piece-numel", type=int, default=None, help="ours' piece_numel (default: AveragingConfig's)")
    parser.add_argument(
        "--victim", type=int, default=None, help="this rank SIGKILLs itself at its first send of the last repeat"
    )
    args = parser.parse_args(argv)
    args.ip_rank0 = args.ip_rank0 or args.ip
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bootstrap import start_reaper

    start_reaper()  # our DHT, p2pd and averager children die with us, even on SIGKILL
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks below
    torch.set_num_threads(1)  # many peers share this machine's few cores
    tensor = make_tensor(args.seed, args.rank, args.numel)
    deadline = time.monotonic() + args.timeout_s
    peer = {"ours": _Ours, "hivemind": _Hivemind, "gloo": _Gloo}[args.mode](args, deadline)
    try:
        for repeat in range(args.repeats):
            _repeat(peer, tensor, args, repeat, time.monotonic() + args.timeout_s)
        # a peer that is done may still be streaming a reduced slice to a slower one (through p2pd's
        # and the link's buffers): leaving now would cut that reply, so wait until the parent has all results
        wait_json(Path(args.dir) / "exit", time.monotonic() + args.timeout_s)
    except RendezvousTimeout as e:
        print(f"worker {args.rank}: {e}", file=sys.stderr)
        return 2
    finally:
        peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
