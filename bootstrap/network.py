"""Start the DHT of a Swarm process: its libp2p identity is the peer's Ed25519 key, every record it
stores or reads must be signed by its subkey's owner (:class:`bootstrap.owned.OwnerBoundValidator`,
which signs this peer's own), and every capability record is checked by
:class:`bootstrap.records.PeerRecordValidator`."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from hivemind import DHT

from bootstrap import start_dht
from bootstrap.identity import Identity
from bootstrap.owned import OwnerBoundValidator
from bootstrap.records import PeerRecordValidator


def start_swarm_dht(
    identity: Identity,
    *,
    initial_peers: Sequence[str] = (),
    host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
    announce_maddrs: Sequence[str] = (),
    connect_timeout_s: float = 30.0,
    client_mode: bool = False,
    cancel: threading.Event | None = None,
    **dht_kwargs: Any,
) -> DHT:
    """A started DHT whose peer ID is ``identity.peer_id``; raises bootstrap.DHTStartError on failure.

    `cancel` as in `start_dht`: once set, the start-up wait gives up and raises KeyboardInterrupt.
    `dht_kwargs` go on to hivemind's DHTNode (e.g. `wait_timeout`, `blacklist_time`).
    """
    with identity.libp2p_identity_file() as identity_path:
        return start_dht(
            list(initial_peers),
            host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs),
            identity_path=identity_path,
            connect_timeout_s=connect_timeout_s,
            client_mode=client_mode,
            cancel=cancel,
            # hivemind's "is this identity taken" probe only understands RSA keys; Identity.lock()
            # guards against running one key twice on this machine instead.
            check_if_identity_free=False,
            record_validators=[PeerRecordValidator(), OwnerBoundValidator(identity)],
            # UPnP/NAT-PMP port mapping only makes sense for a peer listening beyond loopback
            nat_port_map=not all(m.startswith(("/ip4/127.", "/ip6/::1/")) for m in host_maddrs),
            **dht_kwargs,
        )
