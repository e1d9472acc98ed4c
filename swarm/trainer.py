"""The trainer API: wrap a model and its (inner) optimizer, and train it with the swarm.

DiLoCo-style training (Douillard et al., 2023): every peer takes ``sync_every`` local steps with its
own inner optimizer, then the peers of a group average their parameters and each applies an outer
Nesterov-SGD step to its copy of the global parameters, with the pseudo-gradient

    delta = global_params - weighted_mean(local_params of the group)

When all members hold the same global parameters this is exactly DiLoCo's averaged pseudo-gradient;
when they do not (after a missed round, say) averaging the local parameters also pulls the bases
together instead of letting them drift apart forever. With ``outer_lr=1, outer_momentum=0`` a round
is plain parameter averaging. The defaults (``swarm.recipe``): the outer settings follow the sync
interval (Nesterov lr 0.5 / momentum 0.5 below 40 steps, plain averaging from 40), and the inner
optimizer's learning rate warms up linearly over each peer's first ``inner_warmup_steps`` steps; a
validation loss that rises for ``divergence_rounds`` sealed rounds in a row is reported loudly.

    trainer = swarm.Trainer(model, torch.optim.AdamW(model.parameters()), run="my-run",
                            initial_peers=["/ip4/1.2.3.4/tcp/31337/p2p/Qm..."], sync_every=50)
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        trainer.step(num_samples=len(x))
    trainer.shutdown()
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import math
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from hivemind import DHT
from packaging.version import InvalidVersion, Version

from averaging import AveragingConfig, GroupAverager, RoundRecord
from bootstrap import peer_id_of_maddr, reconnect, start_reaper, stop_dht, visible_maddrs
from bootstrap.identity import Identity, PeerBinding
from bootstrap.network import start_swarm_dht
from peers import (
    MAX_LIFETIME_S,
    Advertiser,
    Network,
    PeerRecord,
    Performance,
    Requirements,
    ResourceGraph,
    RunInfo,
    Trust,
    probe_hardware,
    probe_software,
    reachability,
    unmet_requirements,
)
from peers.bandwidth import BandwidthProber
from swarm._private.divergence import DivergenceGuard, Rising
from swarm._private.evidence import Evidence, milli
from swarm.checkpoint.manifest import MANIFEST_REJECTIONS
from swarm.checkpoint.sync import CheckpointManager, SealRequest
from swarm.ledger import GENESIS, Ledger, LedgerError, default_ledger_path
from swarm.ledger.receipts import Receipt, sign_receipt
from swarm.recipe import (
    DEFAULT_SYNC_EVERY,
    INNER_WARMUP_STEPS,
    OuterSettings,
    outer_settings,
    step_with_lr_factor,
    warmup_factor,
)

logger = logging.getLogger(__name__)

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerConfig:
    """How a trainer joins a run and averages with its peers."""

    run: str
    """Name of the run to join (letters, digits, '_', '.', '-'; at most 64 characters)."""
    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of any live peers of the network (bootstrap node or any peer); empty starts a new network."""
    sync_every: int = DEFAULT_SYNC_EVERY
    """Local (inner) optimizer steps between averaging rounds. Smaller trains better at equal samples and
    sends more (README: choosing sync_every and the outer optimizer); raise it on a slow link, or for a
    large model whose rounds take long."""
    inner_warmup_steps: int = INNER_WARMUP_STEPS
    """Linear warm-up of the inner optimizer's learning rate over this peer's first local steps (0: off).
    A fresh inner optimizer (AdamW with no statistics yet) takes large steps, and replicas that start
    with large steps from scratch drift apart before their first average; see the README's "choosing
    sync_every and the outer optimizer". Applied on top of any schedule of the user's own."""
    outer_lr: float | None = None
    """Learning rate of the outer Nesterov-SGD step applied to the averaged pseudo-gradient (default: by
    sync_every, swarm.recipe.outer_settings: 0.5 below 40 steps, 1 (plain averaging) below 300, 0.7)."""
    outer_momentum: float | None = None
    """Momentum of the outer step, 0 disables momentum and Nesterov (default: by sync_every,
    swarm.recipe.outer_settings: 0.5 below 40 steps, 0 below 300, 0.9)."""
    target_group_size: int = 8
    """Largest averaging group."""
    min_group_size: int = 2
    """Smallest averaging group; with fewer peers a round is retried until averaging_timeout_s, or until two
    matchmaking windows in a row find no other peer looking."""
    matchmaking_time_s: float = 2.0
    """How long peers gather in the DHT before groups are drawn."""
    averaging_timeout_s: float = 30.0
    """Deadline of a whole round (matchmaking, all-reduce, retries); with no group by then a peer
    applies its own update alone."""
    sender_timeout_s: float = 10.0
    """A member whose part has not arrived this long after the group formed is dropped from the round."""
    reducer_timeout_s: float = 20.0
    """A member that has not returned its averaged slice by then fails the attempt (the group re-forms)."""
    codec: str = "int8"
    """Wire format of the averaged pseudo-gradients: fp32, fp16 or int8 (bitsandbytes blockwise 8-bit)."""
    aggregator: str = "centered_clip"
    """Robust rule for each slice: centered_clip, trimmed_mean or mean."""
    max_weight_ratio: float = 2.0
    """A member's weight (samples since its last round) counts at most this many times the median of its
    group's, so one peer claiming a huge sample count cannot outweigh the others (0: no cap)."""
    divergence_rounds: int = 3
    """Warn loudly (log, ledger, status board) when the validation loss sealed by the groups rose this many
    rounds in a row, by at least 1 percent in all (0: never). Needs ``evaluate=``."""
    load_state: bool = True
    """Download the run's current state from a peer at start-up (a fresh run starts from the model as given)."""
    load_state_timeout_s: float = 60.0
    """Deadline for the state download at start-up."""
    checkpoint_dir: str = "~/.swarm/checkpoints"
    """Where sealed checkpoints of the run are kept (content-addressed safetensors shards + manifests)."""
    checkpoint_every: int = 1
    """Seal a checkpoint every this many averaging rounds (0: never; the run's other peers may still)."""
    keep_checkpoints: int = 5
    """Sealed checkpoints kept on disk; older ones and their unreferenced shards are removed."""
    ledger_dir: str = "~/.swarm/ledgers"
    """Where this peer's hash-chained, signed event ledger is kept (DIR/RUN/PEER_ID.sqlite); empty: none."""
    metrics_port: int = 0
    """Serve Prometheus metrics on this port (0: off)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint listens on (0.0.0.0 to let a remote Prometheus scrape it)."""
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    """Multiaddrs this peer listens on."""
    announce_maddrs: tuple[str, ...] = ()
    """Multiaddrs announced to others (when behind NAT or port forwarding)."""
    connect_timeout_s: float = 30.0
    """Deadline to reach one of initial_peers."""
    advertise: bool = True
    """Publish this peer's signed capability record (hardware, throughput, run, trust) in the DHT."""
    record_refresh_s: float = 15.0
    """Heartbeat of the capability record."""
    record_expiry_s: float = 45.0
    """Lifetime of one capability record: a dead peer vanishes from the resource graph after this."""
    bandwidth_probe_period_s: float = 300.0
    """Measure bandwidth and RTT to up to 3 peers of the run this often (0: never; probes are served anyway)."""
    region: str | None = None
    """Free-form region label advertised with this peer (e.g. eu-west)."""
    available_until: str | None = None
    """Declared availability: an ISO-8601 time or unix seconds (default: until stopped)."""
    require_memory_gb: float = 0.0
    """Run requirement (when this peer starts the run): free accelerator memory, or RAM on CPU peers."""
    require_dtype: str = "fp32"
    """Run requirement: fp32, or bf16 (peers without bf16 support are refused)."""
    require_swarm_version: str = ""
    """Run requirement: oldest swarm version allowed to join (empty: any)."""
    require_torch_version: str = ""
    """Run requirement: oldest torch version allowed to join (empty: any)."""

    def __post_init__(self) -> None:
        if not isinstance(self.run, str) or not _RUN_NAME.match(self.run):
            raise ValueError(f"run must match {_RUN_NAME.pattern}, got {self.run!r}")
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ValueError(f"checkpoint_every must be >= 0 and keep_checkpoints >= 1, got "
                             f"{self.checkpoint_every!r}, {self.keep_checkpoints!r}")
        if self.inner_warmup_steps < 0:
            raise ValueError(f"inner_warmup_steps must be >= 0, got {self.inner_warmup_steps!r}")
        if self.divergence_rounds < 0:
            raise ValueError(f"divergence_rounds must be >= 0, got {self.divergence_rounds!r}")
        for name in ("sync_every",):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        outer = self.outer()
        if not 0 < outer.lr <= 10:
            raise ValueError(f"outer_lr must be in (0, 10], got {outer.lr!r}")
        if not 0 <= outer.momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer.momentum!r}")
        for name in ("load_state_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        self.averaging_config()  # validates the averaging fields
        if not 0 < self.record_refresh_s < self.record_expiry_s <= MAX_LIFETIME_S:
            raise ValueError(f"need 0 < record_refresh_s < record_expiry_s <= {MAX_LIFETIME_S}, got "
                             f"{self.record_refresh_s!r} and {self.record_expiry_s!r}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port!r}")
        if not self.bandwidth_probe_period_s >= 0:
            raise ValueError(f"bandwidth_probe_period_s must be >= 0, got {self.bandwidth_probe_period_s!r}")
        if self.require_dtype not in ("fp32", "bf16"):
            raise ValueError(f"require_dtype must be fp32 or bf16, got {self.require_dtype!r}")
        if not (0 <= self.require_memory_gb < 1e6):
            raise ValueError(f"require_memory_gb must be in [0, 1e6), got {self.require_memory_gb!r}")
        for name in ("require_swarm_version", "require_torch_version"):
            if getattr(self, name):
                try:
                    Version(getattr(self, name))
                except InvalidVersion:
                    raise ValueError(f"{name} must be a version like 2.1, got {getattr(self, name)!r}") from None
        if self.region is not None and not 0 < len(self.region) <= 64:
            raise ValueError(f"region must be 1-64 characters, got {self.region!r}")
        self.available_until_unix()  # validates

    def available_until_unix(self) -> int | None:
        if self.available_until is None:
            return None
        text = self.available_until.strip()
        try:
            return int(text) if text.isdigit() else int(datetime.fromisoformat(text).timestamp())
        except ValueError:
            raise ValueError(f"available_until must be an ISO-8601 time or unix seconds, got {text!r}") from None

    def outer(self) -> OuterSettings:
        """The outer step's settings: the fields given, else the rule's for ``sync_every``."""
        rule = outer_settings(self.sync_every) if self.sync_every >= 1 else OuterSettings(lr=0.5, momentum=0.5)
        return OuterSettings(lr=rule.lr if self.outer_lr is None else self.outer_lr,
                             momentum=rule.momentum if self.outer_momentum is None else self.outer_momentum)

    def averaging_config(self) -> AveragingConfig:
        return AveragingConfig(
            min_group_size=self.min_group_size, target_group_size=self.target_group_size,
            matchmaking_time_s=self.matchmaking_time_s, join_timeout_s=5.0, sender_timeout_s=self.sender_timeout_s,
            reducer_timeout_s=self.reducer_timeout_s, agreement_timeout_s=5.0,
            round_timeout_s=self.averaging_timeout_s, codec=self.codec, aggregator=self.aggregator, max_weight=1e9,
            max_weight_ratio=self.max_weight_ratio or None)

    def requirements(self) -> Requirements:
        return Requirements(min_memory_bytes=int(self.require_memory_gb * 2**30), dtype=self.require_dtype,
                            min_swarm_version=self.require_swarm_version,
                            min_torch_version=self.require_torch_version)


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskInfo:
    """What model a run trains; peers of one run must agree on ``config_digest``."""

    name: str = "custom"
    """Task name (a registry task, or "custom" for a user's own model)."""
    preset: str = ""
    """Size preset of a registry task."""
    config_digest: str = ""
    """SHA-256 hex of the model's configuration; empty: derived from parameter names and shapes."""

    @classmethod
    def of(cls, task: Any, preset: str) -> TaskInfo:
        """The TaskInfo of a registry task (swarm.tasks), as swarm.peer advertises it."""
        digest = hashlib.sha256(json.dumps(task.config_dict(), sort_keys=True).encode()).hexdigest()
        return cls(name=task.name, preset=preset, config_digest=digest)


class RunMismatch(ValueError):
    """This peer may not join the run: unmet requirements or a different model."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundResult:
    """What one averaging round did, as seen by this peer."""

    round: int
    """Round number after this round (the run's round counter)."""
    group_size: int
    """Peers whose contributions were averaged (1: no group was found, own update applied alone)."""
    weight: float
    """This peer's weight (samples since the last round)."""
    duration_s: float
    """Wall time of matchmaking plus all-reduce."""
    rejected: tuple[str, ...] = ()
    """Group members whose gathered metadata failed validation."""
    record: RoundRecord | None = None
    """The averaging round's record: members, bytes, phase times, failures, outcome."""


@dataclass(slots=True)
class TrainerCounters:
    rounds_ok: int = 0
    rounds_solo: int = 0
    state_loaded: int = 0
    state_verified: int = 0
    rejected: Counter = field(default_factory=Counter)


class Trainer:
    """Train ``model`` with ``inner_optimizer`` locally and average with the run's peers every ``sync_every`` steps.

    ``config`` holds every setting; keyword ``overrides`` replace single fields of it, so
    ``Trainer(model, opt, run="r", initial_peers=[...], sync_every=20)`` works without a config.
    Pass ``dht`` to share one DHT between components (the caller then owns its shutdown).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        config: TrainerConfig | None = None,
        dht: DHT | None = None,
        identity: Identity | None = None,
        task_info: TaskInfo | None = None,
        evaluate: Callable[[], float] | None = None,
        **overrides: Any,
    ):
        if "initial_peers" in overrides:
            overrides["initial_peers"] = tuple(overrides["initial_peers"])
        if "host_maddrs" in overrides:
            overrides["host_maddrs"] = tuple(overrides["host_maddrs"])
        if config is None:
            config = TrainerConfig(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        self.model, self.inner_optimizer = model, inner_optimizer
        self.identity = identity if identity is not None else Identity.generate()
        self.counters = TrainerCounters()
        self.local_step = 0
        self.round = 0
        self.last_round: RoundResult | None = None
        self.samples_per_s = 0.0
        self.state = "joining"
        self._started_at = time.time()
        self._samples_since_sync = 0
        self._last_sync_end = time.perf_counter()
        self.before_sync: list[Callable[[int, list[torch.Tensor]], None]] = []
        """Callbacks run with (round, local parameters) right before each averaging round."""
        self._state_lock = threading.Lock()
        self._names, self._params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
        self._global = [p.detach().to("cpu", torch.float32, copy=True) for p in self._params]
        self.outer = config.outer()
        """The outer step's learning rate and momentum (config.outer_lr/outer_momentum, else the rule's)."""
        self._outer_optimizer = self._make_outer_optimizer(self._global)
        self.task_info = _with_digest(task_info or TaskInfo(), self._names, self._global)
        self.advertiser: Advertiser | None = None
        self.group_averager: GroupAverager | None = None
        self.checkpoints: CheckpointManager | None = None
        self.evaluate = evaluate
        """Optional validation-loss function of the current model; its value (in thousandths) is signed
        into each sealed manifest's metrics."""
        self.last_val_loss: float | None = None
        self.last_loss: float | None = None
        """The last training loss passed to :meth:`step` (shown on the status board and in metrics)."""
        self.evidence = Evidence()
        """This trainer's ledger, status board entry and metrics (see ``swarm._private.evidence``)."""
        self._last_group: dict | None = None
        self._lost: dict[str, int] = {}
        self._val_for_status: float | None = None
        self._solo_streak = 0
        self._divergence = DivergenceGuard(rounds=config.divergence_rounds)
        self._met: dict[str, None] = {}  # peers of recent groups, oldest first (bounded)
        self._reconnecting: concurrent.futures.Future | None = None
        self._run_peers: tuple[float, set[str]] = (0.0, set())
        self.prober: BandwidthProber | None = None
        self._closing = threading.Event()
        self._probe_thread: threading.Thread | None = None

        self.identity.lock()
        start_reaper()
        self._owns_dht = dht is None
        self.dht = dht if dht is not None else start_swarm_dht(
            self.identity, initial_peers=config.initial_peers, host_maddrs=config.host_maddrs,
            announce_maddrs=config.announce_maddrs, connect_timeout_s=config.connect_timeout_s,
        )
        self.peer_id = str(self.dht.peer_id)
        self.binding = self.identity.bind(self.peer_id)
        try:
            self.evidence = Evidence(ledger=self._open_ledger(), metrics=self._start_metrics())
            self.graph = ResourceGraph(self.dht)
            self.device = self._params[0].device
            self.requirements = self._check_run(self.graph)
            self.group_averager = GroupAverager(self.dht, prefix=f"swarm_{config.run}",
                                                config=config.averaging_config(),
                                                bandwidth_mbps=self._bandwidth_mbps, region=config.region)
            self._start_advertising()
            self.checkpoints = self._make_checkpoints()
            if config.load_state:
                self.load_state(timeout_s=config.load_state_timeout_s)
            self._set_state("training")
            newest = self.checkpoints.newest_digest() if self.checkpoints is not None else None
            self.evidence.record("joined", {
                "round": self.round, "step": self.local_step, "state_loaded": self.counters.state_loaded > 0,
                "state_verified": self.counters.state_verified > 0, "join_s": time.time() - self._started_at,
                "manifest": newest[1] if newest and self.counters.state_verified else None})
        except BaseException:
            self.shutdown()
            raise

    # ----------------------------------------------------------------------------------------- setup
    def _check_run(self, graph: ResourceGraph) -> Requirements:
        """The run's requirements (as advertised by its live peers, else this peer's config); raise
        RunMismatch if this peer does not meet them or builds a different model."""
        run = self.config.run
        try:
            summary = next((r for r in graph.runs() if r.name == run), None)
        except Exception as e:  # a DHT hiccup must not stop a peer from starting or joining
            logger.warning(f"could not read run {run!r} from the DHT: {e!r}")
            summary = None
        requirements = summary.requirements if summary is not None else self.config.requirements()
        if summary is not None and summary.config_digest != self.task_info.config_digest:
            raise RunMismatch(
                f"cannot join run {run!r}: it trains {summary.task}/{summary.task_preset} "
                f"(model digest {summary.config_digest[:12]}), this peer built "
                f"{self.task_info.name}/{self.task_info.preset} (digest {self.task_info.config_digest[:12]})")
        problems = unmet_requirements(requirements, probe_hardware(self.device), probe_software())
        if problems:
            raise RunMismatch(f"cannot join run {run!r}: " + "; ".join(problems))
        return requirements

    def _open_ledger(self) -> Ledger | None:
        if not self.config.ledger_dir:
            return None
        if self.identity.peer_id != self.peer_id:
            logger.warning("no ledger: the DHT's peer ID is not this trainer's identity (pass no dht=)")
            return None
        path = default_ledger_path(self.config.ledger_dir, run=self.config.run, peer_id=self.peer_id)
        try:
            return Ledger(path, identity=self.identity, run=self.config.run)
        except LedgerError as e:
            raise ValueError(f"cannot open the ledger {path}: {e}; move the file away or pass another "
                             f"--ledger-dir") from None

    def _start_metrics(self) -> Any | None:
        if not self.config.metrics_port:
            return None
        from swarm.metrics import PeerMetrics  # prometheus-client is imported only when metrics are on

        metrics = PeerMetrics(peer_id=self.peer_id, run=self.config.run, task=self.task_info.name)
        try:
            metrics.serve(port=self.config.metrics_port, host=self.config.metrics_host)
        except BaseException:
            metrics.close()
            raise
        logger.info(f"Prometheus metrics on http://{self.config.metrics_host}:{self.config.metrics_port}/metrics")
        return metrics

    def _status_snapshot(self) -> dict:
        return {"state": self.state, "round": self.round, "step": self.local_step,
                "samples_per_s_milli": milli(self.samples_per_s) or 0, "loss_milli": milli(self.last_loss),
                "val_loss_milli": milli(self._val_for_status), "last_group": self._last_group}

    def _start_advertising(self) -> None:
        cfg = self.config
        if not cfg.advertise:
            return
        if self.identity.peer_id != self.peer_id:
            logger.warning("not advertising: the DHT's peer ID is not this trainer's identity (pass no dht=)")
            return
        self._maddrs = tuple(visible_maddrs(self.dht))[:16]
        self.prober = BandwidthProber(dht=self.dht)
        if cfg.bandwidth_probe_period_s > 0:
            self._probe_thread = threading.Thread(target=self._probe_loop, name="swarm-probe-loop", daemon=True)
            self._probe_thread.start()
        self.advertiser = Advertiser(self.dht, self.identity, self._build_record, refresh_s=cfg.record_refresh_s,
                                     expiry_s=cfg.record_expiry_s).start()
        from swarm.status import StatusPublisher

        self.evidence.status = StatusPublisher(self.dht, self.identity, run=cfg.run, snapshot=self._status_snapshot,
                                               refresh_s=cfg.record_refresh_s, expiry_s=cfg.record_expiry_s).start()

    def _probe_loop(self) -> None:
        """Measure bandwidth to a few peers of the run soon after joining, then every probe period."""
        delay_s = 1.0
        while not self._closing.wait(timeout=delay_s):
            try:
                others = [r.peer_id for r in self.graph.records(run=self.config.run) if r.peer_id != self.peer_id]
                results = self.prober.probe(others, max_peers=3) if others else []
            except Exception as e:  # a failed probe only leaves the figures unmeasured
                logger.info(f"bandwidth probe failed: {e!r}")
                results = []
            delay_s = self.config.bandwidth_probe_period_s if results else self.config.record_refresh_s
            if results and self.advertiser is not None:
                self.advertiser.refresh_now()

    def _set_state(self, state: str) -> None:
        self.state = state
        if self.advertiser is not None:
            self.advertiser.refresh_now()

    def _build_record(self, *, issued_at: int, expires_at: int, seq: int) -> PeerRecord:
        cfg, info = self.config, self.task_info
        return PeerRecord(
            v=1, peer_id=self.peer_id, public_key=self.identity.public_key.hex(), issued_at=issued_at,
            expires_at=expires_at, seq=seq, state=self.state,
            run=RunInfo(name=cfg.run, task=info.name, task_preset=info.preset, config_digest=info.config_digest,
                        requirements=self.requirements, round=self.round, step=self.local_step),
            hardware=probe_hardware(self.device), software=probe_software(),
            perf=self._performance(),
            network=Network(reachability=reachability(self._maddrs), maddrs=self._maddrs, region=cfg.region),
            available_until=cfg.available_until_unix(),
            trust=Trust(uptime_s=int(time.time() - self._started_at), rounds_completed=self.counters.rounds_ok,
                        checkpoints_cosigned=self.checkpoints.sealed if self.checkpoints is not None else 0),
        )

    def _make_outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.SGD:
        outer = self.outer
        return torch.optim.SGD(params, lr=outer.lr, momentum=outer.momentum, nesterov=outer.momentum > 0)

    def _performance(self) -> Performance:
        measured = self.prober.summary() if self.prober is not None else {}

        def scaled(key: str, factor: float) -> int | None:
            value = measured.get(key)
            return None if value is None else int(value * factor)
        return Performance(samples_per_s_milli=int(self.samples_per_s * 1000),
                           upload_kbps=scaled("upload_mbps", 1000), download_kbps=scaled("download_mbps", 1000),
                           rtt_us=scaled("rtt_ms", 1000))

    def _make_checkpoints(self) -> CheckpointManager | None:
        if self.identity.peer_id != self.peer_id:
            logger.warning("no sealed checkpoints: the DHT's peer ID is not this trainer's identity (pass no dht=)")
            return None
        directory = Path(self.config.checkpoint_dir).expanduser() / self.config.run / self.peer_id
        return CheckpointManager(self.dht, identity=self.identity, run_id=self.config.run, task=self.task_info.name,
                                 config_digest=self.task_info.config_digest, directory=directory,
                                 keep_last=self.config.keep_checkpoints, run_peers=self.run_peers,
                                 on_event=self._on_checkpoint_event)

    def _on_checkpoint_event(self, kind: str, body: dict) -> None:
        if kind == "receipts":  # the group's verified receipts of a round: one ledger entry each
            for receipt in body["receipts"]:
                self.evidence.record("receipt", receipt)
        else:
            self.evidence.record(kind, body)

    def run_peers(self) -> set[str]:
        """Peer IDs with live records in this run (cached for one record refresh period)."""
        fetched_at, peers = self._run_peers
        if time.monotonic() - fetched_at > self.config.record_refresh_s:
            try:
                peers = {r.peer_id for r in self.graph.records(run=self.config.run)}
            except Exception as e:  # keep the last known set on a DHT hiccup
                logger.debug(f"could not read the run's peers: {e!r}")
            self._run_peers = (time.monotonic(), peers)
        return peers

    def _bandwidth_mbps(self) -> float | None:
        measured = self.prober.summary() if self.prober is not None else {}
        up, down = measured.get("upload_mbps"), measured.get("download_mbps")
        return None if up is None or down is None else min(up, down)

    # ----------------------------------------------------------------------------------------- training
    def step(self, *, num_samples: int = 1, loss: float | None = None) -> RoundResult | None:
        """One inner optimizer step (and zero_grad); every ``sync_every`` steps also an averaging round.

        Over this trainer's first ``inner_warmup_steps`` steps the optimizer's learning rates are scaled
        by ``step / inner_warmup_steps`` for the step (and restored, so a scheduler of the user's keeps
        its own values).

        ``loss`` (optional, a float) is only reported: status board and metrics.
        Returns the round's result when a round ran, else None.
        """
        self._inner_step()
        self.inner_optimizer.zero_grad(set_to_none=True)
        self.local_step += 1
        self._samples_since_sync += num_samples
        if loss is not None:
            self.last_loss = float(loss)
        if self.evidence.metrics is not None:
            elapsed = max(time.perf_counter() - self._last_sync_end, 1e-9)
            self.evidence.metrics.observe_step(step=self.local_step, samples=num_samples, loss=self.last_loss,
                                               samples_per_s=self._samples_since_sync / elapsed)
        if self.local_step % self.config.sync_every == 0:
            return self.sync()
        return None

    def inner_lr_factor(self) -> float:
        """The factor on the inner optimizer's learning rate for the next local step (the warm-up)."""
        return warmup_factor(self.local_step + 1, self.config.inner_warmup_steps)

    def _inner_step(self) -> None:
        """The inner optimizer's step, its learning rates scaled by the warm-up factor for this step only."""
        step_with_lr_factor(self.inner_optimizer, self.inner_lr_factor())

    def sync(self) -> RoundResult:
        """Average pseudo-gradients with a group now and apply the outer step.

        Never blocks past ``averaging_timeout_s`` (plus a second all-reduce of the bases when group
        members disagree on them, which pulls diverged bases together).
        """
        cfg = self.config
        started = time.perf_counter()
        self.samples_per_s = self._samples_since_sync / max(started - self._last_sync_end, 1e-9)
        weight = float(max(self._samples_since_sync, 1))
        local = [p.detach().to("cpu", torch.float32) for p in self._params]
        for hook in self.before_sync:
            hook(self.round, local)
        with self._state_lock:
            base = torch.cat([b.reshape(-1) for b in self._global])
            momentum = torch.cat([self._momentum_buffer(b).reshape(-1) for b in self._global])
        delta = base - torch.cat([t.reshape(-1) for t in local])
        state_digest = hashlib.sha256(base.numpy().tobytes() + momentum.numpy().tobytes()).hexdigest()[:32]
        newest = self.checkpoints.newest_digest() if self.checkpoints is not None else None
        gather = {"round": self.round, "samples": int(self._samples_since_sync), "binding": self.binding.to_dict(),
                  "base": state_digest, "t": int(time.time()),
                  "sealed": list(newest) if newest else None,
                  "fresh": self.counters.rounds_ok + self.counters.rounds_solo == 0}
        try:
            averaged, record, group = self.group_averager.step(delta, weight=weight, gather=gather,
                                                               timeout_s=cfg.averaging_timeout_s)
        except Exception as e:  # a failed round must not kill training; the update is applied alone
            logger.warning(f"averaging round failed: {e!r}; applying this peer's update alone")
            averaged, record, group = None, None, None
        rejected: tuple[str, ...] = ()
        new_base = None
        if averaged is not None and group is not None:
            rejected = self._check_gathered(group.gathered)
            new_base = self._agree_on_base(group, record, torch.cat([base, momentum]))
            rounds = [g.get("round") for g in group.gathered.values() if isinstance(g, dict)]
            next_round = 1 + max([self.round] + [r for r in rounds if isinstance(r, int) and 0 <= r < 2**62])
            self.counters.rounds_ok += 1
            self._solo_streak = 0
            self._remember(group.members)
        else:
            averaged, next_round = delta, self.round + 1
            self.counters.rounds_solo += 1
            self._solo_streak += 1
            self._reconnect()
        self._apply_outer_step(averaged, next_round=next_round, new_base=new_base)
        grouped = group is not None and averaged is not delta
        samples = int(self._samples_since_sync)
        self._samples_since_sync = 0
        self.last_round = RoundResult(
            round=self.round, group_size=len(group.members) if grouped else 1,
            weight=weight, duration_s=time.perf_counter() - started, rejected=rejected, record=record,
        )
        val_loss = self._evaluate_for_seal() if grouped else None
        rising = self._divergence.observe(val_loss, round_=self.round)
        if rising is not None:
            self._report_rising(rising)
        self._record_round(self.last_round, group if grouped else None, samples=samples, val_loss=val_loss)
        if grouped:
            self._finish_group_round(group, record, samples=samples, val_loss=val_loss)
        self._record_rejections()
        if self.evidence.metrics is not None:
            self.evidence.metrics.set_peers_known(len(self.run_peers()))
        self._resync_if_lagging()
        self._last_sync_end = time.perf_counter()
        return self.last_round

    def _report_rising(self, rising: Rising) -> None:
        """Never silently: a validation loss that keeps rising is logged, kept in the ledger and shown on
        the status board (its timeline) and in the report."""
        cfg = self.config
        logger.warning(
            f"round {rising.round}: the validation loss sealed by the groups rose {rising.rounds} rounds in a row, "
            f"{rising.start:.4f} -> {rising.now:.4f} (+{100 * rising.rise:.1f}%): training is diverging. "
            f"Outer settings: sync_every={cfg.sync_every}, outer_lr={self.outer.lr}, "
            f"outer_momentum={self.outer.momentum}; a lower outer_lr or outer_momentum (README: choosing "
            f"sync_every and the outer optimizer) or a lower inner learning rate usually cures it")
        self.evidence.record("diverging", rising.to_dict())

    def _remember(self, members: Any) -> None:
        for member in members:
            self._met.pop(member, None)
            self._met[member] = None
        while len(self._met) > 64:
            self._met.pop(next(iter(self._met)))

    def _reconnect(self) -> None:
        """Alone this round: ping the peers of recent groups, the run's known peers and the initial peers,
        in the background. A partition (or any run of failed DHT calls) empties the DHT's routing table,
        and nothing would bring this peer back to the others until one of them happened to call it."""
        if self._reconnecting is not None and not self._reconnecting.done():
            return
        initial = (peer_id_of_maddr(m) for m in self.config.initial_peers)
        peers = [*reversed(self._met), *sorted(self.run_peers()), *(p for p in initial if p)]
        try:
            self._reconnecting = reconnect(self.dht, peers)
        except Exception as e:  # the DHT process is gone or closing: nothing to reconnect
            logger.debug(f"could not ping known peers: {e!r}")
            return
        self._reconnecting.add_done_callback(_log_reconnected)

    def _evaluate_for_seal(self) -> float | None:
        """Validation loss of the new global parameters (all members evaluate the same ones)."""
        if self.evaluate is None:
            return None
        self.last_val_loss = float(self.evaluate())
        self._val_for_status = self.last_val_loss
        return self.last_val_loss

    def _record_round(self, result: RoundResult, group: Any | None, *, samples: int, val_loss: float | None) -> None:
        record = result.record
        body = {"round": result.round, "step": self.local_step, "group_size": result.group_size,
                "duration_s": result.duration_s, "samples": samples, "samples_per_s": self.samples_per_s,
                "val_loss": val_loss if val_loss is None or math.isfinite(val_loss) else None,
                "solo": group is None, "rejected_metadata": list(result.rejected)}
        if record is not None:
            body.update({k: record.to_dict()[k] for k in ("group_id", "members", "included", "outcome",
                                                           "bytes_sent", "bytes_received", "failures", "rejected")})
        self.evidence.record("round", body)
        for failure in record.failures if record is not None else []:
            self.evidence.record("failure", {"round": result.round, **failure})
        if record is not None and group is not None:
            self._last_group = {"group_id": record.group_id, "members": sorted(group.members),
                                "outcome": record.outcome, "duration_ms": int(result.duration_s * 1000),
                                "bytes_sent": int(record.bytes_sent), "bytes_received": int(record.bytes_received)}
            self._note_replacement(group, record, round_=result.round)
        if self.evidence.status is not None:
            self.evidence.status.publish_soon()  # the training thread never waits on the DHT for it

    def _note_replacement(self, group: Any, record: RoundRecord, *, round_: int) -> None:
        """Peers that failed in our rounds are "lost" until seen in a group again; when a peer that has
        just joined (and resumed from a sealed checkpoint) shows up while some are lost, record who
        replaced whom."""
        members = set(group.members)
        self._lost.update({f["peer"]: round_ for f in record.failures
                           if isinstance(f.get("peer"), str) and f["peer"] not in members})
        for peer in members:
            self._lost.pop(peer, None)
        joined = sorted(p for p, g in group.gathered.items()
                        if p != self.peer_id and isinstance(g, dict) and g.get("fresh") is True)
        if joined and self._lost:
            self.evidence.record("peer_replaced", {"round": round_, "left": sorted(self._lost), "joined": joined})
            self._lost.clear()

    def _record_rejections(self) -> None:
        """Rejected untrusted input seen since the last round, by source and reason, into the ledger."""
        sources = {"metadata": self.counters.rejected, "record": self.graph.rejections.counts,
                   "manifest": MANIFEST_REJECTIONS}
        if self.checkpoints is not None:
            sources["receipt"] = self.checkpoints.receipt_rejections
            sources["gossip"] = self.checkpoints.gossip.rejected
        for what, counts in sources.items():
            self.evidence.rejections(what, counts, round_=self.round)

    def _resync_if_lagging(self, max_solo_rounds: int = 3) -> None:
        """A peer cut off from the others for a few rounds takes the run's newest sealed state again, but
        only state sealed at a later round than its own: a peer left alone (the others died or left)
        keeps training forward instead of rolling back to the last checkpoint it sealed with them."""
        if self.checkpoints is None or self._solo_streak < max_solo_rounds:
            return
        streak, before = self._solo_streak, self.round
        self._solo_streak = 0  # looked again after another max_solo_rounds solo rounds
        if self.load_state(timeout_s=self.config.load_state_timeout_s, reason="resync", newer_than=before):
            logger.info(f"was cut off for {streak} rounds: re-synced from round {before} to the run's newer "
                        f"sealed round {self.round}")

    def _finish_group_round(self, group: Any, record: RoundRecord | None, *, samples: int,
                            val_loss: float | None) -> None:
        """Sign this peer's participation receipt; the group swaps receipts and, on sealing rounds, every
        member signs the same manifest of the state they now all hold, listing those receipts."""
        if self.checkpoints is None:
            return
        receipt = self._safe_receipt(group, record, samples=samples)
        every = self.config.checkpoint_every
        seal = self._seal_request(group, val_loss) if every and self.round % every == 0 else None
        self.checkpoints.finish_round_async(receipt=receipt, seal=seal)

    def _sign_receipt(self, group: Any, record: RoundRecord | None, *, samples: int) -> Any:
        if record is None or not record.group_id:
            return None
        seq, head = self.evidence.ledger.head() if self.evidence.ledger is not None else (0, GENESIS)
        receipt = Receipt(v=1, run=self.config.run, round=self.round, group_id=record.group_id,
                          members=tuple(sorted(group.members)), peer=self.peer_id, samples=samples,
                          bytes_sent=int(record.bytes_sent), bytes_received=int(record.bytes_received),
                          ledger_seq=seq, ledger_head=head, t=int(time.time()))
        return sign_receipt(receipt, self.identity)

    def _safe_receipt(self, group: Any, record: RoundRecord | None, *, samples: int) -> Any:
        try:
            return self._sign_receipt(group, record, samples=samples)
        except ValueError as e:  # e.g. a group larger than a receipt may name: evidence is skipped, not training
            logger.warning(f"round {self.round}: no participation receipt: {e}")
            return None

    def _seal_request(self, group: Any, val_loss: float | None) -> SealRequest:
        """What every member seals: only values all of them computed identically."""
        gathered = [g for g in group.gathered.values() if isinstance(g, dict)]
        # untrusted: values a manifest would refuse are dropped here, or one member could stop the group's seal
        times = [g["t"] for g in gathered if isinstance(g.get("t"), int) and 0 < g["t"] < 2**63]
        parents = [tuple(g["sealed"]) for g in gathered if isinstance(g.get("sealed"), list)
                   and len(g["sealed"]) == 2 and isinstance(g["sealed"][0], int)
                   and isinstance(g["sealed"][1], str) and _SHA256_HEX.fullmatch(g["sealed"][1])]
        parent = max(parents, key=lambda sealed: (sealed[0], sealed[1]))[1] if parents else ""
        samples = sum(g["samples"] for g in gathered if isinstance(g.get("samples"), int) and 0 <= g["samples"] < 2**40)
        metrics = {"round_samples": samples, "group_size": len(group.members)}
        # members evaluate the same parameters on the same batches; rounding to thousandths makes the
        # signed value agree across hardware (a rare disagreement only skips one seal)
        if val_loss is not None and math.isfinite(val_loss):
            metrics["val_loss_milli"] = round(val_loss * 1000)
        contributions = {peer: g["samples"] for peer, g in group.gathered.items() if peer in group.members
                         and isinstance(g, dict) and isinstance(g.get("samples"), int) and 0 <= g["samples"] < 2**40}
        return SealRequest(state=self._state_dict(), step=self.round, participants=tuple(group.members),
                           created_at=min(times, default=0), parent=parent, metrics=metrics,
                           contributions=contributions)

    def _state_dict(self) -> dict[str, torch.Tensor]:
        with self._state_lock:
            state = {f"param/{name}": p.detach().clone() for name, p in zip(self._names, self._global)}
            state.update({f"momentum/{name}": self._momentum_buffer(p).clone()
                          for name, p in zip(self._names, self._global)})
        return state

    def load_state(self, *, timeout_s: float, reason: str = "join", newer_than: int | None = None) -> bool:
        """Resume from the run's newest sealed checkpoint, verified end to end; True if one was loaded.

        With ``newer_than`` only a checkpoint sealed at a later round than that is taken (never an
        older state than this peer's own). Nothing unverified is ever loaded: before the run has
        sealed a checkpoint (its first round) every peer starts from the same seeded model, which is
        the run's genesis state."""
        started = time.monotonic()
        if self.checkpoints is not None:
            try:
                loaded = self.checkpoints.load_newest(timeout_s=timeout_s, newer_than=newer_than)
            except Exception as e:  # a bad or unreachable checkpoint: say why, then try the fallback
                logger.warning(f"could not load the newest sealed checkpoint: {e!r}")
                self.counters.rejected["sealed checkpoint"] += 1
                loaded = None
            if loaded is not None:
                manifest, state = loaded
                problem = self._state_dict_problem(state)
                if newer_than is not None and manifest.round <= newer_than:
                    problem = f"sealed at round {manifest.round}, not after this peer's round {newer_than}"
                if problem is None:
                    tensors = [state[f"param/{n}"] for n in self._names] + [state[f"momentum/{n}"] for n in self._names]
                    self._install_state(manifest.round, tensors)
                    self.counters.state_verified += 1
                    logger.info(f"resumed from sealed checkpoint {manifest.digest()[:12]} at step {manifest.step}")
                    self.evidence.record("state_synced", {
                        "round": self.round, "step": manifest.step, "manifest": manifest.digest(),
                        "seconds": time.monotonic() - started, "reason": reason,
                        "participants": len(manifest.participants)})
                    return True
                self.counters.rejected[f"sealed checkpoint: {problem}"] += 1
                logger.warning(f"rejected the sealed checkpoint: {problem}")
        if newer_than is None:
            logger.info("no sealed checkpoint of this run yet: starting from the model as given (the run's genesis)")
        else:
            logger.info(f"no sealed checkpoint of this run after round {newer_than}: training on from this peer's own")
        return False

    def _state_dict_problem(self, state: dict[str, torch.Tensor]) -> str | None:
        expected = {f"{kind}/{n}": p for n, p in zip(self._names, self._global) for kind in ("param", "momentum")}
        if set(state) != set(expected):
            return "tensor names differ from this model's"
        for name, want in expected.items():
            got = state[name]
            if got.shape != want.shape or got.dtype != want.dtype or not torch.isfinite(got).all():
                return f"{name}: shape/dtype/values do not fit"
        return None

    def _agree_on_base(self, group: Any, record: RoundRecord | None, base: torch.Tensor) -> torch.Tensor | None:
        """When members hold different global state (parameters and outer momentum, concatenated in
        ``base``: after a missed round, a join, or groups that went separate ways), average it too, in
        fp32, so every member holds the same state again (and all sign the same checkpoint).

        Only among the members whose updates the round included (the same set at every reducer): one
        that was dropped (late, refused, dead) is not there to take part, and waiting for it would cost
        every later round a timeout while its state drifts."""
        if record is not None and record.included:
            kept = set(record.included)
            if self.peer_id not in kept:
                return None
            members = tuple(m for m in group.members if m in kept)
            group = dataclasses.replace(group, members=members, gathered={m: group.gathered.get(m) for m in members})
        # str(): the digests are untrusted metadata and may be unhashable (a list, a dict)
        digests = {str(g.get("base")) for g in group.gathered.values() if isinstance(g, dict)}
        if len(digests) <= 1 or len(group.members) < 2:
            return None
        averaged, record = self.group_averager.average_in_group(group, base, weight=1.0, codec="fp32",
                                                                timeout_s=self.config.averaging_timeout_s)
        if averaged is None:
            logger.info(f"round {self.round}: could not average the diverged bases: {record.failures[:3]}")
        return averaged

    def _check_gathered(self, gathered: dict) -> tuple[str, ...]:
        """Validate what each group member sent alongside its tensors; log and count what fails."""
        rejected = []
        for peer_id, data in gathered.items():
            reason = _gathered_problem(str(peer_id), data)
            if reason is not None:
                rejected.append(str(peer_id))
                self.counters.rejected[reason] += 1
                logger.warning(f"round {self.round}: rejected metadata from {peer_id}: {reason}")
        return tuple(rejected)

    def _apply_outer_step(self, delta: torch.Tensor, *, next_round: int, new_base: torch.Tensor | None = None) -> None:
        """base <- outer_optimizer(base, grad=delta): the averaged pseudo-gradient (flat, fp32).

        ``new_base`` (parameters then momentum, flat) first replaces the state the group averaged."""
        with self._state_lock:
            offset, total = 0, delta.numel()
            for param in self._global:
                numel = param.numel()
                if new_base is not None:
                    param.copy_(new_base[offset:offset + numel].view_as(param))
                    momentum = new_base[total + offset:total + offset + numel]
                    if self.outer.momentum > 0:
                        self._outer_optimizer.state[param]["momentum_buffer"] = momentum.view_as(param).clone()
                param.grad = delta[offset:offset + numel].view_as(param).clone()
                offset += numel
            self._outer_optimizer.step()
            self._outer_optimizer.zero_grad(set_to_none=True)
            self._copy_global_to_model()
            self.round = next_round

    def _copy_global_to_model(self) -> None:
        with torch.no_grad():
            for param, base in zip(self._params, self._global):
                param.copy_(base)

    # ----------------------------------------------------------------------------------------- state
    def _momentum_buffer(self, param: torch.Tensor) -> torch.Tensor:
        buf = self._outer_optimizer.state.get(param, {}).get("momentum_buffer")
        return buf if buf is not None else torch.zeros_like(param)

    def _install_state(self, round_: int, tensors: Sequence[torch.Tensor]) -> None:
        count = len(self._global)
        with self._state_lock:
            for base, new in zip(self._global, tensors[:count]):
                base.copy_(new)
            if self.outer.momentum > 0:
                for base, buf in zip(self._global, tensors[count:]):
                    self._outer_optimizer.state[base]["momentum_buffer"] = buf.clone()
            self._copy_global_to_model()
            self.round = round_
        self.counters.state_loaded += 1
        logger.info(f"loaded the run's state at round {self.round}")

    # ----------------------------------------------------------------------------------------- lifetime
    def interrupt(self) -> None:
        """Abandon the averaging round in progress at once (the update is applied alone); for Ctrl+C."""
        if self.group_averager is not None:
            self.group_averager.interrupt()

    def shutdown(self, *, reason: str | None = None) -> None:
        """Leave the run: withdraw the record, stop the averager, then the DHT if this trainer started it.

        The ledger's last entry is "stop" with ``reason`` (e.g. the signal's name). Idempotent."""
        closing = getattr(self, "_closing", None)
        if closing is not None:
            closing.set()
        probe_thread = getattr(self, "_probe_thread", None)
        if probe_thread is not None:
            probe_thread.join(timeout=15)
        advertiser = getattr(self, "advertiser", None)
        if advertiser is not None:
            advertiser.close()
        prober = getattr(self, "prober", None)
        if prober is not None:
            prober.close()
        checkpoints = getattr(self, "checkpoints", None)
        if checkpoints is not None:
            checkpoints.close()
        group_averager = getattr(self, "group_averager", None)
        if group_averager is not None:
            group_averager.close()
        evidence = getattr(self, "evidence", None)
        if evidence is not None and evidence.ledger is not None:
            evidence.record("stop", {"step": self.local_step, "round": self.round, "signal": reason})
        if evidence is not None:
            evidence.close()
        if getattr(self, "_owns_dht", False) and getattr(self, "dht", None) is not None:
            stop_dht(self.dht)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _gathered_problem(peer_id: str, data: Any) -> str | None:
    """Why a group member's gathered metadata is unacceptable, or None."""
    if not isinstance(data, dict):
        return "metadata is not a dict"
    if not isinstance(data.get("round"), int) or data["round"] < 0:
        return "bad round"
    if not isinstance(data.get("samples"), int) or data["samples"] < 0:
        return "bad sample count"
    try:
        binding = PeerBinding.from_dict(data.get("binding"))
    except ValueError:
        return "malformed identity binding"
    if binding.peer_id != peer_id:
        return "identity binding names another peer"
    if not binding.is_valid():
        return "identity binding signature does not verify"
    return None


def _with_digest(info: TaskInfo, names: Sequence[str], params: Sequence[torch.Tensor]) -> TaskInfo:
    if info.config_digest:
        return info
    shapes = ";".join(f"{name}:{tuple(p.shape)}" for name, p in zip(names, params))
    return dataclasses.replace(info, config_digest=hashlib.sha256(shapes.encode()).hexdigest())


def _log_reconnected(future: concurrent.futures.Future) -> None:
    if not future.cancelled() and future.exception() is None and future.result():
        logger.info(f"alone in the last round: {future.result()} known peer(s) answered a ping")
