"""What a run's options resolve to (``Plan``), all checked before a run directory is made: the
trace (one streaming pass checks it), its phases, its buckets and SLOs, and its targets."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from replay.cli.common import console, shown
from replay.cli.compose import SERIAL_PHASE, refuse_combinations
from replay.cli.run_options import RunOptions
from replay.cli.skip_layers import with_skip_layers
from replay.core.buckets import Buckets
from replay.core.errors import InputError
from replay.core.schedule import ClosedLoop, OpenLoop, PoissonOffsets, TraceOffsets
from replay.core.slo import SloSpec, parse_slo
from replay.run.exclude import exclusion, refuse_overlap
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
from replay.traces.sessions import has_sessions, units


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
