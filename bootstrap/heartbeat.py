"""A signed heartbeat: this peer's one owner-bound DHT entry under a key, re-signed and stored on a beat.

The capability record (`peers.Advertiser`) and the status entry (`swarm.status.StatusPublisher`) are both
one: a background thread that signs a fresh value every ``refresh_s`` (and soon after `publish_soon`) and
stores it under the peer's own subkey, each value expiring after the previous one.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from hivemind import DHT

from bootstrap.dhtcalls import process_gone, store_within
from bootstrap.identity import Identity

logger = logging.getLogger(__name__)


class Heartbeat:
    """Keeps this peer's entry under ``key`` (subkey: its peer ID) fresh.

    A subclass says what to sign in `_signed` and names it in ``what`` (for the log). Each value expires
    ``expiry_s`` after it is signed and always after the previous one: the DHT keeps the value with the
    latest expiration, so a value that expired sooner would be dropped. A peer that dies therefore vanishes
    from every reader within ``expiry_s``. ``whole_seconds`` expirations (for records that sign their own
    integer expiry) step by a second, others by a millisecond; so that those steps never carry a value's
    expiration past ``expiry_s`` from its signing, the beat publishes a ``whole_seconds`` value at most once
    a second (`publish_now` itself is not throttled: a direct call may still step ahead, as ``close``'s
    withdrawal means to). A failed store is counted in ``failures``, logged (a warning for the first of a
    run of failures) and retried on the next beat. The thread publishes at most once per ``min_interval_s``,
    so a burst of `publish_soon` calls is one publication.
    """

    what = "entry"
    whole_seconds = False
    min_interval_s = 0.0

    def __init__(
        self,
        dht: DHT,
        identity: Identity,
        key: str,
        *,
        refresh_s: float,
        expiry_s: float,
        store_timeout_s: float,
        thread_name: str,
    ):
        if not 0 < refresh_s < expiry_s:
            raise ValueError(f"refresh_s must be in (0, expiry_s={expiry_s!r}), got {refresh_s!r}")
        if not store_timeout_s > 0:
            raise ValueError(f"store_timeout_s must be > 0, got {store_timeout_s!r}")
        self.dht, self.identity, self.key = dht, identity, key
        self.refresh_s, self.expiry_s, self.store_timeout_s = refresh_s, expiry_s, store_timeout_s
        self.published = 0
        self.failures = 0
        self.last: Any = None
        """What `_signed` returned to keep, for the last value the DHT took."""
        self._last_expiration = 0.0
        self._last_publish_at = -math.inf
        self._failures_in_a_row = 0
        self._lock = threading.Lock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)

    def _signed(self, now: float, expiration: float, **options: Any) -> tuple[Any, Any]:
        """``(kept, value)``: what to keep as `last` once stored, and the signed DHT value."""
        raise NotImplementedError

    def start(self) -> Heartbeat:
        """Start the beat; the first publication happens at once, in the background, unless one was made."""
        if self._thread.ident is None and not self._stop.is_set():  # not started yet, not closed
            self._thread.start()
            if self.published == 0:
                self._wake.set()
        return self

    def publish_soon(self) -> None:
        """Ask the background thread to publish now (never blocks the caller)."""
        self._wake.set()

    def publish_now(self, **options: Any) -> bool:
        """Sign and store a value now (blocks up to ``store_timeout_s``); True if the DHT took it."""
        with self._lock:
            self._last_publish_at = time.monotonic()
            now = time.time()
            step = 1 if self.whole_seconds else 0.001
            expiration = max(now + self.expiry_s, self._last_expiration + step)
            if self.whole_seconds:
                now, expiration = int(now), int(expiration)
            try:
                kept, value = self._signed(now, expiration, **options)
                failure = store_within(
                    self.dht,
                    self.key,
                    value,
                    subkey=self.identity.peer_id,
                    expiration_time=expiration,
                    timeout_s=self.store_timeout_s,
                )
            except Exception as e:  # building or signing it failed
                failure = repr(e)
            if failure is not None:  # the next beat tries again
                self.failures += 1
                self._failures_in_a_row += 1
                level = logging.WARNING if self._failures_in_a_row == 1 else logging.DEBUG
                logger.log(level, "could not publish this peer's %s: %s", self.what, failure)
                return False
            self.published, self.last, self._last_expiration = self.published + 1, kept, expiration
            self._failures_in_a_row = 0
            return True

    def close(self) -> bool:
        """Stop the beat (bounded by ``store_timeout_s``); False if it was already closed."""
        if self._stop.is_set():
            return False
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            # a DHT whose process died (its process group's signal) never answers the store in flight
            self._thread.join(timeout=0.5 if process_gone(self.dht) else self.store_timeout_s + 1)
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=self.refresh_s)
            min_interval_s = max(self.min_interval_s, 1.0 if self.whole_seconds else 0.0)
            delay_s = self._last_publish_at + min_interval_s - time.monotonic()
            if self._stop.wait(timeout=max(0.0, delay_s)):  # coalesce a burst of wakes into one publication
                return
            self._wake.clear()
            self.publish_now()
