"""The command line's options and the run's ``RunSpec``, both ways: the options (and what
they resolved to: the trace's format and count, the schedules, the targets) become the spec
the run is (``run_config``, ``run_spec``), and a run's spec gives back the options that build it
again (``options_of``: what ``--resume`` continues)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from replay.analysis.run_spec import (
    BudgetSpec,
    LoadSpec,
    QualitySpec,
    RunDirSpec,
    RunSpec,
    SequentialSpec,
    TargetsSpec,
    TraceSpec,
)
from replay.analysis.verdict.advice import read_advice
from replay.cli.compose import SERIAL_PHASE
from replay.cli.measuring import capacity_options
from replay.cli.plan import Plan
from replay.cli.run_options import RunOptions
from replay.core.credentials import redact
from replay.run.run_config import RunConfig, load_for
from replay.run.session_history import check_mode
from replay.rundir.files import file_digest
from replay.traces.sessions import think_time


def run_config(
    o: RunOptions,
    plan: Plan,
    run_dir: Path,
    resume: bool,
    canary: bool = False,
    given: Mapping[str, str] | None = None,
) -> RunConfig:
    """The run: its spec, built once from the options and what they resolved to, and the live
    objects it names."""
    return RunConfig(
        spec=run_spec(o, plan, run_dir, resume, canary),
        trace=plan.trace,
        targets=plan.targets,
        schedules=plan.schedules,
        cli_options=o.given_json(given or {}),
        advice=read_advice(o.advice_path) if o.advice_path else None,
    )


def run_spec(o: RunOptions, plan: Plan, run_dir: Path, resume: bool, canary: bool) -> RunSpec:
    """Everything the run was asked to do (``RunSpec``): what ``--resume`` continues and the
    analysis reads."""
    think_time(o.think_time, o.time_scale)  # a bad value is found before the run starts
    return RunSpec(
        trace=TraceSpec(
            path=str(o.trace_path),
            format=plan.trace_format,
            sha256=file_digest(o.trace_path),
            requests=plan.trace.count,
            length_scale=o.length_scale,
            max_input_tokens=o.max_input_tokens,
            max_output_tokens=o.max_output_tokens,
            on_bad_line=o.on_bad_line,
            limit=o.limit,
            exclude_ids=None if o.exclude_ids is None else str(o.exclude_ids),
        ),
        targets=TargetsSpec(
            given=redact(o.targets),
            targets_file=None if o.targets_file is None else str(o.targets_file),
            model=None if o.model_dir is None else str(o.model_dir),
            skip_layers=o.skip_layers,
            emulate="kv" if o.emulate_kv else "fp8" if o.emulate_fp8 else None,
        ),
        load=load_spec(o, plan),
        quality=quality_spec(o, plan),
        budget=BudgetSpec(
            max_errors=o.max_errors, max_error_rate=o.max_error_rate, drain_s=o.drain_s
        ),
        run_dir=RunDirSpec(path=str(run_dir), resume=resume),
        capacity=capacity_options(o, canary),
        sequential=(
            SequentialSpec(
                round_size=o.round_size, max_requests=o.max_requests, max_time_s=o.max_time
            )
            if o.sequential
            else None
        ),
    )


def load_spec(o: RunOptions, plan: Plan) -> LoadSpec:
    """Who gets the load and how it is sent."""
    return load_for(
        plan.targets,
        plan.schedules,
        concurrency=o.concurrency,
        rate=o.rate,
        trace_times=o.trace_times,
        time_scale=o.time_scale,
        max_in_flight=o.max_in_flight,
        seed=o.seed,
        timeout_s=o.timeout_s,
        phase_timeout_s=o.phase_timeout_s,
        workers=o.workers,
        salt_phases=not o.share_prefix_cache,
        parallel_targets=o.parallel_targets,
        interleave=bool(o.interleave),
        block_size=o.block_size,
        session_history=check_mode(o.session_history, o.parallel_targets),
        think_time=o.think_time,
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
        advice=None if o.advice_path is None else str(o.advice_path),
    )


def options_of(spec: RunSpec, targets: TargetsSpec) -> RunOptions:
    """The options that build ``spec`` again (``replay_run.run_spec``): a resumed run is the
    same run. Where it goes and where its Markdown goes are not the run's."""
    t, load, q, b = spec.trace, spec.load, spec.quality, spec.budget
    capacity, seq = spec.capacity, spec.sequential or SequentialSpec()
    rounds = spec.sequential is not None
    return RunOptions(
        trace_path=Path(t.path),
        trace_format=t.format,
        targets=targets.given,
        targets_file=_path(targets.targets_file),
        model_dir=_path(targets.model),
        concurrency=load.concurrency,
        rate=load.rate,
        trace_times=load.trace_times,
        time_scale=load.time_scale,
        max_in_flight=load.max_in_flight,
        bucket_spec=q.buckets,
        on_bad_line=t.on_bad_line,
        length_scale=t.length_scale,
        max_input_tokens=t.max_input_tokens,
        max_output_tokens=t.max_output_tokens,
        limit=t.limit,
        # An order's own setting (interleaved blocks and the sequential rounds serve every
        # target at once), not the user's --parallel-targets.
        parallel_targets=load.parallel_targets and not (load.interleave or rounds),
        timeout_s=load.timeout_s,
        phase_timeout_s=load.phase_timeout_s or 0.0,
        reference=q.reference,
        no_teacher_forced=not q.teacher_forced and not rounds,  # the rounds' own setting
        tolerance=q.tolerance,
        share_prefix_cache=not load.salt_phases,
        out_dir=Path(spec.run_dir.path).parent,
        run_id=Path(spec.run_dir.path).name,
        seed=load.seed,
        min_pairs=q.min_pairs,
        required_capacity_ratio=q.required_capacity_ratio,
        alpha=q.alpha,
        drain_s=b.drain_s or 0.0,
        markdown_path=None,
        exclude_ids=_path(t.exclude_ids),
        candidate=q.candidate,
        calibrated=q.calibrated,
        emulate_fp8=targets.emulate == "fp8",
        emulate_kv=targets.emulate == "kv",
        accept_emulated=q.accept_emulated,
        control=q.control,
        max_errors=b.max_errors,
        max_error_rate=1.0 if b.max_error_rate is None else b.max_error_rate,
        slo=q.slo,
        session_history=load.session_history,
        think_time=load.think_time,
        stop_at_saturation=load.stop_at_saturation,
        sequential=rounds,
        round_size=seq.round_size,
        max_requests=seq.max_requests,
        max_time=seq.max_time_s,
        workers=load.workers,
        interleave=load.interleave,
        block_size=load.block_size,
        systems_threshold=q.systems_threshold,
        capacity_phase={"on": True, "off": False}.get(capacity.mode),
        capacity_concurrency=capacity.concurrency,
        capacity_cache_mib=capacity.cache_mib,
        capacity_time_limit=capacity.time_limit_s,
        skip_layers=targets.skip_layers,
        advice_path=_path(q.advice),
        quality_pass="serial" if q.quality_phase else "load",
    )


def _path(text: str | None) -> Path | None:
    return None if text is None else Path(text)
