"""A stream handler served from a background thread with its own event loop (uvloop) over a P2P
replica of a DHT's daemon: the shared plumbing of Swarm's synchronous network components."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import hivemind

from peers.bandwidth import open_p2p_replica

Handler = Callable[[Any, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class P2PService:
    """Serves ``handler`` under ``handler_name`` until ``close()``; ``background(stop)``, if given, runs
    beside it and is cancelled at close. ``loop`` and ``p2p`` are for the owner's coroutines."""

    def __init__(self, dht: hivemind.DHT, *, handler_name: str, handler: Handler, thread_name: str,
                 background: Callable[[asyncio.Event], Awaitable[None]] | None = None,
                 start_timeout_s: float = 30.0):
        self.handler_name = handler_name
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(dht, handler, background), name=thread_name,
                                        daemon=True)
        self._thread.start()
        self.loop, self.p2p, self._stop = self._ready.result(timeout=start_timeout_s)

    def _run(self, dht: hivemind.DHT, handler: Handler, background: Any) -> None:
        try:
            import uvloop

            uvloop.run(self._main(dht, handler, background))
        except BaseException as e:
            if not self._ready.done():
                self._ready.set_exception(e)

    async def _main(self, dht: hivemind.DHT, handler: Handler, background: Any) -> None:
        p2p = await open_p2p_replica(dht)
        stop = asyncio.Event()
        await p2p.add_binary_stream_handler(self.handler_name, handler)
        self._ready.set_result((asyncio.get_running_loop(), p2p, stop))
        task = asyncio.create_task(background(stop)) if background is not None else None
        try:
            await stop.wait()
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            with contextlib.suppress(Exception):
                await p2p.remove_binary_stream_handler(self.handler_name)
            await p2p.shutdown()

    def submit(self, coroutine: Awaitable[Any]) -> concurrent.futures.Future:
        """Run ``coroutine`` on the service's loop; returns a concurrent future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving and shut the replica down. Idempotent."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=timeout_s)
