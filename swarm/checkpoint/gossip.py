"""Epidemic push of sealed manifests over libp2p (a unary call per push), plus a DHT index for peers that
were away.

A peer that learns a new sealed manifest (one that verifies and is newer than what it has) stores it
and pushes it to ``fanout`` random peers of the run; each receiver verifies *before* forwarding, so
a forged or stale manifest dies at the first honest hop. Every peer also keeps its newest sealed
manifest in the DHT under the run's index key (subkey = its peer ID), so a peer that was offline,
or a joiner, finds the newest one with a single lookup (and verifies it like any other).

Why not libp2p GossipSub (which p2pd runs with ``-pubsub``; `bootstrap.pubsub`): measured side by side
(benchmarks/README.md section 5b), it spreads 6-7x faster but relays every message before any check,
since the daemon has no validator hook, so one forged publish reaches every subscriber; here a forgery
costs its sender one send per peer it reaches and dies at the first honest hop.

The gossip layer treats manifests as opaque bytes: ``verify(data) -> (digest, step)`` raises
``ValueError`` for anything unacceptable (signatures, quorum, run, lineage are its business).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from bootstrap.framing import ProtocolError, read_blob
from bootstrap.runtime import Handler, result_within

logger = logging.getLogger(__name__)

MAX_MANIFEST_BYTES = 1 << 20
INDEX_STORE_TIMEOUT_S = 10.0
"""Bound on storing a sealed manifest in the run's DHT index."""
_FROM_INDEX = "DHT index"

Verify = Callable[[bytes], tuple[str, int]]
"""Returns (digest, step) of a valid sealed manifest; raises ValueError with the reason otherwise."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GossipConfig:
    """How far and how fast sealed manifests spread."""

    fanout: int = 8
    """Random peers each new manifest is pushed to (each peer forwards news once; with fanout f about
    e^-f of the peers are missed by the random pushes: 4 missed 2% of 50 peers). Each peer also pushes
    to its successor on the ring of peer IDs, which reaches the ones the random pushes missed."""
    pull_interval_s: float = 5.0
    """Anti-entropy: this often, read the run's DHT index and take any newer valid manifest (push
    gossip that forwards only news can miss a few peers; the pull closes that gap). Skipped while
    pushes of the newest manifest keep arriving (the push reaches this peer): reading the index
    returns every peer's manifest, and those reads were half the bytes a sealing round cost."""
    push_timeout_s: float = 5.0
    """Deadline of one push to one peer."""
    index_expiry_s: float = 600.0
    """Lifetime of this peer's entry in the run's DHT index (refreshed on every new manifest)."""

    def __post_init__(self) -> None:
        if not 1 <= self.fanout <= 64:
            raise ValueError(f"fanout must be in [1, 64], got {self.fanout!r}")
        for name in ("push_timeout_s", "index_expiry_s", "pull_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


def index_key(run_id: str) -> str:
    return f"swarm/{run_id}/manifests"


class ManifestGossip:
    """Spreads sealed manifests of one run; thread-safe, synchronous API over a background event loop.

    ``peers()`` lists the peer IDs to push to (e.g. the run's peers from the resource graph);
    ``on_new(data, digest, step)`` is called (from the gossip thread) for every newer valid manifest.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        *,
        run_id: str,
        verify: Verify,
        peers: Callable[[], Sequence[str]],
        on_new: Callable[[bytes, str, int], None] | None = None,
        config: GossipConfig | None = None,
        start_timeout_s: float = 30.0,
        announce: Callable[[bytes, str], bool] | None = None,
        holders: Callable[[bytes], Collection[str]] | None = None,
    ):
        self.dht, self.run_id, self.verify, self.peers = dht, run_id, verify, peers
        self.on_new = on_new or (lambda data, digest, step: None)
        self.announce = announce or (lambda data, digest: True)
        """Whether this peer writes a new manifest into the run's DHT index (default: always). Every
        copy in the index costs each reader its bytes, so a group lets only some of its members write it."""
        self.holders = holders or (lambda data: ())
        """Peers that hold a manifest already and are never pushed it (the group that sealed it)."""
        self.config = config or GossipConfig()
        self.rejected: Counter = Counter()
        self.received = 0
        self.forwarded = 0
        self.duplicates = 0
        """Copies of the newest manifest received again (byte for byte): dropped without verifying."""
        self._forwarding: set[asyncio.Task] = set()
        self.newest: tuple[int, str, bytes, str | None] | None = None
        """The newest valid manifest: step, digest, bytes, and whom this peer first had it from (a peer ID,
        the DHT index, or None: published here)."""
        self.pulls = 0
        """Anti-entropy reads of the DHT index made so far (the others were skipped: pushes arrived)."""
        self._last_push = -float("inf")
        self._lock = threading.Lock()
        self._service = Handler(
            dht,
            handler_name=f"swarm.gossip.v1.{run_id}",
            handler=self._serve,
            background=self._pull_periodically,
            unary=self._serve_unary,
            start_timeout_s=start_timeout_s,
        )
        self._p2p = self._service.p2p
        self.peer_id = str(self._p2p.peer_id)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop gossiping. Idempotent."""
        self._service.close(timeout_s)

    # ------------------------------------------------------------------------------------ api
    def publish(self, data: bytes, *, timeout_s: float = 30.0) -> bool:
        """Offer a manifest (e.g. one this peer just sealed); True if it was new and valid."""
        future = self._service.submit(self._accept(data, source=None))
        return future.result(timeout=timeout_s)

    def fetch_newest_from_index(
        self, *, timeout_s: float = 30.0, cancel: threading.Event | None = None
    ) -> bytes | None:
        """The newest valid manifest announced in the run's DHT index (for a peer that was away); see
        `bootstrap.runtime.result_within` for ``cancel``."""
        return result_within(self._service.submit(self._from_index()), timeout_s=timeout_s, cancel=cancel)

    # ------------------------------------------------------------------------------------ internals
    def _check(self, data: Any) -> tuple[str, int]:
        if not isinstance(data, bytes) or not 0 < len(data) <= MAX_MANIFEST_BYTES:
            raise ValueError("oversized or empty manifest")
        return self.verify(data)

    async def _accept(self, data: bytes, *, source: str | None) -> bool:
        with self._lock:
            newest = self.newest
        if newest is not None and data == newest[2]:  # the very bytes this peer verified: old news, unverified
            self.duplicates += 1
            if source != _FROM_INDEX:
                self._last_push = time.monotonic()
            return False
        try:
            digest, step = self._check(data)
        except ValueError as e:
            reason = str(e).split(":")[0][:60] or "invalid"
            self.rejected[reason] += 1
            logger.info("rejected a manifest from %s: %s", source or "this peer", e)
            return False
        with self._lock:
            if source != _FROM_INDEX and (self.newest is None or step >= self.newest[0]):
                self._last_push = time.monotonic()  # pushed to, or sealing: this peer's manifests are current
            if self.newest is not None and (step < self.newest[0] or digest == self.newest[1]):
                return False  # old news: do not forward, so the epidemic dies out
            self.newest = (step, digest, data, source)
        self.on_new(data, digest, step)
        announces = _ask("announce", self.announce, data, digest, default=True)
        announce = self._announce(data, digest, step) if announces else asyncio.sleep(0)
        holders = _ask("holders", self.holders, data, default=())
        await asyncio.gather(announce, self._push(data, exclude={source, *holders}))
        return True

    async def _announce(self, data: bytes, digest: str, step: int) -> None:
        with contextlib.suppress(Exception):  # the index is a convenience; gossip does not depend on it
            stored = self.dht.store(
                index_key(self.run_id),
                {"step": step, "digest": digest, "manifest": data},
                expiration_time=get_dht_time() + self.config.index_expiry_s,
                subkey=self.peer_id,
                return_future=True,
            )
            await asyncio.wait_for(stored, INDEX_STORE_TIMEOUT_S)  # a DHT whose process died never answers

    async def _push(self, data: bytes, *, exclude: set) -> None:
        peers = sorted(set(self.peers()) | {self.peer_id})
        candidates = [p for p in peers if p != self.peer_id and p not in exclude]
        targets = set(random.sample(candidates, min(self.config.fanout, len(candidates))))
        # and the next peer after this one on the ring of peer IDs: every peer that hears news forwards it
        # to its successor, so a peer the random pushes missed hears it one hop after its predecessor
        # (instead of at the next anti-entropy pull, seconds later)
        mine = peers.index(self.peer_id)
        successor = next((p for p in peers[mine + 1 :] + peers[:mine] if p not in exclude), None)
        targets.update([successor] if successor is not None else [])
        await asyncio.gather(*(self._push_one(peer, data) for peer in targets))

    async def _push_one(self, peer: str, data: bytes) -> None:
        """One unary call (the replica's multiplexed connection to the daemon): at 100 peers in one process,
        a stream per push (a daemon connection and a stream negotiation each) cost the spread most of its time."""
        try:
            async with asyncio.timeout(self.config.push_timeout_s):
                await self._service.call_unary(peer, data)
            self.forwarded += 1
        except Exception as e:  # an unreachable peer only slows the epidemic down
            logger.debug("push to %s failed: %r", peer, e)

    async def _serve_unary(self, data: bytes, source: str) -> bytes:
        if not 0 < len(data) <= MAX_MANIFEST_BYTES:
            self.rejected["oversized or empty manifest"] += 1
            return b""
        self.received += 1
        self._forward_later(data, source)
        return b""

    def _forward_later(self, data: bytes, source: str) -> None:
        # forwarding outlives the handler: keep a strong reference, or the task can be collected mid-push
        task = asyncio.create_task(self._accept(data, source=source))
        self._forwarding.add(task)
        task.add_done_callback(self._forwarding.discard)

    async def _serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A push over a stream (how peers before the unary push sent it)."""
        source = str(info.peer_id)
        try:
            async with asyncio.timeout(self.config.push_timeout_s):
                data = await read_blob(reader, max_bytes=MAX_MANIFEST_BYTES)
            self.received += 1
        except ProtocolError as e:
            self.rejected[e.reason] += 1
            return
        except (asyncio.TimeoutError, ConnectionError):
            self.rejected["truncated"] += 1
            return
        except asyncio.CancelledError:
            return
        finally:
            writer.close()
        self._forward_later(data, source)

    async def _pull_periodically(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.pull_interval_s * random.uniform(0.5, 1.5))
            if stop.is_set():
                return
            if time.monotonic() - self._last_push < self.config.pull_interval_s:
                continue  # pushes are arriving: nothing to catch up on
            self.pulls += 1
            try:
                data = await asyncio.wait_for(self._from_index(), self.config.push_timeout_s)
            except Exception as e:  # the next pull tries again
                logger.debug("anti-entropy pull failed: %r", e)
                continue
            if data is not None and (self.newest is None or data != self.newest[2]):
                await self._accept(data, source=_FROM_INDEX)

    async def _from_index(self) -> bytes | None:
        found = await self.dht.get(index_key(self.run_id), latest=True, return_future=True)
        if found is None or not isinstance(found.value, dict):
            return None
        best: tuple[int, bytes] | None = None
        for item in found.value.values():
            value = getattr(item, "value", None)
            data = value.get("manifest") if isinstance(value, dict) else None
            try:
                _digest, step = self._check(data)
            except ValueError as e:
                self.rejected[str(e).split(":")[0][:60] or "invalid"] += 1
                continue
            if best is None or step > best[0]:
                best = (step, data)
        return None if best is None else best[1]


def _ask(name: str, policy: Callable[..., Any], *args: Any, default: Any) -> Any:
    """A caller's policy's answer; ``default`` (as with no policy) if it fails: a failing policy must not
    stop the epidemic."""
    try:
        return policy(*args)
    except Exception as e:
        logger.debug("%s policy failed: %r", name, e)
        return default


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until true or ``timeout_s`` passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True
