"""When each request is sent.

Open loop sends at absolute times (start + offset), never by sleeping a relative gap after
each send, which drifts. Closed loop keeps N requests in flight. The clock is injected so
tests can run a ten-minute schedule in milliseconds.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

T = TypeVar("T")
# Event-loop timers fire on a millisecond grid (uvloop's libuv timers wake up to ~1.3 ms early,
# asyncio's up to 1 ms late), so the last stretch before a send is due is waited for by
# yielding to the loop, which runs its other callbacks and I/O meanwhile, until the clock says so.
YIELD_BEFORE_DUE_S = 0.002
# A wait shorter than this is not raced against the stop event (two tasks per request would
# cost more than the wait is worth at a thousand requests a second); stop is checked after it.
STOP_RACE_MIN_S = 0.05
# send(item, scheduled_time) -> awaitable; the schedule never inspects the outcome.
Send = Callable[[T, float], Awaitable[object]]


class Clock(Protocol):
    """The run's time, which every timestamp of a run is on: seconds since the run's zero.

    All the run uses of it: ``now()``, and ``sleep_until`` to wait for a due time. What stamps
    results off the event loop (the client's socket callbacks, the /metrics scraper) is handed
    the bound ``now`` as its time source, so it stamps on the same zero without knowing how the
    clock keeps time. ``MonotonicClock`` is the real one; a test's clock implements this, it
    does not subclass ``MonotonicClock`` (tests/house/test_clock.py)."""

    def now(self) -> float: ...

    async def sleep_until(self, t: float) -> None: ...


class MonotonicClock:
    """Real time (a ``Clock``): seconds since ``epoch`` on ``time.perf_counter``."""

    def __init__(self, epoch: float | None = None) -> None:
        self.epoch = time.perf_counter() if epoch is None else epoch

    def now(self) -> float:
        return time.perf_counter() - self.epoch

    async def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > YIELD_BEFORE_DUE_S:
            await asyncio.sleep(delay - YIELD_BEFORE_DUE_S)
        while self.now() < t:
            await asyncio.sleep(0)


@dataclass(frozen=True)
class ClosedLoop:
    """Keep ``concurrency`` requests in flight until the items run out."""

    concurrency: int

    @property
    def label(self) -> str:
        return f"c{self.concurrency}"

    async def run(
        self, items: Iterable[T], send: Send[T], clock: Clock, stop: asyncio.Event | None = None
    ) -> None:
        it = iter(items)
        lock = asyncio.Lock()

        async def worker() -> None:
            while stop is None or not stop.is_set():
                async with lock:
                    item = next(it, _END)
                if item is _END:
                    return
                # In a closed loop the request is due the moment a slot frees up.
                await send(item, clock.now())  # type: ignore[arg-type]

        await asyncio.gather(*(worker() for _ in range(self.concurrency)))


_END = object()


@dataclass(frozen=True)
class OpenLoop:
    """Send each item at ``start + offsets[i]``; ``max_in_flight`` bounds open requests
    (0 = unbounded). A request that waits for a slot keeps its scheduled time, so the
    queueing shows in latency-from-schedule. ``offsets`` is iterated once per run: a list, or
    a re-iterable that computes them as it goes (``PoissonOffsets``, ``TraceOffsets``).
    ``start`` is the time on the clock the offsets count from; None: when the run begins (the
    load processes of ``--workers`` share one start, so their schedules add up to this one)."""

    offsets: Iterable[float]
    max_in_flight: int = 0
    name: str = "open"
    start: float | None = None

    @property
    def label(self) -> str:
        return self.name

    async def run(
        self, items: Iterable[T], send: Send[T], clock: Clock, stop: asyncio.Event | None = None
    ) -> None:
        start = clock.now() if self.start is None else self.start
        slots = asyncio.Semaphore(self.max_in_flight) if self.max_in_flight > 0 else None
        tasks: set[asyncio.Task[object]] = set()
        try:
            for item, offset in zip(items, self.offsets, strict=False):
                due = start + offset
                if not await _sleep_unless_stopped(clock, due, stop):
                    break
                if slots is not None:
                    await slots.acquire()
                task = asyncio.ensure_future(_guarded(send(item, due), slots))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()


async def _sleep_unless_stopped(clock: Clock, due: float, stop: asyncio.Event | None) -> bool:
    """Sleep until ``due``; False as soon as ``stop`` is set (an interrupt sends no more)."""
    if stop is None:
        await clock.sleep_until(due)
        return True
    if stop.is_set():
        return False
    if due - clock.now() < STOP_RACE_MIN_S:
        await clock.sleep_until(due)
        return not stop.is_set()
    sleeper = asyncio.ensure_future(clock.sleep_until(due))
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({sleeper, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        waiter.cancel()
    return not stop.is_set()


async def _guarded(aw: Awaitable[object], slots: asyncio.Semaphore | None) -> object:
    try:
        return await aw
    finally:
        if slots is not None:
            slots.release()


def trace_offsets(times: Sequence[float | None], time_scale: float = 1.0) -> list[float]:
    """Offsets from the trace's own timestamps, relative to the first, scaled
    (``time_scale`` 0.5 replays twice as fast). Missing times count as 0."""
    base = min((t for t in times if t is not None), default=0.0)
    return list(TraceOffsets(lambda: times, base, time_scale))


def poisson_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets of a Poisson process at ``rate`` requests/s (private seeded RNG)."""
    return list(PoissonOffsets(n, rate, seed))


@dataclass(frozen=True)
class PoissonOffsets:
    """``poisson_offsets`` computed as they are consumed, the same numbers on every pass, so
    a long schedule holds no list of times."""

    n: int
    rate: float
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate <= 0 or not math.isfinite(self.rate):
            raise ValueError("rate must be a positive number of requests per second")

    def __iter__(self) -> Iterator[float]:
        rng = random.Random(self.seed)
        t = 0.0
        for _ in range(self.n):
            yield t
            t += rng.expovariate(self.rate)


@dataclass(frozen=True)
class TraceOffsets:
    """``trace_offsets`` computed as they are consumed: ``times`` gives the trace's
    timestamps afresh on every pass, and ``base`` is their minimum (known from a scan)."""

    times: Callable[[], Iterable[float | None]]
    base: float
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.time_scale <= 0 or not math.isfinite(self.time_scale):
            raise ValueError("time_scale must be a positive number")

    def __iter__(self) -> Iterator[float]:
        for t in self.times():
            yield ((t if t is not None else self.base) - self.base) * self.time_scale
