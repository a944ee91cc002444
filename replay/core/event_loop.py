"""The event loop every load process runs on (uvloop where it is installed, else asyncio's),
and the garbage collector kept out of its way while a phase sends."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on uvloop where it is installed: the client then spends about 0.6 of
    the CPU per streamed token, and its timestamps lag less at high concurrency (bench/).
    Same semantics as ``asyncio.run`` (an ``asyncio.Runner``; Ctrl-C cancels the run)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


@contextmanager
def heap_frozen() -> Iterator[None]:
    """While a phase sends, what the process already holds (its imports, the trace's index,
    the run's state: hundreds of thousands of objects) is left out of the collector's full
    collections, which otherwise walked all of it every few seconds and held the loop 17-30 ms
    each time (bench/open_loop.py: the schedule lag's p99.9). Objects made during the phase
    are collected as usual; afterwards the held ones are collectable again."""
    gc.collect()  # what is garbage now is not kept frozen
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
