"""One replay: every target, every phase, every request, written as it completes.

The runner orders targets (the reference first), starts and stops the local servers, checks
each target serves what its spec says, runs its phases (replay/run/phase.py), the A/A control and
teacher-forced scoring, and keeps the manifest current; the analysis at the end is
replay/run/analyze.py's, shared with the Locust adapter. Progress goes through the ``Progress``
protocol, so the terminal UI (rich) lives in the CLI, not here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import aiohttp

from replay.analysis.grading.quality import CONTROL_SUFFIX
from replay.analysis.grading.rows import GradingSpec, grading_spec
from replay.analysis.roles import resolve as resolve_roles
from replay.analysis.schemas_manifest import Manifest
from replay.core.errors import ServerStartError, TargetError
from replay.core.schedule import MonotonicClock
from replay.run.analyze import Analysis, analyse, target_for_summary
from replay.run.budget import ErrorBudget
from replay.run.config import RunConfig, TargetRun
from replay.run.manifest import build_manifest
from replay.run.phase import Phase, Schedule, TargetSession
from replay.run.progress import Progress, QuietProgress
from replay.run.resume import ResumeState
from replay.run.rundir import (
    MANIFEST,
    RESULTS,
    TEACHER_FORCED,
    JsonlWriter,
    write_bad_lines,
    write_json,
)
from replay.run.senders import InProcess, PhaseSender
from replay.run.servers import launch, stop
from replay.run.session_history import ReferenceHistory, check_mode
from replay.run.session_turns import Sessions
from replay.run.signals import interrupts
from replay.run.stopping import RunStop
from replay.run.sweep import stop_rising
from replay.run.teacher import Scoring, reference_offsets, score_answers
from replay.serving.client import Client
from replay.serving.endpoints import api_session
from replay.serving.introspect import engine_config_from_log, introspect, served_model
from replay.serving.local_server import LocalServer
from replay.serving.metrics import MetricsSnapshot, Scraper
from replay.serving.prompt_scores import serves_cached_scores
from replay.serving.prompt_tokens import UNKNOWN, prompt_token_counts, token_pool
from replay.serving.scale_log import scale_lines
from replay.serving.targets import check_served_dtype
from replay.traces.sessions import has_sessions

__all__ = ["Runner"]


class Runner:
    """One run of ``cfg``, given its progress sink, its clock (every timestamp's zero) and its
    phase sender (replay/run/senders.py: this process, or a pool of load processes)."""

    def __init__(
        self,
        cfg: RunConfig,
        progress: Progress | None = None,
        *,
        clock: MonotonicClock | None = None,
        sender: PhaseSender | None = None,
    ) -> None:
        self.cfg = cfg
        self.progress = progress or QuietProgress()
        self.clock = clock or MonotonicClock()
        self.sender: PhaseSender = sender or InProcess()
        names = [s.name for s in cfg.targets]
        self.roles = resolve_roles(
            names,
            reference=cfg.reference,
            candidate=cfg.candidate,
            calibrated=cfg.calibrated,
            declared={s.name: s.role for s in cfg.targets if s.role},
        )
        self.reference = self.roles.reference
        # The reference goes first: the others are compared with (and scored on) its answers.
        ordered = sorted(cfg.targets, key=lambda s: s.name != self.reference)
        self.runs = {s.name: TargetRun(s, budget=self._budget()) for s in ordered}
        self.control: TargetRun | None = None
        if cfg.control:
            ref = self.runs[self.reference].spec
            self.control = TargetRun(
                replace(ref, name=ref.name + CONTROL_SUFFIX), budget=self._budget()
            )
        self.ref_done: asyncio.Event | None = None
        self.stop = RunStop(cfg.run_dir, cfg.drain_s, self.progress)
        self.stopping = self.stop.event
        self.resume = ResumeState.load(cfg.run_dir) if cfg.resume else ResumeState()
        self.sessions = has_sessions(cfg.trace.iter_requests())
        self.history = (
            ReferenceHistory(cfg.run_dir, self.reference, on_failure=self.stop.cannot_write)
            if self.sessions
            and check_mode(cfg.session_history, cfg.parallel_targets) == "reference"
            else None
        )
        self.writer = JsonlWriter(cfg.run_dir / RESULTS, self.stop.cannot_write)
        self.tf_writer = JsonlWriter(cfg.run_dir / TEACHER_FORCED, self.stop.cannot_write)
        self.started_at = time.time()

    def _budget(self) -> ErrorBudget:
        return ErrorBudget(max_errors=self.cfg.max_errors, max_error_rate=self.cfg.max_error_rate)

    # -- manifest -------------------------------------------------------------------------
    def manifest(self) -> dict[str, Any]:
        c = self.cfg
        return build_manifest(
            command=c.command,
            started_at=self.started_at,
            trace=c.trace_facts(),
            buckets=c.buckets,
            schedules=[s.label for s in c.schedules],
            options=c.manifest_options(self.sessions),
            reference=self.reference,
            roles=self.roles.to_json(),
            cli_options=c.cli_options,
            interrupted=self.interrupted,
            resumed=self.resume.note or None,
            targets={n: r.manifest() for n, r in self.all_runs().items()},
        )

    def all_runs(self) -> dict[str, TargetRun]:
        extra = {self.control.spec.name: self.control} if self.control else {}
        return {**self.runs, **extra}

    def save_manifest(self) -> None:
        self.stop.guarded(lambda: write_json(self.cfg.run_dir / MANIFEST, self.manifest()))

    @property
    def interrupted(self) -> bool:
        return self.stop.interrupted

    def interrupt(self) -> None:
        self.stop.interrupt()

    # -- the run --------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
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
        main = self.stop.main = asyncio.ensure_future(self._all_targets())
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

    async def _all_targets(self) -> None:
        if self.cfg.parallel_targets:
            await asyncio.gather(*(self._target(r) for r in self.runs.values()))
            return
        for r in self.runs.values():
            if self.stopping.is_set():
                break
            await self._target(r)

    def write_summary(self) -> dict[str, Any]:
        return analyse(self.analysis()).to_json()

    def analysis(self) -> Analysis:
        """What the analysis at the end of the run reads of the runner."""
        runs = self.all_runs()
        return Analysis(
            run_dir=self.cfg.run_dir,
            targets={
                n: target_for_summary(r.status, r.reason, r.info.get("cache_config"), r.phases)
                for n, r in runs.items()
            },
            reference=self.reference,
            candidate=self.roles.candidate,
            first_phase=self.cfg.schedules[0].label,
            bucket_labels=self.cfg.buckets.labels,
            tolerance=self.cfg.tolerance,
            seed=self.cfg.seed,
            thresholds=self.cfg.thresholds,
            manifest=Manifest.from_json(self.manifest(), where="manifest"),
            grading_specs=self._grading_specs,
            slo=self.cfg.slo,
        )

    def _grading_specs(self, ids: set[str]) -> dict[str, GradingSpec]:
        """Task and checker of each request that has results: what grading needs of the
        trace, with the prompt's text (capped) only where derived grading reads it."""
        return {r.id: grading_spec(r) for r in self.cfg.trace.iter_requests() if r.id in ids}

    def _reference_ids(self) -> Iterator[str]:
        """The reference's first-phase answers that teacher-forced scoring can use."""
        c = self.cfg
        return iter(reference_offsets(c.run_dir / RESULTS, self.reference, c.schedules[0].label))

    # -- resume ---------------------------------------------------------------------------
    def _names(self, name: str) -> list[str]:
        """A target and the arms that run on its server (the reference's A/A control)."""
        control = self.control is not None and name == self.reference
        return [name] + ([self.control.spec.name] if self.control and control else [])

    def _complete(self, name: str) -> bool:
        """Resume: every phase has a final result for every request (and scores if due)."""
        names = self._names(name)
        skipped = self._skipped_before(name)
        done = [
            self.resume.finished(n, s.label)
            for n in names
            for s in self.cfg.schedules
            if s.label not in skipped
        ]
        phases_done = all(all(req.id in d for d in done) for req in self.cfg.trace.iter_requests())
        tf_due = self.cfg.teacher_forced and any(
            (n, rid) not in self.resume.tf_done for rid in self._reference_ids() for n in names
        )
        return phases_done and not tf_due

    def _skipped_before(self, name: str) -> list[str]:
        """The levels an earlier process of this run left out when the sweep stopped."""
        prev = self.resume.previous.get(name) or {}
        return list((prev.get("sweep_stopped") or {}).get("skipped", []))

    def _restore(self, run: TargetRun) -> None:
        run.status, run.reason, run.phases, run.info = self.resume.restore(run.spec.name)

    # -- one target -----------------------------------------------------------------------
    async def _target(self, run: TargetRun) -> None:
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
                server = LocalServer(
                    spec,
                    self.cfg.run_dir / "servers" / f"{spec.name}.log",
                    startup_timeout_s=self.cfg.startup_timeout_s,
                )
                self.progress.status(
                    f"[{spec.name}] starting vLLM ({spec.kv_cache_dtype} KV cache)"
                )
                if not await launch(server, run.info, self.save_manifest, self.stopping):
                    return  # interrupted while starting: the finally below stops it
            url = server.url if server is not None else spec.url
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

    # -- serving one target ---------------------------------------------------------------
    async def _serve(self, run: TargetRun, url: str, server: LocalServer | None) -> None:
        """Introspect, check and replay one target. A target that cannot be used raises
        TargetError; ``_target`` records it as failed with every request unavailable."""
        spec = run.spec
        # The target's key goes with every call made on this session (introspection,
        # /metrics, /tokenize, teacher-forced scoring), and only to the target's URL.
        async with api_session(spec.auth_headers()) as session:
            info = await introspect(session, url)
            run.info.update(info)
            if server is not None:
                log = server.log_text()
                run.info["engine_config"] = engine_config_from_log(log)
                run.info["scale_log_lines"] = scale_lines(log)
                run.info["log"] = str(server.log_path.relative_to(self.cfg.run_dir))
            model = served_model(info)
            check_served_dtype(
                spec,
                info["cache_config"].get("cache_dtype"),
                server.log_text() if server is not None else None,
                run.info["problems"],
            )
            self.save_manifest()
            client = Client(
                url,
                model,
                api_key=spec.api_key(),
                timeout_s=self.cfg.timeout_s,
                seed=self.cfg.seed,
                epoch=self.clock.epoch,
                token_logprobs=self.cfg.teacher_forced,
            )
            try:
                await self._phases(run, session, client, url)
            finally:
                await client.close()
        if not run.budget.spent:
            run.status = "ok"

    @asynccontextmanager
    async def target_session(
        self, run: TargetRun, session: aiohttp.ClientSession, client: Client, url: str
    ) -> AsyncIterator[TargetSession]:
        """One target's prompt lengths on its tokenizer, and its /metrics scraped while the
        block lasts (into ``metrics/<target>.jsonl``)."""
        trace = self.cfg.trace
        self.progress.status(f"[{run.spec.name}] counting prompt tokens on the target tokenizer")
        pool = await token_pool(session, url, client.model) if trace.has_synth else None
        counts = await prompt_token_counts(
            session,
            url,
            client.model,
            trace.iter_requests(),
            trace.count,
            problems=run.info["problems"],
        )
        run.info["tokens_counted"] = sum(c != UNKNOWN for c in counts)
        series = JsonlWriter(
            self.cfg.run_dir / "metrics" / f"{run.spec.name}.jsonl", self.stop.cannot_write
        )

        def sink(snap: MetricsSnapshot) -> None:
            series.write(snap.to_json())

        scraper = Scraper(session, url, self.clock.now, sink)
        scraper.start()
        try:
            mml = run.info.get("max_model_len")
            yield TargetSession(run.spec.name, client, counts, pool, run.budget, scraper, mml)
        finally:
            await scraper.stop()
            series.close()
            run.info["scrape_failures"] = scraper.failures
            if scraper.first_failure is not None:
                run.info["problems"].append(
                    f"{scraper.failures} /metrics scrape(s) failed; first: {scraper.first_failure}"
                )

    async def _phases(
        self, run: TargetRun, session: aiohttp.ClientSession, client: Client, url: str
    ) -> None:
        """Every phase of one target (then, for the reference, its A/A control on the same
        server), then teacher-forced scoring, with /metrics scraped throughout."""
        async with self.target_session(run, session, client, url) as arm:
            if not await self._send_arms(run, arm):
                return
            if self.cfg.teacher_forced and not self.stopping.is_set():
                scoring = Scoring(
                    session,
                    url,
                    client.model,
                    self.tf_writer,
                    self.progress,
                    self.cfg.timeout_s,
                    salt=None,
                    # A local server is started to serve them; an external one is asked.
                    cached=run.spec.is_local or await serves_cached_scores(session, url),
                )
                for name in self._names(run.spec.name):  # its own, then its A/A control's
                    await self._teacher_forced(self.all_runs()[name], scoring)

    async def _send_arms(self, run: TargetRun, arm: TargetSession) -> bool:
        """Every phase of one target, then, for the reference, its A/A control on the same
        server; False when it must go no further (``InterleavedRunner`` sends them in blocks)."""
        if not await self._arm(run, arm, skip=self._skipped_before(run.spec.name)):
            return False
        if run.spec.name == self.reference:
            await self._control(run, arm)
        return True

    async def _arm(self, run: TargetRun, arm: TargetSession, skip: Sequence[str] = ()) -> bool:
        """Every phase for one arm (but those in ``skip``, above where its sweep stopped);
        False when it must go no further (its budget is spent, or the run is interrupted)."""
        labels = [s.label for s in self.cfg.schedules]
        for k, sched in enumerate(self.cfg.schedules):
            if sched.label in skip:
                continue
            await self._phase(run, arm, sched)
            rest = [x for x in labels[k + 1 :] if x not in skip]
            if rest and self._saturated(run, arm.name):
                run.info["sweep_stopped"] = {**run.info["sweep_stopped"], "skipped": rest}
                self.save_manifest()
                break
        if run.budget.spent:
            self._budget_spent(run)
            return False
        return not self.stopping.is_set()

    def _saturated(self, run: TargetRun, name: str) -> bool:
        """--stop-at-saturation: whether the sweep may stop rising for this target."""
        if not self.cfg.stop_at_saturation or self.stopping.is_set() or run.budget.spent:
            return False
        c = self.cfg
        why = stop_rising(c.run_dir, name, run.phases, c.buckets.labels, c.slo)
        if why is not None:
            run.info["sweep_stopped"] = {"after": list(run.phases)[-1], "reason": why}
            self.progress.status(f"[{name}] {why}: the sweep stops rising")
        return why is not None

    async def _control(self, ref: TargetRun, arm: TargetSession) -> None:
        """A/A: the same server, the same requests, again (its own cache salt and budget)."""
        assert self.ref_done is not None
        if self.control is not None:
            self.control.info = dict(ref.info)
            control = replace(arm, name=self.control.spec.name, budget=self.control.budget)
            skipped = (ref.info.get("sweep_stopped") or {}).get("skipped", [])
            await self._arm(self.control, control, skip=skipped)
            if not self.control.budget.spent:
                self.control.status = "ok"
        self.ref_done.set()

    async def _phase(self, run: TargetRun, arm: TargetSession, sched: Schedule) -> None:
        label = sched.label
        salt = self.cfg.phase_salt(arm.name, label)
        phase = Phase(
            target=arm,
            sched=sched,
            trace=self.cfg.trace,
            buckets=self.cfg.buckets,
            writer=self.writer,
            progress=self.progress,
            clock=self.clock,
            stopping=self.stopping,
            timeout_s=self.cfg.phase_timeout_s,
            salt=salt,
            # Resume: the results of an earlier process are all for this trace's requests.
            before_done=self.resume.finished(arm.name, label),
            sessions=(
                Sessions(self.cfg.think, self.history, is_reference=arm.name == self.reference)
                if self.sessions
                else None
            ),
        )
        window = await self.sender.send(phase, run, self.stop)
        if window is not None:
            run.phases[label] = window
            self.save_manifest()

    async def _teacher_forced(self, run: TargetRun, scoring: Scoring) -> None:
        """Score the reference's first-phase answers under this target (its own answers and
        its prefix cache under its first phase's salt save most of the work)."""
        assert self.ref_done is not None
        await self.ref_done.wait()
        name, first = run.spec.name, self.cfg.schedules[0].label
        await score_answers(
            name,
            self.cfg.run_dir / RESULTS,
            self.reference,
            first,
            self.resume.tf_done,
            replace(scoring, salt=self.cfg.phase_salt(name, first)),
        )

    def _budget_spent(self, run: TargetRun) -> None:
        run.spend_budget()
        self.save_manifest()

    def _record_unavailable(self, run: TargetRun) -> None:
        """A target that cannot serve still accounts for every planned request."""
        now = self.clock.now()
        for sched in self.cfg.schedules:
            run.phases.setdefault(sched.label, {"start": now, "end": now})
            for req in self.cfg.trace.iter_requests():
                self.writer.write(run.unavailable(req.id, sched.label, now).to_json())
