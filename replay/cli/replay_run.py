"""``replay`` and ``replay canary``: read and check the trace, resolve the targets, run them,
and say what happened (a table and a verdict, or the canary's Markdown and its exit code).
The options resolve once into the run's ``RunSpec`` (``run_spec``), which the manifest records
and ``--resume`` continues (replay/cli/run_directory.py)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Mapping
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
from replay.analysis.schemas import Summary
from replay.cli.common import console, shown
from replay.cli.compose import compose
from replay.cli.measuring import resolve_control, resolve_interleave
from replay.cli.plan import Plan
from replay.cli.run_directory import run_directory, run_options_of
from replay.cli.run_options import RunOptions
from replay.cli.run_spec import run_config
from replay.core.errors import InputError, RunDirError
from replay.core.event_loop import run_loop
from replay.core.exit_codes import ExitCode
from replay.present.table import quality_table, summary_table
from replay.present.terminal import print_tables
from replay.run.run_config import RunConfig
from replay.run.runner import Runner
from replay.rundir.run_lock import holding

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
        return _run_in(run_dir, o, plan, canary, resuming is not None, given or {})


def _run_in(
    run_dir: Path, o: RunOptions, plan: Plan, canary: bool, resumed: bool, given: Mapping[str, str]
) -> int:
    """The run in ``run_dir``, held by this process, and what it says and exits with."""
    o = resolve_interleave(resolve_control(o, plan.trace), plan.trace, plan.targets)
    cfg = run_config(o, plan, run_dir, resume=resumed, canary=canary, given=given)
    console.print(
        f"run directory: [bold]{shown(str(run_dir))}[/bold] - {plan.trace.count} requests, "
        f"{len(plan.targets)} target(s), schedules {', '.join(s.label for s in plan.schedules)}"
    )
    try:
        runner, summary = _replay(cfg, canary)
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


def _replay(cfg: RunConfig, canary: bool) -> tuple[Runner, Summary]:
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
        runner = compose(cfg, RichProgress(bar))  # may raise ConfigError (--reference)
        summary = run_loop(runner.run())
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


def target_errors(s: Summary, max_error_rate: float) -> list[tuple[str, str]]:
    """Targets that ran but did not answer: stopped by their error budget, no request
    answered, or more than ``max_error_rate`` of them failed (over every phase)."""
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
