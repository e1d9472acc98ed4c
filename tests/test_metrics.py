"""Prometheus metrics: a peer's `PeerMetrics` and the bootstrap node's `--metrics-port`, scraped over HTTP.

Every check reads the metrics the way Prometheus does (an HTTP GET of /metrics, parsed with
prometheus_client's own parser), so a name that changes or a value that is not exported fails here.
"""

from __future__ import annotations

import math
import socket
import time
import urllib.error
import urllib.request
from collections import Counter

import hivemind
import pytest
from helpers import bootstrap_cmd, free_port, read_line_matching, spawn, start_bootstrap, terminate, wait_until
from hivemind.utils.timed_storage import get_dht_time
from prometheus_client.parser import text_string_to_metric_families

import bootstrap.metrics
import swarm.metrics
from bootstrap import stop_dht
from bootstrap.metrics import BootstrapMetrics, MetricsServerError, serve_metrics
from bootstrap.node import BootstrapConfig
from peers import peers_key
from swarm.metrics import PeerMetrics

# the documented names, spelled out: renaming one breaks dashboards, so it must break this test too
PEER_METRIC_NAMES = {
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
}
BOOTSTRAP_METRIC_NAMES = (
    "swarm_bootstrap_peers_known",
    "swarm_bootstrap_uptime_seconds",
    "swarm_bootstrap_record_rejections_total",
)
PEER_ID = "12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"

Samples = dict[tuple[str, frozenset], float]


def _scrape(url: str, timeout_s: float = 5.0) -> Samples:
    """GET `url` and parse it as Prometheus does: {(sample name, labels): value}."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _try_scrape(url: str) -> Samples | None:
    try:
        return _scrape(url, timeout_s=2.0)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def _value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def _names(samples: Samples) -> set[str]:
    names = {name for name, _ in samples}
    # a histogram's samples are NAME_bucket/_sum/_count: it is documented under NAME
    return names | {name.rsplit("_", 1)[0] for name in names if name.endswith(("_bucket", "_count", "_sum"))}


def _port_is_free(port: int) -> bool:
    """True if a new server could listen on 127.0.0.1:port (SO_REUSEADDR, as servers set it)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen(1)
        except OSError:
            return False
    return True


@pytest.fixture
def peer_metrics():
    metrics = PeerMetrics(peer_id=PEER_ID, run="demo-run", task="charlm", version="9.9.9")
    yield metrics
    metrics.close()


# --- a peer's metrics -------------------------------------------------------------------------


def test_peer_metrics_scraped_over_http_show_every_documented_metric(peer_metrics: PeerMetrics) -> None:
    server = peer_metrics.serve(0)
    assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
    peer_metrics.observe_round(outcome="ok", duration_s=1.5, bytes_sent=1000, bytes_received=2000)
    peer_metrics.observe_round(outcome="solo", duration_s=0.05, bytes_sent=0, bytes_received=0)
    peer_metrics.observe_round(outcome="ok", duration_s=30.0, bytes_sent=10, bytes_received=20)
    peer_metrics.observe_step(step=7, samples=32, loss=2.5, samples_per_s=100.0)
    peer_metrics.observe_step(step=8, samples=16, loss=None, samples_per_s=90.0)  # no loss: gauge kept
    peer_metrics.set_val_loss(2.25)
    peer_metrics.set_round(3)
    peer_metrics.set_peers_known(4)
    peer_metrics.add_rejections("manifest", {"bad signature": 2})
    peer_metrics.checkpoint_sealed()
    peer_metrics.state_synced("join")

    samples = _scrape(server.url)
    assert PEER_METRIC_NAMES <= _names(samples), sorted(PEER_METRIC_NAMES - _names(samples))
    expected = {
        ("swarm_rounds_total", (("outcome", "ok"),)): 2,
        ("swarm_rounds_total", (("outcome", "solo"),)): 1,
        ("swarm_rounds_total", (("outcome", "failed"),)): 0,  # every outcome is exported from the start
        ("swarm_round_duration_seconds_count", ()): 3,
        ("swarm_round_duration_seconds_sum", ()): 31.55,
        ("swarm_round_duration_seconds_bucket", (("le", "0.1"),)): 1,
        ("swarm_round_duration_seconds_bucket", (("le", "2.5"),)): 2,
        ("swarm_round_duration_seconds_bucket", (("le", "120.0"),)): 3,
        ("swarm_bytes_sent_total", ()): 1010,
        ("swarm_bytes_received_total", ()): 2020,
        ("swarm_rejections_total", (("what", "manifest"), ("reason", "bad signature"))): 2,
        ("swarm_peers_known", ()): 4,
        ("swarm_train_loss", ()): 2.5,
        ("swarm_val_loss", ()): 2.25,
        ("swarm_step", ()): 8,
        ("swarm_round", ()): 3,
        ("swarm_samples_total", ()): 48,
        ("swarm_samples_per_second", ()): 90.0,
        ("swarm_checkpoints_sealed_total", ()): 1,
        ("swarm_state_syncs_total", (("reason", "join"),)): 1,
        ("swarm_info", (("peer_id", PEER_ID), ("run", "demo-run"), ("task", "charlm"), ("version", "9.9.9"))): 1,
    }
    for (name, labels), value in expected.items():
        assert _value(samples, name, **dict(labels)) == pytest.approx(value), (name, labels)


def test_documented_names_match_the_module() -> None:
    assert set(swarm.metrics.METRIC_NAMES) == PEER_METRIC_NAMES
    for name in PEER_METRIC_NAMES:
        assert f"`{name}`" in swarm.metrics.__doc__, f"{name} is not documented in swarm/metrics.py"
    for name in BOOTSTRAP_METRIC_NAMES:
        assert f"`{name}" in bootstrap.metrics.__doc__, f"{name} is not documented in bootstrap/metrics.py"


def test_add_rejections_adds_only_the_growth_of_a_cumulative_tally(peer_metrics: PeerMetrics) -> None:
    def value(what: str, reason: str) -> float | None:
        return peer_metrics.registry.get_sample_value("swarm_rejections_total", {"what": what, "reason": reason})

    tally: Counter = Counter()
    tally["bad signature"] += 2
    peer_metrics.add_rejections("receipt", tally)
    peer_metrics.add_rejections("receipt", tally)  # unchanged tally: nothing added
    assert value("receipt", "bad signature") == 2
    tally["bad signature"] += 3
    tally["oversized"] += 1
    peer_metrics.add_rejections("receipt", tally)
    assert value("receipt", "bad signature") == 5 and value("receipt", "oversized") == 1
    # another kind of input with the same reason is its own series
    peer_metrics.add_rejections("status", {"bad signature": 4})
    assert value("status", "bad signature") == 4 and value("receipt", "bad signature") == 5
    # a tally that went down was reset at its source: its new value is all new rejections
    peer_metrics.add_rejections("receipt", {"bad signature": 1})
    assert value("receipt", "bad signature") == 6
    with pytest.raises(ValueError, match="counts"):
        peer_metrics.add_rejections("receipt", {"bad signature": -1})


def test_non_finite_losses_are_exported_as_nan_without_raising(peer_metrics: PeerMetrics) -> None:
    server = peer_metrics.serve(0)
    for bad in (math.nan, math.inf, -math.inf):
        peer_metrics.observe_step(step=1, samples=1, loss=bad, samples_per_s=bad)
        peer_metrics.set_val_loss(bad)
        samples = _scrape(server.url)
        for name in ("swarm_train_loss", "swarm_val_loss", "swarm_samples_per_second"):
            assert math.isnan(_value(samples, name)), (name, bad)
    peer_metrics.observe_step(step=2, samples=1, loss=1.25, samples_per_s=3.0)
    assert _value(_scrape(server.url), "swarm_train_loss") == 1.25


@pytest.mark.parametrize(
    ("call", "field_name"),
    [
        (lambda m: m.observe_round(outcome="great", duration_s=1, bytes_sent=0, bytes_received=0), "outcome"),
        (lambda m: m.observe_round(outcome="ok", duration_s=-1, bytes_sent=0, bytes_received=0), "duration_s"),
        (lambda m: m.observe_round(outcome="ok", duration_s=math.nan, bytes_sent=0, bytes_received=0), "duration_s"),
        (lambda m: m.observe_round(outcome="ok", duration_s=1, bytes_sent=-5, bytes_received=0), "bytes_sent"),
        (lambda m: m.observe_step(step=1, samples=True, loss=None, samples_per_s=1), "samples"),
        (lambda m: m.set_round(1.5), "number"),
        (lambda m: m.state_synced(""), "reason"),
    ],
)
def test_bad_updates_raise_value_error_naming_the_argument(peer_metrics: PeerMetrics, call, field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        call(peer_metrics)


def test_each_component_has_its_own_registry() -> None:
    first = PeerMetrics(peer_id=PEER_ID, run="a", task="charlm")
    second = PeerMetrics(peer_id=PEER_ID, run="b", task="charlm")  # same names, no "Duplicated timeseries"
    first.set_round(1)
    second.set_round(2)
    assert first.registry.get_sample_value("swarm_round") == 1
    assert second.registry.get_sample_value("swarm_round") == 2
    assert BootstrapMetrics().registry is not BootstrapMetrics().registry


def test_close_releases_the_port_promptly_and_is_idempotent(peer_metrics: PeerMetrics) -> None:
    server = peer_metrics.serve(0)
    assert _scrape(server.url)
    with pytest.raises(RuntimeError, match="already serving"):
        peer_metrics.serve(0)
    started = time.monotonic()
    peer_metrics.close()
    closed_s = time.monotonic() - started
    peer_metrics.close()
    assert closed_s < 1.0, f"close took {closed_s:.2f} s"
    assert _port_is_free(server.port)
    with pytest.raises(urllib.error.URLError):
        _scrape(server.url, timeout_s=2.0)


def test_port_in_use_raises_a_value_error_naming_port_and_fix(peer_metrics: PeerMetrics) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        with pytest.raises(MetricsServerError) as info:
            peer_metrics.serve(port)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert f"127.0.0.1:{port}" in message and "already in use" in message and "choose another" in message


@pytest.mark.parametrize("port", [-1, 65536, True, 1.5])
def test_serve_metrics_rejects_a_bad_port(port) -> None:
    with pytest.raises(ValueError, match="port"):
        serve_metrics(BootstrapMetrics().registry, port=port)


# --- the bootstrap node -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        (dict(metrics_port=-1), "metrics_port"),
        (dict(metrics_port=70000), "metrics_port"),
        (dict(metrics_port=True), "metrics_port"),
        (dict(metrics_host=""), "metrics_host"),
    ],
)
def test_bootstrap_config_rejects_bad_metrics_options(kwargs: dict, field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        BootstrapConfig(**kwargs)
    assert BootstrapConfig().metrics_port == 0, "metrics are off unless asked for"


@pytest.mark.timeout(90)
def test_bootstrap_node_serves_its_metrics_and_frees_the_port_on_sigterm(tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    node = start_bootstrap(tmp_path / "bootstrap.id", extra=["--metrics-port", str(port), "--refresh-period-s", "0.5"])
    client = None
    try:
        read_line_matching(node.child, f"metrics at {url}", timeout_s=10, stream="stderr")
        # a plain hivemind DHT (no record validator) joins and stores a garbage capability record
        client = hivemind.DHT(
            initial_peers=node.maddrs, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False
        )
        client.store(
            peers_key(PEER_ID), {"p": b"garbage", "s": b"x" * 64}, expiration_time=get_dht_time() + 30, subkey=PEER_ID
        )

        def caught_up() -> Samples | None:
            samples = _try_scrape(url)
            peers = samples and _value(samples, "swarm_bootstrap_peers_known")
            rejected = samples and _value(samples, "swarm_bootstrap_record_rejections_total", reason="malformed")
            return samples if peers and peers >= 1 and rejected and rejected >= 1 else None

        samples = wait_until(
            caught_up,
            timeout_s=20,
            interval_s=0.2,
            message=lambda: f"peers_known >= 1 and a rejection at {url}: {_try_scrape(url)}",
        )
        uptime_s = _value(samples, "swarm_bootstrap_uptime_seconds")
        assert uptime_s is not None and 0 < uptime_s < 90
        assert _value(_try_scrape(url) or {}, "swarm_bootstrap_uptime_seconds") >= uptime_s
    finally:
        if client is not None:
            stop_dht(client)
        returncode = terminate(node.child, timeout_s=15)
    assert returncode == 0, node.child.describe()
    assert _port_is_free(port), f"metrics port {port} still in use after the node exited"


@pytest.mark.timeout(60)
def test_bootstrap_metrics_port_in_use_exits_2_naming_the_port(tmp_path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        child = spawn(bootstrap_cmd(port=free_port(), identity=tmp_path / "id", extra=["--metrics-port", str(port)]))
        try:
            returncode = child.popen.wait(timeout=40)
        finally:
            if child.popen.poll() is None:
                terminate(child, timeout_s=10)
    child.join_output()
    assert returncode == 2, child.describe()
    errors = [line for line in child.stderr_lines if line.startswith("bootstrap: error:")]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "already in use" in errors[0], child.describe()
