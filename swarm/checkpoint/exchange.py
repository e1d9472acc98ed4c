"""Verified exchange of checkpoint shards between peers, over libp2p streams.

A shard is an immutable byte blob named by the SHA-256 hex digest of its bytes (a safetensors
file). Peers serve the shards they hold (`ShardServer`, reading through a `ShardSource`); a joiner
downloads a set of shards from several donors at once (`fetch_shards`), checks every digest,
throws away a shard whose bytes do not match and fetches it again from another donor, and resumes
from prefixes kept from an earlier, interrupted download.

Protocol `swarm.shards.v1`. A stream carries requests one after the other; each message is a
4-byte big-endian length, a JSON object of that length and, for a reply with data, raw bytes.
  request  {"digest": <64 lowercase hex>, "offset": int, "length": int}
  reply    {"status": "ok", "size": <shard size>, "length": n} followed by n bytes, or
           {"status": "not found"} (the stream stays open), or
           {"status": "busy"} / {"status": "bad request", "reason": ...} (the server then stops
           reading requests and hangs up once the client has, or after a short bound).
The client hangs up when done. Every peer should use the same `chunk_bytes`: a server refuses a
request for more than its own.

Bounds. Network bytes are untrusted input. A server serves at most `max_concurrent_per_donor`
streams at once to all clients together (it answers "busy" at once to more), gives each request
`timeout_s` to arrive once the stream is idle and to be sent, and never raises out of its handler:
every refusal is counted by reason in `ShardServer.rejected`. A client bounds each chunk request by
`timeout_s`, each shard by `max_attempts_per_shard` failed attempts and the whole fetch by
`fetch_timeout_s`, and raises `FetchError` when a shard cannot be had. A "busy" answer costs no
attempt: the donor backs off briefly and the shard goes elsewhere. (The daemon gives no reliable
half-close, so a donor may still count a stream the client just closed: a client whose cap equals
the donor's sees an occasional "busy" from its own churn.)

Blame. A joiner downloads a shard from one donor at a time and switches only when that donor
fails, so a digest mismatch usually has a single culprit: it is counted against that donor in
`FetchReport.corrupt_by_donor`, the donor is never asked for that shard again in this fetch, and it
is used for other shards only when cleaner donors are at capacity. When several sources made up
the bytes (a donor switch, or a resumed prefix, counted as `PARTIAL_SOURCE`), each is counted and
the next attempt prefers other donors.

`ShardServer` and `fetch_shards` are asyncio building blocks; `ShardExchange` wraps both for a
synchronous process: it owns a thread with its own event loop (uvloop) and P2P replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from bootstrap.errors import NetworkError, Rejected, one_line
from bootstrap.framing import (
    CLOSE_TIMEOUT_S,
    ProtocolError,
    close_stream,
    linger,
    read_exactly,
    read_frame,
    write_frame,
)
from bootstrap.runtime import Served, ServedFacade, StreamServer, peer_id_of

__all__ = [
    "PARTIAL_SOURCE",
    "PROTOCOL",
    "ChunkReply",
    "DirectoryShardSource",
    "ExchangeConfig",
    "FetchError",
    "FetchReport",
    "MemoryShardSource",
    "ShardExchange",
    "ShardServer",
    "ShardSource",
    "fetch_shards",
    "request_chunk",
]

logger = logging.getLogger(__name__)

PROTOCOL = "swarm.shards.v1"
PARTIAL_SOURCE = "partial"
"""The name blamed in `FetchReport.corrupt_by_donor` for a resumed prefix that did not check out."""
SHARD_SUFFIX = ".safetensors"

_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_MAX_HEADER_BYTES = 4096
_MIB = 1024 * 1024
_MAX_CHUNK_BYTES = 256 * _MIB
_MAX_SHARD_BYTES = 2**50
_LINGER_S = 2.0  # how long a server waits for the client to hang up after a final reply
_RPC_TIMEOUT_S = 10.0
_MAX_CONSECUTIVE_FAILURES = 3  # a donor failing this often in a row is dropped for the fetch
_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 1.0

STATUS_OK, STATUS_NOT_FOUND, STATUS_BUSY, STATUS_BAD_REQUEST = "ok", "not found", "busy", "bad request"
_STATUSES = frozenset({STATUS_OK, STATUS_NOT_FOUND, STATUS_BUSY, STATUS_BAD_REQUEST})


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and _DIGEST_RE.fullmatch(value) is not None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --- shard sources ------------------------------------------------------------------------------


@runtime_checkable
class ShardSource(Protocol):
    """Read access to the shards a peer holds; called from a worker thread, so it may block."""

    def has(self, digest: str) -> bool:
        """Whether the shard named `digest` can be served."""
        ...

    def size(self, digest: str) -> int | None:
        """Its size in bytes, or None if it is not held."""
        ...

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        """`length` bytes from `offset`; may raise (e.g. `OSError`, `KeyError`) if they cannot be read."""
        ...


class MemoryShardSource:
    """Shards held in memory, as {digest: bytes}; digests are not checked (tests serve bad bytes)."""

    def __init__(self, shards: Mapping[str, bytes]) -> None:
        self._shards = dict(shards)

    def has(self, digest: str) -> bool:
        return digest in self._shards

    def size(self, digest: str) -> int | None:
        data = self._shards.get(digest)
        return None if data is None else len(data)

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        return self._shards[digest][offset : offset + length]


class DirectoryShardSource:
    """Shards stored as files `root/<digest>.safetensors`; names that are not digests are never opened."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _path(self, digest: str) -> Path | None:
        return self.root / f"{digest}{SHARD_SUFFIX}" if _is_digest(digest) else None

    def has(self, digest: str) -> bool:
        path = self._path(digest)
        return path is not None and path.is_file()

    def size(self, digest: str) -> int | None:
        path = self._path(digest)
        try:
            return path.stat().st_size if path is not None and path.is_file() else None
        except OSError:
            return None

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        path = self._path(digest)
        if path is None:
            raise KeyError(digest)
        with path.open("rb") as file:
            file.seek(offset)
            return file.read(length)


# --- configuration and results ------------------------------------------------------------------


def _check_int(name: str, value: object, *, low: int, high: int) -> None:
    if not _is_int(value) or not low <= value <= high:
        raise ValueError(f"{name}: must be an integer in [{low}, {high}], got {value!r}")


def _check_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: must be a positive number of seconds, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: must be a positive number of seconds, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExchangeConfig:
    """How a peer serves shards and downloads them."""

    chunk_bytes: int = 4 * _MIB
    """Bytes per request; a server refuses requests for more (use the same value on every peer)."""
    max_concurrent_per_donor: int = 2
    """Server: streams served at once to all clients (more get "busy"); client: streams to one donor."""
    max_parallel_shards: int = 4
    """Client: shards downloaded at once."""
    timeout_s: float = 30.0
    """Bound on one chunk request (client) and on an idle stream or one reply (server)."""
    max_attempts_per_shard: int = 6
    """Client: failed attempts (broken stream, timeout, bad reply, digest mismatch) before giving up."""
    fetch_timeout_s: float = 3600.0
    """Client: bound on a whole `fetch_shards` call, waiting for busy donors included."""

    def __post_init__(self) -> None:
        _check_int("chunk_bytes", self.chunk_bytes, low=1, high=_MAX_CHUNK_BYTES)
        _check_int("max_concurrent_per_donor", self.max_concurrent_per_donor, low=1, high=1024)
        _check_int("max_parallel_shards", self.max_parallel_shards, low=1, high=1024)
        _check_int("max_attempts_per_shard", self.max_attempts_per_shard, low=1, high=1000)
        _check_seconds("timeout_s", self.timeout_s)
        _check_seconds("fetch_timeout_s", self.fetch_timeout_s)


@dataclass
class FetchReport:
    """What one fetch did; filled in as it goes, so it is meaningful after a `FetchError` too."""

    bytes_downloaded: int = 0
    """Shard bytes received in "ok" replies (headers excluded), corrupt ones later discarded included."""
    per_donor_bytes: Counter[str] = field(default_factory=Counter)
    """The same, by donor peer id."""
    corrupt_by_donor: Counter[str] = field(default_factory=Counter)
    """Digest mismatches by the donor (or `PARTIAL_SOURCE`) that supplied the bytes."""
    corrupt_shards: int = 0
    """Completed shards whose digest did not match (each counted once, whoever is blamed)."""
    retries: int = 0
    """Times a shard had to go on with another attempt (failure, busy, not found, mismatch)."""
    failures: Counter[str] = field(default_factory=Counter)
    """Failed or refused attempts by reason: unreachable, busy, not found, timeout, disconnected, malformed."""
    seconds: float = 0.0
    """Wall time of the fetch."""


class FetchError(NetworkError):
    """Some shard could not be had; the message names it and why.

    `reason`: attempts (too many failed attempts), no donor (no donor left that may have it),
    timeout (the fetch ran past its bound), or, from `request_chunk`, a transport failure
    (unreachable, timeout, disconnected, malformed). `report` is the fetch's report so far.
    """

    def __init__(self, message: str, *, reason: str, report: FetchReport | None = None) -> None:
        super().__init__(message, reason=reason)
        self.report = report


@dataclass(frozen=True, slots=True)
class ChunkReply:
    """A server's answer to one request: `status`, the shard `size` and `data` when "ok"."""

    status: str
    size: int | None = None
    data: bytes = b""
    reason: str = ""


# --- server -------------------------------------------------------------------------------------


def _parse_request(header: dict[str, Any], chunk_bytes: int) -> tuple[str, int, int]:
    digest, offset, length = header.get("digest"), header.get("offset"), header.get("length")
    if not _is_digest(digest):
        raise ProtocolError("bad digest", f"digest {str(digest)[:80]!r} is not 64 lowercase hex digits")
    if not _is_int(offset) or not 0 <= offset <= _MAX_SHARD_BYTES:
        raise ProtocolError("bad range", f"offset {str(offset)[:40]!r}")
    if not _is_int(length) or length < 1:
        raise ProtocolError("bad range", f"length {str(length)[:40]!r}")
    if length > chunk_bytes:
        raise ProtocolError("too long", f"length {length} over chunk_bytes {chunk_bytes}")
    return digest, offset, length


def _read_source(source: ShardSource, digest: str, offset: int, length: int) -> tuple[int | None, bytes]:
    """(size, data) with data empty if the shard is missing or the range is past its end."""
    size = source.size(digest) if source.has(digest) else None
    if size is None or offset + length > size:
        return size, b""
    return size, source.read_range(digest, offset, length)


class ShardServer(StreamServer):
    """Serves `swarm.shards.v1` from `source` on a `P2P` (e.g. `bootstrap.runtime`'s).

    `rejected` counts refusals by reason: busy, not found, bad digest, bad range, too long,
    malformed, truncated, source error, timeout, disconnected, internal error. `num_chunks_served`
    and `bytes_served` count "ok" replies; `num_active` is the number of streams being served now.
    """

    protocol = PROTOCOL

    def __init__(self, source: ShardSource, config: ExchangeConfig | None = None, *, p2p: P2P) -> None:
        super().__init__(p2p=p2p, rpc_timeout_s=_RPC_TIMEOUT_S)
        self._source = source
        self._config = config if config is not None else ExchangeConfig()
        self.num_chunks_served = 0
        self.bytes_served = 0

    async def _handle(self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(info.peer_id)

        async def refuse(e: Rejected) -> None:
            await self._refuse(reader, writer, {"status": STATUS_BAD_REQUEST, "reason": str(e)[:200]})

        async with self._guarded(peer, writer, timeout_s=self._config.timeout_s, refuse=refuse):
            if self._busy(self._config.max_concurrent_per_donor):
                self._reject(peer, "busy", f"already serving {len(self._active)} streams")
                await self._refuse(reader, writer, {"status": STATUS_BUSY})
                return
            async with self._serving():
                await self._serve(peer, reader, writer)

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):  # the client may be gone; it was refused either way
            await asyncio.wait_for(write_frame(writer, reply), CLOSE_TIMEOUT_S)
            await linger(reader, _LINGER_S)

    async def _serve(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        timeout_s = self._config.timeout_s
        while True:
            # waiting here for the next request is also the linger after the last reply
            header = await asyncio.wait_for(
                read_frame(reader, max_header_bytes=_MAX_HEADER_BYTES, eof_ok=True), timeout_s
            )
            if header is None:
                return
            digest, offset, length = _parse_request(header, self._config.chunk_bytes)
            try:
                size, data = await asyncio.to_thread(_read_source, self._source, digest, offset, length)
            except Exception as e:  # a source is the store's code: its errors must not end serving
                self._reject(peer, "source error", f"{digest[:12]}: {one_line(e)}")
                await asyncio.wait_for(write_frame(writer, {"status": STATUS_NOT_FOUND}), timeout_s)
                continue
            if size is None:
                self._reject(peer, "not found", digest[:12])
                await asyncio.wait_for(write_frame(writer, {"status": STATUS_NOT_FOUND}), timeout_s)
                continue
            if offset + length > size:
                raise ProtocolError("bad range", f"{offset}+{length} past the end of a shard of {size} bytes")
            if len(data) != length:
                self._reject(peer, "source error", f"{digest[:12]}: read {len(data)} of {length} bytes")
                await asyncio.wait_for(write_frame(writer, {"status": STATUS_NOT_FOUND}), timeout_s)
                continue
            reply = {"status": STATUS_OK, "size": size, "length": length}
            await asyncio.wait_for(write_frame(writer, reply, data), timeout_s)
            self.num_chunks_served += 1
            self.bytes_served += length


# --- client: one stream to one donor ------------------------------------------------------------


class _AttemptFailed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class _Session:
    donor: str
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    @classmethod
    async def open(cls, p2p: P2P, donor: PeerID, timeout_s: float) -> _Session:
        try:
            _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(donor, PROTOCOL), timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            raise _AttemptFailed("unreachable", f"no {PROTOCOL} stream to {donor} within {timeout_s:.1f} s") from None
        except Exception as e:  # the daemon reports dial and protocol failures with several types
            raise _AttemptFailed("unreachable", f"cannot open a {PROTOCOL} stream to {donor}: {one_line(e)}") from e
        return cls(donor=str(donor), reader=reader, writer=writer)

    async def request(self, digest: str, offset: int, length: int, timeout_s: float) -> ChunkReply:
        try:
            return await asyncio.wait_for(self._request(digest, offset, length), timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            raise _AttemptFailed("timeout", f"no reply to a chunk request within {timeout_s:.1f} s") from None
        except ProtocolError as e:
            reason = "disconnected" if e.reason == "truncated" else "malformed"
            raise _AttemptFailed(reason, str(e)) from None
        except (ConnectionError, OSError) as e:
            raise _AttemptFailed("disconnected", one_line(e)) from None

    async def _request(self, digest: str, offset: int, length: int) -> ChunkReply:
        await write_frame(self.writer, {"digest": digest, "offset": offset, "length": length})
        header = await read_frame(self.reader, max_header_bytes=_MAX_HEADER_BYTES, eof_ok=True)
        if header is None:
            raise ProtocolError("truncated", "the donor hung up without a reply")
        status = header.get("status")
        if not isinstance(status, str) or status not in _STATUSES:
            raise ProtocolError("malformed", f"status {str(status)[:40]!r}")
        if status != STATUS_OK:
            return ChunkReply(status=status, reason=str(header.get("reason", ""))[:200])
        size, num_bytes = header.get("size"), header.get("length")
        if not _is_int(size) or num_bytes != length:
            raise ProtocolError("malformed", f"ok reply with size {size!r}, length {num_bytes!r} for {length}")
        data = await read_exactly(self.reader, length)
        return ChunkReply(status=status, size=size, data=data)

    async def close(self) -> None:
        await close_stream(self.writer)


async def request_chunk(
    p2p: P2P, donor: PeerID | str, *, digest: str, offset: int, length: int, timeout_s: float = 30.0
) -> ChunkReply:
    """One request on a fresh stream, sent as given (not validated: tools and tests probe servers).

    Returns the server's reply, "bad request" and "busy" included; raises `FetchError` (reason
    unreachable, timeout, disconnected or malformed) if no well-formed reply came back.
    """
    try:
        session = await _Session.open(p2p, peer_id_of(donor), timeout_s)
        try:
            return await session.request(digest, offset, length, timeout_s)
        finally:
            await session.close()
    except _AttemptFailed as e:
        raise FetchError(f"chunk request to {donor}: {e}", reason=e.reason) from None


# --- client: scheduling -------------------------------------------------------------------------


@dataclass
class _Donor:
    peer: PeerID
    name: str
    index: int
    active: int = 0
    sessions: int = 0
    blamed: int = 0
    consecutive_failures: int = 0
    consecutive_busy: int = 0
    ready_at: float = 0.0
    dead: bool = False


class _DonorPool:
    """Hands out donors least-loaded first, at most `cap` sessions each, with backoff after trouble."""

    def __init__(self, peers: Sequence[PeerID], cap: int) -> None:
        self._donors = {str(p): _Donor(peer=p, name=str(p), index=i) for i, p in enumerate(peers)}
        self._cap = cap
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def acquire(self, excluded: set[str], avoid: set[str]) -> _Donor | None:
        """A donor for a shard, waiting while all are at capacity or backing off; None if none is left."""
        while True:
            eligible = [d for d in self._donors.values() if not d.dead and d.name not in excluded]
            if not eligible:
                return None
            now = time.monotonic()
            free = [d for d in eligible if d.active < self._cap and d.ready_at <= now]
            if free:
                donor = min(
                    free,
                    key=lambda d: (
                        d.name in avoid,
                        d.blamed > 0,
                        d.active,
                        d.consecutive_failures,
                        d.sessions,
                        d.index,
                    ),
                )
                donor.active += 1
                donor.sessions += 1
                return donor
            waiting = [d.ready_at - now for d in eligible if d.ready_at > now]
            changed = self._changed
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                # someone at capacity releases within a chunk timeout; a backoff ends on its own
                await asyncio.wait_for(changed.wait(), min(waiting) if waiting else None)

    def release(self, donor: _Donor, outcome: str) -> None:
        donor.active -= 1
        if outcome == "ok":
            donor.consecutive_failures = donor.consecutive_busy = 0
        elif outcome == "busy":
            donor.consecutive_busy += 1
            donor.ready_at = time.monotonic() + _backoff_s(donor.consecutive_busy)
        else:
            donor.consecutive_failures += 1
            donor.dead = donor.consecutive_failures >= _MAX_CONSECUTIVE_FAILURES
            donor.ready_at = time.monotonic() + _backoff_s(donor.consecutive_failures)
        self._notify()

    def blame(self, name: str) -> None:
        if name in self._donors:
            self._donors[name].blamed += 1


def _backoff_s(streak: int) -> float:
    return min(_MAX_BACKOFF_S, _BACKOFF_S * 2 ** (streak - 1))


@dataclass
class _Shard:
    digest: str
    size: int
    buf: bytearray
    hasher: Any
    sources: list[str]
    """Who supplied the bytes in `buf`, in order: donor ids and `PARTIAL_SOURCE` for a prefix."""
    excluded: set[str] = field(default_factory=set)
    avoid: set[str] = field(default_factory=set)
    attempts: int = 0
    last_error: str = ""

    @classmethod
    def create(cls, digest: str, size: int, prefix: bytes) -> _Shard:
        return cls(
            digest=digest,
            size=size,
            buf=bytearray(prefix),
            hasher=hashlib.sha256(prefix),
            sources=[PARTIAL_SOURCE] if prefix else [],
        )

    def append(self, donor: str, data: bytes) -> None:
        self.buf += data
        self.hasher.update(data)
        if not self.sources or self.sources[-1] != donor:
            self.sources.append(donor)

    def restart(self) -> None:
        self.buf = bytearray()
        self.hasher = hashlib.sha256()
        self.sources = []


class _Fetcher:
    def __init__(self, p2p: P2P, peers: Sequence[PeerID], config: ExchangeConfig, report: FetchReport) -> None:
        self._p2p = p2p
        self._config = config
        self._report = report
        self._pool = _DonorPool(peers, config.max_concurrent_per_donor)

    async def run(self, shards: list[_Shard]) -> dict[str, bytes]:
        results: dict[str, bytes] = {}
        slots = asyncio.Semaphore(self._config.max_parallel_shards)

        async def one(shard: _Shard) -> None:
            async with slots:
                results[shard.digest] = await self._fetch_shard(shard)

        tasks = [asyncio.create_task(one(shard)) for shard in shards]
        try:
            await asyncio.gather(*tasks)  # the first FetchError ends the fetch
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return {shard.digest: results[shard.digest] for shard in shards}

    async def _fetch_shard(self, shard: _Shard) -> bytes:
        while True:
            if len(shard.buf) == shard.size:
                if shard.hasher.hexdigest() == shard.digest:
                    return bytes(shard.buf)
                self._discard_corrupt(shard)
            if shard.attempts >= self._config.max_attempts_per_shard:
                raise self._error(shard, "attempts", f"{shard.attempts} attempts failed")
            donor = await self._pool.acquire(shard.excluded, shard.avoid)
            if donor is None:
                raise self._error(shard, "no donor", "no donor left that may hold it")
            outcome = "failure"
            try:
                outcome = await self._download(donor, shard)
            finally:
                self._pool.release(donor, outcome)

    def _error(self, shard: _Shard, reason: str, what: str) -> FetchError:
        last = f"; last error: {shard.last_error}" if shard.last_error else ""
        return FetchError(
            f"cannot fetch shard {shard.digest} ({shard.size} bytes): {what}{last}; "
            f"excluded donors: {sorted(shard.excluded) or 'none'}",
            reason=reason,
            report=self._report,
        )

    def _discard_corrupt(self, shard: _Shard) -> None:
        report = self._report
        report.corrupt_shards += 1
        for source in shard.sources:
            report.corrupt_by_donor[source] += 1
            self._pool.blame(source)
        donors = [s for s in shard.sources if s != PARTIAL_SOURCE]
        if len(shard.sources) == 1 and donors:
            shard.excluded.add(donors[0])  # the sole culprit: never again for this shard
        else:
            shard.avoid.update(donors)
        logger.warning(
            "shard %s from %s failed its digest check; fetching it again", shard.digest[:12], ", ".join(shard.sources)
        )
        shard.last_error = f"digest mismatch (bytes from {', '.join(shard.sources)})"
        shard.attempts += 1
        report.retries += 1
        shard.restart()

    async def _download(self, donor: _Donor, shard: _Shard) -> str:
        """Fetch the rest of `shard` from `donor` on one stream; the outcome for the donor pool."""
        config, report = self._config, self._report
        try:
            session = await _Session.open(self._p2p, donor.peer, config.timeout_s)
        except _AttemptFailed as e:
            return self._failed(donor, shard, e.reason, str(e))
        try:
            while len(shard.buf) < shard.size:
                offset = len(shard.buf)
                length = min(config.chunk_bytes, shard.size - offset)
                reply = await session.request(shard.digest, offset, length, config.timeout_s)
                if reply.status == STATUS_BUSY:
                    shard.avoid.add(donor.name)
                    return self._refused(shard, "busy", f"{donor.name} is busy")
                if reply.status == STATUS_NOT_FOUND:
                    shard.excluded.add(donor.name)
                    self._refused(shard, "not found", f"{donor.name} does not hold it")
                    return "ok"  # nothing wrong with the donor itself
                if reply.status != STATUS_OK or reply.size != shard.size:
                    shard.excluded.add(donor.name)
                    detail = f"{donor.name} answered {reply.status!r} {reply.reason} (size {reply.size})"
                    return self._failed(donor, shard, "malformed", detail)
                shard.append(donor.name, reply.data)
                report.bytes_downloaded += length
                report.per_donor_bytes[donor.name] += length
            return "ok"
        except _AttemptFailed as e:
            return self._failed(donor, shard, e.reason, f"{donor.name}: {e}")
        finally:
            await session.close()

    def _refused(self, shard: _Shard, reason: str, detail: str) -> str:
        self._report.failures[reason] += 1
        self._report.retries += 1
        shard.last_error = detail
        return "busy"

    def _failed(self, donor: _Donor, shard: _Shard, reason: str, detail: str) -> str:
        self._report.failures[reason] += 1
        self._report.retries += 1
        shard.attempts += 1
        shard.avoid.add(donor.name)
        shard.last_error = detail
        logger.info("shard %s: attempt at %s failed (%s): %s", shard.digest[:12], donor.name, reason, detail)
        return "failure"


def _check_wanted(wanted: Mapping[str, int], partial: Mapping[str, bytes] | None) -> None:
    if not isinstance(wanted, Mapping):
        raise TypeError(f"wanted: expected a mapping of digest to size, got {type(wanted).__name__}")
    if partial is not None and not isinstance(partial, Mapping):
        raise TypeError(f"partial: expected a mapping of digest to bytes, got {type(partial).__name__}")
    for digest, size in wanted.items():
        if not _is_digest(digest):
            raise ValueError(f"wanted: {digest!r} is not a SHA-256 digest (64 lowercase hex digits)")
        if not _is_int(size) or not 0 <= size <= _MAX_SHARD_BYTES:
            raise ValueError(f"wanted[{digest[:12]}...]: size must be a non-negative integer, got {size!r}")
    for digest, prefix in (partial or {}).items():
        if digest not in wanted:
            raise ValueError(f"partial: {digest!r} is not among the wanted shards")
        if not isinstance(prefix, (bytes, bytearray, memoryview)):
            raise TypeError(f"partial[{digest[:12]}...]: expected bytes, got {type(prefix).__name__}")
        if len(prefix) > wanted[digest]:
            raise ValueError(f"partial[{digest[:12]}...]: {len(prefix)} bytes, more than the shard's {wanted[digest]}")


def _validated_shards(wanted: Mapping[str, int], partial: Mapping[str, bytes] | None) -> list[_Shard]:
    _check_wanted(wanted, partial)
    partial = partial or {}
    return [_Shard.create(digest, size, bytes(partial.get(digest, b""))) for digest, size in wanted.items()]


def _validated_donors(donors: Sequence[PeerID | str], own: str) -> list[PeerID]:
    if isinstance(donors, (str, bytes)):
        raise TypeError(f"donors: expected a sequence of peer ids, got the single value {donors!r}")
    try:
        peers = {str(p): p for p in map(peer_id_of, donors)}
    except ValueError as e:
        raise ValueError(f"donors: {e}") from None
    return [peer for name, peer in peers.items() if name != own]


async def fetch_shards(
    p2p: P2P,
    wanted: Mapping[str, int],
    donors: Sequence[PeerID | str],
    config: ExchangeConfig | None = None,
    *,
    partial: Mapping[str, bytes] | None = None,
    report: FetchReport | None = None,
) -> dict[str, bytes]:
    """Download every shard in `wanted` ({digest: size}) from `donors`; each result matches its digest.

    `partial` holds prefixes kept from an interrupted download ({digest: first bytes}): only the
    rest is downloaded, and the digest check covers the prefix too. Our own peer id and duplicates
    among `donors` are skipped. Pass a `FetchReport` as `report` to see what happened (it is filled
    in place, also when the fetch fails). Raises `FetchError` if a shard cannot be had, and
    `ValueError`/`TypeError` for malformed arguments.
    """
    config = config if config is not None else ExchangeConfig()
    report = report if report is not None else FetchReport()
    shards = _validated_shards(wanted, partial)
    fetcher = _Fetcher(p2p, _validated_donors(donors, str(p2p.peer_id)), config, report)
    started = time.perf_counter()
    try:
        return await asyncio.wait_for(fetcher.run(shards), config.fetch_timeout_s)
    except (TimeoutError, asyncio.TimeoutError):
        raise FetchError(
            f"fetching {len(shards)} shards from {len(donors)} donors did not finish within "
            f"{config.fetch_timeout_s:.1f} s; are the donors reachable and serving {PROTOCOL}?",
            reason="timeout",
            report=report,
        ) from None
    finally:
        report.seconds = time.perf_counter() - started


# --- synchronous facade -------------------------------------------------------------------------


class ShardExchange(ServedFacade):
    """Serves `source` and fetches shards on the DHT's network runtime (`bootstrap.runtime`).

    Thread-safe; fetches may run concurrently. One exchange per DHT: a second one on the same daemon
    takes over the `swarm.shards.v1` handler. Use as a context manager or call `close()`.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        source: ShardSource,
        config: ExchangeConfig | None = None,
        *,
        start_timeout_s: float = 30.0,
    ) -> None:
        if not isinstance(source, ShardSource):
            raise TypeError(f"source: expected a ShardSource (has, size, read_range), got {type(source).__name__}")
        self._config = config if config is not None else ExchangeConfig()
        self._source = source
        self._served = Served(
            dht,
            lambda p2p: ShardServer(source, self._config, p2p=p2p),
            what="the shard exchange",
            start_timeout_s=start_timeout_s,
        )

    @property
    def config(self) -> ExchangeConfig:
        return self._config

    server: ShardServer
    """The shard server; its counters stay readable after `close()`."""

    def fetch(
        self,
        wanted: Mapping[str, int],
        donors: Sequence[PeerID | str],
        *,
        partial: Mapping[str, bytes] | None = None,
        timeout_s: float | None = None,
        cancel: threading.Event | None = None,
    ) -> tuple[dict[str, bytes], FetchReport]:
        """`fetch_shards` on this exchange's P2P, bounded by `timeout_s` (default: `fetch_timeout_s`); once
        ``cancel`` is set (a stop request), the fetch is cancelled and `bootstrap.Stopped` raised.

        Returns ({digest: bytes}, report). Raises `FetchError` (its `report` attached) when a shard
        cannot be had, `ValueError`/`TypeError` for malformed arguments, `RuntimeError` once closed.
        """
        p2p = self._served.p2p
        config = self._config
        if timeout_s is not None:
            _check_seconds("timeout_s", timeout_s)
            config = dataclasses.replace(config, fetch_timeout_s=timeout_s)
        _check_wanted(wanted, partial)  # raise argument errors in the caller's thread
        _validated_donors(donors, "")
        report = FetchReport()
        coro = fetch_shards(p2p, wanted, donors, config, partial=partial, report=report)
        try:
            shards = self._served.call(coro, timeout_s=config.fetch_timeout_s + _RPC_TIMEOUT_S, cancel=cancel)
        except TimeoutError:
            raise FetchError(
                f"the fetch did not end within {config.fetch_timeout_s:.1f} s", reason="timeout", report=report
            ) from None
        return shards, report
