"""What kvcanary's Locust adapter (``scenarios/locustfile.py``) needs from the replay core.

Nothing here imports Locust or gevent: these are plain functions and classes over the core
(trace, client, buckets, run directory, summary, grading), so they are typed, unit-tested and
usable by any other load driver. The adapter adds only the Locust and gevent glue.

    LoadPlan (Constant, StepSweep, TraceTimes)   users over time, as pure functions of time
    shard_indices()                              which trace requests one worker sends
    locust_events(), check_event()               one Result as Locust request events
    prepare(), send_one(), MetricsTap            the target, through the core's async client
    RunPlan                                      what the master tells each worker
    RunRecorder                                  the run directory, as ``replay`` writes it
"""

from __future__ import annotations

import asyncio
import math
import platform
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from replay import __version__
from replay.analysis.grading import grading_spec
from replay.analysis.verdict import Thresholds
from replay.checkers import Answer, Grader
from replay.core.buckets import Buckets
from replay.core.errors import ConfigError
from replay.core.records import Result
from replay.core.synth import TokenPool, synthesize
from replay.core.trace import Request, TraceLoad
from replay.run.budget import ErrorBudget
from replay.run.rundir import MANIFEST, RESULTS, JsonlWriter, read_results, write_json
from replay.run.runner import Analysis, _cpu_flags, analyse, count_tokens, token_pool
from replay.serving.client import Client
from replay.serving.introspect import Scraper, introspect, served_model
from replay.serving.targets import (
    TargetSpec,
    check_served_dtype,
    load_targets_config,
    parse_targets,
)

# -- load plans: user count over time ----------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    """What the load should be now: Locust's (user_count, spawn_rate), and the phase label
    results get (``c4`` for four users in a closed loop, as ``replay --concurrency 4``)."""

    users: int
    spawn_rate: float
    label: str


class LoadPlan(Protocol):
    @property
    def labels(self) -> list[str]: ...

    def tick(self, t: float) -> Tick | None:
        """The load ``t`` seconds after the trace is ready; None when the run is over."""
        ...


def _positive(value: float, what: str) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{what} must be a positive number, got {value!r}")
    return value


def parse_levels(text: str) -> tuple[int, ...]:
    """``"1,4,16"`` -> (1, 4, 16): distinct positive user counts, in the order given."""
    try:
        levels = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ConfigError(
            f"--kvc-levels: '{text}' is not a list of integers (e.g. 1,4,16)"
        ) from None
    if not levels or any(v < 1 for v in levels):
        raise ConfigError(f"--kvc-levels: give positive user counts, e.g. 1,4,16 (got '{text}')")
    if len(set(levels)) != len(levels):
        raise ConfigError(f"--kvc-levels: each level once, please (got '{text}')")
    return levels


@dataclass(frozen=True)
class Constant:
    """Locust's own ``-u/-r``: a fixed number of users until ``run_time_s`` (None: until the
    trace is exhausted)."""

    users: int
    spawn_rate: float
    run_time_s: float | None = None

    def __post_init__(self) -> None:
        if self.users < 1:
            raise ConfigError(f"users must be at least 1, got {self.users}")
        _positive(self.spawn_rate, "spawn rate")

    @property
    def labels(self) -> list[str]:
        return [f"c{self.users}"]

    def tick(self, t: float) -> Tick | None:
        if self.run_time_s is not None and t >= self.run_time_s:
            return None
        return Tick(self.users, self.spawn_rate, self.labels[0])


@dataclass(frozen=True)
class StepSweep:
    """Concurrency levels in turn. Level k ramps from the previous level at ``ramp`` users/s,
    then holds ``hold_s`` seconds; the sweep ends after its last level. Each level is a phase
    (``c1``, ``c4``, ...), as ``replay --concurrency 1,4,...`` names them."""

    levels: tuple[int, ...]
    hold_s: float
    ramp: float
    run_time_s: float | None = None

    def __post_init__(self) -> None:
        parse_levels(",".join(map(str, self.levels)))
        _positive(self.hold_s, "--kvc-hold")
        _positive(self.ramp, "--kvc-ramp")

    @property
    def labels(self) -> list[str]:
        return [f"c{n}" for n in self.levels]

    def ends(self) -> list[float]:
        """When each level ends, seconds from the start."""
        out, t, prev = [], 0.0, 0
        for n in self.levels:
            t += abs(n - prev) / self.ramp + self.hold_s
            out.append(t)
            prev = n
        return out

    def tick(self, t: float) -> Tick | None:
        if self.run_time_s is not None and t >= self.run_time_s:
            return None
        for n, end in zip(self.levels, self.ends(), strict=True):
            if t < end:
                return Tick(n, self.ramp, f"c{n}")
        return None


@dataclass(frozen=True)
class TraceTimes:
    """Open loop at the trace's own timestamps (gaps times ``time_scale``). Users send each
    request at its due time; the plan keeps ``max_in_flight`` users, so at most that many
    requests are open at once. A request that finds every user busy keeps its due time as
    ``scheduled``, so the wait shows as queue delay (as ``replay --trace-times
    --max-in-flight``)."""

    max_in_flight: int
    time_scale: float = 1.0
    spawn_rate: float = 100.0
    run_time_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ConfigError(f"--kvc-max-in-flight must be at least 1, got {self.max_in_flight}")
        _positive(self.time_scale, "--kvc-time-scale")
        _positive(self.spawn_rate, "spawn rate")

    @property
    def labels(self) -> list[str]:
        return [f"trace-x{self.time_scale:g}"]

    def tick(self, t: float) -> Tick | None:
        if self.run_time_s is not None and t >= self.run_time_s:
            return None
        return Tick(self.max_in_flight, self.spawn_rate, self.labels[0])


# -- sharding ---------------------------------------------------------------------------------


def shard_indices(n: int, index: int, count: int) -> list[int]:
    """Trace positions worker ``index`` of ``count`` sends: ``i % count == index``. Over all
    workers every position appears exactly once, and the split depends on nothing else."""
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard {index} of {count} does not exist")
    return list(range(index, n, count))


# -- Results as Locust request events ---------------------------------------------------------

REQUEST_TYPE = "LLM"
CHECK_TYPE = "CHECK"
DEFAULT_ITL_EVENTS = 256


@dataclass(frozen=True)
class LocustEvent:
    """The arguments of one ``events.request.fire``; ``error`` set means a failure."""

    request_type: str
    name: str
    response_time: float
    response_length: int
    error: str | None = None


def sample_evenly(values: Sequence[float], cap: int) -> list[float]:
    """At most ``cap`` values spread evenly over ``values`` (all when there are fewer), so a
    long answer does not flood the statistics while its gaps keep their distribution."""
    if cap <= 0:
        return []
    n = len(values)
    if n <= cap:
        return list(values)
    return [values[(i * n) // cap] for i in range(cap)]


def locust_events(r: Result, itl_cap: int = DEFAULT_ITL_EVENTS) -> list[LocustEvent]:
    """A Result as Locust request events, one entry name per metric and bucket:

    ``ttft <b>``            time to first token, ms (length: prompt tokens)
    ``itl <b>``             one event per inter-token gap, ms (a chunk of n tokens counts n
                            gaps of a nth of its gap, as ``Result.itl``), at most ``itl_cap``
                            per request, sampled evenly (length: 1 token)
    ``e2e <b>``             whole request, ms (length: output tokens); a failed request is
                            one failure here, with its error kind and message
    ``output_tokens <b>``   the response-time columns hold the output token count

    Cancelled requests (the test stopped) are not server outcomes and fire nothing.
    """
    b = r.bucket
    if r.status == "cancelled":
        return []
    if r.status != "ok":
        elapsed = (r.done - r.sent) if r.done is not None and r.sent is not None else 0.0
        reason = f"{r.error_kind}: {(r.error or '').strip()[:300]}"
        return [LocustEvent(REQUEST_TYPE, f"e2e {b}", elapsed * 1000, 0, reason)]
    out: list[LocustEvent] = []
    if r.ttft is not None:
        out.append(LocustEvent(REQUEST_TYPE, f"ttft {b}", r.ttft * 1000, r.prompt_tokens or 0))
    out += [
        LocustEvent(REQUEST_TYPE, f"itl {b}", gap * 1000, 1)
        for gap in sample_evenly(r.itl(), itl_cap)
    ]
    if r.e2e is not None:
        out.append(LocustEvent(REQUEST_TYPE, f"e2e {b}", r.e2e * 1000, r.output_tokens))
    out.append(
        LocustEvent(REQUEST_TYPE, f"output_tokens {b}", float(r.output_tokens), r.output_tokens)
    )
    return out


def check_event(r: Result, req: Request, grader: Grader) -> LocustEvent | None:
    """``check <b>``: the request's checker on the answer, a failure (with the checker's reason)
    when it does not pass; None for requests without a checker or without an answer. Graded
    under the same bounds as the run's analysis: a hostile answer cannot stall the process."""
    if r.status != "ok" or req.check is None:
        return None
    grade = grader.grade(req.check, Answer(r.output_text, tuple(r.tool_calls)))
    kind = str(req.check.get("type"))
    return LocustEvent(
        CHECK_TYPE,
        f"check {r.bucket}",
        0.0,
        0,
        None if grade.passed else f"{kind}: {grade.reason[:300]}",
    )


# -- the target, through the core client ------------------------------------------------------


def resolve_target(text: str, host: str | None, targets_file: str | None) -> TargetSpec:
    """``--kvc-target``: ``http://...`` (named ``target``), ``NAME=URL`` (bf16/fp8 names set the
    expected cache dtype, as in ``replay --targets``), a name from ``--kvc-targets-file``, or
    empty for Locust's host. Locust drives servers that already run; it starts none."""
    text = (text or "").strip() or (host or "").strip()
    if not text:
        raise ConfigError(
            "no target: give --kvc-target (URL, NAME=URL or a name from "
            "--kvc-targets-file) or Locust's --host"
        )
    if re.match(r"https?://", text):
        return TargetSpec(name="target", url=text.rstrip("/"))
    config = load_targets_config(Path(targets_file)) if targets_file else None
    if "=" not in text and (config is None or text not in config):
        raise ConfigError(
            f"--kvc-target: '{text}' names no server: give a URL, NAME=URL, or a "
            "name from --kvc-targets-file"
        )
    specs = parse_targets(text, None, config)
    if len(specs) != 1:
        raise ConfigError(
            f"--kvc-target: one target per Locust run (got {len(specs)}); run "
            "Locust once per target and compare the run directories"
        )
    spec = specs[0]
    if spec.url is None:
        raise ConfigError(
            f"--kvc-target: '{spec.name}' is a local model; start it (vllm serve "
            "or replay) and give its URL: Locust starts no servers"
        )
    return spec


@dataclass
class Prepared:
    """What sending a shard needs to know about the target."""

    info: dict[str, Any]
    model: str
    counts: dict[str, int | None]
    buckets: dict[str, str]
    pool: TokenPool | None

    def new_result(self, req: Request, target: str, phase: str, scheduled: float) -> Result:
        return Result(
            request_id=req.id,
            target=target,
            phase=phase,
            bucket=self.buckets.get(req.id, "unknown"),
            scheduled=scheduled,
            prompt_tokens=self.counts.get(req.id),
        )


async def prepare(spec: TargetSpec, reqs: Sequence[Request], buckets: Buckets) -> Prepared:
    """Introspect the target, check it serves what its spec expects, count each prompt on its
    tokenizer (the bucket) and build the synthetic-prompt pool, as the runner does. A target
    that cannot be used raises TargetError with the reason."""
    assert spec.url is not None
    url = spec.url
    # The target's key goes with every call on this session, and only to the target's URL.
    async with aiohttp.ClientSession(headers=spec.auth_headers()) as session:
        info = await introspect(session, url)
        model = served_model(info)
        check_served_dtype(spec, info["cache_config"].get("cache_dtype"), None, info["problems"])
        pool = await token_pool(session, url, model) if any(r.synth for r in reqs) else None
        counts = await count_tokens(session, url, model, reqs, problems=info["problems"])
    labels = {rid: (buckets.label(n) if n is not None else "unknown") for rid, n in counts.items()}
    info["tokens_counted"] = sum(c is not None for c in counts.values())
    return Prepared(info, model, counts, labels, pool)


async def send_one(
    client: Client, req: Request, res: Result, prepared: Prepared, salt: str | None
) -> Result:
    """Send one request through the core client into ``res``. Also when the send is cancelled
    (the test stopped) the Result comes back, marked cancelled by the client."""
    ids = synthesize(req, prepared.pool) if req.synth is not None and prepared.pool else None
    try:
        await client.send(req, res, ids, salt)
    except asyncio.CancelledError:
        pass  # the client has recorded it; the caller keeps the Result
    return res


class MetricsTap:
    """The target's introspection and its /metrics scraped about once a second (the core's
    Scraper), for the manifest and the server-side figures of the summary."""

    def __init__(
        self, spec: TargetSpec, now: Callable[[], float], sink: Callable[[dict[str, Any]], None]
    ) -> None:
        self.spec, self.now, self.sink = spec, now, sink
        self._session: aiohttp.ClientSession | None = None
        self._scraper: Scraper | None = None

    async def start(self) -> dict[str, Any]:
        assert self.spec.url is not None
        self._session = aiohttp.ClientSession(headers=self.spec.auth_headers())
        info = await introspect(self._session, self.spec.url)
        self._scraper = Scraper(
            self._session, self.spec.url, self.now, lambda snap: self.sink(snap.to_json())
        )
        self._scraper.start()
        return info

    async def scrape_once(self) -> None:
        if self._scraper is not None:
            await self._scraper.scrape_once()

    async def stop(self) -> int:
        failures = 0
        if self._scraper is not None:
            await self._scraper.stop()
            failures = self._scraper.failures
            self._scraper = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        return failures


# -- the master's instructions to a worker ----------------------------------------------------


@dataclass(frozen=True)
class RunPlan:
    """Everything a worker needs for one test, sent by the master in a message (plain data), so
    a worker does not depend on its own command line: the web UI may have changed it."""

    run_id: str
    trace_path: str
    trace_sha256: str
    limit: int
    buckets: str
    target: dict[str, Any]
    mode: str
    first_label: str
    time_scale: float
    loop: bool
    checkers: bool
    seed: int
    timeout_s: float
    itl_events: int
    epoch_wall: float
    shard: int = 0
    shards: int = 1
    # The shard's error budget (replay/run/budget.py); 0 max_errors: no absolute cap.
    max_errors: int = 0
    max_error_rate: float = 0.05

    def budget(self) -> ErrorBudget:
        return ErrorBudget(max_errors=self.max_errors or None, max_error_rate=self.max_error_rate)

    def to_msg(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_msg(cls, data: Mapping[str, Any]) -> RunPlan:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def target_spec(self) -> TargetSpec:
        t = self.target
        return TargetSpec(
            name=t["name"],
            url=t["url"],
            api_key_env=t.get("api_key_env"),
            expect_cache_dtype=t.get("expect_cache_dtype"),
        )

    def salt(self, target: str, label: str, pass_no: int) -> str:
        """A prefix-cache salt per phase (and per pass over the trace), as the runner's."""
        base = f"{self.run_id}.{target}.{label}"
        return base if pass_no == 0 else f"{base}.p{pass_no}"


def target_message(spec: TargetSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "url": spec.url,
        "api_key_env": spec.api_key_env,
        "expect_cache_dtype": spec.expect_cache_dtype,
    }


def trace_requests(trace: TraceLoad, limit: int) -> list[Request]:
    return trace.requests[:limit] if limit > 0 else list(trace.requests)


def cancelled_result(
    req: Request, target: str, phase: str, bucket: str, at: float, kind: str, reason: str
) -> Result:
    """A request the test will not send (stopped, or the target is unavailable): a result
    too, so every trace request is accounted for."""
    return Result(
        request_id=req.id,
        target=target,
        phase=phase,
        bucket=bucket,
        scheduled=at,
        status="cancelled" if kind == "cancelled" else "error",
        error_kind="cancelled" if kind == "cancelled" else "unavailable",
        error=reason,
    )


# -- the run directory ------------------------------------------------------------------------


DEFAULT_MAX_RESULTS = 250_000


@dataclass
class RunRecorder:
    """The run directory of one Locust test, in ``replay``'s format: ``manifest.json``,
    ``results.jsonl`` (appended as results arrive), ``metrics/<target>.jsonl``,
    ``grades.jsonl`` (with checkers on) and ``summary.json``, so ``replay report`` renders it."""

    run_dir: Path
    trace: TraceLoad
    trace_path: Path
    trace_format: str
    trace_sha256: str
    requests: list[Request]
    buckets: Buckets
    spec: TargetSpec
    schedules: list[str]
    options: dict[str, Any]
    driver: dict[str, Any]
    command: list[str]
    checkers: bool = True
    seed: int = 0
    status: str = "ok"
    reason: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    series: list[dict[str, Any]] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    # A looping test (--kvc-loop on) has no natural end: past this many result rows, results
    # are counted, not stored, so no test can fill the disk (Locust's statistics still see
    # every request). 0: no cap.
    max_results: int = DEFAULT_MAX_RESULTS

    def __post_init__(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "metrics").mkdir(exist_ok=True)
        self._results = JsonlWriter(self.run_dir / RESULTS)
        self._metrics = JsonlWriter(self.run_dir / "metrics" / f"{self.spec.name}.jsonl")
        self._open: tuple[str, float] | None = None
        self.received = 0
        self.dropped = 0

    # results and metrics arrive as they happen
    def add_results(self, rows: Iterable[Mapping[str, Any]]) -> None:
        for row in rows:
            if self.max_results and self.received >= self.max_results:
                if not self.dropped:
                    self.info.setdefault("problems", []).append(
                        f"results past --kvc-max-results {self.max_results} were counted, "
                        "not stored"
                    )
                self.dropped += 1
                continue
            self._results.write(row)
            self.received += 1

    def add_snapshot(self, row: dict[str, Any]) -> None:
        self.series.append(row)
        self._metrics.write(row)

    # phases: the windows results are grouped in
    def open_phase(self, label: str, t: float) -> None:
        self.close_phase(t)
        self._open = (label, t)
        self.phases.setdefault(label, {"start": t, "end": t})

    def close_phase(self, t: float) -> None:
        if self._open is not None:
            label, _ = self._open
            self.phases[label]["end"] = max(self.phases[label]["end"], t)
            self._open = None

    def fail(self, reason: str) -> None:
        self.status, self.reason = "failed", reason

    def manifest(self) -> dict[str, Any]:
        return {
            "tool": {"name": "kvcanary", "version": __version__},
            "driver": self.driver,
            "command": list(self.command),
            "started_at": self.started_at,
            "platform": {
                "python": platform.python_version(),
                "machine": platform.machine(),
                "cpu_flags": _cpu_flags(),
            },
            "trace": {
                "path": str(self.trace_path),
                "format": self.trace_format,
                "sha256": self.trace_sha256,
                "lines": self.trace.lines,
                "requests": len(self.requests),
                "bad_lines": len(self.trace.bad),
                "skipped_rows": dict(self.trace.skipped),
                "length_policy": {
                    "scale": 1.0,
                    "max_input_tokens": None,
                    "max_output_tokens": None,
                },
            },
            "buckets": {"bounds": self.buckets.spec(), "labels": self.buckets.labels},
            "schedules": list(self.schedules),
            "options": dict(self.options),
            "reference": self.spec.name,
            "results_not_stored": self.dropped,
            "targets": {
                self.spec.name: {
                    "spec": self.spec.describe(),
                    "status": self.status,
                    "reason": self.reason,
                    **self.info,
                    "phases": self.phases,
                }
            },
        }

    def save_manifest(self) -> None:
        write_json(self.run_dir / MANIFEST, self.manifest())

    def finish(self, tolerance: float = 0.05) -> dict[str, Any]:
        """Write manifest, grades and summary from everything received (callable again when
        late results arrive: each call rewrites them)."""
        results = list(read_results(self.run_dir))
        # A phase some result names but no window covers (e.g. the target failed before the
        # first phase opened) gets the span of its results, so the summary counts them.
        for r in results:
            if r.phase not in self.phases:
                times = [x for x in (r.scheduled, r.sent, r.done) if x is not None]
                self.phases[r.phase] = {"start": min(times), "end": max(times)}
        self.save_manifest()
        name = self.spec.name
        targets = {
            name: {
                "status": self.status,
                "reason": self.reason,
                "cache_config": self.info.get("cache_config") or {},
                "phases": self.phases,
            }
        }
        specs = {r.id: grading_spec(r) for r in self.requests}
        # The CLI's own analysis (replay.run.runner.analyse): one pipeline for both drivers.
        return analyse(
            Analysis(
                run_dir=self.run_dir,
                targets=targets,
                series={name: self.series},
                reference=name,
                candidate=None,
                first_phase=next(iter(self.phases), ""),
                bucket_labels=self.buckets.labels,
                tolerance=tolerance,
                seed=self.seed,
                thresholds=Thresholds(tolerance=tolerance),
                manifest=self.manifest(),
                grading_specs=lambda ids: specs,
                verdict=False,
                grading=self.checkers,
                results=results,
                driver=self.driver,
            )
        ).to_json()

    def close(self) -> None:
        self._results.close()
        self._metrics.close()
