"""One replay: every target, every phase, every request, written as it completes.

The runner knows schedules, the client, targets and the run directory; it reports progress
through the ``Progress`` protocol, so the terminal UI (rich) lives in the CLI, not here.
"""

from __future__ import annotations

import asyncio
import platform
import signal
import sys
import time
from array import array
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp
import orjson

from replay import __version__
from replay.analysis.grading import (
    CONTROL_SUFFIX,
    Gradable,
    GradingSpec,
    assess_quality,
    grade_rows,
    grading_spec,
)
from replay.analysis.roles import Roles
from replay.analysis.roles import resolve as resolve_roles
from replay.analysis.schemas import Summary
from replay.analysis.summary import SUMMARY_VERSION, summarize_targets
from replay.analysis.systems import systems, throughput_ratio
from replay.analysis.verdict import Thresholds, decide, facts_from_run
from replay.core.buckets import Buckets
from replay.core.errors import InputError, ServerStartError, TargetError
from replay.core.importers import LengthPolicy, stream
from replay.core.records import Result
from replay.core.schedule import ClosedLoop, MonotonicClock, OpenLoop
from replay.core.synth import POOL_TEXT, TokenPool, synthesize
from replay.core.trace import Request, TraceSource
from replay.run.budget import ErrorBudget
from replay.run.rundir import (
    GRADES,
    MANIFEST,
    RESULTS,
    SUMMARY,
    TEACHER_FORCED,
    JsonlWriter,
    file_digest,
    read_json,
    read_jsonl,
    read_results,
    repair_jsonl,
    rewrite_jsonl,
    write_bad_lines,
    write_json,
)
from replay.run.teacher import score as tf_score
from replay.serving.client import Client
from replay.serving.introspect import (
    EndpointError,
    MetricsSnapshot,
    Scraper,
    engine_config_from_log,
    fetch_json,
    introspect,
    served_model,
)
from replay.serving.targets import LocalServer, TargetSpec, check_served_dtype, scale_lines

Schedule = ClosedLoop | OpenLoop
T = TypeVar("T")


class Progress(Protocol):
    def status(self, message: str) -> None: ...

    def phase(self, target: str, label: str, total: int) -> None: ...

    def advance(self, target: str, label: str, ok: bool) -> None: ...


class QuietProgress:
    def status(self, message: str) -> None:
        pass

    def phase(self, target: str, label: str, total: int) -> None:
        pass

    def advance(self, target: str, label: str, ok: bool) -> None:
        pass


@dataclass
class RunConfig:
    # A ``StreamedTrace`` (the CLI) is re-read for each pass; the runner never holds all of
    # the requests, only what is in flight and what its results need.
    trace: TraceSource
    trace_path: Path
    trace_format: str
    targets: Sequence[TargetSpec]
    schedules: Sequence[Schedule]
    buckets: Buckets
    run_dir: Path
    length_policy: LengthPolicy = field(default_factory=LengthPolicy)
    parallel_targets: bool = False
    timeout_s: float = 600.0
    phase_timeout_s: float = 3600.0
    startup_timeout_s: float = 900.0
    seed: int = 0
    # A prefix-cache salt per phase, so a phase does not reuse the cache a previous phase
    # filled with the same prompts (that would flatter TTFT). Sharing within a phase stays.
    salt_phases: bool = True
    # Quality: the target others are compared with (default: bf16, else the first), an A/A
    # replay of it for the noise floor, and teacher-forced scoring of its answers.
    reference: str | None = None
    candidate: str | None = None
    calibrated: str | None = None
    control: bool = False
    teacher_forced: bool = True
    tolerance: float = 0.05
    thresholds: Thresholds = field(default_factory=Thresholds)
    # Interrupts: in-flight requests get this long to finish before they are cancelled.
    drain_s: float = 30.0
    # Continue an interrupted or killed run in ``run_dir``: send only what has no final result.
    resume: bool = False
    # Each target's error budget (replay/run/budget.py): past it the target gets no more requests.
    max_errors: int | None = None
    max_error_rate: float | None = 0.05
    cli_options: dict[str, Any] = field(default_factory=dict)
    command: Sequence[str] = field(default_factory=lambda: list(sys.argv))


@dataclass
class TargetRun:
    """What happened to one target; goes into the manifest."""

    spec: TargetSpec
    status: str = "pending"  # ok | failed
    reason: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    series: list[dict[str, Any]] = field(default_factory=list)
    budget: ErrorBudget = field(default_factory=ErrorBudget)

    def manifest(self) -> dict[str, Any]:
        return {
            "spec": self.spec.describe(),
            "status": self.status,
            "reason": self.reason,
            **self.info,
            "phases": self.phases,
        }


class Runner:
    def __init__(self, cfg: RunConfig, progress: Progress | None = None) -> None:
        self.cfg = cfg
        self.progress = progress or QuietProgress()
        self.clock = MonotonicClock()
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
        self.stopping = asyncio.Event()
        self.interrupted = False
        self._drain_task: asyncio.Task[None] | None = None
        self.resume_note: dict[str, Any] = {}
        self.done: dict[tuple[str, str], set[str]] = {}
        self.tf_done: set[tuple[str, str]] = set()
        self.previous: dict[str, Any] = {}
        if cfg.resume:
            self._load_previous()
        self.writer = JsonlWriter(cfg.run_dir / RESULTS)
        self.tf_writer = JsonlWriter(cfg.run_dir / TEACHER_FORCED)
        self.started_at = time.time()

    def _budget(self) -> ErrorBudget:
        return ErrorBudget(max_errors=self.cfg.max_errors, max_error_rate=self.cfg.max_error_rate)

    # -- manifest -------------------------------------------------------------------------
    def manifest(self) -> dict[str, Any]:
        c = self.cfg
        return {
            "tool": {"name": "kvcanary", "version": __version__},
            "command": list(c.command),
            "started_at": self.started_at,
            "platform": {
                "python": platform.python_version(),
                "machine": platform.machine(),
                "cpu_flags": _cpu_flags(),
            },
            "trace": {
                "path": str(c.trace_path),
                "format": c.trace_format,
                "sha256": file_digest(c.trace_path),
                "lines": c.trace.lines,
                "requests": c.trace.count,
                "bad_lines": c.trace.bad_count,
                "skipped_rows": dict(c.trace.skipped),
                "length_policy": c.length_policy.as_dict(),
            },
            "buckets": {"bounds": c.buckets.spec(), "labels": c.buckets.labels},
            "schedules": [s.label for s in c.schedules],
            "options": {
                "parallel_targets": c.parallel_targets,
                "timeout_s": c.timeout_s,
                "phase_timeout_s": c.phase_timeout_s,
                "seed": c.seed,
                "salt_phases": c.salt_phases,
            },
            "reference": self.reference,
            "roles": self.roles.to_json(),
            "cli_options": self.cfg.cli_options,
            "interrupted": self.interrupted,
            "resumed": self.resume_note or None,
            "targets": {n: r.manifest() for n, r in self.all_runs().items()},
        }

    def all_runs(self) -> dict[str, TargetRun]:
        extra = {self.control.spec.name: self.control} if self.control else {}
        return {**self.runs, **extra}

    def save_manifest(self) -> None:
        write_json(self.cfg.run_dir / MANIFEST, self.manifest())

    # -- the run --------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        write_bad_lines(self.cfg.run_dir, self.cfg.trace.iter_bad())
        self.save_manifest()
        self.ref_done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.interrupt)
        main = asyncio.ensure_future(self._all_targets())
        self._main = main
        try:
            await main
        except asyncio.CancelledError:
            if not self.interrupted:
                raise
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            if self._drain_task is not None:
                self._drain_task.cancel()
            self.writer.close()
            self.tf_writer.close()
            self.save_manifest()
        return self.write_summary()

    async def _all_targets(self) -> None:
        if self.cfg.parallel_targets:
            await asyncio.gather(*(self._target(r) for r in self.runs.values()))
            return
        for r in self.runs.values():
            if self.stopping.is_set():
                break
            await self._target(r)

    def interrupt(self) -> None:
        """First Ctrl-C/SIGTERM: send nothing more, let in-flight requests finish for up to
        ``drain_s``, then cancel them. A second one cancels at once. Summary and reports are
        written either way; ``--resume`` completes the run."""
        if self.stopping.is_set():
            self._main.cancel()
            return
        self.interrupted = True
        self.stopping.set()
        self.progress.status(
            f"interrupted: draining in-flight requests (up to "
            f"{self.cfg.drain_s:g} s; Ctrl-C again to stop now)"
        )

        async def drain() -> None:
            await asyncio.sleep(self.cfg.drain_s)
            self._main.cancel()

        self._drain_task = asyncio.ensure_future(drain())

    def _load_previous(self) -> None:
        """Repair and read what an earlier process of this run wrote."""
        run_dir = self.cfg.run_dir
        dropped = repair_jsonl(run_dir / RESULTS)
        kept, redo = [], 0
        for r in read_results(run_dir):
            if r.status == "cancelled" and not (r.error or "").startswith("not sent: phase"):
                redo += 1  # cut short by the interrupt: it will be sent again
                continue
            kept.append(r.to_json())
            self.done.setdefault((r.target, r.phase), set()).add(r.request_id)
        rewrite_jsonl(run_dir / RESULTS, kept)
        tf_dropped = repair_jsonl(run_dir / TEACHER_FORCED)
        for row in read_jsonl(run_dir / TEACHER_FORCED):
            self.tf_done.add((row["target"], row["request_id"]))
        try:
            self.previous = read_json(run_dir / MANIFEST).get("targets", {})
        except (OSError, ValueError):
            self.previous = {}
        self.resume_note = {
            "kept_results": len(kept),
            "resent_interrupted": redo,
            "repaired_bytes": dropped + tf_dropped,
        }

    def write_summary(self) -> dict[str, Any]:
        runs = self.all_runs()
        series = {n: r.series for n, r in runs.items()}
        if self.control is not None:  # the control ran on the reference's server
            series[self.control.spec.name] = series[self.reference]
        return analyse(
            Analysis(
                run_dir=self.cfg.run_dir,
                targets={
                    n: {
                        "status": r.status,
                        "reason": r.reason,
                        "cache_config": r.info.get("cache_config") or {},
                        "phases": r.phases,
                    }
                    for n, r in runs.items()
                },
                series=series,
                reference=self.reference,
                candidate=self.roles.candidate,
                first_phase=self.cfg.schedules[0].label,
                bucket_labels=self.cfg.buckets.labels,
                tolerance=self.cfg.tolerance,
                seed=self.cfg.seed,
                thresholds=self.cfg.thresholds,
                manifest=self.manifest(),
                grading_specs=self._grading_specs,
            )
        ).to_json()

    def _grading_specs(self, ids: set[str]) -> dict[str, GradingSpec]:
        """Task and checker of each request that has results: what grading needs of the
        trace, with the prompt's text (capped) only where derived grading reads it."""
        return {r.id: grading_spec(r) for r in self.cfg.trace.iter_requests() if r.id in ids}

    def _reference_answers(self) -> Iterator[Result]:
        """The reference's answers in the first phase that teacher-forced scoring can use,
        read back from results.jsonl rather than kept in memory."""
        path = self.cfg.run_dir / RESULTS
        if not path.exists():
            return
        first = self.cfg.schedules[0].label
        with path.open("rb") as fh:
            for raw in fh:
                if not raw.endswith(b"\n"):
                    break  # another target's line, still being written (after ours)
                row = orjson.loads(raw)
                if (
                    row["target"] == self.reference
                    and row["phase"] == first
                    and row["status"] == "ok"
                    and row.get("prompt_ids")
                    and row.get("output_ids")
                ):
                    yield Result.from_json(row)

    def _complete(self, name: str) -> bool:
        """Resume: every phase has a final result for every request (and scores if due)."""
        names = [name] + (
            [self.control.spec.name] if self.control and name == self.reference else []
        )
        done = [self.done.get((n, s.label), set()) for n in names for s in self.cfg.schedules]
        phases_done = all(all(req.id in d for d in done) for req in self.cfg.trace.iter_requests())
        tf_due = self.cfg.teacher_forced and any(
            (n, r.request_id) not in self.tf_done for r in self._reference_answers() for n in names
        )
        return phases_done and not tf_due

    async def _healthy_or_stopped(self, server: LocalServer) -> bool:
        health: asyncio.Future[None] = asyncio.get_running_loop().run_in_executor(
            None, server.wait_healthy
        )
        stop: asyncio.Future[Any] = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait([health, stop], return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if health.done():
            health.result()  # raises ServerStartError when the server died
            return True
        # The polling thread ends by itself once the server is stopped.
        health.add_done_callback(lambda f: f.exception())
        return False

    def _restore(self, run: TargetRun) -> None:
        prev = dict(self.previous.get(run.spec.name) or {})
        run.status, run.reason = prev.pop("status", "ok"), prev.pop("reason", None)
        run.phases = prev.pop("phases", {}) or {}
        prev.pop("spec", None)
        run.info = prev

    async def _target(self, run: TargetRun) -> None:
        spec = run.spec
        server: LocalServer | None = None
        if self.cfg.resume and spec.name in self.previous and self._complete(spec.name):
            self._restore(run)
            if self.control is not None and spec.name == self.reference:
                self._restore(self.control)
            if spec.name == self.reference and self.ref_done is not None:
                self.ref_done.set()
            return
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
                server.start()
                assert server.proc is not None
                run.info["server"] = {
                    "pid": server.proc.pid,
                    "url": server.url,
                    "command": server.command(),
                }
                self.save_manifest()
                if not await self._healthy_or_stopped(server):
                    return  # interrupted while starting: the finally below stops it
                url = server.url
            else:
                assert spec.url is not None
                url = spec.url
            await self._serve(run, url, server)
        except TargetError as exc:
            reason = exc.reason if isinstance(exc, ServerStartError) else str(exc)
            run.status = "failed"
            run.reason = (
                f"server did not start: {reason}" if isinstance(exc, ServerStartError) else reason
            )
            if server is not None:
                run.info["engine_config"] = engine_config_from_log(server.log_text())
                run.info["log"] = str(server.log_path.relative_to(self.cfg.run_dir))
            self._record_unavailable(run)
        finally:
            if spec.name == self.reference and self.ref_done is not None:
                self.ref_done.set()  # also on failure: nobody waits forever
            if server is not None:
                self.progress.status(f"[{spec.name}] stopping server")
                await asyncio.get_running_loop().run_in_executor(None, server.stop)
                if "scale_log_lines" in run.info:
                    # again at the end: some lines (the FP8 emulation's scales per layer)
                    # come only with the first cache write
                    run.info["scale_log_lines"] = scale_lines(server.log_text())
            self.save_manifest()

    async def _serve(self, run: TargetRun, url: str, server: LocalServer | None) -> None:
        """Introspect, check and replay one target. A target that cannot be used raises
        TargetError; ``_target`` records it as failed with every request unavailable."""
        spec = run.spec
        # The target's key goes with every call made on this session (introspection,
        # /metrics, /tokenize, teacher-forced scoring), and only to the target's URL.
        async with aiohttp.ClientSession(headers=spec.auth_headers()) as session:
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
            )
            try:
                await self._phases(run, session, client, url)
            finally:
                await client.close()
        if not run.budget.spent:
            run.status = "ok"

    async def _phases(
        self, run: TargetRun, session: aiohttp.ClientSession, client: Client, url: str
    ) -> None:
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
        series_file = JsonlWriter(self.cfg.run_dir / "metrics" / f"{run.spec.name}.jsonl")

        def sink(snap: MetricsSnapshot) -> None:
            row = snap.to_json()
            run.series.append(row)
            series_file.write(row)

        scraper = Scraper(session, url, self.clock.now, sink)
        scraper.start()
        try:
            for sched in self.cfg.schedules:
                await self._phase(run, sched, client, pool, counts, scraper)
            if run.budget.spent:
                self._budget_spent(run)
                return
            if self.stopping.is_set():
                return
            if run.spec.name == self.reference:
                assert self.ref_done is not None
                if self.control is not None:
                    # A/A: the same server, the same requests, again (its own cache salt).
                    self.control.info = dict(run.info)
                    for sched in self.cfg.schedules:
                        await self._phase(self.control, sched, client, pool, counts, scraper)
                    if self.control.budget.spent:
                        self._budget_spent(self.control)
                    else:
                        self.control.status = "ok"
                self.ref_done.set()
            if self.cfg.teacher_forced and not self.stopping.is_set():
                await self._teacher_forced(run, session, url, client.model)
                if run.spec.name == self.reference and self.control is not None:
                    await self._teacher_forced(self.control, session, url, client.model)
        finally:
            await scraper.stop()
            series_file.close()
            run.info["scrape_failures"] = scraper.failures
            if scraper.first_failure is not None:
                run.info["problems"].append(
                    f"{scraper.failures} /metrics scrape(s) failed; first: {scraper.first_failure}"
                )

    async def _phase(
        self,
        run: TargetRun,
        sched: Schedule,
        client: Client,
        pool: TokenPool | None,
        counts: array[int],
        scraper: Scraper,
    ) -> None:
        name, label = run.spec.name, sched.label
        before_done = self.done.get((name, label), set())
        # Resume: the results of an earlier process are all for this trace's requests.
        total = self.cfg.trace.count - len(before_done)
        if total <= 0 or self.stopping.is_set():
            return  # resumed: this phase is complete (or the run is being interrupted)
        budget = run.budget
        # The schedule stops on an interrupt or when this target's error budget is spent.
        halt = asyncio.Event()
        if budget.spent:  # in an earlier phase: this one sends nothing
            halt.set()
        relay = asyncio.ensure_future(self.stopping.wait())
        relay.add_done_callback(lambda f: None if f.cancelled() else halt.set())
        self.progress.phase(name, label, total)
        # Per target too: the A/A control must not reuse the reference's cache on its server.
        salt = f"{self.cfg.run_dir.name}.{name}.{label}" if self.cfg.salt_phases else None

        def bucket(i: int) -> str:
            n = counts[i]
            return self.cfg.buckets.label(n) if n != UNKNOWN else "unknown"

        # The schedule pulls requests from the file as it sends them; ``pending`` holds the
        # ones it has pulled and not finished (at most what is in flight, plus one waiting for
        # its time), so what a time limit leaves unsent is ``pending`` and the rest of ``todo``.
        pending: dict[int, Request] = {}

        def pulled(items: Iterator[tuple[int, Request]]) -> Iterator[tuple[int, Request]]:
            for i, req in items:
                pending[i] = req
                yield i, req

        async def send(item: tuple[int, Request], scheduled: float) -> None:
            i, req = item
            # Backoff while the target does not answer; then it is stopped, not spun on.
            wait = budget.delay()
            if wait:
                await _pause(wait, halt)
            if halt.is_set():
                return  # left in ``pending``: recorded after the phase as not sent
            res = Result(
                request_id=req.id,
                target=name,
                phase=label,
                bucket=bucket(i),
                scheduled=scheduled,
                prompt_tokens=_count(counts[i]),
            )
            ids = synthesize(req, pool) if req.synth is not None and pool is not None else None
            try:
                await client.send(req, res, ids, salt)
            finally:
                self.writer.write(res.to_json())
                pending.pop(i, None)
                self.progress.advance(name, label, res.status == "ok")
                budget.record(res.status, res.error_kind, res.http_status, res.error)
                if budget.spent:
                    halt.set()

        with closing(self.cfg.trace.iter_requests()) as reqs:
            todo = ((i, r) for i, r in enumerate(reqs) if r.id not in before_done)
            # Scrapes at the phase's edges make server-side deltas cover exactly this phase.
            before = await scraper.scrape_once()
            start = before.t if before is not None else self.clock.now()
            try:
                await asyncio.wait_for(
                    sched.run(pulled(todo), send, self.clock, halt), self.cfg.phase_timeout_s
                )
            except TimeoutError:
                pass
            finally:
                relay.cancel()
            after = await scraper.scrape_once()
            end = after.t if after is not None else self.clock.now()
            # Requests the phase never sent (time limit) are results too; after an interrupt
            # they are left for --resume to send.
            if not self.stopping.is_set():
                unsent = sorted(pending.items())
                pending.clear()
                for i, req in [*unsent, *todo]:
                    self.writer.write(self._not_sent(run, req, label, bucket(i), end))
        run.phases[label] = {
            "start": start,
            "end": end,
            **({"resumed": True} if before_done else {}),
            **({"interrupted": True} if self.stopping.is_set() else {}),
        }
        self.save_manifest()

    async def _teacher_forced(
        self,
        run: TargetRun,
        session: aiohttp.ClientSession,
        url: str,
        model: str,
        concurrency: int = 4,
    ) -> None:
        """Score the reference's first-phase answers under this target."""
        assert self.ref_done is not None
        await self.ref_done.wait()
        name = run.spec.name

        def answers() -> Iterator[Result]:
            return (
                r for r in self._reference_answers() if (name, r.request_id) not in self.tf_done
            )

        due = sum(1 for _ in answers())
        if not due:
            return
        self.progress.phase(name, "teacher-forced", due)
        salt = f"{self.cfg.run_dir.name}.{name}.tf"

        async def one(ref: Result) -> None:
            assert ref.prompt_ids is not None
            s = await tf_score(
                session,
                url,
                model,
                ref.prompt_ids,
                ref.output_ids,
                salt=salt,
                timeout_s=self.cfg.timeout_s,
            )
            self.tf_writer.write(
                {"target": name, "request_id": ref.request_id, "bucket": ref.bucket, **s.to_json()}
            )
            self.progress.advance(name, "teacher-forced", s.error is None)

        # The answers are read from the results file as the workers take them (their token
        # ids are the bulk of a result), never all at once.
        with closing(answers()) as items:
            await pooled(items, one, concurrency)

    def _budget_spent(self, run: TargetRun) -> None:
        """The target failed by its error budget; later phases sent it nothing (their rows
        were written as not sent, so every request is still accounted for)."""
        run.status, run.reason = "failed", f"error budget spent: {run.budget.reason}"
        run.info["error_budget"] = {
            "finished": run.budget.finished,
            "errors": run.budget.errors,
            "reason": run.budget.reason,
        }
        self.save_manifest()

    def _not_sent(
        self, run: TargetRun, req: Request, label: str, bucket: str, at: float
    ) -> dict[str, Any]:
        """A request the phase did not send: the target's error budget was spent (final: the
        target failed), or the phase ran out of time (cancelled)."""
        if run.budget.spent:
            res = Result(
                request_id=req.id,
                target=run.spec.name,
                phase=label,
                bucket=bucket,
                scheduled=at,
                status="error",
                error_kind="unavailable",
                error=f"not sent: {run.budget.reason}",
            )
        else:
            res = Result(
                request_id=req.id,
                target=run.spec.name,
                phase=label,
                bucket=bucket,
                scheduled=at,
                status="cancelled",
                error_kind="cancelled",
                error=f"not sent: phase time limit {self.cfg.phase_timeout_s:g} s",
            )
        return res.to_json()

    def _record_unavailable(self, run: TargetRun) -> None:
        """A target that cannot serve still accounts for every planned request."""
        now = self.clock.now()
        for sched in self.cfg.schedules:
            run.phases.setdefault(sched.label, {"start": now, "end": now})
            for req in self.cfg.trace.iter_requests():
                res = Result(
                    request_id=req.id,
                    target=run.spec.name,
                    phase=sched.label,
                    bucket="unknown",
                    scheduled=now,
                    status="error",
                    error_kind="unavailable",
                    error=run.reason,
                )
                self.writer.write(res.to_json())


async def token_pool(session: aiohttp.ClientSession, url: str, model: str) -> TokenPool:
    """Synthetic prompts are made of the target's own token ids: a target that cannot
    tokenize cannot replay them (TargetError naming what /tokenize answered)."""
    why = "synthetic prompts are made of the target's own token ids"
    try:
        ids = await _tokenize(
            session, url, {"model": model, "prompt": POOL_TEXT, "add_special_tokens": False}
        )
        return TokenPool(ids)
    except EndpointError as exc:
        raise TargetError(f"{url} has no usable /tokenize endpoint ({exc}); {why}") from None
    except ValueError as exc:  # too few distinct ids to build prompts from
        raise TargetError(
            f"{url} has no usable /tokenize endpoint (POST /tokenize: {exc}); {why}"
        ) from None


async def _tokenize(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[int]:
    """The token ids /tokenize gives for ``body``; EndpointError when it gives none."""
    ans = await fetch_json(session, "POST", url, "/tokenize", json_body=body, timeout_s=60.0)
    v = ans.value
    tokens = v.get("tokens") if isinstance(v, dict) else None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise ans.wrong('an object with a "tokens" list of token ids')
    return tokens


async def pooled(
    items: Iterator[T], work: Callable[[T], Awaitable[None]], concurrency: int
) -> None:
    """``work`` on every item, ``concurrency`` at a time, taking items only as workers free
    up: a million items are never a million pending coroutines."""

    async def worker() -> None:
        for item in items:  # shared: each item goes to exactly one worker
            await work(item)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


@contextmanager
def closing(items: Iterator[T]) -> Iterator[Iterator[T]]:
    """Close a generator (and the file it reads) when the reader stops early; plain
    iterators have nothing to close."""
    try:
        yield items
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()


UNKNOWN = -1  # a prompt length the target could not count (``counts`` hold no None)


def _count(n: int) -> int | None:
    return None if n == UNKNOWN else n


async def prompt_token_counts(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    reqs: Iterable[Request],
    n: int,
    concurrency: int = 16,
    problems: list[str] | None = None,
) -> array[int]:
    """Prompt length of each of the ``n`` requests on the target's own tokenizer (chat
    template applied), by position in ``reqs``; where /tokenize cannot count one, the
    trace's ``input_tokens`` or ``UNKNOWN``, and a line in ``problems`` says how many and
    why. Eight bytes a request, whatever the prompts hold."""
    out = array("q", [UNKNOWN]) * n
    failed, first = 0, ""

    async def one(item: tuple[int, Request]) -> None:
        nonlocal failed, first
        i, req = item
        known = req.declared_tokens
        if known is None:
            if req.api == "chat":
                body: dict[str, Any] = {
                    "model": model,
                    "messages": list(req.messages or ()),
                    "add_generation_prompt": True,
                }
                if req.tools:
                    body["tools"] = list(req.tools)
            else:
                body = {"model": model, "prompt": req.prompt}
            try:
                known = len(await _tokenize(session, url, body))
            except EndpointError as exc:
                failed, first = failed + 1, first or str(exc)
                known = req.input_tokens
        out[i] = UNKNOWN if known is None else known

    with closing(iter(reqs)) as items:
        await pooled(enumerate(items), one, concurrency)
    if failed and problems is not None:
        problems.append(
            f"{failed} of {n} prompt(s) not counted on the target's tokenizer "
            f"(bucketed by the trace's input_tokens, else 'unknown'); first: "
            f"{first}"
        )
    return out


async def count_tokens(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    reqs: Sequence[Request],
    concurrency: int = 16,
    problems: list[str] | None = None,
) -> dict[str, int | None]:
    """``prompt_token_counts`` by request id, for callers that hold their requests."""
    counts = await prompt_token_counts(session, url, model, reqs, len(reqs), concurrency, problems)
    return {r.id: _count(c) for r, c in zip(reqs, counts, strict=True)}


def _cpu_flags() -> dict[str, bool]:
    """The CPU features that decide which vLLM CPU kernels (FP8 KV among them) exist."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile")}


def load_results(run_dir: Path, prompt_ids: bool = True) -> list[Result]:
    """Every result of a run; ``prompt_ids=False`` drops the prompt token ids (often the
    largest part of a result) for readers that do not use them."""
    if prompt_ids:
        return list(read_results(run_dir))
    out = []
    for r in read_results(run_dir):
        r.prompt_ids = None
        out.append(r)
    return out


async def _pause(seconds: float, halt: asyncio.Event) -> None:
    """Sleep, or less when ``halt`` is set meanwhile."""
    try:
        await asyncio.wait_for(halt.wait(), seconds)
    except TimeoutError:
        pass


# -- analysis: results -> grades and summary ----------------------------------------------------


@dataclass(frozen=True)
class Analysis:
    """Everything that turns a run directory's results into grades and its summary. The runner
    fills it from its own state at the end of a run, ``reanalyse`` from the run directory."""

    run_dir: Path
    targets: Mapping[str, Mapping[str, Any]]  # name -> status, reason, cache_config, phases
    series: Mapping[str, Sequence[Mapping[str, Any]]]
    reference: str
    candidate: str | None
    first_phase: str
    bucket_labels: Sequence[str]
    tolerance: float
    seed: int
    thresholds: Thresholds
    manifest: Mapping[str, Any]
    grading_specs: Callable[[set[str]], Mapping[str, Gradable]]
    verdict: bool = True  # a Locust run (one target) has none
    grading: bool = True  # Locust with --kvc-checkers off: no grades
    results: Sequence[Result] | None = None  # None: read from the run directory
    driver: Mapping[str, Any] | None = None  # a Locust run: what drove it (its manifest's)


def analyse(a: Analysis) -> Summary:
    """Write ``grades.jsonl`` and ``summary.json`` of a run; return the summary."""
    # Prompt ids are only for teacher-forced scoring, which reads them from the file.
    results = (
        list(a.results) if a.results is not None else load_results(a.run_dir, prompt_ids=False)
    )
    summary = Summary(
        version=SUMMARY_VERSION,
        targets=summarize_targets(results, a.targets, a.series, a.bucket_labels),
        run_dir=str(a.run_dir),
        driver=a.driver,
    )
    if a.grading:
        rows = grade_rows(results, a.grading_specs({r.request_id for r in results}), a.reference)
        with (a.run_dir / GRADES).open("w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(orjson.dumps(row).decode() + "\n")
        tf_rows = list(_complete_rows(a.run_dir / TEACHER_FORCED))
        summary = replace(
            summary,
            quality=assess_quality(
                rows,
                tf_rows,
                a.reference,
                a.bucket_labels,
                a.tolerance,
                a.seed,
                alpha=a.thresholds.alpha,
                min_pairs=a.thresholds.min_pairs,
            ),
        )
    if a.verdict:
        if a.candidate is not None:
            compared = systems(results, a.reference, a.candidate, a.first_phase, a.seed)
            summary = replace(
                summary,
                systems=replace(
                    compared,
                    throughput_ratio=(
                        throughput_ratio(summary, a.reference, a.candidate, a.first_phase)
                    ),
                ),
            )
        verdict = decide(
            facts_from_run(summary, a.manifest, candidate=a.candidate, thresholds=a.thresholds),
            a.thresholds,
        )
        summary = replace(summary, verdict=verdict)
    write_json(a.run_dir / SUMMARY, summary.to_json())
    return summary


def reanalyse(run_dir: Path, trace_path: Path | None = None) -> dict[str, Any]:
    """Grades and summary of a run whose analysis failed or never ran (killed, stopped by
    SIGTERM, a checker that crashed an older version), from what its directory holds: the
    manifest (targets, phases, options), results.jsonl, metrics/ and teacher_forced.jsonl, and
    the checks of its trace (``trace_path``, else the manifest's, which must be unchanged).
    Reads the run directory without repairing it; a line cut short at the end of a file is
    left out."""
    manifest = _manifest(run_dir)
    results = []
    for r in _complete_results(run_dir):
        r.prompt_ids = None
        results.append(r)
    names = list(manifest["targets"])
    reference = str(manifest.get("reference") or names[0])
    targets = {n: _target_facts(manifest["targets"][n], n, results) for n in names}
    series: dict[str, list[Any]] = {
        n: list(_complete_rows(run_dir / "metrics" / f"{n}.jsonl")) for n in names
    }
    for n in names:  # the control ran on the reference's server, which its metrics describe
        if n == reference + CONTROL_SUFFIX:
            series[n] = series.get(reference, [])
    cli = manifest.get("cli_options") or {}
    tolerance = float(cli.get("tolerance", 0.05))
    thresholds = Thresholds(
        tolerance=tolerance,
        alpha=float(cli.get("alpha", 0.05)),
        min_pairs=int(cli.get("min_pairs", 20)),
        required_capacity_ratio=float(cli.get("required_capacity_ratio", 1.5)),
        max_error_rate=float(cli.get("max_error_rate", 0.05)),
        accept_emulated=bool(cli.get("accept_emulated", False)),
    )
    roles = Roles.from_manifest(manifest, _ordered(names, cli.get("targets")))
    schedules = list(manifest.get("schedules") or [])
    locust = "driver" in manifest
    return analyse(
        Analysis(
            run_dir=run_dir,
            targets=targets,
            series=series,
            reference=reference,
            candidate=None if locust else roles.candidate,
            first_phase=schedules[0] if schedules else next((r.phase for r in results), ""),
            bucket_labels=list((manifest.get("buckets") or {}).get("labels") or []),
            tolerance=tolerance,
            seed=int((manifest.get("options") or {}).get("seed", 0)),
            thresholds=thresholds,
            manifest=manifest,
            grading_specs=_trace_checks(run_dir, manifest, trace_path),
            verdict=not locust,
            results=results,
            driver=manifest["driver"] if locust else None,
        )
    ).to_json()


def _manifest(run_dir: Path) -> dict[str, Any]:
    try:
        manifest = read_json(run_dir / MANIFEST)
    except (OSError, ValueError) as exc:
        raise InputError(
            f"{run_dir}: no readable {MANIFEST} ({exc}); is this a kvcanary run directory?"
        ) from None
    if (
        not isinstance(manifest, dict)
        or not isinstance(manifest.get("targets"), dict)
        or not manifest["targets"]
        or not isinstance(manifest.get("trace"), dict)
    ):
        raise InputError(f"{run_dir / MANIFEST}: not a kvcanary manifest (no targets or trace)")
    return manifest


def _complete_rows(path: Path) -> Iterator[Any]:
    """The JSON lines of a file that a kill may have cut short: an unfinished last line is
    the one being written, not data."""
    if not path.exists():
        return
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.endswith(b"\n"):
                return
            if raw.strip():
                try:
                    yield orjson.loads(raw)
                except orjson.JSONDecodeError as exc:
                    raise InputError(f"{path}:{lineno}: not JSON ({exc})") from None


def _complete_results(run_dir: Path) -> Iterator[Result]:
    for lineno, row in enumerate(_complete_rows(run_dir / RESULTS), 1):
        try:
            yield Result.from_json(row)
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(
                f"{run_dir / RESULTS}: result {lineno} is not a result "
                f"({type(exc).__name__}: {exc})"
            ) from None


def _target_facts(info: Mapping[str, Any], name: str, results: Sequence[Result]) -> dict[str, Any]:
    """What the summary needs of a target, from its manifest entry. A phase that some result
    names but the manifest has no window for (the run was killed inside it) gets the span of
    its results, so that its requests are counted."""
    phases = {k: dict(v) for k, v in (info.get("phases") or {}).items()}
    spans: dict[str, list[float]] = {}
    for r in results:
        if r.target == name and r.phase not in phases:
            times = [t for t in (r.scheduled, r.sent, r.done) if t is not None]
            span = spans.setdefault(r.phase, [min(times), max(times)])
            span[0], span[1] = min(span[0], *times), max(span[1], *times)
    for label, (start, end) in spans.items():
        phases[label] = {"start": start, "end": end, "interrupted": True}
    return {
        "status": info.get("status"),
        "reason": info.get("reason"),
        "cache_config": info.get("cache_config") or {},
        "phases": phases,
    }


def _ordered(names: Sequence[str], targets_option: Any) -> list[str]:
    """The targets in the order ``--targets`` gave them (the manifest's keys are sorted)."""
    order = [p.split("=", 1)[0].strip() for p in str(targets_option or "").split(",")]
    return [n for n in order if n in names] + sorted(n for n in names if n not in order)


def _trace_checks(
    run_dir: Path, manifest: Mapping[str, Any], trace_path: Path | None
) -> Callable[[set[str]], dict[str, GradingSpec]]:
    """The checks of the run's own trace, by request id (read when grading asks for them)."""
    trace = manifest["trace"]
    path = trace_path or Path(str(trace.get("path")))
    if not path.is_file():
        raise InputError(
            f"{run_dir}: the run's trace {path} is not there, and grading needs "
            "its checks; give it with --trace PATH"
        )
    if trace.get("sha256") and file_digest(path) != trace["sha256"]:
        raise InputError(
            f"{path}: not the trace of {run_dir} (its sha256 differs from the "
            "manifest's): its checks would grade other requests; give the "
            "original with --trace PATH"
        )
    fmt = str(trace.get("format") or "auto")

    def checks(ids: set[str]) -> dict[str, GradingSpec]:
        return {r.id: grading_spec(r) for r in stream(path, fmt, on_bad_line="skip") if r.id in ids}

    return checks
