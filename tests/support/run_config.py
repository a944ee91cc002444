"""``run_config``: a ``RunConfig`` for a test, its spec built from the settings the test gives
(its load named after its targets and schedules)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from replay.analysis.run_spec import (
    BudgetSpec,
    CapacitySpec,
    LoadSpec,
    QualitySpec,
    RunDirSpec,
    RunSpec,
    TargetsSpec,
    TraceSpec,
)
from replay.run.phase import Schedule
from replay.run.run_config import RunConfig, load_for
from replay.rundir.files import file_digest
from replay.serving.targets import TargetSpec
from replay.traces.importers import LengthPolicy
from replay.traces.trace import TraceSource


def run_config(
    *,
    trace: TraceSource,
    trace_path: Path,
    trace_format: str,
    targets: Sequence[TargetSpec],
    schedules: Sequence[Schedule],
    quality: QualitySpec,
    run_dir: Path,
    load: Mapping[str, Any] | None = None,
    length_policy: LengthPolicy | None = None,
    budget: BudgetSpec | None = None,
    capacity: CapacitySpec | None = None,
    resume: bool = False,
    startup_timeout_s: float = 900.0,
    **kw: Any,
) -> RunConfig:
    """``load``: the ``LoadSpec`` settings that differ from their defaults (timeouts, seed,
    parallel targets); ``kw``: the rest of the ``RunConfig`` (advice, command)."""
    lp = length_policy or LengthPolicy()
    spec = RunSpec(
        trace=TraceSpec(
            path=str(trace_path),
            format=trace_format,
            sha256=file_digest(trace_path),
            requests=trace.count,
            length_scale=lp.scale,
            max_input_tokens=lp.max_input_tokens,
            max_output_tokens=lp.max_output_tokens,
        ),
        targets=TargetsSpec(
            given=",".join(t.name for t in targets), startup_timeout_s=startup_timeout_s
        ),
        load=load_for(targets, schedules, **(load or {})),
        quality=quality,
        budget=budget or BudgetSpec(drain_s=30.0),
        run_dir=RunDirSpec(path=str(run_dir), resume=resume),
        capacity=capacity or CapacitySpec(),
    )
    return RunConfig(spec=spec, trace=trace, targets=targets, schedules=schedules, **kw)


def bare_spec(
    targets: Sequence[str], schedules: Sequence[str], checkers: bool = True, buckets: str = "256"
) -> RunSpec:
    """The spec of a run whose trace and settings a test does not look at."""
    return RunSpec(
        trace=TraceSpec(path="trace.jsonl", format="v1", sha256="", requests=0),
        load=LoadSpec(targets=tuple(targets), schedules=tuple(schedules)),
        quality=QualitySpec(buckets=buckets, checkers=checkers),
        budget=BudgetSpec(),
        run_dir=RunDirSpec(path="run"),
    )
