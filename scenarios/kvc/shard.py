"""This process's shard of the trace for one test, sent by Locust's users.

A ``Shard`` reads its part of the trace as the file streams past (the other shards'
requests are dropped as they are read), prepares it on the target (bucket counts, the
synthetic-prompt pool, the checkers), hands requests to users once the master says go and
has granted their claims (``kvc.lease``), sends each through the core client on the
process's asyncio loop, reports it as Locust request events and ships the results to the
master (``kvc.outbox``). Requests a lost worker never claimed may be re-assigned to it
(``adopt``): read from the trace, prepared the same way, and sent after its own.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import traceback
from collections.abc import Sequence
from itertools import islice
from pathlib import Path

import aiohttp
import gevent
from gevent.event import Event
from locust.env import Environment

from kvc.bridge import AsyncBridge
from kvc.lease import LEASE_AHEAD_S, MIN_LEASE, Item, Lease, read_positions
from kvc.outbox import Outbox
from kvc.protocol import MSG_CLAIM, MSG_READY, STOP_WAIT_S, runner_of
from replay.checkers import Answer, Grader
from replay.core.buckets import Buckets
from replay.core.errors import KvcanaryError
from replay.core.records import Result
from replay.core.schedule import TraceOffsets
from replay.locust.events import check_event, locust_events
from replay.locust.messages import RunPlan
from replay.locust.plans import read_shard
from replay.locust.recorder import cancelled_result
from replay.locust.target import Prepared, prepare, prepare_more, send_one
from replay.rundir.files import file_digest
from replay.serving.client import Client
from replay.traces.importers import stream
from replay.traces.trace import Request

log = logging.getLogger("kvcanary")
IDLE_WAIT_S = 0.5  # a user with nothing granted looks again at least this often
CLAIM_RETRY_S = 5.0  # a claim the master has not answered in this long is sent again

# Why a shard cannot run that is an outcome of the test, recorded as the target's failure:
# the target or the network (the core wraps most of these in KvcanaryError; a few arrive
# raw), this worker's copy of the trace, or an option. Anything else is a bug in kvcanary.
CANNOT_RUN = (KvcanaryError, OSError, aiohttp.ClientError, TimeoutError)


class LLMFailure(Exception):
    """A failed request or check, as Locust shows it (the message, not the class)."""

    def __repr__(self) -> str:
        return str(self)


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
        self.lease = Lease([], [], plan.run.load.loop, plan.mode == "trace")
        self.t0 = 0.0  # the trace clock's zero (the whole trace's first timestamp)
        self.outstanding: dict[int, Item] = {}  # taken by a user, no result yet
        # Taken by a user and not yet reported to Locust: the result reaches the outbox on the
        # asyncio loop before the user fires its events, and the shard is not done until then
        # (Locust's statistics count every result the run directory has).
        self.in_hand = 0
        self.futures: set[concurrent.futures.Future[Result]] = set()
        self.running = 0
        self.outbox = Outbox(env, plan)
        self.stopping = self.done = False
        self.inbox: list[list[int]] = []  # re-assignments to take in, in the master's order
        self.adoptions = 0  # re-assignments in the list
        self.grader = Grader()  # live checks, bounded in time and size like the analysis
        self.budget = plan.budget()
        self._adopter: gevent.Greenlet | None = None
        self._claimed_at = 0.0  # when the claim being answered was sent
        self._prep = gevent.spawn(self._prepare)
        self._sink = gevent.spawn(self._sink_loop)

    def now(self) -> float:
        return time.perf_counter() - self.epoch

    @property
    def name(self) -> str:
        return f"shard {self.plan.shard + 1}/{self.plan.shards}"

    # preparation -----------------------------------------------------------------------
    def _prepare(self) -> None:
        p = self.plan
        try:
            self._read_trace()
            reqs = [r for _, r in self.lease.items]
            self.prepared = self.bridge.call(
                prepare(self.spec, reqs, Buckets.parse(p.run.quality.buckets))
            )
            self.client = self.bridge.call(self._make_client(self.prepared.model))
            if p.run.quality.checkers:
                self._warm_checkers(reqs)
            log.info("kvcanary: %s ready: %d requests", self.name, len(reqs))
        except CANNOT_RUN as exc:
            self._cannot_run(str(exc) if isinstance(exc, KvcanaryError) else repr(exc))
        except Exception as exc:
            self._internal(exc)
        finally:
            self.ready.set()
            if not self.stopping:
                runner_of(self.env).send_message(
                    MSG_READY,
                    {
                        "run": p.run_id,
                        "shard": p.shard,
                        "requests": len(self.lease.items),
                        "failure": self.failure,
                        "internal": self.internal,
                        "info": self.prepared.info if self.prepared else None,
                    },
                )

    def _internal(self, exc: Exception) -> None:
        """A bug, not the target's failure: the traceback goes to the log and to the master,
        which stops the test as kvcanary's own error."""
        log.exception("kvcanary: %s: internal error", self.name)
        self.internal = traceback.format_exc()
        self.failure = f"internal error in kvcanary (not the target's failure): {exc!r}"

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
        self.t0 = shard.t0
        self.lease.extend(shard.items, self._offsets([r for _, r in shard.items]))

    def _offsets(self, reqs: Sequence[Request]) -> list[float]:
        times = [r.t for r in reqs]
        try:
            return list(TraceOffsets(lambda: times, self.t0, self.plan.time_scale))
        except ValueError as exc:  # --kvc-time-scale: the master checks it in the trace shape only
            raise KvcanaryError(repr(exc)) from exc

    def _cannot_run(self, reason: str) -> None:
        self.failure = reason
        log.error("kvcanary: %s cannot run: %s", self.name, reason)
        if not self.stopping:  # in the web UI's Failures tab too
            self.env.events.request.fire(
                request_type="LLM",
                name="prepare target",
                response_time=0,
                response_length=0,
                context={},
                exception=LLMFailure(reason),
            )

    def _warm_checkers(self, reqs: Sequence[Request]) -> None:
        """Grade a blank answer once per checker kind before the go: first use imports
        modules (and the code checker starts its sandbox), which would otherwise stall the
        hub, and with it the timestamps of requests in flight, mid-run. (A checker that
        cannot grade gives a failed grade, by the Grader's contract: nothing to catch.)"""
        kinds: dict[str, Request] = {}
        for req in reqs:
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
            self.lease.pulse()

    # requests taken over from a lost worker ------------------------------------------------
    def adopt(self, positions: list[int], origin: int) -> None:
        """The master re-assigns a lost worker's unsent requests: taken in, in order, by one
        greenlet (each message's requests follow the previous one's, as the master's ledger
        lists them)."""
        self.inbox.append(positions)
        log.warning(
            "kvcanary: %s takes over %d request(s) of lost shard %d",
            self.name,
            len(positions),
            origin + 1,
        )
        if self._adopter is None or self._adopter.dead:
            self._adopter = gevent.spawn(self._adopt_loop)

    def _adopt_loop(self) -> None:
        self.ready.wait()
        while self.inbox:
            positions = self.inbox[0]
            got: list[tuple[int, Request]] = []
            try:
                got = read_positions(Path(self.plan.run.trace.path), self.plan.limit, positions)
                reqs = [r for _, r in got]
                if self.prepared is not None and not self.stopping:
                    buckets = Buckets.parse(self.plan.run.quality.buckets)
                    self.bridge.call(prepare_more(self.spec, self.prepared, reqs, buckets))
                offsets = self._offsets(reqs)
            except CANNOT_RUN as exc:
                self._cannot_run(str(exc) if isinstance(exc, KvcanaryError) else repr(exc))
                offsets = [0.0] * len(got)
            except Exception as exc:
                self._internal(exc)
                offsets = [0.0] * len(got)
            # Always in the list, sendable or not: the shard's end accounts for each of them.
            self.lease.extend(got, offsets)
            self.inbox.pop(0)
            self.adoptions += 1
            if self.stopping:
                if self.done:  # the stop has reported: these are recorded as not sent too
                    self.done = False
                    self._record_unsent("cancelled", "not sent: the test stopped")
                    self._finish(stopped=True)
            elif self.done:  # it had finished its own: it reports again after these
                self.done = False
                self._sink = gevent.spawn(self._sink_loop)
            self.wake.set()

    # users -----------------------------------------------------------------------------
    def take(self) -> Item | None:
        """The next request for a user, once granted (waits for preparation and the go);
        None when the test is stopping or the shard cannot run. A user whose shard has
        nothing left waits: a lost worker's requests may still come its way."""
        self.ready.wait()
        self.go.wait()
        while not self.stopping and self.failure is None and not self.budget.spent:
            item = self.lease.pop()
            if item is not None:
                self.outstanding[item.seq] = item
                self.in_hand += 1
                self._top_up()
                return item
            self._top_up()
            self.lease.wait(self._idle_wait())
        return None

    def _idle_wait(self) -> float:
        due = self.lease.next_due(self.go_at)
        if due is None:
            return IDLE_WAIT_S
        return min(IDLE_WAIT_S, max(0.005, due - LEASE_AHEAD_S - self.now()))

    def _top_up(self) -> None:
        """Claim the next requests, a window ahead of the users (one claim at a time; one
        unanswered for ``CLAIM_RETRY_S`` is sent again: Locust may have reset the connection
        and lost it or its answer)."""
        lease = self.lease
        if lease.revoked or self.stopping or self.failure is not None:
            return
        if lease.claiming:
            if self.now() - self._claimed_at > CLAIM_RETRY_S:
                self._claim(list(lease.claiming.values()))
            return
        want = max(MIN_LEASE, runner_of(self.env).user_count) - len(lease.leased)
        horizon = self.now() + LEASE_AHEAD_S if lease.timed else None
        items = lease.claims(want, self.go_at, horizon) if want > 0 else []
        if items:
            self._claim(items)

    def _claim(self, items: Sequence[Item]) -> None:
        self._claimed_at = self.now()
        buckets = self.prepared.buckets if self.prepared else {}
        claims = [[it.seq, it.position, buckets.get(it.req.id, "unknown")] for it in items]
        runner_of(self.env).send_message(
            MSG_CLAIM, {"run": self.plan.run_id, "shard": self.plan.shard, "claims": claims}
        )

    def granted(self, seqs: Sequence[int], revoked: bool) -> None:
        """The master's answer to a claim."""
        if revoked:
            log.warning(
                "kvcanary: %s: the master gave this worker up (it was cut off too long); "
                "its unclaimed requests went to others, it sends only what it was granted",
                self.name,
            )
            self.lease.revoke()
            self.wake.set()
        else:
            self.lease.granted(seqs)

    def serve(self, item: Item) -> None:
        """Send a request ``take`` handed out and report its result (if the test did not
        stop first)."""
        try:
            res = self.send(item)
            if res is not None:
                self.report(item, res)
        finally:
            self.in_hand -= 1
            self.wake.set()

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
        self.outbox.add(res.to_json(), seq)
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
        log.error("kvcanary: %s: %s", self.name, reason)
        self.failure = reason
        self.stop("unavailable", f"not sent: {reason}")

    def report(self, item: Item, res: Result) -> None:
        """The result as Locust request events (and the checker's verdict)."""
        fire = self.env.events.request.fire
        ctx = {"request_id": res.request_id, "phase": res.phase, "target": res.target}
        events = locust_events(res, self.plan.itl_events)
        if self.plan.run.quality.checkers:
            checked = check_event(res, item.req, self.grader)
            events += [checked] if checked is not None else []
        for ev in events:
            fire(
                request_type=ev.request_type,
                name=ev.name,
                response_time=ev.response_time,
                response_length=ev.response_length,
                context=ctx,
                exception=LLMFailure(ev.error) if ev.error else None,
            )

    # results to the master ---------------------------------------------------------------
    def _sink_loop(self) -> None:
        while not self.done:
            self.wake.wait(timeout=0.5)
            self.wake.clear()
            self.outbox.flush()
            if self._exhausted():
                self._finish(stopped=False)

    def _exhausted(self) -> bool:
        if not self.ready.is_set() or self.done or self.inbox:
            return False
        if self.failure is not None:
            return True
        return self.lease.idle() and not self.outstanding and not self.in_hand

    def _finish(self, stopped: bool) -> None:
        if self.done:
            return
        if self.internal is not None:
            self._record_unsent("cancelled", f"not sent: {self.failure}")
        elif self.failure is not None:
            self._record_unsent("unavailable", f"target unavailable: {self.failure}")
        self.done = True
        self.outbox.done(stopped, self.failure, self.adoptions)
        self.lease.pulse()
        self.wake.set()

    def _record_unsent(self, kind: str, reason: str) -> None:
        at = self.now()
        buckets = self.prepared.buckets if self.prepared else {}
        claimed, rest = self.lease.unsent()
        left = [*self.outstanding.values(), *claimed]
        self.outstanding.clear()
        for it in left:
            bucket = buckets.get(it.req.id, "unknown")
            due = it.due if it.due is not None else at
            row = cancelled_result(it.req, self.spec.name, self.label, bucket, due, kind, reason)
            self.outbox.add(row.to_json(), it.seq)
        for _, req in rest:
            bucket = buckets.get(req.id, "unknown")
            row = cancelled_result(req, self.spec.name, self.label, bucket, at, kind, reason)
            self.outbox.add(row.to_json(), None)

    def stop(self, kind: str, reason: str) -> None:
        """The test stops: cancel what is in flight, record what was not sent, report done."""
        if self.done and not self.inbox:
            return
        self.stopping = True
        if not self.ready.is_set():
            self._prep.kill()
            self.ready.set()
        self.go.set()
        self.lease.pulse()
        in_flight = list(self.futures)
        for fut in in_flight:
            fut.cancel()
        deadline = time.monotonic() + STOP_WAIT_S
        while (self.running or self.inbox) and time.monotonic() < deadline:
            gevent.sleep(0.05)  # the adopter takes in what is on its way, to record it too
        log.info(
            "kvcanary: %s stopping: %d in flight cancelled, the unsent recorded (%s)",
            self.name,
            len(in_flight),
            kind,
        )
        self.done = False  # one last report, with everything recorded
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
