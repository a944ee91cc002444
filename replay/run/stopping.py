"""How a run stops before its end: an interrupt, or a run directory it can no longer write.

An interrupt (Ctrl-C, SIGTERM; ``signals.interrupts`` delivers it): nothing more is sent,
in-flight requests get ``drain_s`` to finish and are then cancelled; a second one cancels at
once. The summary and reports are written as far as the run got. A write to the run directory
that fails (a full disk, a quota, a folder made read-only): the run stops at once, since
nothing more could be recorded, and the runner raises the error once every server it started is
stopped (the CLI's exit 5). Either way ``event`` is set, and ``--resume`` finishes the run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from replay.core.errors import RunDirError
from replay.core.schedule import Clock, MonotonicClock
from replay.run.progress import Progress


class RunStop:
    """The run's stop: ``event`` once it stops, ``interrupted`` or ``storage`` (why), and
    ``main`` (the task that runs the targets, cancelled to stop). The drain is timed on
    ``clock`` (the run's: a test's clock drains in no time)."""

    def __init__(
        self, run_dir: Path, drain_s: float, progress: Progress, clock: Clock | None = None
    ) -> None:
        self.run_dir, self.drain_s, self.progress = run_dir, drain_s, progress
        self.clock: Clock = clock or MonotonicClock()
        self.event = asyncio.Event()
        self.interrupted = False
        # The signal that interrupted the run (SIGINT, SIGTERM: the exit code says which);
        # None for another cause (a lost load process).
        self.signal: int | None = None
        self.storage: RunDirError | None = None  # the first write that failed
        self.main: asyncio.Future[None] | None = None
        self._drain: asyncio.Task[None] | None = None

    def interrupt(self, by: int | None = None) -> None:
        """First Ctrl-C/SIGTERM (``by``): drain, then cancel; a second (or one after a stop):
        at once."""
        if self.event.is_set():
            self.cancel()
            return
        self.interrupted, self.signal = True, by
        self.event.set()
        self.progress.status(
            f"interrupted: draining in-flight requests (up to "
            f"{self.drain_s:g} s; Ctrl-C again to stop now)"
        )

        async def drain() -> None:
            await self.clock.sleep_until(self.clock.now() + self.drain_s)
            self.cancel()

        self._drain = asyncio.ensure_future(drain())

    def cannot_write(self, err: RunDirError) -> None:
        """A file of the run directory could not be written: stop at once (what is in flight
        would have nowhere to go; ``--resume`` sends it again)."""
        if self.storage is not None:
            return
        self.storage = err.in_run(str(self.run_dir))
        self.progress.status(f"stopping: cannot write {err.path} ({err.reason})")
        self.event.set()
        self.cancel()

    def guarded(self, write: Callable[[], object]) -> None:
        """A write to the run directory during the run: one that fails stops the run."""
        try:
            write()
        except RunDirError as err:
            self.cannot_write(err)

    def cancel(self) -> None:
        if self.main is not None:
            self.main.cancel()

    def close(self) -> None:
        if self._drain is not None:
            self._drain.cancel()
