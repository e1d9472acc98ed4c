"""Verifiable checkpoints, locally: a content-addressed shard store and signed manifests.

Owns the on-disk layout of checkpoints (`store`: safetensors shards named by SHA-256, atomic
writes, re-hashing on every read, pruning) and the manifest that describes one training state
(`manifest`: canonical JSON, Ed25519 signatures with run-bound domain separation, strict parsing,
quorum/replay/lineage checks). Those two touch no network; the network side builds on their API
(`put_manifest` then `put_shard_bytes` for downloads; `read_shard` to serve): `exchange` (shards between
peers), `gossip` (sealed manifests), `posts` (a group's seal signatures and receipts) and `sync` (the
trainer's sealing and loading).

Depends on `bootstrap.identity` (signing, canonical JSON, peer IDs), `safetensors` and `torch`.
Never loads pickle.
Exports: CheckpointStore, ShardRejected, PruneResult, TensorInfo, ShardInfo, Manifest,
SignedManifest, ManifestRejected, sign_manifest, verify_manifest, verify_lineage,
public_key_from_peer_id, default_quorum, MANIFEST_KIND, ALLOWED_DTYPES.
"""

from swarm.checkpoint.manifest import (
    ALLOWED_DTYPES,
    MANIFEST_KIND,
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestRejected,
    ShardInfo,
    SignedManifest,
    TensorInfo,
    default_quorum,
    public_key_from_peer_id,
    sign_manifest,
    verify_lineage,
    verify_manifest,
)
from swarm.checkpoint.store import DEFAULT_MAX_SHARD_BYTES, CheckpointStore, PruneResult, ShardRejected

__all__ = [
    "ALLOWED_DTYPES",
    "DEFAULT_MAX_SHARD_BYTES",
    "MANIFEST_KIND",
    "MAX_MANIFEST_BYTES",
    "CheckpointStore",
    "Manifest",
    "ManifestRejected",
    "PruneResult",
    "ShardInfo",
    "ShardRejected",
    "SignedManifest",
    "TensorInfo",
    "default_quorum",
    "public_key_from_peer_id",
    "sign_manifest",
    "verify_lineage",
    "verify_manifest",
]
