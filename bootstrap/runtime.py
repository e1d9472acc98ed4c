"""One network runtime per process and DHT: a single event loop (uvloop) in one thread, over a single
P2P replica of the DHT's daemon, hosting every stream handler (averaging, gossip, shard exchange,
bandwidth probes) and every client call of the components built on that DHT.

Components share it by reference count: `NetworkRuntime.acquire(dht)` returns the DHT's runtime,
starting it on first use; `release()` stops the loop and shuts the replica down after the last user
let go. `Handler` registers one stream handler (and an optional background task) on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, Protocol, TypeVar

import hivemind
from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.utils.multiaddr import Multiaddr

from bootstrap.dhtcalls import process_gone
from bootstrap.errors import Rejected, one_line
from bootstrap.framing import close_stream
from bootstrap.lifetime import Stopped

logger = logging.getLogger(__name__)

T = TypeVar("T")
StreamHandler = Callable[[Any, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
UnaryHandler = Callable[[bytes, str], Awaitable[bytes]]

_RPC_TIMEOUT_S = 30.0


def _described(error: BaseException) -> str:
    return f"{type(error).__name__}: {one_line(error)}"


_CANCEL_POLL_S = 0.1


def result_within(
    future: concurrent.futures.Future[T], *, timeout_s: float, cancel: threading.Event | None = None
) -> T:
    """``future``'s result within ``timeout_s`` (else it is cancelled and TimeoutError raised, as when the work
    itself raised one); once ``cancel`` is set (a stop request: it is polled every 0.1 s), the future is
    cancelled and `Stopped` raised."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            return future.result(timeout=max(0.0, min(remaining, _CANCEL_POLL_S) if cancel is not None else remaining))
        except concurrent.futures.TimeoutError:
            # done: the work's own TimeoutError, not a poll's (polling on would spin until the deadline)
            if future.done() or time.monotonic() >= deadline:
                future.cancel()
                raise TimeoutError(f"no result within {timeout_s:.1f} s") from None
            if cancel is not None and cancel.is_set():
                future.cancel()
                raise Stopped("stop requested") from None


def peer_id_of(value: PeerID | str) -> PeerID:
    """``value`` as a `PeerID`; ValueError (one line, naming it) if it is not a base58 peer ID."""
    if isinstance(value, PeerID):
        return value
    try:
        return PeerID.from_base58(str(value))
    except Exception as e:  # the base58 and multihash decoders raise several exception types
        raise ValueError(f"{value!r} is not a peer id ({one_line(e)})") from None


async def _daemon_listen_maddr(_dht: hivemind.DHT, node: hivemind.DHTNode) -> str:
    return str(node.p2p.daemon_listen_maddr)


async def open_p2p_replica(dht: hivemind.DHT, *, timeout_s: float = _RPC_TIMEOUT_S) -> P2P:
    """A new `P2P` on `dht`'s daemon, bound to the running event loop and owned by the caller.

    Unlike `DHT.replicate_p2p`, which caches one replica per process (bound to the event loop that
    made it, and dead once that loop closes), every call returns a fresh one. Shut it down with
    `await p2p.shutdown()`. Raises `TimeoutError` if the DHT process does not answer in time.
    """
    future = dht.run_coroutine(_daemon_listen_maddr, return_future=True)
    try:
        maddr = await asyncio.wait_for(future, timeout_s)
    except asyncio.TimeoutError:
        future.cancel()
        raise TimeoutError(f"the DHT process did not answer within {timeout_s:.1f} s") from None
    return await asyncio.wait_for(P2P.replicate(Multiaddr(maddr)), timeout_s)


class NetworkRuntime:
    """The event loop and P2P replica every component on one DHT shares (see the module docstring).

    ``loop`` and ``p2p`` are for coroutines run with `submit` or `call`; both are thread-safe.
    """

    _lock = threading.Lock()
    _by_dht: dict[int, NetworkRuntime] = {}
    """Live runtimes by id() of their DHT; each holds its DHT (``_dht``), so no id is reused meanwhile."""
    _starting: dict[int, threading.Lock] = {}
    """Per DHT (by id), the lock its first users start its runtime under."""

    def __init__(self, dht: hivemind.DHT, *, start_timeout_s: float) -> None:
        self._dht = dht
        self._users = 0
        self._stop_requested = False
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(dht,), name="swarm-network", daemon=True)
        self._thread.start()
        try:
            self.loop, self.p2p, self._stop = self._ready.result(timeout=start_timeout_s)
        except BaseException as e:
            self._ready.cancel()  # tells a late start-up to shut itself down
            if isinstance(e, concurrent.futures.TimeoutError):
                raise TimeoutError(f"the network runtime did not start within {start_timeout_s:.1f} s") from None
            raise RuntimeError(f"cannot start the network runtime: {_described(e)}") from e
        self.peer_id = str(self.p2p.peer_id)

    @classmethod
    def acquire(cls, dht: hivemind.DHT, *, start_timeout_s: float = 30.0) -> NetworkRuntime:
        """The runtime of `dht` in this process (started now if it is the first user); `release()` it."""
        with cls._lock:
            start_lock = cls._starting.setdefault(id(dht), threading.Lock())
        with start_lock:  # one start at a time per DHT; a start never holds up another DHT's components
            with cls._lock:
                runtime = cls._by_dht.get(id(dht))
                if runtime is not None and runtime._dht is dht and runtime.alive:
                    runtime._users += 1
                    return runtime
            runtime = cls(dht, start_timeout_s=start_timeout_s)
            with cls._lock:
                cls._by_dht[id(dht)] = runtime
                runtime._users += 1
            return runtime

    @classmethod
    def count(cls) -> int:
        """Runtimes alive in this process (one per DHT in use; tests count them)."""
        with cls._lock:
            return sum(1 for runtime in cls._by_dht.values() if runtime.alive)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop_requested

    def dht_gone(self) -> bool:
        """True once the DHT's process, and the daemon it ran, have died (`bootstrap.dhtcalls.process_gone`)."""
        return process_gone(self._dht)

    def closing_timeout(self, timeout_s: float) -> float:
        """``timeout_s`` for a farewell call to the daemon, or 0.5 s once the DHT's process is gone."""
        return min(timeout_s, 0.5) if self.dht_gone() else timeout_s

    def _run(self, dht: hivemind.DHT) -> None:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency
            runner: Callable[[Coroutine[Any, Any, None]], None] = asyncio.run
        else:
            runner = uvloop.run
        try:
            runner(self._main(dht))
        except BaseException as e:
            if not self._ready.done():
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    self._ready.set_exception(e)
            else:
                logger.warning("the network runtime's loop ended with an error: %s", _described(e))

    async def _main(self, dht: hivemind.DHT) -> None:
        p2p = await open_p2p_replica(dht)
        try:
            stop = asyncio.Event()
            try:
                self._ready.set_result((asyncio.get_running_loop(), p2p, stop))
            except concurrent.futures.InvalidStateError:
                return  # the caller gave up waiting
            await stop.wait()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5.0)
        finally:
            with contextlib.suppress(Exception):
                await p2p.shutdown()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coroutine` on the runtime's loop; returns a concurrent future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call(self, coroutine: Coroutine[Any, Any, T], *, timeout_s: float, cancel: threading.Event | None = None) -> T:
        """Run `coroutine` on the loop and wait up to `timeout_s` for it (then cancel it, raise TimeoutError);
        see `result_within` for ``cancel``."""
        return result_within(self.submit(coroutine), timeout_s=timeout_s, cancel=cancel)

    def release(self, *, timeout_s: float = 10.0) -> None:
        """One user let go; the last one stops the loop and shuts the replica down (waits up to `timeout_s`)."""
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
            self._stop_requested = True
            if NetworkRuntime._by_dht.get(id(self._dht)) is self:
                del NetworkRuntime._by_dht[id(self._dht)]
                NetworkRuntime._starting.pop(id(self._dht), None)
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self.loop.call_soon_threadsafe(self._stop.set)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("the network runtime did not stop within %.1f s", timeout_s)


class Handler:
    """Serves `handler` under `handler_name` on the DHT's runtime until `close()`; `background(stop)`,
    if given, runs beside it and is cancelled at close. ``loop`` and ``p2p`` are the runtime's.

    With `unary` (``unary(request bytes, caller's peer ID) -> reply bytes``) it also serves one-message
    calls under `unary_name`, which `call_unary` makes: they ride the replica's one multiplexed connection
    to the daemon (hivemind's unary protobuf handlers, a `BytesValue` each way), where a stream call opens
    a connection to the daemon and negotiates a stream per call."""

    def __init__(
        self,
        dht: hivemind.DHT,
        *,
        handler_name: str,
        handler: StreamHandler,
        background: Callable[[asyncio.Event], Awaitable[None]] | None = None,
        unary: UnaryHandler | None = None,
        start_timeout_s: float = 30.0,
    ):
        self.handler_name = handler_name
        self.unary_name = f"{handler_name}.unary"
        self.runtime = NetworkRuntime.acquire(dht, start_timeout_s=start_timeout_s)
        self.loop, self.p2p = self.runtime.loop, self.runtime.p2p
        self._closed = False
        self._unary = unary
        try:
            self._stop, self._task = self.runtime.call(self._start(handler, background), timeout_s=start_timeout_s)
        except BaseException:
            self.runtime.release()
            raise

    async def _start(self, handler: StreamHandler, background: Any) -> tuple[asyncio.Event, asyncio.Task | None]:
        await self.p2p.add_binary_stream_handler(self.handler_name, handler)
        if self._unary is not None:
            await self.p2p.add_protobuf_handler(self.unary_name, self._serve_unary, BytesValue)
        stop = asyncio.Event()
        return stop, (asyncio.create_task(background(stop)) if background is not None else None)

    async def _serve_unary(self, request: BytesValue, context: P2PContext) -> BytesValue:
        return BytesValue(value=await self._unary(request.value, str(context.remote_id)))

    async def call_unary(self, peer: PeerID | str, data: bytes) -> bytes:
        """One message to `peer`'s `unary` handler of the same name; its reply. Bound it with a timeout."""
        reply = await self.p2p.call_protobuf_handler(
            peer_id_of(peer), self.unary_name, BytesValue(value=data), BytesValue
        )
        return reply.value

    async def _stop_serving(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        with contextlib.suppress(Exception):
            await self.p2p.remove_binary_stream_handler(self.handler_name)
        if self._unary is not None:
            with contextlib.suppress(Exception):
                await self.p2p.remove_protobuf_handler(self.unary_name)

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coroutine` on the runtime's loop; returns a concurrent future."""
        return self.runtime.submit(coroutine)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving and let the runtime go. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.runtime.call(self._stop_serving(), timeout_s=self.runtime.closing_timeout(timeout_s / 2))
        self.runtime.release(timeout_s=timeout_s)


class Server(Protocol):
    """A protocol server on a `P2P`: registers its handler in `start` and cuts its streams off in `stop`."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


S = TypeVar("S", bound=Server)


class Served(Generic[S]):
    """A `Server` made by ``make(p2p)`` and started on the DHT's runtime; `call` runs the owner's
    coroutines beside it, `close` stops it (idempotent). ``what`` names it in errors."""

    def __init__(self, dht: hivemind.DHT, make: Callable[[P2P], S], *, what: str, start_timeout_s: float = 30.0):
        self.what = what
        self._lock = threading.Lock()
        self._closed = False
        try:
            self.runtime = NetworkRuntime.acquire(dht, start_timeout_s=start_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{what} did not start within {start_timeout_s:.1f} s") from None
        except RuntimeError as e:
            raise RuntimeError(f"cannot start {what}: {e}") from e
        try:
            self.server: S = make(self.runtime.p2p)
            self.runtime.call(self.server.start(), timeout_s=start_timeout_s)
        except BaseException as e:
            self.runtime.release()
            if isinstance(e, TimeoutError):
                raise TimeoutError(f"{what} did not start within {start_timeout_s:.1f} s") from None
            raise RuntimeError(f"cannot start {what}: {_described(e)}") from e

    @property
    def p2p(self) -> P2P:
        self.check_open()
        return self.runtime.p2p

    def check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.what} is closed")

    def call(self, coroutine: Coroutine[Any, Any, T], *, timeout_s: float, cancel: threading.Event | None = None) -> T:
        """Run ``coroutine`` on the runtime and wait up to ``timeout_s`` (TimeoutError, then cancelled); see
        `result_within` for ``cancel``."""
        if self._closed:
            coroutine.close()
            raise RuntimeError(f"{self.what} is closed")
        return self.runtime.call(coroutine, timeout_s=timeout_s, cancel=cancel)

    def close(self, *, timeout_s: float = 10.0) -> None:
        """Stop the server (its streams are cut off) and let the runtime go; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.runtime.call(self.server.stop(), timeout_s=self.runtime.closing_timeout(timeout_s / 2))
        except Exception as e:
            logger.warning("%s did not stop cleanly: %s", self.what, _described(e))
        self.runtime.release(timeout_s=timeout_s)


class StreamServer:
    """The shared part of a protocol server on a `P2P`: the handler's registration (`start`, `stop`),
    the streams being served (`num_active`, cancelled at `stop`), refusals counted by reason
    (`rejected`). A subclass sets ``protocol`` and implements ``_handle(info, reader, writer)``,
    wrapping each stream it serves in `_serving`."""

    protocol = ""

    def __init__(self, *, p2p: P2P, rpc_timeout_s: float = 10.0) -> None:
        self._p2p = p2p
        self._rpc_timeout_s = rpc_timeout_s
        self._active: set[asyncio.Task[Any]] = set()
        self._running = False
        self.rejected: Counter[str] = Counter()

    @property
    def num_active(self) -> int:
        return len(self._active)

    async def start(self) -> None:
        """Register the stream handler with the daemon."""
        if self._running:
            raise RuntimeError(f"{type(self).__name__}.start: already started")
        await asyncio.wait_for(self._p2p.add_binary_stream_handler(self.protocol, self._handle), self._rpc_timeout_s)
        self._running = True

    async def stop(self) -> None:
        """Unregister the handler and cancel the streams being served; safe to call twice."""
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(Exception):  # the daemon may be gone already; nothing to undo then
            await asyncio.wait_for(self._p2p.remove_binary_stream_handler(self.protocol), self._rpc_timeout_s)
        active = list(self._active)
        for task in active:
            task.cancel()
        await asyncio.gather(*active, return_exceptions=True)

    def _reject(self, peer: str, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        logger.debug("%s stream from %s refused: %s (%s)", self.protocol, peer, reason, detail)

    def _busy(self, limit: int) -> bool:
        """Whether a new stream must be refused (stopping, or ``limit`` streams already being served)."""
        return not self._running or len(self._active) >= limit

    @contextlib.asynccontextmanager
    async def _serving(self) -> Any:
        """Track the current handler task as a stream being served (cancelled by `stop`)."""
        task = asyncio.current_task()
        if task is not None:
            self._active.add(task)
        try:
            yield
        finally:
            self._active.discard(task)

    @contextlib.asynccontextmanager
    async def _guarded(
        self,
        peer: str,
        writer: asyncio.StreamWriter,
        *,
        timeout_s: float,
        refuse: Callable[[Rejected], Awaitable[None]] | None = None,
    ) -> Any:
        """Serve one stream from ``peer`` inside: a refusal (`Rejected`, then ``refuse`` to tell the peer),
        a timeout, a broken stream and a bug each end it with one counted reason; the stream is closed."""
        try:
            yield
        except Rejected as e:
            self._reject(peer, e.reason, e.detail)
            if refuse is not None:
                await refuse(e)
        except (TimeoutError, asyncio.TimeoutError):
            self._reject(peer, "timeout", f"not served within {timeout_s:.1f} s")
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as e:
            self._reject(peer, "disconnected", one_line(e))
        except asyncio.CancelledError:
            # stop() or the loop's end: a handler task that ends cancelled makes hivemind log an error
            logger.debug("%s stream from %s cut short: the server is stopping", self.protocol, peer)
        except Exception:
            logger.exception("bug while serving a %s stream from %s", self.protocol, peer)
            self.rejected["internal error"] += 1
        finally:
            await close_stream(writer)

    async def _handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class ServedFacade:
    """What the synchronous facades over a `Served` server share: ``server`` (its counters stay readable
    after `close`), ``peer_id``, `close` and the context manager. A subclass sets ``_served``."""

    _served: Served

    @property
    def server(self) -> Any:
        return self._served.server

    @property
    def peer_id(self) -> str:
        return str(self._served.p2p.peer_id)

    def close(self, *, timeout_s: float = 10.0) -> None:
        """Unregister the handler and cut off its streams; idempotent."""
        self._served.close(timeout_s=timeout_s)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
