"""``replay``: the command line. Parses options, shows progress, prints the table.

Exit codes: 0 every target served the whole run; 2 bad input or usage; 3 at least one target
failed (did not start, or serves something other than its spec); 130 interrupted.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from replay import __version__
from replay.analysis.schemas import Summary
from replay.analysis.verdict import Thresholds
from replay.core.buckets import DEFAULT_BOUNDS, Buckets
from replay.core.errors import InputError, KvcanaryError, TraceError
from replay.core.importers import (
    FORMAT_HELP,
    LengthPolicy,
    StreamedTrace,
    scan,
    skipped_note,
    sniff_format,
    stream,
)
from replay.core.schedule import ClosedLoop, OpenLoop, PoissonOffsets, TraceOffsets
from replay.core.trace import CheckStats
from replay.present.table import compare_table, quality_table, summary_table
from replay.run.exclude import exclusion, refuse_overlap
from replay.run.rundir import file_digest, new_run_dir
from replay.run.runner import RunConfig, Runner
from replay.serving.targets import emulate_fp8, load_targets_config, parse_targets

EXIT_OK, EXIT_INPUT, EXIT_TARGET_FAILED, EXIT_INTERRUPTED = 0, 2, 3, 130
# A target that ran but answered none of its requests, more than --max-error-rate of them,
# or was stopped by its error budget: a CI step must not mistake that run for a good one.
EXIT_TARGET_ERRORS = 4
T = TypeVar("T")

console = Console(stderr=True)


class RichProgress:
    """Progress bars per target x phase, and a status line for slow steps."""

    def __init__(self, progress: Progress) -> None:
        self.p = progress
        self.tasks: dict[tuple[str, str], TaskID] = {}
        self.status_task = progress.add_task("", total=None)

    def status(self, message: str) -> None:
        self.p.update(self.status_task, description=message)

    def phase(self, target: str, label: str, total: int) -> None:
        self.status(f"[{target}] replaying ({label})")
        self.tasks[(target, label)] = self.p.add_task(f"{target} {label}", total=total)

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
) -> list[ClosedLoop | OpenLoop]:
    if rate is not None and trace_times:
        raise InputError("--rate and --trace-times are exclusive: pick one open-loop schedule")
    try:
        # Offsets are computed as the schedule consumes them (no list as long as the trace).
        if trace_times:
            times = TraceOffsets(
                lambda: (r.t for r in trace.iter_requests()), trace.t_min or 0.0, time_scale
            )
            return [OpenLoop(times, max_in_flight, name=f"trace-x{time_scale:g}")]
        if rate is not None:
            return [
                OpenLoop(
                    PoissonOffsets(trace.count, rate, seed),
                    max_in_flight,
                    name=f"poisson-{rate:g}rps",
                )
            ]
    except ValueError as exc:
        raise InputError(f"schedule: {exc}") from None
    return [ClosedLoop(c) for c in _int_list(concurrency, "--concurrency")]


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run the replay on uvloop where it is installed: the client then spends about 0.6 of
    the CPU per streamed token, and its timestamps lag less at high concurrency (bench/).
    Same semantics as ``asyncio.run`` (an ``asyncio.Runner``; Ctrl-C cancels the run)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _install_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C (asyncio cancels the run, ``finally`` blocks stop the
    servers we started)."""

    def handler(signum: int, frame: Any) -> None:
        signal.raise_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, handler)


def _guard(fn: Callable[[], int]) -> NoReturn:
    try:
        code = fn()
    except InputError as exc:
        console.print(f"[red]error:[/red] {exc}")
        code = EXIT_INPUT
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/yellow]: results so far are in the run directory")
        code = EXIT_INTERRUPTED
    except KvcanaryError as exc:
        console.print(f"[red]error:[/red] {exc}")
        code = EXIT_TARGET_FAILED
    sys.exit(code)


RUN_OPTIONS = [
    click.option(
        "--trace",
        "trace_path",
        type=click.Path(path_type=Path),
        help="Trace file: kvcanary v1 JSONL, or a production trace (see --trace-format).",
    ),
    click.option(
        "--trace-format",
        default="auto",
        show_default=True,
        help=FORMAT_HELP,
    ),
    click.option(
        "--targets",
        default="bf16,fp8",
        show_default=True,
        help="Comma-separated: bf16/fp8 (local servers of --model), name=URL, or names "
        "from --targets-file.",
    ),
    click.option(
        "--targets-file",
        type=click.Path(path_type=Path, exists=True, dir_okay=False),
        help="TOML with [targets.NAME] tables (see scenarios/targets.example.toml).",
    ),
    click.option(
        "--model",
        "model_dir",
        type=click.Path(path_type=Path),
        help="Model for the built-in bf16/fp8 local targets [default: the embedded "
        "test model: `replay model` prints it].",
    ),
    click.option(
        "--concurrency",
        default="4",
        show_default=True,
        help="Closed loop: requests in flight; a list sweeps levels (1,4,16).",
    ),
    click.option("--rate", type=float, help="Open loop: Poisson arrivals at this many requests/s."),
    click.option("--trace-times", is_flag=True, help="Open loop at the trace's own timestamps."),
    click.option(
        "--time-scale",
        default=1.0,
        show_default=True,
        help="With --trace-times: multiply gaps (0.5 = twice as fast).",
    ),
    click.option(
        "--max-in-flight",
        default=0,
        show_default=True,
        help="Open loop: cap on requests in flight (0 = none).",
    ),
    click.option(
        "--buckets",
        "bucket_spec",
        default=DEFAULT_BOUNDS,
        show_default=True,
        help="Context-length bucket bounds in tokens.",
    ),
    click.option(
        "--on-bad-line",
        type=click.Choice(["fail", "skip"]),
        default="fail",
        show_default=True,
        help="A bad trace line stops the run, or is skipped and listed.",
    ),
    click.option(
        "--length-scale",
        default=1.0,
        show_default=True,
        help="Length-only traces: scale input/output lengths (fit a small model).",
    ),
    click.option("--max-input-tokens", type=int, help="Length-only traces: cap prompt length."),
    click.option("--max-output-tokens", type=int, help="Length-only traces: cap output length."),
    click.option("--limit", type=int, help="Replay only the first N requests."),
    click.option(
        "--exclude-ids",
        type=click.Path(path_type=Path, dir_okay=False),
        help="Leave out the request ids this file lists (one a line), e.g. the "
        "calibration_ids.txt of `kvcal sample`.",
    ),
    click.option(
        "--parallel-targets",
        is_flag=True,
        help="Run targets at the same time (default: one after another, fair on shared hardware).",
    ),
    click.option(
        "--timeout",
        "timeout_s",
        default=600.0,
        show_default=True,
        help="Per-request timeout, seconds.",
    ),
    click.option(
        "--phase-timeout",
        "phase_timeout_s",
        default=3600.0,
        show_default=True,
        help="Time limit per phase; unsent requests are recorded as cancelled.",
    ),
    click.option(
        "--reference", help="Target the others are compared with [default: bf16, else the first]."
    ),
    click.option(
        "--candidate",
        help="Target judged against the reference (FP8 at scale 1.0) "
        "[default: a targets-file `role`, else the first other target that is not "
        "calibrated].",
    ),
    click.option(
        "--calibrated",
        help="Target with calibrated scales [default: a targets-file "
        "`role`, else a name with the word cal, calibrated or kvcal, as fp8-cal].",
    ),
    click.option(
        "--emulate-fp8",
        is_flag=True,
        help="Serve local fp8 targets with a BF16 cache and kvcal's E4M3 round trip of "
        "K/V at the cache write (where the CPU cannot serve FP8): quality "
        "evidence only; capacity and speed are BF16's.",
    ),
    click.option(
        "--accept-emulated",
        is_flag=True,
        help="Let the verdict rest on emulated FP8 targets (otherwise it refuses).",
    ),
    click.option(
        "--control/--no-control",
        default=None,
        help="Replay the reference a second time (A/A): the noise floor of every "
        "metric [default: on in `canary` when the trace has requests without a "
        "check, whose grades are derived from the reference's answers; off "
        "otherwise].",
    ),
    click.option(
        "--no-teacher-forced",
        is_flag=True,
        help="Skip scoring the reference's answers under each target (prompt_logprobs).",
    ),
    click.option(
        "--tolerance",
        default=0.05,
        show_default=True,
        help="Quality drop (pass-rate points, 0.05 = 5) a bucket must be able to detect.",
    ),
    click.option(
        "--share-prefix-cache",
        is_flag=True,
        help="Let a phase reuse the prefix cache earlier phases filled (default: a "
        "cache salt per phase keeps phases comparable).",
    ),
    click.option(
        "--out",
        "out_dir",
        default=Path("reports"),
        type=click.Path(path_type=Path),
        show_default=True,
        help="Where run directories go.",
    ),
    click.option("--run-id", help="Name of the run directory [default: timestamp]."),
    click.option("--seed", default=0, show_default=True, help="Sampling and schedule seed."),
    click.option(
        "--min-pairs",
        default=20,
        show_default=True,
        help="Graded pairs a bucket needs before it counts as evidence.",
    ),
    click.option(
        "--required-capacity-ratio",
        default=1.5,
        show_default=True,
        help="FP8/BF16 KV-cache capacity that counts as the gain.",
    ),
    click.option(
        "--alpha", default=0.05, show_default=True, help="Significance level for a repeatable loss."
    ),
    click.option(
        "--max-errors",
        type=click.IntRange(min=1),
        help="Stop sending to a target after this many failed requests (it fails).",
    ),
    click.option(
        "--max-error-rate",
        default=0.05,
        show_default=True,
        type=click.FloatRange(0.0, 1.0),
        help="A target with more failed requests than this share (after 20) gets no "
        "more and fails; replay then exits 4. 1 turns it off.",
    ),
    click.option(
        "--drain",
        "drain_s",
        default=30.0,
        show_default=True,
        help="On Ctrl-C: seconds in-flight requests get to finish.",
    ),
    click.option(
        "--resume",
        "resume_dir",
        type=click.Path(path_type=Path, file_okay=False, exists=True),
        help="Continue an interrupted or killed run in this run directory (its "
        "options are read from its manifest).",
    ),
    click.option(
        "--markdown",
        "markdown_path",
        type=click.Path(path_type=Path),
        help="Also write the Markdown summary here (for a PR comment).",
    ),
]


def run_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(RUN_OPTIONS):
        f = option(f)
    return f


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@run_options
@click.version_option(__version__, prog_name="kvcanary replay")
@click.pass_context
def main(ctx: click.Context, /, **opts: Any) -> None:
    """Replay a trace against BF16 and FP8 vLLM servers, bucketed by context length.

    \b
    replay --trace traces/sample.jsonl --targets bf16,fp8
    replay --trace prod.jsonl --targets bf16=http://127.0.0.1:8000,fp8=http://127.0.0.1:8001
    """
    if ctx.invoked_subcommand is not None:
        return
    if opts["trace_path"] is None and opts["resume_dir"] is None:
        click.echo(ctx.get_help())
        ctx.exit(EXIT_INPUT)
    _install_sigterm()
    _guard(lambda: _run(opts, canary=False))


@main.command("canary")
@run_options
def canary(**opts: Any) -> None:
    """Replay, then apply the stop rule: quiet, Markdown verdict on stdout, exit code per
    verdict (0 keep, 10 calibrate, 11 per-head/skip layers, 12 reject, 13 insufficient
    evidence; 2 bad input, 130 interrupted)."""
    if opts["trace_path"] is None and opts["resume_dir"] is None:
        raise click.UsageError("--trace is required")
    _install_sigterm()
    _guard(lambda: _run(opts, canary=True))


def _warn_unscanned(path: Path, has_text: bool) -> None:
    """Text traces should pass through `replay trace anonymize` before they are shared."""
    from replay.tools.anonymize import is_scanned

    if has_text and path.suffix == ".jsonl" and not is_scanned(path):
        console.print(
            f"[yellow]warning:[/yellow] {path} was not anonymized by kvcanary; run "
            "`replay trace anonymize` (and `replay trace scan`) before sharing "
            "production traces"
        )


def _resume_options(run_dir: Path) -> dict[str, Any]:
    """The options the interrupted run was started with, from its manifest."""
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
        saved = dict(manifest["cli_options"])
    except (OSError, ValueError, KeyError, TypeError):
        raise InputError(
            f"--resume {run_dir}: no readable manifest.json with the run's "
            "options; is this a kvcanary run directory?"
        ) from None
    for key in (
        "trace_path",
        "targets_file",
        "model_dir",
        "out_dir",
        "markdown_path",
        "exclude_ids",
    ):
        if saved.get(key) is not None:
            saved[key] = Path(saved[key])
    saved["resume_dir"], saved["trace_sha256"] = run_dir, manifest["trace"]["sha256"]
    return saved


def _run(o: dict[str, Any], canary: bool) -> int:
    if o.get("resume_dir") is not None:
        o = _resume_options(o["resume_dir"])
    trace_path: Path = o["trace_path"]
    policy = LengthPolicy(o["length_scale"], o["max_input_tokens"], o["max_output_tokens"])
    fmt = (
        sniff_format(trace_path)
        if o["trace_format"] == "auto" and trace_path.is_file()
        else o["trace_format"]
    )
    # One streaming pass checks the whole trace; the runner re-reads it for each pass, so the
    # replay's memory does not grow with the trace's length.
    keep = exclusion(o.get("exclude_ids"))
    trace = scan(trace_path, fmt, policy, o["on_bad_line"], o["limit"], keep=keep)
    if keep is not None:
        console.print(f"--exclude-ids: left out {keep.dropped} request(s) listed in {keep.source}")
    if trace.bad_count:
        console.print(
            f"[yellow]skipped {trace.bad_count} bad line(s)[/yellow] "
            f"(first: {trace.first_bad}); all are listed in bad_lines.jsonl"
        )
    if trace.skipped:
        console.print(f"[yellow]{skipped_note(trace.skipped)}[/yellow] (counted in the manifest)")
    if not trace.count:
        raise InputError(f"{trace_path}: no valid requests to replay")
    _warn_unscanned(trace_path, trace.has_text)
    buckets = Buckets.parse(o["bucket_spec"])
    schedules = build_schedules(
        trace,
        o["concurrency"],
        o["rate"],
        o["trace_times"],
        o["time_scale"],
        o["max_in_flight"],
        o["seed"],
    )
    config = load_targets_config(o["targets_file"]) if o["targets_file"] else None
    model_dir = o["model_dir"]
    needs_default = any(n.strip() in ("bf16", "fp8") for n in o["targets"].split(","))
    if (
        model_dir is None
        and needs_default
        and not (config and all(n.strip() in config for n in o["targets"].split(",")))
    ):
        from replay.testmodel.factory import ensure_default_model

        model_dir = ensure_default_model()
        console.print(f"using the embedded test model {model_dir}")
    specs = parse_targets(o["targets"], model_dir.resolve() if model_dir else None, config)
    if o.get("emulate_fp8"):
        specs = [emulate_fp8(s) for s in specs]
    for spec in specs:
        spec.api_key()  # a missing key variable is bad input, found before any server starts
    refuse_overlap(trace.iter_requests(), specs, trace_path)
    if o.get("resume_dir") is not None:
        run_dir = o["resume_dir"]
        if file_digest(trace_path) != o["trace_sha256"]:
            raise InputError(
                f"--resume: {trace_path} changed since the run started (its "
                "sha256 differs); resuming would mix two traces"
            )
    else:
        run_dir = new_run_dir(o["out_dir"], o["run_id"])
    control = o.get("control")
    if control is None:
        # Derived grades need their own noise floor: how often the reference agrees with
        # itself. It costs one more pass of the reference (the README says so).
        control = canary and trace.unlabeled > 0
        if control:
            console.print(
                f"{trace.unlabeled} request(s) have no check: their grades come from "
                "the reference's answers, so the reference is replayed a second time "
                "for their noise floor (A/A; --no-control to skip)"
            )
        o = {**o, "control": control}  # saved resolved: a resume must replay the same arms
    # Runs saved before the error budget existed resume with its defaults.
    max_error_rate = float(o.get("max_error_rate", 0.05))
    cfg = RunConfig(
        trace=trace,
        trace_path=trace_path,
        trace_format=fmt,
        targets=specs,
        schedules=schedules,
        buckets=buckets,
        run_dir=run_dir,
        length_policy=policy,
        parallel_targets=o["parallel_targets"],
        timeout_s=o["timeout_s"],
        phase_timeout_s=o["phase_timeout_s"],
        seed=o["seed"],
        salt_phases=not o["share_prefix_cache"],
        reference=o["reference"],
        candidate=o.get("candidate"),
        calibrated=o.get("calibrated"),
        control=control,
        teacher_forced=not o["no_teacher_forced"],
        tolerance=o["tolerance"],
        thresholds=Thresholds(
            tolerance=o["tolerance"],
            alpha=o["alpha"],
            min_pairs=o["min_pairs"],
            required_capacity_ratio=o["required_capacity_ratio"],
            max_error_rate=max_error_rate,
            accept_emulated=bool(o.get("accept_emulated")),
        ),
        max_errors=o.get("max_errors"),
        max_error_rate=max_error_rate,
        drain_s=o["drain_s"],
        resume=o.get("resume_dir") is not None,
        cli_options={
            k: str(v) if isinstance(v, Path) else v
            for k, v in o.items()
            if k not in ("resume_dir", "trace_sha256")
        },
    )
    console.print(
        f"run directory: [bold]{run_dir}[/bold] - {trace.count} requests, "
        f"{len(specs)} target(s), schedules {', '.join(s.label for s in schedules)}"
    )
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=canary,
        disable=canary,
    ) as bar:
        runner = Runner(cfg, RichProgress(bar))  # may raise ConfigError (--reference)
        summary = Summary.from_json(run_loop(runner.run()))
    html, md = _write_reports(run_dir)
    if runner.interrupted:
        console.print(
            f"[yellow]interrupted[/yellow]: partial summary and report written; "
            f"continue with: replay --resume {run_dir}"
        )
        return EXIT_INTERRUPTED
    if o["markdown_path"]:
        Path(o["markdown_path"]).write_text(md.read_text(encoding="utf-8"), encoding="utf-8")
    verdict = summary.verdict
    assert verdict is not None  # the runner always decides
    if canary:
        click.echo(md.read_text(encoding="utf-8"))
        console.print(f"verdict: {verdict.verdict} (exit {verdict.exit_code}); report: {html}")
        return verdict.exit_code
    out = Console()
    if not out.is_terminal:
        out = Console(width=170)
    out.print(summary_table(summary))
    if summary.quality and summary.quality.phases:
        out.print(quality_table(summary.quality))
        for note in summary.quality.notes:
            console.print(f"[yellow]note:[/yellow] {note}")
    failed = [(n, t.reason) for n, t in summary.targets.items() if t.status != "ok"]
    for name, reason in failed:
        console.print(f"[red]target {name} failed:[/red] {reason}")
    erring = target_errors(summary, max_error_rate)
    for name, why in erring:
        console.print(f"[red]target {name}:[/red] {why}")
    style = "green" if verdict.verdict == "keep" else "yellow"
    console.print(f"[bold {style}]{verdict.headline}[/bold {style}]")
    console.print(f"results: {run_dir}  report: {html}")
    erring_names = {n for n, _ in erring}
    if any(n not in erring_names for n, _ in failed):
        return EXIT_TARGET_FAILED
    return EXIT_TARGET_ERRORS if erring else EXIT_OK


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
            continue  # could not be used at all: EXIT_TARGET_FAILED says so
        phases = [p.all for p in t.phases.values()]
        # Requests a time limit or an interrupt left unsent are not the target's failures.
        total = sum(p.requests - p.errors_by_kind.get("cancelled", 0) for p in phases)
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


def _write_reports(run_dir: Path) -> tuple[Path, Path]:
    from replay.present.report import write_reports

    html, md = write_reports(run_dir)
    return Path(html), Path(md)


@main.command("report")
@click.argument("run_dir", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="The run's trace, for its checks, when it is no longer where the manifest "
    "says (it must be the same file).",
)
@click.option(
    "--reanalyse",
    is_flag=True,
    help="Grade and summarize again from results.jsonl even when summary.json exists.",
)
def report_cmd(run_dir: Path, trace_path: Path | None, reanalyse: bool) -> None:
    """Re-render report.html and report.md from a run directory's saved results. A run with
    no summary.json (stopped or killed before its analysis, or whose analysis failed) is
    graded and summarized first, from results.jsonl and manifest.json."""

    def run() -> int:
        from replay.run.runner import reanalyse as analyse_again

        if reanalyse or not (run_dir / "summary.json").exists():
            if not (run_dir / "manifest.json").exists():
                raise InputError(
                    f"{run_dir}: no summary.json and no manifest.json; is this a "
                    "kvcanary run directory?"
                )
            analyse_again(run_dir, trace_path)
            console.print(f"graded and summarized {run_dir} from its results")
        for path in _write_reports(run_dir):
            click.echo(str(path))
        return EXIT_OK

    _guard(run)


@main.command("export")
@click.argument("run_dir", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["csv", "parquet"]),
    default="csv",
    show_default=True,
    help="File format of the tables.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path, file_okay=False),
    help="Folder for the tables [default: RUN_DIR/export].",
)
def export_cmd(run_dir: Path, fmt: str, output: Path | None) -> None:
    """Write the run as tables (results, grades, metrics, teacher_forced), the same ones
    replay.load_run(RUN_DIR) returns as DataFrames."""

    def run() -> int:
        from replay.run.rundata import export_run

        for path in export_run(run_dir, output or run_dir / "export", fmt):
            click.echo(str(path))
        return EXIT_OK

    _guard(run)


@main.command("compare")
@click.argument("run_a", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.argument("run_b", type=click.Path(path_type=Path, file_okay=False, exists=True))
def compare_cmd(run_a: Path, run_b: Path) -> None:
    """Compare two runs (before/after calibration): verdicts, pass rates, latency per bucket."""

    def run() -> int:
        summaries = []
        for d in (run_a, run_b):
            try:
                doc = json.loads((d / "summary.json").read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise InputError(f"{d}: cannot read summary.json: {exc}") from None
            summaries.append(Summary.from_json(doc, where=str(d / "summary.json")))
        out = Console()
        if not out.is_terminal:
            out = Console(width=170)
        out.print(compare_table(summaries[0], summaries[1], str(run_a), str(run_b)))
        return EXIT_OK

    _guard(run)


@main.group()
def trace() -> None:
    """Validate and import traces."""


@trace.command("validate")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--format", "fmt", default="auto", show_default=True, help=FORMAT_HELP)
def trace_validate(path: Path, fmt: str) -> None:
    """Check every line of a trace; list each bad one with its field and reason."""

    def run() -> int:
        bad: list[int] = [0]  # streamed: each bad line is printed as it is found
        stats = CheckStats()

        def report(_k: int, err: TraceError) -> None:
            bad[0] += 1
            click.echo(str(err))

        valid = sum(1 for _ in stream(path, fmt, on_bad_line="skip", bad=report, stats=stats))
        note = f", {skipped_note(stats.skipped)}" if stats.skipped else ""
        click.echo(f"{path}: {valid} valid request(s), {bad[0]} bad line(s){note}")
        return EXIT_INPUT if bad[0] else EXIT_OK

    _guard(run)


@trace.command("import")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--format", "fmt", default="auto", show_default=True, help=FORMAT_HELP)
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True)
@click.option("--length-scale", default=1.0, show_default=True)
@click.option("--max-input-tokens", type=int)
@click.option("--max-output-tokens", type=int)
@click.option("--on-bad-line", type=click.Choice(["fail", "skip"]), default="fail")
def trace_import(
    path: Path,
    fmt: str,
    output: Path,
    length_scale: float,
    max_input_tokens: int | None,
    max_output_tokens: int | None,
    on_bad_line: str,
) -> None:
    """Convert a production trace (any --format) into kvcanary's v1 format."""

    def run() -> int:
        policy = LengthPolicy(length_scale, max_input_tokens, max_output_tokens)
        stats, bad = CheckStats(), [0]
        # Streamed into a temporary file beside the output, renamed when the whole trace
        # checked: a bad line in "fail" mode leaves no half-written output behind.
        tmp = output.with_name(output.name + ".part")
        try:
            with tmp.open("w", encoding="utf-8") as fh:
                for req in stream(
                    path,
                    fmt,
                    policy,
                    on_bad_line,  # type: ignore[arg-type]
                    lambda _k, _e: bad.__setitem__(0, bad[0] + 1),
                    stats,
                ):
                    fh.write(req.model_dump_json(exclude_none=True) + "\n")
            tmp.replace(output)
        finally:
            tmp.unlink(missing_ok=True)
        note = f"; {skipped_note(stats.skipped)}" if stats.skipped else ""
        click.echo(
            f"wrote {stats.requests} request(s) to {output}; {bad[0]} bad line(s) skipped{note}"
        )
        return EXIT_OK

    _guard(run)


def _secret(secret_env: str | None, secret_file: Path | None) -> bytes:
    """The pseudonym key: from an environment variable or a file, never a command argument
    (which would land in shell history and process lists)."""
    import os

    if (secret_env is None) == (secret_file is None):
        raise InputError("give exactly one of --secret-env VAR and --secret-file PATH")
    if secret_env is not None:
        value = os.environ.get(secret_env)
        if not value:
            raise InputError(f"--secret-env: environment variable {secret_env} is not set")
        return value.encode()
    assert secret_file is not None
    try:
        data = secret_file.read_bytes().strip()
    except OSError as exc:
        raise InputError(f"--secret-file: cannot read {secret_file}: {exc}") from None
    if not data:
        raise InputError(f"--secret-file: {secret_file} is empty")
    return data


@trace.command("anonymize")
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False, exists=True))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True)
@click.option("--secret-env", help="Environment variable holding the pseudonym key.")
@click.option(
    "--secret-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="File holding the pseudonym key.",
)
def trace_anonymize(
    path: Path, output: Path, secret_env: str | None, secret_file: Path | None
) -> None:
    """Scrub PII and secrets (emails, also full-width or look-alike ones; phones, IPs, cards,
    also split across a line; IBANs, keys, JWTs, PEM blocks, credentials in URLs, query strings
    and password=/token: text, and fragments of them where a field was cut) from a v1 trace, in
    messages, tool arguments and checks alike, with consistent pseudonyms keyed by a secret;
    then re-scan the output."""

    def run() -> int:
        from replay.tools.anonymize import anonymize_file, scan_file

        counts = anonymize_file(path, output, _secret(secret_env, secret_file))
        found = {k: n for k, n in counts.items() if n}
        click.echo(f"wrote {output}: replaced {sum(found.values())} item(s) {found or ''}")
        lines, left = scan_file(output)
        if left:
            for lineno, f in left[:20]:
                click.echo(f"{output}:{lineno}: {f.kind} in {f.field}: {f.excerpt}")
            return 1
        click.echo(f"scan of {output}: {lines} line(s), nothing left")
        return EXIT_OK

    _guard(run)


@trace.command("scan")
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False, exists=True))
def trace_scan(path: Path) -> None:
    """Report PII and secrets left in a trace; exit 1 when anything is found."""

    def run() -> int:
        from replay.tools.anonymize import scan_file

        lines, found = scan_file(path)
        for lineno, f in found:
            click.echo(f"{path}:{lineno}: {f.kind} in {f.field}: {f.excerpt}")
        click.echo(f"{path}: {lines} line(s) scanned, {len(found)} finding(s)")
        return 1 if found else EXIT_OK

    _guard(run)


@main.command("model")
@click.option(
    "--twin",
    is_flag=True,
    help="Derive the outlier twin (keys times F, queries divided by F: identical in "
    "BF16, keys past FP8's range; F is the power of two that puts every layer's "
    "keys 4x past 448, 1024 for the embedded model) into the cache and print "
    "its folder.",
)
@click.option(
    "--random",
    "random_out",
    type=click.Path(path_type=Path),
    help="Build the untrained factory model (random weights) into this folder.",
)
def model_cmd(twin: bool, random_out: Path | None) -> None:
    """Print the folder of the default test model: a trained checkpoint committed under
    replay/testmodel/models/ (python -m replay.testmodel.train
    --out replay/testmodel/models/kvcanary-tiny-llama), else the deterministic random one,
    built on first use."""
    from replay.testmodel.factory import build, ensure_default_model, ensure_twin_model

    if random_out:
        click.echo(str(build(random_out)))
    else:
        click.echo(str(ensure_twin_model() if twin else ensure_default_model()))


if __name__ == "__main__":
    main()
