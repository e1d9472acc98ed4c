"""Who may be drawn into a group on an open network: signed entries of live run members, minus suspects.

Anyone can write to a DHT key, so a matchmaking key read as-is lets a stranger stall every round:
24 fake candidates made every round wait out its deadline for leaders that do not exist. With an
``Identity`` the averager reads the key through three filters:

* **Owner-signed entries.** The subkey is the writer's Ed25519 peer ID and the value is
  ``{"p": payload, "s": signature}``: ``payload`` is canonical JSON ``{"c": bandwidth class,
  "r": region, "x": expiry in unix ms}``, signed by that peer ID's key (domain ``swarm/mm``, run id =
  the matchmaking key). Our peer IDs embed the public key, so any reader checks an entry without a
  lookup. An entry with another subkey, a bad signature, or one kept alive (or replayed) past its
  signed expiry is dropped with a counted reason: no one can add, forge or revive another's entry.
* **Members of the run.** With ``run`` set, a candidate must also hold a live, valid, signed
  capability record (`bootstrap.records`) of that run. The records are read beside the key
  (cached for `MEMBERS_TTL_S`, re-read at most every `MEMBERS_MIN_REFRESH_S` when an unknown
  candidate shows up, so a newcomer is drawn within a window or two).
* **Suspects.** A candidate that was drawn and did not join its leader, a leader that did not
  answer, or a member that joined and then failed the all-reduce, is not drawn (nor waited for) for `AveragingConfig.suspect_s`, doubling on each repeat
  offence up to 16x, unless this peer has averaged with it before (members with history are never
  suspected: their absence costs that round only, as before). A peer that never joins costs each
  honest peer at most one join timeout per suspicion period, and a run of them (signed Sybils that
  advertise and never join) costs at most one join timeout per round, for about
  ceil(sybils / (target_group_size - 1)) rounds per period, with periods of 1, 2, 4, 8, 16x.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from bootstrap.envelope import check_int, check_str, unwrap_signed
from bootstrap.errors import Rejected
from bootstrap.identity import Identity, canonical_json, public_key_from_peer_id, verify
from bootstrap.records import PEERS_KEY, RecordRejected, live_records

ENTRY_KIND = "swarm/mm"
MAX_ENTRY_BYTES = 512
MEMBERS_TTL_S = 10.0
MEMBERS_MIN_REFRESH_S = 1.0
JOIN_MIN_REFRESH_S = 0.25
_MAX_SUSPICION_DOUBLINGS = 4
_CLOCK_SKEW_S = 30.0
_MAX_CLASS = 64
_MAX_TRACKED = 4096


class EntryRejected(Rejected):
    """A matchmaking entry failed validation; ``reason`` is a short, countable label."""

    what = "matchmaking entry"


def sign_entry(identity: Identity, key: str, *, bandwidth_class: int, region: str, expires_at: float) -> dict:
    """The DHT value of ``identity``'s matchmaking entry under ``key``, valid until ``expires_at``."""
    payload = canonical_json({"c": int(bandwidth_class), "r": region, "x": int(expires_at * 1000)})
    return {"p": payload, "s": identity.sign(kind=ENTRY_KIND, run_id=key, payload=payload)}


def parse_entry(key: str, subkey: Any, value: Any, expiration_time: float, now: float) -> tuple[str, int]:
    """(region, bandwidth class) of an untrusted entry; raises EntryRejected with the reason."""
    try:
        public_key = public_key_from_peer_id(subkey)
    except ValueError:
        raise EntryRejected("subkey is not a peer id", repr(subkey)[:80]) from None
    payload, signature = unwrap_signed(value, max_bytes=MAX_ENTRY_BYTES, rejected=EntryRejected)
    if not verify(public_key=public_key, kind=ENTRY_KIND, run_id=key, payload=payload, signature=signature):
        raise EntryRejected("bad signature", subkey)
    try:
        data = json.loads(payload)
        if not isinstance(data, dict) or set(data) != {"c", "r", "x"}:
            raise ValueError("fields are not {c, r, x}")
        check_int("c", data["c"], maximum=_MAX_CLASS)
        check_str("r", data["r"], max_chars=64, allow_empty=True)
        check_int("x", data["x"])
    except (ValueError, TypeError, RecursionError) as e:
        raise EntryRejected("malformed", str(e)[:120]) from None
    signed_expiry = data["x"] / 1000
    if now >= signed_expiry:
        raise EntryRejected("expired", subkey)
    if expiration_time > signed_expiry + 1 or signed_expiry > now + _CLOCK_SKEW_S + 3600:
        raise EntryRejected("outlives its expiry", subkey)
    return data["r"], data["c"]


class RunMembers:
    """Peer IDs holding a live, valid capability record of one run, read from the DHT and cached."""

    def __init__(self, run: str, rejected: Counter) -> None:
        self.run, self.rejected = run, rejected
        self._members: frozenset[str] = frozenset()
        self._read_at = -float("inf")

    async def get(self, dht: Any, wanted: set[str], *, min_age_s: float = MEMBERS_MIN_REFRESH_S) -> frozenset[str]:
        """The members, re-read if stale, or if one of ``wanted`` is unknown and the last read is older
        than ``min_age_s`` (records spread through the DHT within seconds of a peer's start)."""
        age = time.monotonic() - self._read_at
        if age > MEMBERS_TTL_S or (not wanted <= self._members and age > min_age_s):
            await self._read(dht)
        return self._members

    async def _read(self, dht: Any) -> None:
        self._read_at = time.monotonic()
        try:
            found = await dht.get(PEERS_KEY, latest=True, return_future=True)
        except Exception:  # the DHT hiccupped: keep the last known members
            return

        def rejected(error: RecordRejected, _subkey: Any) -> None:
            self.rejected[f"member record {error.reason}"] += 1

        records = live_records(found, run=self.run, now=time.time(), on_rejected=rejected)
        self._members = frozenset(record.peer_id for record in records)


class Suspects:
    """Peers not to draw for a while; each repeat offence doubles the period (up to 16x).

    A peer this one has averaged with (``proven``) is never suspected: an honest member whose view of
    the key differed for a window simply went to another leader, and its absence is that round's
    failure only. A suspect that asks to join this peer's group is live after all and is cleared.
    """

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._until: dict[str, float] = {}
        self._offences: Counter = Counter()
        self._proven: set[str] = set()

    def prove(self, peers: Iterable[str]) -> None:
        for peer in peers:
            if len(self._proven) < _MAX_TRACKED:
                self._proven.add(peer)
            self._until.pop(peer, None)

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


class Admission:
    """Who a GroupAverager may draw and admit: its signing identity (None: unsigned entries, any
    well-formed entry is drawn), the run's members (None: anyone) and its suspects."""

    def __init__(self, identity: Identity | None, run: str | None, suspect_s: float, rejected: Counter) -> None:
        if run is not None and identity is None:
            raise ValueError("drawing only members of a run needs signed entries: pass identity= too")
        self.identity = identity
        self.members = RunMembers(run, rejected) if run is not None else None
        self.suspects = Suspects(suspect_s)
