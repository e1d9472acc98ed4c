"""Who may be drawn into a group on an open network: signed entries of live run members, minus suspects.

Anyone can write to a DHT key, so a matchmaking key read as-is lets a stranger stall every round:
24 fake candidates made every round wait out its deadline for leaders that do not exist. With an
``Identity`` the averager reads the key through three filters:

* **Owner-signed entries.** The subkey is the writer's Ed25519 peer ID and the value is
  ``{"p": payload, "s": signature}``: ``payload`` is canonical JSON ``{"c": bandwidth class,
  "r": region, "x": expiry in unix ms}`` (plus ``"g": 1`` when its writer left the run), signed by that peer ID's key (domain ``swarm/mm``, run id =
  the matchmaking key). Our peer IDs embed the public key, so any reader checks an entry without a
  lookup. An entry with another subkey, a bad signature, or one kept alive (or replayed) past its
  signed expiry is dropped with a counted reason: no one can add, forge or revive another's entry.
* **Members of the run.** With ``run`` set, a candidate must also hold a live, valid, signed
  capability record (`bootstrap.records`) of that run. The records are read beside the key
  (cached for `MEMBERS_TTL_S`, re-read at most every `MEMBERS_MIN_REFRESH_S` when an unknown
  candidate shows up, so a newcomer is drawn within a window or two).
* **Suspects.** A candidate that was drawn and did not join its leader, a leader that did not
  answer, or a member that joined and then failed the all-reduce, is not drawn (nor waited for) for
  `AveragingConfig.suspect_s`, doubling on each repeat offence up to 16x, unless this peer has
  averaged with it before (members with history are never suspected: their absence costs that round
  only, as before). Off by default (see the config).

**The guard: peers with history first** (on by default, `AveragingConfig.guard_s`). Signed Sybils
(real keys with valid records that advertise and never join) defeat per-peer suspicion: each honest
peer learns them one no-show at a time, and meanwhile the honest peers, diluted among dozens of
candidates, are drawn into different chunks (24 Sybils beside 3 peers: 0.25x the grouped rounds).
So a peer watches for the flood's signature instead, a drawn peer it has never averaged with that
does not show (a no-show follower, or a leader that does not answer). That raises its guard for
``guard_s`` (doubling on each raise within a period of the last, up to 16x). While raised, it draws
only the candidates it has history with (``Guard.proven``: peers it averaged with, and the
participants of the sealed checkpoint it loaded); honest peers of a run have averaged with each other,
so they draw the same core and group as before. Others may still join a leader that has them in its
chunk, at most ``max(1, target_group_size // 4)`` per group (``newcomer_slots``); a leader waits for
none of them, except for ``NEWCOMER_GRACE_S`` after its core has joined for one that knocked lately
(asked to join when the lobby was closed: it is live), once per knock. Leaders are the first member
with history of each chunk, so a peer with no round of its own never leads while guarded. The bound, per honest peer:
about one failed matchmaking attempt (a join timeout plus a window, 7 s at the defaults) per guard
period while the flood lasts (periods of 60, 120, 240, 480, 960 s), whatever the number of Sybils;
Sybils that do join get at most ``newcomer_slots`` places in a group and are then averaged with like
anyone (bounded by the robust aggregator); Sybils that knock and then stay away cost at most
``NEWCOMER_GRACE_S`` per knock, one knock per Sybil per leader round. The price: while guarded, groups do not mix across peers
without a shared history, and a newcomer enters only through a proven leader's open slots.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from bootstrap.dhtcalls import latest_many
from bootstrap.envelope import check_int, check_str, unwrap_signed
from bootstrap.errors import Rejected
from bootstrap.identity import Identity, canonical_json, public_key_from_peer_id, verify
from bootstrap.records import PEERS_KEYS, RecordBook, RecordRejected

ENTRY_KIND = "swarm/mm"
MAX_ENTRY_BYTES = 512
MEMBERS_TTL_S = 10.0
MEMBERS_MIN_REFRESH_S = 1.0
MEMBERS_READ_TIMEOUT_S = 5.0
"""Bound on one read of the capability records; a read that takes longer keeps the last known members."""
NEWCOMER_GRACE_S = 1.0
JOIN_MIN_REFRESH_S = 0.25
_MAX_SUSPICION_DOUBLINGS = 4
_CLOCK_SKEW_S = 30.0
_MAX_CLASS = 64
_MAX_TRACKED = 4096


class EntryRejected(Rejected):
    """A matchmaking entry failed validation; ``reason`` is a short, countable label."""

    what = "matchmaking entry"


class Entry(NamedTuple):
    """A valid matchmaking entry: its writer is looking for a group, or (``gone``) has left the run."""

    region: str
    bandwidth_class: int
    gone: bool = False


def sign_entry(
    identity: Identity, key: str, *, bandwidth_class: int, region: str, expires_at: float, gone: bool = False
) -> dict:
    """The DHT value of ``identity``'s matchmaking entry under ``key``, valid until ``expires_at``; ``gone``:
    the writer left the run (a clean leave), so that no one draws it or waits for it."""
    fields = {"c": int(bandwidth_class), "r": region, "x": int(expires_at * 1000), **({"g": 1} if gone else {})}
    payload = canonical_json(fields)
    return {"p": payload, "s": identity.sign(kind=ENTRY_KIND, run_id=key, payload=payload)}


def parse_entry(key: str, subkey: Any, value: Any, expiration_time: float, now: float) -> Entry:
    """The `Entry` of an untrusted value; raises EntryRejected with the reason."""
    try:
        public_key = public_key_from_peer_id(subkey)
    except ValueError:
        raise EntryRejected("subkey is not a peer id", repr(subkey)[:80]) from None
    payload, signature = unwrap_signed(value, max_bytes=MAX_ENTRY_BYTES, rejected=EntryRejected)
    if not verify(public_key=public_key, kind=ENTRY_KIND, run_id=key, payload=payload, signature=signature):
        raise EntryRejected("bad signature", subkey)
    try:
        data = json.loads(payload)
        if not isinstance(data, dict) or set(data) - {"g"} != {"c", "r", "x"} or data.get("g", 1) != 1:
            raise ValueError("fields are not {c, r, x[, g=1]}")
        check_int("c", data["c"], maximum=_MAX_CLASS)
        check_str("r", data["r"], max_chars=64, allow_empty=True)
        check_int("x", data["x"])
    except (ValueError, TypeError, RecursionError) as e:
        raise EntryRejected("malformed", str(e)[:120]) from None
    signed_expiry = data["x"] / 1000
    if now >= signed_expiry:
        raise EntryRejected("expired", subkey)
    if not expiration_time <= signed_expiry + 1 or signed_expiry > now + _CLOCK_SKEW_S + 3600:  # NaN too
        raise EntryRejected("outlives its expiry", subkey)
    return Entry(data["r"], data["c"], "g" in data)


class RunMembers:
    """Peer IDs holding a live, valid capability record of one run, read from the DHT and cached."""

    def __init__(self, run: str, rejected: Counter) -> None:
        self.run, self.rejected = run, rejected
        self._members: frozenset[str] = frozenset()
        self._read_at = -float("inf")
        self._book = RecordBook()  # a read that misses a live member's record does not drop the member

    async def get(self, dht: Any, wanted: set[str], *, min_age_s: float = MEMBERS_MIN_REFRESH_S) -> frozenset[str]:
        """The members, re-read if stale, or if one of ``wanted`` is unknown and the last read is older
        than ``min_age_s`` (records spread through the DHT within seconds of a peer's start)."""
        age = time.monotonic() - self._read_at
        if age > MEMBERS_TTL_S or (not wanted <= self._members and age > min_age_s):
            await self._read(dht)
        return self._members

    @property
    def known(self) -> frozenset[str]:
        """The members as last read (no DHT call)."""
        return self._members

    async def _read(self, dht: Any) -> None:
        self._read_at = time.monotonic()
        try:
            found = await asyncio.wait_for(latest_many(dht, PEERS_KEYS), MEMBERS_READ_TIMEOUT_S)
        except Exception:  # the DHT hiccupped or is slow: keep the last known members
            return

        def rejected(error: RecordRejected, _subkey: Any) -> None:
            self.rejected[f"member record {error.reason}"] += 1

        self._members = frozenset(
            record.peer_id for record in self._book.read(found, run=self.run, on_rejected=rejected)
        )


class Suspects:
    """Peers not to draw for a while; each repeat offence doubles the period (up to 16x).

    A peer this one has averaged with (``proven``, shared with the Guard) is never suspected: an honest member whose view of
    the key differed for a window simply went to another leader, and its absence is that round's
    failure only. A suspect that asks to join this peer's group is live after all and is cleared.
    """

    def __init__(self, period_s: float, proven: set[str]) -> None:
        self.period_s = period_s
        self._until: dict[str, float] = {}
        self._offences: Counter = Counter()
        self._proven = proven

    def clear(self, peer: str) -> None:
        self._until.pop(peer, None)

    def add(self, peer: str) -> None:
        if peer in self._proven or self.period_s <= 0:
            return
        if len(self._offences) >= _MAX_TRACKED:  # a flood of identities: forget the past offences of non-suspects
            self._offences = Counter({p: n for p, n in self._offences.items() if p in self.active()})
        doublings = min(self._offences[peer], _MAX_SUSPICION_DOUBLINGS)
        self._offences[peer] += 1
        self._until[peer] = time.monotonic() + self.period_s * 2**doublings

    def active(self) -> set[str]:
        now = time.monotonic()
        for peer in [p for p, until in self._until.items() if until <= now]:
            del self._until[peer]
        return set(self._until)


class Guard:
    """The raised-guard state (see the module docstring): peers with history, and until when to draw
    only them."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self.proven: set[str] = set()
        """Peers this one averaged with, and the participants of the sealed state it loaded."""
        self.own_history = False
        """True once this peer has averaged in a group."""
        self.raised = 0
        """How many times the guard was raised (for counters and tests)."""
        self._until = -float("inf")
        self._doublings = 0
        self._knocked: dict[str, float] = {}

    def prove(self, peers: Iterable[str], *, own_round: bool = True) -> None:
        for peer in peers:
            if len(self.proven) < _MAX_TRACKED:
                self.proven.add(peer)
        self.own_history = self.own_history or own_round

    def alarm(self, peer: str) -> None:
        """``peer`` was drawn and did not show: raise the guard if it is a peer without history."""
        if peer in self.proven or self.period_s <= 0 or self.active():
            return
        now = time.monotonic()
        again = now < self._until + self.period_s  # the flood went on past the last period: a longer one
        self._doublings = min(self._doublings + 1, _MAX_SUSPICION_DOUBLINGS) if again else 0
        self._until = now + self.period_s * 2**self._doublings
        self.raised += 1

    def active(self) -> bool:
        return time.monotonic() < self._until

    def knock(self, peer: str) -> None:
        """``peer`` (without history) asked to join while this peer was not leading: it is live, so this
        peer's next lobby waits ``NEWCOMER_GRACE_S`` for it (once: a knock is used up by that wait)."""
        if peer not in self.proven and (peer in self._knocked or len(self._knocked) < _MAX_TRACKED):
            self._knocked[peer] = time.monotonic() + self.period_s

    def knocked(self, live: Iterable[str], slots: int) -> frozenset[str]:
        """Up to ``slots`` of the peers that knocked lately and are in ``live``; their knocks are used up."""
        now = time.monotonic()
        self._knocked = {p: until for p, until in self._knocked.items() if until > now}
        chosen = sorted(p for p in live if p in self._knocked)[:slots]
        for peer in chosen:
            del self._knocked[peer]
        return frozenset(chosen)

    def leader(self, chunk: list[str], me: str) -> str:
        """The chunk's leader while the guard is up: the first member with history (this peer counts
        once it has averaged), so newcomers in a chunk never change who leads."""
        eligible = [p for p in chunk if p in self.proven or (p == me and self.own_history)]
        return sorted(eligible or chunk)[0]

    def core(self, candidates: dict[str, Any], me: str) -> dict[str, Any]:
        """The candidates to draw from: all of them, or (guard up) this peer and its proven ones."""
        if not self.active():
            return candidates
        core = {peer: c for peer, c in candidates.items() if peer == me or peer in self.proven}
        return core if len(core) > 1 else candidates


def newcomer_slots(target_group_size: int) -> int:
    """Most peers without history a guarded leader admits into one group."""
    return max(1, target_group_size // 4)


class Admission:
    """Who a GroupAverager may draw and admit: its signing identity (None: unsigned entries, any
    well-formed entry is drawn), the run's members (None: anyone), its suspects and its guard."""

    def __init__(
        self, identity: Identity | None, run: str | None, suspect_s: float, rejected: Counter, guard_s: float = 0.0
    ) -> None:
        if run is not None and identity is None:
            raise ValueError("drawing only members of a run needs signed entries: pass identity= too")
        self.identity = identity
        self.members = RunMembers(run, rejected) if run is not None else None
        self.guard = Guard(guard_s)
        self.suspects = Suspects(suspect_s, self.guard.proven)
        self.expected: frozenset[str] = frozenset()
        """Who the caller believes the run's live members are (this round's ``step(expected=...)``)."""
        self.departed: dict[str, float] = {}
        """Peers whose "gone" entry was read (monotonic time): not waited for until they look again."""
        self.excluded: dict[str, str] = {}
        """Peers shown to cheat (swarm.work), with the reason: never drawn, admitted or waited for."""
        self.policy: Callable[[str, Any], str | None] | None = None
        """The caller's rule on a member's gathered metadata for this round: a reason to refuse it, or None
        (swarm.work's ``require_verified``: no commitment). Unlike exclusion it holds for the one round."""

    def refuses(self, peer: str, gathered: Any) -> str | None:
        """Why ``peer`` may not be in this peer's group this round (``"excluded"``, or ``"refused"`` by the
        policy), or None."""
        if peer in self.excluded:
            return "excluded"
        if self.policy is not None and self.policy(peer, gathered) is not None:
            return "refused"
        return None

    def gone(self, peer: str) -> None:
        """``peer`` said it left the run (a signed "gone" entry)."""
        self.departed[peer] = time.monotonic()
        if len(self.departed) > _MAX_TRACKED:  # bounded: the oldest goes first
            del self.departed[next(iter(self.departed))]

    def looking(self, peer: str) -> None:
        """``peer`` is looking for a group (again, after a restart): a member like any other."""
        self.departed.pop(peer, None)

    def live_expected(self) -> frozenset[str]:
        """The expected members, minus those that said they left and those shown to cheat."""
        return self.expected - self.departed.keys() - self.excluded.keys()

    def prove(self, peers: Iterable[str], *, own_round: bool = True) -> None:
        """``peers`` averaged with this one (or, ``own_round=False``, signed the state it loaded): they
        have history, and are no longer suspects."""
        peers = list(peers)
        self.guard.prove(peers, own_round=own_round)
        for peer in peers:
            self.suspects.clear(peer)

    def no_show(self, peer: str) -> None:
        """``peer`` was drawn and did not show up (or did not answer as a leader)."""
        self.suspects.add(peer)
        self.guard.alarm(peer)
