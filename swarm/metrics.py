"""Prometheus metrics of a Swarm peer: `PeerMetrics`, fed by the trainer with plain numbers.

`PeerMetrics` owns a private `CollectorRegistry` (never prometheus_client's process-wide default, so
several peers or tests in one process do not collide) and serves it with `serve(port)` through
`bootstrap.metrics.serve_metrics`. Its methods take plain `int`/`float`/`str` arguments: callers
need not know prometheus_client. All methods are thread-safe.

Metric names are stable (dashboards and tests rely on them):

| name                                   | type      | labels                     | fed by                           |
|----------------------------------------|-----------|----------------------------|----------------------------------|
| `swarm_rounds_total`                   | counter   | `outcome`: ok, partial, retried, failed, solo | `observe_round`  |
| `swarm_round_duration_seconds`         | histogram | (buckets 0.1 s .. 120 s)   | `observe_round`                  |
| `swarm_bytes_sent_total`               | counter   |                            | `observe_round` (averaging)      |
| `swarm_bytes_received_total`           | counter   |                            | `observe_round` (averaging)      |
| `swarm_rejections_total`               | counter   | `what`, `reason`           | `add_rejections`                 |
| `swarm_peers_known`                    | gauge     |                            | `set_peers_known` (live peers of the run) |
| `swarm_train_loss`                     | gauge     |                            | `observe_step`                   |
| `swarm_val_loss`                       | gauge     |                            | `set_val_loss`                   |
| `swarm_step`                           | gauge     |                            | `observe_step`                   |
| `swarm_round`                          | gauge     |                            | `set_round`                      |
| `swarm_samples_total`                  | counter   |                            | `observe_step`                   |
| `swarm_samples_per_second`             | gauge     |                            | `observe_step`                   |
| `swarm_checkpoints_sealed_total`       | counter   |                            | `checkpoint_sealed`              |
| `swarm_state_syncs_total`              | counter   | `reason`: e.g. join, resync | `state_synced`                  |
| `swarm_info`                           | gauge = 1 | `peer_id`, `run`, `task`, `version` | constructor             |

`what` in `swarm_rejections_total` names the kind of untrusted input refused: record, manifest,
receipt, metadata, status, ...; `reason` is the refusing check's short fixed reason.

Non-finite values: a loss (or throughput) that is NaN or +-inf is exported as NaN, never as a stale
good value and never as an exception: a diverged run shows up as NaN on the dashboard. A loss of
`None` leaves the gauge unchanged (no new value). Counts must be non-negative integers and
durations finite and non-negative (`ValueError` otherwise: those come from our own code).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from bootstrap.metrics import CounterFeed, MetricsServer, serve_metrics

__all__ = ["METRIC_NAMES", "ROUND_DURATION_BUCKETS_S", "ROUND_OUTCOMES", "PeerMetrics"]

ROUND_OUTCOMES = ("ok", "partial", "retried", "failed", "solo")
"""The values of `swarm_rounds_total{outcome}`; all of them are exported from the start (as 0)."""

ROUND_DURATION_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
"""Upper bounds of the `swarm_round_duration_seconds` buckets (plus +Inf)."""

METRIC_NAMES = (
    "swarm_rounds_total",
    "swarm_round_duration_seconds",
    "swarm_bytes_sent_total",
    "swarm_bytes_received_total",
    "swarm_rejections_total",
    "swarm_peers_known",
    "swarm_train_loss",
    "swarm_val_loss",
    "swarm_step",
    "swarm_round",
    "swarm_samples_total",
    "swarm_samples_per_second",
    "swarm_checkpoints_sealed_total",
    "swarm_state_syncs_total",
    "swarm_info",
)
"""Every metric a `PeerMetrics` exports, as it appears in the exposition (counters with `_total`)."""


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: must be a non-negative integer, got {value!r}")
    return value


def _gauge_value(value: float) -> float:
    """The value to export for a loss or rate: NaN for anything non-finite (see the module docstring)."""
    value = float(value)
    return value if math.isfinite(value) else math.nan


def _label(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}: must be a non-empty string, got {value!r}")
    return value


class PeerMetrics:
    """A peer's Prometheus metrics (see the module docstring for the names) in a private registry."""

    def __init__(self, *, peer_id: str, run: str, task: str, version: str | None = None) -> None:
        """`peer_id`, `run`, `task` and `version` (default: swarm's) label `swarm_info`."""
        if version is None:
            from swarm import __version__ as version
        self.registry = CollectorRegistry(auto_describe=True)
        """The private registry holding these metrics (e.g. for `prometheus_client.generate_latest`)."""
        self._lock = threading.Lock()
        self._server: MetricsServer | None = None
        self._define_round_metrics()
        self._define_training_metrics()
        rejections = Counter(
            "swarm_rejections",
            "Untrusted inputs refused, by kind of input and reason.",
            ["what", "reason"],
            registry=self.registry,
        )
        self._rejections = CounterFeed(rejections, label="reason")
        info = Gauge(
            "swarm_info",
            "Always 1; labels identify the peer.",
            ["peer_id", "run", "task", "version"],
            registry=self.registry,
        )
        info.labels(
            peer_id=_label("peer_id", peer_id),
            run=_label("run", run),
            task=_label("task", task),
            version=_label("version", version),
        ).set(1)

    def _define_round_metrics(self) -> None:
        registry = self.registry
        self._rounds = Counter("swarm_rounds", "Averaging rounds, by outcome.", ["outcome"], registry=registry)
        for outcome in ROUND_OUTCOMES:
            self._rounds.labels(outcome=outcome)
        self._round_duration = Histogram(
            "swarm_round_duration_seconds",
            "Wall time of an averaging round.",
            buckets=ROUND_DURATION_BUCKETS_S,
            registry=registry,
        )
        self._bytes_sent = Counter("swarm_bytes_sent", "Bytes sent by averaging.", registry=registry)
        self._bytes_received = Counter("swarm_bytes_received", "Bytes received by averaging.", registry=registry)
        self._peers_known = Gauge("swarm_peers_known", "Live peers in this run.", registry=registry)
        self._round = Gauge("swarm_round", "Current averaging round number.", registry=registry)
        self._sealed = Counter(
            "swarm_checkpoints_sealed", "Checkpoints sealed by this peer's groups.", registry=registry
        )
        self._syncs = Counter(
            "swarm_state_syncs", "State downloads from sealed checkpoints, by reason.", ["reason"], registry=registry
        )

    def _define_training_metrics(self) -> None:
        registry = self.registry
        self._train_loss = Gauge("swarm_train_loss", "Training loss of the latest step.", registry=registry)
        self._val_loss = Gauge("swarm_val_loss", "Latest validation loss.", registry=registry)
        self._step = Gauge("swarm_step", "Current optimizer step.", registry=registry)
        self._samples = Counter("swarm_samples", "Training samples processed.", registry=registry)
        self._samples_per_s = Gauge("swarm_samples_per_second", "Recent training throughput.", registry=registry)

    # --- updates -------------------------------------------------------------------------------

    def observe_round(self, *, outcome: str, duration_s: float, bytes_sent: int, bytes_received: int) -> None:
        """Count one averaging round: its outcome (one of `ROUND_OUTCOMES`), wall time and traffic."""
        if outcome not in ROUND_OUTCOMES:
            raise ValueError(f"outcome: must be one of {', '.join(ROUND_OUTCOMES)}, got {outcome!r}")
        duration_s = float(duration_s)
        if not (math.isfinite(duration_s) and duration_s >= 0):
            raise ValueError(f"duration_s: must be a finite number of seconds >= 0, got {duration_s!r}")
        sent, received = _count("bytes_sent", bytes_sent), _count("bytes_received", bytes_received)
        self._rounds.labels(outcome=outcome).inc()
        self._round_duration.observe(duration_s)
        self._bytes_sent.inc(sent)
        self._bytes_received.inc(received)

    def observe_step(self, *, step: int, samples: int, loss: float | None, samples_per_s: float) -> None:
        """Record one optimizer step: `samples` processed by *this* step are added to the total."""
        self._step.set(_count("step", step))
        self._samples.inc(_count("samples", samples))
        if loss is not None:
            self._train_loss.set(_gauge_value(loss))
        self._samples_per_s.set(_gauge_value(samples_per_s))

    def set_val_loss(self, value: float) -> None:
        """Set `swarm_val_loss` (NaN if not finite)."""
        self._val_loss.set(_gauge_value(value))

    def set_round(self, number: int) -> None:
        """Set `swarm_round`."""
        self._round.set(_count("number", number))

    def set_peers_known(self, num_peers: int) -> None:
        """Set `swarm_peers_known`: the live peers of this run."""
        self._peers_known.set(_count("num_peers", num_peers))

    def add_rejections(self, what: str, counts: Mapping[str, int]) -> None:
        """Advance `swarm_rejections_total{what, reason}` to the CUMULATIVE `counts` by reason.

        Pass the same growing tally each time (e.g. a `collections.Counter` kept elsewhere): only the
        growth since the previous call for that `what` is added. A count that went down is taken as a
        reset tally and added whole.
        """
        self._rejections.update(counts, what=_label("what", what))

    def checkpoint_sealed(self) -> None:
        """Count one sealed checkpoint."""
        self._sealed.inc()

    def state_synced(self, reason: str) -> None:
        """Count one state download, e.g. reason "join" or "resync"."""
        self._syncs.labels(reason=_label("reason", reason)).inc()

    # --- serving -------------------------------------------------------------------------------

    def serve(self, port: int, host: str = "127.0.0.1") -> MetricsServer:
        """Serve the registry at `http://HOST:PORT/metrics` until `close()`; port 0 picks a free port.

        Raises `bootstrap.metrics.MetricsServerError` (a `ValueError`) if the port is taken, and
        `RuntimeError` if already serving.
        """
        with self._lock:
            if self._server is not None:
                raise RuntimeError(f"already serving metrics at {self._server.url}")
            self._server = serve_metrics(self.registry, port=port, host=host)
            return self._server

    def close(self) -> None:
        """Stop serving (if serving) and release the port; idempotent, bounded (a few seconds at most)."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.close()
