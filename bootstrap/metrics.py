"""Prometheus metrics: a small owned `/metrics` server, and the bootstrap node's own metrics.

* `serve_metrics(registry, port=..., host=...)` serves one registry at `http://HOST:PORT/metrics` from
  a daemon thread and returns a `MetricsServer`; its `close()` stops it and frees the port.
* `CounterFeed` turns cumulative counts kept elsewhere (a `collections.Counter`, a validator's tally
  fetched from another process) into increments of a labelled Prometheus counter.
* `BootstrapMetrics`: what `python -m bootstrap --metrics-port PORT` exports.

Every component owns a private `CollectorRegistry`, never prometheus_client's process-wide default
one, so several components (or tests) in one process never collide on a metric name.

Metrics of the bootstrap node (names are stable: dashboards and tests rely on them):

| name                                           | type    | meaning                                                  |
|------------------------------------------------|---------|----------------------------------------------------------|
| `swarm_bootstrap_peers_known`                  | gauge   | other DHT nodes in the node's routing table              |
| `swarm_bootstrap_uptime_seconds`               | gauge   | seconds since the node started (computed at scrape time) |
| `swarm_bootstrap_record_rejections_total{reason}` | counter | records the node's validators refused, by reason (`not owned: ...`: bootstrap.owned) |

The peer count and the rejections live in the DHT process; the node fetches them every few seconds
(`BootstrapMetrics.start_refresh`), not on each scrape, so scrapes never wait on the DHT.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Mapping
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app

from bootstrap.errors import StartError

__all__ = ["BootstrapMetrics", "CounterFeed", "MetricsServer", "MetricsServerError", "serve_metrics"]

logger = logging.getLogger(__name__)

_POLL_INTERVAL_S = 0.1
_CLIENT_TIMEOUT_S = 10.0
_CLOSE_TIMEOUT_S = 5.0


class MetricsServerError(StartError, ValueError):
    """The metrics server could not listen; the message names the address and what to do."""


class _Handler(WSGIRequestHandler):
    # a client that connects and never sends a request must not hold its thread forever
    timeout = _CLIENT_TIMEOUT_S

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass  # one access-log line per scrape is noise


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN, which can stall on a slow DNS: not needed here
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]
        self.setup_environ()

    def handle_error(self, request: object, client_address: object) -> None:
        logger.debug("metrics request from %s failed", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """A running `/metrics` endpoint; `close()` stops it. Use `serve_metrics` to create one."""

    def __init__(self, server: _Server, *, host: str) -> None:
        self.host = host
        """The address it listens on, as given."""
        self.port: int = server.server_address[1]
        """The TCP port it listens on (the one the OS picked when asked for port 0)."""
        self._server = server
        self._stop = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"metrics-server:{self.port}", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """`http://HOST:PORT/metrics`, the address to scrape."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def _loop(self) -> None:
        # handle_request returns after _POLL_INTERVAL_S without a request, so close() is prompt;
        # each request is served on its own (daemon) thread by ThreadingMixIn
        while not self._stop.is_set():
            self._server.handle_request()

    def close(self, *, timeout_s: float = _CLOSE_TIMEOUT_S) -> None:
        """Stop serving and release the port. Idempotent; returns within about `timeout_s`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("metrics server on port %d did not stop within %.1f s", self.port, timeout_s)
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsServer({self.url}{', closed' if self._closed else ''})"


def serve_metrics(registry: CollectorRegistry, *, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve `registry` at `http://HOST:PORT/metrics` (any path answers) until `close()`.

    Port 0 lets the OS pick a free port: read it from `.port`. Raises `MetricsServerError` (a
    `ValueError`) if the address cannot be bound (port in use, unknown host), `ValueError` for a
    port outside 0..65535 or an empty host.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port: must be an integer in 0..65535, got {port!r}")
    if not isinstance(host, str) or not host.strip():
        raise ValueError(f"host: must be a non-empty address, got {host!r}")
    server_class = _Server6 if ":" in host else _Server
    try:
        server = make_server(host, port, make_wsgi_app(registry), server_class=server_class, handler_class=_Handler)
    except OSError as error:
        raise _bind_error(error, host=host, port=port) from error
    server.timeout = _POLL_INTERVAL_S
    return MetricsServer(server, host=host)


def _bind_error(error: OSError, *, host: str, port: int) -> MetricsServerError:
    where = f"{host}:{port}"
    if error.errno == errno.EADDRINUSE:
        return MetricsServerError(
            f"cannot serve metrics on {where}: address already in use; "
            f"stop the process using port {port} or choose another metrics port"
        )
    if error.errno == errno.EACCES:
        return MetricsServerError(f"cannot serve metrics on {where}: permission denied; choose a port above 1023")
    reason = error.strerror or str(error)
    return MetricsServerError(
        f"cannot serve metrics on {where}: {reason}; check the metrics host (e.g. 127.0.0.1 or 0.0.0.0)"
    )


class CounterFeed:
    """Feeds cumulative counts kept elsewhere into a labelled Prometheus `Counter`.

    `update(counts, **labels)` takes the *total* count per label value (e.g. a `Counter` by reason
    that the caller keeps growing) and increments the Prometheus counter by the growth since the
    previous call. A count that went down means its source was reset (a new tally): its whole new
    value is then counted as growth. Thread-safe.
    """

    def __init__(self, counter: Counter, *, label: str) -> None:
        self._counter = counter
        self._label = label
        self._last: dict[tuple[tuple[str, str], ...], int] = {}
        self._lock = threading.Lock()

    def update(self, counts: Mapping[str, int], **labels: str) -> None:
        """Raise each `counter{label=key, **labels}` to match `counts[key]`; `ValueError` on a bad count."""
        checked = {str(key): _count(f"counts[{key!r}]", value) for key, value in counts.items()}
        with self._lock:
            for key, total in checked.items():
                full = {**labels, self._label: key}
                slot = tuple(sorted(full.items()))
                previous = self._last.get(slot, 0)
                growth = total - previous if total >= previous else total
                self._last[slot] = total
                if growth:
                    self._counter.labels(**full).inc(growth)


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: must be a non-negative integer count, got {value!r}")
    return value


class BootstrapMetrics:
    """The bootstrap node's metrics (see the module docstring) in a private registry.

    The node serves them with `serve(port=..., host=...)` and keeps them current with
    `start_refresh(sample, interval_s=...)`; `close()` stops both.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        """The private registry holding these metrics."""
        started = time.monotonic()
        self._peers_known = Gauge(
            "swarm_bootstrap_peers_known",
            "Other DHT nodes in the bootstrap node's routing table.",
            registry=self.registry,
        )
        uptime = Gauge(
            "swarm_bootstrap_uptime_seconds", "Seconds since the bootstrap node started.", registry=self.registry
        )
        uptime.set_function(lambda: time.monotonic() - started)
        rejections = Counter(
            "swarm_bootstrap_record_rejections",
            "Capability records the bootstrap node's DHT validator refused, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self._rejections = CounterFeed(rejections, label="reason")
        self._server: MetricsServer | None = None
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    @property
    def url(self) -> str | None:
        """The URL to scrape while `serve` runs, else None."""
        return self._server.url if self._server is not None else None

    def set_peers_known(self, num_peers: int) -> None:
        """Set `swarm_bootstrap_peers_known`."""
        self._peers_known.set(_count("num_peers", num_peers))

    def update_record_rejections(self, counts: Mapping[str, int]) -> None:
        """Advance `swarm_bootstrap_record_rejections_total` to the cumulative `counts` by reason."""
        self._rejections.update(counts)

    def serve(self, *, port: int, host: str = "127.0.0.1") -> MetricsServer:
        """Start serving the registry (see `serve_metrics`); `close()` stops it."""
        if self._server is not None:
            raise RuntimeError(f"already serving metrics at {self._server.url}")
        self._server = serve_metrics(self.registry, port=port, host=host)
        return self._server

    def start_refresh(self, sample: Callable[[], tuple[int, Mapping[str, int]]], *, interval_s: float) -> None:
        """Call `sample()` -> (num_peers, rejections by reason) now and every `interval_s` until `close()`.

        Runs on a daemon thread; a failing sample (e.g. the DHT did not answer in time) is logged
        and the previous values are kept.
        """
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s: must be a positive number of seconds, got {interval_s!r}")
        if self._refresher is not None:
            raise RuntimeError("the metrics refresher is already running")
        self._refresher = threading.Thread(
            target=self._refresh_loop, args=(sample, interval_s), name="bootstrap-metrics", daemon=True
        )
        self._refresher.start()

    def _refresh_loop(self, sample: Callable[[], tuple[int, Mapping[str, int]]], interval_s: float) -> None:
        while not self._stop.is_set():
            self._refresh_once(sample)
            self._stop.wait(interval_s)

    def _refresh_once(self, sample: Callable[[], tuple[int, Mapping[str, int]]]) -> None:
        try:
            num_peers, rejections = sample()
            self.set_peers_known(num_peers)
            self.update_record_rejections(rejections)
        except Exception as error:  # a DHT that is slow or shutting down must not end the refresher
            if not self._stop.is_set():
                logger.warning("could not refresh the bootstrap metrics: %s", error)

    def close(self, *, timeout_s: float = _CLOSE_TIMEOUT_S) -> None:
        """Stop the refresher (waiting up to `timeout_s` for a sample in flight) and the server. Idempotent."""
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(timeout_s)
        if self._server is not None:
            self._server.close(timeout_s=timeout_s)
