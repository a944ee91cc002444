"""``replay --workers N``: one run whose phases are sent by N load processes.

``WorkerPoolSender`` is the runner's phase sender (replay/run/senders.py) for it; the runner
does the rest (targets, servers, introspection, manifest, /metrics, A/A control,
teacher-forced scoring, analysis) as for one process. The sender splits the phase by unit
position (replay/core/shards.py), starts one process per share (replay/run/load_process.py:
its own event loop and connection pool, its own results file), scrapes /metrics around them,
gives them one start on the run's clock, shows their progress, and merges their files into
results.jsonl when the phase ends (replay/rundir/shard_files.py), also after an interrupt. The
target's error budget is each worker's own during the phase (each starts from the target's,
as the phase starts); the parent then counts every merged result into it, so the next phase
starts from the whole run's count.

A worker that dies (a kill, a crash) stops the run as an interrupt does: the other workers send
nothing more, what they have in flight finishes, and ``--resume`` sends what is missing.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import Any

from replay.core.errors import InputError, RunDirError
from replay.core.records import Result
from replay.core.schedule import Clock, OpenLoop
from replay.core.shards import (
    AnyShard,
    ClosedLoopShare,
    closed_loop_shards,
    concurrency_shares,
    open_loop_shards,
)
from replay.run.load_process import WorkerSpec, work
from replay.run.phase import Phase, Schedule, scrape_caught_up, scrape_idle
from replay.run.progress import Progress
from replay.run.run_config import RunConfig, TargetRun
from replay.run.stopping import RunStop
from replay.rundir.shard_files import merge_shards, shard_results

STOP_GRACE_S = 5.0  # after SIGTERM, a worker writes what it cancelled; then it is killed


def check_workers(workers: int, schedules: Sequence[Schedule], session_history: str) -> None:
    """What --workers cannot do, refused before a run directory is made."""
    if workers < 1:
        raise InputError(f"--workers {workers}: give 1 or more load processes")
    if workers == 1:
        return
    if session_history == "reference":
        raise InputError(
            "--session-history reference reads the reference's answers as they come, in "
            "one process: leave out --workers"
        )
    for sched in schedules:
        if not isinstance(sched, OpenLoop):
            concurrency_shares(sched.concurrency, workers)


def worker_schedules(
    sched: Schedule, workers: int, ctx: SpawnContext
) -> list[tuple[Schedule, AnyShard]]:
    """Each worker's schedule and shard of one phase (a closed loop's workers claim their
    units from one counter, made here in ``ctx`` so the spawned processes share it)."""
    if isinstance(sched, OpenLoop):
        return [(sched, shard) for shard in open_loop_shards(workers)]
    shares = concurrency_shares(sched.concurrency, workers)
    shards = closed_loop_shards(workers, ctx.Value("q", 0))
    return [
        (ClosedLoopShare(c, phase=sched.label), shard)
        for c, shard in zip(shares, shards, strict=True)
    ]


class WorkerPool:
    """The processes of one phase, watched from the event loop: their pipes (ready, advance,
    done) and their ends (``Process.sentinel``)."""

    def __init__(self, specs: list[WorkerSpec], advance: Callable[[bool], None]) -> None:
        self.specs, self.advance = specs, advance
        self.ctx: SpawnContext = multiprocessing.get_context("spawn")
        self.procs: list[SpawnProcess] = []
        self.conns: list[Connection] = []
        self.ready: set[int] = set()
        self.done: set[int] = set()
        self.ended: set[int] = set()
        self.reported: set[int] = set()  # lost workers already said
        self.cannot_write: dict[int, RunDirError] = {}  # workers stopped by a full disk
        self.changed = asyncio.Event()
        self.stop_sent = False

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for k, spec in enumerate(self.specs):
            ours, theirs = self.ctx.Pipe()
            proc = self.ctx.Process(
                target=work, args=(spec, theirs), name=f"replay-worker-{k}", daemon=True
            )
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
            loop.add_reader(ours.fileno(), self._read, k)
            loop.add_reader(proc.sentinel, self._ended, k)

    def _read(self, k: int) -> None:
        conn = self.conns[k]
        try:
            while conn.poll():
                msg = conn.recv()
                if msg[0] == "advance":
                    for ok, n in ((True, msg[1]), (False, msg[2])):
                        for _ in range(n):
                            self.advance(ok)
                elif msg[0] == "ready":
                    self.ready.add(k)
                elif msg[0] == "done":
                    self.done.add(k)
                elif msg[0] == "cannot_write":
                    self.cannot_write[k] = RunDirError(str(msg[1]), str(msg[2]))
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(conn.fileno())
        self.changed.set()

    def _ended(self, k: int) -> None:
        asyncio.get_running_loop().remove_reader(self.procs[k].sentinel)
        self._read(k)  # what it said before it ended comes first
        self.procs[k].join()  # it has ended: this only reaps it (and sets its exitcode)
        self.ended.add(k)
        self.changed.set()

    def lost(self) -> list[int]:
        """Workers that ended without finishing their share."""
        return sorted(self.ended - self.done)

    async def until(self, ok: Callable[[], bool], stopping: asyncio.Event | None = None) -> None:
        """Wait until ``ok()``; tell the workers to stop once ``stopping`` is set."""
        while not ok():
            if stopping is not None and stopping.is_set():
                self.stop()
            waits = [asyncio.ensure_future(self.changed.wait())]
            if stopping is not None and not self.stop_sent:
                waits.append(asyncio.ensure_future(stopping.wait()))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            self.changed.clear()

    def send(self, msg: tuple[Any, ...]) -> None:
        for k, conn in enumerate(self.conns):
            if k not in self.ended:
                try:
                    conn.send(msg)
                except OSError:
                    pass  # it is ending: its sentinel says so

    def stop(self) -> None:
        if not self.stop_sent:
            self.stop_sent = True
            self.send(("stop",))

    async def close(self) -> None:
        """Whatever still runs gets SIGTERM (its in-flight requests are written as
        cancelled), then SIGKILL after a grace."""
        for k, proc in enumerate(self.procs):
            if k not in self.ended:
                proc.terminate()
        try:
            await asyncio.wait_for(
                self.until(lambda: len(self.ended) == len(self.procs)), STOP_GRACE_S
            )
        except TimeoutError:
            pass
        finally:
            loop = asyncio.get_running_loop()
            for proc, conn in zip(self.procs, self.conns, strict=True):
                if proc.is_alive():
                    proc.kill()
                proc.join()
                loop.remove_reader(proc.sentinel)
                loop.remove_reader(conn.fileno())
                conn.close()


class WorkerPoolSender:
    """Each phase sent by ``workers`` load processes (a ``PhaseSender``, replay/run/senders.py).
    ``clock`` is the run's: the workers' clocks share its zero through the wall clock."""

    def __init__(self, cfg: RunConfig, clock: Clock) -> None:
        self.workers, self.cfg, self.clock = cfg.load.workers, cfg, clock
        self.wall_epoch = time.time() - clock.now()

    def _specs(self, phase: Phase, headers: dict[str, str]) -> list[WorkerSpec]:
        t, c = phase.target, self.cfg
        run = c.run_spec()
        return [
            WorkerSpec(
                run=run,
                shard=shard,
                sched=sched,
                results=shard_results(c.run_dir, k),
                run_wall_epoch=self.wall_epoch,
                url=t.client.base_url,
                model=t.client.model,
                headers=headers,
                target=t.name,
                trace=phase.trace,
                counts=t.counts,
                pool=t.pool,
                budget=t.budget,
                phase_limit_s=phase.timeout_s,
                salt=phase.salt,
                before_done=phase.before_done,
                sessions=phase.sessions,
                max_model_len=t.max_model_len,
            )
            for k, (sched, shard) in enumerate(
                worker_schedules(phase.sched, self.workers, multiprocessing.get_context("spawn"))
            )
        ]

    async def send(self, phase: Phase, run: TargetRun, stop: RunStop) -> dict[str, Any] | None:
        total = phase.trace.count - len(phase.before_done)
        if total <= 0 or stop.event.is_set():
            return None
        name, label, progress = phase.target.name, phase.label, phase.progress
        progress.phase(name, label, total)
        answered = 0

        def advance(ok: bool) -> None:
            nonlocal answered
            answered += ok
            progress.advance(name, label, ok)

        pool = WorkerPool(self._specs(phase, run.spec.auth_headers()), advance)
        pool.start()
        try:
            await pool.until(
                lambda: pool.ready | pool.ended == set(range(len(pool.procs))), stop.event
            )
            before = await scrape_idle(phase.target.scraper)
            start = before.t if before is not None else self.clock.now()
            # The open loop's offsets count from here, in every worker, as in one process.
            pool.send(("go", self.clock.now()))
            await pool.until(lambda: _watch(pool, run, stop, progress), stop.event)
            after = await scrape_caught_up(phase.target.scraper, before, answered)
            end = after.t if after is not None else self.clock.now()
        finally:
            try:
                await pool.close()
            finally:  # also when a second Ctrl-C cancels the close
                _merged(phase, pool)
        return {
            "start": start,
            "end": end,
            **({"resumed": True} if phase.before_done else {}),
            **({"interrupted": True} if stop.event.is_set() else {}),
        }


def _watch(pool: WorkerPool, run: TargetRun, stop: RunStop, progress: Progress) -> bool:
    """Every worker ended; a lost one stops the run (as an interrupt: --resume)."""
    for k in pool.lost():
        if k in pool.reported:
            continue
        pool.reported.add(k)
        if k in pool.cannot_write:
            stop.cannot_write(pool.cannot_write[k])
            continue
        code = pool.procs[k].exitcode
        why = f"load process {k} ended before its share of the phase was sent (exit {code})"
        run.info.setdefault("problems", []).append(why)
        progress.status(f"[{run.spec.name}] {why}")
        if not stop.event.is_set():
            stop.interrupt()
    return len(pool.ended) == len(pool.procs)


def _merged(phase: Phase, pool: WorkerPool) -> None:
    """The workers' results into results.jsonl, and into the target's error budget."""
    rows = merge_shards([s.results for s in pool.specs], phase.writer)
    budget = phase.target.budget
    for row in rows:
        r = Result.from_json(row)
        budget.record(r.status, r.error_kind, r.http_status, r.error)
