"""A trainer's settings: one frozen, typed, nested `TrainerConfig`.

Each part is its own dataclass (`averaging.AveragingConfig`, `NetworkConfig`, `CheckpointConfig`,
`PresenceConfig`, `RequirementsConfig`, `MetricsConfig`) and every field name is unique across
them, so `swarm.peer` derives one flat flag per field (``--codec``, ``--checkpoint-dir``) and
`TrainerConfig.with_fields` sets any of them by its plain name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from packaging.version import InvalidVersion, Version

from averaging import AveragingConfig
from bootstrap.errors import ConfigError
from bootstrap.records import MAX_LIFETIME_S, Requirements
from swarm.recipe import DEFAULT_SYNC_EVERY, INNER_WARMUP_STEPS, OuterSettings, outer_settings

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_RENAMED = {"averaging_timeout_s": "round_timeout_s"}
"""Field names of earlier releases, still accepted (with a DeprecationWarning)."""


def averaging_prefix(run: str) -> str:
    """The `averaging.GroupAverager` prefix of a run's trainers: their matchmaking keys, their averaging handler,
    and what their signed statements of parts are bound to (`swarm.work` checks those signatures)."""
    return f"swarm_{run}"


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkConfig:
    """How this peer listens and reaches the network."""

    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    """Multiaddrs this peer listens on."""
    announce_maddrs: tuple[str, ...] = ()
    """Multiaddrs announced to others (when behind NAT or port forwarding)."""
    connect_timeout_s: float = 30.0
    """Deadline to reach one of initial_peers."""
    dht_rpc_timeout_s: float = 3.0
    """Deadline of one DHT request to one node (hivemind's ``wait_timeout``); a node that misses it is left out
    for a while (hivemind's blacklist: 5 s, doubling). A frozen node (SIGSTOP, a suspended machine) costs a
    lookup that long whenever its blacklisting runs out."""

    def __post_init__(self) -> None:
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s!r}")
        if not (math.isfinite(self.dht_rpc_timeout_s) and self.dht_rpc_timeout_s > 0):
            raise ValueError(f"dht_rpc_timeout_s must be a positive number, got {self.dht_rpc_timeout_s!r}")

    def dht_kwargs(self) -> dict:
        """The keyword arguments of `bootstrap.network.start_swarm_dht` this part sets."""
        return {
            "host_maddrs": self.host_maddrs,
            "announce_maddrs": self.announce_maddrs,
            "connect_timeout_s": self.connect_timeout_s,
            "wait_timeout": self.dht_rpc_timeout_s,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """Where this peer keeps its sealed checkpoints and its evidence ledger."""

    checkpoint_dir: str = "~/.swarm/checkpoints"
    """Where sealed checkpoints of the run are kept (content-addressed safetensors shards + manifests)."""
    checkpoint_every: int = 1
    """Seal a checkpoint every this many averaging rounds (0: never; the run's other peers may still)."""
    keep_checkpoints: int = 5
    """Sealed checkpoints kept on disk; older ones and their unreferenced shards are removed."""
    ledger_dir: str = "~/.swarm/ledgers"
    """Where this peer's hash-chained, signed event ledger is kept (DIR/RUN/PEER_ID.sqlite); empty: none."""

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0 or self.keep_checkpoints < 1:
            raise ValueError(
                f"checkpoint_every must be >= 0 and keep_checkpoints >= 1, got "
                f"{self.checkpoint_every!r}, {self.keep_checkpoints!r}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class PresenceConfig:
    """What this peer publishes about itself, and how often."""

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

    def __post_init__(self) -> None:
        if not 0 < self.record_refresh_s < self.record_expiry_s <= MAX_LIFETIME_S:
            raise ValueError(
                f"need 0 < record_refresh_s < record_expiry_s <= {MAX_LIFETIME_S}, got "
                f"{self.record_refresh_s!r} and {self.record_expiry_s!r}"
            )
        if not self.bandwidth_probe_period_s >= 0:
            raise ValueError(f"bandwidth_probe_period_s must be >= 0, got {self.bandwidth_probe_period_s!r}")
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


@dataclass(frozen=True, kw_only=True, slots=True)
class RequirementsConfig:
    """The run's requirements, when this peer starts the run (joiners take the run's own)."""

    require_memory_gb: float = 0.0
    """Run requirement (when this peer starts the run): free accelerator memory, or RAM on CPU peers."""
    require_dtype: Literal["fp32", "bf16"] = "fp32"
    """Run requirement: fp32, or bf16 (peers without bf16 support are refused)."""
    require_swarm_version: str = ""
    """Run requirement: oldest swarm version allowed to join (empty: any)."""
    require_torch_version: str = ""
    """Run requirement: oldest torch version allowed to join (empty: any)."""

    def __post_init__(self) -> None:
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

    def requirements(self) -> Requirements:
        return Requirements(
            min_memory_bytes=int(self.require_memory_gb * 2**30),
            dtype=self.require_dtype,
            min_swarm_version=self.require_swarm_version,
            min_torch_version=self.require_torch_version,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricsConfig:
    """What a peer shows: the Prometheus endpoint and the progress line."""

    metrics_port: int = 0
    """Serve Prometheus metrics on this port (0: off)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint listens on (0.0.0.0 to let a remote Prometheus scrape it)."""
    progress: bool = True
    """Show a live progress line (step, loss, samples/s, round, group, val loss) when stderr is a terminal."""

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkConfig:
    """Verified work (swarm.work): commitments to each phase, spot-check replays, exclusion of cheats."""

    verify_work: bool = False
    """Commit to each phase's inner steps and check the others' by replay (needs a registry task; blocking
    rounds only). swarm.peer turns it on for its registry tasks with --verify-work."""
    check_rate: float = 0.9
    """Chance that a contribution is checked (one segment of it, by another member) while its verifier has
    not yet passed ``trust_after`` of its prover's checks itself: a peer that never trains escapes 5 rounds
    with probability 0.1^5 = 1e-5. Cost while on probation: about 0.23 of the compute at --sync-every 10
    (benchmarks/README.md, section 13)."""
    trusted_rate: float = 0.25
    """Chance of a check once the verifier has passed ``trust_after`` checks of that prover by its own
    replays (never on hearsay): a peer that trained honestly for that long and then stops is caught in 4
    rounds on average (escapes 5 with probability 0.75^5 = 0.24). Cost once trusted: about 0.09 of the
    compute at --sync-every 10. Set it to check_rate for a flat rate."""
    trust_after: int = 4
    """Passed checks (by this verifier) after which a prover is checked at trusted_rate."""
    segment_steps: int = 2
    """Inner steps per checked segment (longer when a phase would have more than 32 segments): a check
    replays this many steps; a phase keeps a boundary state (hashed: the recording's cost) every this many
    steps (memory: phase steps / segment_steps + 1 copies of parameters and optimizer state)."""
    require_verified: bool = False
    """Exclude members that send no commitment (a custom data loop, an overlapped trainer)."""
    replay_nice: int = 10
    """Niceness added to the thread that replays checks (Linux): replays take the CPU that training leaves
    (the waits of a round) before they take it from training. 0: the trainer's own priority."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.check_rate <= 1.0:
            raise ValueError(f"check_rate must be in [0, 1], got {self.check_rate!r}")
        if not 0.0 <= self.trusted_rate <= 1.0:
            raise ValueError(f"trusted_rate must be in [0, 1], got {self.trusted_rate!r}")
        if self.trust_after < 0:
            raise ValueError(f"trust_after must be >= 0, got {self.trust_after!r}")
        if self.segment_steps < 1:
            raise ValueError(f"segment_steps must be >= 1, got {self.segment_steps!r}")
        if not 0 <= self.replay_nice <= 19:
            raise ValueError(f"replay_nice must be in [0, 19], got {self.replay_nice!r}")


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
    overlap: bool = False
    """Run each averaging round in the background during the next inner steps and apply its outer step at
    the first step after it ends, under the progress made meanwhile (swarm.overlap), so training waits on
    the network only when a round takes longer than a phase; off: each round blocks training until it is
    done."""
    overlap_eager: bool = True
    """Overlapped rounds: each phase starts from the outer step this peer's own pseudo-gradient would make
    (standing in for the group's mean until the round lands: "eager updates"), not from its local parameters.
    It makes a late round cost less (benchmarks/README.md, section 11)."""
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
    divergence_rounds: int = 3
    """Warn loudly (log, ledger, status board) when the validation loss sealed by the groups rose this many
    rounds in a row, by at least 1 percent in all (0: never). Needs ``evaluate=``."""
    load_state: bool = True
    """Download the run's current state from a peer at start-up (a fresh run starts from the model as given)."""
    load_state_timeout_s: float = 60.0
    """Deadline for the state download at start-up."""
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    presence: PresenceConfig = field(default_factory=PresenceConfig)
    requirements: RequirementsConfig = field(default_factory=RequirementsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    work: WorkConfig = field(default_factory=WorkConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.run, str) or not _RUN_NAME.match(self.run):
            raise ValueError(f"run must match {_RUN_NAME.pattern}, got {self.run!r}")
        for name in ("sync_every",):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("inner_warmup_steps", "divergence_rounds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        outer = self.outer()
        if not 0 < outer.lr <= 10:
            raise ValueError(f"outer_lr must be in (0, 10], got {outer.lr!r}")
        if not 0 <= outer.momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer.momentum!r}")
        if not self.load_state_timeout_s > 0:
            raise ValueError(f"load_state_timeout_s must be > 0, got {self.load_state_timeout_s!r}")

    def outer(self) -> OuterSettings:
        """The outer step's settings: the fields given, else the rule's for ``sync_every``."""
        rule = outer_settings(self.sync_every)
        return OuterSettings(
            lr=rule.lr if self.outer_lr is None else self.outer_lr,
            momentum=rule.momentum if self.outer_momentum is None else self.outer_momentum,
        )

    @classmethod
    def create(cls, **fields: Any) -> TrainerConfig:
        """A config from plain field names of any part: ``TrainerConfig.create(run="r", codec="fp32")``."""
        if "run" not in fields:
            raise TypeError("TrainerConfig needs run= (the name of the run to join)")
        run = fields.pop("run")
        return cls(run=run).with_fields(**fields)

    def with_fields(self, **fields: Any) -> TrainerConfig:
        """A copy with fields of any part replaced by plain name (``sync_every=20, codec="fp32"``).

        Lists become tuples; an unknown name raises TypeError naming the known ones."""
        own: dict[str, Any] = {}
        parts: dict[str, dict[str, Any]] = {}
        renamed: dict[str, str] = {}
        for name, value in fields.items():
            if name in _RENAMED:
                warnings.warn(f"{name} is now {_RENAMED[name]}", DeprecationWarning, stacklevel=3)
                renamed[_RENAMED[name]], name = name, _RENAMED[name]
            value = tuple(value) if isinstance(value, list) else value
            part = _PART_OF.get(name)
            if part is not None:
                parts.setdefault(part, {})[name] = value
            elif name in _OWN and name not in _PART_TYPES:
                own[name] = value
            else:
                raise TypeError(f"TrainerConfig has no field {name!r}; fields: {', '.join(sorted(all_field_names()))}")
        try:
            for part, values in parts.items():
                own[part] = dataclasses.replace(getattr(self, part), **values)
            return dataclasses.replace(self, **own)
        except ValueError as e:  # name the fields as the caller typed them
            if not renamed:
                raise
            text = str(e)
            for new, old in renamed.items():
                text = text.replace(new, f"{old} (now {new})")
            raise ValueError(text) from None


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

    def for_params(self, names: Sequence[str], params: Sequence[Any]) -> TaskInfo:
        """This info, with the digest derived from the parameters' names and shapes if it has none."""
        if self.config_digest:
            return self
        shapes = ";".join(f"{name}:{tuple(p.shape)}" for name, p in zip(names, params))
        return dataclasses.replace(self, config_digest=hashlib.sha256(shapes.encode()).hexdigest())


class RunMismatch(ConfigError):
    """This peer may not join the run: unmet requirements or a different model."""


_PART_TYPES = {
    f.name: f.default_factory for f in dataclasses.fields(TrainerConfig) if f.default_factory is not dataclasses.MISSING
}
_OWN = {f.name for f in dataclasses.fields(TrainerConfig)}
_PART_OF = {f.name: part for part, cls in _PART_TYPES.items() for f in dataclasses.fields(cls)}


def all_field_names() -> list[str]:
    """Every settable field name, parts included (the flags of `swarm.peer`)."""
    return [n for n in _OWN if n not in _PART_TYPES] + list(_PART_OF)
