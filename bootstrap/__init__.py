"""Bootstrap: the ground floor. The swarm's entry point and what every Swarm process needs to start.

Owns
  * the bootstrap DHT node, `python -m bootstrap` (`node.BootstrapConfig`, `node.main`): a plain,
    long-lived hivemind DHT peer that prints the `--initial-peers` line other peers join with;
  * DHT start-up helpers (`node`): validated initial peers, identity files, a `start_dht` that fails
    with a clear error within a timeout instead of hanging, and a `stop_dht` that leaves no `p2pd`;
    bounded DHT stores and reads for synchronous callers (`dhtcalls`: a DHT whose process died never answers);
    `network.start_swarm_dht`: a DHT whose libp2p identity is the peer's Ed25519 key;
  * peer identity and domain-separated Ed25519 signatures (`identity`), which every floor uses;
  * the one exception taxonomy (`errors`: SwarmError, Rejected, ConfigError, StartError, NetworkError,
    StateError) and the signed-envelope helpers every signed payload parser uses (`envelope`: strict
    JSON, exact keys, {p, s} DHT values, typed dataclasses, field checks, a RejectionLog whose counter
    the owner passes in);
  * one network runtime per process and DHT (`runtime`: one event loop and one P2P replica hosting every
    stream handler and client call; `Handler`, `Served`, `StreamServer` for the protocols on it) and
    the one message framing of every stream protocol (`framing`, with its one `ProtocolError`);
  * GossipSub through the daemon (`pubsub`: a `P2P` whose p2pd runs ``-pubsub``, and the control-protocol
    client hivemind does not wrap); measured against our push gossip, used by no component yet;
  * config dataclasses mapped one-to-one onto command-line flags (`cli`);
  * signed capability records and their DHT validator (`records`): every Swarm DHT node, this one
    included, refuses a forged or replayed capability record;
  * owner-bound DHT records (`owned.OwnerBoundValidator`): every record a Swarm node stores or reads
    sits under its writer's peer ID and is signed by it, so no one can forge, overwrite or hide another's;
  * the process-lifetime reaper (`lifetime`): children (DHT, averager, `p2pd`) die with their parent;
    and `StopSignal`, SIGINT/SIGTERM as a stop request every entry point uses;
  * the signed heartbeat (`heartbeat.Heartbeat`): this peer's one owner-bound entry under a key,
    re-signed and stored on a beat (the capability record and the status entry are two);
  * the Prometheus endpoint (`metrics`): `serve_metrics` for any component's private registry, and
    the bootstrap node's own metrics (`--metrics-port`); the release, `version.SWARM_VERSION`.

Uses hivemind (DHT, P2P, PeerID, Multiaddr), pynacl, psutil and prometheus-client; rich and uvloop
for the CLI only. Imports no other Swarm package: every arrow points down to here.

Exports the names in `__all__`. They load lazily, so `python -m bootstrap.lifetime` (the watchdog)
imports psutil only, not hivemind and torch. Importing any of it first defers `scipy.optimize`, which
hivemind imports and no Swarm process uses, to its first use (`_private.deferred`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from bootstrap._private.deferred import defer_unused_imports

defer_unused_imports()  # before any Swarm module imports hivemind: a quarter of a second off every process's start

if TYPE_CHECKING:
    from bootstrap.lifetime import Stopped, StopSignal, set_parent_death_signal, start_reaper
    from bootstrap.metrics import MetricsServer, MetricsServerError, serve_metrics
    from bootstrap.node import (
        BootstrapConfig,
        DHTStartError,
        check_identity_file,
        ensure_identity,
        initial_peers_line,
        num_known_peers,
        parse_initial_peers,
        peer_id_of_maddr,
        reconnect,
        start_dht,
        stop_dht,
        visible_maddrs,
    )

_EXPORTS = {
    "start_reaper": "bootstrap.lifetime",
    "set_parent_death_signal": "bootstrap.lifetime",
    "StopSignal": "bootstrap.lifetime",
    "Stopped": "bootstrap.lifetime",
    "BootstrapConfig": "bootstrap.node",
    "DHTStartError": "bootstrap.node",
    "check_identity_file": "bootstrap.node",
    "ensure_identity": "bootstrap.node",
    "initial_peers_line": "bootstrap.node",
    "num_known_peers": "bootstrap.node",
    "parse_initial_peers": "bootstrap.node",
    "peer_id_of_maddr": "bootstrap.node",
    "reconnect": "bootstrap.node",
    "start_dht": "bootstrap.node",
    "stop_dht": "bootstrap.node",
    "visible_maddrs": "bootstrap.node",
    "MetricsServer": "bootstrap.metrics",
    "MetricsServerError": "bootstrap.metrics",
    "serve_metrics": "bootstrap.metrics",
}

__all__ = [
    "BootstrapConfig",
    "DHTStartError",
    "MetricsServer",
    "MetricsServerError",
    "StopSignal",
    "Stopped",
    "check_identity_file",
    "ensure_identity",
    "initial_peers_line",
    "num_known_peers",
    "parse_initial_peers",
    "peer_id_of_maddr",
    "reconnect",
    "serve_metrics",
    "set_parent_death_signal",
    "start_dht",
    "start_reaper",
    "stop_dht",
    "visible_maddrs",
]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'bootstrap' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
