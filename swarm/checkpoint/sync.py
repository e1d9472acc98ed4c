"""Sealed checkpoints for a trainer: write, co-sign, spread and load verified state.

After an averaging round every member of the group holds bit-identical global parameters and outer
momentum (the all-reduce gives everyone the same bytes), so every member builds the *same*
manifest, signs it, and posts its signature under the manifest's digest to the other members
(`swarm.checkpoint.posts`: directly, the DHT only for a member it cannot reach). Once a quorum of the
group's signatures is there, the manifest is sealed: any member publishes it by gossip.

A joiner takes the newest sealed manifest (gossip, or the run's DHT index), verifies it (signatures,
quorum of signers that hold live records in the run, run id, model digest), downloads the shards it
lacks from several donors with every digest checked, and resumes from exactly that state.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hivemind
import torch

from bootstrap.identity import Identity
from swarm.checkpoint.exchange import ShardExchange
from swarm.checkpoint.gossip import ManifestGossip
from swarm.checkpoint.manifest import (
    Manifest,
    ManifestRejected,
    ShardInfo,
    SignedManifest,
    default_quorum,
    sign_manifest,
    verify_manifest,
)
from swarm.checkpoint.posts import GroupPosts
from swarm.checkpoint.store import CheckpointStore
from swarm.ledger.receipts import ReceiptRejected, SignedReceipt, verify_receipt

ANNOUNCERS = 1
"""Members of a sealing group that write its manifest into the run's DHT index (one: if it is gone, the
index lags one seal, and the next group's seal brings it up to date)."""

logger = logging.getLogger(__name__)


def seal_key(run_id: str, manifest_digest: str) -> str:
    """Where a group's members post their signatures of the manifest they are sealing (subkey: signer)."""
    return f"swarm/{run_id}/seal/{manifest_digest}"


def receipts_key(run_id: str, group_id: str) -> str:
    """Where a group's members post their signed receipts of one round (subkey: the receipt's peer)."""
    return f"swarm/{run_id}/receipts/{group_id}"


@dataclass(frozen=True, kw_only=True, slots=True)
class SealRequest:
    """What a group member seals after a round (identical on every member, so all sign the same manifest)."""

    state: dict[str, torch.Tensor]
    """The global parameters and outer momentum, as every member holds them."""
    step: int
    """The run's round counter after the round (the manifest's step and round)."""
    participants: tuple[str, ...]
    """The group's members: the only valid signers."""
    created_at: int
    """Unix seconds agreed by the group (the earliest time gathered from its members)."""
    parent: str
    """Digest of the newest sealed manifest any member knew, or "" for the first one."""
    metrics: dict[str, int] = field(default_factory=dict)
    """Integer metrics that every member computed identically."""
    contributions: dict[str, int] = field(default_factory=dict)
    """Member -> samples it contributed, from the metadata the whole group gathered."""


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

    @classmethod
    def for_run(
        cls,
        dht: hivemind.DHT,
        identity: Identity,
        config: Any,
        task: Any,
        run_peers: Callable[[], set[str]],
        on_event: Callable[[str, dict], None],
    ) -> CheckpointManager:
        """The manager of ``identity``'s checkpoints of a trainer's run (``config``: its `swarm.config.TrainerConfig`;
        ``task``: its `swarm.config.TaskInfo`), kept in CHECKPOINT_DIR/RUN/PEER_ID."""
        run, ck = config.run, config.checkpoint
        directory = Path(ck.checkpoint_dir).expanduser() / run / identity.peer_id
        return cls(
            dht,
            identity=identity,
            run_id=run,
            task=task.name,
            config_digest=task.config_digest,
            directory=directory,
            keep_last=ck.keep_checkpoints,
            run_peers=run_peers,
            on_event=on_event,
        )

    def rejections(self) -> dict[str, Counter[str]]:
        """Refused untrusted input by source (manifest, receipt, gossip, post) and reason."""
        return {
            "manifest": self.manifest_rejections,
            "receipt": self.receipt_rejections,
            "gossip": self.gossip.rejected,
            "post": self.posts.rejected,
        }

    def __init__(
        self,
        dht: hivemind.DHT,
        *,
        identity: Identity,
        run_id: str,
        task: str,
        config_digest: str,
        directory: Path,
        keep_last: int,
        run_peers: Callable[[], set[str]],
        seal_timeout_s: float = 15.0,
        receipt_timeout_s: float = 5.0,
        on_event: Callable[[str, dict], None] | None = None,
    ):
        self.identity, self.run_id = identity, run_id
        self.task, self.config_digest, self.run_peers = task, config_digest, run_peers
        self.seal_timeout_s, self.receipt_timeout_s = seal_timeout_s, receipt_timeout_s
        self.on_event = on_event
        """Told ("receipts", {"receipts": [...]}) and ("checkpoint_sealed", {...}) from the sealer thread."""
        self.receipt_rejections: Counter[str] = Counter()
        self.manifest_rejections: Counter[str] = Counter()
        self._newest: tuple[int, SealRequest | None] = (-1, None)
        """The newest round given to the sealer, and its seal until the sealer takes it up: a seal still waiting
        when a newer round comes is dropped at once (it would be skipped as overtaken), so the sealer's queue
        holds at most one copy of the state however far the rounds run ahead of the disk."""
        self.store = CheckpointStore(directory, keep_last=keep_last)
        self.sealed = 0
        self.newest: Manifest | None = None
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._sealer = ThreadPoolExecutor(1, thread_name_prefix="swarm-sealer")
        self.exchange = ShardExchange(dht, StoreShardSource(self.store))
        self.posts = GroupPosts(dht, run_id=run_id, prefixes=(seal_key(run_id, ""), receipts_key(run_id, "")))
        """Seal signatures and receipts, to and from the group's members (the DHT the fallback)."""
        self.gossip = ManifestGossip(
            dht,
            run_id=run_id,
            verify=self._verify,
            peers=lambda: sorted(run_peers()),
            on_new=self._on_new,
            announce=self._announces,
            holders=_signers_group,
        )

    # ------------------------------------------------------------------------------------ verification
    def _verify(self, data: bytes) -> tuple[str, int]:
        manifest = verify_manifest(data, run_id=self.run_id, counter=self.manifest_rejections)
        if manifest.task != self.task or manifest.config_digest != self.config_digest:
            raise ValueError(f"another model: {manifest.task} digest {manifest.config_digest[:12]}")
        signers = SignedManifest.from_bytes(data).signatures
        known = self.run_peers() | {self.identity.peer_id}
        if self.identity.peer_id in signers:  # our own seal: we averaged with its group moments ago and
            known |= set(manifest.participants)  # checked each co-signer's signature, records seen or not
        live = sum(1 for peer in signers if peer in known)
        if live < default_quorum(len(manifest.participants)):
            raise ValueError(f"unknown signers: {live} of {len(signers)} signers hold live records in the run")
        return manifest.digest(), manifest.step

    def _announces(self, data: bytes, digest: str) -> bool:
        """:data:`ANNOUNCERS` members of the sealing group write its manifest into the run's DHT index
        (the same on every member: the first by sha256(digest + peer ID)), not every member and every
        peer that hears of it: each copy there is read by every joiner and anti-entropy pull, and each
        DHT store costs ~20 KB of traversal besides the value. Measured, 4 peers sealing every round:
        all members writing, 137 KB of the 278 KB each peer sent per round besides the averaged
        tensors; two, 68 KB."""
        participants = SignedManifest.from_bytes(data).manifest.participants
        ranked = sorted(participants, key=lambda p: hashlib.sha256(f"{digest}{p}".encode()).digest())
        return self.identity.peer_id in ranked[:ANNOUNCERS]

    def _on_new(self, data: bytes, digest: str, step: int) -> None:
        self.store.put_manifest(data)
        with self._lock:
            self.newest = SignedManifest.from_bytes(data).manifest
        logger.info("sealed checkpoint of run %r at step %s (%s)", self.run_id, step, digest[:12])

    def newest_digest(self) -> tuple[int, str] | None:
        with self._lock:
            return None if self.newest is None else (self.newest.step, self.newest.digest())

    # ------------------------------------------------------------------------------------ after a round
    def finish_round_async(self, *, receipt: SignedReceipt | None, seal: SealRequest | None) -> Future:
        """In the background: swap signed participation receipts with the group and, with ``seal``, write
        the state, sign its manifest and collect the group's signatures; the sealed manifest carries the
        receipts gathered by then. Work for a round already overtaken by a newer one is cut short, and a seal
        overtaken before the sealer took it up is dropped at once. ``seal.state`` is the sealer's from here on:
        tensors the caller does not change (`swarm.outer.DiLoCo.state_dict` makes copies)."""
        round_ = seal.step if seal is not None else receipt.receipt.round if receipt is not None else -1
        with self._lock:
            newest = self._newest[0]
            if round_ > newest or (round_ == newest and seal is not None):
                self._newest = (round_, seal)
        return self._sealer.submit(self._finish_round, receipt, round_)

    def flush(self, *, cancel: threading.Event | None = None) -> bool:
        """Wait for the work `finish_round_async` was given so far: each round's receipts swapped and its seal, if
        any, sealed or given up. True if it ended; the wait is bounded by that work's own deadlines
        (`seal_timeout_s`, then `receipt_timeout_s`; an overtaken round's work ends at once), and ends within 0.1 s
        of ``cancel`` being set (a stop request)."""
        try:  # the sealer has one worker and runs its queue in order: the marker is done once all before it is
            marker = self._sealer.submit(lambda: None)
        except RuntimeError:  # closed: nothing runs any more
            return True
        deadline = time.monotonic() + self.seal_timeout_s + self.receipt_timeout_s + 1.0
        while not marker.done() and time.monotonic() < deadline:
            if cancel is not None and cancel.is_set():
                break
            wait([marker], timeout=0.1)
        return marker.done()

    def _overtaken(self, round_: int) -> bool:
        with self._lock:
            return self._newest[0] > round_

    def _take_seal(self, round_: int) -> SealRequest | None:
        """Round ``round_``'s seal, if it is still the newest (handed over once)."""
        with self._lock:
            newest, waiting = self._newest
            if newest != round_ or waiting is None:
                return None
            self._newest = (newest, None)
            return waiting

    def _finish_round(self, receipt: SignedReceipt | None, round_: int) -> bool:
        try:
            receipts = _ReceiptSwap(self, receipt) if receipt is not None else None
            seal = self._take_seal(round_)
            sealed = self._seal(seal, receipts) if seal is not None else False
            if receipts is not None:
                receipts.wait(deadline=time.monotonic() + self.receipt_timeout_s, round_=round_)
                self.posts.discard(receipts.key)
                self._tell("receipts", {"receipts": [r.to_dict() for r in receipts.sorted()]})
            return sealed
        except Exception as e:  # evidence and sealing are best effort: training goes on, the next round seals
            logger.warning("after round %s: could not swap receipts or seal: %r", round_, e)
            return False

    def _tell(self, kind: str, body: dict) -> None:
        if self.on_event is not None:
            try:
                self.on_event(kind, body)
            except Exception as e:  # a listener's bug must not stop sealing
                logger.warning("checkpoint event listener failed on %s: %r", kind, e)

    def _seal(self, seal: SealRequest, receipts: _ReceiptSwap | None) -> bool:
        step = seal.step
        shards = self.store.put_tensors(seal.state)
        manifest = Manifest(
            version=1,
            run_id=self.run_id,
            step=step,
            round=step,
            task=self.task,
            config_digest=self.config_digest,
            parent=seal.parent,
            shards=tuple(shards),
            participants=tuple(sorted(seal.participants)),
            metrics=seal.metrics,
            created_at=seal.created_at,
            contributions=seal.contributions,
        )
        key = seal_key(self.run_id, manifest.digest())
        peer_id, signature = sign_manifest(manifest, self.identity)
        self.posts.post(key, signature, sender=peer_id, to=manifest.participants)
        quorum = default_quorum(len(manifest.participants))
        began = time.monotonic()
        deadline = began + self.seal_timeout_s
        while time.monotonic() < deadline and not self._closing.is_set() and not self._overtaken(step):
            seen = self.posts.arrivals  # before the read: a post that comes after it ends the wait below at once
            signatures = self._collect(key, manifest, since=began)
            if len(signatures) >= quorum:
                self.posts.discard(key)
                if receipts is not None:  # a little longer for the last members' receipts, then seal
                    receipts.wait(deadline=min(deadline, time.monotonic() + self.receipt_timeout_s), round_=step)
                self._publish_sealed(manifest, signatures, receipts)
                return True
            if receipts is not None:
                receipts.poll()
            self.posts.wait(0.2, since=seen)  # for the others' signatures (a post wakes it), with a deadline
        self.posts.discard(key)
        if self._closing.is_set():
            logger.info("step %s: left before the group's %s signatures came; not sealed", step, quorum)
        elif self._overtaken(step):  # a newer round's seal takes its place: routine when rounds come fast
            logger.debug("step %s: not sealed, overtaken by a newer round", step)
        else:
            logger.info("step %s: fewer than %s signatures within %.0fs; not sealed", step, quorum, self.seal_timeout_s)
        return False

    def _publish_sealed(self, manifest: Manifest, signatures: dict[str, str], receipts: _ReceiptSwap | None) -> None:
        attached = tuple(
            r
            for r in (receipts.sorted() if receipts is not None else ())
            if manifest.contributions.get(r.receipt.peer, r.receipt.samples) == r.receipt.samples
        )
        data = SignedManifest(manifest=manifest, signatures=signatures, receipts=attached).to_bytes()
        self.gossip.publish(data)
        self.sealed += 1
        self.store.prune()
        self._tell(
            "checkpoint_sealed",
            {
                "step": manifest.step,
                "digest": manifest.digest(),
                "signers": sorted(signatures),
                "participants": list(manifest.participants),
                "metrics": dict(manifest.metrics),
                "receipts": len(attached),
            },
        )

    def _collect(self, key: str, manifest: Manifest, *, since: float) -> dict[str, str]:
        signatures: dict[str, str] = {}
        for peer, signature in self.posts.read(key, since=since):
            if peer in signatures:
                continue
            if isinstance(peer, str) and peer in manifest.participants and isinstance(signature, str):
                signed = SignedManifest(manifest=manifest, signatures={peer: signature})
                try:  # one bad signature must not spoil the others: check them one by one
                    verify_manifest(signed, run_id=self.run_id, quorum=1, counter=self.manifest_rejections)
                except (ManifestRejected, ValueError):
                    continue
                signatures[peer] = signature
        return signatures

    # ------------------------------------------------------------------------------------ loading
    def load_newest(
        self,
        *,
        timeout_s: float = 120.0,
        attempts: int = 3,
        newer_than: int | None = None,
        cancel: threading.Event | None = None,
    ) -> tuple[Manifest, dict[str, torch.Tensor]] | None:
        """The newest sealed state of the run, verified end to end, or None if there is none yet (or,
        with ``newer_than``, none sealed at a later round than that: nothing is downloaded then). Once
        ``cancel`` is set (a stop request), the search or download in progress ends and `bootstrap.Stopped`
        is raised.

        Donors keep only their last few checkpoints, so a manifest can be pruned while a joiner
        downloads it: then the joiner asks again for the newest one and retries.
        """
        deadline = time.monotonic() + timeout_s
        last_error: Exception | None = None
        for _ in range(attempts):
            data = self.gossip.fetch_newest_from_index(timeout_s=max(1.0, deadline - time.monotonic()), cancel=cancel)
            if data is not None:
                self.gossip.publish(data)  # verifies it; if newer than what we had, it becomes ours
            with self._lock:
                newest = self.newest
            if newest is None or (newer_than is not None and newest.round <= newer_than):
                return None
            try:
                return newest, self._download(newest, timeout_s=max(1.0, deadline - time.monotonic()), cancel=cancel)
            except Exception as e:  # pruned by its donors meanwhile, or unreachable: try the newest again
                last_error = e
                logger.info("could not download sealed step %s: %r; asking for the newest again", newest.step, e)
        raise RuntimeError(f"no sealed checkpoint could be downloaded in {attempts} attempts: {last_error!r}")

    def resume(
        self,
        outer: Any,
        *,
        timeout_s: float,
        newer_than: int | None = None,
        reason: str = "join",
        cancel: threading.Event | None = None,
    ) -> tuple[Manifest | None, str | None]:
        """Load the run's newest sealed state into ``outer`` (a `swarm.outer.DiLoCo`) if it fits it, and
        record it ("state_synced", with ``reason``); ``cancel`` as in `load_newest`.

        Returns (manifest, None) once loaded, (None, problem) when one was refused or could not be had
        (logged), and (None, None) when there is none (with ``newer_than``: none sealed after that round)."""
        started = time.monotonic()
        try:
            loaded = self.load_newest(timeout_s=timeout_s, newer_than=newer_than, cancel=cancel)
        except Exception as e:  # a bad or unreachable checkpoint: say why; the caller trains on
            logger.warning("could not load the newest sealed checkpoint: %r", e)
            return None, "sealed checkpoint"
        if loaded is None:
            logger.info(
                "no sealed checkpoint of this run yet: starting from the model as given (the run's genesis)"
                if newer_than is None
                else f"no sealed checkpoint of this run after round {newer_than}: training on from this peer's own"
            )
            return None, None
        manifest, state = loaded
        problem = outer.state_dict_problem(state)
        if newer_than is not None and manifest.round <= newer_than:
            problem = f"sealed at round {manifest.round}, not after this peer's round {newer_than}"
        if problem is not None:
            logger.warning("rejected the sealed checkpoint: %s", problem)
            return None, f"sealed checkpoint: {problem}"
        outer.load_state_dict(state, round_=manifest.round)
        logger.info("resumed from sealed checkpoint %s at round %s", manifest.digest()[:12], manifest.round)
        self._tell(
            "state_synced",
            {
                "round": manifest.round,
                "step": manifest.step,
                "manifest": manifest.digest(),
                "seconds": time.monotonic() - started,
                "reason": reason,
                "participants": len(manifest.participants),
            },
        )
        return manifest, None

    def _download(
        self, manifest: Manifest, *, timeout_s: float, cancel: threading.Event | None = None
    ) -> dict[str, torch.Tensor]:
        deadline = time.monotonic() + timeout_s

        def fetch(missing: list[ShardInfo]) -> None:
            donors = [p for p in manifest.participants if p in self.run_peers()] or sorted(self.run_peers())
            fetched, report = self.exchange.fetch(
                {s.digest: s.size_bytes for s in missing},
                donors,
                timeout_s=max(1.0, deadline - time.monotonic()),
                cancel=cancel,
            )
            for shard in missing:
                self.store.put_shard_bytes(
                    fetched[shard.digest], expected_digest=shard.digest, expected_size_bytes=shard.size_bytes
                )
            logger.info(
                "downloaded %s bytes of checkpoint shards from %s donor(s) in %.2fs (%s; %s retries%s)",
                report.bytes_downloaded,
                len(report.per_donor_bytes),
                report.seconds,
                ", ".join(f"{donor}: {n} B" for donor, n in report.per_donor_bytes.most_common()),
                report.retries,
                "".join(f", {reason} {n}" for reason, n in report.failures.items()),
            )

        return self.store.load_fetching(manifest, fetch)

    def close(self) -> None:
        self._closing.set()
        self.posts.close()  # wakes a seal waiting for posts
        self._sealer.shutdown(wait=True, cancel_futures=True)  # a seal in progress stops at its next poll
        self.gossip.close()
        self.exchange.close()


def _signers_group(data: bytes) -> tuple[str, ...]:
    """The group that sealed a manifest: each member signed it and holds it, so none is pushed it
    (measured, 4 peers sealing every round: the members' pushes to each other were ~40 KB per peer
    and round, the manifest's 8.6 KB three times over, for nothing)."""
    return SignedManifest.from_bytes(data).manifest.participants


class _ReceiptSwap:
    """One round's receipt exchange: this peer's receipt is posted to the members at once (`GroupPosts`, the
    group's key); theirs are gathered (each verified, and for the same round and group) as they come."""

    def __init__(self, manager: CheckpointManager, own: SignedReceipt):
        self.manager, self.own = manager, own
        self.key = receipts_key(manager.run_id, own.receipt.group_id)
        self.found: dict[str, SignedReceipt] = {own.receipt.peer: own}
        self.began = time.monotonic()
        manager.posts.post(self.key, own.to_dict(), sender=own.receipt.peer, to=own.receipt.members)

    def complete(self) -> bool:
        return set(self.found) >= set(self.own.receipt.members)

    def sorted(self) -> list[SignedReceipt]:
        return [self.found[peer] for peer in sorted(self.found)]

    def wait(self, *, deadline: float, round_: int) -> None:
        """Poll until every member's receipt is in, ``deadline`` passes or a newer round overtakes this one."""
        while not self.complete():
            seen = self.manager.posts.arrivals  # before the read: a post that comes after it ends the wait at once
            self.poll()
            if self.complete() or time.monotonic() >= deadline or self.manager._overtaken(round_):
                return
            if self.manager._closing.is_set():
                return
            self.manager.posts.wait(0.2, since=seen)  # for the others' receipts (a post wakes it), with a deadline

    def poll(self) -> None:
        if self.complete():
            return
        own = self.own.receipt
        for peer, value in self.manager.posts.read(self.key, since=self.began)[: 4 * len(own.members)]:
            if peer in self.found:
                continue
            try:
                signed = verify_receipt(value, run_id=self.manager.run_id, counter=self.manager.receipt_rejections)
            except ReceiptRejected:
                continue
            r = signed.receipt
            if r.peer == peer and (r.round, r.group_id, r.members) == (own.round, own.group_id, own.members):
                self.found[peer] = signed
            else:
                self.manager.receipt_rejections["another round or peer"] += 1
