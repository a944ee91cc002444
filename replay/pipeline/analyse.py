"""One analysis for every run directory: results -> grades.jsonl and summary.json.

It reads a run directory and its ``Manifest`` (the run's ``RunSpec`` says how to decide), with
``Sources`` for what neither holds (the trace's checks). The runner calls it at the end of a
run, the Locust adapter at the end of a test, and ``replay report --reanalyse`` (``reanalyse``)
on a run whose analysis never ran; all three get the same files. The server-side series come from
``metrics/<target>.jsonl``, which both drivers write as they scrape, so neither keeps them in
memory."""

from __future__ import annotations

import collections
import contextlib
import gc
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from replay.analysis.capacity import capacity_phase
from replay.analysis.grading.quality import CONTROL_SUFFIX, Graded, assess_quality
from replay.analysis.grading.rows import (
    GRADE_BATCH,
    Gradable,
    iter_grade_rows,
)
from replay.analysis.grading.trend import prompt_token_counts
from replay.analysis.reasoning import reasoning_length
from replay.analysis.result_table import ResultTable, phase_spans
from replay.analysis.roles import Roles
from replay.analysis.saturation import saturation_of
from replay.analysis.schemas import (
    CapacityPhase,
    Quality,
    Sequential,
    Summary,
    SystemsRule,
    Verdict,
)
from replay.analysis.schemas.manifest import Manifest, TargetEntry
from replay.analysis.summary import SUMMARY_VERSION, summarize_targets
from replay.analysis.systems import systems, throughput_ratio
from replay.analysis.systems_cells import (
    Planned,
    block_counts,
    block_list,
    block_rates,
    latency_cells,
    rate_cell,
)
from replay.analysis.systems_cells import rule as rule_of
from replay.analysis.thresholds import Thresholds
from replay.analysis.verdict.candidates import decide_candidates, quality_first
from replay.analysis.verdict.facts import facts_from_run
from replay.analysis.verdict.rule import decide
from replay.core.errors import InputError
from replay.core.records import Result
from replay.core.slo import SloSpec, parse_slo
from replay.pipeline.target_facts import target_for_summary as target_for_summary
from replay.rundir.files import (
    CAPACITY_DIR,
    GRADES,
    RESULTS,
    SUMMARY,
    TEACHER_FORCED,
    complete_results,
    complete_rows,
    read_results,
    rewrite_jsonl,
    write_json,
)
from replay.rundir.sequential_file import load_record


def load_results(run_dir: Path, prompt_ids: bool = True) -> list[Result]:
    """Every result of a run; ``prompt_ids=False`` gives them ``lean``: without the prompt
    token ids (often the largest part of a result) and what else the analysis never reads."""
    if prompt_ids:
        return held(read_results(run_dir))
    return held(lean(r) for r in read_results(run_dir))


def held(results: Iterable[Result]) -> list[Result]:
    """The results as a list, read with the cyclic garbage collector paused (a tenth of the
    analysis's time at 100k results, ``gc_paused``)."""
    with gc_paused():
        return list(results)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused: what the analysis makes a million at a time (the
    results, each request's checks, the grade rows) holds no reference cycles, yet each full
    collection walks every object still alive (a fifth of grading's time at 1M results)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def lean(r: Result) -> Result:
    """A result as the analysis keeps it, a million at a time: without what it never reads
    (prompt token ids, log-probabilities, the reasoning's text), its labels shared with every
    other result's (interned)."""
    r.prompt_ids = r.output_logprobs = None
    r.reasoning_text = ""
    r.target, r.phase, r.bucket = sys.intern(r.target), sys.intern(r.phase), sys.intern(r.bucket)
    if r.finish_reason is not None:
        r.finish_reason = sys.intern(r.finish_reason)
    return r


@dataclass(frozen=True)
class Sources:
    """What the analysis reads besides the run directory and its manifest: the checks of the
    trace's requests (by id), and where a driver already holds what the directory has."""

    grading_specs: Callable[[set[str]], Mapping[str, Gradable]]
    results: Sequence[Result] | ResultTable | None = None  # None: read from the run directory
    # Server-side series by target; None: read from the run directory's metrics/ files.
    series: Mapping[str, Sequence[Mapping[str, Any]]] | None = None
    # Told how grading goes, a batch at a time: (answers graded, of how many).
    progress: Callable[[int, int], None] | None = None


@dataclass(frozen=True)
class AnalysedRun:
    """The run being analysed, as its manifest describes it (``of``): what every step of the
    analysis reads."""

    run_dir: Path
    manifest: Manifest
    sources: Sources
    targets: Mapping[str, Mapping[str, Any]]  # name -> summary_targets.target_for_summary(...)
    reference: str
    candidate: str | None
    first_phase: str
    bucket_labels: Sequence[str]
    thresholds: Thresholds
    slo: SloSpec | None  # SLO attainment and goodput per group
    sequential: Sequential | None  # a sequential canary's block (it decides the verdict)
    grades_file: bool = True  # False: grade without writing grades.jsonl (``quality_verdict``)

    @classmethod
    def of(
        cls, run_dir: Path, manifest: Manifest, sources: Sources, results: ResultTable
    ) -> AnalysedRun:
        names = list(manifest.targets)
        reference = manifest.reference or names[0]
        roles = Roles.from_manifest(manifest, _ordered(names, manifest.target_order))
        schedules = list(manifest.schedules)
        return cls(
            run_dir=run_dir,
            manifest=manifest,
            sources=sources,
            targets={n: _target_facts(manifest.targets[n], n, results) for n in names},
            reference=reference,
            candidate=None if manifest.driver is not None else roles.candidate,
            first_phase=schedules[0] if schedules else (results.values("phase") or [""])[0],
            bucket_labels=list(manifest.buckets.labels),
            thresholds=manifest.thresholds(),
            slo=_saved_slo(manifest),
            sequential=load_record(run_dir),
        )

    @property
    def seed(self) -> int:
        return self.manifest.seed

    @property
    def verdict(self) -> bool:
        """A Locust run (one target) has none."""
        return self.manifest.driver is None

    @property
    def grading(self) -> bool:
        """Locust with --kvc-checkers off: no grades."""
        spec = self.manifest.run_spec
        return spec is None or spec.quality.checkers


def _results(run_dir: Path, sources: Sources) -> ResultTable:
    # Prompt ids are only for teacher-forced scoring, which reads them from the file.
    given = sources.results
    if given is None:
        return results_table(run_dir)
    return given if isinstance(given, ResultTable) else ResultTable.of(given)


def analyse(run_dir: Path, manifest: Manifest, sources: Sources) -> Summary:
    """Write ``grades.jsonl`` and ``summary.json`` of the run in ``run_dir``, as ``manifest``
    describes it; return the summary."""
    results = _results(run_dir, sources)
    a = AnalysedRun.of(run_dir, manifest, sources, results)
    summary = _measured(a, results)
    if a.verdict:
        summary = _decide(a, results, summary)
    write_json(run_dir / SUMMARY, summary.to_json())
    return summary


def quality_verdict(run_dir: Path, manifest: Manifest, sources: Sources) -> Verdict | None:
    """The primary candidate's verdict where the quality side decides it alone
    (``candidates.quality_first``: the verdict the analysis at the end gives it), from the
    run's results so far: what a run asks before its capacity phase, which only whether FP8
    pays needs. Grades as the analysis does, without writing grades.jsonl (the analysis at the
    end writes it)."""
    results = _results(run_dir, sources)
    a = replace(AnalysedRun.of(run_dir, manifest, sources, results), grades_file=False)
    if a.candidate is None:
        return None
    summary = _measured(a, results)
    return quality_first(summary, a.manifest, candidates_of(a), a.candidate, a.thresholds)


def _measured(a: AnalysedRun, results: ResultTable) -> Summary:
    """Everything the summary holds but the systems comparison and the verdict."""
    summary = Summary(
        version=SUMMARY_VERSION,
        targets=summarize_targets(
            results,
            a.targets,
            _series(a),
            a.bucket_labels,
            a.slo,
        ),
        run_dir=str(a.run_dir),
        driver=a.manifest.driver,
    )
    labels = list(a.manifest.schedules)
    sweep = saturation_of(summary, labels) if labels else None
    if sweep is not None:
        summary = replace(summary, saturation=sweep)
    if a.grading:
        summary = replace(summary, quality=_graded_quality(a, results))
    # Only answers that reasoned have a length to compare: most runs have none to read.
    reasoned = results.counts("reasoning_tokens").any()
    length = reasoning_length(results, a.reference, a.bucket_labels, a.seed) if reasoned else None
    if length is not None:
        summary = replace(summary, reasoning=length)
    if a.sequential is not None:
        summary = replace(summary, sequential=a.sequential)
    return summary


def _series(a: AnalysedRun) -> Mapping[str, Sequence[Mapping[str, Any]]]:
    given = a.sources.series
    return given if given is not None else read_series(a.run_dir, a.targets, a.reference)


def _graded_quality(a: AnalysedRun, results: ResultTable) -> Quality:
    """Grade every answer into ``grades.jsonl`` and judge quality from the grades. Its own
    function so that what grading holds (every request's checks, a few fields of every
    grade) is let go before the next step."""
    return assess_quality(
        _grades(a, results),
        list(complete_rows(a.run_dir / TEACHER_FORCED)),
        a.reference,
        a.bucket_labels,
        a.thresholds.rule,
        a.seed,
        prompt_tokens=prompt_token_counts(results, a.reference),
    )


def _grades(a: AnalysedRun, results: ResultTable) -> Graded:
    """Every answer graded into ``grades.jsonl``, as it is graded; quality keeps a few fields
    of each row (``Graded``). The checks of every request are let go on return."""
    with gc_paused():
        specs = a.sources.grading_specs(results.request_ids())
        graded = Graded()
        rows = (
            graded.add(row)
            for row in _told(iter_grade_rows(results, specs, a.reference), a, results)
        )
        if a.grades_file:
            rewrite_jsonl(a.run_dir / GRADES, rows)
        else:
            collections.deque(rows, maxlen=0)
    return graded


def _told(rows: Iterator[Any], a: AnalysedRun, results: ResultTable) -> Iterator[Any]:
    """The rows, telling ``progress`` every ``GRADE_BATCH`` of them, and at the end."""
    progress = a.sources.progress
    if progress is None:
        yield from rows
        return
    k = 0
    for k, row in enumerate(rows, 1):
        if k % GRADE_BATCH == 0:
            progress(k, len(results))
        yield row
    progress(k, len(results))


def candidates_of(a: AnalysedRun) -> list[str]:
    """The targets compared with the reference, in the order --targets gave them: the primary
    candidate and every other target but the calibrated and layers arms and the A/A control."""
    roles = Roles.from_manifest(a.manifest, list(a.targets))
    order = _ordered(list(a.targets), a.manifest.target_order)
    arms = (a.reference, a.candidate, roles.calibrated, roles.layers)
    others = [n for n in order if n not in arms and not n.endswith(CONTROL_SUFFIX)]
    return ([a.candidate] if a.candidate is not None else []) + others


def _decide(a: AnalysedRun, results: Sequence[Result], summary: Summary) -> Summary:
    """The systems comparison of each candidate with the reference, and the verdicts: the
    primary candidate's decides the run; with several, each has its own
    (``verdict.candidates``)."""
    names = candidates_of(a) if a.candidate is not None else []
    systems_of = {}
    first = load_phases(a)[0]
    for name in names:
        rule, capacity = systems_rule(a, results, name)
        compared = systems(results, a.reference, name, first, a.seed, rule=rule)
        ratio = throughput_ratio(summary, a.reference, name, first)
        systems_of[name] = replace(compared, capacity=capacity, throughput_ratio=ratio)
    if a.candidate is None:
        facts = facts_from_run(summary, a.manifest, candidate=None, thresholds=a.thresholds)
        return replace(summary, verdict=decide(facts, a.thresholds))
    summary = replace(summary, systems=systems_of[a.candidate])
    verdicts = decide_candidates(summary, a.manifest, names, a.candidate, systems_of, a.thresholds)
    return replace(
        summary,
        verdict=verdicts[a.candidate],
        candidates=verdicts if len(verdicts) > 1 else None,
    )


def systems_rule(
    a: AnalysedRun, results: Sequence[Result], candidate: str
) -> tuple[SystemsRule, CapacityPhase | None]:
    """The systems rule's cells (``analysis.systems_cells``): latency per phase and bucket;
    with SLOs, goodput per interleaved phase over its blocks; the capacity phase's rate."""
    control = a.reference + CONTROL_SUFFIX
    control_name = control if control in a.targets else None
    phases = load_phases(a)
    blocks = {
        name: {ph: block_list(w) for ph, w in t["phases"].items()} for name, t in a.targets.items()
    }
    planned = latency_cells(results, a.reference, candidate, control_name, phases, blocks)
    if a.slo is not None:
        for ph in phases:
            arms = [n for n in (a.reference, candidate, control_name) if n is not None]
            if all(blocks.get(n, {}).get(ph) for n in arms[:2]):
                counts = {
                    n: block_counts(results, blocks[n].get(ph, []), a.slo, target=n, phase=ph)
                    for n in arms
                }
                rates = {n: block_rates(c) for n, c in counts.items()}
                planned.append(
                    rate_cell(ph, "goodput_rps", rates, a.reference, candidate, control_name)
                )
    # The capacity phase serves the reference and the primary candidate only.
    capacity, cell = (
        _capacity(a, candidate, control_name) if candidate == a.candidate else (None, None)
    )
    if cell is not None:
        planned.append(cell)
    interleaved = a.manifest.interleaved
    th = a.thresholds
    return (
        rule_of(
            planned,
            alpha=th.alpha,
            threshold=th.systems_threshold,
            control=control_name,
            interleaved=interleaved,
        ),
        capacity,
    )


def load_phases(a: AnalysedRun) -> list[str]:
    """The phases the systems side reads: every phase but the quality pass (--quality-pass
    serial's c1 answers one request at a time for quality, not at the workload's load), unless
    it is the run's only phase."""
    phases = list(a.manifest.schedules) or [a.first_phase]
    quality = a.manifest.quality_phase
    return [p for p in phases if p != quality] or phases


def _capacity(
    a: AnalysedRun, candidate: str, control: str | None
) -> tuple[CapacityPhase | None, Planned | None]:
    """The capacity phase from the manifest's ``capacity`` block and its own files."""
    block = a.manifest.capacity
    if block is None:
        return None, None
    where = a.run_dir / CAPACITY_DIR
    results = list(complete_results(where)) if (where / RESULTS).exists() else []
    servers = {str(i.get("server") or n) for n, i in (block.get("arms") or {}).items()}
    series = {n: list(complete_rows(where / "metrics" / f"{n}.jsonl")) for n in servers}
    return capacity_phase(block, results, series, a.slo, a.reference, candidate, control)


def _saved_slo(manifest: Manifest) -> SloSpec | None:
    """The SLOs the run was started with (``--slo``, or the Locust test's ``--kvc-slo``)."""
    text = manifest.slo
    labels = list(manifest.buckets.labels)
    return parse_slo(text, labels or None) if text else None


def read_series(
    run_dir: Path, names: Iterator[str] | Mapping[str, Any], reference: str
) -> dict[str, list[Any]]:
    """Each target's /metrics snapshots, from ``metrics/<target>.jsonl``. An A/A control that
    ran on the reference's server (it has no file of its own) is described by the reference's
    snapshots."""
    series = {n: list(complete_rows(run_dir / "metrics" / f"{n}.jsonl")) for n in names}
    for n in series:
        if n == reference + CONTROL_SUFFIX and not series[n]:
            series[n] = series.get(reference, [])
    return series


def results_table(run_dir: Path) -> ResultTable:
    """The run's results as the analysis holds them: columns (``ResultTable``), without what
    it never reads. A line cut short at the end is left out; a line that is not a result is
    an error naming it."""
    table = ResultTable()
    for lineno, row in enumerate(complete_rows(run_dir / RESULTS), 1):
        try:
            table.add_row(row)
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(
                f"{run_dir / RESULTS}: result {lineno} is not a result "
                f"({type(exc).__name__}: {exc})"
            ) from None
    return table


def _target_facts(info: TargetEntry, name: str, results: ResultTable) -> dict[str, Any]:
    """What the summary needs of a target, from its manifest entry. A phase that some result
    names but the manifest has no window for (the run was killed inside it) gets the span of
    its results, so that its requests are counted."""
    phases = {k: dict(v) for k, v in info.phases.items()}
    for label, (start, end) in phase_spans(results, phases, target=name).items():
        phases[label] = {"start": start, "end": end, "interrupted": True}
    return target_for_summary(
        info.status or None,
        info.reason,
        info.cache_config,
        phases,
        model_dirs=(info.spec.model, info.model_root),
        max_model_len=info.max_model_len,
    )


def _ordered(names: Sequence[str], order: Sequence[str]) -> list[str]:
    """The targets in the order they were given (the manifest's keys are sorted)."""
    return [n for n in order if n in names] + sorted(n for n in names if n not in order)
