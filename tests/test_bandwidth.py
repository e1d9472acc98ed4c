"""The active bandwidth/RTT probe (`peers.bandwidth`) between in-process DHTs on loopback.

Three DHTs (each with its p2pd) are shared by the module. Server-side behaviour is asserted through
`ProbeServer.rejected` (outcome and count); raw protocol clients run in the test's own event loop
on a `P2P` replica of the first DHT. Waits poll with a deadline; nothing sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import hivemind
import pytest
from helpers import wait_until
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from bootstrap.node import start_dht, stop_dht, visible_maddrs
from bootstrap.runtime import open_p2p_replica
from peers.bandwidth import PROTOCOL, BandwidthProber, ProbeConfig, ProbeError, probe_peer

pytestmark = pytest.mark.timeout(30)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
SMALL = ProbeConfig(probe_bytes=64 * 1024, max_request_bytes=64 * 1024, timeout_s=3.0)
POLL_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def dhts() -> Iterator[list[hivemind.DHT]]:
    """Three loopback DHTs; the second and third joined through the first."""
    started: list[hivemind.DHT] = []
    try:
        started.append(start_dht(host_maddrs=LOOPBACK, nat_port_map=False))
        initial_peers = visible_maddrs(started[0])
        for _ in range(2):
            started.append(start_dht(initial_peers, host_maddrs=LOOPBACK, nat_port_map=False))
        yield started
    finally:
        for dht in reversed(started):
            stop_dht(dht)


@pytest.fixture
def make_prober() -> Iterator[Callable[..., BandwidthProber]]:
    """`make_prober(dht, config=None)`: a `BandwidthProber` closed at teardown."""
    probers: list[BandwidthProber] = []

    def make(dht: hivemind.DHT, config: ProbeConfig | None = None) -> BandwidthProber:
        prober = BandwidthProber(config, dht=dht)
        probers.append(prober)
        return prober

    yield make
    for prober in probers:
        prober.close()


def run_with_replica(dht: hivemind.DHT, scenario: Callable[[P2P], Awaitable[None]]) -> None:
    """Run `scenario(p2p)` in a fresh event loop with its own replica of `dht`'s P2P."""

    async def main() -> None:
        p2p = await open_p2p_replica(dht)
        try:
            await scenario(p2p)
        finally:
            await p2p.shutdown()

    asyncio.run(main())


async def async_wait_until(predicate: Callable[[], object], message: str) -> None:
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while not predicate():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{message} not reached within {POLL_TIMEOUT_S:.1f} s")
        await asyncio.sleep(0.01)


async def expect_closed(reader: asyncio.StreamReader) -> None:
    """The server closed the stream: EOF arrives, with no bytes before it."""
    assert await asyncio.wait_for(reader.read(1), POLL_TIMEOUT_S) == b""


def random_peer_id() -> str:
    key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
    return str(PeerID.from_identity(key.SerializeToString()))


def header(op: bytes, value: int) -> bytes:
    return op + value.to_bytes(8, "big")


# --- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("probe_bytes", 0),
        ("probe_bytes", 9 * 1024 * 1024),  # over the default max_request_bytes
        ("max_request_bytes", -1),
        ("timeout_s", 0),
        ("timeout_s", float("inf")),
        ("num_pings", 0),
        ("num_pings", True),
        ("max_concurrent_served", 0),
    ],
)
def test_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: .*{value!r}"):
        ProbeConfig(**{field: value})


def test_probe_between_peers_measures_and_counts_bytes(dhts, make_prober) -> None:
    config = ProbeConfig()  # 1 MiB each way, 3 pings
    prober_a, prober_b, prober_c = (make_prober(dht, config) for dht in dhts)

    results = prober_a.probe([prober_b.peer_id, prober_c.peer_id, prober_a.peer_id], max_peers=3)

    assert [r.peer_id for r in results] == [prober_b.peer_id, prober_c.peer_id]  # own id skipped
    for result in results:
        assert result.rtt_ms > 0 and result.download_mbps > 0 and result.upload_mbps > 0
        # headers included: num_pings pings, one download and one upload request of 9 bytes each
        assert result.bytes_sent == config.probe_bytes + 9 * (config.num_pings + 2)
        assert result.bytes_received == config.probe_bytes + 8 * (config.num_pings + 1)
        print(
            f"loopback, {config.probe_bytes} B: rtt {result.rtt_ms:.3f} ms, "
            f"down {result.download_mbps:.0f} Mbps, up {result.upload_mbps:.0f} Mbps"
        )
    summary = prober_a.summary()
    assert summary["num_probes"] == 2 and summary["rtt_ms"] > 0 and summary["upload_mbps"] > 0
    assert prober_a.failures.total() == 0
    for server in (prober_b.server, prober_c.server):
        # the client may hang up before the server has seen the end of the stream
        wait_until(lambda server=server: server.num_served == 1, POLL_TIMEOUT_S, message="probe served")
        assert server.rejected.total() == 0


def test_summary_is_empty_before_any_probe(dhts, make_prober) -> None:
    prober = make_prober(dhts[0])
    assert prober.summary() == {"num_probes": 0, "rtt_ms": None, "download_mbps": None, "upload_mbps": None}


def test_server_refuses_request_over_its_cap(dhts, make_prober) -> None:
    server = make_prober(dhts[1], SMALL).server
    greedy = ProbeConfig(probe_bytes=2 * SMALL.max_request_bytes, max_request_bytes=2 * SMALL.max_request_bytes)

    async def scenario(p2p: P2P) -> None:
        with pytest.raises(ProbeError, match="closed the probe stream.*download") as caught:
            await probe_peer(p2p, server_peer_id, greedy)
        assert caught.value.reason == "refused"

    server_peer_id = str(dhts[1].peer_id)
    run_with_replica(dhts[0], scenario)
    wait_until(lambda: server.rejected["too_large"] == 1, POLL_TIMEOUT_S, message="too_large counted")
    assert server.rejected.total() == 1 and server.num_served == 0


def test_malformed_requests_are_counted_and_serving_goes_on(dhts, make_prober) -> None:
    server = make_prober(dhts[1], SMALL).server
    server_peer_id = PeerID.from_base58(str(dhts[1].peer_id))

    async def scenario(p2p: P2P) -> None:
        _, reader, writer = await p2p.call_binary_stream_handler(server_peer_id, PROTOCOL)
        writer.write(header(b"X", 1))
        await expect_closed(reader)
        writer.close()
        await async_wait_until(lambda: server.rejected["unknown_op"] == 1, "unknown_op counted")

        _, reader, writer = await p2p.call_binary_stream_handler(server_peer_id, PROTOCOL)
        writer.write(b"D\x00\x00")  # 3 of 9 header bytes, then the client goes away
        await writer.drain()
        writer.close()
        await async_wait_until(lambda: server.rejected["truncated_header"] == 1, "truncated_header counted")

        result = await probe_peer(p2p, server_peer_id, SMALL)
        assert result.download_mbps > 0

    run_with_replica(dhts[0], scenario)
    wait_until(lambda: server.num_served == 1, POLL_TIMEOUT_S, message="valid probe served")
    assert server.rejected == {"unknown_op": 1, "truncated_header": 1}


def test_concurrency_cap_refuses_extra_probe(dhts, make_prober) -> None:
    server = make_prober(dhts[1], ProbeConfig(max_concurrent_served=1, timeout_s=10.0)).server
    server_peer_id = PeerID.from_base58(str(dhts[1].peer_id))

    async def scenario(p2p: P2P) -> None:
        # hold the only slot: an upload of 1000 bytes that stalls after 10
        _, reader, writer = await p2p.call_binary_stream_handler(server_peer_id, PROTOCOL)
        writer.write(header(b"U", 1000) + b"x" * 10)
        await writer.drain()
        await async_wait_until(lambda: server.num_active == 1, "stalled upload being served")

        with pytest.raises(ProbeError) as caught:
            await probe_peer(p2p, server_peer_id, SMALL)
        assert caught.value.reason == "refused"
        assert server.rejected == {"busy": 1}

        writer.close()  # the stalled upload ends short: its slot frees up
        await async_wait_until(lambda: server.num_active == 0, "stalled upload released")
        assert server.rejected == {"busy": 1, "short_read": 1}
        assert (await probe_peer(p2p, server_peer_id, SMALL)).upload_mbps > 0

    run_with_replica(dhts[0], scenario)
    wait_until(lambda: server.num_served == 1, POLL_TIMEOUT_S, message="valid probe served")
    assert server.rejected == {"busy": 1, "short_read": 1}


def test_client_rejects_malformed_replies(dhts) -> None:
    """A peer that echoes the wrong ping bytes is reported as malformed, not trusted."""
    target = PeerID.from_base58(str(dhts[2].peer_id))

    async def liar(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(9)
        writer.write(b"\x00" * 8)
        await writer.drain()
        await reader.read(1)  # until the client hangs up
        writer.close()

    async def scenario(p2p: P2P) -> None:
        server_p2p = await open_p2p_replica(dhts[2])
        try:
            await server_p2p.add_binary_stream_handler(PROTOCOL, liar)
            with pytest.raises(ProbeError, match="wrong bytes") as caught:
                await probe_peer(p2p, target, SMALL)
            assert caught.value.reason == "malformed"
        finally:
            await server_p2p.remove_binary_stream_handler(PROTOCOL)
            await server_p2p.shutdown()

    run_with_replica(dhts[0], scenario)


def test_unreachable_peer_fails_in_time_and_is_skipped(dhts, make_prober) -> None:
    config = ProbeConfig(probe_bytes=64 * 1024, timeout_s=2.0)
    prober_a = make_prober(dhts[0], config)
    prober_b = make_prober(dhts[1], config)
    ghost = random_peer_id()

    async def scenario(p2p: P2P) -> None:
        started = time.monotonic()
        with pytest.raises(ProbeError, match=ghost) as caught:
            await probe_peer(p2p, ghost, config)
        assert time.monotonic() - started < config.timeout_s + 1.0
        assert caught.value.reason in {"unreachable", "timeout"}

    run_with_replica(dhts[0], scenario)

    # max_peers=2 lets it try up to 4 candidates: two failures, then one success
    results = prober_a.probe([ghost, "not-a-peer-id", prober_b.peer_id], max_peers=2)
    assert [r.peer_id for r in results] == [prober_b.peer_id]
    assert prober_a.failures.total() == 2 and prober_a.failures["bad_peer_id"] == 1


def test_close_is_idempotent_and_leaves_no_thread(dhts, make_prober) -> None:
    server_peer_id = make_prober(dhts[1], SMALL).peer_id
    before = set(threading.enumerate())
    prober = BandwidthProber(SMALL, dht=dhts[0])
    assert prober.probe([server_peer_id])  # the thread did real work
    with pytest.raises(ValueError, match="max_peers"):
        prober.probe([], max_peers=0)
    with pytest.raises(TypeError, match="peer_ids"):
        prober.probe(server_peer_id)
    prober.close()
    prober.close()
    assert set(threading.enumerate()) - before == set()
    with pytest.raises(RuntimeError, match="closed"):
        prober.probe([server_peer_id])


def test_close_cuts_off_a_stalled_stream_quietly(dhts, caplog) -> None:
    prober = BandwidthProber(ProbeConfig(timeout_s=20.0), dht=dhts[1])
    server = prober.server
    server_peer_id = PeerID.from_base58(prober.peer_id)

    async def scenario(p2p: P2P) -> None:
        _, reader, writer = await p2p.call_binary_stream_handler(server_peer_id, PROTOCOL)
        try:
            writer.write(header(b"U", 1000) + b"x" * 10)
            await writer.drain()
            await async_wait_until(lambda: server.num_active == 1, "stalled upload being served")
            started = time.monotonic()
            await asyncio.to_thread(prober.close)
            assert time.monotonic() - started < 5.0  # not the server's 20 s stream timeout
            await expect_closed(reader)
        finally:
            writer.close()

    with caplog.at_level("WARNING"):
        run_with_replica(dhts[0], scenario)
    assert server.num_active == 0 and server.rejected.total() == 0
    assert not [r for r in caplog.records if r.levelno >= 30], caplog.text  # e.g. asyncio's task errors
