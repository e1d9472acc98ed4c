"""Settings of group averaging, and the record of one round."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, kw_only=True, slots=True)
class AveragingConfig:
    """How groups form and how long every phase of a round may take (no wait is unbounded)."""

    min_group_size: int = 2
    """Smallest group worth averaging in; with fewer peers the attempt fails and is retried."""
    target_group_size: int = 8
    """Largest group."""
    matchmaking_time_s: float = 2.0
    """How long peers gather in the DHT before groups are drawn."""
    join_timeout_s: float = 5.0
    """Deadline for followers to join their leader and hear the final group."""
    sender_timeout_s: float = 10.0
    """A reducer waits this long (after the group forms) for every member's part; late parts are dropped."""
    reducer_timeout_s: float = 20.0
    """A sender waits this long for a reducer's averaged slice; a silent reducer fails the attempt."""
    agreement_timeout_s: float = 5.0
    """Reducers wait this long for each other's lists of received parts."""
    round_timeout_s: float = 30.0
    """Deadline of a whole round (matchmaking, all-reduce, retries); a trainer with no group by then applies
    its own update alone."""
    members_only: bool = False
    """Draw (and admit to a group this peer leads) only peers holding a live capability record of the
    run; see averaging.membership. Off by default: records take seconds to spread, and peers that see
    different member sets draw different groups (measured, with suspect_s=30 too: the 80 s chaos test
    grouped 0.45 of its rounds instead of 0.86)."""
    suspect_s: float = 0.0
    """A candidate that was drawn and did not join, a leader that did not answer, or a member that failed
    the all-reduce, is not drawn for this long (doubling on each repeat, up to 16x; never a peer this one
    has averaged with); 0: off (the default, for the same reason as members_only)."""
    guard_s: float = 60.0
    """Signed Sybils' defence: after a drawn peer this one never averaged with fails to show, draw only
    peers it has history with for this long (doubling while the flood lasts, up to 16x); see
    averaging.membership. 0: off."""
    shard_size: int = 64
    """Most live members of the run per matchmaking key: a larger run spreads over a power of two of keys
    (each holding shard_size/2 to shard_size of them on average), a peer's key drawn anew every `SHARD_EPOCH_S` from
    its peer ID, so the load on the DHT nodes that hold a key stays bounded as the run grows and groups
    still mix across the run over epochs (averaging.group). 0: one key, whatever the size."""
    piece_numel: int = 1 << 18
    """Coordinates per piece of a slice (0: one piece). Senders stream their parts piece by piece, and a
    reducer aggregates each piece and sends it back as soon as every member's piece came, before the last
    pieces arrive (a pipelined all-reduce); the robust rule runs per piece. Every member of a run must use
    the same value."""
    max_attempts: int = 3
    """All-reduce attempts per round (a failed slice re-forms the group from the survivors)."""
    codec: Literal["fp32", "fp16", "int8"] = "int8"
    """Wire format of averaged tensors: fp32, fp16 or int8 (bitsandbytes blockwise 8-bit)."""
    aggregator: Literal["centered_clip", "trimmed_mean", "mean"] = "centered_clip"
    """Robust rule applied to each slice: centered_clip, trimmed_mean or mean."""
    max_weight: float = 1e9
    """A contribution claiming a larger weight (or a non-finite or non-positive one) is rejected."""
    max_weight_ratio: float | None = 2.0
    """Cap each accepted weight (a trainer's: its samples since its last round) at this many times the
    median accepted weight of the slice, so that one sender's huge (but allowed) claim cannot outweigh
    the rest (0 or None: no cap)."""

    def __post_init__(self) -> None:
        if self.min_group_size < 2:
            raise ValueError(f"min_group_size must be >= 2, got {self.min_group_size!r}")
        if self.target_group_size < self.min_group_size:
            raise ValueError(f"target_group_size must be >= min_group_size, got {self.target_group_size!r}")
        for name in (
            "matchmaking_time_s",
            "join_timeout_s",
            "sender_timeout_s",
            "reducer_timeout_s",
            "agreement_timeout_s",
            "round_timeout_s",
            "max_weight",
        ):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        for name in ("suspect_s", "guard_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.round_timeout_s <= self.matchmaking_time_s + self.join_timeout_s:
            raise ValueError(
                f"round_timeout_s ({self.round_timeout_s!r}) must exceed matchmaking_time_s + join_timeout_s "
                f"({self.matchmaking_time_s!r} + {self.join_timeout_s!r})"
            )
        if self.max_weight_ratio == 0:
            object.__setattr__(self, "max_weight_ratio", None)
        ratio = self.max_weight_ratio
        if ratio is not None and not (
            isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and math.isfinite(ratio) and ratio >= 1
        ):
            raise ValueError(f"max_weight_ratio must be None or a finite number >= 1, got {ratio!r}")
        if not isinstance(self.shard_size, int) or isinstance(self.shard_size, bool) or self.shard_size < 0:
            raise ValueError(f"shard_size must be an int >= 0, got {self.shard_size!r}")
        if 0 < self.shard_size < self.target_group_size:
            raise ValueError(
                f"shard_size ({self.shard_size!r}) must be 0 or >= target_group_size ({self.target_group_size!r})"
            )
        if not isinstance(self.piece_numel, int) or isinstance(self.piece_numel, bool) or self.piece_numel < 0:
            raise ValueError(f"piece_numel must be an int >= 0, got {self.piece_numel!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts!r}")
        if self.codec not in ("fp32", "fp16", "int8"):
            raise ValueError(f"codec must be fp32, fp16 or int8, got {self.codec!r}")
        if self.aggregator not in ("centered_clip", "trimmed_mean", "mean"):
            raise ValueError(f"aggregator must be centered_clip, trimmed_mean or mean, got {self.aggregator!r}")


@dataclass(slots=True)
class RoundRecord:
    """Everything one peer saw of one averaging round; the evidence ledger stores these."""

    round: int
    group_id: str = ""
    members: list[str] = field(default_factory=list)
    """The final group, in slice order (member i reduces slice i)."""
    included: list[str] = field(default_factory=list)
    """Members whose contributions are in the result."""
    rejected: dict[str, str] = field(default_factory=dict)
    """Senders whose contributions failed validation, with the reason."""
    failures: list[dict[str, str]] = field(default_factory=list)
    """(peer, phase, reason) of every fault seen: dropped senders, silent reducers, refused joins."""
    bytes_sent: int = 0
    bytes_received: int = 0
    phase_s: dict[str, float] = field(default_factory=dict)
    """Seconds of the round: ``matchmaking``, ``ready`` (a tensor handed later: until it came, from the round's
    start), and of its last all-reduce attempt ``parts`` (until this reducer had every part, or stopped
    waiting), ``last_sender`` (until the last part began to arrive; 0 if all did before), ``mean_sender`` (the
    members' mean of when their parts began to arrive, this one's own at 0; negative: it is behind), ``agreement`` (the
    reducers' lists of senders), ``reduced`` (its own slice aggregated, from the attempt's start) and
    ``allreduce`` (every slice back); ``total``."""
    parts: dict[str, dict] = field(default_factory=dict)
    """Sender -> ``{"sha256": its part of this peer's slice as it came (`averaging.group.part_digest`), "weight":
    the weight it claimed, "statement": its `averaging.group.PartStatement` of that part (as JSON), "signature": the
    sender's signature of it}``, for the senders in this peer's slice of the result (the last attempt's): a
    verifier of the sender binds them to its committed update, and shows them to others (`swarm.work`)."""
    own_slice: tuple[int, int] = (0, 0)
    """The coordinates [start, end) of the vector this peer reduced in the last attempt."""
    codec: str = ""
    """The last attempt's wire format."""
    piece_numel: int = 0
    """The last attempt's pieces (`AveragingConfig.piece_numel`)."""
    label: str = ""
    """What this peer's signed statements of its parts name (`averaging.group.PartStatement`): the caller's
    ``step(label=...)``, in swarm.work the digest of the phase's commitment."""
    attempts: int = 0
    outcome: str = "failed"
    """ok (every member included), partial (survivors' mean: some senders dropped), retried (a slice was
    lost and the group re-formed from the survivors), or failed (no group; the caller keeps its own values)."""

    def fail(self, peer: str, phase: str, reason: str) -> None:
        self.failures.append({"peer": peer, "phase": phase, "reason": reason})

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}
