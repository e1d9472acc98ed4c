"""bootstrap.pubsub: GossipSub through p2pd's control protocol (benchmarks/gossipsub.py measures it against our
push gossip). Two real daemons on loopback; a plain `P2P` daemon is the negative control."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import write_unsigned_varint
from hivemind.proto import p2pd_pb2 as pb

from bootstrap.errors import NetworkError
from bootstrap.framing import ProtocolError
from bootstrap.pubsub import _MAX_CONTROL_BYTES, MAX_MESSAGE_BYTES, PubSubP2P, _read_pb, publish, subscribe, topic_peers

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TOPIC = "swarm/test/pubsub"


async def _poll(predicate, timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_a_message_reaches_the_other_subscriber_signed_by_its_publisher() -> None:
    async def main() -> None:
        a = await PubSubP2P.create(host_maddrs=LOOPBACK, nat_port_map=False)
        b = await PubSubP2P.create(initial_peers=await a.get_visible_maddrs(), host_maddrs=LOOPBACK, nat_port_map=False)
        plain = await P2P.create(host_maddrs=LOOPBACK, nat_port_map=False)
        try:
            received = await subscribe(b, TOPIC)
            sending = await subscribe(a, TOPIC)
            await _poll(lambda: _has(topic_peers(a, TOPIC), b.peer_id))
            await _poll(lambda: _has(topic_peers(b, TOPIC), a.peer_id))
            queue: asyncio.Queue = asyncio.Queue()
            reading = asyncio.create_task(_drain(received, queue))
            for _attempt in range(10):  # the first message can race the daemons' new pubsub streams
                await publish(a, TOPIC, b"sealed manifest")
                try:
                    message = await asyncio.wait_for(queue.get(), 1.0)
                    break
                except asyncio.TimeoutError:
                    continue
            else:
                raise AssertionError("no message in 10 attempts")
            assert (message.sender, message.data) == (a.peer_id, b"sealed manifest")
            with pytest.raises(ValueError, match="at most"):
                await publish(a, TOPIC, bytes(MAX_MESSAGE_BYTES + 1))
            # negative control: a daemon started without -pubsub refuses the same request
            with pytest.raises(NetworkError, match="refused SUBSCRIBE"):
                await subscribe(plain, TOPIC)
            await received.close()
            await sending.close()
            await asyncio.wait_for(reading, 5.0)  # closing ends the iteration
        finally:
            for p2p in (a, b, plain):
                await p2p.shutdown()

    asyncio.run(main())


async def _drain(subscription, queue: asyncio.Queue) -> None:
    async for message in subscription:
        queue.put_nowait(message)


async def _has(peers, peer_id) -> bool:
    return peer_id in await peers


def test_a_control_message_over_the_bound_is_refused_before_it_is_read() -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()

        class _Sink:
            def write(self, data: bytes) -> None:
                reader.feed_data(data)

            async def drain(self) -> None:
                pass

        await write_unsigned_varint(_Sink(), _MAX_CONTROL_BYTES + 1)
        with pytest.raises(ProtocolError) as refused:
            await _read_pb(reader, pb.PSMessage())
        assert refused.value.reason == "oversized"

    asyncio.run(main())
