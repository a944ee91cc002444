"""Schedules under an injected clock: a long schedule runs in milliseconds."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from replay.core.schedule import (
    ClosedLoop,
    MonotonicClock,
    OpenLoop,
    poisson_offsets,
    trace_offsets,
)
from tests.support.nowire import VirtualClock


def test_open_loop_sends_at_absolute_times() -> None:
    clock = VirtualClock(start=100.0)
    offsets = [0.0, 0.5, 0.5, 2.0, 600.0]
    sent: list[tuple[int, float, float]] = []

    async def send(item: int, scheduled: float) -> None:
        sent.append((item, scheduled, clock.now()))
        await clock.sleep(0.3)  # a slow request must not delay the next send

    clock.drive(OpenLoop(offsets).run(range(5), send, clock))
    assert [s[0] for s in sent] == [0, 1, 2, 3, 4]
    assert [s[1] - 100.0 for s in sent] == offsets
    # Each was sent at its scheduled time, not after the previous one finished.
    assert all(abs(actual - scheduled) < 1e-9 for _, scheduled, actual in sent)


def test_open_loop_max_in_flight_keeps_scheduled_time() -> None:
    clock = VirtualClock(start=100.0)
    in_flight = 0
    peak = 0
    records: list[tuple[float, float]] = []

    async def send(item: int, scheduled: float) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        records.append((scheduled, clock.now()))
        await clock.sleep(10.0)
        in_flight -= 1

    clock.drive(OpenLoop([0.0] * 6, max_in_flight=2).run(range(6), send, clock))
    assert peak == 2
    assert len(records) == 6
    # Queued requests keep their schedule; the wait shows up as queue delay.
    assert all(sched == 100.0 for sched, _ in records)
    assert max(actual - sched for sched, actual in records) >= 10.0


@pytest.mark.parametrize("n", [1, 3, 8])
def test_closed_loop_never_exceeds_concurrency_and_sends_all(n: int) -> None:
    clock = VirtualClock(start=100.0)
    in_flight = 0
    peak = 0
    seen: list[int] = []

    async def send(item: int, scheduled: float) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        seen.append(item)
        await clock.sleep(1.0 + (item % 3))
        in_flight -= 1

    clock.drive(ClosedLoop(n).run(range(20), send, clock))
    assert clock.t > 100.0
    assert sorted(seen) == list(range(20))
    assert peak == min(n, 20)


def test_trace_offsets_scale_and_start_at_zero() -> None:
    assert trace_offsets([5.0, 6.0, 9.0], 0.5) == [0.0, 0.5, 2.0]
    assert trace_offsets([None, 2.0, 4.0]) == [0.0, 0.0, 2.0]
    with pytest.raises(ValueError):
        trace_offsets([1.0], 0)


def test_poisson_offsets_are_seeded_and_have_the_rate() -> None:
    a = poisson_offsets(4000, rate=20.0, seed=3)
    assert a == poisson_offsets(4000, rate=20.0, seed=3)
    assert a != poisson_offsets(4000, rate=20.0, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in itertools.pairwise(a))
    measured = (len(a) - 1) / a[-1]
    assert 19.0 < measured < 21.0


@pytest.mark.parametrize("kind", ["open", "closed"])
def test_stop_sends_nothing_more(kind: str) -> None:
    clock = VirtualClock(start=100.0)
    stop = asyncio.Event()
    sent: list[int] = []

    async def send(item: int, scheduled: float) -> None:
        sent.append(item)
        if item == 2:
            stop.set()
        await clock.sleep(1.0)

    sched = OpenLoop([float(i) for i in range(10)]) if kind == "open" else ClosedLoop(1)
    clock.drive(sched.run(range(10), send, clock, stop))
    assert sent == [0, 1, 2]


def test_the_real_clock_never_wakes_before_the_due_time() -> None:
    """uvloop's millisecond timers woke ``asyncio.sleep`` up to ~1.3 ms early: an open loop
    sent before its schedule. The last stretch is yielded away until the clock is due."""
    uvloop = pytest.importorskip("uvloop")
    rng = random.Random(7)

    async def main() -> list[float]:
        clock = MonotonicClock()
        early = []
        for _ in range(300):
            due = clock.now() + rng.uniform(0.0002, 0.004)
            await clock.sleep_until(due)
            early.append(due - clock.now())
        return early

    assert max(uvloop.run(main())) <= 0.0


def test_a_stop_during_a_long_wait_ends_it_at_once() -> None:
    async def main() -> float:
        clock, stop = MonotonicClock(), asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, stop.set)
        t0 = clock.now()
        await OpenLoop([0.0, 30.0]).run(range(2), _ignore, clock, stop)
        return clock.now() - t0

    assert asyncio.run(main()) < 5.0


async def _ignore(item: int, scheduled: float) -> None:
    return None
