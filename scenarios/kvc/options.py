"""kvcanary's options on Locust's command line and web UI, and one test's validated
``Config`` (``replay/locust/config.py``): what the master reads at the start of every test
(the web UI may have changed the options since the last one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from locust.env import Environment

from replay.core.buckets import DEFAULT_BOUNDS
from replay.locust.config import Config, config_of
from replay.locust.events import DEFAULT_ITL_EVENTS
from replay.locust.recorder import DEFAULT_MAX_RESULTS

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
    add(
        "--kvc-reassign",
        default="on",
        choices=["on", "off"],
        help="Distributed: a lost worker's unsent requests go to the live workers (off: "
        "recorded as unavailable)",
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


def read_config(env: Environment, mode: str, common: bool) -> Config:
    """This test's options, checked; KvcanaryError names the first one that is wrong."""
    return config_of(parsed_options(env), env.host, mode, common)
