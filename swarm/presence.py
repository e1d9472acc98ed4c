"""A trainer's presence in its run: the signed capability record on a heartbeat, the status board
entry, bandwidth probes to a few peers of the run, the cached set of the run's live peers, and the
pings that bring a peer cut off from the others back into the DHT.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from hivemind import DHT

from bootstrap import peer_id_of_maddr, reconnect, visible_maddrs
from bootstrap.identity import Identity
from peers import (
    Advertiser,
    Network,
    PeerRecord,
    Performance,
    Requirements,
    ResourceGraph,
    RunInfo,
    Trust,
    probe_hardware,
    probe_software,
    reachability,
    unmet_requirements,
)
from peers.bandwidth import BandwidthProber
from swarm.config import PresenceConfig, RunMismatch, TaskInfo, TrainerConfig
from swarm.rounds import RecentPeers

if TYPE_CHECKING:
    from swarm.status import StatusPublisher

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PeerView:
    """What this peer's record says of its training now."""

    state: str
    round: int
    step: int
    samples_per_s: float
    rounds_completed: int
    checkpoints_cosigned: int


@dataclass(frozen=True, slots=True)
class RunFacts:
    """What this peer's record says of its run (fixed once the trainer has checked the run), and the device
    whose hardware it advertises."""

    name: str
    task: str
    preset: str
    config_digest: str
    requirements: Requirements
    device: torch.device

    @classmethod
    def of(cls, run: str, task: TaskInfo, requirements: Requirements, device: torch.device) -> RunFacts:
        """The facts of ``run`` for ``task``."""
        return cls(run, task.name, task.preset, task.config_digest, requirements, device)


class Presence:
    """Advertises, probes and keeps in touch, each on its own heartbeat, until `close()`.

    ``trainer_config`` is the trainer's config (its presence part and initial peers are read).
    ``view()`` is called from the heartbeat threads; ``status()`` feeds the status board.
    Without ``advertise`` (or when the DHT's peer ID is not this identity's) nothing is published,
    but `run_peers` and `reconnect` still work.
    """

    def __init__(
        self,
        dht: DHT,
        identity: Identity,
        graph: ResourceGraph,
        trainer_config: TrainerConfig,
        run: RunFacts,
        *,
        view: Callable[[], PeerView],
        status: Callable[[], dict],
    ) -> None:
        config: PresenceConfig = trainer_config.presence
        self.dht, self.identity, self.graph, self.config, self.run = dht, identity, graph, config, run
        self.peer_id = str(dht.peer_id)
        self._view = view
        self._initial = [p for p in (peer_id_of_maddr(m) for m in trainer_config.initial_peers) if p]
        self._started_at = time.time()
        self._run_peers: tuple[float, set[str]] = (-float("inf"), set())
        self._reconnecting: concurrent.futures.Future | None = None
        self._closing = threading.Event()
        self._probe_thread: threading.Thread | None = None
        self.recent = RecentPeers()
        self.advertiser: Advertiser | None = None
        self.prober: BandwidthProber | None = None
        self.status: StatusPublisher | None = None
        """The status board's publisher, once advertising."""
        if not config.advertise:
            return
        if identity.peer_id != self.peer_id:
            logger.warning("not advertising: the DHT's peer ID is not this trainer's identity (pass no dht=)")
            return
        self._maddrs = tuple(visible_maddrs(dht))[:16]
        self.prober = BandwidthProber(dht=dht)
        if config.bandwidth_probe_period_s > 0:
            self._probe_thread = threading.Thread(target=self._probe_loop, name="swarm-probe-loop", daemon=True)
            self._probe_thread.start()
        self.advertiser = Advertiser(
            dht, identity, self._build_record, refresh_s=config.record_refresh_s, expiry_s=config.record_expiry_s
        ).start()
        from swarm.status import StatusPublisher

        self.status = StatusPublisher(
            dht,
            identity,
            run=run.name,
            snapshot=status,
            refresh_s=config.record_refresh_s,
            expiry_s=config.record_expiry_s,
        ).start()

    def changed(self) -> None:
        """The trainer's state changed: publish the record now rather than on the next heartbeat."""
        if self.advertiser is not None:
            self.advertiser.refresh_now()

    def _probe_loop(self) -> None:
        """Measure bandwidth to a few peers of the run soon after joining, then every probe period."""
        delay_s = 1.0
        while not self._closing.wait(timeout=delay_s):
            try:
                others = [r.peer_id for r in self.graph.records(run=self.run.name) if r.peer_id != self.peer_id]
                results = self.prober.probe(others, max_peers=3) if others else []
            except Exception as e:  # a failed probe only leaves the figures unmeasured
                logger.info("bandwidth probe failed: %r", e)
                results = []
            delay_s = self.config.bandwidth_probe_period_s if results else self.config.record_refresh_s
            if results:
                self.changed()

    def measured(self) -> dict[str, float]:
        """The bandwidth probes' summary (upload_mbps, download_mbps, rtt_ms), empty before any."""
        return self.prober.summary() if self.prober is not None else {}

    def bandwidth_mbps(self) -> float | None:
        measured = self.measured()
        up, down = measured.get("upload_mbps"), measured.get("download_mbps")
        return None if up is None or down is None else min(up, down)

    def _build_record(self, *, issued_at: int, expires_at: int, seq: int) -> PeerRecord:
        cfg, run, view, measured = self.config, self.run, self._view(), self.measured()

        def scaled(key: str, factor: float) -> int | None:
            value = measured.get(key)
            return None if value is None else int(value * factor)

        return PeerRecord(
            v=1,
            peer_id=self.peer_id,
            public_key=self.identity.public_key.hex(),
            issued_at=issued_at,
            expires_at=expires_at,
            seq=seq,
            state=view.state,
            run=RunInfo(
                name=run.name,
                task=run.task,
                task_preset=run.preset,
                config_digest=run.config_digest,
                requirements=run.requirements,
                round=view.round,
                step=view.step,
            ),
            hardware=probe_hardware(self.run.device),
            software=probe_software(),
            perf=Performance(
                samples_per_s_milli=int(view.samples_per_s * 1000),
                upload_kbps=scaled("upload_mbps", 1000),
                download_kbps=scaled("download_mbps", 1000),
                rtt_us=scaled("rtt_ms", 1000),
            ),
            network=Network(reachability=reachability(self._maddrs), maddrs=self._maddrs, region=cfg.region),
            available_until=cfg.available_until_unix(),
            trust=Trust(
                uptime_s=int(time.time() - self._started_at),
                rounds_completed=view.rounds_completed,
                checkpoints_cosigned=view.checkpoints_cosigned,
            ),
        )

    def run_peers(self) -> set[str]:
        """Peer IDs with live records in this run (cached for one record refresh period)."""
        fetched_at, peers = self._run_peers
        if time.monotonic() - fetched_at > self.config.record_refresh_s:
            try:
                peers = {r.peer_id for r in self.graph.records(run=self.run.name)}
            except Exception as e:  # keep the last known set on a DHT hiccup
                logger.debug("could not read the run's peers: %r", e)
            self._run_peers = (time.monotonic(), peers)
        return peers

    def forget_run_peers(self) -> None:
        """The next `run_peers` reads the records again (a member of a group was not among them)."""
        self._run_peers = (-float("inf"), self._run_peers[1])

    def reconnect(self) -> None:
        """Alone this round: ping the peers of recent groups, the run's known peers and the initial peers,
        in the background. A partition (or any run of failed DHT calls) empties the DHT's routing table,
        and nothing would bring this peer back to the others until one of them happened to call it."""
        if self._reconnecting is not None and not self._reconnecting.done():
            return
        peers = [*self.recent.newest_first(), *sorted(self.run_peers()), *self._initial]
        try:
            self._reconnecting = reconnect(self.dht, peers)
        except Exception as e:  # the DHT process is gone or closing: nothing to reconnect
            logger.debug("could not ping known peers: %r", e)
            return
        self._reconnecting.add_done_callback(_log_reconnected)

    def close(self) -> None:
        """Stop probing and withdraw the record (the status entry expires on its own). Idempotent."""
        self._closing.set()
        if self._probe_thread is not None:
            self._probe_thread.join(timeout=15)
        if self.advertiser is not None:
            self.advertiser.close()
        if self.prober is not None:
            self.prober.close()


def _log_reconnected(future: concurrent.futures.Future) -> None:
    if not future.cancelled() and future.exception() is None and future.result():
        logger.info("alone in the last round: %s known peer(s) answered a ping", future.result())


def check_run(
    graph: ResourceGraph, *, run: str, task: TaskInfo, device: torch.device, own: Requirements
) -> Requirements:
    """The run's requirements (as advertised by its live peers, else ``own``, this peer's); raise
    RunMismatch if this peer does not meet them or builds a different model from ``task``."""
    try:
        summary = next((r for r in graph.runs() if r.name == run), None)
    except Exception as e:  # a DHT hiccup must not stop a peer from starting or joining
        logger.warning("could not read run %r from the DHT: %r", run, e)
        summary = None
    requirements = summary.requirements if summary is not None else own
    if summary is not None and summary.config_digest != task.config_digest:
        raise RunMismatch(
            f"cannot join run {run!r}: it trains {summary.task}/{summary.task_preset} "
            f"(model digest {summary.config_digest[:12]}), this peer built "
            f"{task.name}/{task.preset} (digest {task.config_digest[:12]})"
        )
    problems = unmet_requirements(requirements, probe_hardware(device), probe_software())
    if problems:
        raise RunMismatch(f"cannot join run {run!r}: " + "; ".join(problems))
    return requirements
