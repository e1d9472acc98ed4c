"""One sink for what a trainer did: its signed ledger, its entry on the run's status board, its metrics.

The trainer calls :meth:`Evidence.record` with a ledger entry kind and body (see ``swarm.ledger``
for the kinds); this module decides what of it goes to the status board's event timeline and which
Prometheus metrics it moves, so the trainer knows nothing of either.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from swarm._private.progress import ProgressLine
from swarm.ledger import Ledger, LedgerError, default_ledger_path
from swarm.rounds import Replacements, group_summary

logger = logging.getLogger(__name__)

Listener = Callable[[str, dict], None]


def status_snapshot(state: str, round_: int, step: int, last_group: Any, book: Any, work: Any = None) -> dict:
    """A trainer's entry on the status board, from its `swarm.rounds.RoundBook` (milli-units: signed JSON
    carries no floats) and its verified work (`swarm.work.WorkChecks`, or None)."""
    return {
        "work": work.tally() if work is not None else None,
        "state": state,
        "round": round_,
        "step": step,
        "last_group": last_group,
        "samples_per_s_milli": milli(book.samples_per_s) or 0,
        "loss_milli": milli(book.last_loss),
        "val_loss_milli": milli(book.shown_val_loss),
    }


def milli(value: Any) -> int | None:
    """A float metric as integer thousandths (signed payloads carry no floats); None if absent or not finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return round(value * 1000)


def _status_note(kind: str, body: dict) -> tuple[str, str] | None:
    """The status board's timeline line for a ledger entry, or None for routine entries.

    Sealed checkpoints are left out: every member would note each one; the board shows the newest."""
    if kind == "joined":
        return "joined", f"round {body.get('round')}"
    if kind == "state_synced":
        return "resumed", f"from sealed step {body.get('step')} ({body.get('reason')})"
    if kind == "peer_replaced":
        return "peer replaced", f"{_short(body.get('left'))} -> {_short(body.get('joined'))}"
    if kind == "failure":
        return "failure", f"{str(body.get('peer'))[:16]} {body.get('phase')}: {body.get('reason')}"[:200]
    if kind == "record_rejected":
        return "rejected", f"{body.get('what')}: {body.get('reason')} x{body.get('count')}"[:200]
    if kind == "round" and body.get("outcome") == "retried":
        return "group re-formed", f"round {body.get('round')}: a slice was lost, survivors retried"
    if kind == "round" and body.get("solo"):
        return "solo round", f"round {body.get('round')}: no group, own update applied"
    if kind == "diverging":
        return "val loss rising", (
            f"{body.get('rounds')} sealed rounds in a row: {_num(body.get('from'))} -> {_num(body.get('to'))}"
        )
    if kind in ("work_excluded", "work_refused"):
        return kind.removeprefix("work_"), f"{str(body.get('peer'))[-8:]}: {body.get('reason')}"[:200]
    if kind == "work_check" and body.get("ok") is False:
        return "work check failed", f"{str(body.get('prover'))[-8:]} round {body.get('round')}: {body.get('reason')}"
    if kind == "stop":
        return "left", str(body.get("signal") or "")
    return None


def _num(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "?"


def _short(peers: Any) -> str:
    return ",".join(str(p)[-8:] for p in peers) if isinstance(peers, list) else "?"


class Evidence:
    """Fans each recorded event out to the ledger, the status publisher and the metrics (each optional)."""

    def __init__(self, *, ledger: Ledger | None = None, metrics: Any | None = None, progress: Any | None = None):
        self.ledger = ledger
        self.metrics = metrics
        """A ``swarm.metrics.PeerMetrics`` or None."""
        self.progress = progress
        """A ``swarm._private.progress.ProgressLine`` (on a terminal) or None."""
        self.status: Any | None = None
        """A ``swarm.status.StatusPublisher`` or None (set once the trainer advertises)."""
        self.listeners: list[Listener] = []
        """Called with (kind, body) after each record, e.g. to mirror it into an event log."""
        self._rejections: dict[tuple[str, str], int] = {}
        self.last_group: dict | None = None
        """The status board's summary of this peer's last group (``swarm.rounds.group_summary``)."""
        self._replacements = Replacements()

    def record(self, kind: str, body: dict, *, t: float | None = None) -> None:
        """Append to the ledger, note it on the status board, move the metrics, tell the listeners.

        Never raises: evidence must not stop training (a failure is logged)."""
        if self.ledger is not None:
            try:
                self.ledger.append(kind, body, t=t)
            except Exception as e:
                logger.warning("could not append %r to the ledger: %r", kind, e)
        note = _status_note(kind, body)
        if note is not None and self.status is not None:
            self.status.note(*note)
        if self.metrics is not None:
            self._move_metrics(kind, body)
        for listener in self.listeners:
            try:
                listener(kind, body)
            except Exception as e:
                logger.warning("evidence listener failed on %r: %r", kind, e)

    def step(self, step: int, samples: int, book: Any, *, round: int, in_flight: bool) -> None:
        """One inner step: the metrics' step figures and the progress line (``book``: a ``swarm.rounds.RoundBook``)."""
        if self.metrics is None and self.progress is None:
            return
        rate = book.samples_since_sync / max(time.perf_counter() - book.last_sync_end, 1e-9)
        if self.metrics is not None:
            self.metrics.observe_step(step=step, samples=samples, loss=book.last_loss, samples_per_s=rate)
        if self.progress is not None:
            val, size = book.shown_val_loss, len(self.last_group["members"]) if self.last_group else None
            val = val if val is not None and math.isfinite(val) else None
            fields = {"loss": book.last_loss, "group": size, "val_loss": val, "in_flight": in_flight}
            self.progress.update(step=step, samples_per_s=rate, round=round, **fields)

    def round(self, entry: dict, *, group: Any | None, record: Any | None, peer_id: str) -> None:
        """A finished round: its ledger entry (``swarm.rounds.round_entry``), one entry per failure seen,
        the status board's last group, and who replaced whom; then the board publishes soon (the
        training thread never waits on the DHT for it)."""
        self.record("round", entry)
        for failure in record.failures if record is not None else []:
            self.record("failure", {"round": entry["round"], **failure})
        if record is not None and group is not None:
            self.last_group = group_summary(group, record, entry["duration_s"])
            replaced = self._replacements.observe(
                round_=entry["round"], peer_id=peer_id, group=group, failures=record.failures
            )
            if replaced is not None:
                self.record("peer_replaced", replaced)
        if self.status is not None:
            self.status.publish_soon()

    def checkpoint_event(self, kind: str, body: dict) -> None:
        """What the checkpoint manager reports; a round's verified receipts become one entry each."""
        if kind == "receipts":
            for receipt in body["receipts"]:
                self.record("receipt", receipt)
        else:
            self.record(kind, body)

    def rejections_of(self, sources: Mapping[str, Mapping[str, int]], round_: int) -> None:
        """`rejections` for each (what, counts) of ``sources``."""
        for what, counts in sources.items():
            self.rejections(what, counts, round_=round_)

    def rejections(self, what: str, counts: Mapping[str, int], *, round_: int) -> None:
        """Record the increase of a cumulative rejection counter (by reason) since the last call."""
        for reason, total in list(counts.items()):
            seen = self._rejections.get((what, reason), 0)
            if total > seen:
                self._rejections[(what, reason)] = total
                self.record(
                    "record_rejected",
                    {"what": what, "reason": str(reason)[:200], "count": total - seen, "total": total, "round": round_},
                )
        if self.metrics is not None:
            self.metrics.add_rejections(what, counts)

    def _move_metrics(self, kind: str, body: dict) -> None:
        m = self.metrics
        try:
            if kind == "round":
                m.observe_round(
                    outcome="solo" if body.get("solo") else str(body.get("outcome")),
                    duration_s=float(body.get("duration_s") or 0.0),
                    bytes_sent=int(body.get("bytes_sent") or 0),
                    bytes_received=int(body.get("bytes_received") or 0),
                )
                m.set_round(int(body.get("round") or 0))
                if body.get("val_loss") is not None:
                    m.set_val_loss(float(body["val_loss"]))
            elif kind == "val" and body.get("val_loss") is not None:
                m.set_val_loss(float(body["val_loss"]))
            elif kind == "checkpoint_sealed":
                m.checkpoint_sealed()
            elif kind == "state_synced":
                m.state_synced(str(body.get("reason")))
        except Exception as e:  # metrics are best effort
            logger.debug("metrics update for %r failed: %r", kind, e)

    def close(self) -> None:
        """Stop the status publisher and the metrics server, close the ledger. Idempotent."""
        for part in (self.progress, self.status, self.metrics, self.ledger):
            if part is not None:
                try:
                    part.close()
                except Exception as e:
                    logger.warning("could not close %s: %r", type(part).__name__, e)
        self.progress = self.status = self.metrics = self.ledger = None


def open_evidence(identity: Any, *, run: str, task: str, ledger_dir: str, metrics: Any) -> Evidence:
    """Evidence with the peer's ledger (DIR/RUN/PEER_ID.sqlite under ``ledger_dir``; empty: none), its
    Prometheus endpoint (``metrics``: a MetricsConfig; port 0: none) and, on a terminal, its progress line
    (``metrics.progress``). Raises ValueError naming the file when the ledger cannot be opened."""
    progress = ProgressLine.open(metrics.progress)
    ledger = None
    if ledger_dir:
        path = default_ledger_path(ledger_dir, run=run, peer_id=identity.peer_id)
        try:
            ledger = Ledger(path, identity=identity, run=run)
        except LedgerError as e:
            raise ValueError(
                f"cannot open the ledger {path}: {e}; move the file away or pass another --ledger-dir"
            ) from None
    if not metrics.metrics_port:
        return Evidence(ledger=ledger, progress=progress)
    from swarm.metrics import PeerMetrics  # prometheus-client is imported only when metrics are on

    served = PeerMetrics(peer_id=identity.peer_id, run=run, task=task)
    try:
        served.serve(port=metrics.metrics_port, host=metrics.metrics_host)
    except BaseException:
        served.close()
        if ledger is not None:
            ledger.close()
        raise
    logger.info("Prometheus metrics on http://%s:%s/metrics", metrics.metrics_host, metrics.metrics_port)
    return Evidence(ledger=ledger, metrics=served, progress=progress)
