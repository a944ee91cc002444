"""One replay: every target, every phase, every request, written as it completes.

The runner orders targets (the reference first), starts and stops the local servers, checks
each target serves what its spec says, runs its phases (replay/run/phase.py), the A/A control
and teacher-forced scoring, and keeps the manifest current; the analysis at the end is
replay/pipeline/analyse.py's, shared with the Locust adapter. Progress goes through the
``Progress`` protocol, so the terminal UI (rich) lives in the CLI, not here.

A runner is given its collaborators, never subclassed: its clock (every timestamp's zero), its
phase sender (replay/run/senders.py: this process, or a pool of load processes), its connector
(replay/run/connect.py: the target over HTTP), its local servers' factory
(replay/run/servers.py) and its order (replay/run/order.py's ``RunOrder``: one target after
another by default; interleaved blocks, replay/run/interleave.py; the sequential canary's
rounds, replay/run/sequential_run.py), which it hands itself as the order's ``Run``. The CLI
picks them (replay/cli/compose.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from replay.analysis.grading.quality import CONTROL_SUFFIX
from replay.analysis.grading.rows import GradingSpec, grading_spec
from replay.analysis.roles import resolve as resolve_roles
from replay.analysis.schemas import Summary
from replay.analysis.schemas.manifest import Manifest
from replay.core.errors import ServerStartError, TargetError
from replay.core.schedule import Clock, MonotonicClock
from replay.pipeline.analyse import Sources, analyse
from replay.run.budget import ErrorBudget
from replay.run.connect import Connected, Connector, HttpConnector
from replay.run.order import Run, RunOrder
from replay.run.phase import Phase, Schedule, TargetSession
from replay.run.progress import Progress, QuietProgress
from replay.run.run_config import RunConfig, TargetRun
from replay.run.senders import InProcess, PhaseSender
from replay.run.servers import ServerFactory, launch, local_servers, stop
from replay.run.session_history import ReferenceHistory, check_mode
from replay.run.session_turns import Sessions
from replay.run.signals import interrupts
from replay.run.stopping import RunStop
from replay.run.sweep import stop_rising
from replay.run.teacher import Answers, Scoring, score_answers
from replay.rundir.files import (
    MANIFEST,
    RESULTS,
    TEACHER_FORCED,
    JsonlWriter,
    write_bad_lines,
    write_json,
)
from replay.rundir.manifest import build_manifest
from replay.rundir.resume import ResumeState
from replay.serving.introspect import engine_config_from_log
from replay.serving.local_server import LocalServer
from replay.traces.sessions import has_sessions

__all__ = ["OneAfterAnother", "Runner"]


class Runner:
    """One run of ``cfg``, given its progress sink, its clock, its phase sender, its connector
    and its order (each has a default: real time, this process, HTTP, one after another)."""

    def __init__(
        self,
        cfg: RunConfig,
        progress: Progress | None = None,
        *,
        clock: Clock | None = None,
        sender: PhaseSender | None = None,
        connector: Connector | None = None,
        order: RunOrder | None = None,
        servers: ServerFactory | None = None,
        analysis: Callable[[Path, Manifest, Sources], Summary] = analyse,
    ) -> None:
        self.order: RunOrder = order or OneAfterAnother()
        self.servers = servers or local_servers(cfg.startup_timeout_s)
        self.analyse = analysis  # the analysis at the end of the run (grades, summary)
        cfg = self.cfg = self.order.prepare(cfg)
        self.progress = progress or QuietProgress()
        self.clock: Clock = clock or MonotonicClock()
        self.sender: PhaseSender = sender or InProcess()
        names = [s.name for s in cfg.targets]
        self.roles = resolve_roles(
            names,
            reference=cfg.quality.reference,
            candidate=cfg.quality.candidate,
            calibrated=cfg.quality.calibrated,
            declared={s.name: s.role for s in cfg.targets if s.role},
        )
        self.reference = self.roles.reference
        self.candidate = self.roles.candidate
        # The reference goes first: the others are compared with (and scored on) its answers.
        ordered = sorted(cfg.targets, key=lambda s: s.name != self.reference)
        self.runs = {s.name: TargetRun(s, budget=self.new_budget()) for s in ordered}
        self.control: TargetRun | None = None
        if cfg.quality.control:
            ref = self.runs[self.reference].spec
            self.control = TargetRun(
                replace(ref, name=ref.name + CONTROL_SUFFIX), budget=self.new_budget()
            )
        self.ref_done: asyncio.Event | None = None
        self.stop = RunStop(cfg.run_dir, cfg.budget.drain_s or 0.0, self.progress, self.clock)
        self.stopping = self.stop.event
        self.resume = ResumeState.load(cfg.run_dir) if cfg.resume else ResumeState()
        self.sessions = has_sessions(cfg.trace.iter_requests())
        self.history = (
            ReferenceHistory(cfg.run_dir, self.reference, on_failure=self.stop.cannot_write)
            if self.sessions
            and check_mode(cfg.load.session_history, cfg.load.parallel_targets) == "reference"
            else None
        )
        self.writer = JsonlWriter(cfg.run_dir / RESULTS, self.stop.cannot_write)
        self.tf_writer = JsonlWriter(cfg.run_dir / TEACHER_FORCED, self.stop.cannot_write)
        # Teacher-forced scoring: the answers it reads, and each arm's way to ask its server.
        first, done = cfg.schedules[0].label, self.resume.tf_done
        self.answers = Answers(cfg.run_dir / RESULTS, self.reference, first, done)
        self.scorings: dict[str, Scoring] = {}
        self.connector: Connector = connector or HttpConnector(
            cfg, self.clock, self.progress, self.save_manifest, self.stop.cannot_write
        )
        self.started_at = time.time()
        self.order.bind(self)

    def previous(self, name: str) -> dict[str, Any]:
        return dict(self.resume.previous.get(name) or {})

    def finished(self, name: str, label: str) -> set[str]:
        return self.resume.finished(name, label)

    async def send(self, phase: Phase, run: TargetRun) -> dict[str, Any] | None:
        return await self.sender.send(phase, run, self.stop)

    def new_budget(self) -> ErrorBudget:
        return ErrorBudget.of(self.cfg.budget)

    # -- manifest -------------------------------------------------------------------------
    def manifest(self) -> dict[str, Any]:
        c = self.cfg
        return {
            **build_manifest(
                command=c.command,
                started_at=self.started_at,
                trace=c.trace_facts(),
                options=c.manifest_options(self.sessions),
                spec=c.run_spec(),
                roles=self.roles,
                cli_options=c.cli_options,
                interrupted=self.interrupted,
                resumed=self.resume.note or None,
                targets={n: r.manifest() for n, r in self.all_runs().items()},
            ),
            **self.order.manifest_extra(),
        }

    def all_runs(self) -> dict[str, TargetRun]:
        extra = {self.control.spec.name: self.control} if self.control else {}
        return {**self.runs, **extra}

    def save_manifest(self) -> None:
        self.stop.guarded(lambda: write_json(self.cfg.run_dir / MANIFEST, self.manifest()))

    @property
    def interrupted(self) -> bool:
        return self.stop.interrupted

    def interrupt(self, by: int | None = None) -> None:
        self.stop.interrupt(by)

    # -- the run --------------------------------------------------------------------------
    async def run(self) -> Summary:
        """Every target, then the analysis; a run directory that could not be written stops
        the run (``stopping``) and is raised here, once every server is stopped."""
        self.stop.guarded(lambda: write_bad_lines(self.cfg.run_dir, self.cfg.trace.iter_bad()))
        self.save_manifest()
        self.ref_done = asyncio.Event()
        if self.stop.storage is None:
            await self._run_targets()
        if self.stop.storage is not None:
            raise self.stop.storage
        return self.write_summary()

    async def _run_targets(self) -> None:
        main = self.stop.main = asyncio.ensure_future(self.order.run_targets())
        try:
            with interrupts(self.interrupt):
                await main
        except asyncio.CancelledError:
            if not (self.stop.interrupted or self.stop.storage):
                raise
        finally:
            self.stop.close()
            self.writer.close()
            self.tf_writer.close()
            if self.history is not None:
                self.history.close()
            self.save_manifest()

    def write_summary(self) -> Summary:
        return self.analyse(*self.analysis())

    def analysis(self) -> tuple[Path, Manifest, Sources]:
        """What the analysis reads: the run directory, its manifest as it stands, and the
        trace's checks."""
        sources = Sources(
            grading_specs=self._grading_specs,
            progress=lambda k, n: self.progress.status(f"analysis: {k:,} of {n:,} graded"),
        )
        manifest = Manifest.from_json(self.manifest(), where="manifest")
        return self.cfg.run_dir, manifest, sources

    def _grading_specs(self, ids: set[str]) -> dict[str, GradingSpec]:
        """Task and checker of each request that has results: what grading needs of the
        trace, with the prompt's text (capped) only where derived grading reads it."""
        return {r.id: grading_spec(r) for r in self.cfg.trace.iter_requests() if r.id in ids}

    def _reference_ids(self) -> Iterator[str]:
        """The reference's first-phase answers that teacher-forced scoring can use."""
        self.answers.update()
        return iter(list(self.answers.ref))

    # -- resume ---------------------------------------------------------------------------
    def _complete(self, name: str) -> bool:
        """Resume: every phase has a final result for every request (and scores if due)."""
        names = self.order.arms_on(name)
        skipped = self.skipped_before(name)
        done = [
            self.resume.finished(n, s.label)
            for n in names
            for s in self.cfg.schedules
            if s.label not in skipped
        ]
        phases_done = all(all(req.id in d for d in done) for req in self.cfg.trace.iter_requests())
        tf_due = self.cfg.quality.teacher_forced and any(
            (n, rid) not in self.resume.tf_done for rid in self._reference_ids() for n in names
        )
        return phases_done and not tf_due

    def skipped_before(self, name: str) -> list[str]:
        """The levels an earlier process of this run left out when the sweep stopped."""
        prev = self.previous(name)
        return list((prev.get("sweep_stopped") or {}).get("skipped", []))

    def _restore(self, run: TargetRun) -> None:
        run.status, run.reason, run.phases, run.info = self.resume.restore(run.spec.name)

    # -- one target -----------------------------------------------------------------------
    async def serve_target(self, run: TargetRun) -> None:
        """One target: its server started (a local one), connected, its arms sent (as the
        order says), its server stopped; a target that cannot be used is recorded failed."""
        spec = run.spec
        if self.cfg.resume and spec.name in self.resume.previous and self._complete(spec.name):
            self._restore(run)
            if self.control is not None and spec.name == self.reference:
                self._restore(self.control)
            if spec.name == self.reference and self.ref_done is not None:
                self.ref_done.set()
            return
        server: LocalServer | None = None
        try:
            if spec.is_local:
                server = self.servers(spec, self.cfg.run_dir / "servers" / f"{spec.name}.log")
                self.progress.status(
                    f"[{spec.name}] starting vLLM ({spec.kv_cache_dtype} KV cache)"
                )
                if not await launch(server, run.info, self.save_manifest, self.stopping):
                    return  # interrupted while starting: the finally below stops it
            url = server.url if server is not None else spec.connect_url
            assert url is not None
            await self._serve(run, url, server)
        except TargetError as exc:
            self._failed(run, exc, server)
        finally:
            if spec.name == self.reference and self.ref_done is not None:
                self.ref_done.set()  # also on failure: nobody waits forever
            if server is not None:
                self.progress.status(f"[{spec.name}] stopping server")
                await stop(server, run.info)
            self.save_manifest()

    def _failed(self, run: TargetRun, exc: TargetError, server: LocalServer | None) -> None:
        """A target that cannot be used: failed, with every planned request unavailable."""
        if isinstance(exc, ServerStartError):
            run.fail(f"server did not start: {exc.reason}")
        else:
            run.fail(str(exc))
        if server is not None:
            run.info["engine_config"] = engine_config_from_log(server.log_text())
            run.info["log"] = str(server.log_path.relative_to(self.cfg.run_dir))
        self._record_unavailable(run)

    async def _serve(self, run: TargetRun, url: str, server: LocalServer | None) -> None:
        """Connect, check and replay one target (its arms, then teacher-forced scoring). A
        target that cannot be used raises TargetError; ``serve_target`` records it."""
        async with self.connector.open(run, url, server) as target:
            await self._phases(run, target)
        if not run.budget.spent:
            run.status = "ok"

    async def _phases(self, run: TargetRun, target: Connected) -> None:
        scoring = None
        if self.cfg.quality.teacher_forced:
            scoring = await target.scoring(self.tf_writer)
            for name in self.order.arms_on(run.spec.name):  # its own and its control's
                self.scorings[name] = scoring
        if not await self.order.send_arms(run, target.arm):
            return
        if scoring is not None and not self.stopping.is_set():
            for name in self.order.arms_on(run.spec.name):  # its own, then its control's
                await self._teacher_forced(self.all_runs()[name], scoring)

    # -- the phases of one arm ------------------------------------------------------------
    async def send_phases(
        self, run: TargetRun, arm: TargetSession, skip: Sequence[str] = ()
    ) -> bool:
        """Every phase for one arm (but those in ``skip``, above where its sweep stopped);
        False when it must go no further (its budget is spent, or the run is interrupted)."""
        labels = [s.label for s in self.cfg.schedules]
        for k, sched in enumerate(self.cfg.schedules):
            if sched.label in skip:
                continue
            await self._phase(run, arm, sched)
            rest = [x for x in labels[k + 1 :] if x not in skip]
            if rest and self.saturated(run, arm.name):
                run.info["sweep_stopped"] = {**run.info["sweep_stopped"], "skipped": rest}
                self.save_manifest()
                break
        if run.budget.spent:
            self.budget_spent(run)
            return False
        return not self.stopping.is_set()

    def saturated(self, run: TargetRun, name: str) -> bool:
        """--stop-at-saturation: whether the sweep may stop rising for this target."""
        if not self.cfg.load.stop_at_saturation or self.stopping.is_set() or run.budget.spent:
            return False
        c = self.cfg
        why = stop_rising(c.run_dir, name, run.phases, c.buckets.labels, c.slo)
        if why is not None:
            run.info["sweep_stopped"] = {"after": list(run.phases)[-1], "reason": why}
            self.progress.status(f"[{name}] {why}: the sweep stops rising")
        return why is not None

    def phase(self, arm: TargetSession, sched: Schedule, **given: Any) -> Phase:
        """A phase of ``arm`` on the run's trace, buckets, writer, progress, clock, interrupt,
        time limit, cache salt and sessions; ``given``: what differs from those."""
        common: dict[str, Any] = {
            "trace": self.cfg.trace,
            "buckets": self.cfg.buckets,
            "writer": self.writer,
            "progress": self.progress,
            "clock": self.clock,
            "stopping": self.stopping,
            "timeout_s": self.cfg.phase_timeout_s,
            "salt": self.cfg.phase_salt(arm.name, sched.label),
            "sessions": self.sessions_of(arm.name),
        }
        return Phase(target=arm, sched=sched, **{**common, **given})

    def sessions_of(self, name: str) -> Sessions | None:
        """An arm's sessions (None: the trace has none)."""
        if not self.sessions:
            return None
        return Sessions(self.cfg.think, self.history, is_reference=name == self.reference)

    async def _phase(self, run: TargetRun, arm: TargetSession, sched: Schedule) -> None:
        label = sched.label
        # Resume: the results of an earlier process are all for this trace's requests.
        phase = self.phase(arm, sched, before_done=self.resume.finished(arm.name, label))
        window = await self.send(phase, run)
        if window is not None:
            run.phases[label] = window
            self.save_manifest()

    async def _teacher_forced(self, run: TargetRun, scoring: Scoring) -> None:
        """Score the reference's first-phase answers under this target that are not scored
        yet (its own answers and its prefix cache under its first phase's salt save most of
        the work)."""
        assert self.ref_done is not None
        await self.ref_done.wait()
        await self._score(run.spec.name, scoring, ready=False)

    async def score_between(self, name: str) -> None:
        """Score now, on its server, what arm ``name`` answered of the first phase whose
        reference answer is in: between an interleaved phase's blocks, while the server still
        holds their prompts."""
        scoring = self.scorings.get(name)
        if scoring is not None and not self.stopping.is_set():
            await self._score(name, scoring, ready=True)

    async def _score(self, name: str, scoring: Scoring, *, ready: bool) -> None:
        start = self.clock.now()
        how = replace(scoring, salt=self.cfg.phase_salt(name, self.cfg.schedules[0].label))
        rows = await score_answers(name, self.answers, how, ready=ready)
        if rows:
            info = self.all_runs()[name].info.setdefault("teacher_forced", {"spans": []})
            info["spans"].append([start, self.clock.now(), rows])

    def budget_spent(self, run: TargetRun) -> None:
        run.spend_budget()
        self.save_manifest()

    def _record_unavailable(self, run: TargetRun) -> None:
        """A target that cannot serve still accounts for every planned request."""
        now = self.clock.now()
        for sched in self.cfg.schedules:
            run.phases.setdefault(sched.label, {"start": now, "end": now})
            for req in self.cfg.trace.iter_requests():
                self.writer.write(run.unavailable(req.id, sched.label, now).to_json())


class OneAfterAnother:
    """The default order: target after target (or all at once, ``parallel_targets``), each
    phase after phase; the reference first, then its A/A control on the same server."""

    def __init__(self) -> None:
        self._runner: Run | None = None

    @property
    def runner(self) -> Run:
        assert self._runner is not None, "bind the order to its run first"
        return self._runner

    def prepare(self, cfg: RunConfig) -> RunConfig:
        return cfg

    def bind(self, run: Run) -> None:
        self._runner = run

    def arms_on(self, target: str) -> list[str]:
        r = self.runner
        control = r.control is not None and target == r.reference
        return [target] + ([r.control.spec.name] if r.control and control else [])

    async def run_targets(self) -> None:
        r = self.runner
        if r.cfg.load.parallel_targets:
            await asyncio.gather(*(r.serve_target(t) for t in r.runs.values()))
            return
        for t in r.runs.values():
            if r.stopping.is_set():
                break
            await r.serve_target(t)

    async def send_arms(self, run: TargetRun, arm: TargetSession) -> bool:
        r = self.runner
        if not await r.send_phases(run, arm, skip=r.skipped_before(run.spec.name)):
            return False
        if run.spec.name == r.reference:
            await self._control(run, arm)
        return True

    async def _control(self, ref: TargetRun, arm: TargetSession) -> None:
        """A/A: the same server, the same requests, again (its own cache salt and budget)."""
        r = self.runner
        assert r.ref_done is not None
        if r.control is not None:
            r.control.info = dict(ref.info)
            control = replace(arm, name=r.control.spec.name, budget=r.control.budget)
            skipped = (ref.info.get("sweep_stopped") or {}).get("skipped", [])
            await r.send_phases(r.control, control, skip=skipped)
            if not r.control.budget.spent:
                r.control.status = "ok"
        r.ref_done.set()

    def manifest_extra(self) -> dict[str, Any]:
        return {}
