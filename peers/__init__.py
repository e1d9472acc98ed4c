"""Peers: what each peer can do, and the live resource graph of a network or run.

Owns capability probing (`probe`), the heartbeat that publishes the signed capability records
(`advertiser`), the resource graph with its placement score and run discovery (`graph`), active
bandwidth/RTT probes over libp2p streams (`bandwidth`), and the CLI `python -m peers list|runs`.
Uses the ground floor, `bootstrap` (identity, the records' schema and DHT validator, DHT start-up;
its record names are re-exported here), hivemind's DHT and P2P, psutil and torch (device queries);
knows nothing of the peer process.
"""

from bootstrap.records import (
    MAX_LIFETIME_S,
    MAX_RECORD_BYTES,
    PEERS_KEYS,
    PEERS_SHARDS,
    Hardware,
    Network,
    PeerRecord,
    PeerRecordValidator,
    Performance,
    RecordRejected,
    Requirements,
    RunInfo,
    Software,
    Trust,
    dht_record_rejections,
    parse_record,
    peers_key,
    sign_record,
)
from peers.advertiser import Advertiser
from peers.graph import ResourceGraph, RunSummary, ScoredPeer, pick_run, score_peers, summarize_runs, unmet_requirements
from peers.probe import probe_hardware, probe_software, reachability

__all__ = [
    "MAX_LIFETIME_S",
    "MAX_RECORD_BYTES",
    "PEERS_KEYS",
    "PEERS_SHARDS",
    "Advertiser",
    "Hardware",
    "Network",
    "PeerRecord",
    "PeerRecordValidator",
    "Performance",
    "RecordRejected",
    "Requirements",
    "ResourceGraph",
    "RunInfo",
    "RunSummary",
    "ScoredPeer",
    "Software",
    "Trust",
    "dht_record_rejections",
    "parse_record",
    "peers_key",
    "pick_run",
    "probe_hardware",
    "probe_software",
    "reachability",
    "score_peers",
    "sign_record",
    "summarize_runs",
    "unmet_requirements",
]
