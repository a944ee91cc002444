"""The worker role: this process's shard of the trace for one test, sent by Locust's users.

A ``Shard`` reads its part of the trace as the file streams past (the other shards'
requests are dropped as they are read), prepares it on the target (bucket counts, the
synthetic-prompt pool, the checkers), hands requests to users once the master says go,
sends each through the core client on the process's asyncio loop, reports it as Locust
request events and ships the results to the master in batches. ``Worker`` holds the shard
of the current test and answers the master's messages.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import traceback
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import aiohttp
import gevent
from gevent.event import Event
from locust.env import Environment

from kvc.bridge import AsyncBridge
from kvc.protocol import MSG_DONE, MSG_READY, MSG_RESULTS, RESULTS_BATCH, STOP_WAIT_S, runner_of
from replay.checkers import Answer, Grader
from replay.core.buckets import Buckets
from replay.core.errors import KvcanaryError
from replay.core.records import Result
from replay.core.schedule import TraceOffsets
from replay.locust.events import check_event, locust_events
from replay.locust.messages import RunPlan
from replay.locust.plans import read_shard
from replay.locust.recorder import cancelled_result
from replay.locust.target import Prepared, prepare, send_one
from replay.run.rundir import file_digest
from replay.serving.client import Client
from replay.traces.importers import stream
from replay.traces.trace import Request

log = logging.getLogger("kvcanary")
NO_PLAN_WAIT_S = 30.0

# Why a shard cannot run that is an outcome of the test, recorded as the target's failure:
# the target or the network (the core wraps most of these in KvcanaryError; a few arrive
# raw), this worker's copy of the trace, or an option. Anything else is a bug in kvcanary.
CANNOT_RUN = (KvcanaryError, OSError, aiohttp.ClientError, TimeoutError)


class LLMFailure(Exception):
    """A failed request or check, as Locust shows it (the message, not the class)."""

    def __repr__(self) -> str:
        return str(self)


@dataclass
class Item:
    seq: int
    req: Request
    pass_no: int
    due: float | None  # trace shape: when it is due, on the run clock


class Shard:
    """This process's part of the trace for one test: prepares it, hands requests to users,
    sends them through the core client and ships the results to the master."""

    def __init__(self, env: Environment, bridge: AsyncBridge, plan: RunPlan) -> None:
        self.env, self.bridge, self.plan = env, bridge, plan
        self.spec = plan.target_spec()
        # The master's epoch (wall clock) on this process's monotonic clock: results of all
        # workers share one time base.
        self.epoch = time.perf_counter() - (time.time() - plan.epoch_wall)
        self.label = plan.first_label
        self.ready, self.go, self.wake = Event(), Event(), Event()
        self.go_at = 0.0
        self.failure: str | None = None
        self.internal: str | None = None  # the traceback of a bug that stopped the shard
        self.prepared: Prepared | None = None
        self.client: Client | None = None
        self.items: list[tuple[int, Request]] = []
        self.offsets: list[float] = []  # each item's due time on the trace's clock
        self.cursor = self.pass_no = self.seq = 0
        self.outstanding: dict[int, Item] = {}
        self.futures: set[concurrent.futures.Future[Result]] = set()
        self.running = 0
        self.pending: list[dict[str, Any]] = []
        self.stopping = self.done = False
        self.grader = Grader()  # live checks, bounded in time and size like the analysis
        self.budget = plan.budget()
        self._prep = gevent.spawn(self._prepare)
        self._sink = gevent.spawn(self._sink_loop)

    def now(self) -> float:
        return time.perf_counter() - self.epoch

    # preparation -----------------------------------------------------------------------
    def _prepare(self) -> None:
        p = self.plan
        try:
            self._read_trace()
            self.prepared = self.bridge.call(
                prepare(self.spec, [r for _, r in self.items], Buckets.parse(p.run.quality.buckets))
            )
            self.client = self.bridge.call(self._make_client(self.prepared.model))
            if p.run.quality.checkers:
                self._warm_checkers()
            log.info(
                "kvcanary: shard %d/%d ready: %d requests", p.shard + 1, p.shards, len(self.items)
            )
        except CANNOT_RUN as exc:
            self._cannot_run(str(exc) if isinstance(exc, KvcanaryError) else repr(exc))
        except Exception as exc:
            # A bug, not the target's failure: the traceback goes to the log and to the master,
            # which stops the test as kvcanary's own error.
            log.exception("kvcanary: shard %d/%d: internal error", p.shard + 1, p.shards)
            self.internal = traceback.format_exc()
            self.failure = f"internal error in kvcanary (not the target's failure): {exc!r}"
        finally:
            self.ready.set()
            if not self.stopping:
                runner_of(self.env).send_message(
                    MSG_READY,
                    {
                        "run": p.run_id,
                        "shard": p.shard,
                        "requests": len(self.items),
                        "failure": self.failure,
                        "internal": self.internal,
                    },
                )

    def _read_trace(self) -> None:
        """This shard's requests and their due offsets, in one streaming pass over the trace
        (which the master has checked: the same file, by its digest)."""
        p = self.plan
        path = Path(p.run.trace.path)
        if not path.is_file():
            raise KvcanaryError(f"{path}: no such trace file on this worker")
        if file_digest(path) != p.run.trace.sha256:
            raise KvcanaryError(
                f"{path} on this worker differs from the master's "
                "(sha256): give every worker the same trace"
            )
        requests = stream(path)
        try:
            shard = read_shard(islice(requests, p.limit or None), p.shard, p.shards)
        finally:
            requests.close()  # a limit stops the stream early: the file is closed now
        self.items = shard.items
        times = [r.t for _, r in shard.items]
        try:
            self.offsets = list(TraceOffsets(lambda: times, shard.t0, p.time_scale))
        except ValueError as exc:  # --kvc-time-scale: the master checks it in the trace shape only
            raise KvcanaryError(repr(exc)) from exc

    def _cannot_run(self, reason: str) -> None:
        p = self.plan
        self.failure = reason
        log.error("kvcanary: shard %d/%d cannot run: %s", p.shard + 1, p.shards, reason)
        if not self.stopping:  # in the web UI's Failures tab too
            self.env.events.request.fire(
                request_type="LLM",
                name="prepare target",
                response_time=0,
                response_length=0,
                context={},
                exception=LLMFailure(reason),
            )

    def _warm_checkers(self) -> None:
        """Grade a blank answer once per checker kind before the go: first use imports
        modules (and the code checker starts its sandbox), which would otherwise stall the
        hub, and with it the timestamps of requests in flight, mid-run. (A checker that
        cannot grade gives a failed grade, by the Grader's contract: nothing to catch.)"""
        kinds: dict[str, Request] = {}
        for _, req in self.items:
            if req.check is not None:
                kinds.setdefault(str(req.check.get("type")), req)
        for req in kinds.values():
            self.grader.grade(req.check or {}, Answer("", ()))

    async def _make_client(self, model: str) -> Client:
        # A client's connections belong to a loop: the client is made inside ours.
        return Client(
            self.spec.connect_url or "",
            model,
            headers=self.spec.auth_headers(),
            timeout_s=self.plan.run.load.timeout_s,
            seed=self.plan.run.load.seed,
            epoch=self.epoch,
        )

    def start(self, label: str) -> None:
        """The master's phase message; the first one is the go signal."""
        self.label = label
        if not self.go.is_set():
            self.go_at = self.now()
            self.go.set()

    # users -----------------------------------------------------------------------------
    def take(self) -> Item | None:
        """The next request for a user (waits for preparation and the go); None when the
        shard is exhausted or the test is stopping."""
        self.ready.wait()
        self.go.wait()
        if self.stopping or self.failure is not None:
            return None
        if self.cursor >= len(self.items):
            if not self.plan.run.load.loop or not self.items:
                return None
            self.cursor, self.pass_no = 0, self.pass_no + 1
        _, req = self.items[self.cursor]
        offset = self.offsets[self.cursor]
        self.cursor += 1
        due = self.go_at + offset if self.plan.mode == "trace" else None
        item = Item(self.seq, req, self.pass_no, due)
        self.seq += 1
        self.outstanding[item.seq] = item
        return item

    def send(self, item: Item) -> Result | None:
        """Send one request (at its due time in the trace shape); None if the test stopped
        first (the stop records it)."""
        if item.due is not None:
            delay = item.due - self.now()
            if delay > 0:
                gevent.sleep(delay)
        backoff = self.budget.delay()  # the target does not answer: no busy loop on it
        if backoff:
            gevent.sleep(backoff)
        if self.stopping or self.budget.spent:
            return None  # still outstanding: the stop records it as not sent
        scheduled = item.due if item.due is not None else self.now()
        fut = self.bridge.submit(self._send(item, scheduled, self.label))
        self.futures.add(fut)
        fut.add_done_callback(self.futures.discard)
        try:
            return self.bridge.wait(fut)
        except concurrent.futures.CancelledError:
            return None

    async def _send(self, item: Item, scheduled: float, label: str) -> Result:
        assert self.client is not None and self.prepared is not None
        res = self.prepared.new_result(item.req, self.spec.name, label, scheduled)
        self.running += 1
        try:
            return await send_one(
                self.client,
                item.req,
                res,
                self.prepared,
                self.plan.salt(self.spec.name, label, item.pass_no),
            )
        finally:
            self.running -= 1
            self._record(item.seq, res)

    def _record(self, seq: int, res: Result) -> None:
        self.outstanding.pop(seq, None)
        self.pending.append(res.to_json())
        self.wake.set()
        was_spent = self.budget.spent
        self.budget.record(res.status, res.error_kind, res.http_status, res.error)
        if self.budget.spent and not was_spent:
            # Runs on the asyncio loop: the stop (which waits) goes to a greenlet.
            gevent.spawn(self._budget_stop)

    def _budget_stop(self) -> None:
        if self.stopping or self.done:
            return
        reason = f"error budget spent: {self.budget.reason}"
        log.error("kvcanary: shard %d/%d: %s", self.plan.shard + 1, self.plan.shards, reason)
        self.failure = reason
        self.stop("unavailable", f"not sent: {reason}")

    def report(self, item: Item, res: Result) -> None:
        """The result as Locust request events (and the checker's verdict)."""
        fire = self.env.events.request.fire
        ctx = {"request_id": res.request_id, "phase": res.phase, "target": res.target}
        for ev in locust_events(res, self.plan.itl_events):
            fire(
                request_type=ev.request_type,
                name=ev.name,
                response_time=ev.response_time,
                response_length=ev.response_length,
                context=ctx,
                exception=LLMFailure(ev.error) if ev.error else None,
            )
        if self.plan.run.quality.checkers:
            checked = check_event(res, item.req, self.grader)
            if checked is not None:
                fire(
                    request_type=checked.request_type,
                    name=checked.name,
                    response_time=0,
                    response_length=0,
                    context=ctx,
                    exception=LLMFailure(checked.error) if checked.error else None,
                )

    # results to the master ---------------------------------------------------------------
    def _sink_loop(self) -> None:
        while not self.done:
            self.wake.wait(timeout=0.5)
            self.wake.clear()
            self._flush()
            if self._exhausted():
                self._finish(stopped=False)

    def _exhausted(self) -> bool:
        if not self.ready.is_set() or self.done:
            return False
        if self.failure is not None:
            return True
        return (
            not self.plan.run.load.loop and self.cursor >= len(self.items) and not self.outstanding
        )

    def _flush(self) -> None:
        while self.pending:
            batch, self.pending = self.pending[:RESULTS_BATCH], self.pending[RESULTS_BATCH:]
            runner_of(self.env).send_message(
                MSG_RESULTS, {"run": self.plan.run_id, "shard": self.plan.shard, "rows": batch}
            )

    def _finish(self, stopped: bool) -> None:
        if self.done:
            return
        if self.internal is not None:
            self._record_unsent("cancelled", f"not sent: {self.failure}")
        elif self.failure is not None:
            self._record_unsent("unavailable", f"target unavailable: {self.failure}")
        self._flush()
        self.done = True
        runner_of(self.env).send_message(
            MSG_DONE,
            {
                "run": self.plan.run_id,
                "shard": self.plan.shard,
                "stopped": stopped,
                "failure": self.failure,
            },
        )
        self.wake.set()

    def _record_unsent(self, kind: str, reason: str) -> None:
        at = self.now()
        buckets = self.prepared.buckets if self.prepared else {}
        left = list(self.outstanding.values())
        self.outstanding.clear()
        rows = [
            cancelled_result(
                it.req,
                self.spec.name,
                self.label,
                buckets.get(it.req.id, "unknown"),
                it.due if it.due is not None else at,
                kind,
                reason,
            )
            for it in left
        ]
        if not self.plan.run.load.loop:
            rows += [
                cancelled_result(
                    req,
                    self.spec.name,
                    self.label,
                    buckets.get(req.id, "unknown"),
                    at,
                    kind,
                    reason,
                )
                for _, req in self.items[self.cursor :]
            ]
            self.cursor = len(self.items)
        self.pending += [r.to_json() for r in rows]

    def stop(self, kind: str, reason: str) -> None:
        """The test stops: cancel what is in flight, record what was not sent, report done."""
        if self.done:
            return
        self.stopping = True
        if not self.ready.is_set():
            self._prep.kill()
            self.ready.set()
        self.go.set()
        in_flight = list(self.futures)
        for fut in in_flight:
            fut.cancel()
        deadline = time.monotonic() + STOP_WAIT_S
        while self.running and time.monotonic() < deadline:
            gevent.sleep(0.05)
        unsent = len(self.outstanding) + (
            0 if self.plan.run.load.loop else len(self.items) - self.cursor
        )
        log.info(
            "kvcanary: shard %d/%d stopping: %d in flight cancelled, %d not sent (%s)",
            self.plan.shard + 1,
            self.plan.shards,
            len(in_flight),
            unsent,
            kind,
        )
        self._record_unsent(kind, reason)
        self._finish(stopped=True)

    def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            try:
                self.bridge.call(client.close(), timeout=5)
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass  # the process is going away: a session that does not close cleanly is moot
        self.grader.close()


class Worker:
    """The worker role of this process (a worker, or a standalone process): the shard of the
    current test, the master's messages to it, and the users' steps."""

    def __init__(self, env: Environment, bridge: AsyncBridge) -> None:
        self.env, self.bridge = env, bridge
        self.shard: Shard | None = None
        self.planned = Event()  # the first plan has come

    def on_plan(self, environment: Environment, msg: Any, **_: Any) -> None:
        old = self.shard
        if old is not None and not old.done:
            old.stop("cancelled", "not sent: a new test started")
        plan = RunPlan.from_msg(msg.data)
        self.shard = Shard(environment, self.bridge, plan)
        self.planned.set()
        log.info(
            "kvcanary: plan for shard %d/%d (run %s)", plan.shard + 1, plan.shards, plan.run_id
        )

    def on_phase(self, environment: Environment, msg: Any, **_: Any) -> None:
        if self.shard is not None:
            self.shard.start(str(msg.data["label"]))

    def on_stop(self, environment: Environment, msg: Any, **_: Any) -> None:
        self.stop_shard(str(msg.data["kind"]), str(msg.data["reason"]))

    def stop_shard(self, kind: str, reason: str) -> None:
        if self.shard is not None and not self.shard.done:
            self.shard.stop(kind, reason)

    def close(self) -> None:
        if self.shard is not None:
            self.shard.close()

    def user_step(self) -> bool:
        """One task iteration of a user: take a request, send it, report it. False: this
        user has nothing more to do (shard exhausted, test stopping, or no plan came)."""
        if self.shard is None and not self.planned.wait(timeout=NO_PLAN_WAIT_S):
            log.warning(
                "kvcanary: no plan from the master (did this worker join after the "
                "test started?); this user stops"
            )
            return False
        shard = self.shard
        assert shard is not None
        item = shard.take()
        if item is None:
            return False
        res = shard.send(item)
        if res is not None:
            shard.report(item, res)
        return True
