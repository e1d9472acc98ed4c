"""Publish this peer's signed capability record on a heartbeat; withdraw it on a clean exit."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from hivemind import DHT

from bootstrap.heartbeat import Heartbeat
from bootstrap.identity import Identity
from bootstrap.records import PeerRecord, peers_key, sign_record


class Advertiser(Heartbeat):
    """Every ``refresh_s`` seconds, sign ``build(issued_at, expires_at, seq)`` and store it in the DHT.

    The record expires ``expiry_s`` after it is issued, so a peer that dies vanishes from every
    reader within ``expiry_s`` (plus the reader's own refresh). ``close()`` publishes a signed
    ``left`` record that outlives the last live one, so readers drop the peer at once.
    """

    what = "capability record"
    whole_seconds = True  # the record signs its own integer expires_at

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
        super().__init__(
            dht,
            identity,
            peers_key(identity.peer_id),
            refresh_s=refresh_s,
            expiry_s=expiry_s,
            store_timeout_s=store_timeout_s,
            thread_name="swarm-advertiser",
        )
        self.build = build
        self.seq = 0

    @property
    def last_record(self) -> PeerRecord | None:
        return self.last

    def start(self) -> Advertiser:
        """Publish at once (blocking), then on the heartbeat."""
        self.publish()
        super().start()
        return self

    def refresh_now(self) -> None:
        """Publish at once (e.g. after a state change) instead of waiting for the heartbeat."""
        self.publish_soon()

    def publish(self, *, state: str | None = None) -> bool:
        return self.publish_now(state=state)

    def _signed(self, now: float, expiration: float, *, state: str | None = None) -> tuple[PeerRecord, Any]:
        self.seq += 1
        record = self.build(issued_at=now, expires_at=expiration, seq=self.seq)
        if state is not None:
            record = dataclasses.replace(record, state=state)
        return record, sign_record(record, self.identity)

    def close(self, *, withdraw: bool = True) -> None:
        """Stop the heartbeat and (by default) withdraw the record. Idempotent."""
        if super().close() and withdraw and self.dht.is_alive():
            self.publish(state="left")
