"""The round's bookkeeping as pure functions: what a member sends beside its tensors, how the others'
(untrusted) metadata is checked, which round the group moves to, whether bases must be agreed on,
what every member seals, who replaced whom. No network, no clock, no trainer: the trainer calls them
with what a round returned, and tests call them with plain values.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from averaging import Group, RoundRecord
from bootstrap.identity import PeerBinding
from swarm.checkpoint.sync import SealRequest
from swarm.ledger.chain import GENESIS
from swarm.ledger.receipts import Receipt, sign_receipt

logger = logging.getLogger(__name__)

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_MAX_SAMPLES = 2**40


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
    landed_step: int | None = None
    """Overlapped: the local step it landed at between sync points (None: at a sync point, or blocking)."""


@dataclass(slots=True)
class TrainerCounters:
    rounds_ok: int = 0
    rounds_solo: int = 0
    state_loaded: int = 0
    state_verified: int = 0
    rejected: Counter = field(default_factory=Counter)


@dataclass(slots=True)
class RoundBook:
    """A trainer's running figures between rounds."""

    started_at: float
    last_sync_end: float
    divergence: Any
    """A ``swarm._private.divergence.DivergenceGuard`` fed each grouped round's validation loss."""
    samples_since_sync: int = 0
    samples_per_s: float = 0.0
    last_loss: float | None = None
    last_val_loss: float | None = None
    """The last value of ``evaluate()``; the caller may clear it once used (``swarm.peer`` does)."""
    shown_val_loss: float | None = None
    """The same value, kept for the status board."""
    solo_streak: int = 0
    next_sync: int = 0
    """The local step of the next sync point (set by the trainer)."""
    last_sync_step: int = 0
    steps_per_s: float = 0.0
    """Inner steps per second over the last phase (an overlapped trainer's matchmaking lead)."""


def prelaunch_due(book: RoundBook, *, local_step: int, lead: int, grouped: int, in_flight: bool) -> bool:
    """Whether an overlapped phase's round forms its group now, ``lead`` steps before its sync point.

    Only once this process has grouped (``grouped`` rounds ok) and its last round did (no solo streak),
    with no round in flight. Never a process's first round: the members' sync points are then as far
    apart as their starts (seconds, a restart's more), and each member of a prelaunched round begins
    its all-reduce at its own sync point, waiting for the others' parts only until the sender deadline,
    so a member that far behind fails the round for all of them. A round joined at its sync point forms
    its group when the members are looking, and the next phase counts from then: their sync points meet.
    """
    return not in_flight and grouped > 0 and book.solo_streak == 0 and local_step >= book.next_sync - lead


def gather_metadata(
    round_: int,
    samples: int,
    binding: PeerBinding,
    state_digest: str,
    sealed: tuple[int, str] | None,
    *,
    fresh: bool,
    now: float | None = None,
) -> dict:
    """What this member sends beside its tensors (every member checks it with `gathered_problem`)."""
    return {
        "round": round_,
        "samples": int(samples),
        "binding": binding.to_dict(),
        "base": state_digest,
        "t": int(time.time() if now is None else now),
        "sealed": list(sealed) if sealed else None,
        "fresh": fresh,
    }


def joined_entry(
    round_: int, step: int, counters: TrainerCounters, join_s: float, newest: tuple[int, str] | None
) -> dict:
    """The ledger's "joined" entry."""
    return {
        "round": round_,
        "step": step,
        "state_loaded": counters.state_loaded > 0,
        "state_verified": counters.state_verified > 0,
        "join_s": join_s,
        "manifest": newest[1] if newest and counters.state_verified else None,
    }


def gathered_problem(peer_id: str, data: Any) -> str | None:
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


def check_gathered(gathered: Mapping[str, Any]) -> dict[str, str]:
    """{member: reason} for every member whose gathered metadata fails `gathered_problem`."""
    problems = {str(peer): gathered_problem(str(peer), data) for peer, data in gathered.items()}
    return {peer: reason for peer, reason in problems.items() if reason is not None}


def next_round(current: int, gathered: Mapping[str, Any]) -> int:
    """One past the highest round any member (this one included) was at; absurd claims are ignored."""
    rounds = [g.get("round") for g in gathered.values() if isinstance(g, dict)]
    return 1 + max([current] + [r for r in rounds if isinstance(r, int) and 0 <= r < 2**62])


def base_agreement_group(group: Group, record: RoundRecord | None, peer_id: str) -> Group | None:
    """The group that must average its global state after the round, or None when there is nothing to
    agree on: every included member holds the same state, fewer than two are left, or this peer's own
    update was not included.

    Only members whose updates the round included take part (the same set at every reducer): one that
    was dropped (late, refused, dead) is not there, and waiting for it would cost every later round a
    timeout while its state drifts."""
    if record is not None and record.included:
        kept = set(record.included)
        if peer_id not in kept:
            return None
        members = tuple(m for m in group.members if m in kept)
        group = dataclasses.replace(group, members=members, gathered={m: group.gathered.get(m) for m in members})
    # str(): the digests are untrusted metadata and may be unhashable (a list, a dict)
    digests = {str(g.get("base")) for g in group.gathered.values() if isinstance(g, dict)}
    if len(digests) <= 1 or len(group.members) < 2:
        return None
    return group


def _samples(value: Any) -> int | None:
    return value if isinstance(value, int) and 0 <= value < _MAX_SAMPLES else None


@dataclasses.dataclass(frozen=True, slots=True)
class SealFields:
    """What every member of a group seals beside the state: only values all of them computed identically."""

    participants: tuple[str, ...]
    created_at: int
    parent: str
    metrics: dict[str, int]
    contributions: dict[str, int]


def seal_fields(group: Group, val_loss: float | None) -> SealFields:
    """The seal's fields from the group's gathered metadata (untrusted: values a manifest would refuse
    are dropped here, or one member could stop the group's seal)."""
    gathered = [g for g in group.gathered.values() if isinstance(g, dict)]
    times = [g["t"] for g in gathered if isinstance(g.get("t"), int) and 0 < g["t"] < 2**63]
    parents = [
        tuple(g["sealed"])
        for g in gathered
        if isinstance(g.get("sealed"), list)
        and len(g["sealed"]) == 2
        and isinstance(g["sealed"][0], int)
        and isinstance(g["sealed"][1], str)
        and _SHA256_HEX.fullmatch(g["sealed"][1])
    ]
    parent = max(parents, key=lambda sealed: (sealed[0], sealed[1]))[1] if parents else ""
    samples = sum(s for g in gathered if (s := _samples(g.get("samples"))) is not None)
    metrics = {"round_samples": samples, "group_size": len(group.members)}
    # members evaluate the same parameters on the same batches; rounding to thousandths makes the
    # signed value agree across hardware (a rare disagreement only skips one seal)
    if val_loss is not None and math.isfinite(val_loss):
        metrics["val_loss_milli"] = round(val_loss * 1000)
    contributions = {
        peer: s
        for peer, g in group.gathered.items()
        if peer in group.members and isinstance(g, dict) and (s := _samples(g.get("samples"))) is not None
    }
    return SealFields(
        participants=tuple(group.members),
        created_at=min(times, default=0),
        parent=parent,
        metrics=metrics,
        contributions=contributions,
    )


def participation_receipt(
    *,
    run: str,
    round_: int,
    group: Group,
    record: RoundRecord | None,
    peer_id: str,
    samples: int,
    ledger_head: tuple[int, str],
    now: int,
) -> Any:
    """This peer's (unsigned) participation receipt of a grouped round, or None without a group id.
    Raises ValueError when a field is out of a receipt's bounds (e.g. a group larger than it may name)."""
    if record is None or not record.group_id:
        return None
    seq, head = ledger_head
    return Receipt(
        v=1,
        run=run,
        round=round_,
        group_id=record.group_id,
        members=tuple(sorted(group.members)),
        peer=peer_id,
        samples=samples,
        bytes_sent=int(record.bytes_sent),
        bytes_received=int(record.bytes_received),
        ledger_seq=seq,
        ledger_head=head,
        t=int(now),
    )


def sign_participation(
    identity: Any, run: str, round_: int, group: Group, record: RoundRecord | None, samples: int, *, ledger: Any
) -> Any:
    """``identity``'s signed participation receipt of a grouped round, naming the head of its ``ledger``
    (None: no ledger); None when there is none to sign (logged: evidence is skipped, training goes on)."""
    try:
        receipt = participation_receipt(
            run=run,
            round_=round_,
            group=group,
            record=record,
            peer_id=identity.peer_id,
            samples=samples,
            ledger_head=ledger.head() if ledger is not None else (0, GENESIS),
            now=int(time.time()),
        )
        return sign_receipt(receipt, identity) if receipt is not None else None
    except ValueError as e:  # e.g. a group larger than a receipt may name
        logger.warning("round %s: no participation receipt: %s", round_, e)
        return None


def seal_request(group: Group, val_loss: float | None, *, state: Callable[[], dict], step: int) -> Any:
    """The `swarm.checkpoint.sync.SealRequest` every member of ``group`` makes: ``state()`` (the global
    state they all hold now) and `seal_fields`."""
    fields = seal_fields(group, val_loss)
    return SealRequest(
        state=state(),
        step=step,
        participants=fields.participants,
        created_at=fields.created_at,
        parent=fields.parent,
        metrics=fields.metrics,
        contributions=fields.contributions,
    )


class Replacements:
    """Peers that failed in our rounds are "lost" until seen in a group again; when a peer that has just
    joined (and resumed from a sealed checkpoint) shows up while some are lost, `observe` says who
    replaced whom."""

    def __init__(self) -> None:
        self.lost: dict[str, int] = {}

    def observe(self, *, round_: int, peer_id: str, group: Group, failures: Iterable[dict]) -> dict | None:
        members = set(group.members)
        self.lost.update(
            {f["peer"]: round_ for f in failures if isinstance(f.get("peer"), str) and f["peer"] not in members}
        )
        for peer in members:
            self.lost.pop(peer, None)
        joined = sorted(
            p for p, g in group.gathered.items() if p != peer_id and isinstance(g, dict) and g.get("fresh") is True
        )
        if not joined or not self.lost:
            return None
        event = {"round": round_, "left": sorted(self.lost), "joined": joined}
        self.lost.clear()
        return event


class RecentPeers:
    """Peers of recent groups, most recent last (bounded): who to ping when a round finds no one."""

    def __init__(self, limit: int = 64) -> None:
        self._limit = limit
        self._peers: dict[str, None] = {}

    def add(self, members: Sequence[str]) -> None:
        for member in members:
            self._peers.pop(member, None)
            self._peers[member] = None
        while len(self._peers) > self._limit:
            self._peers.pop(next(iter(self._peers)))

    def newest_first(self) -> list[str]:
        return list(reversed(self._peers))


def round_entry(
    result: RoundResult, step: int, samples: int, samples_per_s: float, val_loss: float | None, solo: bool
) -> dict:
    """The ledger's "round" entry."""
    body = {
        "round": result.round,
        "step": step,
        "group_size": result.group_size,
        "duration_s": result.duration_s,
        "samples": samples,
        "samples_per_s": samples_per_s,
        "val_loss": val_loss if val_loss is None or math.isfinite(val_loss) else None,
        "solo": solo,
        "rejected_metadata": list(result.rejected),
    }
    if result.record is not None:
        full = result.record.to_dict()
        body.update(
            {
                k: full[k]
                for k in (
                    "group_id",
                    "members",
                    "included",
                    "outcome",
                    "bytes_sent",
                    "bytes_received",
                    "failures",
                    "rejected",
                )
            }
        )
    return body


def group_summary(group: Group, record: RoundRecord, duration_s: float) -> dict:
    """The status board's "last group" of this peer."""
    return {
        "group_id": record.group_id,
        "members": sorted(group.members),
        "outcome": record.outcome,
        "duration_ms": int(duration_s * 1000),
        "bytes_sent": int(record.bytes_sent),
        "bytes_received": int(record.bytes_received),
    }
