"""What a run is asked to do (``RunConfig``: the run's ``RunSpec``, replay/analysis/run_spec.py,
with the live objects it names: the trace being read, the targets and the schedules) and what
happened to each target (``TargetRun``, which the manifest shows)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from replay.analysis.run_spec import (
    BudgetSpec,
    CapacitySpec,
    LoadSpec,
    QualitySpec,
    RunSpec,
)
from replay.analysis.thresholds import Thresholds
from replay.core.buckets import Buckets
from replay.core.records import Result
from replay.core.slo import SloSpec, parse_slo
from replay.run.budget import ErrorBudget
from replay.run.phase import Schedule
from replay.rundir.manifest import target_entry, trace_facts
from replay.serving.targets import TargetSpec
from replay.traces.sessions import ThinkTime, think_time
from replay.traces.trace import TraceSource

DEFAULT_STARTUP_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class RunConfig:
    """One run: its spec (everything it was asked to do, as the manifest records it), and the
    live objects the spec names. Fixed once the run is composed (an order that runs it
    otherwise gets a copy: ``RunOrder.prepare``); everything else here is read off the spec."""

    spec: RunSpec
    # A ``StreamedTrace`` (the CLI) is re-read for each pass; the runner never holds all of
    # the requests, only what is in flight and what its results need.
    trace: TraceSource
    targets: Sequence[TargetSpec]
    schedules: Sequence[Schedule]
    # ``kvcal advise``'s figures, read from the file the spec names (``quality.advice``), for
    # the verdict's next step (``analysis.verdict.advice``).
    advice: dict[str, Any] | None = None
    # An audit record of the command line's own flags, as given; nothing reads it back.
    cli_options: dict[str, Any] = field(default_factory=dict)
    command: Sequence[str] = field(default_factory=lambda: list(sys.argv))

    def __post_init__(self) -> None:
        named = (tuple(t.name for t in self.targets), tuple(s.label for s in self.schedules))
        if named != (self.load.targets, self.load.schedules):
            raise ValueError(f"the load names {self.load.targets}, {self.load.schedules}: {named}")
        if self.load.phase_timeout_s is None:
            raise ValueError("a run the runner sends has a phase time limit")

    # -- the spec's records ---------------------------------------------------------------
    @property
    def load(self) -> LoadSpec:
        return self.spec.load

    @property
    def quality(self) -> QualitySpec:
        """Buckets, SLOs, roles, the A/A control, teacher-forced scoring and the verdict's
        thresholds (``buckets``, ``slo``, ``thresholds`` parse them)."""
        return self.spec.quality

    @property
    def budget(self) -> BudgetSpec:
        """Each target's error budget (replay/run/budget.py): past it the target gets no more
        requests; on an interrupt, in-flight requests get ``drain_s`` to finish."""
        return self.spec.budget

    @property
    def capacity(self) -> CapacitySpec:
        return self.spec.capacity

    @property
    def run_dir(self) -> Path:
        return Path(self.spec.run_dir.path)

    @property
    def resume(self) -> bool:
        """Continue an interrupted or killed run in ``run_dir``: send only what has no final
        result."""
        return self.spec.run_dir.resume

    @property
    def startup_timeout_s(self) -> float:
        """For the servers the run starts itself."""
        targets = self.spec.targets
        return targets.startup_timeout_s if targets else DEFAULT_STARTUP_TIMEOUT_S

    @cached_property
    def think(self) -> ThinkTime:
        """Multi-turn sessions: the wait between turns (whose history they carry is the
        load's)."""
        return think_time(self.load.think_time, self.load.time_scale)

    # -- copies ---------------------------------------------------------------------------
    def with_spec(self, **records: Any) -> RunConfig:
        """A copy whose spec has these records replaced."""
        return replace(self, spec=replace(self.spec, **records))

    def with_load(self, **changes: Any) -> RunConfig:
        """A copy whose load differs by ``changes`` (a run order's own settings)."""
        return self.with_spec(load=replace(self.load, **changes))

    def with_schedules(self, schedules: Sequence[Schedule]) -> RunConfig:
        """A copy that sends ``schedules`` (the load names them)."""
        load = replace(self.load, schedules=tuple(s.label for s in schedules))
        return replace(self, spec=replace(self.spec, load=load), schedules=list(schedules))

    # -- what the spec's text parses to ---------------------------------------------------
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
        return self.spec.thresholds

    def phase_salt(self, target: str, label: str) -> str | None:
        """The prefix-cache salt of a target's phase (``salt_phases``), None when phases share
        the cache. Per target too: the A/A control must not reuse the reference's cache on
        its server."""
        return f"{self.run_dir.name}.{target}.{label}" if self.load.salt_phases else None

    def trace_facts(self) -> dict[str, Any]:
        """What reading the trace found (the manifest's ``trace``; the spec holds the rest)."""
        t = self.trace
        return trace_facts(t.lines, t.bad_count, t.skipped)

    def run_spec(self) -> RunSpec:
        """This run as both drivers describe it (the manifest's ``run_spec``)."""
        return self.spec

    def manifest_options(self, sessions: bool) -> dict[str, Any]:
        """The options the manifest lists beside the run spec: what they resolved to."""
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
