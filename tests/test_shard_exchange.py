"""Verified shard exchange (`swarm.checkpoint.exchange`) between in-process DHTs on loopback.

Four DHTs (three donors and a joiner, each with its p2pd) are shared by the module; every test
starts its own `ShardExchange`s on them and closes them at teardown. Faults are injected by
`ShardSource` wrappers that count what they fired, and each test asserts both the outcome and the
count. Randomness is seeded; the seed is printed (and named in assertion messages). Waits poll
with a deadline; nothing sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping

import hivemind
import pytest
from helpers import wait_until
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from bootstrap import start_dht, stop_dht, visible_maddrs
from bootstrap.runtime import open_p2p_replica
from swarm.checkpoint.exchange import (
    PARTIAL_SOURCE,
    PROTOCOL,
    DirectoryShardSource,
    ExchangeConfig,
    FetchError,
    MemoryShardSource,
    ShardExchange,
    ShardSource,
    request_chunk,
)

pytestmark = pytest.mark.timeout(30)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
KIB, MIB = 1024, 1024 * 1024
FAST = ExchangeConfig(chunk_bytes=256 * KIB, timeout_s=5.0, fetch_timeout_s=20.0)
POLL_TIMEOUT_S = 5.0


# --- fixtures and fault-injecting sources -------------------------------------------------------


@pytest.fixture(scope="module")
def dhts() -> Iterator[list[hivemind.DHT]]:
    """Four loopback DHTs: donors 0-2 and the joiner 3, joined through the first."""
    started: list[hivemind.DHT] = []
    try:
        started.append(start_dht(host_maddrs=LOOPBACK, nat_port_map=False))
        initial_peers = visible_maddrs(started[0])
        for _ in range(3):
            started.append(start_dht(initial_peers, host_maddrs=LOOPBACK, nat_port_map=False))
        yield started
    finally:
        for dht in reversed(started):
            stop_dht(dht)


@pytest.fixture
def make_exchange() -> Iterator[Callable[..., ShardExchange]]:
    """`make_exchange(dht, source, config=FAST)`: a `ShardExchange` closed at teardown."""
    exchanges: list[ShardExchange] = []

    def make(dht: hivemind.DHT, source: ShardSource, config: ExchangeConfig = FAST) -> ShardExchange:
        exchange = ShardExchange(dht, source, config)
        exchanges.append(exchange)
        return exchange

    yield make
    for exchange in exchanges:
        exchange.close()


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("SWARM_TEST_SEED", random.randrange(2**32)))
    print(f"seed={value} (rerun with SWARM_TEST_SEED={value})")
    return value


def make_shards(rng: random.Random, num_shards: int, low: int, high: int) -> dict[str, bytes]:
    shards = {}
    for _ in range(num_shards):
        data = rng.randbytes(rng.randint(low, high))
        shards[hashlib.sha256(data).hexdigest()] = data
    return shards


def sizes(shards: Mapping[str, bytes]) -> dict[str, int]:
    return {digest: len(data) for digest, data in shards.items()}


def flip_bit(data: bytes, bit: int) -> bytes:
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    return bytes(flipped)


class CorruptSource:
    """Serves `inner`'s shards with one bit flipped in every chunk it returns; counts reads per digest."""

    def __init__(self, inner: ShardSource) -> None:
        self._inner = inner
        self.reads: Counter[str] = Counter()

    def has(self, digest: str) -> bool:
        return self._inner.has(digest)

    def size(self, digest: str) -> int | None:
        return self._inner.size(digest)

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        self.reads[digest] += 1
        return flip_bit(self._inner.read_range(digest, offset, length), 0)


class FlipInjector:
    """Plans and counts bit flips keyed by (donor, round, digest): at most one flip per key.

    Each round, for each donor and shard, the seed picks one bit of the shard; the chunk that
    contains it is served with that bit flipped, until `budget` flips have fired.
    """

    def __init__(self, seed: int, budget: int) -> None:
        self._seed = seed
        self._lock = threading.Lock()
        self.budget = budget
        self.round = 0
        self._planned: dict[tuple[str, int, str], int | None] = {}
        self.fired: Counter[str] = Counter()

    def source(self, donor: str, inner: ShardSource) -> ShardSource:
        injector = self

        class FlippingSource:
            def has(self, digest: str) -> bool:
                return inner.has(digest)

            def size(self, digest: str) -> int | None:
                return inner.size(digest)

            def read_range(self, digest: str, offset: int, length: int) -> bytes:
                data = inner.read_range(digest, offset, length)
                bit = injector.fire(donor, digest, inner.size(digest) or 0, offset, length)
                return data if bit is None else flip_bit(data, bit)

        return FlippingSource()

    def fire(self, donor: str, digest: str, size: int, offset: int, length: int) -> int | None:
        """The bit to flip in this chunk (relative to its start), or None."""
        with self._lock:
            key = (donor, self.round, digest)
            if key not in self._planned:
                # derived from the key, not drawn in arrival order: the same seed gives the same flips
                self._planned[key] = random.Random(f"{self._seed}/{key}").randrange(size * 8)
            bit = self._planned[key]
            if bit is None or not offset * 8 <= bit < (offset + length) * 8 or self.fired.total() >= self.budget:
                return None
            self._planned[key] = None  # fired
            self.fired[donor] += 1
            return bit - offset * 8


class StallingSource:
    """Serves `inner`; every read sets `first_read` and stalls until `release` (bounded)."""

    def __init__(self, inner: ShardSource) -> None:
        self._inner = inner
        self.first_read = threading.Event()
        self.release = threading.Event()
        self.num_reads = 0

    def has(self, digest: str) -> bool:
        return self._inner.has(digest)

    def size(self, digest: str) -> int | None:
        return self._inner.size(digest)

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        self.num_reads += 1
        self.first_read.set()
        self.release.wait(POLL_TIMEOUT_S)
        return self._inner.read_range(digest, offset, length)


def random_peer_id() -> str:
    key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
    return str(PeerID.from_identity(key.SerializeToString()))


def run_with_replica(dht: hivemind.DHT, scenario: Callable[[P2P], object]) -> None:
    """Run `scenario(p2p)` in a fresh event loop with its own replica of `dht`'s P2P."""

    async def main() -> None:
        p2p = await open_p2p_replica(dht)
        try:
            await scenario(p2p)
        finally:
            await p2p.shutdown()

    asyncio.run(main())


# --- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("chunk_bytes", 0),
        ("chunk_bytes", True),
        ("max_concurrent_per_donor", 0),
        ("max_parallel_shards", -1),
        ("timeout_s", 0),
        ("timeout_s", float("nan")),
        ("max_attempts_per_shard", 0),
        ("fetch_timeout_s", float("inf")),
    ],
)
def test_config_rejects_bad_values(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{name}: .*{value!r}"):
        ExchangeConfig(**{name: value})


def test_directory_source_reads_digest_named_files(tmp_path) -> None:
    data = os.urandom(1000)
    digest = hashlib.sha256(data).hexdigest()
    (tmp_path / f"{digest}.safetensors").write_bytes(data)
    source = DirectoryShardSource(tmp_path)
    assert isinstance(source, ShardSource)
    assert source.has(digest) and source.size(digest) == 1000
    assert source.read_range(digest, 10, 20) == data[10:30]
    assert not source.has("0" * 64) and source.size("0" * 64) is None
    assert not source.has("../" + digest) and source.size("../" + digest) is None


def test_fetch_from_three_donors(dhts, make_exchange, seed) -> None:
    shards = make_shards(random.Random(seed), 5, 1 * MIB, 3 * MIB)
    donors = [make_exchange(dht, MemoryShardSource(shards)) for dht in dhts[:3]]
    joiner = make_exchange(dhts[3], MemoryShardSource({}))

    got, report = joiner.fetch(sizes(shards), [d.peer_id for d in donors])

    assert got == shards, f"seed={seed}"
    total = sum(map(len, shards.values()))
    assert report.bytes_downloaded == total == sum(report.per_donor_bytes.values())
    assert len(report.per_donor_bytes) > 1, report
    assert report.corrupt_shards == 0 and set(report.failures) <= {"busy"}, report
    print(f"{total / 1e6:.1f} MB from 3 donors in {report.seconds:.2f} s: {dict(report.per_donor_bytes)}")


def test_corrupt_donor_is_detected_and_blamed(dhts, make_exchange, seed) -> None:
    shards = make_shards(random.Random(seed), 6, 256 * KIB, 1 * MIB)
    corrupt = CorruptSource(MemoryShardSource(shards))
    bad = make_exchange(dhts[0], corrupt)
    good = [make_exchange(dht, MemoryShardSource(shards)) for dht in dhts[1:3]]
    joiner = make_exchange(dhts[3], MemoryShardSource({}))

    # the corrupt donor comes first, so it is given the first shard
    got, report = joiner.fetch(sizes(shards), [bad.peer_id, *(g.peer_id for g in good)])

    assert got == shards, f"seed={seed}"
    assert corrupt.reads.total() > 0  # the fault fired
    assert set(report.corrupt_by_donor) == {bad.peer_id}, report
    # every shard it served was caught, once (it is never asked for the same shard again)
    assert report.corrupt_by_donor[bad.peer_id] == report.corrupt_shards == len(corrupt.reads), report
    assert report.bytes_downloaded == sum(map(len, shards.values())) + report.per_donor_bytes[bad.peer_id]


def test_thousand_random_bit_flips_are_all_detected(dhts, make_exchange, seed) -> None:
    rng = random.Random(seed)
    shards = make_shards(rng, 64, 4 * KIB, 16 * KIB)
    config = ExchangeConfig(
        chunk_bytes=4 * KIB, max_concurrent_per_donor=4, max_parallel_shards=12, timeout_s=5.0, fetch_timeout_s=20.0
    )
    injector = FlipInjector(rng.randrange(2**32), budget=1000)
    flipping = [
        make_exchange(dht, injector.source(f"donor{i}", MemoryShardSource(shards)), config)
        for i, dht in enumerate(dhts[:2])
    ]
    clean = make_exchange(dhts[2], MemoryShardSource(shards), config)
    joiner = make_exchange(dhts[3], MemoryShardSource({}), config)
    donors = [*(f.peer_id for f in flipping), clean.peer_id]

    detected: Counter[str] = Counter()
    started = time.monotonic()
    while injector.fired.total() < injector.budget:
        assert injector.round < 200, f"seed={seed}: only {injector.fired.total()} flips after 200 rounds"
        injector.round += 1
        got, report = joiner.fetch(sizes(shards), donors)
        assert got == shards, f"seed={seed}, round {injector.round}"
        # no chunk was lost in transit; "busy" (our own just-closed streams may still count on the
        # donor) comes before any data
        assert set(report.failures) <= {"busy"}, f"seed={seed}: {report}"
        detected.update(report.corrupt_by_donor)
    names = {f.peer_id: f"donor{i}" for i, f in enumerate(flipping)}
    print(f"{injector.round} rounds, {injector.fired.total()} flips in {time.monotonic() - started:.1f} s")
    assert injector.fired.total() == 1000
    assert {names[peer]: count for peer, count in detected.items()} == injector.fired, f"seed={seed}"


def test_resume_downloads_only_the_rest(dhts, make_exchange, seed) -> None:
    rng = random.Random(seed)
    shards = make_shards(rng, 1, 1 * MIB, 1 * MIB)
    ((digest, data),) = shards.items()
    donor = make_exchange(dhts[0], MemoryShardSource(shards))
    joiner = make_exchange(dhts[3], MemoryShardSource({}))
    cut = rng.randrange(1, len(data))  # anywhere, not on a chunk boundary

    got, report = joiner.fetch(sizes(shards), [donor.peer_id], partial={digest: data[:cut]})

    assert got == shards, f"seed={seed}, cut={cut}"
    assert report.bytes_downloaded == len(data) - cut
    assert report.corrupt_shards == 0

    bad_prefix = flip_bit(data[:cut], rng.randrange(cut * 8))
    got, report = joiner.fetch(sizes(shards), [donor.peer_id], partial={digest: bad_prefix})

    assert got == shards, f"seed={seed}, cut={cut}"
    assert report.corrupt_shards == 1 and report.corrupt_by_donor[PARTIAL_SOURCE] == 1, report
    assert report.bytes_downloaded == (len(data) - cut) + len(data)  # the rest, then all of it again


def test_busy_donor_sends_the_client_elsewhere(dhts, make_exchange, seed) -> None:
    shards = make_shards(random.Random(seed), 1, 512 * KIB, 512 * KIB)
    one_at_a_time = ExchangeConfig(chunk_bytes=256 * KIB, max_concurrent_per_donor=1, timeout_s=5.0)
    busy = make_exchange(dhts[0], MemoryShardSource(shards), one_at_a_time)
    other = make_exchange(dhts[1], MemoryShardSource(shards))
    joiner = make_exchange(dhts[3], MemoryShardSource({}))

    async def scenario(p2p: P2P) -> None:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(busy.peer_id), PROTOCOL)
        try:
            await asyncio.to_thread(
                wait_until, lambda: busy.server.num_active == 1, POLL_TIMEOUT_S, message="held stream being served"
            )
            got, report = await asyncio.to_thread(joiner.fetch, sizes(shards), [busy.peer_id, other.peer_id])
        finally:
            writer.close()
        assert got == shards
        assert report.failures == {"busy": 1} and report.retries == 1, report
        assert report.per_donor_bytes == {other.peer_id: len(next(iter(shards.values())))}

    run_with_replica(dhts[2], scenario)
    wait_until(lambda: busy.server.num_active == 0, POLL_TIMEOUT_S, message="held stream released")
    assert busy.server.rejected == {"busy": 1}


def test_server_rejects_bad_requests_and_keeps_serving(dhts, make_exchange) -> None:
    data = os.urandom(100 * KIB)
    digest = hashlib.sha256(data).hexdigest()
    config = ExchangeConfig(chunk_bytes=64 * KIB, timeout_s=5.0)
    server = make_exchange(dhts[0], MemoryShardSource({digest: data}), config)

    async def scenario(p2p: P2P) -> None:
        async def ask(digest: object, offset: object, length: object) -> str:
            reply = await request_chunk(p2p, server.peer_id, digest=digest, offset=offset, length=length, timeout_s=5.0)
            return reply.status

        assert await ask("xyz", 0, 1) == "bad request"
        assert await ask(digest.upper(), 0, 1) == "bad request"
        assert await ask(digest, len(data), 1) == "bad request"  # offset at the end
        assert await ask(digest, 0, -5) == "bad request"
        assert await ask(digest, 0, 64 * KIB + 1) == "bad request"  # over chunk_bytes
        assert await ask("ab" * 32, 0, 1) == "not found"

        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(server.peer_id), PROTOCOL)
        writer.write(b"\x00\x00\x00\x05{oops")
        length = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), POLL_TIMEOUT_S), "big")
        assert b'"bad request"' in await asyncio.wait_for(reader.readexactly(length), POLL_TIMEOUT_S)
        writer.close()

        reply = await request_chunk(p2p, server.peer_id, digest=digest, offset=1000, length=64 * KIB)
        assert reply.status == "ok" and reply.size == len(data) and reply.data == data[1000 : 1000 + 64 * KIB]

    run_with_replica(dhts[3], scenario)
    assert server.server.rejected == {
        "bad digest": 2,
        "bad range": 2,
        "too long": 1,
        "not found": 1,
        "malformed header": 1,
    }
    # the server counts a chunk once its write returned, which may be after the client has read it
    wait_until(lambda: server.server.num_chunks_served == 1, POLL_TIMEOUT_S, message="the good chunk counted")


def test_fetch_survives_unreachable_and_dying_donors(dhts, make_exchange, seed) -> None:
    shards = make_shards(random.Random(seed), 6, 256 * KIB, 768 * KIB)
    dying_dht = start_dht(visible_maddrs(dhts[0]), host_maddrs=LOOPBACK, nat_port_map=False)
    try:
        stalling = StallingSource(MemoryShardSource(shards))
        dying = make_exchange(dying_dht, stalling)
        good = make_exchange(dhts[1], MemoryShardSource(shards))
        joiner = make_exchange(dhts[3], MemoryShardSource({}))
        gone = random_peer_id()  # nobody has this id

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(joiner.fetch, sizes(shards), [gone, dying.peer_id, good.peer_id])
            assert stalling.first_read.wait(POLL_TIMEOUT_S), "the dying donor was never asked"
            stop_dht(dying_dht)  # its p2pd goes away in the middle of a reply
            stalling.release.set()
            got, report = future.result(timeout=20)
    finally:
        stop_dht(dying_dht)

    assert got == shards, f"seed={seed}"
    assert report.failures["unreachable"] >= 1, report
    assert report.failures["disconnected"] + report.failures["timeout"] >= 1, report
    assert set(report.per_donor_bytes) == {good.peer_id}, report  # the dying donor sent nothing in full
    assert stalling.num_reads >= 1


def test_fetch_fails_clearly_when_nobody_has_the_shard(dhts, make_exchange) -> None:
    donors = [make_exchange(dht, MemoryShardSource({})) for dht in dhts[:2]]
    joiner = make_exchange(dhts[3], MemoryShardSource({}))
    digest = "cd" * 32

    with pytest.raises(FetchError, match=f"cannot fetch shard {digest}.*no donor left") as caught:
        joiner.fetch({digest: 10}, [d.peer_id for d in donors])

    assert caught.value.reason == "no donor"
    assert caught.value.report is not None and caught.value.report.failures == {"not found": 2}


def test_fetch_rejects_bad_arguments(dhts, make_exchange) -> None:
    joiner = make_exchange(dhts[3], MemoryShardSource({}))
    with pytest.raises(ValueError, match="not a SHA-256 digest"):
        joiner.fetch({"abc": 1}, [])
    with pytest.raises(ValueError, match="more than the shard's 1"):
        joiner.fetch({"ab" * 32: 1}, [], partial={"ab" * 32: b"xy"})
    with pytest.raises(ValueError, match="not a peer id"):
        joiner.fetch({"ab" * 32: 1}, ["not-a-peer"])
