"""How a run goes through its targets (``RunOrder``), and what an order may do with the run
(``Run``: the runner implements it). An order imports this module, never the runner: it serves
targets, sends phases, and reads the runs so far, the control and the stop through the handle
it is bound to, and adds its own settings to the config (``prepare``) and the manifest
(``manifest_extra``). The orders: one target after another (``runner.OneAfterAnother``),
interleaved blocks (``interleave.Interleaved``), the sequential canary's rounds
(``sequential_run.Rounds``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from replay.analysis.schemas.manifest import Manifest
from replay.core.schedule import Clock
from replay.pipeline.analyse import Sources
from replay.run.budget import ErrorBudget
from replay.run.phase import Phase, Schedule, TargetSession
from replay.run.progress import Progress
from replay.run.run_config import RunConfig, TargetRun
from replay.run.servers import ServerFactory
from replay.run.session_turns import Sessions
from replay.run.stopping import RunStop
from replay.rundir.files import JsonlWriter


class Run(Protocol):
    """The run an order goes through: its config and roles, its targets' runs so far (the
    reference first) and the A/A control's, its clock, progress and stop, and the steps an
    order puts together (serve a target, send its phases, send one phase)."""

    cfg: RunConfig
    reference: str
    candidate: str | None  # the primary candidate (the roles')
    runs: dict[str, TargetRun]  # an order may reorder them (``bind``)
    control: TargetRun | None
    clock: Clock
    progress: Progress
    stop: RunStop
    stopping: asyncio.Event
    ref_done: asyncio.Event | None  # set once the reference's answers are all in
    sessions: bool  # the trace has multi-turn sessions
    writer: JsonlWriter  # results.jsonl
    servers: ServerFactory  # how a local target's server is made

    def all_runs(self) -> dict[str, TargetRun]: ...

    def previous(self, name: str) -> dict[str, Any]:
        """Resume: what an earlier process of this run recorded of a target (its manifest
        entry, empty for none)."""
        ...

    def finished(self, name: str, label: str) -> set[str]:
        """Resume: the requests an earlier process of this run finished on an arm's phase."""
        ...

    async def serve_target(self, run: TargetRun) -> None: ...

    async def send_phases(
        self, run: TargetRun, arm: TargetSession, skip: Sequence[str] = ()
    ) -> bool: ...

    def phase(self, arm: TargetSession, sched: Schedule, **given: Any) -> Phase: ...

    async def send(self, phase: Phase, run: TargetRun) -> dict[str, Any] | None:
        """One phase through the run's sender: its window, None when nothing was sent."""
        ...

    def saturated(self, run: TargetRun, name: str) -> bool: ...

    async def score_between(self, name: str) -> None:
        """Teacher-forced scores, now, of what an arm answered of the first phase (between
        its blocks); nothing when the run does not score."""
        ...

    def skipped_before(self, name: str) -> list[str]: ...

    def budget_spent(self, run: TargetRun) -> None: ...

    def new_budget(self) -> ErrorBudget: ...

    def sessions_of(self, name: str) -> Sessions | None: ...

    def save_manifest(self) -> None: ...

    def analysis(self) -> tuple[Path, Manifest, Sources]: ...


class RunOrder(Protocol):
    """How a run goes through its targets and their phases: the runner serves each target
    (its server, its checks, its connection) and asks its order what to send on it."""

    def prepare(self, cfg: RunConfig) -> RunConfig:
        """The config this order runs (the runner is built on it)."""
        ...

    def bind(self, run: Run) -> None:
        """The run this order goes through, once it is built."""
        ...

    def arms_on(self, target: str) -> list[str]:
        """A target and the arms sent on its server (the reference's A/A control)."""
        ...

    async def run_targets(self) -> None:
        """Every target (``Run.serve_target``), in this order's order."""
        ...

    async def send_arms(self, run: TargetRun, arm: TargetSession) -> bool:
        """What is sent on one connected target; False when it must go no further
        (teacher-forced scoring follows a True)."""
        ...

    def manifest_extra(self) -> dict[str, Any]:
        """What this order adds to the manifest."""
        ...
