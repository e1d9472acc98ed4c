"""The one message framing of every Swarm stream protocol, and its one error.

A frame is a 4-byte big-endian length, that many bytes of a JSON object (the header), then any raw
payload the header announces. A blob is a length and that many raw bytes. What a peer sends is
untrusted: every read is bounded, and anything malformed raises `ProtocolError` with a short,
countable ``reason`` (one of `REASONS` here; protocols add their own for their fields).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from typing import Any

from bootstrap.errors import Rejected

LENGTH = struct.Struct(">I")
REASONS = ("truncated", "oversized header", "malformed header", "oversized")
CLOSE_TIMEOUT_S = 1.0


class ProtocolError(Rejected):
    """A peer sent something malformed or unexpected on a stream; ``reason`` is a short countable label."""


async def close_stream(writer: asyncio.StreamWriter, *, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
    """Close a stream and wait (bounded) until it is closed; the other side may have reset it already."""
    writer.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), timeout_s)


async def linger(reader: asyncio.StreamReader, timeout_s: float) -> None:
    """After a server's last reply: wait (at most ``timeout_s``) until the client hangs up, discarding whatever it
    still sends. Closing at once can lose the reply: p2pd resets a stream whose local end vanished, and the
    reply's last bytes may still be in flight."""

    async def drain() -> None:
        while await reader.read(64 * 1024):
            pass

    with contextlib.suppress(asyncio.TimeoutError, OSError):  # the client may be gone already
        await asyncio.wait_for(drain(), timeout_s)


async def write_frame(writer: asyncio.StreamWriter, header: dict, payload: bytes = b"") -> int:
    """Write a header and its payload, then drain; returns the bytes written."""
    data = json.dumps(header, separators=(",", ":")).encode()
    # one vectored write: the header and a payload of megabytes leave together, without a copy of the payload
    writer.writelines((LENGTH.pack(len(data)) + data, payload) if payload else (LENGTH.pack(len(data)) + data,))
    await writer.drain()
    return LENGTH.size + len(data) + len(payload)


async def read_frame(reader: asyncio.StreamReader, *, max_header_bytes: int, eof_ok: bool = False) -> dict | None:
    """The next header (a JSON object of at most ``max_header_bytes``); None if ``eof_ok`` and the
    stream ended cleanly before it."""
    try:
        prefix = await reader.readexactly(LENGTH.size)
    except asyncio.IncompleteReadError as e:
        if eof_ok and not e.partial:
            return None
        raise ProtocolError("truncated", f"{len(e.partial)} of {LENGTH.size} length bytes") from None
    (length,) = LENGTH.unpack(prefix)
    if length > max_header_bytes:
        raise ProtocolError("oversized header", f"{length} bytes, over {max_header_bytes}")
    try:
        header = json.loads(await reader.readexactly(length))
    except asyncio.IncompleteReadError as e:
        raise ProtocolError("truncated", f"{len(e.partial)} of {length} header bytes") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nesting deeper than the stack
        raise ProtocolError("malformed header", " ".join(str(e).split())[:100]) from None
    if not isinstance(header, dict):
        raise ProtocolError("malformed header", f"a {type(header).__name__}, not an object")
    return header


async def read_exactly(reader: asyncio.StreamReader, num_bytes: int) -> bytes:
    """Exactly ``num_bytes`` of payload, or ProtocolError("truncated")."""
    try:
        return await reader.readexactly(num_bytes)
    except asyncio.IncompleteReadError as e:
        raise ProtocolError("truncated", f"{len(e.partial)} of {num_bytes} payload bytes") from None


async def write_blob(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(LENGTH.pack(len(data)) + data)
    await writer.drain()


async def read_blob(reader: asyncio.StreamReader, *, max_bytes: int) -> bytes:
    """A length-prefixed blob of at most ``max_bytes``."""
    (length,) = LENGTH.unpack(await read_exactly(reader, LENGTH.size))
    if length > max_bytes:
        raise ProtocolError("oversized", f"{length} bytes, over {max_bytes}")
    return await read_exactly(reader, length)


def header_field(
    header: dict, name: str, kind: type | tuple, *, low: int | None = None, high: int | None = None
) -> Any:
    """``header[name]`` if it is a ``kind`` (a bool is no int) within [low, high], else ProtocolError."""
    value = header.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ProtocolError("malformed header", f"{name} must be {kind}, got {type(value).__name__}")
    if low is not None and not low <= value <= (high if high is not None else value):
        raise ProtocolError("malformed header", f"{name}={value!r} out of range")
    return value
