"""Group averaging over hivemind's P2P streams: DHT matchmaking, butterfly all-reduce, robust slices.

Matchmaking (no coordinator). Every peer that wants to average announces itself under the run's
matchmaking key in the DHT, waits ``matchmaking_time_s``, and reads who else is looking. All peers
sort that list the same way -- by bandwidth class (so a slow peer does not drag a fast group down),
then by a hash of (peer ID, the list's own digest), which reshuffles groups from round to round so
updates mix across the swarm (Moshpit-style) -- and cut it into groups of at most
``target_group_size``. The first member of each chunk leads: the others join it over a stream and it
answers with the final membership (who actually joined) and everyone's gathered metadata. With the
peer's identity, entries are owner-signed and the list is filtered first (averaging.membership): only
signed entries of live members of the run, minus recent no-shows, are drawn. While a flood of no-shows
lasts, the guard draws only peers this one has history with (averaging.membership).

Sharded keys. Every looking peer reads its key every 0.1 s of the window, so one key for a whole run
would put the run's every read on the few DHT nodes that hold that key. A run of more than
``shard_size`` live members (64 by default) spreads over S keys, S the least power of two that leaves at
most ``shard_size`` members a key; a peer's key for an epoch (`SHARD_EPOCH_S`, 60 s) is a hash of its
peer ID and the epoch, so the split changes each epoch and updates still mix across the run (Moshpit's
rotating grid, drawn at random). The run's size is the larger of the caller's live members and the
members read from the DHT; the window closes early once every live member *of this key* is looking.
The load on a key's nodes is then bounded by ``shard_size`` whatever the run's size
(`benchmarks/scale_model.py`).

Wake-ups. Between its reads a member in its window also listens: a join from a follower that has closed
its own window, or a "nudge" from the leader that drew it and has opened its lobby, makes it read the key
at once instead of at its next 0.1 s tick (at most `_MAX_WAKES` times a window; a nudge only from a peer it
knows to be looking, or a live member of its run). A join that comes before its leader's lobby opens waits
for the lobby, not for a 0.05 s poll. So the last member to look closes the others' windows within a
stream's latency, not a poll interval.

All-reduce (butterfly). Member i reduces slice i: every member sends slice i of its vector to member
i (encoded as fp32, fp16 or 8-bit), member i validates each part and aggregates the parts with a
robust rule (CenteredClip by default), and sends the result back on the same stream. Each peer
therefore sends and receives 2(N-1)/N of the vector, the bandwidth floor.

Pipelined in pieces. A slice is cut into pieces of at most ``piece_numel`` coordinates
(:func:`piece_bounds`), and a part is streamed piece by piece, each encoded on its own. As soon as every
member's piece k has come, the reducer aggregates it (the rule runs per piece) and sends it back on every
member's stream, while later pieces still arrive: the two halves of the round overlap, as a ring
all-reduce's do, instead of the link idling while the slowest reducer finishes and aggregates. Those
pieces are tentative: they assume every member survives. The reply on a stream is
``(piece)* [revised (piece)*] final``; a member takes the pieces it holds when ``final`` comes. A reducer
records the sha256 of each sender's part as it came, with the weight it claimed (`RoundRecord.parts`,
`part_digest`): what a verifier binds to that sender's committed update (`swarm.work`). After its last piece
a sender sends its signed statement of the part (`PartStatement`: the slice, the codec, the weight, the
digest and the caller's label, in swarm.work its commitment's digest); a reducer takes the part only if the
statement is what came and, with an identity, carries the sender's signature. The reducer keeps it, so what a
sender averaged is evidence anyone can check against what it committed, not only the reducer's word.

Faults. A sender silent past ``sender_timeout_s`` (a straggler or a dead peer) is dropped. Reducers
exchange the lists of parts they received in full and all use their intersection, so every slice averages
the *same* survivors: the result is the weighted mean of the surviving contributions, exactly. When the
survivors are every member and no piece rejected a sender, the reducer confirms the pieces it sent
(``final``); otherwise it sends ``revised`` and the survivors' aggregate, piece by piece (a second transfer
of the slice, only in a round with a fault, counted in ``GroupAverager.revised_slices``). A reducer that
never answers loses its slice: the members re-form a group from the survivors and retry, within the round's
deadline; a member that no reducer had a part from and whose list of senders never came by the agreement's
deadline is not waited for past it (it is gone or cut off; judged once another member's list came). A
member whose stream breaks or is refused is probed once on a fresh stream; one found gone (a killed peer's
dial fails; a restarted one is in no round) is waited for no longer -- neither its part nor its list of
senders -- so a SIGKILL costs the survivors the retry, not the deadlines. A member from which nothing came
for a quarter of the sender timeout while it owes this peer something is probed (`_watch_silence`): one
that answers is waited for as before; one silent to two probes in a row (frozen, cut off: its streams hang
rather than fail) is given up too, so a freeze or a partition costs the survivors that quiet spell (2.5 s by
default) and two probe timeouts, then the retry, not the deadlines. A leader probes the followers
that have not joined 0.5 s in, and again every second (one that does not answer within the probe's 2 s is
slow, not gone: it is waited for until the join deadline; one that answers that it drew another leader in
this window, its view of the candidates having differed, is not waited for, nor made a suspect), and leaves
out of the group a follower whose join stream ended before the group formed (killed, or it gave up): it
could not hear of the group, and the others would wait for its part.
`_PROBE_WINDOW_AFTER_S` into a matchmaking window, the expected members that are not looking are probed
once; one whose dial or stream fails, or that says it is loading state (`GroupAverager.loading`: a restarted
peer), is not waited for in that window (a slow or missing answer is no proof: it is still waited for),
nor probed or waited for in later windows until it is read as looking again (a restarted member's first
entry; `_Window.unreachable`), so a killed member costs one probe, not one a window until its capability
record expires. A member that gave no answer is not waited for in the next windows either until it shows
signs of life (`_Silent`), so a frozen member (SIGSTOP, a suspended laptop) costs one whole window.
Every outcome is in the RoundRecord.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import hivemind
import torch
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from averaging.aggregation import AggregationResult, Contribution, aggregate, validate_contribution
from averaging.compression import get_codec, wire_bytes
from averaging.config import AveragingConfig, RoundRecord
from averaging.membership import (
    JOIN_MIN_REFRESH_S,
    NEWCOMER_GRACE_S,
    Admission,
    Entry,
    EntryRejected,
    Guard,
    newcomer_slots,
    parse_entry,
    sign_entry,
)
from bootstrap.dhtcalls import keep_out_of_lookups, let_back_into_lookups
from bootstrap.envelope import Signable, check_int, check_str, from_dict
from bootstrap.errors import Rejected
from bootstrap.framing import ProtocolError, header_field, linger, read_exactly, read_frame, write_frame
from bootstrap.identity import Identity, public_key_from_peer_id, verify
from bootstrap.runtime import Handler

logger = logging.getLogger(__name__)

_MAX_HEADER_BYTES = 64 * 1024
_MAX_MEMBERS = 64
_MAX_ENTRIES_READ = 16 * _MAX_MEMBERS
_GONE_POLL_S = 0.25
_PROBE_TIMEOUT_S = 2.0
_QUIET_MIN_S = 1.0  # an all-reduce probes a member from which nothing came for this long at least
_QUIET_POLL_S = 0.25
_PROBE_GRACE_S = 0.1  # a window that ran its length waits this long for its probe's answers, due at its end
_PROBE_ABSENT_AFTER_S = 0.5  # a leader probes the followers that have not joined by then
_PROBE_WINDOW_AFTER_S = 0.25
"""How far into a matchmaking window the expected members not looking yet are probed. Halfway (1 s of the
default 2 s) made every window in the ~10 s a killed member takes to come back wait that long for its
probe: chaos runs spent 1.3-1.4 s a round in matchmaking against 0.35 s without faults."""
_LOADING = "loading state"
"""A window probe's answer from a peer that is loading the run's state (it will not look for a while)."""
_ELSEWHERE = "another leader"
"""A leader's probe's answer from an expected follower that drew another leader in this window (or leads one
itself): its view of the candidates differed, and it will not join."""
_WINDOW_POLL_S = 0.1
"""How often a member in its matchmaking window reads the key when nothing wakes it."""
_MAX_WAKES = 4
"""Most early reads that joins and nudges can cause in one matchmaking window (each is a DHT traversal)."""
_NUDGE_TIMEOUT_S = 1.0
"""Bound on a leader's nudge of one follower (best effort: a follower it misses reads at its next tick)."""
_KEEP_OUT_TIMEOUT_S = 1.0
"""Bound on asking this peer's DHT node to leave the silent members out of its lookups (`_Window.silent`)."""
_REPROBE_S = 1.0
"""How often a leader asks again the expected followers that have not joined and were not found gone or
elsewhere (one still in its window has drawn nobody yet)."""
_POLLERS: set[asyncio.Task] = set()
_MAX_SHARDS = 1 << 16
_MAX_PIECES = 256
SHARD_EPOCH_S = 60.0
"""How long a peer keeps its matchmaking key when the run is sharded (AveragingConfig.shard_size): long
beside a window (2 s), so few windows straddle a change, short beside a run, so groups mix across keys."""


# --------------------------------------------------------------------------------------------- groups
@dataclass(frozen=True, slots=True)
class Group:
    group_id: str
    members: tuple[str, ...]
    """In slice order; member i reduces slice i."""
    gathered: dict[str, Any]
    """Each member's gathered metadata (as sent, untrusted)."""


def slice_bounds(numel: int, num_parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(numel, num_parts)
    bounds, start = [], 0
    for i in range(num_parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def draw_groups(candidates: dict[str, Any], target_size: int, min_size: int) -> list[list[str]]:
    """Deterministic groups from {peer: bandwidth class} or {peer: (region, bandwidth class)}.

    Equal inputs give equal groups on every peer. Peers are ordered by region, then by bandwidth
    class (fastest first), then by a hash salted with the whole candidate list (so groups reshuffle
    whenever membership changes), and cut into consecutive chunks of near-equal size.
    """
    keys = {p: (c if isinstance(c, tuple) else ("", c)) for p, c in candidates.items()}
    digest = hashlib.sha256(",".join(sorted(keys)).encode()).hexdigest()
    order = sorted(keys, key=lambda p: (keys[p][0], -keys[p][1], hashlib.sha256((digest + p).encode()).digest()))
    num_groups = max(1, math.ceil(len(order) / target_size))
    while num_groups > 1 and len(order) // num_groups < min_size:
        num_groups -= 1
    bounds = slice_bounds(len(order), num_groups)
    return [order[a:b] for a, b in bounds]


def shard_count(run_size: int, shard_size: int) -> int:
    """Matchmaking keys for a run of ``run_size`` live members: the least power of two that puts at most
    ``shard_size`` of them on a key on average (so each holds shard_size/2 to shard_size, give or take a
    binomial spread: 1000 members on 16 keys, 49 to 72 a key); 1 (the plain key) for a
    run of up to ``shard_size``, or with ``shard_size`` 0."""
    shards = 1
    while shard_size > 0 and shards * shard_size < run_size and shards < _MAX_SHARDS:
        shards *= 2
    return shards


def shard_epoch(now: float) -> int:
    """The epoch of a DHT time ``now``: every peer's key changes at the same moments."""
    return int(now // SHARD_EPOCH_S)


def shard_of(peer_id: str, epoch: int, shards: int) -> int:
    """The key a peer looks on during ``epoch``: a hash of both, so that every peer computes every other's
    and the split changes each epoch (groups mix across keys over time, as Moshpit's rotating grid does)."""
    if shards <= 1:
        return 0
    return int.from_bytes(hashlib.sha256(f"{epoch}:{peer_id}".encode()).digest()[:8], "big") % shards


def matchmaking_key(prefix: str, shards: int, shard: int) -> str:
    """``prefix.mm`` for one key (every run of up to ``shard_size`` members); ``prefix.mm.S.i`` otherwise."""
    return f"{prefix}.mm" if shards <= 1 else f"{prefix}.mm.{shards}.{shard}"


def bandwidth_class(mbps: float | None) -> int:
    """Peers within a factor of ~4 in bandwidth share a class (unknown bandwidth: class 0)."""
    return 0 if not mbps or mbps <= 0 else max(1, int(math.log(mbps, 4)) + 1)


def piece_bounds(numel: int, piece_numel: int) -> list[tuple[int, int]]:
    """The pieces of a slice of ``numel`` coordinates: near-equal, at most ``piece_numel`` each (0: one piece)."""
    count = 1 if piece_numel <= 0 or numel <= 0 else min(_MAX_PIECES, -(-numel // piece_numel))
    return slice_bounds(numel, count)


def part_digest(part: torch.Tensor, codec: str, piece_numel: int) -> str:
    """sha256 of a member's ``part`` of one slice as a sender streams it: its pieces (`piece_bounds`), each
    encoded with ``codec``. What a reducer records of each sender's part (`RoundRecord.parts`), and what a
    verifier recomputes from the sender's committed update (`swarm.work`)."""
    digest, encode = hashlib.sha256(), get_codec(codec).encode
    for a, b in piece_bounds(part.numel(), piece_numel):
        digest.update(encode(part[a:b].contiguous()))
    return digest.hexdigest()


PART_KIND = "swarm-avg-part"
"""What a sender's statement of its part is signed as (`PartStatement`)."""
_MAX_PART_INT = 2**62 - 1
_MAX_PART_STR = 128


class PartRejected(Rejected):
    """A part's statement was refused (malformed, unsigned, or not signed by its sender)."""

    what = "part statement"


@dataclass(frozen=True, kw_only=True, slots=True)
class PartStatement(Signable):
    """What a sender signs of its part of one slice (sent after the last piece): slice ``index``, coordinates
    [lo, hi) of the vector, in pieces of ``piece_numel`` encoded with ``codec`` (`part_digest` is ``sha256``),
    with the weight it claimed and the caller's ``label`` (swarm.work: the digest of the sender's commitment,
    so a statement is evidence of that round only). Made by `part_statement`, read by `read_part`."""

    group_id: str
    index: int
    lo: int
    hi: int
    codec: str
    piece_numel: int
    weight: str
    """``repr`` of the float weight (signed payloads hold no floats)."""
    sha256: str
    label: str

    def __post_init__(self) -> None:
        for name in ("index", "lo", "hi", "piece_numel"):
            check_int(name, getattr(self, name), maximum=_MAX_PART_INT)
        for name in ("group_id", "codec", "weight", "sha256", "label"):
            check_str(name, getattr(self, name), max_chars=_MAX_PART_STR, allow_empty=True)


def part_statement(
    *, group_id: str, index: int, lo: int, hi: int, codec: str, piece_numel: int, weight: float, sha256: str, label: str
) -> PartStatement:
    """A `PartStatement` of a part whose claimed weight is ``weight``."""
    return PartStatement(
        group_id=group_id,
        index=index,
        lo=lo,
        hi=hi,
        codec=codec,
        piece_numel=piece_numel,
        weight=repr(float(weight)),
        sha256=sha256,
        label=label,
    )


def sign_part(identity: Identity, prefix: str, statement: PartStatement) -> str:
    """``identity``'s hex signature of ``statement`` among the averagers of ``prefix`` (`GroupAverager`'s: in a
    `swarm.Trainer`, ``swarm_<run>``)."""
    return identity.sign(kind=PART_KIND, run_id=prefix, payload=statement.payload()).hex()


def read_part(data: Any, signature: Any, *, signer: str | None, prefix: str) -> PartStatement:
    """The `PartStatement` in untrusted ``data``, signed by ``signer`` among the averagers of ``prefix`` (no
    ``signer``: the form only); PartRejected ("malformed part statement", "unsigned part", "bad part
    signature") otherwise."""
    try:
        statement = from_dict(PartStatement, data, "part", max_str=_MAX_PART_STR)
    except (TypeError, ValueError) as e:
        raise PartRejected("malformed part statement", str(e)[:200]) from None
    if signer is None:
        return statement
    try:
        key, signed = public_key_from_peer_id(signer), bytes.fromhex(signature)
    except (TypeError, ValueError):
        raise PartRejected("unsigned part") from None
    if not verify(public_key=key, kind=PART_KIND, run_id=prefix, payload=statement.payload(), signature=signed):
        raise PartRejected("bad part signature")
    return statement


# --------------------------------------------------------------------------------------------- state
@dataclass
class _Pieces:
    """The pieces of the slice a reducer aggregates (the pipelined all-reduce: see the module docstring)."""

    bounds: list[tuple[int, int]]
    weights: dict[str, float] = field(default_factory=dict)
    """Sender -> the weight its part's header claimed."""
    digests: dict[str, str] = field(default_factory=dict)
    """Sender -> sha256 of its part's bytes as they came, every piece of it (`part_digest`)."""
    signed: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Sender -> its `PartStatement` (what came, as JSON) and its signature: ``{"statement": ..., "signature": ...}``."""
    lo: int = 0
    """Where the slice begins in the vector."""
    received: list[dict[str, torch.Tensor]] = field(init=False)
    """Per piece: sender -> its decoded values (the reducer's own included)."""
    ready: list[asyncio.Event] = field(init=False)
    """Per piece: set once every member's piece came (or a member is known dead)."""
    tentative: list[asyncio.Future] = field(init=False)
    """Per piece: the encoded aggregate of every member's piece, sent before the survivors are agreed; None
    from the first piece that could not be aggregated that way."""
    final: list[bytes] = field(default_factory=list)
    """The encoded pieces of the result (set before ``_ReduceState.result``)."""
    confirmed: bool = False
    """Whether ``final`` is what went out tentatively (every member survived, no piece rejected)."""

    def __post_init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.received = [{} for _ in self.bounds]
        self.ready = [asyncio.Event() for _ in self.bounds]
        self.tentative = [loop.create_future() for _ in self.bounds]

    def give_up_tentative(self) -> None:
        for future in self.tentative:
            if not future.done():
                future.set_result(None)


@dataclass
class _ReduceState:
    """This peer's part of one all-reduce attempt: the slice it reduces."""

    group: Group
    my_index: int
    numel: int
    weight: float
    sender_deadline: float
    codec: str
    pieces: _Pieces
    started: float = field(default_factory=time.monotonic)
    """When this attempt began (monotonic)."""
    parts: set[str] = field(default_factory=set)
    """Senders every piece of whose part came (their weights: ``pieces.weights``)."""
    all_parts: asyncio.Event = field(default_factory=asyncio.Event)
    received_sets: dict[str, frozenset] = field(default_factory=dict)
    all_sets: asyncio.Event = field(default_factory=asyncio.Event)
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    """The senders included in the slice's aggregate (its pieces in ``pieces.final``), or None: the slice failed."""
    arrivals: dict[str, float] = field(default_factory=dict)
    """When each member's part began to arrive (its header; monotonic): about when that member sent."""
    dead: set[str] = field(default_factory=set)
    """Members gone from this attempt (a stream to them broke and a probe found them gone, or they fell
    silent: `GroupAverager._watch_silence`): neither their part, their list of senders nor their slice is
    waited for."""
    silent: set[str] = field(default_factory=set)
    """Those of ``dead`` given up for silence."""
    heard: dict[str, float] = field(default_factory=dict)
    """Member -> when something last came from it in this attempt (monotonic): a piece of its part, its list
    of senders, a piece of its slice, an answer to a probe."""
    sent: set[str] = field(default_factory=set)
    """Members this peer's part went to in full."""
    replied: set[str] = field(default_factory=set)
    """Members whose slice came back in full."""
    died: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (and replaced) each time a member is marked dead."""

    def waiting_for(self) -> set[str]:
        return set(self.group.members) - self.dead

    def heard_from(self, peer: str) -> None:
        self.heard[peer] = time.monotonic()

    def owes(self, peer: str) -> bool:
        """Whether this peer still waits for something from ``peer`` that does not wait on this peer's own
        sending: its part, or (once this peer's part went to it in full) its list of senders and its slice.
        A peer that is itself slow to send is not misled into giving up on those that wait for it."""
        if peer in self.dead or peer == self.group.members[self.my_index]:
            return False
        return peer not in self.parts or (
            peer in self.sent and not (peer in self.received_sets and peer in self.replied)
        )

    def update(self) -> None:
        """Wake the waits whose peers have all answered or are known dead."""
        members = set(self.group.members)
        for received, ready in zip(self.pieces.received, self.pieces.ready):
            if self.dead or set(received) >= members:
                ready.set()
        if self.parts >= self.waiting_for():
            self.all_parts.set()
        if set(self.received_sets) >= self.waiting_for():
            self.all_sets.set()

    def mark_dead(self, peer: str) -> None:
        self.dead.add(peer)
        self.update()
        self.died.set()
        self.died = asyncio.Event()

    async def unless_dead(self, peer: str, work: Awaitable[Any]) -> Any:
        """``work``'s result, or None (``work`` cancelled) once ``peer`` is marked dead: a stream to a frozen or
        cut-off member hangs rather than fails."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done() and peer not in self.dead:
                died = asyncio.ensure_future(self.died.wait())
                try:
                    await asyncio.wait((task, died), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    died.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
            return task.result()
        finally:
            if not task.done():  # this wait itself was cancelled
                task.cancel()

    def unheard(self) -> set[str]:
        """Once the survivors are agreed: the members no reducer had a part from and whose own list of senders
        never came (gone, or cut off: a partitioned peer's streams hang rather than fail). None while no other
        member's list came: on this peer's own view alone, it may be the one cut off or starved."""
        if len(self.received_sets) < 2:
            return set()
        return {
            m
            for m in self.group.members
            if m not in self.received_sets and not any(m in s for s in self.received_sets.values())
        }


@dataclass
class _Activity:
    """What an averager is doing: streams it is serving (`close` lets them finish) and rounds under way
    (matchmaking included: parts for a group it does not know yet may come meanwhile)."""

    serves: int = 0
    rounds: int = 0
    revised: int = 0
    """Slices this peer reduced whose pieces went out before the survivors were agreed and then changed."""
    last_round_end: float = -math.inf
    loading: bool = False
    """The owner is loading the run's state (`GroupAverager.loading`): it will not look for a group soon."""
    left_groups: deque[str] = field(default_factory=lambda: deque(maxlen=16))
    """Groups this peer formed and then left before its all-reduce (it had no tensor): parts and probes for
    them are answered at once, so the others do not wait for its part."""

    def round_ended(self) -> None:
        self.rounds -= 1
        self.last_round_end = time.monotonic()

    def in_a_round(self, *, grace_s: float) -> bool:
        """In a round, or in one that ended less than ``grace_s`` ago."""
        return self.rounds > 0 or time.monotonic() - self.last_round_end < grace_s


@dataclass(slots=True)
class _Silent:
    """Members that did not answer in time: a window's probe (an expected member not looking), a lobby's (a
    drawn follower that did not join), a join (a leader), an all-reduce's (`GroupAverager._watch_silence`) or a
    follower's probe of a drawn member left out of its group; suspended, SIGSTOPped, cut off without a reset,
    or very loaded. Later windows do not stay open for them, a lobby stops waiting for one silent again, and
    none is drawn while the entry it looks with may predate its silence: a frozen member costs one window and
    one join timeout, not one a round until its capability record expires. They are still probed (as absent),
    and one is forgotten once it answers a probe, averages with this peer, or is seen looking longer after it
    fell silent than an entry lives (a frozen member's last entry is read as looking for a window and a join
    timeout after it froze). A member wrongly found silent is thus drawn again once it answers a probe, or an
    entry's lifetime later; peers that disagree on it draw from different lists meanwhile (a window lost, at
    worst). This peer's DHT node leaves them out of its lookups meanwhile, and lets them back once forgotten
    (`GroupAverager._keep_silent_out_of_lookups`)."""

    since: dict[str, float] = field(default_factory=dict)
    """Peer -> when it fell silent (monotonic)."""
    back: set[str] = field(default_factory=set)
    """Those forgotten because they showed signs of life, not yet let back into this peer's DHT lookups."""

    def __bool__(self) -> bool:
        return bool(self.since)

    def peers(self) -> set[str]:
        return set(self.since)

    def fell_silent(self, peers: Iterable[str]) -> set[str]:
        """Mark ``peers``; returns those not marked before."""
        new = set(peers) - self.since.keys()
        self.back -= new
        now = time.monotonic()
        self.since.update((peer, now) for peer in new)
        return new

    def heard(self, peers: Iterable[str]) -> None:
        for peer in peers:
            if self.since.pop(peer, None) is not None:
                self.back.add(peer)

    def answered(self, outcomes: Mapping[str, str]) -> set[str]:
        """Probe outcomes (peer -> "silent", or how else it met the probe): the silent ones are marked, the
        others forgotten; returns those not marked before."""
        self.heard(p for p, how in outcomes.items() if how != "silent")
        return self.fell_silent(p for p, how in outcomes.items() if how == "silent")

    def seen_looking(self, peers: Iterable[str], entry_lifetime_s: float) -> None:
        """``peers`` were read as looking: those silent for longer than an entry lives wrote it since."""
        now = time.monotonic()
        self.heard([p for p in peers if now - self.since.get(p, now) > entry_lifetime_s])

    def keep_only(self, peers: Iterable[str]) -> None:
        """Forget those no longer among ``peers`` (the live members of the run)."""
        keep = set(peers)
        for peer in [p for p in self.since if p not in keep]:
            del self.since[peer]


@dataclass(slots=True)
class _Window:
    """This peer's last matchmaking window."""

    key: str
    """The matchmaking key it looked on (its entry is there; a "gone" entry goes there too)."""
    lonely: bool = False
    """Nobody else was looking."""
    looking: set = field(default_factory=set)
    """Who its last read in the window now open found looking (empty outside a window): nudges are taken
    from them, and from live members of the run."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by a join or a nudge: a member in its matchmaking window reads the key again at once."""
    lobby_opened: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (and replaced) when this peer opens a lobby: joins that came before it stop waiting."""
    unreachable: set = field(default_factory=set)
    """Expected members it stopped waiting for: not looking `_PROBE_WINDOW_AFTER_S` into a window, and a probe's
    dial or stream failed (killed, crashed, or restarted with its averager not up yet) or it said it is loading
    state. Later windows neither wait for nor probe them until one is read as looking again (a restarted
    member's first entry). Before, each window paid the probe's 0.25 s and the failed dial for every dead member
    until its capability record expired (after a Sybil flood, 41 of 62 rounds a minute spent 0.5 s in
    matchmaking, against 0.05 s)."""
    silent: _Silent = field(default_factory=_Silent)
    """Members that did not answer a probe in time (see `_Silent`)."""
    leader: str | None = None
    """The leader this round's last draw gave this peer (itself when it leads, or when its chunk was too small),
    None before the round's first draw: a leader that drew this peer and asks is told `_ELSEWHERE` when it is
    another. It is kept through the next window until that one draws. CI of stop 52: a peer whose view of the
    candidates misses its leader leads a chunk, hears that the others went to that leader, and looks again with
    them as suspects (a chunk too small); a probe in those windows was answered "not drawn yet" (wait for it),
    so its leader waited until the join deadline. One that does draw the leader later still joins while the
    leader's lobby is open."""


@dataclass
class _Lobby:
    """A leader's open invitation: followers join until the chunk is complete or time is up."""

    expected: frozenset
    joined: dict[str, Any] = field(default_factory=dict)
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    dead: set[str] = field(default_factory=set)
    """Expected followers that a probe found gone (killed, or restarted and in no round)."""
    quit: set[str] = field(default_factory=set)
    """Followers whose join stream closed before the group formed (killed, or gave up waiting)."""
    elsewhere: set[str] = field(default_factory=set)
    """Expected followers that answered a probe that they drew another leader (live: not suspects)."""
    silent: set[str] = field(default_factory=set)
    """Expected followers silent to a probe here and to an earlier one (`_Window.silent`): frozen or cut off."""
    final: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def leave(self, peer: str) -> None:
        """``peer``'s join stream closed while the group was forming: it cannot hear of the group, so it is
        not in it, and not waited for."""
        if self.final.done() or peer not in self.joined:
            return
        del self.joined[peer]
        self.quit.add(peer)
        self.expect_no_more({peer})

    def expect_no_more(self, peers: set[str]) -> None:
        """``peers`` are not waited for; the lobby is complete once everyone still expected has joined."""
        self.expected -= peers
        self.update()

    def update(self) -> None:
        if self.expected <= set(self.joined):
            self.complete.set()


FaultHook = Callable[[int, str, str], Awaitable[None] | None]
"""Called with (round, phase, peer) at fault-injection points; tests make it crash, stall or corrupt."""


class GroupAverager:
    """Averages a flat float32 vector with a group of peers of a run; thread-safe, synchronous API.

    Runs its own event loop in a background thread over a P2P replica of ``dht``'s daemon.
    ``step`` returns ``(averaged_tensor or None, RoundRecord)``: None when no group could average
    within the round's deadline (the caller then keeps its own values).

    With ``identity`` (the key of ``dht``'s peer ID) matchmaking entries are owner-signed and only
    signed entries are drawn; with ``run`` too, only peers holding a live capability record of that
    run are drawn or admitted to a group this peer leads (see averaging.membership). Without them
    (tests, benchmarks on plain hivemind DHTs) any well-formed entry is drawn.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        *,
        prefix: str,
        config: AveragingConfig | None = None,
        bandwidth_mbps: Callable[[], float | None] | None = None,
        region: str | None = None,
        identity: Identity | None = None,
        run: str | None = None,
        start_timeout_s: float = 30.0,
    ):
        self.dht, self.prefix, self.region = dht, prefix, (region or "")[:64]
        self.config = config or AveragingConfig()
        # a codec's first use loads what it needs (int8: bitsandbytes, 0.5-1.3 s of CPU): here, on the thread
        # that makes the averager before training starts, not in the first round against its deadlines
        get_codec(self.config.codec).warm()
        self.rejected: Counter = Counter()
        self._admission = Admission(identity, run, self.config.suspect_s, self.rejected, self.config.guard_s)
        self._bandwidth_mbps = bandwidth_mbps or (lambda: None)
        self.fault_hook: FaultHook | None = None
        self._dead = False
        self._left = False
        self._current: concurrent.futures.Future | None = None
        self._rounds = 0
        self._states: dict[str, _ReduceState] = {}
        self._lobbies: dict[str, _Lobby] = {}
        self._step_lock = threading.Lock()
        self._state_added = asyncio.Event()
        self._activity = _Activity()
        self._window = _Window(key=matchmaking_key(prefix, 1, 0))
        self._service = Handler(
            dht, handler_name=self._handler_name, handler=self._handle_stream, start_timeout_s=start_timeout_s
        )
        self.peer_id = str(self._p2p.peer_id)
        if identity is not None and identity.peer_id != self.peer_id:
            self._service.close()
            raise ValueError(f"identity {identity.peer_id} is not the key of the DHT's peer {self.peer_id}")

    # ------------------------------------------------------------------------------------ lifetime
    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        return self._service.loop

    @property
    def _p2p(self) -> Any:
        return self._service.p2p

    @property
    def _handler_name(self) -> str:
        return f"swarm.avg.v2.{self.prefix}"  # v2: a signed statement ends each part

    async def crash(self) -> None:
        """Fault injection: vanish at once, as a killed process would (streams drop, nothing answers)."""
        self._dead = True
        with contextlib.suppress(Exception):
            await self._p2p.remove_binary_stream_handler(self._handler_name)
        with contextlib.suppress(Exception):
            await self._p2p.shutdown()

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """While the owner loads the run's state (joining, or re-syncing after a cut): a window probe is
        answered "loading state", so the members looking for a group do not wait for this one."""
        self._activity.loading = True
        try:
            yield
        finally:
            self._activity.loading = False

    def close(self, timeout_s: float = 10.0) -> None:
        """Leave: say so in the matchmaking key (peers then neither draw this one nor wait for it), stop
        serving after up to 3 s for replies still in flight to be read. Idempotent."""
        self.leave(timeout_s=min(2.0, timeout_s / 4))
        if self._activity.serves and not self._dead and not self._service.runtime.dht_gone():
            with contextlib.suppress(Exception):
                self._service.submit(self._drain(min(3.0, timeout_s / 2))).result(timeout=timeout_s / 2 + 1)
        self._service.close(timeout_s)

    def leave(self, timeout_s: float = 2.0) -> None:
        """Say in the matchmaking key that this peer left the run: the others neither draw it nor wait for it
        (a signed "gone" entry, `averaging.membership`). Once; `close` does it too."""
        if self._left or self._dead or self._service.closed:
            return
        self._left = True
        if self._service.runtime.dht_gone():  # the DHT died with its process group's signal: no one to tell
            return
        with contextlib.suppress(Exception):
            self._service.submit(self._say_gone()).result(timeout=timeout_s)

    async def _say_gone(self) -> None:
        """A "gone" entry over this peer's matchmaking entry (a later expiry replaces it in the DHT)."""
        cfg = self.config
        expiration = get_dht_time() + cfg.matchmaking_time_s + cfg.join_timeout_s + 1
        # the key of its last window (where its entry is read) and, in a sharded run, the one of this epoch (where
        # the peers that expect it look)
        for key in dict.fromkeys((self._window.key, self._shard()[0])):
            await self.dht.store(
                key, self._entry(key, expiration, gone=True), expiration, subkey=self.peer_id, return_future=True
            )

    def _entry(self, key: str, expiration: float, *, gone: bool = False) -> dict:
        bandwidth = bandwidth_class(self._bandwidth_mbps())
        if self._admission.identity is not None:
            return sign_entry(
                self._admission.identity,
                key,
                bandwidth_class=bandwidth,
                region=self.region,
                expires_at=expiration,
                gone=gone,
            )
        return {"t": time.time(), "c": bandwidth, "r": self.region, **({"g": 1} if gone else {})}

    async def _drain(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._activity.serves and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # polling a counter with a deadline

    async def _fault(self, phase: str, peer: str = "") -> None:
        if self.fault_hook is not None:
            outcome = self.fault_hook(self._rounds, phase, peer)
            if asyncio.iscoroutine(outcome):
                await outcome

    # ------------------------------------------------------------------------------------ step
    def step(
        self,
        tensor: torch.Tensor | concurrent.futures.Future,
        *,
        weight: float,
        gather: Any = None,
        timeout_s: float | None = None,
        expected: Iterable[str] = (),
        label: str = "",
    ) -> tuple[torch.Tensor | None, RoundRecord, Group | None]:
        """Average ``tensor`` (1-D float32) with a group; see the class docstring. ``expected``: the peers this
        one believes to be the live members of the run (itself included); once all of them are looking (at
        least ``min_group_size``), the matchmaking window closes early: at once when nobody else is looking,
        else once that view is stable (the same in two reads 0.1 s apart).

        ``tensor`` may be a future of ``(tensor, weight)`` (then ``weight`` is ignored): the group forms now and
        the all-reduce starts once the future is set (an overlapped trainer matchmakes before its sync point);
        no group, or no tensor by the deadline (a cancelled future included), and the round has no result.
        ``label`` goes into this peer's signed statement of each part it sends (`PartStatement`)."""
        if isinstance(tensor, torch.Tensor):
            tensor = self._checked(tensor, weight)
        timeout_s = timeout_s if timeout_s is not None else self.config.round_timeout_s
        with self._step_lock:
            self._rounds += 1
            self._admission.expected = frozenset(expected)
            record = RoundRecord(round=self._rounds, label=label[:128])
            future = asyncio.run_coroutine_threadsafe(
                self._step(tensor, weight, gather, record, time.monotonic() + timeout_s), self._loop
            )
            self._current = future
            try:
                result, group = future.result(timeout=timeout_s + 10)
            except concurrent.futures.TimeoutError:
                future.cancel()
                record.fail(self.peer_id, "round", "deadline passed")
                result, group = None, None
            except concurrent.futures.CancelledError:
                record.fail(self.peer_id, "round", "interrupted")
                result, group = None, None
            finally:
                self._current = None
            return result, record, group

    def _checked(self, tensor: torch.Tensor, weight: float) -> torch.Tensor:
        if tensor.dim() != 1 or tensor.dtype != torch.float32:
            raise ValueError(f"expected a 1-D float32 tensor, got {tuple(tensor.shape)} {tensor.dtype}")
        if not (math.isfinite(weight) and 0 < weight <= self.config.max_weight):
            raise ValueError(f"weight must be in (0, {self.config.max_weight}], got {weight!r}")
        return tensor.detach().cpu().contiguous()

    @property
    def revised_slices(self) -> int:
        """Slices this peer reduced whose pieces went out before the survivors were agreed and then changed
        (a sender dropped or rejected after its first pieces were aggregated)."""
        return self._activity.revised

    def interrupt(self) -> None:
        """Abandon the round in progress (e.g. on Ctrl+C): ``step`` returns at once with no result.

        Safe to call from a signal handler or another thread."""
        current = self._current
        if current is not None:
            current.cancel()

    def vouch(self, peers: Iterable[str]) -> None:
        """``peers`` signed the sealed state this peer loaded: they count as peers with history when the
        guard is up (see averaging.membership), so a newcomer finds the run's core during a flood."""
        self._admission.prove(peers, own_round=False)

    def exclude(self, peer: str, reason: str) -> None:
        """Never draw, admit or wait for ``peer`` again (its work failed a check: swarm.work). Thread-safe: the
        set changes at once (one dict insertion, atomic under the GIL: a round that forms right after this call
        already sees it), and a leader drops a follower excluded after it joined (`_lead`)."""
        self._admission.excluded.setdefault(peer, reason)

    def require(self, policy: Callable[[str, Any], str | None]) -> None:
        """Admit to a group only members whose gathered metadata ``policy(peer, gathered)`` accepts (returns
        None), round by round. Checked by a leader on each join and by a follower on the final group, so no
        member averages with a refused one (swarm.work's ``require_verified``). Runs on the averager's loop."""
        self._loop.call_soon_threadsafe(setattr, self._admission, "policy", policy)

    @property
    def guard(self) -> Guard:
        """The Sybil guard's state (read-only use: ``active()``, ``raised``, ``proven``)."""
        return self._admission.guard

    def average_in_group(
        self, group: Group, tensor: torch.Tensor, *, weight: float, codec: str, timeout_s: float | None = None
    ) -> tuple[torch.Tensor | None, RoundRecord]:
        """A second all-reduce among the members of an already formed ``group`` (no matchmaking).

        Every member must call it with the same group and codec; used, e.g., to average a second
        tensor only when the group's gathered metadata shows it is needed.
        """
        timeout_s = timeout_s if timeout_s is not None else self.config.round_timeout_s
        sub = Group(group_id=_derive_id(group.group_id, ("again",)), members=group.members, gathered=group.gathered)
        with self._step_lock:
            record = RoundRecord(round=self._rounds)
            future = asyncio.run_coroutine_threadsafe(
                self._allreduce(
                    sub, tensor.detach().cpu().contiguous(), weight, record, time.monotonic() + timeout_s, codec
                ),
                self._loop,
            )
            try:
                result, _lost = future.result(timeout=timeout_s + 10)
            except concurrent.futures.TimeoutError:
                future.cancel()
                result = None
            record.outcome = "failed" if result is None else "ok"
            return result, record

    async def _step(
        self,
        tensor: torch.Tensor | concurrent.futures.Future,
        weight: float,
        gather: Any,
        record: RoundRecord,
        deadline: float,
    ) -> tuple[torch.Tensor | None, Group | None]:
        started = time.monotonic()
        group: Group | None = None
        self._activity.rounds += 1
        self._window.leader = None  # this round has drawn nothing yet
        try:
            lonely_windows = 0
            while group is None and time.monotonic() + self.config.matchmaking_time_s < deadline:
                # a peer that failed us this round is not drawn again, nor one that failed to join lately
                suspects = {f["peer"] for f in record.failures} | self._admission.suspects.active()
                group = await self._form_group(gather, record, deadline, suspects)
                lonely_windows = lonely_windows + 1 if group is None and self._window.lonely else 0
                if lonely_windows >= 2:  # nobody else has been looking for two whole windows: stop waiting
                    record.fail(self.peer_id, "matchmaking", "no other peer looking for a group")
                    break
            record.phase_s["matchmaking"] = time.monotonic() - started
            if group is None:
                return None, None
            if isinstance(tensor, concurrent.futures.Future):  # formed before this peer's sync point
                try:
                    tensor, weight = await asyncio.wait_for(
                        asyncio.wrap_future(tensor), max(0.0, deadline - time.monotonic())
                    )
                except (asyncio.TimeoutError, asyncio.CancelledError, concurrent.futures.CancelledError):
                    if asyncio.current_task().cancelling():
                        raise
                    record.fail(self.peer_id, "round", "no tensor: cancelled, or none by the deadline")
                    self._leave(group.group_id)
                    return None, None
                tensor = self._checked(tensor, weight)
                record.phase_s["ready"] = time.monotonic() - started
            result = None
            for attempt in range(self.config.max_attempts):
                record.attempts = attempt + 1
                result, lost = await self._allreduce(group, tensor, weight, record, deadline)
                if result is not None or time.monotonic() >= deadline:
                    break
                survivors = tuple(m for m in group.members if m not in lost)
                if len(survivors) < self.config.min_group_size:
                    break
                group = Group(
                    group_id=_derive_id(group.group_id, survivors),
                    members=survivors,
                    gathered={m: group.gathered.get(m) for m in survivors},
                )
            if result is not None:
                self._admission.prove(record.included)
                self._window.silent.heard(record.included)
                record.outcome = (
                    "retried"
                    if record.attempts > 1
                    else "ok"
                    if set(record.included) == set(group.members)
                    else "partial"
                )
            return result, group
        finally:
            self._activity.round_ended()
            record.phase_s["total"] = time.monotonic() - started
            for peer in {f["peer"] for f in record.failures if f["phase"] in ("send", "reduce", "gather")}:
                if peer != self.peer_id:
                    self._admission.suspects.add(peer)  # joined, then failed the all-reduce: not drawn for a while

    # ------------------------------------------------------------------------------------ matchmaking
    async def _form_group(self, gather: Any, record: RoundRecord, deadline: float, suspects: set[str]) -> Group | None:
        cfg = self.config
        key, in_my_shard = self._shard()
        self._window.key = key  # its leader stays the last draw's until this window draws (see `_Window.leader`)
        my_class = (self.region, bandwidth_class(self._bandwidth_mbps()))
        entry_lifetime_s = cfg.matchmaking_time_s + cfg.join_timeout_s
        expiration = get_dht_time() + entry_lifetime_s
        entry = self._entry(key, expiration)
        began = time.monotonic()
        await self._keep_silent_out_of_lookups()
        # done once one replica holds the entry (the rest are stored in the background): a replica cut off by
        # a partition costs the window hivemind's RPC timeout (3 s) once, not twice (chaos runs: 6.0 -> 3.0 s)
        await self.dht.store(
            key, entry, expiration_time=expiration, subkey=self.peer_id, return_future=True, await_all_replicas=False
        )
        # the gathering window; it closes early once exactly a full group is looking, or every live member
        # of the run this peer knows of, and that view is stable (what hivemind's leader does when its
        # group fills up); otherwise peers wait the whole window, so that everyone draws the groups from
        # the same list. Exactly the live members it knows of, and nobody else, close it at once: a second
        # read 0.1 s later would only catch a member it does not know of yet, which it would not wait for
        # either (a blocking round's last member to arrive, which read everyone at once, waited 0.1 s for it)
        window_end = time.monotonic() + cfg.matchmaking_time_s
        probe_at = time.monotonic() + min(_PROBE_WINDOW_AFTER_S, cfg.matchmaking_time_s / 2)
        probing: asyncio.Task | None = None
        previous: set[str] | None = None
        poll_s = 0.0  # read at once (the others may all be looking already), then every 0.1 s or when woken
        wakes = 0
        silent, unreachable = self._window.silent, self._window.unreachable
        opened, reads, slowest_read = time.monotonic(), 0, 0.0
        try:
            while True:
                wait_s = min(poll_s, max(0.0, window_end - time.monotonic()))
                if wait_s > 0 and wakes < _MAX_WAKES:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._window.wake.wait(), wait_s)
                        wakes += 1
                elif wait_s > 0:
                    await asyncio.sleep(wait_s)
                self._window.wake.clear()  # after the wait: a wake that comes during the read below counts
                poll_s = _WINDOW_POLL_S
                read_at = time.monotonic()
                found = await self._read_candidates(key, my_class, suspects)
                reads, slowest_read = reads + 1, max(slowest_read, time.monotonic() - read_at)
                # a member remembered as silent is not drawn while the entry it looks with may predate its
                # silence (a frozen member's last entry is read as looking for an entry's lifetime after it
                # froze: adversary runs of stop 58, it was drawn as a leader twice and each of its followers
                # waited a join timeout twice); it is probed as absent instead, and drawn again once it answers
                silent.seen_looking(found, entry_lifetime_s)
                # one that answered this window's probe is alive: drawn from here on like every live member, not
                # after the window (which waited its whole length for it, once, after a thaw or a wrong "silent")
                answers = probing.result() if probing is not None and probing.done() else {}
                silent.heard(p for p, how in answers.items() if how == "answered")
                candidates = {p: v for p, v in found.items() if p not in silent.since}
                looking = self._window.looking = set(candidates)
                unreachable.difference_update(found)  # a restarted member looks again: waited for as before
                # one that said it left is not waited for, nor one that looks on another key this epoch, nor
                # one that this or an earlier window's probe found unreachable (a killed or restarting member),
                # nor one silent to an earlier window's probe that has not answered this one (`_Window.silent`)
                live = {p for p in self._admission.live_expected() if in_my_shard(p)} - unreachable | {self.peer_id}
                absent = live - looking
                if probing is None and time.monotonic() >= probe_at and absent:
                    timeout_s = min(_PROBE_TIMEOUT_S, max(0.05, window_end - time.monotonic()))
                    probing = asyncio.create_task(self._probe_absent(absent, timeout_s))
                live -= {p for p, how in answers.items() if how == "failed"}
                live -= silent.peers()  # never in looking
                expected = live if len(live) >= cfg.min_group_size else None
                everyone = len(candidates) == cfg.target_group_size or (expected is not None and expected <= looking)
                exact = expected is not None and looking == expected
                full_and_stable = exact or (everyone and looking == previous)
                if full_and_stable or time.monotonic() >= window_end:
                    break
                previous = looking
            if probing is not None and not probing.done() and not full_and_stable:
                # its timeout ends with the window: the answers due now are waited for a moment, not dropped (a
                # frozen member's silence went unrecorded when the loop's last read ended first)
                await asyncio.wait({probing}, timeout=_PROBE_GRACE_S)
        finally:
            self._window.looking = set()  # outside a window, nudges are taken from live members only
            if probing is not None and not probing.done():
                probing.cancel()
        answers = probing.result() if probing is not None and probing.done() and not probing.cancelled() else {}
        logger.debug(
            "window of %.2f s (opened %.2f s after it began: the entry's store): %d read(s), slowest %.2f s;"
            " %d looking; probes %s",
            time.monotonic() - opened,
            opened - began,
            reads,
            slowest_read,
            len(candidates),
            {p[-6:]: how for p, how in answers.items()} if probing is None or probing.done() else "cut short",
        )
        members = self._admission.live_expected()
        unreachable.update(p for p, how in answers.items() if how == "failed")
        unreachable.intersection_update(members)
        new = silent.answered(answers)
        silent.keep_only(members)
        if new:
            logger.info(
                "%s silent to a probe in a matchmaking window: not waited for until it answers one",
                ", ".join(p[-6:] for p in sorted(new)),
            )
        if new or silent.back:
            await self._keep_silent_out_of_lookups()
        self._window.lonely = len(candidates) <= 1
        guard = self._admission.guard
        drawn = guard.core(candidates, self.peer_id)
        chunk = next(c for c in draw_groups(drawn, cfg.target_group_size, cfg.min_group_size) if self.peer_id in c)
        if len(chunk) < cfg.min_group_size:
            self._window.leader = self.peer_id  # a chunk of its own, too small: no other leader comes for it
            return None
        await self._fault("matchmaking", self.peer_id)
        guarded = drawn is not candidates  # drawn only from the peers with history (averaging.membership)
        leader = guard.leader(chunk, self.peer_id) if guarded else sorted(chunk)[0]
        self._window.leader = leader
        join_deadline = min(deadline, time.monotonic() + cfg.join_timeout_s)
        if leader == self.peer_id:
            slots = newcomer_slots(cfg.target_group_size) if guarded else 0
            newcomers = guard.knocked(set(candidates) - set(drawn), min(slots, cfg.target_group_size - len(chunk)))
            return await self._lead(frozenset(chunk) - {self.peer_id}, gather, record, join_deadline, newcomers)
        group = await self._follow(leader, gather, record, join_deadline)
        if group is not None and (no_shows := set(chunk) - set(group.members)):
            # drawn, and not in the group: its leader's lobby found it gone or silent, which only the leader
            # remembers. A probe of its own, off the round: a frozen member's last entry is read as looking, and
            # a follower that does not know it silent waits on its DHT node in the next window's store (6 s in
            # an adversary run of stop 58) while the leader, which knows, is already looking
            _POLLERS.add(probe := asyncio.create_task(self._probe_no_shows(no_shows)))
            probe.add_done_callback(_POLLERS.discard)
        return group

    async def _probe_no_shows(self, peers: set[str]) -> None:
        """Remember as silent (`_Silent`) those of ``peers`` (drawn into this follower's chunk, not in its group)
        that do not answer a probe; forget those that do."""
        with contextlib.suppress(Exception):  # best effort: a closing averager, a failed probe
            new = self._window.silent.answered(await self._probe_absent(peers, _PROBE_TIMEOUT_S))
            if new:
                logger.info(
                    "%s drawn, not in the group and silent to a probe: not waited for until it answers one",
                    ", ".join(p[-6:] for p in sorted(new)),
                )

    async def _keep_silent_out_of_lookups(self) -> None:
        """The members remembered as silent (`_Silent`) are left out of this peer's DHT lookups for a while: a
        lookup that reaches a frozen node waits hivemind's RPC timeout (3 s), each time its blacklisting runs
        out (measured: two such waits at different times on two peers cost them 8-15 s of failed matchmaking,
        twice in a minute). Those that showed signs of life since are let back at once: after a partition
        heals, each side could have the other left out for one more ban (hivemind doubles a ban on each
        repeat: 5, 10, 20 s...), and would not ask the other's DHT node meanwhile. Best effort, bounded."""
        silent = self._window.silent
        if not silent and not silent.back:
            return
        back, silent.back = silent.back, set()
        try:
            async with asyncio.timeout(_KEEP_OUT_TIMEOUT_S):
                if back:
                    await let_back_into_lookups(self.dht, back)
                if silent:
                    await keep_out_of_lookups(self.dht, silent.peers())
        except Exception as e:  # a DHT that is shutting down, or slow: the lookups wait as before
            logger.debug("could not update which members this peer's DHT lookups leave out: %r", e)

    def _shard(self) -> tuple[str, Callable[[str], bool]]:
        """This window's matchmaking key, and who else looks on it. The run's size is the larger of the
        caller's view of its live members (``expected``) and the members read from the DHT; peers that see
        sizes on either side of a power of two use different keys for a while (each set still groups)."""
        members = self._admission.members
        size = max(len(self._admission.live_expected() | {self.peer_id}), len(members.known) if members else 0)
        shards = shard_count(size, self.config.shard_size)
        epoch = shard_epoch(get_dht_time())
        shard = shard_of(self.peer_id, epoch, shards)
        return matchmaking_key(self.prefix, shards, shard), lambda peer: shard_of(peer, epoch, shards) == shard

    async def _read_candidates(self, key: str, my_class: tuple[str, int], suspects: set[str]) -> dict:
        found = await self.dht.get(key, latest=True, return_future=True)
        entries: dict[str, tuple[str, int]] = {}
        if found is not None and isinstance(found.value, dict):
            now = get_dht_time()
            for index, (subkey, item) in enumerate(found.value.items()):
                if index >= _MAX_ENTRIES_READ or len(entries) >= 4 * _MAX_MEMBERS:
                    self.rejected["candidates beyond the read limit"] += 1
                    break
                if subkey == self.peer_id:
                    await self._supersede_own_gone(key, item, now)
                    continue
                entry = self._parse_entry(key, subkey, item, now)
                if entry is not None and entry.gone:
                    self._admission.gone(subkey)
                elif entry is not None:
                    self._admission.looking(subkey)
                    entries[subkey] = (entry.region, entry.bandwidth_class)
        if self._admission.members is not None and entries:
            members = await self._admission.members.get(self.dht, set(entries))
            for peer in [p for p in entries if p not in members]:
                self.rejected["candidate not a run member"] += 1
                del entries[peer]
        candidates: dict[str, tuple[str, int]] = {self.peer_id: my_class}
        excluded = self._admission.excluded
        candidates.update(
            (peer, entry) for peer, entry in entries.items() if peer not in suspects and peer not in excluded
        )
        return candidates

    async def _supersede_own_gone(self, key: str, item: Any, now: float) -> None:
        """This peer's own "gone" entry, from before a restart (the same key, the same peer ID): it would hide
        this peer's entries until it expires (the DHT keeps the later expiry), so one with a later expiry
        replaces it now."""
        entry = self._parse_entry(key, self.peer_id, item, now)
        if entry is None or not entry.gone or self._left:
            return
        expiration = max(getattr(item, "expiration_time", now), now) + 0.5
        await self.dht.store(key, self._entry(key, expiration), expiration, subkey=self.peer_id, return_future=True)

    def _parse_entry(self, key: str, subkey: Any, item: Any, now: float) -> Entry | None:
        value = getattr(item, "value", None)
        if self._admission.identity is not None:
            try:
                return parse_entry(key, subkey, value, getattr(item, "expiration_time", math.inf), now)
            except EntryRejected as e:
                self.rejected[f"candidate {e.reason}"] += 1
                return None
        if (
            isinstance(subkey, str)
            and isinstance(value, dict)
            and isinstance(value.get("c"), int)
            and isinstance(value.get("r", ""), str)
        ):
            return Entry(value.get("r", "")[:64], value["c"], value.get("g") == 1)
        return None

    async def _lead(
        self, expected: frozenset, gather: Any, record: RoundRecord, join_deadline: float, newcomers: frozenset
    ) -> Group | None:
        """Wait for the chunk's followers until ``join_deadline``, then (guarded) a short grace for the
        ``newcomers`` that knocked lately, and answer everyone who joined with the final group."""
        lobby = _Lobby(expected=expected)
        lobby_id = self.peer_id
        self._lobbies[lobby_id] = lobby
        self._window.lobby_opened.set()
        self._window.lobby_opened = asyncio.Event()
        for follower in expected:  # still in their windows, between reads: they look again now, not at a tick
            _POLLERS.add(nudge := asyncio.create_task(self._nudge(follower, lobby)))
            nudge.add_done_callback(_POLLERS.discard)
        try:
            await self._wait_for_followers(lobby, join_deadline)
            staying = lobby.expected
            if newcomers - set(lobby.joined) and lobby.complete.is_set():
                lobby.complete.clear()
                lobby.expected = staying | newcomers
                grace = min(NEWCOMER_GRACE_S, join_deadline - time.monotonic())
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(lobby.complete.wait(), max(0.0, grace))
                lobby.expected = staying - lobby.quit
            del self._lobbies[lobby_id]
            for late in [m for m in lobby.joined if self._admission.refuses(m, lobby.joined[m]) == "excluded"]:
                del lobby.joined[late]  # excluded after it joined: it gets a group without it, and fails its round
                record.fail(late, "matchmaking", "excluded after it joined")
            followers = sorted(lobby.joined)[: self.config.target_group_size - 1]
            for absent in sorted(expected - set(lobby.joined)):
                if absent in lobby.quit:
                    record.fail(absent, "matchmaking", "its join stream closed before the group formed")
                elif absent in lobby.dead:
                    record.fail(absent, "matchmaking", "gone (a probe failed)")
                elif absent in lobby.silent:
                    record.fail(absent, "matchmaking", "silent to probes (frozen or cut off)")
                elif absent in lobby.elsewhere:  # live and honest: its view of the candidates differed
                    record.fail(absent, "matchmaking", "drew another leader")
                    continue
                elif absent in staying:
                    record.fail(absent, "matchmaking", "did not join its leader")
                else:
                    record.fail(absent, "matchmaking", "left the run")
                    continue
                self._admission.no_show(absent)  # drawn, and not there: a suspect for a while
            if len(followers) + 1 < self.config.min_group_size:
                lobby.final.set_result(None)
                return None
            members = tuple(sorted([self.peer_id, *followers]))
            gathered = {self.peer_id: gather, **{m: lobby.joined[m] for m in followers}}
            group = Group(
                group_id=_derive_id(self.peer_id + str(time.time()), members), members=members, gathered=gathered
            )
            lobby.final.set_result(group)
            return group
        finally:
            self._lobbies.pop(lobby_id, None)
            if not lobby.final.done():
                lobby.final.set_result(None)

    async def _wait_for_followers(self, lobby: _Lobby, join_deadline: float) -> None:
        """Until the chunk's followers have joined, or ``join_deadline``. A follower that says it left the run
        meanwhile (a "gone" entry: a clean leave) is not waited for: a poller reads the key every
        `_GONE_POLL_S` beside the wait (a slow read never delays the group). Nor is one that a probe finds
        gone (killed: its dial fails; restarted: it is in no round), nor one that answers that it drew another
        leader in this window (the views of the candidates differed): the followers not joined are asked
        `_PROBE_ABSENT_AFTER_S` in and again every `_REPROBE_S`. One that does not answer in time is still waited
        for (a loaded machine answers late)."""

        started = time.monotonic()
        probe_at = started + _PROBE_ABSENT_AFTER_S

        async def probe_the_absent() -> None:
            absent = sorted(lobby.expected - set(lobby.joined) - lobby.dead - lobby.elsewhere - lobby.silent)
            answers = dict(zip(absent, await asyncio.gather(*(self._ask_follower(p) for p in absent))))
            lobby.dead |= {p for p, answer in answers.items() if answer == "gone"}
            lobby.elsewhere |= {p for p, answer in answers.items() if answer == _ELSEWHERE}
            # silent once is no proof (a loaded machine answers late): it is waited for, and remembered
            lobby.silent |= {p for p, answer in answers.items() if answer == "silent"} & self._window.silent.peers()
            self._window.silent.answered(answers)

        async def drop_the_departed() -> None:
            nonlocal probe_at
            while not lobby.complete.is_set() and time.monotonic() < join_deadline:
                await asyncio.sleep(_GONE_POLL_S)
                if time.monotonic() >= probe_at:  # a killed follower fails its dial at once
                    with contextlib.suppress(Exception):
                        await probe_the_absent()
                    probe_at = time.monotonic() + _REPROBE_S
                with contextlib.suppress(Exception):  # a failed read: the next one, or the join deadline
                    await self._read_candidates(self._window.key, (self.region, 0), set())  # notes who is gone
                gone = lobby.expected & (self._admission.departed.keys() | lobby.dead | lobby.elsewhere | lobby.silent)
                if gone:
                    lobby.expect_no_more(gone)

        poller = asyncio.create_task(drop_the_departed())  # ends after its read in flight: DHT calls are not cut
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(lobby.complete.wait(), max(0.0, join_deadline - time.monotonic()))
        _POLLERS.add(poller)  # a reference until it ends (the loop keeps only weak ones)
        poller.add_done_callback(_POLLERS.discard)

    async def _follow(self, leader: str, gather: Any, record: RoundRecord, join_deadline: float) -> Group | None:
        try:
            async with asyncio.timeout(max(0.1, join_deadline - time.monotonic() + 1.0)):
                _, reader, writer = await self._open(leader)
                try:
                    record.bytes_sent += await write_frame(writer, {"op": "join", "gather": gather})
                    await self._fault("joined", self.peer_id)
                    reply = await read_frame(reader, max_header_bytes=_MAX_HEADER_BYTES)
                finally:
                    writer.close()
        except (asyncio.TimeoutError, ProtocolError, OSError, Exception) as e:
            if self._dead:
                raise  # fault injection: this peer crashed after it joined
            record.fail(leader, "matchmaking", f"join failed: {e!r}"[:200])
            self._admission.no_show(leader)  # a leader that does not answer costs us its join timeout once
            if isinstance(e, TimeoutError) and self._window.silent.fell_silent([leader]):
                # no answer, not even "not leading", within the join timeout: frozen or cut off, with its last
                # entry still read as looking. Remembered as silent, it is left out of this peer's DHT lookups
                # from the next window on (adversary run of stop 58: that window's store of the entry waited on
                # its DHT node for 6 s), and forgotten once it shows signs of life (`_Silent`)
                logger.info("%s silent to a join: not waited for until it answers a probe", leader[-6:])
            return None
        if reply.get("status") != "ok":
            record.fail(leader, "matchmaking", f"leader said {str(reply.get('status'))[:50]}")
            return None
        await self._fault("grouped", leader)
        try:
            members = tuple(header_field(reply, "members", list))
            gathered = header_field(reply, "gathered", dict)
            group_id = header_field(reply, "group_id", str)
            if not (
                2 <= len(members) <= _MAX_MEMBERS
                and self.peer_id in members
                and leader in members
                and all(isinstance(m, str) for m in members)
                and len(set(members)) == len(members)
            ):
                raise ProtocolError("bad group", "membership")
        except ProtocolError as e:
            self.rejected[e.reason] += 1
            record.fail(leader, "matchmaking", str(e))
            return None
        excluded = [m for m in members if m != self.peer_id and self._admission.refuses(m, gathered.get(m))]
        if excluded:  # the leader has not excluded it (yet): this peer does not average with it
            self.rejected["group with an excluded peer"] += 1
            record.fail(excluded[0], "matchmaking", "an excluded peer is in the group")
            self._leave(group_id)  # the others' parts and probes hear so at once: no waiting
            return None
        return Group(group_id=group_id, members=members, gathered=gathered)

    async def _refused_join(
        self, peer: str, header: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer a join that this peer's admission refuses (excluded, or the policy), and count it."""
        refused = self._admission.refuses(peer, header.get("gather"))
        if refused is None:
            return False
        self.rejected["join from an excluded peer" if refused == "excluded" else "join refused by policy"] += 1
        await _answer(reader, writer, refused)
        return True

    async def _serve_join(
        self, peer: str, header: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if await self._refused_join(peer, header, reader, writer):
            return
        if self._admission.members is not None and peer not in await self._admission.members.get(
            self.dht, {peer}, min_age_s=JOIN_MIN_REFRESH_S
        ):
            self.rejected["join from a non-member"] += 1
            await _answer(reader, writer, "not a member")
            return
        self._admission.suspects.clear(peer)  # it is live and looking: a no-show of an earlier window, not a Sybil
        lobby = None
        deadline = time.monotonic() + self.config.join_timeout_s
        while lobby is None and time.monotonic() < deadline:  # the leader may still be in its window
            lobby = self._lobbies.get(self.peer_id)
            if lobby is None:
                self._window.wake.set()  # a follower that closed its window: this one reads the key again now
                opened = self._window.lobby_opened
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(opened.wait(), max(0.0, min(0.05, deadline - time.monotonic())))
        if await self._refused_join(peer, header, reader, writer):  # again: it may have been excluded while it waited
            return
        guard = self._admission.guard
        if lobby is None or lobby.final.done() or len(lobby.joined) >= self.config.target_group_size - 1:
            if guard.active():
                guard.knock(peer)  # live, and too late for this lobby: the next one waits a moment for it
            await _answer(reader, writer, "not leading")
            return
        if guard.active() and peer not in guard.proven:
            newcomers = sum(1 for p in lobby.joined if p not in guard.proven)
            if newcomers >= newcomer_slots(self.config.target_group_size):
                self.rejected["join beyond the newcomer slots"] += 1
                await _answer(reader, writer, "no newcomer slot")
                return
        lobby.joined[peer] = header.get("gather")
        lobby.update()
        # a follower sends nothing after its join: the stream's end (a kill, or it gave up) drops it from the group
        closed = asyncio.create_task(_until_closed(reader))
        closed.add_done_callback(lambda task: task.cancelled() or lobby.leave(peer))
        try:
            group = await asyncio.wait_for(asyncio.shield(lobby.final), self.config.join_timeout_s + 1)
        except asyncio.TimeoutError:
            lobby.leave(peer)  # it will hear nothing from this stream: a group formed later must not count it
            raise
        finally:
            closed.cancel()
        if group is None or peer not in group.members:
            await _answer(reader, writer, "not admitted")
            return
        # the group counts this follower now: closing at once could lose the reply in p2pd, and the follower,
        # hearing nothing, would not come (seen in a 3-peer run under load: "join failed: truncated")
        await _answer(
            reader, writer, "ok", group_id=group.group_id, members=list(group.members), gathered=group.gathered
        )

    # ------------------------------------------------------------------------------------ all-reduce
    async def _allreduce(
        self,
        group: Group,
        tensor: torch.Tensor,
        weight: float,
        record: RoundRecord,
        deadline: float,
        codec: str | None = None,
    ) -> tuple[torch.Tensor | None, set[str]]:
        """One attempt; returns (result, lost) where lost names reducers whose slice never came back."""
        cfg = self.config
        started = time.monotonic()
        record.group_id, record.members = group.group_id, list(group.members)
        bounds = slice_bounds(tensor.numel(), len(group.members))
        my_index = group.members.index(self.peer_id)
        lo, hi = bounds[my_index]
        codec = codec or cfg.codec
        state = _ReduceState(
            group=group,
            my_index=my_index,
            numel=hi - lo,
            weight=weight,
            codec=codec,
            sender_deadline=min(deadline, started + cfg.sender_timeout_s),
            started=started,
            pieces=_Pieces(piece_bounds(hi - lo, cfg.piece_numel), lo=lo),
        )
        own = tensor[lo:hi].clone()
        for (a, b), received in zip(state.pieces.bounds, state.pieces.received):
            received[self.peer_id] = own[a:b]
        state.pieces.weights[self.peer_id] = weight
        state.parts.add(self.peer_id)
        self._states[group.group_id] = state
        self._wake_part_waiters()
        self._activity.rounds += 1
        watch = asyncio.create_task(self._watch_silence(state))
        try:
            reduce_task = asyncio.create_task(self._reduce(state, record))
            send_tasks = {
                peer: asyncio.create_task(
                    state.unless_dead(
                        peer,
                        self._send_part(
                            peer,
                            state,
                            i,
                            a,
                            tensor[a:b],
                            weight,
                            record,
                            min(deadline, started + cfg.reducer_timeout_s),
                            codec,
                        ),
                    )
                )
                for i, (peer, (a, b)) in enumerate(zip(group.members, bounds))
                if peer != self.peer_id
            }
            own = await reduce_task
            record.phase_s["reduced"] = time.monotonic() - started
            slices: dict[str, torch.Tensor | None] = {self.peer_id: own}
            unheard = state.unheard()
            for peer, task in send_tasks.items():
                if peer in unheard and not task.done():
                    # its slice would come after everyone's deadline, if at all: the others retry now instead
                    task.cancel()
                    await asyncio.wait([task])
                    record.fail(peer, "reduce", "given up: no reducer had its part and its list of senders never came")
                    slices[peer] = None
                else:
                    slices[peer] = await task
            lost = {peer for peer, value in slices.items() if value is None}
            record.phase_s["allreduce"] = time.monotonic() - started
            record.parts = {
                peer: {
                    "sha256": state.pieces.digests[peer],
                    "weight": state.pieces.weights[peer],
                    **state.pieces.signed[peer],
                }
                for peer in record.included
                if peer in state.pieces.digests
            }
            record.own_slice, record.codec, record.piece_numel = (lo, hi), codec, cfg.piece_numel
            if lost:
                for peer in lost - unheard:
                    reason = "given up: silent" if peer in state.silent else "its slice was not completed"
                    record.fail(peer, "reduce", reason)
                return None, lost
            return torch.cat([slices[m] for m in group.members]), set()
        finally:
            watch.cancel()
            self._activity.round_ended()
            self._states.pop(group.group_id, None)
            state.pieces.give_up_tentative()
            if not state.result.done():
                state.result.set_result(None)

    async def _watch_silence(self, state: _ReduceState) -> None:
        """Give up on a member that fell silent in the attempt (frozen, suspended, cut off without a reset: its
        streams hang rather than fail), not at the deadlines. A member that owes this peer something
        (`_ReduceState.owes`) and from which nothing came for a quarter of the sender timeout (at least
        `_QUIET_MIN_S`) is probed; any answer, or anything else from it meanwhile, and it is waited for as
        before (a straggler, or slow); a failed dial marks it dead, as after a broken stream; no answer to
        two probes in a row (`_PROBE_TIMEOUT_S` each) marks it dead and silent, remembered for the next
        windows (`_Silent`). Measured before (chaos run, a 25 s partition 0.3 s into a round of 4): the
        other 3 waited 14-16 s (sender, agreement and reducer deadlines) and grouped no round in the cut."""
        quiet_s = max(_QUIET_MIN_S, self.config.sender_timeout_s / 4)
        strikes: Counter = Counter()
        while True:
            await asyncio.sleep(_QUIET_POLL_S)
            now = time.monotonic()
            quiet = [
                m for m in state.group.members if state.owes(m) and now - state.heard.get(m, state.started) > quiet_s
            ]
            if not quiet:
                continue
            asked = time.monotonic()
            answers = await asyncio.gather(
                *(self._probe_answer(m, state.group.group_id, _PROBE_TIMEOUT_S) for m in quiet)
            )
            for peer, (how, _) in zip(quiet, answers):
                if peer in state.dead:
                    continue
                if how == "answered" or state.heard.get(peer, -math.inf) >= asked:
                    strikes.pop(peer, None)
                    state.heard_from(peer)
                elif how == "failed":
                    state.mark_dead(peer)
                else:
                    strikes[peer] += 1
                    if strikes[peer] < 2:
                        continue
                    state.silent.add(peer)
                    state.mark_dead(peer)
                    if self._window.silent.fell_silent([peer]):
                        logger.info("%s silent in an all-reduce: given up, not waited for until it answers", peer[-6:])

    async def _reduce(self, state: _ReduceState, record: RoundRecord) -> torch.Tensor | None:
        """Collect the parts of my slice, aggregating and sending back each piece as soon as every member's
        piece came; agree on the survivors with the other reducers; confirm those pieces, or send the
        survivors' aggregate instead (see the module docstring)."""
        expected = set(state.group.members)
        await self._reduce_tentatively(state)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(state.all_parts.wait(), max(0.0, state.sender_deadline - time.monotonic()))
        record.phase_s["parts"] = time.monotonic() - state.started
        # when the others sent, against this attempt's start: how far ahead of them this member is (ahead > 0)
        offsets = [0.0] + [t - state.started for t in state.arrivals.values()]
        record.phase_s["last_sender"] = max(offsets)
        record.phase_s["mean_sender"] = sum(offsets) / len(offsets)
        for missing in expected - state.parts:
            reason = (
                "silent (nothing came, then no answer to two probes)"
                if missing in state.silent
                else "gone (a broken stream, then a probe)"
                if missing in state.dead
                else "no part before the sender deadline"
            )
            record.fail(missing, "send", reason)
        started = time.monotonic()
        mine = frozenset(state.parts)
        state.received_sets[self.peer_id] = mine
        await self._fault("agree", self.peer_id)
        others = [m for m in state.group.members if m != self.peer_id]
        await asyncio.gather(*(state.unless_dead(peer, self._send_received_set(peer, state, mine)) for peer in others))
        state.update()
        # a reducer that already has every part must still wait for those that wait out the sender
        # deadline; a reducer whose list never comes is dead, and its slice is lost anyway
        agreement_deadline = state.sender_deadline + self.config.agreement_timeout_s
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(state.all_sets.wait(), max(0.0, agreement_deadline - time.monotonic()))
        survivors = frozenset.intersection(*state.received_sets.values())
        logger.debug(
            "%s group %s: received sets %s",
            self.peer_id[-6:],
            state.group.group_id[:6],
            {k[-6:]: sorted(x[-6:] for x in v) for k, v in state.received_sets.items()},
        )
        record.phase_s["agreement"] = time.monotonic() - started
        await self._fault("reduce", self.peer_id)
        pieces = state.pieces
        tentative = [future.result() for future in pieces.tentative]  # all done: _reduce_tentatively gave up the rest
        if None not in tentative and survivors == expected:
            pieces.final, pieces.confirmed = tentative, True
            included, rejected = sorted(survivors), {}
        else:
            if tentative[0] is not None:
                self._activity.revised += 1  # members hold pieces that are not the survivors' aggregate
            try:
                included, rejected, pieces.final = await asyncio.to_thread(
                    self._aggregate_slice, state, sorted(survivors)
                )
            except ValueError as e:
                record.fail(self.peer_id, "reduce", f"nothing to aggregate: {e}")
                state.result.set_result(None)
                return None
        record.included = included
        for sender, reason in rejected.items():
            record.rejected[sender] = reason
            self.rejected[reason] += 1
        state.result.set_result(included)
        # the reducer's own copy is decoded from the bytes every member gets, so that with a lossy codec the
        # members' results (and checkpoints) are the same
        codec = get_codec(state.codec)

        def decoded() -> torch.Tensor:
            return torch.cat([codec.decode(data, numel=b - a) for data, (a, b) in zip(pieces.final, pieces.bounds)])

        return await asyncio.to_thread(decoded)

    async def _reduce_tentatively(self, state: _ReduceState) -> None:
        """Aggregate every member's pieces in order as they come, each encoded for the members at once (they
        hold it until the survivors are agreed); stop at the first piece a member misses by the sender deadline
        or whose aggregate rejects a sender. On return every ``pieces.tentative`` is done (None from there)."""
        pieces, members = state.pieces, sorted(state.group.members)
        try:
            for k, ready in enumerate(pieces.ready):
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(ready.wait(), max(0.0, state.sender_deadline - time.monotonic()))
                if state.dead or not set(pieces.received[k]) >= set(members):
                    break
                result, data = await asyncio.to_thread(self._aggregate_piece, state, k, members)
                if result.rejected:
                    break
                pieces.tentative[k].set_result(data)
        finally:
            pieces.give_up_tentative()

    def _aggregate_piece(self, state: _ReduceState, k: int, senders: list[str]) -> tuple[AggregationResult, bytes]:
        """Piece ``k`` aggregated from ``senders`` (validated), and encoded; runs in a worker thread."""
        a, b = state.pieces.bounds[k]
        contributions = [
            Contribution(sender=s, tensor=state.pieces.received[k][s], weight=state.pieces.weights[s]) for s in senders
        ]
        result = aggregate(
            contributions,
            numel=b - a,
            aggregator=self.config.aggregator,
            max_weight=self.config.max_weight,
            max_weight_ratio=self.config.max_weight_ratio,
        )
        return result, get_codec(state.codec).encode(result.tensor.contiguous())

    def _aggregate_slice(
        self, state: _ReduceState, survivors: list[str]
    ) -> tuple[list[str], dict[str, str], list[bytes]]:
        """The survivors' aggregate, piece by piece, encoded: (included, rejected with reasons, pieces). A sender
        with an invalid piece is rejected from every piece. Raises ValueError when nobody is left. Runs in a
        worker thread."""
        rejected: dict[str, str] = {}
        for s in survivors:
            for k, (a, b) in enumerate(state.pieces.bounds):
                contribution = Contribution(
                    sender=s, tensor=state.pieces.received[k][s], weight=state.pieces.weights[s]
                )
                reason = validate_contribution(contribution, numel=b - a, max_weight=self.config.max_weight)
                if reason is not None:
                    rejected[s] = reason
                    break
        accepted = [s for s in survivors if s not in rejected]
        if not accepted:
            raise ValueError(f"no valid contribution out of {len(survivors)}; rejected: {rejected}")
        encoded = [self._aggregate_piece(state, k, accepted)[1] for k in range(len(state.pieces.bounds))]
        return accepted, rejected, encoded

    async def _send_received_set(self, peer: str, state: _ReduceState, received: frozenset) -> None:
        """Tell ``peer`` which senders' parts this reducer took; retried until acknowledged, within the
        agreement timeout (a list lost on a reset stream would make that reducer wait out its deadline)."""
        deadline = time.monotonic() + self.config.agreement_timeout_s
        while time.monotonic() < deadline and peer not in state.dead:
            try:
                async with asyncio.timeout(max(0.05, deadline - time.monotonic())):
                    _, reader, writer = await self._open(peer)
                    try:
                        await write_frame(
                            writer, {"op": "received", "group_id": state.group.group_id, "senders": sorted(received)}
                        )
                        if (await read_frame(reader, max_header_bytes=_MAX_HEADER_BYTES)).get("status") == "ok":
                            return
                    finally:
                        writer.close()
            except asyncio.TimeoutError:
                return
            except Exception as e:  # a reset or refused stream: try again while time is left
                logger.debug("received-set to %s failed: %r", peer[-6:], e)
            await asyncio.sleep(0.05)  # a short pause before retrying a failed stream, not a synchronisation

    async def _send_part(
        self,
        peer: str,
        state: _ReduceState,
        index: int,
        lo: int,
        part: torch.Tensor,
        weight: float,
        record: RoundRecord,
        reply_deadline: float,
        codec_name: str,
    ) -> torch.Tensor | None:
        """Stream my part of ``peer``'s slice piece by piece and read its aggregate back on the same stream,
        both at once: (piece)* [revised (piece)*] final (see the module docstring). ``state``: the attempt's
        (what went to and came from ``peer``, for `_watch_silence`)."""
        group = state.group
        codec = get_codec(codec_name)
        bounds = piece_bounds(part.numel(), self.config.piece_numel)
        header = {
            "op": "part",
            "group_id": group.group_id,
            "index": index,
            "lo": lo,
            "numel": part.numel(),
            "weight": weight,
            "codec": codec_name,
            "pieces": len(bounds),
            "payload_bytes": sum(wire_bytes(codec, b - a) for a, b in bounds),
        }
        tasks: list[asyncio.Task] = []

        async def write() -> None:
            await self._write_pieces(writer, header, part, bounds, codec, record, peer)
            state.sent.add(peer)

        try:
            async with asyncio.timeout(max(0.1, reply_deadline - time.monotonic())):
                await self._fault("send", peer)
                _, reader, writer = await self._open(peer)
                try:
                    tasks = [
                        asyncio.create_task(write()),
                        asyncio.create_task(
                            self._read_pieces(
                                reader, part.numel(), bounds, codec, record, lambda: state.heard_from(peer)
                            )
                        ),
                    ]
                    await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                    if tasks[0].done() and tasks[0].exception() is not None:
                        raise tasks[0].exception()
                    slice_ = await tasks[1]
                    state.replied.add(peer)
                    return slice_
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    writer.close()
        except (ProtocolError, ValueError) as e:
            self.rejected[getattr(e, "reason", "bad slice")] += 1
            record.fail(peer, "gather", str(e)[:200])
        except asyncio.TimeoutError:
            record.fail(peer, "gather", "TimeoutError: no slice before the reducer deadline")
            return None
        except Exception as e:  # resets, unreachable peers
            record.fail(peer, "gather", f"{type(e).__name__}: {e}"[:200])
        await self._probe_after_failure(peer, group.group_id, reply_deadline)
        return None

    async def _write_pieces(
        self,
        writer: asyncio.StreamWriter,
        header: dict,
        part: torch.Tensor,
        bounds: list[tuple[int, int]],
        codec: Any,
        record: RoundRecord,
        peer: str,
    ) -> None:
        """The part's header, then its pieces in order, each encoded and hashed (off the event loop) while the last
        drains, then the signed statement of what went (`PartStatement`; unsigned without an identity)."""
        record.bytes_sent += await write_frame(writer, header)
        digest = hashlib.sha256()
        for k, (a, b) in enumerate(bounds):
            if k:
                await self._fault("piece", peer)
            payload = await asyncio.to_thread(_hashed_encode, codec, part[a:b], digest)
            writer.write(payload)
            await writer.drain()
            record.bytes_sent += len(payload)
        statement = part_statement(
            group_id=header["group_id"],
            index=header["index"],
            lo=header["lo"],
            hi=header["lo"] + part.numel(),
            codec=header["codec"],
            piece_numel=self.config.piece_numel,
            weight=header["weight"],
            sha256=digest.hexdigest(),
            label=record.label,
        )
        identity = self._admission.identity
        signature = sign_part(identity, self.prefix, statement) if identity is not None else ""
        trailer = {"op": "signed", "statement": statement.to_dict(), "signature": signature}
        record.bytes_sent += await write_frame(writer, trailer)

    async def _read_pieces(
        self,
        reader: asyncio.StreamReader,
        numel: int,
        bounds: list[tuple[int, int]],
        codec: Any,
        record: RoundRecord,
        heard: Callable[[], None] = lambda: None,
    ) -> torch.Tensor:
        """The reducer's aggregate of the slice: its pieces in order, once more after a ``revised`` frame (the
        survivors' aggregate replacing what came before it), taken when ``final`` comes after the last piece.
        ``heard`` is called on each frame."""
        out = torch.empty(numel, dtype=torch.float32)
        got, revised = 0, False
        while True:
            frame = await read_frame(reader, max_header_bytes=_MAX_HEADER_BYTES)
            heard()
            status = frame.get("status")
            if status == "piece":
                if header_field(frame, "k", int, low=0, high=len(bounds) - 1) != got:
                    raise ProtocolError("bad reply", f"piece {frame.get('k')} where {got} was due")
                a, b = bounds[got]
                size = header_field(frame, "payload_bytes", int, low=0, high=2**31)
                if size != wire_bytes(codec, b - a):
                    raise ProtocolError("bad size", f"{size} bytes")
                data = await read_exactly(reader, size)
                record.bytes_received += size
                out[a:b] = await asyncio.to_thread(codec.decode, data, numel=b - a)
                got += 1
            elif status == "revised" and not revised:
                got, revised = 0, True
            elif status == "final" and got == len(bounds):
                return out
            else:
                raise ProtocolError("refused", str(status)[:100])

    async def _probe_after_failure(self, peer: str, group_id: str, deadline: float) -> None:
        """A stream to ``peer`` broke or was refused: if a probe finds it gone, it is marked dead in this
        attempt's state, so that nobody waits out a deadline for its part or its list of senders."""
        state = self._states.get(group_id)
        if state is None or peer in state.dead:
            return
        if not await self._probe(peer, group_id, min(_PROBE_TIMEOUT_S, deadline - time.monotonic())):
            state.mark_dead(peer)

    async def _ask(self, peer: str, header: dict, timeout_s: float) -> dict:
        """``peer``'s answer to a one-frame request on a fresh stream; raises what the dial, the stream or the
        ``timeout_s`` deadline raised."""
        async with asyncio.timeout(timeout_s):
            _, reader, writer = await self._open(peer)
            try:
                await write_frame(writer, header)
                return await read_frame(reader, max_header_bytes=_MAX_HEADER_BYTES)
            finally:
                writer.close()

    async def _ask_probe(self, peer: str, group_id: str, timeout_s: float, *, lobby: bool = False) -> dict:
        """``peer``'s answer to a probe for ``group_id`` (``lobby``: asked by a leader that drew it, which it may
        answer `_ELSEWHERE`); raises as `_ask`."""
        header = {"op": "probe", "group_id": group_id, **({"lobby": True} if lobby else {})}
        return await self._ask(peer, header, max(0.05, timeout_s))

    async def _probe_answer(
        self, peer: str, group_id: str, timeout_s: float, *, lobby: bool = False
    ) -> tuple[str, str | None]:
        """How ``peer`` met a probe (`_ask_probe`): ("answered", its status), ("silent", None) when no answer came
        within ``timeout_s`` (a loaded machine answers late: no proof of death), or ("failed", None) when the
        dial or the stream failed (killed, crashed, or restarted with no averaging handler yet). Every probe
        judges a peer from this one answer."""
        try:
            reply = await self._ask_probe(peer, group_id, timeout_s, lobby=lobby)
        except TimeoutError:
            logger.debug("probe of %s: no answer within %.1f s", peer[-6:], timeout_s)
            return "silent", None
        except Exception as e:  # a dial that fails, no averaging handler, a reset
            logger.debug("probe of %s failed: %r", peer[-6:], e)
            return "failed", None
        return "answered", reply.get("status")

    async def _probe(self, peer: str, group_id: str, timeout_s: float) -> bool:
        """Whether ``peer`` still takes part in ``group_id``'s attempt. False for a killed peer (the dial
        fails), a restarted one (it is in no round), and one silent for ``timeout_s`` (its stream to this peer
        already broke)."""
        return await self._probe_answer(peer, group_id, timeout_s) == ("answered", "ok")

    async def _ask_follower(self, peer: str) -> str:
        """A leader's probe of an expected follower that has not joined: "gone" (its dial fails, or it is in no
        round: killed or restarted), `_ELSEWHERE` (it drew another leader in this window), "alive" (it is coming,
        or has not drawn yet) or "silent" (no answer within `_PROBE_TIMEOUT_S`: a loaded machine answers late,
        which is no proof of death)."""
        how, status = await self._probe_answer(peer, "", _PROBE_TIMEOUT_S, lobby=True)
        if how == "silent":
            return "silent"
        if status == "ok":
            return "alive"
        return _ELSEWHERE if status == _ELSEWHERE else "gone"

    async def _nudge(self, peer: str, lobby: _Lobby) -> None:
        """Tell ``peer`` (drawn into ``lobby``) to read its window's key again now, unless it joined meanwhile
        (the joins that waited for the lobby register first); best effort."""
        await asyncio.sleep(0)
        if peer in lobby.joined or lobby.final.done():
            return
        with contextlib.suppress(Exception):
            await self._ask(peer, {"op": "nudge"}, _NUDGE_TIMEOUT_S)

    async def _probe_absent(self, peers: set[str], timeout_s: float) -> dict[str, str]:
        """How each of ``peers`` met a window's probe: "failed" when it cannot take part now (a probe's dial or
        stream failed: killed, crashed, or restarted and its averager not up yet; or it answered that it is
        loading state), "silent" when no answer came within ``timeout_s`` (slow is no proof of death),
        "answered" otherwise."""

        async def outcome(peer: str) -> str:
            how, status = await self._probe_answer(peer, "", timeout_s)
            return "failed" if how == "failed" or status == _LOADING else how

        ordered = sorted(peers)
        return dict(zip(ordered, await asyncio.gather(*(outcome(peer) for peer in ordered))))

    async def _open(self, peer: str) -> Any:
        if self._dead:
            raise ConnectionError("this peer has crashed (fault injection)")
        return await self._p2p.call_binary_stream_handler(PeerID.from_base58(peer), self._handler_name)

    # ------------------------------------------------------------------------------------ server side
    async def _handle_stream(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(info.peer_id)
        if self._dead:
            writer.close()
            return
        try:
            header = await asyncio.wait_for(
                read_frame(reader, max_header_bytes=_MAX_HEADER_BYTES), self.config.sender_timeout_s
            )
            op = header.get("op")
            if op == "join":
                await self._serve_join(peer, header, reader, writer)
            elif op == "part":
                self._activity.serves += 1
                try:
                    await self._serve_part(peer, header, reader, writer)
                finally:
                    self._activity.serves -= 1
            elif op == "probe":
                group_id = header_field(header, "group_id", str)  # a state exists only while in a round
                taking_part = self._in_a_round() and group_id not in self._activity.left_groups
                idle = _LOADING if self._activity.loading and not group_id else "unknown group"
                drawn_by = self._window.leader  # a leader that drew this peer asks whether it will come
                elsewhere = header.get("lobby") is True and not group_id and drawn_by not in (None, peer)
                status = (_ELSEWHERE if elsewhere else "ok") if taking_part else idle
                await _answer(reader, writer, status)
            elif op == "received":
                await self._serve_received(peer, header)
                await _answer(reader, writer, "ok")
            elif op == "nudge":
                if peer in self._window.looking or peer in self._admission.live_expected():
                    self._window.wake.set()
                    await _answer(reader, writer, "ok")
                else:  # a stranger could make this peer read the DHT over and over
                    self.rejected["nudge from a peer not looking"] += 1
                    await _answer(reader, writer, "not looking")
            else:
                raise ProtocolError("unknown op", str(op)[:30])
        except ProtocolError as e:
            self.rejected[e.reason] += 1
            logger.info("rejected a stream from %s: %s", peer, e)
            with contextlib.suppress(Exception):
                await write_frame(writer, {"status": e.reason})
        except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError) as e:
            logger.debug("stream from %s ended: %r", peer, e)
        except asyncio.CancelledError:
            # shutting down: hivemind's stream callback would log a cancelled handler as an error
            logger.debug("stream from %s cancelled at shutdown", peer)
        except Exception as e:  # never let a peer's bytes crash the server
            self.rejected["internal error"] += 1
            logger.warning("error while serving %s: %r", peer, e)
        finally:
            writer.close()

    def _in_a_round(self) -> bool:
        """In a round, or lately: a group of it may still come (the second all-reduce of `average_in_group`
        starts after `step` returned). A peer restarted since is in none, and says so at once."""
        return self._activity.in_a_round(grace_s=self.config.sender_timeout_s + self.config.agreement_timeout_s)

    def _wake_part_waiters(self) -> None:
        """Parts and lists of senders that came before their group's state (`_find_state`) look again."""
        self._state_added.set()
        self._state_added = asyncio.Event()

    def _leave(self, group_id: str) -> None:
        """This peer takes no part in ``group_id``: its parts and probes are told so at once, those already waiting
        for its state included. CI of stop 52: a follower that declined a group (an excluded member) after the
        leader's part had come left that part waiting out the sender and agreement deadlines, so the others'
        retry went past the reducer deadline."""
        self._activity.left_groups.append(group_id)
        self._wake_part_waiters()

    async def _find_state(self, group_id: str) -> _ReduceState:
        # a peer may start an attempt (or a retry) while this one is still finishing the previous one
        deadline = time.monotonic() + self.config.sender_timeout_s + self.config.agreement_timeout_s
        while (state := self._states.get(group_id)) is None:  # the part may race our own matchmaking
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._in_a_round() or group_id in self._activity.left_groups:  # restarted, left
                raise ProtocolError("unknown group", group_id[:20])
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._state_added.wait(), remaining)
        return state

    async def _serve_received(self, peer: str, header: dict) -> None:
        state = await self._find_state(header_field(header, "group_id", str))
        senders = header_field(header, "senders", list)
        if peer not in state.group.members or not all(isinstance(s, str) for s in senders):
            raise ProtocolError("not a member", peer)
        state.received_sets[peer] = frozenset(senders) & frozenset(state.group.members)
        state.heard_from(peer)
        state.update()

    async def _serve_part(
        self, peer: str, header: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        arrived = time.monotonic()  # the sender's part is on its way (this peer's own attempt may start later)
        state = await self._find_state(header_field(header, "group_id", str))
        if peer not in state.group.members:
            raise ProtocolError("not a member", peer)
        if header_field(header, "index", int) != state.my_index or header_field(header, "numel", int) != state.numel:
            raise ProtocolError("wrong slice", f"index {header.get('index')}, numel {header.get('numel')}")
        if header.get("codec") != state.codec:
            raise ProtocolError("wrong codec", str(header.get("codec"))[:20])
        pieces, codec = state.pieces, get_codec(state.codec)
        if header_field(header, "pieces", int, low=1, high=_MAX_PIECES) != len(pieces.bounds):
            raise ProtocolError("wrong pieces", f"{header.get('pieces')} pieces, expected {len(pieces.bounds)}")
        weight = header.get("weight")
        if not isinstance(weight, (int, float)) or isinstance(weight, bool):
            raise ProtocolError("malformed header", "weight")
        try:
            weight = float(weight)
        except OverflowError:  # an int beyond float range (NaN, inf and 1e30 are the aggregator's to reject)
            raise ProtocolError("malformed header", "weight out of float range") from None
        size = header_field(header, "payload_bytes", int, low=0, high=2**31)
        if size != sum(wire_bytes(codec, b - a) for a, b in pieces.bounds):
            raise ProtocolError("bad size", f"{size} bytes")
        if peer in state.arrivals or peer in state.parts:
            raise ProtocolError("duplicate part", peer)
        state.arrivals[peer] = arrived
        state.heard_from(peer)
        pieces.weights[peer] = weight
        replying = asyncio.create_task(self._reply(state, writer))
        digest = hashlib.sha256()
        try:
            for k, (a, b) in enumerate(pieces.bounds):
                payload = await asyncio.wait_for(
                    read_exactly(reader, wire_bytes(codec, b - a)), max(0.01, state.sender_deadline - time.monotonic())
                )
                try:  # hashed and decoded off the event loop, in order
                    piece = await asyncio.to_thread(_hashed_decode, codec, payload, b - a, digest)
                except ValueError as e:
                    raise ProtocolError("undecodable part", str(e)[:100]) from None
                if time.monotonic() > state.sender_deadline or self.peer_id in state.received_sets:
                    raise ProtocolError("late part", peer)  # this reducer already closed its list of senders
                pieces.received[k][peer] = piece
                state.heard_from(peer)
                state.update()
            trailer = await asyncio.wait_for(
                read_frame(reader, max_header_bytes=_MAX_HEADER_BYTES),
                max(0.01, state.sender_deadline - time.monotonic()),
            )
            pieces.signed[peer] = self._signed_part(peer, trailer, state, digest.hexdigest(), weight)
            if time.monotonic() > state.sender_deadline or self.peer_id in state.received_sets:
                raise ProtocolError("late part", peer)
            pieces.digests[peer] = digest.hexdigest()
            state.parts.add(peer)
            state.update()
            await replying
        finally:
            replying.cancel()
            await asyncio.gather(replying, return_exceptions=True)
        await linger(reader, self.config.reducer_timeout_s)  # until the sender, having read it all, hangs up

    def _signed_part(self, peer: str, trailer: dict, state: _ReduceState, sha256: str, weight: float) -> dict:
        """The sender's statement of the part that came (``sha256``), checked: ProtocolError unless it states
        exactly that part of this slice and, when this peer signs, carries ``peer``'s signature."""
        if trailer.get("op") != "signed":
            raise ProtocolError("unsigned part", peer)
        signer = peer if self._admission.identity is not None else None
        try:
            statement = read_part(trailer.get("statement"), trailer.get("signature"), signer=signer, prefix=self.prefix)
        except PartRejected as e:
            raise ProtocolError(e.reason, peer) from None
        came = part_statement(
            group_id=state.group.group_id,
            index=state.my_index,
            lo=state.pieces.lo,
            hi=state.pieces.lo + state.numel,
            codec=state.codec,
            piece_numel=self.config.piece_numel,
            weight=weight,
            sha256=sha256,
            label=statement.label,
        )
        if statement != came:
            raise ProtocolError("part statement differs from the part", peer)
        return {"statement": statement.to_dict(), "signature": trailer.get("signature")}

    async def _reply(self, state: _ReduceState, writer: asyncio.StreamWriter) -> None:
        """Send a sender the pieces of my slice's aggregate as they are made, then ``final`` once the survivors
        are agreed: at once if those pieces stand, else after ``revised`` and the survivors' pieces."""
        pieces = state.pieces
        sent = 0
        deadline = state.sender_deadline + self.config.reducer_timeout_s
        for future in pieces.tentative:
            # set or given up by _reduce (it waits for pieces no longer than the sender deadline), or the slice ended
            await asyncio.wait(
                (future, state.result),
                timeout=max(0.01, deadline - time.monotonic()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            data = future.result() if future.done() else None
            if data is None or self._dead:
                break
            await write_frame(writer, {"status": "piece", "k": sent, "payload_bytes": len(data)}, data)
            sent += 1
        result = await asyncio.wait_for(asyncio.shield(state.result), self.config.reducer_timeout_s)
        if self._dead:
            return  # a crashed peer answers nothing, not even on streams opened before it died
        if result is None:
            await write_frame(writer, {"status": "slice failed"})
            return
        if not (pieces.confirmed and sent == len(pieces.bounds)):
            if sent:
                await write_frame(writer, {"status": "revised"})
            for k, data in enumerate(pieces.final):
                await write_frame(writer, {"status": "piece", "k": k, "payload_bytes": len(data)}, data)
        await write_frame(writer, {"status": "final"})


def _hashed_encode(codec: Any, values: torch.Tensor, digest: Any) -> bytes:
    payload = codec.encode(values.contiguous())
    digest.update(payload)
    return payload


def _hashed_decode(codec: Any, payload: bytes, numel: int, digest: Any) -> torch.Tensor:
    digest.update(payload)
    return codec.decode(payload, numel=numel)


async def _until_closed(reader: asyncio.StreamReader) -> None:
    """Returns once the other side closed or reset the stream (what it sends meanwhile is read and dropped)."""
    with contextlib.suppress(Exception):
        while await reader.read(65536):
            pass


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: str, **fields: Any) -> None:
    """A one-frame answer, then `linger` until the asker hangs up (closing at once can lose the answer)."""
    await write_frame(writer, {"status": status, **fields})
    await linger(reader, 2.0)


def _derive_id(seed: str, members: tuple[str, ...]) -> str:
    return hashlib.sha256((seed + "|" + ",".join(members)).encode()).hexdigest()[:32]
