"""The live resource graph: verified capability records of a network or run, scored for placement.

Placement score (0-100) of a peer for a run, higher is better::

    score = 100 * fit * (0.35 * throughput + 0.30 * bandwidth + 0.15 * reachability + 0.20 * trust)

* ``fit``: 1 when the peer meets the run's requirements (free memory, dtype, software versions),
  0.5 when it only lacks free memory right now but has enough in total, else 0;
* ``throughput``: measured samples/s on the run's task relative to the best live peer (0..1);
* ``bandwidth``: min(upload, download) relative to the best live peer (0..1; 0.5 if not measured);
* ``reachability``: public 1, private 0.7, relayed 0.5, client-only 0.2;
* ``trust``: half uptime (saturating at 1 h), half rounds completed (saturating at 100).

Records are read from the DHT and verified one by one (:func:`bootstrap.records.parse_record`); any
that fail are dropped with a logged reason and counted in ``ResourceGraph.rejections``. A graph keeps
each verified record until it expires or its peer publishes a newer one, so a read that misses a live
record does not hide its peer (:class:`bootstrap.records.RecordBook`).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

from hivemind import DHT
from packaging.version import InvalidVersion, Version

from bootstrap.dhtcalls import latest_many_within
from bootstrap.records import (
    PEERS_KEYS,
    Hardware,
    PeerRecord,
    RecordBook,
    RecordRejected,
    Requirements,
    RunInfo,
    Software,
    record_rejections,
)

logger = logging.getLogger(__name__)

_REACHABILITY_SCORE = {"public": 1.0, "private": 0.7, "relayed": 0.5, "client-only": 0.2}
_WEIGHTS = {"throughput": 0.35, "bandwidth": 0.30, "reachability": 0.15, "trust": 0.20}


@dataclass(frozen=True, kw_only=True, slots=True)
class ScoredPeer:
    """A live peer with its verified record and placement score."""

    record: PeerRecord
    score: float
    """0-100, see the module docstring."""
    fit: float
    """1 fits the run, 0.5 lacks free memory right now, 0 does not fit."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSummary(RunInfo):
    """An open run, as its live peers advertise it (majority for config, maximum for progress)."""

    num_peers: int
    samples_per_s: float
    """Sum of the peers' measured throughput."""


def unmet_requirements(requirements: Requirements, hardware: Hardware, software: Software) -> list[str]:
    """Why a peer with ``hardware``/``software`` may not join a run with ``requirements`` (empty: it may)."""
    problems = []
    if hardware.memory_free_bytes < requirements.min_memory_bytes:
        problems.append(
            f"needs {requirements.min_memory_bytes / 2**30:.1f} GiB of free {hardware.accelerator} "
            f"memory, this peer has {hardware.memory_free_bytes / 2**30:.1f} GiB"
        )
    if requirements.dtype == "bf16" and not hardware.bf16:
        problems.append(f"needs bf16 support, which {hardware.name} lacks")
    for name, have, need in (
        ("swarm", software.swarm, requirements.min_swarm_version),
        ("torch", software.torch, requirements.min_torch_version),
    ):
        if _version_below(have, need):
            problems.append(f"needs {name} >= {need}, this peer has {have}")
    return problems


def _version_below(have: str, need: str) -> bool:
    if not need:
        return False
    try:
        return Version(have) < Version(need)
    except InvalidVersion:
        return True  # an unparseable requirement or version cannot be shown to hold


def fit_of(record: PeerRecord, requirements: Requirements | None) -> float:
    if requirements is None:
        return 1.0
    if not unmet_requirements(requirements, record.hardware, record.software):
        return 1.0
    relaxed = record.hardware.memory_total_bytes >= requirements.min_memory_bytes
    others = unmet_requirements(
        Requirements(
            min_memory_bytes=0,
            dtype=requirements.dtype,
            min_swarm_version=requirements.min_swarm_version,
            min_torch_version=requirements.min_torch_version,
        ),
        record.hardware,
        record.software,
    )
    return 0.5 if relaxed and not others else 0.0


def score_peers(records: list[PeerRecord], requirements: Requirements | None = None) -> list[ScoredPeer]:
    """Score ``records`` against each other (see the module docstring); best first."""
    best_throughput = max((r.perf.samples_per_s_milli for r in records), default=0) or 1
    best_bandwidth = max((_bandwidth_kbps(r) or 0 for r in records), default=0) or 1
    scored = []
    for record in records:
        bandwidth = _bandwidth_kbps(record)
        parts = {
            "throughput": record.perf.samples_per_s_milli / best_throughput,
            "bandwidth": 0.5 if bandwidth is None else bandwidth / best_bandwidth,
            "reachability": _REACHABILITY_SCORE.get(record.network.reachability, 0.0),
            "trust": 0.5 * min(1.0, record.trust.uptime_s / 3600) + 0.5 * min(1.0, record.trust.rounds_completed / 100),
        }
        fit = fit_of(record, requirements)
        score = 100.0 * fit * sum(_WEIGHTS[k] * min(1.0, max(0.0, v)) for k, v in parts.items())
        scored.append(ScoredPeer(record=record, score=round(score, 2), fit=fit))
    return sorted(scored, key=lambda p: (-p.score, p.record.peer_id))


def _bandwidth_kbps(record: PeerRecord) -> int | None:
    up, down = record.perf.upload_kbps, record.perf.download_kbps
    return None if up is None or down is None else min(up, down)


def summarize_runs(records: list[PeerRecord]) -> list[RunSummary]:
    """Group live records by run; config and requirements by majority, progress by maximum."""
    by_run: dict[str, list[PeerRecord]] = {}
    for record in records:
        if record.run is not None and record.is_live():
            by_run.setdefault(record.run.name, []).append(record)
    summaries = []
    for name, members in sorted(by_run.items()):
        majority = Counter(
            (r.run.task, r.run.task_preset, r.run.config_digest, r.run.requirements) for r in members
        ).most_common(1)[0][0]
        task, preset, digest, requirements = majority
        summaries.append(
            RunSummary(
                name=name,
                task=task,
                task_preset=preset,
                config_digest=digest,
                requirements=requirements,
                round=max(r.run.round for r in members),
                step=max(r.run.step for r in members),
                num_peers=len(members),
                samples_per_s=sum(r.perf.samples_per_s_milli for r in members) / 1000,
            )
        )
    return summaries


def pick_run(runs: list[RunSummary], hardware: Hardware, software: Software) -> tuple[RunSummary | None, list[str]]:
    """The best-fitting open run for this peer, and a line of explanation per run considered.

    Among the runs whose requirements this peer meets, prefer the one with the most live peers,
    then the most advanced (round); a peer adds most where the collaboration already is.
    """
    fitting, reasons = [], []
    for run in runs:
        problems = unmet_requirements(run.requirements, hardware, software)
        if problems:
            reasons.append(f"skipped run {run.name!r}: {'; '.join(problems)}")
        else:
            fitting.append(run)
    if not fitting:
        return None, reasons or ["no open run was found in the network"]
    best = max(fitting, key=lambda r: (r.num_peers, r.round, r.name))
    free_gib = hardware.memory_free_bytes / 2**30
    reasons.insert(
        0,
        (
            f"picked run {best.name!r} ({best.task}/{best.task_preset}): {best.num_peers} live peer(s) at round "
            f"{best.round}, the most among {len(fitting)} run(s) this peer fits; it needs "
            f"{best.requirements.min_memory_bytes / 2**30:.1f} GiB free memory (this peer has {free_gib:.1f}) "
            f"and {best.requirements.dtype}"
        ),
    )
    return best, reasons


class ResourceGraph:
    """Reads, verifies and scores the capability records of the live peers of a network."""

    def __init__(self, dht: DHT):
        self.dht = dht
        self.rejections = record_rejections()
        self.book = RecordBook()
        """Every verified record read so far, kept until it expires (see :class:`bootstrap.records.RecordBook`)."""

    def records(self, *, run: str | None = None, timeout_s: float = 10.0) -> list[PeerRecord]:
        """Verified, live records (of ``run``'s peers, if given), each peer once: those of this read and
        those of earlier reads that have not expired or been replaced (:attr:`book`). Raises TimeoutError
        when the read does not finish within ``timeout_s``."""
        found = latest_many_within(self.dht, PEERS_KEYS, timeout_s=timeout_s)

        def rejected(error: RecordRejected, subkey: Any) -> None:
            self.rejections.reject(error, where="resource graph", source=subkey)

        return self.book.read(found, run=run, on_rejected=rejected)

    def peers(self, *, run: str | None = None, timeout_s: float = 10.0) -> list[ScoredPeer]:
        """Live peers (of ``run``, if given), scored against that run's requirements; best first."""
        records = self.records(run=run, timeout_s=timeout_s)
        requirements = None
        if run is not None:
            summary = next((s for s in summarize_runs(records) if s.name == run), None)
            requirements = summary.requirements if summary else None
        return score_peers(records, requirements)

    def runs(self, *, timeout_s: float = 10.0) -> list[RunSummary]:
        return summarize_runs(self.records(timeout_s=timeout_s))
