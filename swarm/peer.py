"""`python -m swarm.peer`: contribute this machine to a training run.

    python -m swarm.peer --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/Qm... --run demo --task charlm

Joins the DHT, builds the task's model and this peer's data shard, loads the run's current state
from its peers, then trains: local steps, and every ``--sync-every`` steps an averaging round.
Ctrl+C or SIGTERM leaves cleanly (the averager and the DHT with its p2pd stop; nothing is orphaned).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import hashlib
import io
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hivemind import DHT
from rich.console import Console
from safetensors.torch import save_file

from bootstrap import DHTStartError, Stopped, StopSignal, parse_initial_peers, stop_dht
from bootstrap.cli import add_dataclass_arguments, dataclass_from_args, field_docs, log_handler, stderr_console
from bootstrap.identity import Identity, IdentityError
from bootstrap.network import start_swarm_dht
from peers import ResourceGraph, pick_run, probe_hardware, probe_software
from swarm.events import EventLog
from swarm.node import Node, launched_size
from swarm.recipe import DTYPES, PRECISIONS, Precision, ScaledStep, autocast_dtype, inner_step
from swarm.tasks import get_task
from swarm.trainer import TaskInfo, Trainer, TrainerConfig, WorkSpec

logger = logging.getLogger("swarm.peer")
EXIT_BAD_INPUT = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerConfig:
    """What this peer trains and how (the run and networking settings are in TrainerConfig)."""

    task: str = "charlm"
    """Task to train: built in (charlm, teacher), installed (an entry point in the swarm.tasks group) or package.module:factory."""
    task_preset: str = "default"
    """Size preset of the task's model (charlm: tiny, small, default; teacher: tiny, default)."""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda."""
    precision: Precision = "auto"
    """Autocast of the forward pass: auto (bf16 on GPUs that compute it natively, compute capability 8.0 and
    up; fp16 with a loss scaler on 7.x, V100/T4/RTX 20xx; fp32 on older GPUs and on a CPU), fp32, bf16, or fp16
    (with a torch.amp.GradScaler; verified work is then off)."""
    optimizer: str = "adamw"
    """Inner optimizer: adamw, or adamw8bit (bitsandbytes 8-bit states)."""
    lr: float = 3e-3
    """Inner optimizer learning rate."""
    weight_decay: float = 0.01
    """Inner optimizer weight decay."""
    num_shards: int = 16
    """Number of disjoint data shards the training split is cut into."""
    shard_index: int | None = None
    """This peer's shard; by default derived from its identity key."""
    seed: int = 0
    """Seed of the initial model (must be the same for all peers of a run) and of batch sampling."""
    max_steps: int = 0
    """Stop after this many local steps (0: no limit)."""
    max_rounds: int = 0
    """Stop after this many averaging rounds (0: no limit)."""
    duration_s: float = 0.0
    """Stop after this many seconds of training (0: no limit)."""
    eval_batches: int = 4
    """Validation batches evaluated after a round that ``eval_every`` names (0: no validation)."""
    eval_every: int = 5
    """Evaluate after every this many rounds, and when training ends (0: only when it ends). Every member of a
    group evaluates the same parameters, on the training thread: 4 batches cost 0.11-0.13 of the compute of 10
    training steps (charlm tiny to default, one thread), so every round at the default sync interval would
    spend about a ninth of the machine on validation; every 5 rounds, about a fortieth."""
    torch_threads: int = 0
    """Torch CPU threads (0: torch's default)."""
    identity_key: str | None = None
    """Ed25519 identity key file (default ~/.swarm/identity.key, created 0600 on first run)."""
    events: str | None = None
    """Append JSON-lines events (steps, rounds, validation) to this file."""
    dump_dir: str | None = None
    """Debug: write each round's local and resulting parameters as safetensors files here."""

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.optimizer not in ("adamw", "adamw8bit"):
            raise ValueError(f"optimizer must be adamw or adamw8bit, got {self.optimizer!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards!r}")
        if self.shard_index is not None and not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard_index must be in [0, {self.num_shards}), got {self.shard_index!r}")
        for name in ("max_steps", "max_rounds", "eval_batches", "eval_every", "torch_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.duration_s < 0:
            raise ValueError(f"duration_s must be >= 0, got {self.duration_s!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m swarm.peer", description="Contribute this machine to a Swarm training run."
    )
    parser.add_argument(
        "--run",
        default=None,
        help=field_docs(TrainerConfig)["run"]
        + (" Without --run, the peer lists the open runs of the network and joins the best-fitting one."),
    )
    add_dataclass_arguments(parser, TrainerConfig, skip=("run",))
    parser.add_argument("--averaging-timeout-s", dest="round_timeout_s", type=float, help=argparse.SUPPRESS)  # renamed
    add_dataclass_arguments(parser, PeerConfig)
    parser.add_argument("--log-level", default="INFO", help="Python logging level (default: %(default)s)")
    return parser


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available")
    return torch.device(name)


def make_inner_optimizer(config: PeerConfig, params: Any) -> torch.optim.Optimizer:
    if config.optimizer == "adamw8bit":
        from averaging.compression import import_bitsandbytes  # lazily: it probes the GPU at import

        bnb = import_bitsandbytes()

        return bnb.optim.AdamW8bit(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)


def default_shard(identity: Identity, num_shards: int) -> int:
    return int.from_bytes(hashlib.sha256(identity.public_key).digest()[:8], "big") % num_shards


class PeerRunner:
    """Owns one peer's training loop: the task, the model, the trainer and the event log. In a multi-process
    node (`swarm.node`), rank 0's runner is the peer and the other ranks' runners `follow` it."""

    def __init__(
        self,
        trainer_config: TrainerConfig,
        config: PeerConfig,
        *,
        stop: StopSignal | None,
        identity: Identity | None,
        dht: DHT | None = None,
        node: Node | None = None,
    ):
        self.trainer_config, self.config, self.stop, self.node = trainer_config, config, stop, node
        self.identity, self.dht = identity, dht
        self.device = node.device if node is not None else resolve_device(config.device)
        self.task = get_task(config.task, preset=config.task_preset)
        leads = node is None or node.leads
        self.events = EventLog(config.events if leads else None)
        shard = config.shard_index
        if shard is None and identity is not None:
            shard = default_shard(identity, config.num_shards)
        self.shard_index = node.share(shard) if node is not None else shard  # the node's ranks: rank 0's shard
        torch.manual_seed(config.seed)
        self.model = self.task.build_model(seed=config.seed).to(self.device)
        self.forward = node.wrap(self.model) if node is not None else self.model
        """The model as the training step calls it (under DDP in a node)."""
        self.autocast_dtype = autocast_dtype(config.precision, self.device)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.autocast_dtype == torch.float16 else None
        optimizer = make_inner_optimizer(config, self.model.parameters())
        self.optimizer = optimizer if self.scaler is None else ScaledStep(optimizer, self.scaler)
        """The inner optimizer, stepped through the loss scaler under fp16."""
        self.trainer: Trainer | None = None
        self.samples_seen = 0
        self.rounds_done = 0

    def _on_evidence(self, kind: str, body: dict) -> None:
        """Our own verified receipt of a sealed round becomes a "receipt" event (the demo waits for it); verified
        work's checks and exclusions become events too (benchmarks count them)."""
        if kind == "receipt" and body["receipt"]["peer"] == self.trainer.peer_id:
            self.events.emit("receipt", round=body["receipt"]["round"], samples=body["receipt"]["samples"])
        elif kind == "work_check":
            self.events.emit(kind, round=body["round"], prover=body["prover"], ok=body["ok"], reason=body["reason"])
        elif kind == "work_excluded":
            self.events.emit(kind, peer=body["peer"], reason=body["reason"])

    def start(self) -> None:
        started = time.time()
        self.events.emit(
            "start",
            pid=os.getpid(),
            shard=self.shard_index,
            task=self.task.name,
            params=sum(p.numel() for p in self.model.parameters()),
            device=str(self.device),
            precision=self.precision_name,
        )
        task_info = TaskInfo.of(self.task, self.config.task_preset)
        cfg = self.config  # verified work (--verify-work) replays this peer's shard of the task's stream
        work = WorkSpec(
            task=self.task, task_digest=task_info.config_digest, shard_index=self.shard_index,
            num_shards=cfg.num_shards, seed=cfg.seed, task_name=cfg.task,
        ) if self.node is None else None  # fmt: skip
        self.trainer = Trainer(
            self.model,
            self.optimizer,
            config=self.trainer_config,
            identity=self.identity,
            dht=self.dht,
            task_info=task_info,
            evaluate=self.evaluate_or_nan,
            work=work,
            cancel=self.stop.event,  # a signal while it joins ends its state sync: Stopped
        )
        self.stop.on_stop.append(self.trainer.interrupt)
        self.trainer.evidence.listeners.append(self._on_evidence)
        self.trainer.evidence.record(
            "start",
            {
                "pid": os.getpid(),
                "task": self.task.name,
                "preset": self.config.task_preset,
                "shard": self.shard_index,
                "params": sum(p.numel() for p in self.model.parameters()),
                "device": str(self.device),
            },
            t=started,
        )
        if self.config.dump_dir:
            self.trainer.before_sync.append(self._dump_before_sync)
        self.events.emit(
            "joined",
            peer_id=self.trainer.peer_id,
            round=self.trainer.round,
            state_loaded=self.trainer.counters.state_loaded > 0,
            state_verified=self.trainer.counters.state_verified > 0,
            join_s=time.time() - started,
        )
        if self.config.dump_dir:
            self._dump("joined", self.trainer.round, list(self.model.parameters()))
        logger.info(
            "training shard %s/%s on %s, %s",
            self.shard_index, self.config.num_shards, self.device, self.precision_name,
        )  # fmt: skip

    @property
    def precision_name(self) -> str:
        """What the forward pass runs in: fp32, bf16 or fp16 (with a loss scaler)."""
        return next(name for name, dtype in DTYPES.items() if dtype == self.autocast_dtype)

    def evaluate_or_nan(self) -> float:
        """The trainer's ``evaluate``: after the rounds that ``eval_every`` names (NaN after the others)."""
        value = self.evaluate() if self._eval_due() else None
        return float("nan") if value is None else value

    def _eval_due(self) -> bool:
        return bool(self.config.eval_every) and self.trainer.round % self.config.eval_every == 0

    def evaluate(self) -> float | None:
        if self.config.eval_batches == 0:
            return None
        with self._autocast():
            return float(self.task.evaluate(self.model, max_batches=self.config.eval_batches))

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _batches(self) -> Iterator[Any]:
        cfg = self.config
        stream = self.task.train_batches(shard_index=self.shard_index, num_shards=cfg.num_shards, seed=cfg.seed)
        return self.node.batches(stream) if self.node is not None else stream

    def _backward(self, batch: Any) -> tuple[int, float]:
        """Forward and backward on ``batch``: (the samples it holds, node-wide; its loss)."""
        x, y = (t.to(self.device, non_blocking=True) for t in batch)
        with self._autocast():
            loss = self.task.loss(self.forward, (x, y))
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        return x.shape[0] * (self.node.world_size if self.node is not None else 1), loss.item()

    def follow(self) -> None:
        """Another rank of a node: the same inner steps as rank 0's trainer, rank 0's parameters whenever the
        swarm wrote them, until rank 0 says stop (`swarm.node`)."""
        params, batches, step = _trainable(self.model), self._batches(), 0
        while not self.node.follow(params):
            self._backward(next(batches))
            step += 1
            inner_step(self.optimizer, step, self.trainer_config.inner_warmup_steps)
        if self.config.dump_dir:
            self._dump("final", 0, params, folder=Path(self.config.dump_dir) / f"rank{self.node.rank}", step=step)

    def run(self) -> None:
        trainer, cfg, node = self.trainer, self.config, self.node
        assert trainer is not None, "start() first"
        val = self.evaluate()
        self.events.emit("val", round=trainer.round, step=trainer.local_step, val_loss=val)
        trainer.evidence.record("val", {"round": trainer.round, "step": trainer.local_step, "val_loss": val})
        batches = trainer.work.batches() if trainer.work is not None else self._batches()
        params, writes = _trainable(self.model), None
        started, window_start, window_samples = time.monotonic(), time.monotonic(), 0
        while True:
            stop = self._should_stop(started)
            if node is not None:  # the first time, the state this peer joined with
                node.lead(params, changed=trainer.outer.model_writes != writes, stop=stop)
                writes = trainer.outer.model_writes
            if stop:
                break
            samples, loss_value = self._backward(next(batches))
            result = trainer.step(num_samples=samples, loss=loss_value)
            self.samples_seen += samples
            if trainer.local_step == 1:
                self.events.emit("first_step", round=trainer.round, loss=loss_value)
            window_samples += samples
            samples_per_s = window_samples / max(time.monotonic() - window_start, 1e-9)
            if trainer.local_step % 10 == 0:
                train = {
                    "step": trainer.local_step,
                    "round": trainer.round,
                    "loss": trainer.last_loss,
                    "samples_per_s": samples_per_s,
                    "samples": self.samples_seen,
                }
                self.events.emit("train", **train)
                trainer.evidence.record("train", train)
            if result is not None:
                self._on_round(result)
                window_start, window_samples = time.monotonic(), 0

        if not self.stop.event.is_set():  # done (steps, rounds, time): the round in flight lands, then a last look
            result = trainer.finish()
            if result is not None:
                self._on_round(result, final=True)
            val = self.evaluate()
            self.events.emit("val", round=trainer.round, step=trainer.local_step, val_loss=val, final=True)
            if cfg.dump_dir:
                self._dump("final", trainer.round, list(self.model.parameters()))

    def _on_round(self, result: Any, *, final: bool = False) -> float | None:
        """Count, dump, evaluate and log a round that ended (``final``: the one ``finish`` waited for)."""
        trainer, cfg = self.trainer, self.config
        self.rounds_done += 1
        if cfg.dump_dir and (final or not self.trainer_config.overlap):  # overlapped: dumped at the sync point
            self._dump("global", result.round, list(self.model.parameters()))
        val = (
            trainer.last_val_loss
            if trainer.last_val_loss is not None
            else self.evaluate()
            if self._eval_due()
            else None
        )
        trainer.last_val_loss = None
        self.events.emit(
            "round",
            round=result.round,
            step=trainer.local_step,
            group_size=result.group_size,
            landed_step=result.landed_step,
            duration_s=result.duration_s,
            val_loss=val,
            rejected=list(result.rejected),
            record=result.record.to_dict() if result.record else None,
        )
        logger.debug(  # the trainer logs each round (group, outcome, time, loss) at INFO
            "round %s: group of %s in %.2fs, val loss %s",
            result.round,
            result.group_size,
            result.duration_s,
            val if val is None else round(val, 4),
        )
        return val

    def _should_stop(self, started: float) -> bool:
        cfg, trainer = self.config, self.trainer
        if self.stop.event.is_set():
            return True
        if cfg.max_steps and trainer.local_step >= cfg.max_steps:
            return True
        if cfg.max_rounds and self.rounds_done + trainer.rounds_in_flight >= cfg.max_rounds:
            return True
        return bool(cfg.duration_s and time.monotonic() - started >= cfg.duration_s)

    def _dump_before_sync(self, round_: int, local: list[torch.Tensor]) -> None:
        self._dump("local", round_, local)
        if self.trainer_config.overlap and round_ > 0:  # the global state after the round just joined
            self._dump("global", round_, self.trainer.outer.global_params())

    def _dump(
        self, kind: str, round_: int, params: list[torch.Tensor], *, folder: Path | None = None, step: int | None = None
    ) -> None:
        names = [n for n, p in self.model.named_parameters()]
        tensors = {n: p.detach().to("cpu", torch.float32).contiguous() for n, p in zip(names, params)}
        path = (folder or Path(self.config.dump_dir)) / f"{kind}_round{round_:04d}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"step": str(self.trainer.local_step if step is None else step)})
        os.replace(tmp, path)

    def shutdown(self) -> None:
        if self.trainer is not None:
            self.events.emit(
                "stop", step=self.trainer.local_step, round=self.trainer.round, signal=self.stop.signal_name
            )
            self.trainer.shutdown(reason=self.stop.signal_name)
        if self.dht is not None:
            stop_dht(self.dht)
        self.events.close()


def _trainable(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def _fail(console: Console, message: str) -> int:
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return EXIT_BAD_INPUT


def choose_run(dht: DHT, device: torch.device, console: Console) -> tuple[str, str, str]:
    """Pick the best-fitting open run of the network; returns (run, task, task preset)."""
    runs = ResourceGraph(dht).runs()
    picked, reasons = pick_run(runs, probe_hardware(device), probe_software())
    for line in reasons:
        console.print(line, highlight=False, soft_wrap=True)
    if picked is None:
        raise ValueError("no open run fits this peer; pass --run NAME to join or start one")
    return picked.name, picked.task, picked.task_preset


def start_node(run: str | None, cfg: TrainerConfig, device: torch.device) -> Node | None:
    """This process's place in a torchrun node (`swarm.node`), or None when it runs alone."""
    if launched_size() <= 1:
        return None
    if run is None:
        raise ValueError("a multi-process node (torchrun) needs --run: its ranks must build the same task")
    # the longest pause of rank 0 between two steps: joining (the DHT, the state download) or a blocking round
    timeout_s = 120 + cfg.load_state_timeout_s + 2 * cfg.averaging.round_timeout_s + cfg.network.connect_timeout_s
    return Node.from_env(device, timeout_s=timeout_s)


def _enable_faulthandler() -> None:
    """A crash in native code (SIGSEGV, SIGABRT, ...) leaves every thread's Python stack on stderr, not a bare
    exit. Left as it is where it is on already (PYTHONFAULTHANDLER, pytest), or where stderr is no file (main
    called in a process whose stderr is captured in memory)."""
    if faulthandler.is_enabled():
        return
    with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
        faulthandler.enable(file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _enable_faulthandler()
    console = stderr_console()
    logging.basicConfig(level=args.log_level.upper(), handlers=[log_handler()])
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    runner: PeerRunner | None = None
    dht: DHT | None = None
    node: Node | None = None
    try:
        peers = parse_initial_peers(args.initial_peers)
        config = dataclass_from_args(PeerConfig, args)
        checked = dataclass_from_args(TrainerConfig, args, run=args.run or "unnamed", initial_peers=tuple(peers))
        get_task(config.task, preset=config.task_preset)  # unknown task: fail before touching any file
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        node = start_node(args.run, checked, resolve_device(config.device))
        if node is not None and not node.leads:  # another rank of a multi-process node: no identity, no DHT
            follower = PeerRunner(checked, config, stop=None, identity=None, node=node)
            follower.follow()
            return 0
        identity = Identity.load_or_create(config.identity_key)
        identity.lock()
        # under torchrun each rank gets the terminal's signal, then torchrun's: the second must not cut the leave short
        stop = StopSignal(second_interrupts=node is None).install()  # first signal: leave cleanly; second: now
        # started here, not by the Trainer, so that a signal while it starts stops the start (`cancel`)
        dht = start_swarm_dht(identity, initial_peers=peers, cancel=stop.event, **checked.network.dht_kwargs())
        run = args.run
        if run is None:
            run, task, preset = choose_run(dht, resolve_device(config.device), console)
            config = dataclasses.replace(config, task=task, task_preset=preset)
        trainer_config = dataclass_from_args(TrainerConfig, args, run=run, initial_peers=tuple(peers))
        runner = PeerRunner(trainer_config, config, stop=stop, identity=identity, dht=dht, node=node)
        runner.start()
        runner.run()
    except (ValueError, IdentityError, DHTStartError) as e:  # UnknownTaskError and RunMismatch are ValueErrors
        return _fail(console, str(e))
    except KeyboardInterrupt as e:  # Stopped: a signal ended the DHT's start or a state sync
        if runner is None or runner.trainer is None:
            logger.info("stopped while starting")
        else:
            logger.info("stopped during a state sync" if isinstance(e, Stopped) else "interrupted again: leaving now")
    finally:
        if runner is not None:
            runner.shutdown()
        elif dht is not None:
            stop_dht(dht)
        if node is not None:
            node.close()
    logger.info("left the run cleanly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
