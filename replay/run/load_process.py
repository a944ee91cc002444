"""One load process of ``replay --workers N``: its share of one phase, sent from its own event
loop (uvloop, as the single process's) and connection pool, its results in its own file
(replay/rundir/shard_files.py).

The parent (replay/run/worker_pool.py) starts it with a ``WorkerSpec`` and a pipe. It says
``ready`` once its client is up, waits for ``go`` with the phase's start (on the run's clock,
which it shares through the wall clock), sends its shard as a ``Phase`` does, reports what
finished (``advance``: counts, at most ten messages a second) and ``done``. ``stop`` is the
run's interrupt: send nothing more, let what is in flight finish. SIGTERM, or the parent's end
of the pipe closing (the parent was killed), cancels what is in flight at once; its results are
written as cancelled. Ctrl-C reaches every process of the terminal's group: a worker ignores
it, its parent decides.
"""

from __future__ import annotations

import asyncio
import signal
import time
from array import array
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from replay.analysis.run_spec import RunSpec
from replay.core.buckets import Buckets
from replay.core.errors import RunDirError
from replay.core.event_loop import run_loop
from replay.core.schedule import Clock, MonotonicClock, OpenLoop
from replay.core.shards import AnyShard, Shard, ShardedOffsets
from replay.run.budget import ErrorBudget
from replay.run.phase import Phase, Schedule, TargetSession
from replay.run.progress import QuietProgress
from replay.run.session_turns import Sessions
from replay.rundir.files import JsonlWriter
from replay.serving.client import Client
from replay.serving.metrics import MetricsSnapshot
from replay.traces.synth import TokenPool
from replay.traces.trace import TraceSource

ADVANCE_EVERY_S = 0.1


@dataclass(frozen=True)
class WorkerSpec:
    """A worker's spec: the run's (``run``, as the manifest records it) plus its ``shard`` of
    one phase, and what the phase hands it: the target's server, the trace it reads, the
    target's counts and budget as the phase starts (pickled to the process)."""

    run: RunSpec
    shard: AnyShard
    sched: Schedule  # the phase's (an open loop's offsets are split by ``shard``)
    results: Path
    run_wall_epoch: float  # wall-clock time of the run clock's zero
    url: str
    model: str
    headers: dict[str, str]  # the target's credentials (TargetSpec.auth_headers)
    target: str
    trace: TraceSource
    counts: array[int]
    pool: TokenPool | None
    budget: ErrorBudget  # the target's, as the phase starts
    phase_limit_s: float  # the phase's time limit (the run spec's, or what is left of it)
    salt: str | None
    before_done: set[str]
    sessions: Sessions | None
    max_model_len: int | None = None

    @property
    def buckets(self) -> Buckets:
        return Buckets.parse(self.run.quality.buckets)

    def clock(self) -> Clock:
        """The run's clock in this process: the same zero, by the wall clock, then monotonic."""
        return MonotonicClock(time.perf_counter() - (time.time() - self.run_wall_epoch))

    def schedule(self, start: float) -> Schedule:
        """This worker's schedule: its share of the concurrency, or its offsets from the
        shared start."""
        if isinstance(self.sched, OpenLoop):
            assert isinstance(self.shard, Shard)  # an open loop's split is by position
            return replace(
                self.sched, offsets=ShardedOffsets(self.sched.offsets, self.shard), start=start
            )
        return self.sched  # a closed loop: the parent gave it this worker's share


class PipeProgress(QuietProgress):
    """The parent shows progress: finished requests go up the pipe as counts, at most every
    ``ADVANCE_EVERY_S`` (one message a request woke the parent a thousand times a second at
    the client's ceiling, taking CPU from the load processes)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.ok = self.failed = 0
        self._flush: asyncio.TimerHandle | None = None

    def advance(self, target: str, label: str, ok: bool) -> None:
        if ok:
            self.ok += 1
        else:
            self.failed += 1
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(ADVANCE_EVERY_S, self.flush)

    def flush(self) -> None:
        """Send what finished since the last message."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self.ok or self.failed:
            try:
                self.conn.send(("advance", self.ok, self.failed))
            except OSError:
                pass  # the parent is gone: the pipe's reader cancels this process
            self.ok = self.failed = 0


class NoScrape:
    """The parent scrapes /metrics around the whole phase; a worker does not."""

    async def scrape_once(self) -> MetricsSnapshot | None:
        return None


def work(spec: WorkerSpec, conn: Connection) -> None:
    """The process's entry point (multiprocessing, spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        run_loop(_work(spec, conn))
    except asyncio.CancelledError:
        pass  # SIGTERM or the parent gone: the results written are all there is
    finally:
        conn.close()


async def _work(spec: WorkerSpec, conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    loop.add_signal_handler(signal.SIGTERM, main.cancel)
    clock = spec.clock()
    stopping = asyncio.Event()
    go: asyncio.Future[float] = loop.create_future()

    def readable() -> None:
        try:
            while conn.poll():
                msg: tuple[Any, ...] = conn.recv()
                if msg[0] == "go" and not go.done():
                    go.set_result(float(msg[1]))
                elif msg[0] == "stop":
                    stopping.set()
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())
            stopping.set()
            main.cancel()

    loop.add_reader(conn.fileno(), readable)
    client = Client(
        spec.url,
        spec.model,
        headers=spec.headers,
        timeout_s=spec.run.load.timeout_s,
        seed=spec.run.load.seed,
        clock=clock.now,
    )
    cannot_write: list[RunDirError] = []

    def stop_writing(err: RunDirError) -> None:  # a full disk: this share stops, said below
        cannot_write.append(err)
        stopping.set()

    writer = JsonlWriter(spec.results, stop_writing)
    progress = PipeProgress(conn)
    try:
        conn.send(("ready",))
        stopped = asyncio.ensure_future(stopping.wait())
        waits: list[asyncio.Future[Any]] = [go, stopped]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        start = go.result() if go.done() else clock.now()
        await _phase(spec, client, writer, progress, clock, stopping, start).run()
    finally:
        progress.flush()
        writer.close()
        await client.close()
        loop.remove_reader(conn.fileno())
    try:
        err = cannot_write[0] if cannot_write else None
        conn.send(("done",) if err is None else ("cannot_write", err.path, err.reason))
    except OSError:
        pass


def _phase(
    spec: WorkerSpec,
    client: Client,
    writer: JsonlWriter,
    progress: PipeProgress,
    clock: Clock,
    stopping: asyncio.Event,
    start: float,
) -> Phase:
    target = TargetSession(
        spec.target,
        client,
        spec.counts,
        spec.pool,
        spec.budget,
        NoScrape(),
        max_model_len=spec.max_model_len,
    )
    return Phase(
        target=target,
        sched=spec.schedule(start),
        trace=spec.trace,
        buckets=spec.buckets,
        writer=writer,
        progress=progress,
        clock=clock,
        stopping=stopping,
        timeout_s=spec.phase_limit_s,
        salt=spec.salt,
        before_done=spec.before_done,
        sessions=spec.sessions,
        shard=spec.shard,
    )
