"""The run directory of one Locust test, written as ``replay`` writes it, through the same
manifest builder and analysis."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from replay.analysis.grading.rows import grading_spec
from replay.analysis.result_table import phase_spans
from replay.analysis.roles import Roles
from replay.analysis.run_spec import RunSpec
from replay.analysis.schemas.manifest import Manifest
from replay.core.records import Result
from replay.pipeline.analyse import Sources, analyse, results_table
from replay.rundir.files import MANIFEST, RESULTS, JsonlWriter, write_json
from replay.rundir.manifest import build_manifest, target_entry, trace_facts
from replay.serving.targets import (
    TargetSpec,
)
from replay.traces.trace import Request, TraceSource


def cancelled_result(
    req: Request, target: str, phase: str, bucket: str, at: float, kind: str, reason: str
) -> Result:
    """A request the test will not send (stopped, or the target is unavailable): a result
    too, so every trace request is accounted for."""
    return Result(
        request_id=req.id,
        target=target,
        phase=phase,
        bucket=bucket,
        scheduled=at,
        status="cancelled" if kind == "cancelled" else "error",
        error_kind="cancelled" if kind == "cancelled" else "unavailable",
        error=reason,
    )


def lost_result(
    req: Request, target: str, phase: str, bucket: str, at: float, kind: str, reason: str
) -> Result:
    """A request a lost worker leaves without a result (``ledger.Ledger.unresolved``):
    ``lost`` (it had taken it) or ``unavailable`` (nobody sent it). Cancelled, not an error:
    a load generator died, which says nothing of the target."""
    unsent = cancelled_result(req, target, phase, bucket, at, "cancelled", reason)
    return replace(unsent, error_kind="lost" if kind == "lost" else "unavailable")


# -- the run directory ------------------------------------------------------------------------


DEFAULT_MAX_RESULTS = 250_000


@dataclass
class RunRecorder:
    """The run directory of one Locust test, in ``replay``'s format: ``manifest.json``,
    ``results.jsonl`` (appended as results arrive), ``metrics/<target>.jsonl``,
    ``grades.jsonl`` (with checkers on) and ``summary.json``, so ``replay report`` renders it."""

    run_dir: Path
    # Streamed: counted for the manifest, re-read for the grading specs (never held).
    trace: TraceSource
    # The manifest's spec block: the trace's path and digest, the buckets and schedules, and
    # what the analysis reads (checkers, seed, SLOs, thresholds).
    run_spec: RunSpec
    spec: TargetSpec
    options: dict[str, Any]
    driver: dict[str, Any]
    command: list[str]
    status: str = "ok"
    reason: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    # A looping test (--kvc-loop on) has no natural end: past this many result rows, results
    # are counted, not stored, so no test can fill the disk (Locust's statistics still see
    # every request). 0: no cap.
    max_results: int = DEFAULT_MAX_RESULTS

    def __post_init__(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "metrics").mkdir(exist_ok=True)
        self._results = JsonlWriter(self.run_dir / RESULTS)
        self._metrics = JsonlWriter(self.run_dir / "metrics" / f"{self.spec.name}.jsonl")
        self._open: tuple[str, float] | None = None
        self.received = 0
        self.dropped = 0

    # results and metrics arrive as they happen
    def add_results(self, rows: Iterable[Mapping[str, Any]]) -> None:
        for row in rows:
            if self.max_results and self.received >= self.max_results:
                if not self.dropped:
                    self.info.setdefault("problems", []).append(
                        f"results past --kvc-max-results {self.max_results} were counted, "
                        "not stored"
                    )
                self.dropped += 1
                continue
            self._results.write(row)
            self.received += 1

    def add_snapshot(self, row: dict[str, Any]) -> None:
        self._metrics.write(row)

    # phases: the windows results are grouped in
    def open_phase(self, label: str, t: float) -> None:
        self.close_phase(t)
        self._open = (label, t)
        self.phases.setdefault(label, {"start": t, "end": t})

    def close_phase(self, t: float) -> None:
        if self._open is not None:
            label, _ = self._open
            self.phases[label]["end"] = max(self.phases[label]["end"], t)
            self._open = None

    def fail(self, reason: str) -> None:
        self.status, self.reason = "failed", reason

    def manifest(self) -> dict[str, Any]:
        """The CLI's manifest (replay/rundir/manifest.py), with what drove the test: its one
        target is the reference."""
        return build_manifest(
            driver=self.driver,
            spec=self.run_spec,
            roles=Roles(self.spec.name),
            command=self.command,
            started_at=self.started_at,
            trace=trace_facts(self.trace.lines, self.trace.bad_count, self.trace.skipped),
            options=self.options,
            results_not_stored=self.dropped,
            targets={
                self.spec.name: target_entry(
                    self.spec, self.status, self.reason, self.info, self.phases
                )
            },
        )

    def save_manifest(self) -> None:
        write_json(self.run_dir / MANIFEST, self.manifest())

    def finish(self) -> dict[str, Any]:
        """Write manifest, grades and summary from everything received (callable again when
        late results arrive: each call rewrites them)."""
        results = results_table(self.run_dir)  # columns, as the CLI's analysis reads them
        # A phase some result names but no window covers (e.g. the target failed before the
        # first phase opened) gets the span of its results, so the summary counts them.
        for label, (start, end) in phase_spans(results, self.phases).items():
            self.phases[label] = {"start": start, "end": end}
        self.save_manifest()
        ids = results.request_ids()
        specs = {r.id: grading_spec(r) for r in self.trace.iter_requests() if r.id in ids}
        # The CLI's own analysis (replay/pipeline/analyse.py): one pipeline for both drivers, which
        # reads how to decide from the manifest's run spec.
        manifest = Manifest.from_json(self.manifest(), where="manifest")
        sources = Sources(grading_specs=lambda ids: specs, results=results)
        return analyse(self.run_dir, manifest, sources).to_json()

    def close(self) -> None:
        self._results.close()
        self._metrics.close()
