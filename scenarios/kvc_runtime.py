"""The machinery behind ``locustfile.py``: kvcanary's replay core driven from Locust.

How kvcanary's concepts map onto Locust's
-----------------------------------------
* A trace request is one task iteration of a Locust user. A user sends one request at a time,
  so Locust's user count is the concurrency (a closed loop, ``replay --concurrency N``); in
  the trace-timestamp shape each user sends its next request at the request's due time and
  the user count caps the requests in flight (``--trace-times --max-in-flight``).
* A phase is a load level: the shapes (``kvc_shapes.py``) name each level ``c<N>`` (or
  ``trace-x<scale>``), exactly as ``replay`` names its schedules, and results carry it.
* A result (``replay.core.records.Result``) is reported as Locust request events per context
  bucket: ``ttft <b>``, ``itl <b>``, ``e2e <b>``, ``output_tokens <b>`` and, with checkers
  on, ``check <b>`` (see ``replay.locust.support.locust_events``). Locust's own statistics,
  charts, CSV and distributed stats merging work on those unchanged.
* The run directory is ``replay``'s: results go to the master (Locust messages), which writes
  ``results.jsonl`` as they arrive and ``manifest.json``/``summary.json``/``grades.jsonl``
  when the test stops, so ``replay report RUN_DIR`` renders a Locust run.

Async core under gevent
-----------------------
The core client is asyncio/aiohttp; Locust users are greenlets. Each Locust process runs ONE
asyncio event loop in a greenlet (``AsyncBridge``): gevent's monkey-patched selector makes the
loop's waits cooperative, so the loop shares the hub with Locust's users instead of blocking
it, and no thread is involved (no cross-thread wake-ups, no GIL contention with a second
thread, and DNS goes through gevent's resolver). A user submits its request to the loop and
waits on a gevent ``AsyncResult``. Timings are the core client's, taken inside the loop as
each chunk arrives: there is no second, Locust-side clock. Tokens are counted by the core's
accumulator from the server's usage (never chunks). Two loops cannot run in one thread, which
is why it is one loop per process and not ``asyncio.run`` per request.

Distributed runs and sharding
-----------------------------
At test start the master (or a standalone process, which plays both roles through Locust's
local message emulation) loads the trace and sends each worker a ``RunPlan`` with its shard
(``i % shards == shard``: every trace request is sent by exactly one worker, none skipped).
Workers prepare their shard (bucket counts on the target's tokenizer, the synthetic-prompt
pool), report ready, and send nothing until the master says go (the first phase), so all
phases start together and phase windows are the master's. A worker sends its results back in
batches and ``kvc_done`` after its last one; the test ends when every shard is done (or the
shape's last level ends, or ``--run-time``). When a test stops early, in-flight requests are
cancelled and unsent ones recorded as cancelled, so every trace request still appears exactly
once in ``results.jsonl``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import signal
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import gevent
from gevent.event import AsyncResult, Event
from locust import __version__ as locust_version
from locust.env import Environment
from locust.runners import MasterRunner, Runner, WorkerRunner

from replay.checkers import Answer, Grader
from replay.core.buckets import DEFAULT_BOUNDS, Buckets
from replay.core.errors import KvcanaryError
from replay.core.importers import load, sniff_format
from replay.core.records import Result
from replay.core.schedule import trace_offsets
from replay.core.trace import Request, TraceLoad
from replay.locust.support import (
    DEFAULT_ITL_EVENTS,
    DEFAULT_MAX_RESULTS,
    Constant,
    LoadPlan,
    MetricsTap,
    Prepared,
    RunPlan,
    RunRecorder,
    StepSweep,
    TraceTimes,
    cancelled_result,
    check_event,
    locust_events,
    parse_levels,
    prepare,
    resolve_target,
    send_one,
    shard_indices,
    target_message,
    trace_requests,
)
from replay.run.rundir import file_digest, read_results
from replay.serving.client import Client
from replay.serving.targets import TargetSpec

log = logging.getLogger("kvcanary")
T = TypeVar("T")

# Messages. master -> workers: plan, phase (the first one is "go"), stop.
# workers -> master: ready, results (batches), done (after the shard's last result).
MSG_PLAN, MSG_PHASE, MSG_STOP = "kvc_plan", "kvc_phase", "kvc_stop"
MSG_READY, MSG_RESULTS, MSG_DONE = "kvc_ready", "kvc_results", "kvc_done"
RESULTS_BATCH = 64
STOP_WAIT_S = 15.0  # how long a stopping test waits for in-flight results and workers
NO_PLAN_WAIT_S = 30.0
EXIT_TARGET_UNUSABLE = 3  # the target cannot be used (does not start, wrong cache dtype, ...)
EXIT_ERROR_BUDGET = 4  # it was used, but failed more requests than its error budget allows
EXIT_SIGTERM = 143  # stopped by SIGTERM (128 + 15, as a shell reports it)
SCRAPE_WAIT_S = 5.0  # a phase-edge /metrics scrape; past it the point is a gap, not a stall
SHAPES = ("users", "step", "trace")


class LLMFailure(Exception):
    """A failed request or check, as Locust shows it (the message, not the class)."""

    def __repr__(self) -> str:
        return str(self)


# -- custom arguments -------------------------------------------------------------------------


def _opts(env: Environment) -> Any:
    """Locust's parsed options: present once the command line is read (before any hook)."""
    if env.parsed_options is None:
        raise RuntimeError("Locust gave this environment no parsed options")
    return env.parsed_options


def _runner(env: Environment) -> Runner:
    if env.runner is None:
        raise RuntimeError("Locust has not started a runner in this environment")
    return env.runner


def add_arguments(parser: Any) -> None:
    """kvcanary's options, on Locust's command line and (except the file of targets) in the
    web UI's start form, where they can be changed before each test. (Not an argument group:
    only the parser's own ``add_argument`` marks options for the web UI.)"""
    add = parser.add_argument
    add(
        "--kvc-trace",
        default="traces/sample.jsonl",
        help="Trace file: kvcanary v1 JSONL, Mooncake JSONL or Azure CSV",
    )
    add(
        "--kvc-target",
        default="",
        help="Server: URL, NAME=URL (bf16/fp8 names check the served KV cache dtype) or a "
        "name from --kvc-targets-file; wins over Host; empty: the Host field",
    )
    add(
        "--kvc-targets-file",
        default="",
        include_in_web_ui=False,
        help="TOML with [targets.NAME] tables (scenarios/targets.example.toml)",
    )
    add(
        "--kvc-buckets",
        default=DEFAULT_BOUNDS,
        help="Context-length bucket bounds in target tokens, e.g. 8K,32K,64K",
    )
    add(
        "--kvc-checkers",
        default="on",
        choices=["on", "off"],
        help="Grade answers with the trace's checkers (check <bucket> entries, grades.jsonl)",
    )
    add(
        "--kvc-shape",
        default="users",
        choices=list(SHAPES),
        help="Load shape: users (Locust's -u/-r), step (--kvc-levels sweep), trace (the "
        "trace's own timestamps)",
    )
    add("--kvc-levels", default="1,4,16", help="Step sweep: concurrency levels, in order")
    add(
        "--kvc-hold",
        type=float,
        default=30.0,
        help="Step sweep: seconds each level holds after its ramp",
    )
    add(
        "--kvc-ramp",
        type=float,
        default=4.0,
        help="Step sweep: users started (or stopped) per second between levels",
    )
    add(
        "--kvc-time-scale",
        type=float,
        default=1.0,
        help="Trace shape: multiply the trace's gaps (0.5 = twice as fast)",
    )
    add(
        "--kvc-max-in-flight",
        type=int,
        default=32,
        help="Trace shape: users kept, so at most this many requests in flight",
    )
    add(
        "--kvc-loop",
        default="off",
        choices=["on", "off"],
        help="Start the trace over when it is exhausted (off: each request once, and the "
        "test ends with the trace)",
    )
    add("--kvc-limit", type=int, default=0, help="Replay only the first N trace requests (0: all)")
    add("--kvc-run-dir", default="", help="Run directory [default: reports/locust-<timestamp>]")
    add("--kvc-timeout", type=float, default=600.0, help="Per-request timeout, seconds")
    add("--kvc-seed", type=int, default=0, help="Sampling seed")
    add(
        "--kvc-itl-events",
        type=int,
        default=DEFAULT_ITL_EVENTS,
        help="At most this many itl events per request (sampled evenly)",
    )
    add(
        "--kvc-max-errors",
        type=int,
        default=0,
        help="Error budget per worker: stop the test after this many failed requests (0: none)",
    )
    add(
        "--kvc-max-error-rate",
        type=float,
        default=0.05,
        help="Error budget per worker: stop the test once more than this share of its "
        "requests failed (after 20); 1 turns it off",
    )
    add(
        "--kvc-max-results",
        type=int,
        default=DEFAULT_MAX_RESULTS,
        help="Store at most this many results in the run directory (a looping test); later "
        "ones are counted, not stored (0: no cap)",
    )


@dataclass
class Config:
    """The options of one test, validated (the master's view)."""

    trace_path: Path
    trace_format: str
    requests: list[Request]
    trace: TraceLoad
    sha256: str
    limit: int
    buckets: Buckets
    spec: TargetSpec
    mode: str
    plan: LoadPlan
    loop: bool
    checkers: bool
    time_scale: float
    seed: int
    timeout_s: float
    itl_events: int
    run_dir: str
    max_errors: int
    max_error_rate: float
    max_results: int


def load_plan(opts: Any, mode: str, common: bool) -> LoadPlan:
    """The shape's plan from the options. ``common``: the shape honours -u/-r/--run-time."""
    run_time = float(opts.run_time) if common and getattr(opts, "run_time", None) else None
    if mode == "step":
        return StepSweep(
            parse_levels(str(opts.kvc_levels)), float(opts.kvc_hold), float(opts.kvc_ramp), run_time
        )
    if mode == "trace":
        n = int(opts.kvc_max_in_flight)
        return TraceTimes(
            n, float(opts.kvc_time_scale), max(float(opts.kvc_ramp), float(n)), run_time
        )
    return Constant(int(opts.num_users or 1), float(opts.spawn_rate or 1), run_time)


def read_config(env: Environment, mode: str, common: bool) -> Config:
    opts = _opts(env)
    path = Path(str(opts.kvc_trace))
    fmt = sniff_format(path) if path.is_file() else "v1"
    trace = load(path, fmt)
    limit = max(0, int(opts.kvc_limit))
    reqs = trace_requests(trace, limit)
    spec = resolve_target(str(opts.kvc_target), env.host, str(opts.kvc_targets_file) or None)
    spec.api_key()  # a missing key variable is found before anything is sent
    plan = load_plan(opts, mode, common)
    return Config(
        trace_path=path,
        trace_format=fmt,
        requests=reqs,
        trace=trace,
        sha256=file_digest(path),
        limit=limit,
        buckets=Buckets.parse(opts.kvc_buckets),
        spec=spec,
        mode=mode,
        plan=plan,
        loop=opts.kvc_loop == "on",
        checkers=opts.kvc_checkers == "on",
        time_scale=float(opts.kvc_time_scale),
        seed=int(opts.kvc_seed),
        timeout_s=float(opts.kvc_timeout),
        itl_events=int(opts.kvc_itl_events),
        run_dir=str(opts.kvc_run_dir),
        max_errors=_at_least(int(opts.kvc_max_errors), 0, "--kvc-max-errors"),
        max_error_rate=_rate(float(opts.kvc_max_error_rate)),
        max_results=_at_least(int(opts.kvc_max_results), 0, "--kvc-max-results"),
    )


def _at_least(value: int, low: int, option: str) -> int:
    if value < low:
        raise KvcanaryError(f"{option}: {value} is below {low}")
    return value


def _rate(value: float) -> float:
    if not 0 <= value <= 1:
        raise KvcanaryError(f"--kvc-max-error-rate: {value:g} is not between 0 and 1")
    return value


# -- asyncio under gevent ---------------------------------------------------------------------


class AsyncBridge:
    """One asyncio loop for this process, run in a greenlet (see the module docstring)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._greenlet = gevent.spawn(self._run)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def wait(self, fut: concurrent.futures.Future[T], timeout: float | None = None) -> T:
        """Wait for ``fut`` cooperatively; a killed waiter (the test stopped) cancels it."""
        done: AsyncResult = AsyncResult()
        fut.add_done_callback(done.set)
        try:
            done.get(timeout=timeout)
        except gevent.Timeout:
            fut.cancel()
            raise TimeoutError(f"no answer within {timeout} s") from None
        except BaseException:
            fut.cancel()
            raise
        return fut.result()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.wait(self.submit(coro), timeout)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._greenlet.join(timeout=5)


# -- the worker role: one shard of the trace --------------------------------------------------


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
        self.prepared: Prepared | None = None
        self.client: Client | None = None
        self.items: list[tuple[int, Request]] = []
        self.offsets: list[float] = []
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
            path = Path(p.trace_path)
            if not path.is_file():
                raise KvcanaryError(f"{path}: no such trace file on this worker")
            if file_digest(path) != p.trace_sha256:
                raise KvcanaryError(
                    f"{path} on this worker differs from the master's "
                    "(sha256): give every worker the same trace"
                )
            reqs = trace_requests(load(path), p.limit)
            self.offsets = trace_offsets([r.t for r in reqs], p.time_scale)
            self.items = [(i, reqs[i]) for i in shard_indices(len(reqs), p.shard, p.shards)]
            self.prepared = self.bridge.call(
                prepare(self.spec, [r for _, r in self.items], Buckets.parse(p.buckets))
            )
            self.client = self.bridge.call(self._make_client(self.prepared.model))
            if p.checkers:
                self._warm_checkers()
            log.info(
                "kvcanary: shard %d/%d ready: %d requests", p.shard + 1, p.shards, len(self.items)
            )
        except Exception as exc:  # any reason this shard cannot run fails the target
            self.failure = str(exc) if isinstance(exc, KvcanaryError) else repr(exc)
            log.error("kvcanary: shard %d/%d cannot run: %s", p.shard + 1, p.shards, self.failure)
            if not self.stopping:  # in the web UI's Failures tab too
                self.env.events.request.fire(
                    request_type="LLM",
                    name="prepare target",
                    response_time=0,
                    response_length=0,
                    context={},
                    exception=LLMFailure(self.failure),
                )
        finally:
            self.ready.set()
            if not self.stopping:
                _runner(self.env).send_message(
                    MSG_READY,
                    {
                        "run": p.run_id,
                        "shard": p.shard,
                        "requests": len(self.items),
                        "failure": self.failure,
                    },
                )

    def _warm_checkers(self) -> None:
        """Grade a blank answer once per checker kind before the go: first use imports
        modules (and the code checker starts its sandbox), which would otherwise stall the
        hub, and with it the timestamps of requests in flight, mid-run."""
        kinds: dict[str, Request] = {}
        for _, req in self.items:
            if req.check is not None:
                kinds.setdefault(str(req.check.get("type")), req)
        for req in kinds.values():
            try:
                self.grader.grade(req.check or {}, Answer("", ()))
            except Exception as exc:  # a checker that cannot grade shows up in the run
                log.warning("kvcanary: checker %s: %r", req.check, exc)

    async def _make_client(self, model: str) -> Client:
        # aiohttp sessions belong to a loop: the client is made inside ours.
        return Client(
            self.spec.url or "",
            model,
            api_key=self.spec.api_key(),
            timeout_s=self.plan.timeout_s,
            seed=self.plan.seed,
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
            if not self.plan.loop or not self.items:
                return None
            self.cursor, self.pass_no = 0, self.pass_no + 1
        index, req = self.items[self.cursor]
        self.cursor += 1
        due = self.go_at + self.offsets[index] if self.plan.mode == "trace" else None
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
        if self.plan.checkers:
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
        return not self.plan.loop and self.cursor >= len(self.items) and not self.outstanding

    def _flush(self) -> None:
        while self.pending:
            batch, self.pending = self.pending[:RESULTS_BATCH], self.pending[RESULTS_BATCH:]
            _runner(self.env).send_message(
                MSG_RESULTS, {"run": self.plan.run_id, "shard": self.plan.shard, "rows": batch}
            )

    def _finish(self, stopped: bool) -> None:
        if self.done:
            return
        if self.failure is not None:
            self._record_unsent("unavailable", f"target unavailable: {self.failure}")
        self._flush()
        self.done = True
        _runner(self.env).send_message(
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
        if not self.plan.loop:
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
        unsent = len(self.outstanding) + (0 if self.plan.loop else len(self.items) - self.cursor)
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
            except Exception:  # the process is going away; nothing to save
                pass
        self.grader.close()


# -- the master role: one test ------------------------------------------------------------------


@dataclass
class Test:
    cfg: Config
    base: RunPlan
    recorder: RunRecorder
    shards: int
    epoch: float
    ready: dict[int, str | None] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    go_at: float | None = None
    label: str | None = None
    failed: str | None = None
    stopping: bool = False
    closed: bool = False
    late: bool = False
    finished: Event = field(default_factory=Event)
    ending: bool = False  # an end() is under way (it waits, so another greenlet may run)
    ended: Event = field(default_factory=Event)  # end() has written the run directory
    tap: MetricsTap | None = None

    def now(self) -> float:
        return time.perf_counter() - self.epoch


class Kvc:
    """kvcanary's state in this Locust process: the master role (tests, run directories) on
    a master or standalone process, the worker role (shards) on a worker or standalone one."""

    def __init__(self) -> None:
        self.env: Environment | None = None
        self.bridge: AsyncBridge | None = None
        self.test: Test | None = None
        self.broken: str | None = None
        self.shard: Shard | None = None
        self.shard_event = Event()
        self.tests_started = 0

    # wiring ----------------------------------------------------------------------------
    def install(self, env: Environment, runner: Runner | None) -> None:
        self.env = env
        self.bridge = AsyncBridge()
        if runner is None:
            return
        ev = env.events
        if not isinstance(runner, WorkerRunner):  # master role
            runner.register_message(MSG_READY, self._on_ready)
            runner.register_message(MSG_RESULTS, self._on_results)
            runner.register_message(MSG_DONE, self._on_done)
            ev.test_start.add_listener(lambda **_: self.begin())
            ev.test_stopping.add_listener(lambda **_: self.stopping())
            ev.test_stop.add_listener(lambda **_: self.end())
            ev.quitting.add_listener(lambda **_: self.quitting())
            # Locust installs its SIGTERM handler only after a headless run with a load shape
            # (kvcanary's default) has ended, so a container stop killed the master with no
            # summary. Until Locust's handler replaces this one, a SIGTERM stops the test
            # the normal way: users end at once and the run directory is completed.
            gevent.signal_handler(signal.SIGTERM, lambda: gevent.spawn(self._sigterm))
            opts = _opts(env)
            if opts is not None and (opts.headless or opts.autostart):
                self.validate()
            if opts is not None and not env.host:
                try:  # the start form's Host field shows the target
                    env.host = resolve_target(
                        str(opts.kvc_target), None, str(opts.kvc_targets_file) or None
                    ).url
                except KvcanaryError:
                    pass
        if not isinstance(runner, MasterRunner):  # worker role
            runner.register_message(MSG_PLAN, self._on_plan)
            runner.register_message(MSG_PHASE, self._on_phase)
            runner.register_message(MSG_STOP, self._on_stop)
            ev.test_stop.add_listener(
                lambda **_: self._stop_shard("cancelled", "not sent: the test stopped")
            )
            ev.quitting.add_listener(lambda **_: self._close_shard())

    @property
    def runner(self) -> Runner:
        assert self.env is not None and self.env.runner is not None
        return self.env.runner

    def shape_mode(self) -> tuple[str, bool]:
        """The active shape's mode and whether it honours -u/-r/--run-time; no kvcanary shape
        (Locust's "Default" in the class picker) is Locust's own users."""
        assert self.env is not None
        shape = self.env.shape_class
        mode_of = getattr(shape, "kvc_mode", None)
        if shape is None or mode_of is None:
            return "users", False
        return str(mode_of(_opts(self.env))), bool(shape.use_common_options)

    def validate(self) -> None:
        """Headless and --autostart runs check their options before anything starts."""
        assert self.env is not None
        try:
            cfg = read_config(self.env, *self.shape_mode())
        except KvcanaryError as exc:
            log.error("kvcanary: %s", exc)
            sys.exit(2)
        opts = _opts(self.env)
        if cfg.loop and cfg.mode == "users" and not getattr(opts, "run_time", None):
            log.warning(
                "kvcanary: --kvc-loop on with the users shape and no --run-time: the "
                "test runs until it is stopped"
            )

    # master: test lifecycle ----------------------------------------------------------------
    def begin(self) -> None:
        assert self.env is not None and self.bridge is not None
        self.broken = None
        if self.test is not None and not self.test.closed:
            self.end()
        try:
            cfg = read_config(self.env, *self.shape_mode())
            run_dir = self._run_dir(cfg.run_dir)
        except KvcanaryError as exc:
            self.broken = str(exc)
            log.error("kvcanary: cannot start: %s", exc)
            self.env.process_exit_code = 2
            if self.env.shape_class is None:
                gevent.spawn(self.runner.stop)
            return
        self.tests_started += 1
        runner = self.runner
        self.env.host = cfg.spec.url  # the web UI's header shows what is measured
        clients = self._workers()
        epoch_wall, epoch = time.time(), time.perf_counter()
        base = RunPlan(
            run_id=run_dir.name,
            trace_path=str(cfg.trace_path),
            trace_sha256=cfg.sha256,
            limit=cfg.limit,
            buckets=cfg.buckets.spec(),
            target=target_message(cfg.spec),
            mode=cfg.mode,
            first_label=cfg.plan.labels[0],
            time_scale=cfg.time_scale,
            loop=cfg.loop,
            checkers=cfg.checkers,
            seed=cfg.seed,
            timeout_s=cfg.timeout_s,
            itl_events=cfg.itl_events,
            epoch_wall=epoch_wall,
            shards=max(1, len(clients)),
            max_errors=cfg.max_errors,
            max_error_rate=cfg.max_error_rate,
        )
        opts = _opts(self.env)
        recorder = RunRecorder(
            run_dir=run_dir,
            trace=cfg.trace,
            trace_path=cfg.trace_path,
            trace_format=cfg.trace_format,
            trace_sha256=cfg.sha256,
            requests=cfg.requests,
            buckets=cfg.buckets,
            spec=cfg.spec,
            schedules=cfg.plan.labels,
            options={
                "driver": "locust",
                "shape": cfg.mode,
                "timeout_s": cfg.timeout_s,
                "seed": cfg.seed,
                "salt_phases": True,
                "loop": cfg.loop,
                "limit": cfg.limit,
                "checkers": cfg.checkers,
                "time_scale": cfg.time_scale,
                "levels": str(opts.kvc_levels),
                "hold_s": float(opts.kvc_hold),
                "ramp": float(opts.kvc_ramp),
                "max_in_flight": int(opts.kvc_max_in_flight),
                "itl_events": cfg.itl_events,
                "max_errors": cfg.max_errors,
                "max_error_rate": cfg.max_error_rate,
                "max_results": cfg.max_results,
            },
            driver={
                "name": "locust",
                "version": locust_version,
                "role": type(runner).__name__,
                "workers": len(clients),
                "shards": base.shards,
                "shape": cfg.mode,
            },
            command=list(sys.argv),
            checkers=cfg.checkers,
            seed=cfg.seed,
            max_results=cfg.max_results,
        )
        test = self.test = Test(cfg, base, recorder, base.shards, epoch)
        recorder.save_manifest()
        log.info(
            "kvcanary: run directory %s: %d requests in %d shard(s), shape %s",
            run_dir,
            len(cfg.requests),
            base.shards,
            cfg.mode,
        )
        gevent.spawn(self._start_tap, test)
        if isinstance(runner, MasterRunner):
            for k, client_id in enumerate(clients):
                plan = RunPlan.from_msg({**base.to_msg(), "shard": k})
                runner.send_message(MSG_PLAN, plan.to_msg(), client_id=client_id)
        else:
            runner.send_message(MSG_PLAN, base.to_msg())

    def _workers(self) -> list[str]:
        runner = self.runner
        if not isinstance(runner, MasterRunner):
            return []
        nodes = runner.clients.ready + runner.clients.spawning + runner.clients.running
        return [n.id for n in sorted(nodes, key=lambda n: runner.get_worker_index(n.id))]

    def _run_dir(self, given: str) -> Path:
        if not given:
            stamp = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
            return Path("reports") / f"locust-{stamp}"
        path = Path(given)
        if self.tests_started:
            path = path.with_name(f"{path.name}-{self.tests_started + 1}")
        if path.exists() and any(path.iterdir()):
            raise KvcanaryError(f"--kvc-run-dir: {path} exists and is not empty")
        return path

    def _start_tap(self, test: Test) -> None:
        assert self.bridge is not None
        tap = MetricsTap(test.cfg.spec, test.now, test.recorder.add_snapshot)
        try:
            info = self.bridge.call(tap.start(), timeout=60)
        except Exception as exc:
            test.recorder.info.setdefault("problems", []).append(f"introspection: {exc!r}")
            return
        test.recorder.info.update(info)
        if test.closed:  # the test ended while the target was being introspected
            self.bridge.call(tap.stop(), timeout=30)
            return
        test.tap = tap
        test.recorder.save_manifest()

    def tick(self, shape: Any) -> tuple[int, float] | None:
        """The kvcanary shapes' tick: the plan's users, and the phase label to the workers;
        None when the run is over (trace exhausted, sweep done, run time, or a failure)."""
        assert self.env is not None
        mode, common = self.shape_mode()
        test = self.test
        if self.broken is not None:
            return None
        if test is None or test.closed:  # a new test, before its test_start
            try:
                plan = load_plan(_opts(self.env), mode, common)
            except KvcanaryError as exc:
                log.error("kvcanary: %s", exc)
                return None
            first = plan.tick(0.0)
            return None if first is None else (first.users, first.spawn_rate)
        if test.failed is not None or test.finished.is_set():
            return None
        if test.go_at is None:  # workers preparing: start the first level's users
            first = test.cfg.plan.tick(0.0)
            return None if first is None else (first.users, first.spawn_rate)
        tk = test.cfg.plan.tick(test.now() - test.go_at)
        if tk is None:
            return None
        self._set_phase(test, tk.label)
        return tk.users, tk.spawn_rate

    def _set_phase(self, test: Test, label: str) -> None:
        if label == test.label:
            return
        self._scrape(test)  # the closing phase's last point, stamped before the boundary
        test.label = label
        test.recorder.open_phase(label, test.now())
        self._scrape(test)  # the new phase's first point, as the CLI scrapes at phase edges
        test.recorder.save_manifest()
        log.info("kvcanary: phase %s", label)
        self.runner.send_message(MSG_PHASE, {"label": label})

    def _scrape(self, test: Test) -> None:
        """One /metrics point now. The tap's loop scrapes about once a second, so a phase
        shorter than that (a fast machine) would otherwise have no point inside its window;
        a failed scrape is counted by the tap, never an error of the run."""
        if test.tap is None or self.bridge is None:
            return
        try:
            self.bridge.call(test.tap.scrape_once(), timeout=SCRAPE_WAIT_S)
        except TimeoutError as exc:
            log.warning("kvcanary: metrics: %s", exc)

    def _current(self, msg: Any) -> Test | None:
        """The test a worker's message belongs to (None: an earlier test's, or none)."""
        test = self.test
        if test is None or msg.data.get("run") != test.base.run_id:
            log.warning("kvcanary: %s from an earlier test ignored", msg.type)
            return None
        return test

    def _on_ready(self, environment: Environment, msg: Any, **_: Any) -> None:
        test = self._current(msg)
        if test is None or test.closed:
            return
        test.ready[int(msg.data["shard"])] = msg.data.get("failure")
        if len(test.ready) < test.shards:
            return
        failures = [f for f in test.ready.values() if f]
        if failures:
            self._fail(test, failures[0])
            return
        test.go_at = test.now()
        first = test.cfg.plan.tick(0.0)
        if first is not None and test.shards > 1 and first.users < test.shards:
            log.warning(
                "kvcanary: %d user(s) for %d workers: a worker without users leaves "
                "its shard waiting; use at least one user per worker (a multiple of "
                "the worker count keeps the shards even)",
                first.users,
                test.shards,
            )
        self._set_phase(test, test.cfg.plan.labels[0])

    def _fail(self, test: Test, reason: str, code: int = EXIT_TARGET_UNUSABLE) -> None:
        assert self.env is not None
        test.failed = reason
        test.recorder.fail(reason)
        self.env.process_exit_code = code
        log.error("kvcanary: target %s failed: %s", test.cfg.spec.name, reason)
        self.runner.send_message(
            MSG_STOP, {"kind": "unavailable", "reason": f"target unavailable: {reason}"}
        )

    def _on_results(self, environment: Environment, msg: Any, **_: Any) -> None:
        test = self._current(msg)
        if test is None:
            return
        test.recorder.add_results(msg.data["rows"])
        if test.closed:
            test.late = True
            log.warning(
                "kvcanary: %d result(s) arrived after the summary; it is rewritten at exit",
                len(msg.data["rows"]),
            )

    def _on_done(self, environment: Environment, msg: Any, **_: Any) -> None:
        test = self._current(msg)
        if test is None or test.closed:
            return
        test.done.add(int(msg.data["shard"]))
        failure = msg.data.get("failure")
        if failure and test.failed is None and str(failure).startswith("error budget"):
            self._fail(test, str(failure), EXIT_ERROR_BUDGET)
        if len(test.done) >= test.shards and not test.finished.is_set():
            test.finished.set()
            log.info("kvcanary: every shard is done (%d results)", test.recorder.received)
            assert self.env is not None
            if self.env.shape_class is None and not test.stopping:
                gevent.spawn(self.runner.stop)  # no shape to end the test: end it here

    def _sigterm(self) -> None:
        log.warning("kvcanary: SIGTERM: stopping the test and writing its run directory")
        assert self.env is not None
        if self.env.process_exit_code is None:
            self.env.process_exit_code = EXIT_SIGTERM
        self.runner.stop()  # test_stopping, then test_stop: end() writes the summary
        self.runner.quit()

    def stopping(self) -> None:
        test = self.test
        if test is None or test.closed or test.stopping:
            return
        test.stopping = True
        if not test.finished.is_set():
            self.runner.send_message(
                MSG_STOP, {"kind": "cancelled", "reason": "not sent: the test stopped"}
            )

    def end(self) -> None:
        """The test stopped: wait for the workers' last results, then write the run dir."""
        self.broken = None
        test = self.test
        if test is None or test.closed or test.ending:
            return
        test.ending = True
        self.stopping()
        if not test.finished.wait(timeout=STOP_WAIT_S):
            missing = sorted(set(range(test.shards)) - test.done)
            log.warning(
                "kvcanary: no final report from shard(s) %s; their missing results "
                "are recorded as unavailable",
                missing,
            )
        test.closed = True
        try:
            self._write_run_dir(test)
        finally:
            test.ended.set()

    def _write_run_dir(self, test: Test) -> None:
        if test.tap is not None:
            # Stopped before the phase closes: the tap's last scrape falls inside the window,
            # so counter deltas cover the whole phase however short it was.
            assert self.bridge is not None
            try:
                failures = self.bridge.call(test.tap.stop(), timeout=30)
                test.recorder.info["scrape_failures"] = failures
            except Exception as exc:
                log.warning("kvcanary: metrics: %r", exc)
            test.tap = None
        test.recorder.close_phase(test.now())
        self._account_missing(test)
        summary = test.recorder.finish()
        self._log_summary(test, summary)

    def _account_missing(self, test: Test) -> None:
        """Trace requests no worker reported (a lost worker): results too, never silence."""
        if test.cfg.loop:
            return
        seen = {r.request_id for r in _read(test.recorder.run_dir)}
        label = test.label or test.cfg.plan.labels[0]
        at = test.now()
        rows = []
        for i, req in enumerate(test.cfg.requests):
            if req.id not in seen:
                shard = i % test.shards
                rows.append(
                    cancelled_result(
                        req,
                        test.cfg.spec.name,
                        label,
                        "unknown",
                        at,
                        "unavailable",
                        f"no result came back from worker shard {shard}",
                    ).to_json()
                )
        if rows:
            log.warning(
                "kvcanary: %d request(s) have no result; recorded as unavailable", len(rows)
            )
            test.recorder.add_results(rows)

    def _log_summary(self, test: Test, summary: dict[str, Any]) -> None:
        t = (summary.get("targets") or {}).get(test.cfg.spec.name) or {}
        for label, phase in (t.get("phases") or {}).items():
            a = phase["all"]
            log.info(
                "kvcanary: %s: %d requests, %d ok, %d errors %s",
                label,
                a["requests"],
                a["ok"],
                a["errors"],
                a["errors_by_kind"] or "",
            )
        log.info(
            "kvcanary: run directory %s (render it: replay report %s)",
            test.recorder.run_dir,
            test.recorder.run_dir,
        )

    def quitting(self) -> None:
        assert self.env is not None
        test = self.test
        if test is not None:
            if not test.closed and not test.ending:
                self.end()
            elif not test.ended.is_set():
                # An end() in another greenlet (the test stopped just before Locust quits) is
                # still writing the run directory: closing it now would lose the summary.
                test.ended.wait(timeout=STOP_WAIT_S + 60)
            elif test.late:
                test.recorder.finish()  # results that arrived after the summary count too
            test.recorder.close()
        self._set_exit_code()
        if self.bridge is not None:
            self.bridge.close()

    def _set_exit_code(self) -> None:
        """Locust's exit code counts every failure; kvcanary's counts serving failures (and
        leaves checker failures, which are the answers' quality, to the report)."""
        assert self.env is not None
        env = self.env
        if env.process_exit_code is not None or env.runner is None:
            return
        if env.runner.exceptions:
            return
        serving = [e for e in env.runner.stats.errors.values() if e.method != "CHECK"]
        if not serving and env.runner.stats.errors:
            env.process_exit_code = 0

    # worker: shards ------------------------------------------------------------------------
    def _on_plan(self, environment: Environment, msg: Any, **_: Any) -> None:
        assert self.bridge is not None
        old = self.shard
        if old is not None and not old.done:
            old.stop("cancelled", "not sent: a new test started")
        plan = RunPlan.from_msg(msg.data)
        self.shard = Shard(environment, self.bridge, plan)
        self.shard_event.set()
        log.info(
            "kvcanary: plan for shard %d/%d (run %s)", plan.shard + 1, plan.shards, plan.run_id
        )

    def _on_phase(self, environment: Environment, msg: Any, **_: Any) -> None:
        if self.shard is not None:
            self.shard.start(str(msg.data["label"]))

    def _on_stop(self, environment: Environment, msg: Any, **_: Any) -> None:
        self._stop_shard(str(msg.data["kind"]), str(msg.data["reason"]))

    def _stop_shard(self, kind: str, reason: str) -> None:
        if self.shard is not None and not self.shard.done:
            self.shard.stop(kind, reason)

    def _close_shard(self) -> None:
        if self.shard is not None:
            self.shard.close()

    def user_step(self) -> bool:
        """One task iteration of a user: take a request, send it, report it. False: this
        user has nothing more to do (shard exhausted, test stopping, or no plan came)."""
        if self.shard is None and not self.shard_event.wait(timeout=NO_PLAN_WAIT_S):
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


def _read(run_dir: Path) -> list[Result]:
    return list(read_results(run_dir))


KVC = Kvc()
