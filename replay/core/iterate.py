"""Bounded ways to walk long streams of work: a fixed pool of workers that take items only as
they free up, and closing a generator (and the file it reads) when its reader stops early."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


async def pooled(
    items: Iterator[T], work: Callable[[T], Awaitable[None]], concurrency: int
) -> None:
    """``work`` on every item, ``concurrency`` at a time, taking items only as workers free
    up: a million items are never a million pending coroutines."""

    async def worker() -> None:
        for item in items:  # shared: each item goes to exactly one worker
            await work(item)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


@contextmanager
def closing(items: Iterator[T]) -> Iterator[Iterator[T]]:
    """Close a generator (and the file it reads) when the reader stops early; plain
    iterators have nothing to close."""
    try:
        yield items
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()
