"""How one phase's sends split across load processes (``replay --workers N``).

A phase sends *units* (a request alone, or a whole session: replay/traces/sessions.py) in the
order its schedule pulls them. A worker takes the units at the positions its ``Shard`` owns:
position ``j`` belongs to worker ``pattern[j % len(pattern)]``. The split is by position in
what the phase sends (after a resume has left out the finished requests), so it is the same
on every pass of the trace and a session never spans two workers.

* Open loop: the pattern is ``0, 1, ..., N-1`` (position modulo N), and each worker sends its
  units at *their own* offsets (``Shard.take`` applied to the schedule's offsets too), from a
  start all workers share: the merged schedule is the single-process one.
* Closed loop of concurrency C: worker k keeps its share of C in flight (C split as evenly as
  possible) and *claims* each unit when one of its slots frees up (``ClaimedShard``: the next
  position nobody has claimed, from a counter the phase's workers share). A worker the machine
  runs slower takes fewer units, so they all finish together: split by a fixed pattern, two
  workers sharing two CPUs with the server ended 2.5 s apart in a 14 s phase (bench/).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from replay.core.errors import InputError
from replay.core.schedule import ClosedLoop

T = TypeVar("T")


@dataclass(frozen=True)
class Shard:
    """Worker ``index``'s share of a phase: the positions ``j`` with
    ``pattern[j % len(pattern)] == index``."""

    index: int
    pattern: tuple[int, ...]

    def take(self, items: Iterable[T]) -> Iterator[T]:
        n = len(self.pattern)
        return (x for j, x in enumerate(items) if self.pattern[j % n] == self.index)


class SharedCounter(Protocol):
    """``multiprocessing``'s ``Value("q")``: an integer that processes share, with its lock."""

    value: int

    def get_lock(self) -> Any: ...


@dataclass(frozen=True)
class ClaimedShard:
    """Worker ``index``'s share of a closed loop, claimed as it goes: each unit it asks for is
    the next position no worker has claimed (``counter``, shared by the phase's workers). Every
    position goes to exactly one worker. The claim happens when the schedule pulls a unit, that
    is when a slot of this worker frees up."""

    index: int
    counter: SharedCounter

    def _claim(self) -> int:
        with self.counter.get_lock():
            j = self.counter.value
            self.counter.value = j + 1
        return j

    def take(self, items: Iterable[T]) -> Iterator[T]:
        want = self._claim()
        for j, x in enumerate(items):
            if j == want:
                yield x
                want = self._claim()


AnyShard = Shard | ClaimedShard


@dataclass(frozen=True)
class ShardedOffsets:
    """An open loop's offsets as one worker sends them: those at its shard's positions,
    re-iterable like the offsets themselves (``PoissonOffsets`` recomputes them each pass)."""

    offsets: Iterable[float]
    shard: Shard

    def __iter__(self) -> Iterator[float]:
        return self.shard.take(self.offsets)


@dataclass(frozen=True)
class ClosedLoopShare(ClosedLoop):
    """One worker's slots of a closed loop; its results keep the whole loop's phase label."""

    phase: str = ""

    @property
    def label(self) -> str:
        return self.phase


def concurrency_shares(concurrency: int, workers: int) -> list[int]:
    """A closed loop's concurrency split over the workers as evenly as possible (the first
    ones get one more); fewer slots than workers would leave a worker idle."""
    if concurrency < workers:
        raise InputError(
            f"--workers {workers}: a closed loop of concurrency {concurrency} cannot give "
            f"every worker a request in flight; use --concurrency >= {workers} or fewer workers"
        )
    base, extra = divmod(concurrency, workers)
    return [base + (1 if k < extra else 0) for k in range(workers)]


def open_loop_shards(workers: int) -> list[Shard]:
    pattern = tuple(range(workers))
    return [Shard(k, pattern) for k in range(workers)]


def closed_loop_shards(workers: int, counter: SharedCounter) -> list[ClaimedShard]:
    """One claiming shard per worker, all on ``counter`` (at 0: the phase's first unit)."""
    return [ClaimedShard(k, counter) for k in range(workers)]
