"""Bounded DHT calls from a synchronous thread: a store or a read that gives up after ``timeout_s``.

A hivemind DHT answers through its own process; when that process dies (or its node is frozen) a plain
``dht.store(...)`` or ``dht.get(...)`` never returns. Every synchronous caller of Swarm (heartbeats, seals,
receipts, verdicts, the CLIs) goes through these, so each such wait has its bound.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import ValueWithExpiration


def process_gone(dht: DHT) -> bool:
    """True once ``dht``'s process (a child of this one) has died, e.g. by the signal a terminal sends its whole
    process group: a call to it, or to the daemon it ran, can then only time out. False when that cannot be told
    (not this process's child, already closed, or a stand-in without a process)."""
    try:
        return not dht.is_alive()
    except (AssertionError, ValueError, AttributeError):
        return False


def store_within(
    dht: DHT, key: str, value: Any, *, subkey: str, expiration_time: float, timeout_s: float
) -> str | None:
    """Store ``value`` under ``key``/``subkey`` until ``expiration_time`` (DHT time); None if the DHT took it,
    else why not (it refused the value, did not answer within ``timeout_s``, or is shut down). Never raises."""
    try:
        stored = dht.store(key, value, expiration_time=expiration_time, subkey=subkey, return_future=True)
        return None if stored.result(timeout=timeout_s) else "the DHT did not store it"
    except Exception as e:  # timed out, or the DHT is shut down
        return repr(e)


def latest_within(dht: DHT, key: str, *, timeout_s: float) -> ValueWithExpiration | None:
    """The newest value under ``key`` (None: nothing stored). Raises TimeoutError if the DHT does not
    answer within ``timeout_s``, or the DHT's own error."""
    return dht.get(key, latest=True, return_future=True).result(timeout=timeout_s)


async def _latest_many(_dht: DHT, node: Any, keys: tuple[str, ...]) -> dict[str, ValueWithExpiration | None]:
    return await node.get_many(keys, sufficient_expiration_time=float("inf"))


def latest_many(dht: DHT, keys: Iterable[str]) -> Any:
    """A future of the newest value under each of ``keys`` (key -> value, None where nothing is stored), read
    in one DHT traversal (hivemind batches the keys of each request to a node). Await it, or call
    ``result(timeout)``."""
    return dht.run_coroutine(functools.partial(_latest_many, keys=tuple(keys)), return_future=True)


def latest_many_within(dht: DHT, keys: Iterable[str], *, timeout_s: float) -> dict[str, ValueWithExpiration | None]:
    """`latest_many`, waited for at most ``timeout_s`` (TimeoutError), or the DHT's own error."""
    return latest_many(dht, keys).result(timeout=timeout_s)


async def _leave_out(_dht: DHT, node: Any, peers: tuple[str, ...], leave_out: bool) -> int:
    """Puts ``peers`` on this node's blacklist (``leave_out``) or takes them off; how many changed."""
    changed = 0
    for peer in peers:
        try:
            peer_id = PeerID.from_base58(peer)
        except Exception:  # not a peer ID: nothing to change
            continue
        was_out = peer_id in node.blacklist
        node.blacklist.register_success(peer_id)
        if leave_out:  # a fresh first ban from now, not one that may run out in the next few seconds
            node.blacklist.register_failure(peer_id)
        changed += was_out != leave_out
    return changed


def keep_out_of_lookups(dht: DHT, peers: Iterable[str]) -> Any:
    """A future (of how many were not left out already): this DHT node leaves ``peers`` (peer IDs) out of its
    lookups and stores for a while, as if each had just missed its first request: hivemind's own blacklist,
    5 s from now (one left out already is banned afresh: an older ban, hivemind's own included, could run out
    within the next few seconds; adversary run of stop 58: a matchmaking window's read then waited 3 s on a
    frozen node marked silent). For peers known to be silent (frozen, suspended, cut off without a reset):
    otherwise every lookup that reaches one waits hivemind's RPC timeout (3 s), each time its last ban runs
    out. Called again while they stay silent; one that answers again is let back with `let_back_into_lookups`."""
    return dht.run_coroutine(
        functools.partial(_leave_out, peers=tuple(sorted(peers)), leave_out=True), return_future=True
    )


def let_back_into_lookups(dht: DHT, peers: Iterable[str]) -> Any:
    """A future (of how many were left out): this DHT node asks ``peers`` again at once and forgets their past
    misses, as after an answer (hivemind's `Blacklist.register_success`). For peers heard from again: a node
    is otherwise asked only once its ban runs out, and its bans double on each repeat (5, 10, 20, 40 s...): a
    peer cut off for 25 s could stay out of the other side's lookups for a 20 s ban more after the heal."""
    return dht.run_coroutine(
        functools.partial(_leave_out, peers=tuple(sorted(peers)), leave_out=False), return_future=True
    )


__all__ = [
    "keep_out_of_lookups",
    "latest_many",
    "latest_many_within",
    "latest_within",
    "let_back_into_lookups",
    "store_within",
]
