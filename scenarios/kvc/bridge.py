"""One asyncio event loop per Locust process, run in a greenlet: the replay core's async
client under Locust's gevent.

The core client is asyncio/aiohttp; Locust users are greenlets. Each Locust process runs ONE
asyncio event loop in a greenlet (``AsyncBridge``): gevent's monkey-patched selector makes the
loop's waits cooperative, so the loop shares the hub with Locust's users instead of blocking
it, and no thread is involved (no cross-thread wake-ups, no GIL contention with a second
thread, and DNS goes through gevent's resolver). A user submits its request to the loop and
waits on a gevent ``AsyncResult``. Timings are the core client's, taken inside the loop as
each chunk arrives: there is no second, Locust-side clock. Tokens are counted by the core's
accumulator from the server's usage (never chunks). Two loops cannot run in one thread, which
is why it is one loop per process and not ``asyncio.run`` per request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar

import gevent
from gevent.event import AsyncResult

T = TypeVar("T")


class AsyncBridge:
    """One asyncio loop for this process, run in a greenlet."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._greenlet = gevent.spawn(self._run)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def wait(self, fut: concurrent.futures.Future[T], timeout: float | None = None) -> T:
        """Wait for ``fut`` cooperatively; a killed waiter (the test stopped) cancels it."""
        done: AsyncResult = AsyncResult()
        fut.add_done_callback(done.set)
        try:
            done.get(timeout=timeout)
        except gevent.Timeout:
            fut.cancel()
            raise TimeoutError(f"no answer within {timeout} s") from None
        except BaseException:
            fut.cancel()
            raise
        return fut.result()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.wait(self.submit(coro), timeout)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._greenlet.join(timeout=5)
