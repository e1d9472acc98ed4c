"""Sealed checkpoints for a trainer: write, co-sign, spread and load verified state.

After an averaging round every member of the group holds bit-identical global parameters and outer
momentum (the all-reduce gives everyone the same bytes), so every member builds the *same*
manifest, signs it, and posts its signature under the manifest's digest in the DHT. Once a quorum
of the group's signatures is there, the manifest is sealed: any member publishes it by gossip.

A joiner takes the newest sealed manifest (gossip, or the run's DHT index), verifies it (signatures,
quorum of signers that hold live records in the run, run id, model digest), downloads the shards it
lacks from several donors with every digest checked, and resumes from exactly that state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import hivemind
import torch
from hivemind.utils.timed_storage import get_dht_time

from swarm.checkpoint.exchange import ShardExchange
from swarm.checkpoint.gossip import ManifestGossip
from swarm.checkpoint.manifest import (
    Manifest,
    ManifestRejected,
    SignedManifest,
    default_quorum,
    sign_manifest,
    verify_manifest,
)
from swarm.checkpoint.store import CheckpointStore
from swarm.identity import Identity

logger = logging.getLogger(__name__)


class StoreShardSource:
    """Serves the shards of a CheckpointStore to the exchange (the client verifies every digest)."""

    def __init__(self, store: CheckpointStore):
        self.store = store

    def has(self, digest: str) -> bool:
        return self.store.has(digest)

    def size(self, digest: str) -> int | None:
        try:
            return self.store.shard_path(digest).stat().st_size
        except (OSError, ValueError):
            return None

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        with open(self.store.shard_path(digest), "rb") as f:
            f.seek(offset)
            return f.read(length)


class CheckpointManager:
    """Owns a run's checkpoint store, shard exchange and manifest gossip for one trainer."""

    def __init__(self, dht: hivemind.DHT, *, identity: Identity, run_id: str, task: str, config_digest: str,
                 directory: Path, keep_last: int, run_peers: Callable[[], set[str]], seal_timeout_s: float = 15.0):
        self.dht, self.identity, self.run_id = dht, identity, run_id
        self.task, self.config_digest, self.run_peers = task, config_digest, run_peers
        self.seal_timeout_s = seal_timeout_s
        self.store = CheckpointStore(directory, keep_last=keep_last)
        self.sealed = 0
        self.newest: Manifest | None = None
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._sealer = ThreadPoolExecutor(1, thread_name_prefix="swarm-sealer")
        self.exchange = ShardExchange(dht, StoreShardSource(self.store))
        self.gossip = ManifestGossip(dht, run_id=run_id, verify=self._verify, peers=lambda: sorted(run_peers()),
                                     on_new=self._on_new)

    # ------------------------------------------------------------------------------------ verification
    def _verify(self, data: bytes) -> tuple[str, int]:
        manifest = verify_manifest(data, run_id=self.run_id)
        if manifest.task != self.task or manifest.config_digest != self.config_digest:
            raise ValueError(f"another model: {manifest.task} digest {manifest.config_digest[:12]}")
        signers = SignedManifest.from_bytes(data).signatures
        known = self.run_peers() | {self.identity.peer_id}
        live = sum(1 for peer in signers if peer in known)
        if live < default_quorum(len(manifest.participants)):
            raise ValueError(f"unknown signers: {live} of {len(signers)} signers hold live records in the run")
        return manifest.digest(), manifest.step

    def _on_new(self, data: bytes, digest: str, step: int) -> None:
        self.store.put_manifest(data)
        with self._lock:
            self.newest = SignedManifest.from_bytes(data).manifest
        logger.info(f"sealed checkpoint of run {self.run_id!r} at step {step} ({digest[:12]})")

    def newest_digest(self) -> tuple[int, str] | None:
        with self._lock:
            return None if self.newest is None else (self.newest.step, self.newest.digest())

    # ------------------------------------------------------------------------------------ sealing
    def seal_async(self, *, state: dict[str, torch.Tensor], step: int, participants: tuple[str, ...],
                   created_at: int, parent: str, metrics: dict[str, int] | None = None) -> Future:
        """Write the state, sign its manifest and collect the group's signatures, in the background."""
        state = {name: tensor.detach().clone() for name, tensor in state.items()}
        return self._sealer.submit(self._seal, state, step, participants, created_at, parent, metrics or {})

    def _seal(self, state: dict[str, torch.Tensor], step: int, participants: tuple[str, ...], created_at: int,
              parent: str, metrics: dict[str, int]) -> bool:
        try:
            shards = self.store.put_tensors(state)
            manifest = Manifest(version=1, run_id=self.run_id, step=step, round=step, task=self.task,
                                config_digest=self.config_digest, parent=parent, shards=tuple(shards),
                                participants=tuple(sorted(participants)), metrics=metrics, created_at=created_at)
            key = f"swarm/{self.run_id}/seal/{manifest.digest()}"
            peer_id, signature = sign_manifest(manifest, self.identity)
            self.dht.store(key, signature, expiration_time=get_dht_time() + 120, subkey=peer_id)
            quorum = default_quorum(len(manifest.participants))
            deadline = time.monotonic() + self.seal_timeout_s
            while time.monotonic() < deadline and not self._closing.is_set():
                signatures = self._collect(key, manifest)
                if len(signatures) >= quorum:
                    data = SignedManifest(manifest=manifest, signatures=signatures).to_bytes()
                    self.gossip.publish(data)
                    self.sealed += 1
                    self.store.prune()
                    return True
                self._closing.wait(0.2)  # polling the DHT for the others' signatures, with a deadline
            logger.info(f"step {step}: fewer than {quorum} signatures within {self.seal_timeout_s:.0f}s; not sealed")
            return False
        except Exception as e:  # sealing is best effort: training goes on, the next round seals again
            logger.warning(f"could not seal the checkpoint of step {step}: {e!r}")
            return False

    def _collect(self, key: str, manifest: Manifest) -> dict[str, str]:
        found = self.dht.get(key, latest=True)
        signatures: dict[str, str] = {}
        if found is None or not isinstance(found.value, dict):
            return signatures
        for peer, item in found.value.items():
            signature = getattr(item, "value", None)
            if isinstance(peer, str) and peer in manifest.participants and isinstance(signature, str):
                signed = SignedManifest(manifest=manifest, signatures={peer: signature})
                try:  # one bad signature must not spoil the others: check them one by one
                    verify_manifest(signed, run_id=self.run_id, quorum=1)
                except (ManifestRejected, ValueError):
                    continue
                signatures[peer] = signature
        return signatures

    # ------------------------------------------------------------------------------------ loading
    def load_newest(self, *, timeout_s: float = 120.0,
                    attempts: int = 3) -> tuple[Manifest, dict[str, torch.Tensor]] | None:
        """The newest sealed state of the run, verified end to end, or None if there is none yet.

        Donors keep only their last few checkpoints, so a manifest can be pruned while a joiner
        downloads it: then the joiner asks again for the newest one and retries.
        """
        deadline = time.monotonic() + timeout_s
        last_error: Exception | None = None
        for _ in range(attempts):
            data = self.gossip.fetch_newest_from_index(timeout_s=max(1.0, deadline - time.monotonic()))
            if data is not None:
                self.gossip.publish(data)  # verifies it; if newer than what we had, it becomes ours
            with self._lock:
                newest = self.newest
            if newest is None:
                return None
            try:
                return newest, self._download(newest, timeout_s=max(1.0, deadline - time.monotonic()))
            except Exception as e:  # pruned by its donors meanwhile, or unreachable: try the newest again
                last_error = e
                logger.info(f"could not download sealed step {newest.step}: {e!r}; asking for the newest again")
        raise RuntimeError(f"no sealed checkpoint could be downloaded in {attempts} attempts: {last_error!r}")

    def _download(self, manifest: Manifest, *, timeout_s: float) -> dict[str, torch.Tensor]:
        missing = self.store.missing_shards(manifest)
        if missing:
            donors = [p for p in manifest.participants if p in self.run_peers()] or sorted(self.run_peers())
            fetched, report = self.exchange.fetch({s.digest: s.size_bytes for s in missing}, donors,
                                                  timeout_s=timeout_s)
            for shard in missing:
                self.store.put_shard_bytes(fetched[shard.digest], expected_digest=shard.digest,
                                           expected_size_bytes=shard.size_bytes)
            logger.info(f"downloaded {report.bytes_downloaded} bytes of checkpoint shards from "
                        f"{len(report.per_donor_bytes)} donor(s) in {report.seconds:.2f}s")
        return self.store.load_state_dict(manifest)

    def close(self) -> None:
        self._closing.set()
        self._sealer.shutdown(wait=True, cancel_futures=True)  # a seal in progress stops at its next poll
        self.gossip.close()
        self.exchange.close()
