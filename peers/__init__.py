"""Peers: what each peer can do, and the live resource graph of a network or run.

Owns capability probing (`probe`), signed capability records and their DHT validator (`records`),
the heartbeat that publishes them (`advertiser`), the resource graph with its placement score and
run discovery (`graph`), active bandwidth/RTT probes over libp2p streams (`bandwidth`), and the CLI
`python -m peers list|runs`. Uses hivemind's DHT and P2P, psutil, torch (device queries) and
`swarm.identity` for signatures; knows nothing of the peer process.
"""

from peers.advertiser import Advertiser
from peers.graph import (
    ResourceGraph,
    RunSummary,
    ScoredPeer,
    pick_run,
    score_peers,
    summarize_runs,
    unmet_requirements,
)
from peers.probe import probe_hardware, probe_software, reachability
from peers.records import (
    MAX_LIFETIME_S,
    MAX_RECORD_BYTES,
    PEERS_KEY,
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
    sign_record,
)

__all__ = [
    "MAX_LIFETIME_S", "MAX_RECORD_BYTES", "PEERS_KEY", "Advertiser", "Hardware", "Network", "PeerRecord",
    "PeerRecordValidator", "Performance", "RecordRejected", "Requirements", "ResourceGraph", "RunInfo",
    "RunSummary", "ScoredPeer", "Software", "Trust", "dht_record_rejections", "parse_record", "pick_run", "probe_hardware",
    "probe_software", "reachability", "score_peers", "sign_record", "summarize_runs", "unmet_requirements",
]
