"""kvcanary's options on Locust's command line and web UI, and one test's validated
``Config``: what the master reads at the start of every test (the web UI may have changed
the options since the last one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from locust.env import Environment

from replay.core.buckets import DEFAULT_BOUNDS, Buckets
from replay.core.errors import InputError, KvcanaryError
from replay.core.slo import SloSpec, parse_slo
from replay.locust.events import DEFAULT_ITL_EVENTS
from replay.locust.plans import Constant, LoadPlan, StepSweep, TraceTimes, parse_levels
from replay.locust.recorder import DEFAULT_MAX_RESULTS
from replay.locust.target import resolve_target
from replay.run.rundir import file_digest
from replay.serving.targets import TargetSpec
from replay.traces.importers import StreamedTrace, scan, sniff_format

SHAPES = ("users", "step", "trace")


def parsed_options(env: Environment) -> Any:
    """Locust's parsed options: present once the command line is read (before any hook)."""
    if env.parsed_options is None:
        raise RuntimeError("Locust gave this environment no parsed options")
    return env.parsed_options


def add_arguments(parser: Any) -> None:
    """kvcanary's options, on Locust's command line and (except the file of targets) in the
    web UI's start form, where they can be changed before each test. (Not an argument group:
    only the parser's own ``add_argument`` marks options for the web UI.)"""
    add = parser.add_argument
    _add_trace_and_target(add)
    _add_shapes(add)
    _add_run(add)
    _add_budgets(add)


def _add_trace_and_target(add: Callable[..., Any]) -> None:
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


def _add_shapes(add: Callable[..., Any]) -> None:
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


def _add_run(add: Callable[..., Any]) -> None:
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
        "--kvc-slo",
        default="",
        help="Service goals, as replay's --slo (ttft=2s,itl=80ms,e2e=30s; per bucket after "
        "a ';'): SLO attainment and goodput in the run directory's summary",
    )
    add(
        "--kvc-itl-events",
        type=int,
        default=DEFAULT_ITL_EVENTS,
        help="At most this many itl events per request (sampled evenly)",
    )


def _add_budgets(add: Callable[..., Any]) -> None:
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
    """The options of one test, validated (the master's view). ``trace`` is the trace as
    checked by one streaming pass: its counts, not its requests."""

    trace_path: Path
    trace_format: str
    trace: StreamedTrace
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
    slo: SloSpec | None = None


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
    """This test's options, checked; KvcanaryError names the first one that is wrong."""
    opts = parsed_options(env)
    path = Path(str(opts.kvc_trace))
    fmt = sniff_format(path) if path.is_file() else "v1"
    limit = max(0, int(opts.kvc_limit))
    # Every line is checked, the requests are not kept: a trace need not fit in memory.
    trace = scan(path, fmt, limit=limit or None)
    spec = resolve_target(str(opts.kvc_target), env.host, str(opts.kvc_targets_file) or None)
    spec.api_key()  # a missing key variable is found before anything is sent
    plan = load_plan(opts, mode, common)
    buckets = Buckets.parse(opts.kvc_buckets)
    return Config(
        trace_path=path,
        trace_format=fmt,
        trace=trace,
        sha256=file_digest(path),
        limit=limit,
        buckets=buckets,
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
        slo=_slo(str(opts.kvc_slo), buckets),
    )


def _slo(text: str, buckets: Buckets) -> SloSpec | None:
    try:
        return parse_slo(text, buckets.labels) if text.strip() else None
    except InputError as exc:  # the same grammar as replay's --slo, named as this option
        raise KvcanaryError(str(exc).replace("--slo", "--kvc-slo")) from None


def _at_least(value: int, low: int, option: str) -> int:
    if value < low:
        raise KvcanaryError(f"{option}: {value} is below {low}")
    return value


def _rate(value: float) -> float:
    if not 0 <= value <= 1:
        raise KvcanaryError(f"--kvc-max-error-rate: {value:g} is not between 0 and 1")
    return value
