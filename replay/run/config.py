"""What a run is asked to do (``RunConfig``: the run spec's load, quality and budget records,
with the live objects they name: the trace, targets and schedules; ``run_spec()`` is the whole
run as plain data, ``replay/analysis/run_spec.py``) and what happened to each target
(``TargetRun``, which the manifest shows)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from replay.analysis.run_spec import (
    BudgetSpec,
    LoadSpec,
    QualitySpec,
    RunDirSpec,
    RunSpec,
    TraceSpec,
)
from replay.analysis.thresholds import Thresholds
from replay.core.buckets import Buckets
from replay.core.records import Result
from replay.core.slo import SloSpec, parse_slo
from replay.run.budget import ErrorBudget
from replay.run.manifest import target_entry, trace_facts
from replay.run.phase import Schedule
from replay.run.rundir import file_digest
from replay.serving.targets import TargetSpec
from replay.traces.importers import LengthPolicy
from replay.traces.sessions import ThinkTime
from replay.traces.trace import TraceSource


@dataclass(frozen=True)
class CapacityOptions:
    """The capacity phase (replay/run/capacity.py): ``mode`` on, off, or auto (run when the
    workload's own load never filled the reference's cache and the quality side left the
    verdict to whether FP8 pays); its closed loop's concurrency; the KV-cache memory of its
    servers in MiB (0: sized from the workload); the time its blocks may take."""

    mode: str = "off"
    concurrency: int = 12
    cache_mib: int = 0
    time_limit_s: float = 600.0


@dataclass(frozen=True)
class RunConfig:
    """What one run is asked to do, fixed once the run is composed (an order that runs it
    otherwise gets a copy: ``RunOrder.prepare``)."""

    # A ``StreamedTrace`` (the CLI) is re-read for each pass; the runner never holds all of
    # the requests, only what is in flight and what its results need.
    trace: TraceSource
    trace_path: Path
    trace_format: str
    targets: Sequence[TargetSpec]
    schedules: Sequence[Schedule]
    # How the load is sent (seed, timeouts, workers, order, salts), as the run spec has it;
    # its target and phase names are those of ``targets`` and ``schedules``.
    load: LoadSpec
    # Buckets, SLOs, roles, the A/A control, teacher-forced scoring and the verdict's
    # thresholds, as the run spec has them (``buckets``, ``slo``, ``thresholds`` parse them).
    quality: QualitySpec
    run_dir: Path
    length_policy: LengthPolicy = field(default_factory=LengthPolicy)
    # Multi-turn sessions: the wait between turns (whose history they carry is the load's).
    think: ThinkTime = field(default_factory=ThinkTime)
    capacity: CapacityOptions = field(default_factory=CapacityOptions)
    startup_timeout_s: float = 900.0  # for the servers the run starts itself
    # Each target's error budget (replay/run/budget.py): past it the target gets no more
    # requests; on an interrupt, in-flight requests get ``drain_s`` to finish.
    budget: BudgetSpec = field(default_factory=lambda: BudgetSpec(drain_s=30.0))
    # Continue an interrupted or killed run in ``run_dir``: send only what has no final result.
    resume: bool = False
    cli_options: dict[str, Any] = field(default_factory=dict)
    # ``kvcal advise``'s figures, for the verdict's next step (``analysis.verdict.advice``).
    advice: dict[str, Any] | None = None
    command: Sequence[str] = field(default_factory=lambda: list(sys.argv))

    def __post_init__(self) -> None:
        named = (tuple(t.name for t in self.targets), tuple(s.label for s in self.schedules))
        if named != (self.load.targets, self.load.schedules):
            raise ValueError(f"the load names {self.load.targets}, {self.load.schedules}: {named}")
        if self.load.phase_timeout_s is None:
            raise ValueError("a run the runner sends has a phase time limit")

    def with_load(self, **changes: Any) -> RunConfig:
        """A copy whose load differs by ``changes`` (a run order's own settings)."""
        return replace(self, load=replace(self.load, **changes))

    def with_schedules(self, schedules: Sequence[Schedule]) -> RunConfig:
        """A copy that sends ``schedules`` (the load names them)."""
        labels = tuple(s.label for s in schedules)
        return replace(self, schedules=list(schedules), load=replace(self.load, schedules=labels))

    @property
    def phase_timeout_s(self) -> float:
        limit = self.load.phase_timeout_s
        assert limit is not None  # __post_init__
        return limit

    @cached_property
    def buckets(self) -> Buckets:
        return Buckets.parse(self.quality.buckets)

    @cached_property
    def slo(self) -> SloSpec | None:
        """SLO attainment and goodput in the summary; None: no SLOs."""
        text = self.quality.slo
        return parse_slo(text, self.buckets.labels) if text else None

    @property
    def thresholds(self) -> Thresholds:
        return self.quality.thresholds(self.budget.max_error_rate)

    def phase_salt(self, target: str, label: str) -> str | None:
        """The prefix-cache salt of a target's phase (``salt_phases``), None when phases share
        the cache. Per target too: the A/A control must not reuse the reference's cache on
        its server."""
        return f"{self.run_dir.name}.{target}.{label}" if self.load.salt_phases else None

    @cached_property
    def trace_sha256(self) -> str:
        """The trace file's digest, read once (the manifest and the workers' specs name it)."""
        return file_digest(self.trace_path)

    def trace_facts(self) -> dict[str, Any]:
        t = self.trace
        return trace_facts(
            self.trace_path,
            self.trace_format,
            self.trace_sha256,
            t.lines,
            t.count,
            t.bad_count,
            self.length_policy,
            t.skipped,
        )

    def run_spec(self) -> RunSpec:
        """This run as both drivers describe it (the manifest's ``run_spec``)."""
        lp = self.length_policy
        return RunSpec(
            trace=TraceSpec(
                path=str(self.trace_path),
                format=self.trace_format,
                sha256=self.trace_sha256,
                requests=self.trace.count,
                length_scale=lp.scale,
                max_input_tokens=lp.max_input_tokens,
                max_output_tokens=lp.max_output_tokens,
            ),
            load=self.load,
            quality=self.quality,
            budget=self.budget,
            run_dir=RunDirSpec(path=str(self.run_dir), resume=self.resume),
        )

    def manifest_options(self, sessions: bool) -> dict[str, Any]:
        """The options the manifest lists beside the run spec: what the spec does not hold."""
        options: dict[str, Any] = {}
        if sessions:
            options["sessions"] = {"think_time": self.think.describe()}
        if self.advice is not None:
            options["advice"] = self.advice
        return options


def load_for(
    targets: Sequence[TargetSpec], schedules: Sequence[Schedule], **settings: Any
) -> LoadSpec:
    """The load of a run that sends ``schedules`` to ``targets``, with ``settings`` (the other
    ``LoadSpec`` fields; their defaults otherwise)."""
    return LoadSpec(
        targets=tuple(t.name for t in targets),
        schedules=tuple(s.label for s in schedules),
        **{"phase_timeout_s": 3600.0, **settings},
    )


@dataclass
class TargetRun:
    """What happened to one target; goes into the manifest."""

    spec: TargetSpec
    status: str = "pending"  # ok | failed
    reason: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)
    budget: ErrorBudget = field(default_factory=ErrorBudget)

    def manifest(self) -> dict[str, Any]:
        return target_entry(self.spec, self.status, self.reason, self.info, self.phases)

    def fail(self, reason: str) -> None:
        self.status, self.reason = "failed", reason

    def spend_budget(self) -> None:
        """The target failed by its error budget; later phases sent it nothing (their rows
        were written as not sent, so every request is still accounted for)."""
        self.fail(f"error budget spent: {self.budget.reason}")
        self.info["error_budget"] = {
            "finished": self.budget.finished,
            "errors": self.budget.errors,
            "reason": self.budget.reason,
        }

    def unavailable(self, request_id: str, phase: str, at: float) -> Result:
        """A request this target could not be sent, being unusable (``reason`` says why)."""
        return Result(
            request_id=request_id,
            target=self.spec.name,
            phase=phase,
            bucket="unknown",
            scheduled=at,
            status="error",
            error_kind="unavailable",
            error=self.reason,
        )
