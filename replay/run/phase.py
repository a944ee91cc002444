"""One phase of one target: the schedule sends the trace's requests, every result is written as
it completes, and every request is accounted for, sent or not.

The schedule pulls requests from the file as it sends them, so a phase holds only what is in
flight. It stops on an interrupt (the run's ``stopping``), on the target's spent error budget,
or at the phase time limit; what a time limit or a spent budget leaves unsent is written as
results too, while after an interrupt it is left for ``--resume`` to send."""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from replay.core.buckets import Buckets
from replay.core.event_loop import heap_frozen
from replay.core.iterate import closing
from replay.core.records import Result
from replay.core.schedule import Clock, ClosedLoop, OpenLoop
from replay.core.shards import AnyShard
from replay.run.budget import ErrorBudget
from replay.run.progress import Progress
from replay.run.session_turns import Sessions, SessionTurns, TurnContext
from replay.rundir.files import JsonlWriter
from replay.serving.client import Client
from replay.serving.metrics import MetricsSnapshot
from replay.serving.prompt_tokens import UNKNOWN, known_count
from replay.traces.sessions import Unit, common_prefix, units
from replay.traces.synth import TokenPool, synthesize
from replay.traces.trace import Request, TraceSource

Schedule = ClosedLoop | OpenLoop

SETTLE_S = 2.0  # the longest a phase's edge waits for the server's figures to settle
SETTLE_POLL_S = 0.02


class EdgeScraper(Protocol):
    """What a phase asks of /metrics: one scrape at each of its edges (a load process of
    ``--workers`` scrapes nothing: its parent does, around all of them)."""

    async def scrape_once(self) -> MetricsSnapshot | None: ...


async def scrape_idle(scraper: EdgeScraper) -> MetricsSnapshot | None:
    """A phase's first edge: once the server runs and queues nothing (at most ``SETTLE_S``),
    so that what it finishes from here on is the phase's own."""
    return await _scrape_until(
        scraper, lambda s: not s.values.get("running") and not s.values.get("waiting")
    )


async def scrape_caught_up(
    scraper: EdgeScraper, before: MetricsSnapshot | None, answered: int
) -> MetricsSnapshot | None:
    """A phase's last edge: once the server has counted every request the phase got a whole
    answer to (at most ``SETTLE_S``). vLLM records a finished request's figures after its
    last chunk may already have reached us, and a scrape just then would leave it out."""

    def finished(s: MetricsSnapshot | None) -> float | None:
        return s.histograms["e2e"]["count"] if s is not None and "e2e" in s.histograms else None

    first = finished(before)
    return await _scrape_until(
        scraper, lambda s: first is None or (finished(s) or 0.0) - first >= answered
    )


async def _scrape_until(
    scraper: EdgeScraper, settled: Callable[[MetricsSnapshot], bool]
) -> MetricsSnapshot | None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_S
    while True:
        snap = await scraper.scrape_once()
        if snap is None or settled(snap) or loop.time() >= deadline:
            return snap
        await asyncio.sleep(SETTLE_POLL_S)


@dataclass
class TargetSession:
    """What every phase of one target shares: its client, its prompt lengths (by trace
    position), the token pool of synthetic prompts and its error budget."""

    name: str
    client: Client
    counts: array[int]
    pool: TokenPool | None
    budget: ErrorBudget
    scraper: EdgeScraper
    # The target's context (/v1/models): a prompt that fills it is not sent (no room to answer).
    max_model_len: int | None = None


@dataclass
class Phase:
    target: TargetSession
    sched: Schedule
    trace: TraceSource
    buckets: Buckets
    writer: JsonlWriter
    progress: Progress
    clock: Clock
    stopping: asyncio.Event  # the run's interrupt
    timeout_s: float
    salt: str | None
    before_done: set[str] = field(default_factory=set)  # resume: ids with a final result
    # Only these ids (a sequential canary's round); None: every id not in ``before_done``.
    only: set[str] | None = None
    # The requests to pick from, with their trace positions (a block of an interleaved phase,
    # which holds them already); None: the trace, read again.
    requests: list[tuple[int, Request]] | None = None
    # The trace's sessions (None: it has none, and requests stream one by one).
    sessions: Sessions | None = None
    # A load process's share of the phase (``--workers``); None: all of it.
    shard: AnyShard | None = None
    # pulled from the trace and not finished: at most what is in flight, plus one waiting
    pending: dict[int, Request] = field(default_factory=dict)
    answered: int = 0  # requests with a whole answer ("ok"): the server has finished them
    halt: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def label(self) -> str:
        return self.sched.label

    def bucket(self, i: int) -> str:
        n = self.target.counts[i]
        return self.buckets.label(n) if n != UNKNOWN else "unknown"

    async def run(self) -> dict[str, Any] | None:
        """Send the phase; its window (start, end, flags) for the manifest, or None when there
        is nothing to send (resumed complete, or the run is being interrupted)."""
        total = (
            len(self.only) if self.only is not None else self.trace.count - len(self.before_done)
        )
        if total <= 0 or self.stopping.is_set():
            return None
        if self.target.budget.spent:  # in an earlier phase: this one sends nothing
            self.halt.set()
        relay = asyncio.ensure_future(self.stopping.wait())
        relay.add_done_callback(lambda f: None if f.cancelled() else self.halt.set())
        self.progress.phase(self.target.name, self.label, total)
        scraper = self.target.scraper
        given = self.requests
        with closing(self.trace.iter_requests() if given is None else iter(())) as reqs:
            pairs = enumerate(reqs) if given is None else iter(given)
            todo = ((i, r) for i, r in pairs if self._wanted(r.id))
            # A session's turns are one item: the schedule sends it, its turns follow in order.
            items: Iterator[Unit] = (
                units(todo) if self.sessions is not None else ([t] for t in todo)
            )
            if self.shard is not None:
                items = self.shard.take(items)
            # Scrapes at the phase's edges make server-side deltas cover exactly this phase.
            before = await scrape_idle(scraper)
            start = before.t if before is not None else self.clock.now()
            try:
                with heap_frozen():
                    await asyncio.wait_for(
                        self.sched.run(self._pulled(items), self._send, self.clock, self.halt),
                        self.timeout_s,
                    )
            except TimeoutError:
                pass
            finally:
                relay.cancel()
            after = await scrape_caught_up(scraper, before, self.answered)
            end = after.t if after is not None else self.clock.now()
            if not self.stopping.is_set():
                self._account_unsent((t for unit in items for t in unit), end)
        return {
            "start": start,
            "end": end,
            **({"resumed": True} if self.before_done else {}),
            **({"interrupted": True} if self.stopping.is_set() else {}),
        }

    def _wanted(self, request_id: str) -> bool:
        if self.only is not None:
            return request_id in self.only
        return request_id not in self.before_done

    def _pulled(self, items: Iterator[Unit]) -> Iterator[Unit]:
        for unit in items:
            for i, req in unit:
                self.pending[i] = req
            yield unit

    async def _send(self, unit: Unit, scheduled: float) -> None:
        """One request, or a session's turns in order: each once the previous one finished
        and the think time passed (its own ``scheduled`` is then)."""
        if len(unit) == 1 and self.sessions is None:
            await self._send_one(*unit[0], scheduled)
            return
        assert self.sessions is not None
        turns = SessionTurns(self.sessions, self.label)
        for k, (i, req) in enumerate(unit):
            if k:
                await _pause(self.sessions.think.between(unit[k - 1][1], req), self.halt)
                scheduled = self.clock.now()
            if self.halt.is_set():
                return  # this turn and the later ones stay in ``pending``: not sent
            sent = turns.request(k, req)
            if sent is None:
                self._unavailable(unit[k:], f"not sent: {turns.why_not}", scheduled)
                return
            res = await self._send_one(i, sent, scheduled, turns.context(k))
            if res is None:
                return
            turns.answered(k, req, res)

    async def _send_one(
        self, i: int, req: Request, scheduled: float, turn: TurnContext | None = None
    ) -> Result | None:
        t, budget = self.target, self.target.budget
        # Backoff while the target does not answer; then it is stopped, not spun on.
        wait = budget.delay()
        if wait:
            await _pause(wait, self.halt)
        if self.halt.is_set():
            return None  # left in ``pending``: recorded after the phase as not sent
        res = Result(
            request_id=req.id,
            target=t.name,
            phase=self.label,
            bucket=self.bucket(i),
            scheduled=scheduled,
            prompt_tokens=known_count(t.counts[i]),
        )
        if turn is not None:
            res.session, res.turn = turn.session, turn.number
        if (why := does_not_fit(res.prompt_tokens, t.max_model_len)) is not None:
            # Known before sending: a 400 from the server would be charged to its budget.
            res.status, res.error_kind, res.error = "skipped", "too_long", why
            self.writer.write(res.to_json())
            self.pending.pop(i, None)
            self.progress.advance(t.name, self.label, False)
            return res
        ids = synthesize(req, t.pool) if req.synth is not None and t.pool is not None else None
        try:
            await t.client.send(req, res, ids, self.salt)
        finally:
            if turn is not None and turn.previous_ids is not None and res.prompt_ids:
                res.reused_prefix_tokens = common_prefix(turn.previous_ids, res.prompt_ids)
            self.writer.write(res.to_json())
            self.pending.pop(i, None)
            self.answered += res.status == "ok"
            self.progress.advance(t.name, self.label, res.status == "ok")
            budget.record(res.status, res.error_kind, res.http_status, res.error)
            if budget.spent:
                self.halt.set()
        return res

    def _unavailable(self, turns: Unit, reason: str, at: float) -> None:
        """Later turns of a session that cannot be built: results too, each one final."""
        for i, req in turns:
            self.pending.pop(i, None)
            res = Result(
                request_id=req.id,
                target=self.target.name,
                phase=self.label,
                bucket=self.bucket(i),
                scheduled=at,
                status="error",
                error_kind="unavailable",
                error=reason,
            )
            self.writer.write(res.to_json())
            self.progress.advance(self.target.name, self.label, False)

    def _account_unsent(self, todo: Iterator[tuple[int, Request]], at: float) -> None:
        """Requests the phase never sent (time limit, spent budget) are results too."""
        unsent = sorted(self.pending.items())
        self.pending.clear()
        for i, req in [*unsent, *todo]:
            self.writer.write(self._not_sent(req, self.bucket(i), at))

    def _not_sent(self, req: Request, bucket: str, at: float) -> dict[str, Any]:
        """The target's error budget was spent (final: the target failed), or the phase ran
        out of time (cancelled)."""
        budget = self.target.budget
        res = Result(
            request_id=req.id,
            target=self.target.name,
            phase=self.label,
            bucket=bucket,
            scheduled=at,
        )
        if budget.spent:
            res.status, res.error_kind = "error", "unavailable"
            res.error = f"not sent: {budget.reason}"
        else:
            res.status, res.error_kind = "cancelled", "cancelled"
            res.error = f"not sent: phase time limit {self.timeout_s:g} s"
        return res.to_json()


def does_not_fit(prompt_tokens: int | None, max_model_len: int | None) -> str | None:
    """Why a prompt of ``prompt_tokens`` cannot be sent to a model of ``max_model_len``
    tokens, or None when it can (or either is unknown). vLLM refuses a longer prompt with a
    400 and gives one of exactly that length no room for a single output token."""
    if prompt_tokens is None or max_model_len is None or prompt_tokens < max_model_len:
        return None
    return (
        f"not sent: its prompt of {prompt_tokens:,} tokens does not fit the target's "
        f"max_model_len of {max_model_len:,} (no room for an answer)"
    )


async def _pause(seconds: float, halt: asyncio.Event) -> None:
    """Sleep, or less when ``halt`` is set meanwhile."""
    try:
        await asyncio.wait_for(halt.wait(), seconds)
    except TimeoutError:
        pass
