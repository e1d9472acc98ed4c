"""Worker process of benchmarks.convergence: one trainer (charlm or teacher) that is not a Swarm peer.

    python -m benchmarks._hivemind_trainer dht  --host-maddrs /ip4/127.0.0.1/tcp/0
    python -m benchmarks._hivemind_trainer solo --preset tiny --steps 3720 --eval-every 60 --log solo.jsonl
    python -m benchmarks._hivemind_trainer hivemind --initial-peers /ip4/... --shard-index 0 --num-shards 4 \
        --peers 4 --steps 930 --eval-every 15 --sync-every 15 --log hm0.jsonl
    python -m benchmarks._hivemind_trainer dp --ip 10.77.0.11 --shard-index 0 --num-shards 4 --peers 4 \
        --steps 930 --eval-every 15 --ready-dir DIR --log dp0.jsonl

Roles:
  * ``dht``: a plain hivemind DHT node (no Swarm record validators) for the hivemind arm to join;
    prints ``--initial-peers MADDR...`` on stdout, then serves until SIGTERM.
  * ``solo``: the single-peer baseline, plain ``torch.optim.AdamW`` on the whole training split
    (shard 0 of 1, i.e. the union of the swarm's shards), no network at all.
  * ``hivemind``: the anchor, the same AdamW wrapped in ``hivemind.Optimizer`` with
    ``use_local_updates=True`` (see ``make_hivemind_optimizer`` for every setting and why).
  * ``dp``: the reference, synchronous data parallelism: ``--peers`` processes (rank = shard index)
    in one torch.distributed gloo group, the model wrapped in ``DistributedDataParallel``, so every
    step all-reduces the gradients (fp32) and applies the same AdamW step everywhere: one step of
    the global batch ``peers x batch``. Rank 0 hosts the TCPStore on ``--ip`` and writes its port to
    ``--ready-dir``/rendezvous.json; the others read it from there (``--ip`` of rank 0 too).

All roles share one training and evaluation loop and the same inner optimizer (AdamW with the same
lr, weight decay and linear warm-up, ``--lr-warmup-steps``), so the figures differ only by how the
peers combine their work. Every line of ``--log`` is a JSON object with an ``event`` key: ``start``,
``val`` (``step``, ``samples`` seen by this process, ``val_loss``), ``done``. SIGTERM/SIGINT stop
the loop and shut the optimizer and DHT down (no p2pd is left).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import torch

from swarm.tasks import get_task, num_params

AVERAGED_LINE = "Averaged parameters with "
FAILED_LINE = "Averaging failed with "


class _Log:
    """Append-only JSON-lines log, flushed after each line so the parent can read it live."""

    def __init__(self, path: str | None) -> None:
        self._file: IO[str] | None = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115

    def emit(self, event: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class _AveragingCounter(logging.Handler):
    """Counts hivemind's own "Averaged parameters with N peers" / "Averaging failed" status lines."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self._counts_lock = threading.Lock()
        self.ok: list[int] = []
        self.failed = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        with self._counts_lock:
            if message.startswith(AVERAGED_LINE):
                self.ok.append(int(message[len(AVERAGED_LINE) :].split()[0]))
            elif message.startswith(FAILED_LINE):
                self.failed += 1

    def snapshot(self) -> dict[str, Any]:
        with self._counts_lock:
            return {
                "averaged": len(self.ok),
                "failed": self.failed,
                "mean_group": sum(self.ok) / len(self.ok) if self.ok else None,
            }


_MAIN_PID = os.getpid()


def _interrupt(signum: int, _frame: Any) -> None:
    if os.getpid() != _MAIN_PID:  # a forked child (DHT, averager) inherited this handler: die as told
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt(signal.Signals(signum).name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._hivemind_trainer", description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=("dht", "solo", "hivemind", "dp"))
    parser.add_argument("--task", default="charlm", help="task of swarm.tasks (charlm, teacher)")
    parser.add_argument(
        "--lr-warmup-steps", type=int, default=0, help="linear warm-up of the learning rate over this many local steps"
    )
    parser.add_argument("--ip", default="127.0.0.1", help="dp: the address of rank 0's TCPStore")
    parser.add_argument("--host-maddrs", nargs="+", default=["/ip4/127.0.0.1/tcp/0"])
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--preset", default="tiny", help="task size preset")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial model and the batch order")
    parser.add_argument("--shard-index", type=int, default=0)
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument("--steps", type=int, default=0, help="local optimizer steps (batches) to train")
    parser.add_argument("--eval-every", type=int, default=0, help="evaluate every this many local steps")
    parser.add_argument("--eval-batches", type=int, default=8, help="validation batches per evaluation")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (swarm.peer's default)")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (swarm.peer's default)")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--log", default=None, help="JSON-lines log file")
    parser.add_argument("--run-id", default="convergence", help="hivemind run_id")
    parser.add_argument("--peers", type=int, default=4, help="peers of the hivemind run (sizes target_batch_size)")
    parser.add_argument("--sync-every", type=int, default=15, help="local steps per hivemind epoch, per peer")
    parser.add_argument("--matchmaking-time-s", type=float, default=2.0)
    parser.add_argument("--averaging-timeout-s", type=float, default=30.0)
    parser.add_argument("--sender-timeout-s", type=float, default=10.0)
    parser.add_argument("--reducer-timeout-s", type=float, default=20.0)
    parser.add_argument(
        "--ready-dir",
        default=None,
        help="hivemind: once the optimizer is built, mark this peer ready here and wait until "
        "--peers peers are, so no peer trains epochs alone while the others still start up",
    )
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    return parser


def make_hivemind_optimizer(model: torch.nn.Module, dht: Any, args: argparse.Namespace, batch_size: int) -> Any:
    """hivemind.Optimizer around AdamW, set up to average about as often as a Swarm peer does.

    * ``use_local_updates=True``: every step applies this peer's own AdamW update, and at the end
      of each epoch the peers average their parameters (hivemind's local-SGD mode, the nearest to
      DiLoCo's inner steps). The default (gradient accumulation to target_batch_size, then one
      global step) would take peers x sync_every fewer optimizer steps for the same samples.
    * ``target_batch_size = peers x batch x sync_every``: one epoch, hence one averaging round,
      per ``sync_every`` local steps of each peer, like ``swarm.peer --sync-every``.
    * ``matchmaking_time`` / ``averaging_timeout`` equal Swarm's defaults (2 s / 30 s); the
      timeouts hivemind leaves at None (one silent peer would stall a round forever) are set like
      Swarm's: ``allreduce_timeout`` = averaging timeout, ``next_chunk_timeout`` = ``sender_timeout``
      = 10 s, ``reducer_timeout`` = 20 s; ``request_timeout`` = 1 s < ``matchmaking_time`` (it must be).
      ``target_group_size`` = peers, ``min_group_size`` = 2, as our run is configured.
    * Everything else stays at hivemind's defaults, which is what a user would run:
      ``delay_state_averaging=True`` (averaging in a background thread, applied with the delta rule),
      no compression (fp32 on the wire), no optimizer statistics averaged.
    """
    from hivemind import Optimizer

    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    return Optimizer(
        dht=dht,
        run_id=args.run_id,
        target_batch_size=args.peers * batch_size * args.sync_every,
        batch_size_per_step=batch_size,
        optimizer=inner,
        use_local_updates=True,
        matchmaking_time=args.matchmaking_time_s,
        averaging_timeout=args.averaging_timeout_s,
        allreduce_timeout=args.averaging_timeout_s,
        next_chunk_timeout=args.sender_timeout_s,
        averager_opts={
            "request_timeout": min(1.0, args.matchmaking_time_s / 2),
            "target_group_size": args.peers,
            "min_group_size": 2,
            "sender_timeout": args.sender_timeout_s,
            "reducer_timeout": args.reducer_timeout_s,
        },
        verbose=True,  # status lines at INFO: counted by _AveragingCounter
    )


def wait_for_peers(ready_dir: Path, *, index: int, num_peers: int, timeout_s: float) -> None:
    """A start barrier: mark this peer ready, then poll until `num_peers` peers are (TimeoutError after timeout_s)."""
    ready_dir.mkdir(parents=True, exist_ok=True)
    (ready_dir / f"peer{index}.ready").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(ready_dir.glob("*.ready"))) < num_peers:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {len(list(ready_dir.glob('*.ready')))} of {num_peers} peers were ready within {timeout_s:.0f} s"
            )
        time.sleep(0.05)


def start_gloo(args: argparse.Namespace) -> Any:
    """Join the dp arm's gloo group: rank 0 hosts the TCPStore and publishes its port in --ready-dir."""
    import torch.distributed as dist

    if args.ip.startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    timeout = timedelta(seconds=args.ready_timeout_s)
    rendezvous = Path(args.ready_dir) / "rendezvous.json"
    if args.shard_index == 0:  # port 0: the store picks a free port, no race with other runs
        store = dist.TCPStore(args.ip, 0, args.peers, is_master=True, timeout=timeout, wait_for_workers=False)
        rendezvous.parent.mkdir(parents=True, exist_ok=True)
        tmp = rendezvous.with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": store.port}))
        os.replace(tmp, rendezvous)
    else:
        deadline = time.monotonic() + args.ready_timeout_s
        while not rendezvous.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no rendezvous from rank 0 within {args.ready_timeout_s:.0f} s")
            time.sleep(0.05)
        store = dist.TCPStore(
            args.ip, json.loads(rendezvous.read_text())["port"], args.peers, is_master=False, timeout=timeout
        )
    dist.init_process_group("gloo", store=store, rank=args.shard_index, world_size=args.peers, timeout=timeout)
    return dist


def set_warmup_lr(optimizer: Any, *, step: int, lr: float, warmup_steps: int) -> None:
    """The learning rate of local step ``step`` (1-based): linear warm-up to ``lr`` over ``warmup_steps``."""
    from swarm.recipe import warmup_factor

    factor = warmup_factor(step, warmup_steps)
    # hivemind.Optimizer's param_groups are copies: its inner optimizer holds the real ones
    inner = optimizer.state_averager.optimizer if hasattr(optimizer, "state_averager") else optimizer
    for group in inner.param_groups:
        group["lr"] = lr * factor


def train(args: argparse.Namespace, log: _Log, *, dht: Any = None, dist: Any = None) -> None:
    task = get_task(args.task, preset=args.preset)
    model = task.build_model(seed=args.seed)
    batch_size = task.config.batch_size
    counter = _AveragingCounter()
    trained = model
    if dist is not None:
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(model)  # broadcasts rank 0's weights (identical anyway: same seed)
    if dht is None:
        optimizer: Any = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    else:
        logging.getLogger("hivemind.optim.state_averager").addHandler(counter)
        optimizer = make_hivemind_optimizer(model, dht, args, batch_size)
    batches = task.train_batches(shard_index=args.shard_index, num_shards=args.num_shards, seed=args.seed)

    def evaluate(step: int) -> None:
        extra = {"epoch": optimizer.local_epoch, **counter.snapshot()} if dht is not None else {}
        log.emit(
            "val",
            step=step,
            samples=step * batch_size,
            val_loss=task.evaluate(model, max_batches=args.eval_batches),
            **extra,
        )

    started, step = time.monotonic(), 0
    try:
        if dht is not None and args.ready_dir and args.role == "hivemind":
            wait_for_peers(
                Path(args.ready_dir), index=args.shard_index, num_peers=args.peers, timeout_s=args.ready_timeout_s
            )
        log.emit(
            "start",
            pid=os.getpid(),
            role=args.role,
            params=num_params(model),
            batch_size=batch_size,
            shard=args.shard_index,
            num_shards=args.num_shards,
            steps=args.steps,
        )
        evaluate(0)
        started = time.monotonic()
        for step in range(1, args.steps + 1):
            set_warmup_lr(optimizer, step=step, lr=args.lr, warmup_steps=args.lr_warmup_steps)
            loss = task.loss(trained, next(batches))
            loss.backward()  # dp: DDP all-reduces (averages) the gradients here
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % args.eval_every == 0 or step == args.steps:
                evaluate(step)
    finally:
        log.emit(
            "done", step=step, train_s=time.monotonic() - started, **(counter.snapshot() if dht is not None else {})
        )
        if dht is not None:
            optimizer.shutdown()


def serve_dht(args: argparse.Namespace) -> None:
    from bootstrap import initial_peers_line, start_dht, stop_dht

    dht = start_dht(args.initial_peers, host_maddrs=args.host_maddrs, nat_port_map=False)
    try:
        print(initial_peers_line(dht), flush=True)
        while True:
            time.sleep(3600)  # until SIGTERM
    finally:
        stop_dht(dht)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.torch_threads)
    if args.role != "dht" and not (args.steps > 0 and args.eval_every > 0):
        print(f"error: --steps and --eval-every must be > 0, got {args.steps} and {args.eval_every}", file=sys.stderr)
        return 2
    log = _Log(args.log)
    dht = None
    try:
        if args.role == "dht":
            serve_dht(args)
        elif args.role == "solo":
            train(args, log)
        elif args.role == "dp":
            if not args.ready_dir:
                print("error: dp needs --ready-dir (the rendezvous folder)", file=sys.stderr)
                return 2
            dist = start_gloo(args)
            try:
                train(args, log, dist=dist)
            finally:
                dist.destroy_process_group()
        else:
            from bootstrap import start_dht, start_reaper

            start_reaper()  # the DHT, averager and p2pd children die with this process, even on SIGKILL
            dht = start_dht(args.initial_peers, host_maddrs=args.host_maddrs, nat_port_map=False)
            train(args, log, dht=dht)
    except KeyboardInterrupt as e:
        print(f"interrupted ({e}); stopping", file=sys.stderr)
        return 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # the clean-up below is bounded; let it finish
            signal.signal(sig, signal.SIG_IGN)
        if dht is not None:
            from bootstrap import stop_dht

            stop_dht(dht)
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
