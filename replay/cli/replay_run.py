"""``replay`` and ``replay canary``: read and check the trace, resolve the targets, run them,
and say what happened (a table and a verdict, or the canary's Markdown and its exit code).
Each step is a function of the typed ``RunOptions``; the manifest saves those options, so
``--resume`` rebuilds the same run from them."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from replay.analysis.result_table import ResultTable
from replay.analysis.run_spec import BudgetSpec, LoadSpec, QualitySpec
from replay.analysis.schemas import Summary
from replay.analysis.verdict.advice import read_advice
from replay.cli.common import console, shown
from replay.cli.compose import SERIAL_PHASE, compose, refuse_combinations
from replay.cli.measuring import capacity_options, resolve_control, resolve_interleave
from replay.cli.run_directory import run_directory, run_options_of
from replay.cli.run_options import RunOptions
from replay.cli.skip_layers import with_skip_layers
from replay.core.buckets import Buckets
from replay.core.errors import InputError, RunDirError
from replay.core.event_loop import run_loop
from replay.core.exit_codes import ExitCode
from replay.core.schedule import (
    ClosedLoop,
    OpenLoop,
    PoissonOffsets,
    TraceOffsets,
)
from replay.core.slo import SloSpec, parse_slo
from replay.present.table import quality_table, summary_table
from replay.present.terminal import print_tables
from replay.run.config import RunConfig, load_for
from replay.run.exclude import exclusion, refuse_overlap
from replay.run.run_lock import holding
from replay.run.runner import Runner
from replay.run.session_history import check_mode
from replay.serving.targets import (
    BUILTIN_DTYPES,
    TargetSpec,
    emulate_fp8,
    emulate_kv,
    load_targets_config,
    parse_targets,
)
from replay.testmodel.named import resolve_model
from replay.traces.importers import StreamedTrace, scan, skipped_note, sniff_format
from replay.traces.sessions import ThinkTime, has_sessions, units

REDRAWS_PER_S = 2


class RichProgress:
    """Progress bars per target x phase, and a status line for slow steps."""

    def __init__(self, progress: Progress) -> None:
        self.p = progress
        self.tasks: dict[tuple[str, str], TaskID] = {}
        self.status_task = progress.add_task("", total=None)

    def status(self, message: str) -> None:
        self.p.update(self.status_task, description=shown(message))

    def phase(self, target: str, label: str, total: int) -> None:
        self.status(f"[{target}] replaying ({label})")  # status() escapes the brackets
        self.tasks[(target, label)] = self.p.add_task(shown(f"{target} {label}"), total=total)

    def advance(self, target: str, label: str, ok: bool) -> None:
        self.p.advance(self.tasks[(target, label)])


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise InputError(f"{option}: '{text}' is not a comma-separated list of integers") from None
    if not values or any(v < 1 for v in values):
        raise InputError(f"{option}: give positive integers, e.g. 1,4,16")
    return values


def build_schedules(
    trace: StreamedTrace,
    concurrency: str,
    rate: float | None,
    trace_times: bool,
    time_scale: float,
    max_in_flight: int,
    seed: int,
    sessions: bool = False,
) -> list[ClosedLoop | OpenLoop]:
    """The phases. With sessions, a schedule's items are sessions (a session's later turns
    follow its first), so open-loop arrivals are the sessions' first turns."""
    if rate is not None and trace_times:
        raise InputError("--rate and --trace-times are exclusive: pick one open-loop schedule")

    def arrivals() -> Iterator[float | None]:
        if sessions:
            return (u[0][1].t for u in units(enumerate(trace.iter_requests())))
        return (r.t for r in trace.iter_requests())

    items = sum(1 for _ in units(enumerate(trace.iter_requests()))) if sessions else trace.count
    try:
        # Offsets are computed as the schedule consumes them (no list as long as the trace).
        if trace_times:
            times = TraceOffsets(arrivals, trace.t_min or 0.0, time_scale)
            return [OpenLoop(times, max_in_flight, name=f"trace-x{time_scale:g}")]
        if rate is not None:
            return [
                OpenLoop(
                    PoissonOffsets(items, rate, seed),
                    max_in_flight,
                    name=f"poisson-{rate:g}rps",
                )
            ]
    except ValueError as exc:
        raise InputError(f"schedule: {exc}") from None
    return [ClosedLoop(c) for c in _int_list(concurrency, "--concurrency")]


def _warn_unscanned(path: Path, has_text: bool) -> None:
    """Text traces should pass through `replay trace anonymize` before they are shared."""
    from replay.tools.anonymize import is_scanned

    if has_text and path.suffix == ".jsonl" and not is_scanned(path):
        console.print(
            f"[yellow]warning:[/yellow] {shown(str(path))} was not anonymized by kvcanary; run "
            "`replay trace anonymize` (and `replay trace scan`) before sharing "
            "production traces"
        )


def load_trace(o: RunOptions) -> tuple[StreamedTrace, str]:
    """One streaming pass checks the whole trace (the runner re-reads it for each pass, so
    the replay's memory does not grow with the trace's length); with its resolved format."""
    path = o.trace_path
    fmt = sniff_format(path) if o.trace_format == "auto" and path.is_file() else o.trace_format
    keep = exclusion(o.exclude_ids)
    trace = scan(path, fmt, o.length_policy, o.on_bad_line, o.limit, keep=keep)  # type: ignore[arg-type]
    if keep is not None:
        console.print(
            f"--exclude-ids: left out {keep.dropped} request(s) listed in {shown(str(keep.source))}"
        )
        if keep.dropped < len(keep.ids):  # a file of another trace, or an edited one
            console.print(
                f"[yellow]warning:[/yellow] {len(keep.ids) - keep.dropped} id(s) it lists are "
                "not in this trace"
            )
    if trace.bad_count:
        console.print(
            f"[yellow]skipped {trace.bad_count} bad line(s)[/yellow] "
            f"(first: {shown(str(trace.first_bad))}); all are listed in bad_lines.jsonl"
        )
    if trace.skipped:
        console.print(f"[yellow]{skipped_note(trace.skipped)}[/yellow] (counted in the manifest)")
    if not trace.count:
        raise InputError(f"{path}: no valid requests to replay")
    _warn_unscanned(path, trace.has_text)
    return trace, fmt


def resolve_targets(o: RunOptions) -> list[TargetSpec]:
    """The targets, with the embedded test model where bf16 or a KV format names no other
    model (nor the name ``--skip-layers`` gives layers)."""
    config = load_targets_config(o.targets_file) if o.targets_file else None
    names = [n.strip() for n in o.targets.split(",")]
    model_dir = None if o.model_dir is None else resolve_model(o.model_dir, "replay --model")
    arm = o.skip_layers.partition("=")[0].strip() if o.skip_layers else None
    needs_default = any(n.lower() in BUILTIN_DTYPES or n == arm for n in names)
    if model_dir is None and needs_default and not (config and all(n in config for n in names)):
        from replay.testmodel.factory import ensure_default_model

        model_dir = ensure_default_model()
        console.print(f"using the embedded test model {shown(str(model_dir))}")
    specs = parse_targets(o.targets, model_dir.resolve() if model_dir else None, config, arm)
    if o.skip_layers:
        specs = with_skip_layers(specs, o.skip_layers)
    if o.emulate_kv:
        specs = [emulate_kv(s) for s in specs]
    elif o.emulate_fp8:
        specs = [emulate_fp8(s) for s in specs]
    for spec in specs:
        spec.api_key()  # a missing key variable is bad input, found before any server starts
    return specs


@dataclass(frozen=True)
class Plan:
    """What the options resolve to, all checked before a run directory is made."""

    trace: StreamedTrace
    trace_format: str
    buckets: Buckets
    schedules: list[ClosedLoop | OpenLoop]
    targets: list[TargetSpec]
    slo: SloSpec | None

    @classmethod
    def of(cls, o: RunOptions) -> Plan:
        trace, fmt = load_trace(o)
        buckets = Buckets.parse(o.bucket_spec)
        slo = parse_slo(o.slo, buckets.labels) if o.slo else None
        sessions = has_sessions(trace.iter_requests())
        schedules = build_schedules(
            trace,
            o.concurrency,
            o.rate,
            o.trace_times,
            o.time_scale,
            o.max_in_flight,
            o.seed,
            sessions,
        )
        if o.quality_pass == "serial" and schedules[0].label != SERIAL_PHASE:
            schedules = [ClosedLoop(1), *(s for s in schedules if s.label != SERIAL_PHASE)]
        refuse_combinations(o, schedules)
        specs = resolve_targets(o)
        refuse_overlap(trace.iter_requests(), specs, o.trace_path)
        return cls(trace, fmt, buckets, schedules, specs, slo)


def think_time(text: str, time_scale: float) -> ThinkTime:
    """``--think-time``: 'auto' (the trace's gaps between turns, scaled by --time-scale) or
    a fixed number of seconds."""
    if text.strip() == "auto":
        return ThinkTime(None, time_scale)
    try:
        seconds = float(text)
    except ValueError:
        raise InputError(f"--think-time: '{text}' is not 'auto' or a number of seconds") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise InputError(f"--think-time: '{text}' must be zero or more seconds")
    return ThinkTime(seconds, time_scale)


def run_config(
    o: RunOptions, plan: Plan, run_dir: Path, resume: bool, canary: bool = False
) -> RunConfig:
    return RunConfig(
        trace=plan.trace,
        trace_path=o.trace_path,
        trace_format=plan.trace_format,
        targets=plan.targets,
        schedules=plan.schedules,
        load=load_spec(o, plan),
        quality=quality_spec(o, plan),
        think=think_time(o.think_time, o.time_scale),
        run_dir=run_dir,
        length_policy=o.length_policy,
        capacity=capacity_options(o, canary),
        budget=BudgetSpec(
            max_errors=o.max_errors, max_error_rate=o.max_error_rate, drain_s=o.drain_s
        ),
        resume=resume,
        cli_options=o.to_json(),
        advice=read_advice(o.advice_path) if o.advice_path else None,
    )


def load_spec(o: RunOptions, plan: Plan) -> LoadSpec:
    """Who gets the load and how it is sent."""
    return load_for(
        plan.targets,
        plan.schedules,
        seed=o.seed,
        timeout_s=o.timeout_s,
        phase_timeout_s=o.phase_timeout_s,
        workers=o.workers,
        salt_phases=not o.share_prefix_cache,
        parallel_targets=o.parallel_targets,
        interleave=bool(o.interleave),
        block_size=o.block_size,
        session_history=check_mode(o.session_history, o.parallel_targets),
        stop_at_saturation=o.stop_at_saturation,
    )


def quality_spec(o: RunOptions, plan: Plan) -> QualitySpec:
    """How the run's answers are grouped, graded and judged (its buckets and SLOs as the plan
    checked them)."""
    return QualitySpec(
        buckets=plan.buckets.spec(),
        slo=plan.slo.text if plan.slo else None,
        reference=o.reference,
        candidate=o.candidate,
        calibrated=o.calibrated,
        control=bool(o.control),
        teacher_forced=not o.no_teacher_forced,
        quality_phase=SERIAL_PHASE if o.quality_pass == "serial" else None,
        tolerance=o.tolerance,
        alpha=o.alpha,
        min_pairs=o.min_pairs,
        required_capacity_ratio=o.required_capacity_ratio,
        accept_emulated=o.accept_emulated,
        systems_threshold=o.systems_threshold,
    )


def replay_run(opts: dict[str, Any], canary: bool, given: Mapping[str, str] | None = None) -> int:
    """The whole command: options in, exit code out. ``given``: the options the command line
    named (parameter name to flag)."""
    o, resuming = run_options_of(opts, given or {})
    with contextlib.ExitStack() as held:
        # One process a run directory (``run_lock``): a run being resumed is held before its
        # trace is read, so that a second --resume is refused at once; a new one once made.
        if resuming is not None:
            held.enter_context(holding(resuming.run_dir))
        plan = Plan.of(o)
        run_dir = run_directory(o, resuming)
        if resuming is None:
            held.enter_context(holding(run_dir))
        return _run_in(run_dir, o, plan, canary, resumed=resuming is not None)


def _run_in(run_dir: Path, o: RunOptions, plan: Plan, canary: bool, resumed: bool) -> int:
    """The run in ``run_dir``, held by this process, and what it says and exits with."""
    o = resolve_interleave(resolve_control(o, plan.trace), plan.trace, plan.targets)
    cfg = run_config(o, plan, run_dir, resume=resumed, canary=canary)
    console.print(
        f"run directory: [bold]{shown(str(run_dir))}[/bold] - {plan.trace.count} requests, "
        f"{len(plan.targets)} target(s), schedules {', '.join(s.label for s in plan.schedules)}"
    )
    try:
        runner, summary = _replay(cfg, canary, o)
        html, md = write_reports(run_dir)
    except RunDirError as err:  # a full disk: say which run --resume finishes
        raise err.in_run(str(run_dir)) from None
    if runner.interrupted:
        console.print(
            f"[yellow]interrupted[/yellow]: partial summary and report written; "
            f"continue with: replay --resume {shown(str(run_dir))}"
        )
        return ExitCode.SIGTERM if runner.stop.signal == signal.SIGTERM else ExitCode.INTERRUPTED
    if o.markdown_path:
        _copy(md, o.markdown_path)
    if canary:
        verdict = summary.verdict
        assert verdict is not None  # the runner always decides
        click.echo(md.read_text(encoding="utf-8"))
        for name, v in (summary.candidates or {}).items():
            console.print(f"candidate {shown(name)}: {v.verdict} (exit {v.exit_code})")
        console.print(
            f"verdict: {verdict.verdict} (exit {verdict.exit_code}); report: {shown(str(html))}"
        )
        return verdict.exit_code
    return _conclude(summary, o.max_error_rate, run_dir, html)


def _copy(md: Path, to: Path) -> None:
    try:
        to.write_text(md.read_text(encoding="utf-8"), encoding="utf-8")
    except OSError as exc:
        raise InputError(f"--markdown {to}: cannot write it ({exc}); {md} has it") from None


def _replay(cfg: RunConfig, canary: bool, o: RunOptions) -> tuple[Runner, Summary]:
    """Run with progress bars (none for the canary, whose stdout is its Markdown)."""
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=canary,
        disable=canary,
        # Each redraw holds the interpreter about a millisecond, and the drawing thread takes
        # it from the load loop whenever it wants it: at rich's default 10 a second, the
        # schedule lag's p99 at 1,000 requests/s was 1.6 ms in a terminal against 0.7 ms
        # without one (bench/README.md, open loop).
        refresh_per_second=REDRAWS_PER_S,
    ) as bar:
        runner = compose(cfg, o, RichProgress(bar))  # may raise ConfigError (--reference)
        summary = Summary.from_json(run_loop(runner.run()))
    return runner, summary


def _conclude(summary: Summary, max_error_rate: float, run_dir: Path, html: Path) -> int:
    """The tables, what failed, the verdict's headline, and the exit code they give."""
    verdict = summary.verdict
    assert verdict is not None  # the runner always decides
    tables = [summary_table(summary)]
    if summary.quality and summary.quality.phases:
        tables.append(quality_table(summary.quality))
    print_tables(tables)
    if summary.quality and summary.quality.phases:
        for note in summary.quality.notes:
            console.print(f"[yellow]note:[/yellow] {shown(note)}")
    failed = [(n, t.reason) for n, t in summary.targets.items() if t.status != "ok"]
    for name, reason in failed:
        console.print(f"[red]target {shown(name)} failed:[/red] {shown(str(reason))}")
    erring = target_errors(summary, max_error_rate)
    for name, why in erring:
        console.print(f"[red]target {shown(name)}:[/red] {shown(why)}")
    for line in saturation_lines(summary):
        console.print(shown(line))
    several = summary.candidates or {}
    for name, v in several.items() if several else [("", verdict)]:
        style = "green" if v.verdict == "keep" else "yellow"
        who = f"{name}: " if name else ""
        console.print(f"[bold {style}]{shown(who + v.headline)}[/bold {style}]")
    console.print(f"results: {shown(str(run_dir))}  report: {shown(str(html))}")
    erring_names = {n for n, _ in erring}
    if any(n not in erring_names for n, _ in failed):
        return ExitCode.TARGET_FAILED
    return ExitCode.TARGET_ERRORS if erring else ExitCode.OK


def saturation_lines(summary: Summary) -> list[str]:
    """A sweep's saturation per target, one line each: its knee and the highest load within
    the SLOs (the report's Load section has the curves)."""
    sat = summary.saturation
    if sat is None:
        return []
    out = []
    for name, t in sat.targets.items():
        knee = t.all.knee
        said = f"knee at {knee.phase} ({knee.reason})" if knee else "no knee within the sweep"
        ceiling = t.all.max_load_meeting_slo
        if ceiling is not None:
            said += f"; highest load within the SLOs: {ceiling.phase or 'none'}"
        out.append(f"saturation {name}: {said}")
    return out


def target_errors(
    summary: Summary | Mapping[str, Any], max_error_rate: float
) -> list[tuple[str, str]]:
    """Targets that ran but did not answer: stopped by their error budget, no request
    answered, or more than ``max_error_rate`` of them failed (over every phase)."""
    s = summary if isinstance(summary, Summary) else Summary.from_json(summary)
    out = []
    for name, t in s.targets.items():
        reason = t.reason or ""
        if reason.startswith("error budget spent"):
            out.append((name, reason))
            continue
        if t.status != "ok":
            continue  # could not be used at all: ExitCode.TARGET_FAILED says so
        phases = [p.all for p in t.phases.values()]
        # Requests a time limit or an interrupt left unsent, and those too long for the target,
        # are not the target's failures.
        total = sum(
            p.requests - p.errors_by_kind.get("cancelled", 0) - (p.skipped_too_long or 0)
            for p in phases
        )
        failed = total - sum(p.ok for p in phases)
        if total and failed == total:
            out.append((name, f"answered none of its {total} requests"))
        elif total and failed / total > max_error_rate:
            out.append(
                (
                    name,
                    f"{failed} of {total} requests failed, more than "
                    f"--max-error-rate {max_error_rate:g}",
                )
            )
    return out


def write_reports(run_dir: Path, results: ResultTable | None = None) -> tuple[Path, Path]:
    from replay.present.report import write_reports

    html, md = write_reports(run_dir, results)
    return Path(html), Path(md)
