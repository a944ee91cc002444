"""One Locust test's validated ``Config``, read from kvcanary's options on Locust's command line
(``scenarios/kvc/options.py`` declares them and hands their parsed values here), and the
``RunSpec`` it describes: the same record the CLI builds for the same trace, target and
options (``replay/analysis/run_spec.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.analysis.run_spec import (
    BudgetSpec,
    LoadSpec,
    QualitySpec,
    RunDirSpec,
    RunSpec,
    TargetsSpec,
    TraceSpec,
)
from replay.core.buckets import Buckets
from replay.core.credentials import redact
from replay.core.errors import InputError, KvcanaryError
from replay.core.slo import SloSpec, parse_slo
from replay.locust.plans import Constant, LoadPlan, StepSweep, TraceTimes, parse_levels
from replay.locust.target import resolve_target
from replay.rundir.files import file_digest
from replay.serving.targets import TargetSpec
from replay.traces.importers import StreamedTrace, scan, sniff_format


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
    # A lost worker's unsent requests go to the live workers (off: recorded as unavailable).
    reassign: bool = True
    # The target as --kvc-target named it (credentials redacted), and its --kvc-targets-file.
    target_given: str = ""
    targets_file: str | None = None

    def run_spec(self, run_dir: Path, shards: int) -> RunSpec:
        """The run this test is, as the CLI would describe it; ``shards``: the workers that
        send it. What Locust has no equivalent of keeps the field's default (``RunSpec``)."""
        return RunSpec(
            trace=TraceSpec(
                path=str(self.trace_path),
                format=self.trace_format,
                sha256=self.sha256,
                requests=self.trace.count,
                limit=self.limit or None,
            ),
            targets=TargetsSpec(given=self.target_given, targets_file=self.targets_file),
            load=LoadSpec(
                targets=(self.spec.name,),
                schedules=tuple(self.plan.labels),
                **{"time_scale": self.time_scale, **self.plan.load_fields()},
                seed=self.seed,
                timeout_s=self.timeout_s,
                workers=shards,
                loop=self.loop,
            ),
            quality=QualitySpec(
                buckets=self.buckets.spec(),
                slo=self.slo.text if self.slo else None,
                checkers=self.checkers,
            ),
            budget=BudgetSpec(
                max_errors=self.max_errors or None,
                max_error_rate=self.max_error_rate,
                max_results=self.max_results or None,
            ),
            run_dir=RunDirSpec(path=str(run_dir)),
        )


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


def config_of(opts: Any, host: str | None, mode: str, common: bool) -> Config:
    """One test's options (Locust's parsed options, its host), checked; KvcanaryError names
    the first one that is wrong."""
    path = Path(str(opts.kvc_trace))
    fmt = sniff_format(path) if path.is_file() else "v1"
    limit = max(0, int(opts.kvc_limit))
    # Every line is checked, the requests are not kept: a trace need not fit in memory.
    trace = scan(path, fmt, limit=limit or None)
    spec = resolve_target(str(opts.kvc_target), host, str(opts.kvc_targets_file) or None)
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
        reassign=getattr(opts, "kvc_reassign", "on") == "on",
        target_given=redact(str(opts.kvc_target)),
        targets_file=str(opts.kvc_targets_file) or None,
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
