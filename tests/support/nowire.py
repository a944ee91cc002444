"""A run without the wire: a virtual clock, a connector that opens no socket and senders that
answer a phase's requests themselves, for tests of the runner's own logic (resume, the error
budget, draining, its orders) that finish in milliseconds. The real connector and senders are
tested on the wire (test_phase_sender, test_workers, test_faults)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from array import array
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from replay.analysis.run_spec import QualitySpec
from replay.analysis.schemas import Summary
from replay.analysis.schemas.manifest import Manifest
from replay.analysis.summary import SUMMARY_VERSION
from replay.core.errors import TargetError
from replay.core.records import Result
from replay.core.schedule import ClosedLoop
from replay.pipeline.analyse import Sources
from replay.run.connect import Connected
from replay.run.phase import Phase, Schedule, TargetSession
from replay.run.run_config import RunConfig, TargetRun
from replay.run.stopping import RunStop
from replay.run.teacher import Scoring
from replay.rundir.files import JsonlWriter
from replay.serving.local_server import LocalServer
from replay.serving.targets import TargetSpec
from replay.traces.importers import load
from replay.traces.trace import Request
from tests.conftest import ROOT
from tests.support.run_config import run_config

TRACE = ROOT / "traces" / "sample.jsonl"
SETTLE_STEPS = 50  # loop turns the clock lets every runnable task take before it jumps


class VirtualClock:
    """Time that passes only when every task waits: ``sleep_until`` wakes the earliest sleeper
    once the others settled, its due time becoming ``now`` (trio's
    ``MockClock(autojump_threshold=0)``). A ten-minute schedule runs in milliseconds. A
    ``replay.core.schedule.Clock`` of its own, not a ``MonotonicClock``."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start
        self._due: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._jumper: asyncio.Future[None] | None = None

    def now(self) -> float:
        return self.t

    async def sleep_until(self, t: float) -> None:
        if t <= self.t:
            await asyncio.sleep(0)
            return
        due: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._due, (t, next(self._order), due))
        if self._jumper is None or self._jumper.done():
            self._jumper = asyncio.ensure_future(self._jump())
        await due

    async def sleep(self, dt: float) -> None:
        await self.sleep_until(self.t + dt)

    def drive(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run(coro)

    async def _jump(self) -> None:
        while self._due:
            for _ in range(SETTLE_STEPS):
                await asyncio.sleep(0)
            t, _, due = heapq.heappop(self._due)
            if not due.done():  # a sleeper cancelled meanwhile is not waited for
                self.t = max(self.t, t)
                due.set_result(None)


class NoWire:
    """Connects to every target without a socket: it serves ``model``, every prompt has
    ``prompt_tokens`` tokens; a target named in ``down`` cannot be used (TargetError);
    ``scoring``: its teacher-forced scoring (by default a run must not ask for it)."""

    def __init__(
        self,
        count: int,
        prompt_tokens: int = 100,
        down: frozenset[str] = frozenset(),
        scoring: Callable[[JsonlWriter], Scoring] | None = None,
    ):
        self.count, self.prompt_tokens, self.down = count, prompt_tokens, down
        self.opened: list[str] = []
        self.scoring = scoring

    @asynccontextmanager
    async def open(
        self, run: TargetRun, url: str, server: LocalServer | None
    ) -> AsyncIterator[Connected]:
        self.opened.append(run.spec.name)
        if run.spec.name in self.down:
            raise TargetError(f"{url}: refused (no test server)")
        run.info.update(
            {
                "url": url,
                "problems": [],
                "model_id": "model",
                "cache_config": {},
                "max_model_len": None,
            }
        )
        counts = array("q", [self.prompt_tokens] * self.count)
        arm = TargetSession(run.spec.name, None, counts, None, run.budget, _NoScrapes())  # type: ignore[arg-type]

        async def scoring(writer: JsonlWriter) -> Scoring:
            if self.scoring is None:
                raise AssertionError("no teacher-forced scoring without the wire")
            return self.scoring(writer)

        yield Connected(arm, scoring)


class _NoScrapes:
    async def scrape_once(self) -> None:
        return None


def todo(phase: Phase) -> list[Request]:
    """The requests a phase asks for: a block's or a round's (``only``), else those without a
    final result."""
    reqs: Iterator[Request] = (
        (r for _, r in phase.requests)
        if phase.requests is not None
        else phase.trace.iter_requests()
    )
    if phase.only is not None:
        return [r for r in reqs if r.id in phase.only]
    return [r for r in reqs if r.id not in phase.before_done]


def answer(
    phase: Phase, req: Request, status: str = "ok", counted: bool = True, **fields: Any
) -> Result:
    """One request's result, written and (``counted``: it was sent) counted in its target's
    error budget."""
    now = phase.clock.now()
    res = Result(
        request_id=req.id,
        target=phase.target.name,
        phase=phase.label,
        bucket="<256",
        scheduled=now,
        sent=now,
        status=status,
        **fields,
    )
    if status == "ok":
        res.first_token, res.done, res.output_tokens = now, now, 1
        res.chunk_times, res.chunk_tokens, res.output_text = [now], [1], "x"
    phase.writer.write(res.to_json())
    if counted:
        phase.target.budget.record(res.status, res.error_kind, res.http_status, res.error)
    return res


class Scripted:
    """Answers each request ``ok`` at once, but a target named in ``failing`` answers HTTP 500
    (until its budget is spent: the rest are written as not sent, as a phase does); with
    ``interrupt_after`` it answers that many requests in all, then interrupts the run as
    Ctrl-C does, then answers nothing more."""

    def __init__(self, interrupt_after: int | None = None, failing: frozenset[str] = frozenset()):
        self.interrupt_after, self.failing = interrupt_after, failing
        self.sent: list[tuple[str, str, frozenset[str]]] = []  # target, phase, ids asked
        self.answered = 0

    async def send(self, phase: Phase, run: TargetRun, stop: RunStop) -> dict[str, Any] | None:
        if stop.event.is_set():
            return None
        reqs = todo(phase)
        self.sent.append((phase.target.name, phase.label, frozenset(r.id for r in reqs)))
        start = phase.clock.now()
        for req in reqs:
            if self.interrupt_after is not None and self.answered == self.interrupt_after:
                stop.interrupt()
                return {"start": start, "end": phase.clock.now(), "interrupted": True}
            if phase.target.budget.spent:
                answer(phase, req, "error", False, error_kind="unavailable", error="not sent")
            elif phase.target.name in self.failing:
                answer(phase, req, "error", error_kind="http", http_status=500, error="boom")
            else:
                answer(phase, req)
            self.answered += 1
        resumed = {"resumed": True} if phase.before_done else {}
        return {"start": start, "end": phase.clock.now(), **resumed}


def config(
    run_dir: Path,
    targets: tuple[str, ...] = ("bf16",),
    schedules: tuple[Schedule, ...] = (ClosedLoop(1), ClosedLoop(2)),
    limit: int = 6,
    url: str | None = None,
    **kw: Any,
) -> RunConfig:
    """A run of the sample trace's first ``limit`` requests, each target at ``url`` (by
    default one no test connects to), without teacher-forced scoring."""
    trace = load(TRACE)
    # Without their checks: grading them (a sandbox, a worker process) is not what these
    # tests look at, and would take most of their time.
    trace.requests = [r.model_copy(update={"check": None}) for r in trace.requests[:limit]]
    return run_config(
        trace=trace,
        trace_path=TRACE,
        trace_format="v1",
        targets=[TargetSpec(name=n, url=url or f"http://{n}.invalid") for n in targets],
        schedules=list(schedules),
        quality=QualitySpec(buckets="256,1K", teacher_forced=False),
        run_dir=run_dir,
        **kw,
    )


def unanalysed(run_dir: Path, manifest: Manifest, sources: Sources) -> Summary:
    """The analysis at the end of a run, left out: these tests look at what the runner sent
    and wrote; the analysis has tests of its own (tests/unit/analysis, the golden run), and
    here it would be most of each test's time."""
    return Summary(version=SUMMARY_VERSION, targets={}, run_dir=str(run_dir))
