"""GossipSub through the p2pd daemon that hivemind starts, which hivemind's Python bindings do not wrap.

`PubSubP2P` is a `hivemind.P2P` whose daemon runs with ``-pubsub`` (router gossipsub, strict
signatures: the daemon drops a message not signed by the libp2p key it claims to come from). Pass
one to ``hivemind.DHT(p2p=...)`` so that the DHT and pubsub share one daemon and its connections.
`subscribe`, `publish` and `topic_peers` speak the daemon's control protocol (``PSRequest`` in
hivemind's ``p2pd.proto``) over its unix socket, one control connection per call or subscription.

What the daemon relays is not validated by us first: its control protocol has no validator hook, so
a mesh peer forwards a well-signed message with any payload before any Python code sees it. Every
message a subscriber yields is therefore untrusted input to its reader.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import DaemonConnector
from hivemind.p2p.p2p_daemon_bindings.utils import read_unsigned_varint, write_pbmsg
from hivemind.proto import p2pd_pb2 as pb

from bootstrap.errors import NetworkError
from bootstrap.framing import ProtocolError, close_stream

MAX_MESSAGE_BYTES = 1 << 20
"""GossipSub's own default bound on a message (go-libp2p-pubsub ``DefaultMaxMessageSize``)."""
_MAX_CONTROL_BYTES = MAX_MESSAGE_BYTES + 4096
_CALL_TIMEOUT_S = 10.0


class PubSubP2P(P2P):
    """A `P2P` whose daemon also runs GossipSub (``-pubsub``, strict message signing)."""

    @staticmethod
    def _make_process_args(*args: Any, **kwargs: Any) -> list[str]:
        kwargs.update(pubsub=True, pubsubRouter="gossipsub", pubsubSign=True, pubsubSignStrict=True)
        return P2P._make_process_args(*args, **kwargs)


@dataclass(frozen=True, slots=True)
class Message:
    """One pubsub message as the daemon delivered it: the signer's peer ID (checked by the daemon under
    strict signing) and the payload (not checked by anyone yet)."""

    sender: PeerID
    data: bytes


async def _read_pb(reader: asyncio.StreamReader, message: Any) -> Any:
    size = await read_unsigned_varint(reader)
    if size > _MAX_CONTROL_BYTES:
        raise ProtocolError("oversized", f"a control message of {size} bytes (at most {_MAX_CONTROL_BYTES})")
    message.ParseFromString(await reader.readexactly(size))
    return message


async def _request(p2p: P2P, request: pb.PSRequest) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Any]:
    """Send one pubsub request on a new control connection; the connection and the daemon's answer."""
    reader, writer = await DaemonConnector(p2p.daemon_listen_maddr).open_connection()
    try:
        await write_pbmsg(writer, pb.Request(type=pb.Request.PUBSUB, pubsub=request))
        response = await _read_pb(reader, pb.Response())
        if response.type != pb.Response.OK:
            raise NetworkError(
                f"the daemon refused {pb.PSRequest.Type.Name(request.type)}: {response.error.msg}", reason="refused"
            )
    except BaseException:
        await close_stream(writer)
        raise
    return reader, writer, response


async def publish(p2p: P2P, topic: str, data: bytes, *, timeout_s: float = _CALL_TIMEOUT_S) -> None:
    """Publish ``data`` on ``topic`` (the daemon signs it with its key); ValueError if it is too large."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"a pubsub message holds at most {MAX_MESSAGE_BYTES} bytes, got {len(data)}")
    request = pb.PSRequest(type=pb.PSRequest.PUBLISH, topic=topic, data=data)
    _, writer, _ = await asyncio.wait_for(_request(p2p, request), timeout_s)
    await close_stream(writer)


async def topic_peers(p2p: P2P, topic: str, *, timeout_s: float = _CALL_TIMEOUT_S) -> list[PeerID]:
    """The connected peers the daemon knows to be subscribed to ``topic``."""
    request = pb.PSRequest(type=pb.PSRequest.LIST_PEERS, topic=topic)
    _, writer, response = await asyncio.wait_for(_request(p2p, request), timeout_s)
    await close_stream(writer)
    return [PeerID(raw) for raw in response.pubsub.peerIDs]


class Subscription:
    """Messages on one topic, in arrival order, until `close` (``async for message in subscription``).

    Malformed control messages end the iteration with `ProtocolError`; a message without a valid
    sender is skipped and counted in ``skipped``.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, topic: str) -> None:
        self.topic = topic
        self.skipped = 0
        self._reader, self._writer = reader, writer

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Message]:
        while True:
            try:
                raw = await _read_pb(self._reader, pb.PSMessage())
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the daemon or close() ended the subscription
            try:
                sender = PeerID(getattr(raw, "from"))
            except Exception:  # a PeerID of garbage bytes raises several types
                self.skipped += 1
                continue
            yield Message(sender=sender, data=raw.data)

    async def close(self) -> None:
        """End the subscription (the daemon unsubscribes when the control connection closes)."""
        await close_stream(self._writer)


async def subscribe(p2p: P2P, topic: str, *, timeout_s: float = _CALL_TIMEOUT_S) -> Subscription:
    """Subscribe to ``topic``; read the messages from the result and `close` it when done."""
    request = pb.PSRequest(type=pb.PSRequest.SUBSCRIBE, topic=topic)
    reader, writer, _ = await asyncio.wait_for(_request(p2p, request), timeout_s)
    return Subscription(reader, writer, topic)
