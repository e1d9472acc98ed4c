"""Active bandwidth and round-trip-time probe between peers, over libp2p streams.

What it measures: for each probed peer, the median round-trip time of `num_pings` pings and the
download and upload throughput of `probe_bytes` each way, all on one libp2p stream opened through
the DHT's `p2pd`. The figures therefore include libp2p and daemon overhead, which is what averaging
traffic pays too. Throughput is timed from the first byte of the request to the last byte of the
reply, so it includes one round trip; Mbps means 10^6 bits per second.

Protocol `swarm.probe.v1` (one stream per probe; requests are served in order on it): a request is
one op byte and an 8-byte big-endian unsigned integer.
  P <8 bytes>  ping: the server echoes the 8 bytes at once (the client sends a random nonce).
  D <length>   download: the server sends `length` bytes.
  U <length>   upload: the client sends `length` bytes; the server reads exactly that many and
               replies with their count as an 8-byte big-endian integer.
The client closes the stream when done. The server refuses by closing the stream; there is no
error message on the wire.

Bounds. Everything read from the network is untrusted input. The server serves at most
`max_concurrent_served` streams at once (more are closed at once), sends and receives at most
`max_request_bytes` each way per stream, serves at most 64 requests per stream, and gives each
stream `timeout_s` in total. Anything else (unknown op, a truncated header, a short upload, a
request over the cap, a slow client) closes the stream and is counted by reason in
`ProbeServer.rejected`; the handler never raises. The client bounds the whole probe by its own
`timeout_s` and raises `ProbeError` on any refusal, timeout or malformed reply.

Byte counts in `ProbeResult` include the 9-byte headers: a probe sends
`probe_bytes + 9 * (num_pings + 2)` bytes and receives `probe_bytes + 8 * (num_pings + 1)`.

`ProbeServer` and `probe_peer` are asyncio building blocks for a process that runs its own event
loop; `BandwidthProber` wraps both for a synchronous process (the trainer): it owns a thread with
its own event loop and its own replica of the DHT's `P2P`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from bootstrap.errors import NetworkError, one_line
from bootstrap.framing import CLOSE_TIMEOUT_S, ProtocolError, close_stream
from bootstrap.runtime import Served, ServedFacade, StreamServer, peer_id_of

__all__ = ["PROTOCOL", "BandwidthProber", "ProbeConfig", "ProbeError", "ProbeResult", "ProbeServer", "probe_peer"]

logger = logging.getLogger(__name__)

PROTOCOL = "swarm.probe.v1"
OP_PING, OP_DOWNLOAD, OP_UPLOAD = b"P"[0], b"D"[0], b"U"[0]
_HEADER_BYTES = 9
_COUNT_BYTES = 8
_CHUNK_BYTES = 64 * 1024
_PAYLOAD = os.urandom(_CHUNK_BYTES)  # random, so that no layer could compress it away
_MAX_REQUESTS_PER_STREAM = 64
_MAX_NUM_PINGS = 32  # leaves room for the download and upload under _MAX_REQUESTS_PER_STREAM
_MAX_LENGTH = 2**63 - 1
_RPC_TIMEOUT_S = 10.0
_SUMMARY_WINDOW = 32
_MIB = 1024 * 1024


# --- configuration and results ------------------------------------------------------------------


def _check_int(name: str, value: object, *, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: must be an integer in [{low}, {high}], got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeConfig:
    """How a peer probes others and how much probing it serves."""

    probe_bytes: int = _MIB
    """Bytes sent each way (one download, one upload) per probe."""
    max_request_bytes: int = 8 * _MIB
    """Server side: most bytes served each way on one stream; a request for more is refused."""
    timeout_s: float = 5.0
    """Whole-probe bound for the client; whole-stream bound for the server."""
    num_pings: int = 3
    """Pings per probe; the reported RTT is their median."""
    max_concurrent_served: int = 2
    """Server side: most probes served at once; more are refused immediately."""

    def __post_init__(self) -> None:
        _check_int("max_request_bytes", self.max_request_bytes, low=1, high=_MAX_LENGTH)
        # a probe that same-configured peers would refuse is a configuration mistake
        _check_int("probe_bytes", self.probe_bytes, low=1, high=self.max_request_bytes)
        _check_int("num_pings", self.num_pings, low=1, high=_MAX_NUM_PINGS)
        _check_int("max_concurrent_served", self.max_concurrent_served, low=1, high=1024)
        timeout_s = self.timeout_s
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise ValueError(f"timeout_s: must be a positive number of seconds, got {timeout_s!r}")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s: must be a positive number of seconds, got {timeout_s!r}")


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One successful probe of one peer; byte counts include headers (see the module docstring)."""

    peer_id: str
    rtt_ms: float
    download_mbps: float
    upload_mbps: float
    bytes_sent: int
    bytes_received: int


class ProbeError(NetworkError):
    """A probe failed; the message names the peer and the step.

    `reason` is one of: bad_peer_id, unreachable (no stream could be opened), refused (the peer
    closed or reset the stream before the probe finished), disconnected (another I/O error),
    malformed (a reply that breaks the protocol), timeout.
    """


def _mbps(num_bytes: int, seconds: float) -> float:
    return num_bytes * 8 / 1e6 / max(seconds, 1e-9)


# --- server -------------------------------------------------------------------------------------


async def _read_header(reader: asyncio.StreamReader) -> bytes | None:
    """The next 9-byte request header, or None if the client closed the stream between requests."""
    try:
        return await reader.readexactly(_HEADER_BYTES)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise ProtocolError("truncated_header", f"{len(e.partial)} of {_HEADER_BYTES} header bytes") from None


async def _receive(reader: asyncio.StreamReader, length: int) -> None:
    received = 0
    while received < length:
        chunk = await reader.read(min(_CHUNK_BYTES, length - received))
        if not chunk:
            raise ProtocolError("short_read", f"upload ended after {received} of {length} bytes")
        received += len(chunk)


async def _send(writer: asyncio.StreamWriter, length: int) -> None:
    sent = 0
    while sent < length:
        chunk = _PAYLOAD[: min(_CHUNK_BYTES, length - sent)]
        writer.write(chunk)
        await writer.drain()
        sent += len(chunk)


class ProbeServer(StreamServer):
    """Serves `swarm.probe.v1` on a `P2P` (e.g. `bootstrap.runtime`'s) in the running event loop.

    `rejected` counts refused or aborted streams by reason: busy, unknown_op, too_large,
    truncated_header, short_read, timeout, too_many_requests, disconnected, internal error.
    `num_served` counts streams served to the end; `num_active` is the number being served now.
    """

    protocol = PROTOCOL

    def __init__(self, config: ProbeConfig, *, p2p: P2P) -> None:
        super().__init__(p2p=p2p, rpc_timeout_s=_RPC_TIMEOUT_S)
        self._config = config
        self.num_served = 0

    async def _handle(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(info.peer_id)
        async with self._guarded(peer, writer, timeout_s=self._config.timeout_s):
            if self._busy(self._config.max_concurrent_served):
                self._reject(peer, "busy", f"already serving {len(self._active)} probe streams")
                return
            async with self._serving():
                await asyncio.wait_for(self._serve(reader, writer), self._config.timeout_s)
            self.num_served += 1

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        budget = {OP_DOWNLOAD: self._config.max_request_bytes, OP_UPLOAD: self._config.max_request_bytes}
        for _ in range(_MAX_REQUESTS_PER_STREAM):
            header = await _read_header(reader)
            if header is None:
                return
            op, argument = header[0], header[1:]
            if op == OP_PING:
                writer.write(argument)
                await writer.drain()
                continue
            if op not in budget:
                raise ProtocolError("unknown_op", f"op byte {bytes([op])!r}")
            length = int.from_bytes(argument, "big")
            if length > budget[op]:
                raise ProtocolError("too_large", f"{bytes([op]).decode()} of {length} bytes, {budget[op]} left")
            budget[op] -= length
            if op == OP_DOWNLOAD:
                await _send(writer, length)
            else:
                await _receive(reader, length)
                writer.write(length.to_bytes(_COUNT_BYTES, "big"))
                await writer.drain()
        raise ProtocolError("too_many_requests", f"more than {_MAX_REQUESTS_PER_STREAM} requests")


# --- client -------------------------------------------------------------------------------------


@dataclass
class _Stream:
    """One open probe stream and the bytes that crossed it."""

    peer: str
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    bytes_sent: int = 0
    bytes_received: int = 0

    async def send(self, data: bytes, what: str) -> None:
        try:
            self.writer.write(data)
            await self.writer.drain()
        except ConnectionError as e:
            raise self._refused(f"reset the probe stream while we sent the {what} ({one_line(e)})") from e
        self.bytes_sent += len(data)

    async def receive_exactly(self, num_bytes: int, what: str) -> bytes:
        try:
            data = await self.reader.readexactly(num_bytes)
        except asyncio.IncompleteReadError as e:
            raise self._refused(
                f"closed the probe stream after {len(e.partial)} of {num_bytes} bytes of the {what}"
            ) from None
        except ConnectionError as e:
            raise self._refused(f"reset the probe stream during the {what} ({one_line(e)})") from e
        self.bytes_received += num_bytes
        return data

    async def receive_count(self, num_bytes: int, what: str) -> None:
        received = 0
        while received < num_bytes:
            try:
                chunk = await self.reader.read(min(_CHUNK_BYTES, num_bytes - received))
            except ConnectionError as e:
                raise self._refused(f"reset the probe stream during the {what} ({one_line(e)})") from e
            if not chunk:
                raise self._refused(f"closed the probe stream after {received} of {num_bytes} bytes of the {what}")
            received += len(chunk)
        self.bytes_received += num_bytes

    def _refused(self, what_happened: str) -> ProbeError:
        # the protocol refuses by closing the stream, which can reach us as EOF or as a reset
        return ProbeError(
            f"peer {self.peer} {what_happened}: it refused the probe (busy, or a request over its "
            f"max_request_bytes) or went away",
            reason="refused",
        )


async def _ping(stream: _Stream) -> float:
    nonce = os.urandom(_COUNT_BYTES)
    started = time.perf_counter()
    await stream.send(bytes([OP_PING]) + nonce, "ping")
    echo = await stream.receive_exactly(_COUNT_BYTES, "ping reply")
    elapsed_s = time.perf_counter() - started
    if echo != nonce:
        raise ProbeError(f"peer {stream.peer} answered a ping with the wrong bytes", reason="malformed")
    return elapsed_s * 1000


async def _download(stream: _Stream, num_bytes: int) -> float:
    started = time.perf_counter()
    await stream.send(bytes([OP_DOWNLOAD]) + num_bytes.to_bytes(_COUNT_BYTES, "big"), "download request")
    await stream.receive_count(num_bytes, "download")
    return _mbps(num_bytes, time.perf_counter() - started)


async def _upload(stream: _Stream, num_bytes: int) -> float:
    started = time.perf_counter()
    await stream.send(bytes([OP_UPLOAD]) + num_bytes.to_bytes(_COUNT_BYTES, "big"), "upload request")
    sent = 0
    while sent < num_bytes:
        chunk = _PAYLOAD[: min(_CHUNK_BYTES, num_bytes - sent)]
        await stream.send(chunk, "upload")
        sent += len(chunk)
    count = int.from_bytes(await stream.receive_exactly(_COUNT_BYTES, "upload reply"), "big")
    elapsed_s = time.perf_counter() - started
    if count != num_bytes:
        raise ProbeError(
            f"peer {stream.peer} acknowledged {count} bytes of an upload of {num_bytes}", reason="malformed"
        )
    return _mbps(num_bytes, elapsed_s)


async def _probe(p2p: P2P, peer_id: PeerID, config: ProbeConfig) -> ProbeResult:
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(peer_id, PROTOCOL)
    except Exception as e:  # the daemon reports dial and protocol failures with several types
        raise ProbeError(
            f"cannot open a {PROTOCOL} stream to peer {peer_id}: {one_line(e)}", reason="unreachable"
        ) from e
    stream = _Stream(peer=str(peer_id), reader=reader, writer=writer)
    try:
        rtts_ms = [await _ping(stream) for _ in range(config.num_pings)]
        download_mbps = await _download(stream, config.probe_bytes)
        upload_mbps = await _upload(stream, config.probe_bytes)
    except (ConnectionError, OSError) as e:
        raise ProbeError(f"probe stream to peer {peer_id} broke: {one_line(e)}", reason="disconnected") from e
    finally:
        await close_stream(writer)
    return ProbeResult(
        peer_id=str(peer_id),
        rtt_ms=statistics.median(rtts_ms),
        download_mbps=download_mbps,
        upload_mbps=upload_mbps,
        bytes_sent=stream.bytes_sent,
        bytes_received=stream.bytes_received,
    )


async def probe_peer(p2p: P2P, peer_id: PeerID | str, config: ProbeConfig | None = None) -> ProbeResult:
    """Measure RTT, download and upload to `peer_id` within `config.timeout_s`.

    Raises `ProbeError` (with `reason`) on a bad peer id, an unreachable peer, a refusal, a broken
    stream, a malformed reply or the timeout; the stream is closed in every case.
    """
    config = config if config is not None else ProbeConfig()
    try:
        peer = peer_id_of(peer_id)
    except ValueError as e:
        raise ProbeError(str(e), reason="bad_peer_id") from None
    try:
        return await asyncio.wait_for(_probe(p2p, peer, config), config.timeout_s)
    except asyncio.TimeoutError:
        raise ProbeError(
            f"probe of peer {peer} did not finish within {config.timeout_s:.1f} s; "
            f"is it reachable and serving {PROTOCOL}?",
            reason="timeout",
        ) from None


# --- synchronous facade -------------------------------------------------------------------------


class BandwidthProber(ServedFacade):
    """Probes peers and serves probes on the DHT's network runtime (`bootstrap.runtime`).

    Thread-safe; `probe` calls are serialised so that probes do not share the link. Use as a
    context manager or call `close()`. One prober per DHT: a second one on the same daemon takes
    over the `swarm.probe.v1` handler. `failures` counts failed probes by `ProbeError.reason`;
    `server.rejected` counts refused incoming probes.
    """

    def __init__(self, config: ProbeConfig | None = None, *, dht: hivemind.DHT, start_timeout_s: float = 30.0) -> None:
        self._config = config if config is not None else ProbeConfig()
        self.failures: Counter[str] = Counter()
        self._results: deque[ProbeResult] = deque(maxlen=_SUMMARY_WINDOW)
        self._lock = threading.Lock()
        self._probe_lock = threading.Lock()
        self._served = Served(
            dht,
            lambda p2p: ProbeServer(self._config, p2p=p2p),
            what="the bandwidth prober",
            start_timeout_s=start_timeout_s,
        )

    server: ProbeServer
    """The probe server; its counters stay readable after `close()`."""

    def probe(self, peer_ids: Sequence[str], *, max_peers: int = 3) -> list[ProbeResult]:
        """Probe `peer_ids` one at a time, in order, until `max_peers` probes succeeded.

        Failures are logged, counted in `failures` and skipped; at most `2 * max_peers` peers are
        tried, so a call takes at most about `2 * max_peers * timeout_s`. Our own id and
        duplicates are skipped. Raises `RuntimeError` once closed.
        """
        _check_int("max_peers", max_peers, low=1, high=1024)
        if isinstance(peer_ids, (str, bytes)):
            raise TypeError(f"peer_ids: expected a sequence of peer ids, got the single value {peer_ids!r}")
        p2p = self._served.p2p
        own = str(p2p.peer_id)
        candidates = [peer for peer in dict.fromkeys(map(str, peer_ids)) if peer != own][: 2 * max_peers]
        bound_s = (len(candidates) + 1) * (self._config.timeout_s + CLOSE_TIMEOUT_S)
        if not self._probe_lock.acquire(timeout=bound_s):
            raise TimeoutError(f"another probe call did not finish within {bound_s:.1f} s")
        try:
            try:
                results, failures = self._served.call(self._probe_many(p2p, candidates, max_peers), timeout_s=bound_s)
            except TimeoutError:
                raise TimeoutError(f"probing {len(candidates)} peers took over {bound_s:.1f} s") from None
        finally:
            self._probe_lock.release()
        with self._lock:
            self._results.extend(results)
            self.failures.update(failures)
        return results

    async def _probe_many(self, p2p: P2P, candidates: list[str], max_peers: int) -> tuple[list[ProbeResult], list[str]]:
        results: list[ProbeResult] = []
        failures: list[str] = []
        for peer in candidates:
            if len(results) >= max_peers:
                break
            try:
                results.append(await probe_peer(p2p, peer, self._config))
            except ProbeError as e:
                failures.append(e.reason)
                logger.info("bandwidth probe failed (%s): %s", e.reason, e)
        return results, failures

    def summary(self) -> dict[str, float | int | None]:
        """Medians over the last (up to 32) successful probes; None fields when nothing measured."""
        with self._lock:
            results = list(self._results)

        def median(values: list[float]) -> float | None:
            return statistics.median(values) if values else None

        return {
            "num_probes": len(results),
            "rtt_ms": median([r.rtt_ms for r in results]),
            "download_mbps": median([r.download_mbps for r in results]),
            "upload_mbps": median([r.upload_mbps for r in results]),
        }
