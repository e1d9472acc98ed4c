"""A group's small signed posts (seal signatures, receipts) delivered to its members directly, the DHT the fallback.

After a round every member signs the manifest it seals and a participation receipt, and needs the others'.
Posting them under a DHT key and polling it cost each member about 4 of the ~8 DHT operations of a round
(measured, 2 peers on charlm tiny: each operation a traversal, RPCs and a process hop in every process it
touches). Members of a group are connected already (they just averaged), so each member sends its post to
the others in one unary call each (`bootstrap.runtime.Handler`), and stores it in the DHT only when some
member could not be reached (an older peer, a broken link); readers look in their inbox first and read
the DHT only once ``dht_after_s`` passed without the posts they wait for.

Posts are untrusted: the sender is the caller's authenticated peer ID (libp2p), never a field of the
post, so a post is filed under the peer that sent it, as an owner-bound DHT subkey would be. Its value is
checked by the reader like one read from the DHT (a signature by that peer). A post is strict JSON of at
most `MAX_POST_BYTES` under one of this run's keys (``prefixes``); refusals are counted in ``rejected``.
The inbox is bounded: `MAX_KEYS` keys (the oldest dropped first) and `MAX_KEYS_PER_SENDER` keys for each
sender (its oldest post gives way to its newest), so one peer cannot push the others' posts out (it would
take ``MAX_KEYS / MAX_KEYS_PER_SENDER`` senders; a post pushed out is lost unless its sender also stored it
in the DHT, and the seal or the receipt swap it belonged to ends at its deadline without it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from bootstrap.dhtcalls import latest_within, store_within
from bootstrap.envelope import strict_json
from bootstrap.errors import Rejected
from bootstrap.identity import canonical_json
from bootstrap.runtime import Handler

logger = logging.getLogger(__name__)

DHT_TIMEOUT_S = 5.0
"""Bound on one DHT store or read of a post (the fallback path)."""
DHT_AFTER_S = 1.0
"""A reader looks in the DHT too once it has waited this long for posts that did not all come directly."""
MAX_POST_BYTES = 16 << 10
"""Largest post accepted (a receipt of 16 members is about 2.5 KB, a seal signature 128 hex chars)."""
MAX_KEYS = 256
"""Keys the inbox holds at most (a member posts 2 a round: its seal signature and its receipt)."""
MAX_KEYS_PER_SENDER = 8
"""Keys one sender may hold in the inbox at once (a member posts 2 a round; a few rounds may overlap)."""


class PostRejected(Rejected):
    what = "post"


class GroupPosts:
    """Sends this peer's posts to its group and files the posts others send it, by key and sender."""

    def __init__(self, dht: hivemind.DHT, *, run_id: str, prefixes: tuple[str, ...], start_timeout_s: float = 30.0):
        self.dht, self.prefixes = dht, prefixes
        self.rejected: Counter[str] = Counter()
        self._inbox: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._arrived = threading.Condition()
        self.arrivals = 0
        """Posts filed so far (this peer's own included), and once more at `close`: `wait`'s ``since``."""
        self._service = Handler(
            dht,
            handler_name=f"swarm.posts.v1.{run_id}",
            handler=_no_stream,
            unary=self._serve_unary,
            start_timeout_s=start_timeout_s,
        )

    def post(self, key: str, value: Any, *, sender: str, to: Iterable[str]) -> None:
        """``sender``'s (this peer's) ``value`` under ``key`` to the peers ``to``: directly, and into the DHT
        (``key``/``sender``) as well when some peer did not take it; `read` returns it here too. Never raises."""
        self._file(key, sender, value)
        others = set(to) - {sender}
        if self.send(key, value, to=others) != others:
            dht_store(self.dht, key, value, subkey=sender)

    def read(self, key: str, *, since: float) -> list[tuple[str, Any]]:
        """(sender, value) of the posts under ``key`` (unchecked: check each like a DHT value): those that came
        directly, and once `DHT_AFTER_S` passed since ``since`` (monotonic) those in the DHT too."""
        found = list(self.received(key).items())
        if time.monotonic() - since >= DHT_AFTER_S:
            entry = dht_get(self.dht, key)
            if entry is not None and isinstance(entry.value, dict):
                found += [(peer, getattr(item, "value", None)) for peer, item in entry.value.items()]
        return found

    def send(self, key: str, value: Any, *, to: Iterable[str], timeout_s: float = 2.0) -> set[str]:
        """Post ``value`` under ``key`` to each peer of ``to``; the peers that took it (within ``timeout_s``)."""
        peers = sorted(set(to))
        if not peers or self._service.closed:
            return set()
        data = canonical_json({"k": key, "v": value})
        future = self._service.submit(self._send_all(peers, data, timeout_s))
        try:
            return future.result(timeout=timeout_s + 1.0)
        except Exception as e:  # timed out or closing: the caller falls back to the DHT
            logger.debug("posting %s: %r", key, e)
            future.cancel()
            return set()

    async def _send_all(self, peers: list[str], data: bytes, timeout_s: float) -> set[str]:
        async def one(peer: str) -> str | None:
            try:
                async with asyncio.timeout(timeout_s):
                    reply = await self._service.call_unary(peer, data)
                return peer if reply == b"ok" else None
            except Exception as e:  # unreachable, or a peer without the handler (an older version)
                logger.debug("post to %s failed: %r", peer, e)
                return None

        return {peer for peer in await asyncio.gather(*(one(p) for p in peers)) if peer is not None}

    def received(self, key: str) -> dict[str, Any]:
        """The posts filed under ``key``: sender -> value (unchecked: check each like a DHT value)."""
        with self._arrived:
            return dict(self._inbox.get(key, {}))

    def wait(self, timeout_s: float, *, since: int) -> None:
        """Return once a post has arrived since `arrivals` read ``since`` (at once if one has already: one that
        came between the caller's read and this call is not missed), or after ``timeout_s``."""
        with self._arrived:
            self._arrived.wait_for(lambda: self.arrivals != since, timeout_s)

    def discard(self, key: str) -> None:
        with self._arrived:
            self._inbox.pop(key, None)

    def close(self) -> None:
        self._service.close()
        with self._arrived:
            self.arrivals += 1  # a waiter returns at once
            self._arrived.notify_all()

    async def _serve_unary(self, data: bytes, sender: str) -> bytes:
        try:
            key, value = self._parse(data)
            self._file(key, sender, value)
        except PostRejected as e:
            self.rejected[e.reason] += 1
            logger.debug("refused a post from %s: %s", sender, e)
            return b""
        return b"ok"

    def _parse(self, data: bytes) -> tuple[str, Any]:
        if not 0 < len(data) <= MAX_POST_BYTES:
            raise PostRejected("oversized", f"{len(data)} bytes")
        post = strict_json(data, PostRejected)
        if not isinstance(post, dict) or set(post) != {"k", "v"} or not isinstance(post["k"], str):
            raise PostRejected("malformed", "not {k: key, v: value}")
        if not post["k"].startswith(self.prefixes):
            raise PostRejected("another key", f"{post['k']!r:.80}")
        return post["k"], post["v"]

    def _file(self, key: str, sender: str, value: Any) -> None:
        with self._arrived:
            held = [k for k, posts in self._inbox.items() if sender in posts and k != key]  # oldest first
            for old in held[: max(0, len(held) + 1 - MAX_KEYS_PER_SENDER)]:  # its oldest give way to its newest
                del self._inbox[old][sender]
                if not self._inbox[old]:
                    del self._inbox[old]
            self._inbox.setdefault(key, {})[sender] = value
            while len(self._inbox) > MAX_KEYS:
                self._inbox.popitem(last=False)
            self.arrivals += 1
            self._arrived.notify_all()


async def _no_stream(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()  # posts come as unary calls only


def dht_store(dht: hivemind.DHT, key: str, value: Any, *, subkey: str, expiry_s: float = 120.0) -> bool:
    """Store ``value`` under ``key``/``subkey`` for ``expiry_s``; False (logged) if the DHT refused it or did
    not answer within `DHT_TIMEOUT_S`."""
    failure = store_within(
        dht, key, value, subkey=subkey, expiration_time=get_dht_time() + expiry_s, timeout_s=DHT_TIMEOUT_S
    )
    if failure is not None:  # the seal or the swap goes on without it
        logger.info("could not store %s: %s", key, failure)
    return failure is None


def dht_get(dht: hivemind.DHT, key: str) -> Any:
    """The newest value under ``key``, or None (logged at debug) if the DHT did not answer within `DHT_TIMEOUT_S`."""
    try:
        return latest_within(dht, key, timeout_s=DHT_TIMEOUT_S)
    except Exception as e:
        logger.debug("could not read %s: %r", key, e)
        return None
