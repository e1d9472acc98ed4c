"""Publish this peer's signed capability record on a heartbeat; withdraw it on a clean exit."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from hivemind import DHT

from bootstrap.dhtcalls import store_within
from bootstrap.identity import Identity
from bootstrap.records import PeerRecord, peers_key, sign_record

logger = logging.getLogger(__name__)


class Advertiser:
    """Every ``refresh_s`` seconds, sign ``build(issued_at, expires_at, seq)`` and store it in the DHT.

    The record expires ``expiry_s`` after it is issued, so a peer that dies vanishes from every
    reader within ``expiry_s`` (plus the reader's own refresh). ``close()`` publishes a signed
    ``left`` record that outlives the last live one, so readers drop the peer at once.
    """

    def __init__(
        self,
        dht: DHT,
        identity: Identity,
        build: Callable[..., PeerRecord],
        *,
        refresh_s: float = 15.0,
        expiry_s: float = 45.0,
        store_timeout_s: float = 10.0,
    ):
        if not 0 < refresh_s < expiry_s:
            raise ValueError(f"refresh_s must be in (0, expiry_s={expiry_s}), got {refresh_s!r}")
        self.dht, self.identity, self.build = dht, identity, build
        self.refresh_s, self.expiry_s, self.store_timeout_s = refresh_s, expiry_s, store_timeout_s
        self.seq = 0
        self.published = 0
        self.failures = 0
        self.last_record: PeerRecord | None = None
        self._last_expires_at = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="swarm-advertiser", daemon=True)

    def start(self) -> Advertiser:
        self.publish()
        self._thread.start()
        return self

    def refresh_now(self) -> None:
        """Publish at once (e.g. after a state change) instead of waiting for the heartbeat."""
        self._wake.set()

    def publish(self, *, state: str | None = None) -> bool:
        with self._lock:
            self.seq += 1
            issued_at = int(time.time())
            # the DHT keeps the value with the latest expiry: each record must outlive the previous one
            expires_at = max(issued_at + int(self.expiry_s), self._last_expires_at + 1)
            try:
                record = self.build(issued_at=issued_at, expires_at=expires_at, seq=self.seq)
                if state is not None:
                    record = _with_state(record, state)
                failure = store_within(
                    self.dht,
                    peers_key(self.identity.peer_id),
                    sign_record(record, self.identity),
                    subkey=self.identity.peer_id,
                    expiration_time=expires_at,
                    timeout_s=self.store_timeout_s,
                )
            except Exception as e:  # building or signing it failed
                failure = repr(e)
            if failure is not None:  # a failed heartbeat is retried on the next one
                logger.warning("could not publish this peer's capability record: %s", failure)
                self.failures += 1
                return False
            self.published += 1
            self.last_record = record
            self._last_expires_at = expires_at
            return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=self.refresh_s)
            self._wake.clear()
            if not self._stop.is_set():
                self.publish()

    def close(self, *, withdraw: bool = True) -> None:
        """Stop the heartbeat and (by default) withdraw the record. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.store_timeout_s + 1)
        if withdraw and self.dht.is_alive():
            self.publish(state="left")


def _with_state(record: PeerRecord, state: str) -> PeerRecord:
    import dataclasses

    return dataclasses.replace(record, state=state)
