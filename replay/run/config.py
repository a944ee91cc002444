"""What a run is asked to do (``RunConfig``: the run as the runner holds it, with its trace,
targets and schedules; ``run_spec()`` is the same run as plain data, ``replay/run/spec.py``) and
what happened to each target (``TargetRun``, which the manifest shows)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from replay.analysis.verdict.facts import Thresholds
from replay.core.buckets import Buckets
from replay.core.records import Result
from replay.core.slo import SloSpec, parse_slo
from replay.run.budget import ErrorBudget
from replay.run.manifest import target_entry, trace_facts
from replay.run.phase import Schedule
from replay.run.rundir import file_digest
from replay.run.spec import BudgetSpec, LoadSpec, QualitySpec, RunDirSpec, RunSpec, TraceSpec
from replay.serving.targets import TargetSpec
from replay.traces.importers import LengthPolicy
from replay.traces.sessions import ThinkTime
from replay.traces.trace import TraceSource


@dataclass(frozen=True)
class CapacityOptions:
    """The capacity phase (replay/run/capacity.py): ``mode`` on, off, or auto (run when the
    workload's own load never filled the reference's cache); its closed loop's concurrency;
    the KV-cache memory of its servers in MiB (0: sized from the workload)."""

    mode: str = "off"
    concurrency: int = 12
    cache_mib: int = 0


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
    # Buckets, SLOs, roles, the A/A control, teacher-forced scoring and the verdict's
    # thresholds, as the run spec has them (``buckets``, ``slo``, ``thresholds`` parse them).
    quality: QualitySpec
    run_dir: Path
    length_policy: LengthPolicy = field(default_factory=LengthPolicy)
    # Multi-turn sessions: the wait between turns, and whose history later turns carry.
    think: ThinkTime = field(default_factory=ThinkTime)
    session_history: str = "trace"
    # A rising load sweep stops for a target once it is saturated (replay/run/sweep.py).
    stop_at_saturation: bool = False
    parallel_targets: bool = False
    # Every target's server up at once, each phase sent in blocks, arm after arm in a
    # rotating order (replay/run/interleave.py); block_size 0: by the schedule.
    interleave: bool = False
    block_size: int = 0
    capacity: CapacityOptions = field(default_factory=CapacityOptions)
    # Load processes that send each phase (replay/run/worker_pool.py); 1: this process alone.
    workers: int = 1
    timeout_s: float = 600.0
    phase_timeout_s: float = 3600.0
    startup_timeout_s: float = 900.0
    seed: int = 0
    # A prefix-cache salt per phase, so a phase does not reuse the cache a previous phase
    # filled with the same prompts (that would flatter TTFT). Sharing within a phase stays.
    salt_phases: bool = True
    # Each target's error budget (replay/run/budget.py): past it the target gets no more
    # requests; on an interrupt, in-flight requests get ``drain_s`` to finish.
    budget: BudgetSpec = field(default_factory=lambda: BudgetSpec(drain_s=30.0))
    # Continue an interrupted or killed run in ``run_dir``: send only what has no final result.
    resume: bool = False
    cli_options: dict[str, Any] = field(default_factory=dict)
    # ``kvcal advise``'s figures, for the verdict's next step (``analysis.verdict.advice``).
    advice: dict[str, Any] | None = None
    command: Sequence[str] = field(default_factory=lambda: list(sys.argv))

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
        return f"{self.run_dir.name}.{target}.{label}" if self.salt_phases else None

    def trace_facts(self) -> dict[str, Any]:
        t = self.trace
        return trace_facts(
            self.trace_path,
            self.trace_format,
            file_digest(self.trace_path),
            t.lines,
            t.count,
            t.bad_count,
            self.length_policy,
            t.skipped,
        )

    def run_spec(self, sha256: str) -> RunSpec:
        """This run as both drivers describe it (the manifest's ``run_spec``); ``sha256``:
        the trace's digest, as ``trace_facts`` found it."""
        lp = self.length_policy
        return RunSpec(
            trace=TraceSpec(
                path=str(self.trace_path),
                format=self.trace_format,
                sha256=sha256,
                requests=self.trace.count,
                length_scale=lp.scale,
                max_input_tokens=lp.max_input_tokens,
                max_output_tokens=lp.max_output_tokens,
            ),
            load=self._load_spec(),
            quality=self.quality,
            budget=self.budget,
            run_dir=RunDirSpec(path=str(self.run_dir), resume=self.resume),
        )

    def _load_spec(self) -> LoadSpec:
        return LoadSpec(
            targets=tuple(t.name for t in self.targets),
            schedules=tuple(s.label for s in self.schedules),
            seed=self.seed,
            timeout_s=self.timeout_s,
            phase_timeout_s=self.phase_timeout_s,
            workers=self.workers,
            salt_phases=self.salt_phases,
            parallel_targets=self.parallel_targets,
            interleave=self.interleave,
            block_size=self.block_size,
            session_history=self.session_history,
            stop_at_saturation=self.stop_at_saturation,
        )

    def manifest_options(self, sessions: bool) -> dict[str, Any]:
        """The run's options as the manifest lists them (the CLI's own are beside them)."""
        options: dict[str, Any] = {
            "parallel_targets": self.parallel_targets,
            "timeout_s": self.timeout_s,
            "phase_timeout_s": self.phase_timeout_s,
            "seed": self.seed,
            "salt_phases": self.salt_phases,
        }
        if sessions:
            options["sessions"] = {
                "history": self.session_history,
                "think_time": self.think.describe(),
            }
        if self.interleave:
            options["interleave"] = {"block_size": self.block_size or "auto"}
        if self.stop_at_saturation:
            options["stop_at_saturation"] = True
        if self.workers > 1:
            options["workers"] = self.workers
        if self.advice is not None:
            options["advice"] = self.advice
        if self.quality.quality_phase is not None:
            options["quality_phase"] = self.quality.quality_phase
        return options


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
