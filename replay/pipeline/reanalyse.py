"""``replay report --reanalyse``: the analysis of a run whose analysis failed or never ran,
from what its directory holds and the checks of its trace."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from replay.analysis.grading.rows import GradingSpec, grading_spec
from replay.analysis.result_table import ResultTable
from replay.analysis.schemas.manifest import Manifest
from replay.core.errors import InputError
from replay.pipeline.analyse import Sources, analyse
from replay.rundir.files import MANIFEST, file_digest
from replay.rundir.manifest import read_manifest
from replay.traces.importers import stream


def reanalyse(
    run_dir: Path,
    trace_path: Path | None = None,
    results: ResultTable | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Grades and summary of a run whose analysis failed or never ran (killed, stopped by
    SIGTERM, a checker that crashed an older version), from what its directory holds: the
    manifest (targets, phases, options), results.jsonl, metrics/ and teacher_forced.jsonl, and
    the checks of its trace (``trace_path``, else the manifest's, which must be unchanged).
    Reads the run directory without repairing it; a line cut short at the end of a file is
    left out. ``results``: the run's results, already read (``results_table``); ``progress``:
    told how grading goes (``Sources.progress``)."""
    manifest = _manifest(run_dir)
    sources = Sources(
        grading_specs=_trace_checks(run_dir, manifest, trace_path),
        results=results,
        progress=progress,
    )
    return analyse(run_dir, manifest, sources).to_json()


def _manifest(run_dir: Path) -> Manifest:
    try:
        manifest = read_manifest(run_dir)
    except (OSError, ValueError) as exc:
        raise InputError(
            f"{run_dir}: no readable {MANIFEST} ({exc}); is this a kvcanary run directory?"
        ) from None
    if not manifest.targets or not manifest.trace.path:
        raise InputError(f"{run_dir / MANIFEST}: not a kvcanary manifest (no targets or trace)")
    return manifest


def _trace_checks(
    run_dir: Path, manifest: Manifest, trace_path: Path | None
) -> Callable[[set[str]], dict[str, GradingSpec]]:
    """The checks of the run's own trace, by request id (read when grading asks for them)."""
    trace = manifest.trace
    path = trace_path or Path(trace.path or "")
    if not path.is_file():
        raise InputError(
            f"{run_dir}: the run's trace {path} is not there, and grading needs "
            "its checks; give it with --trace PATH"
        )
    if trace.sha256 and file_digest(path) != trace.sha256:
        raise InputError(
            f"{path}: not the trace of {run_dir} (its sha256 differs from the "
            "manifest's): its checks would grade other requests; give the "
            "original with --trace PATH"
        )
    fmt = trace.format or "auto"

    def checks(ids: set[str]) -> dict[str, GradingSpec]:
        return {r.id: grading_spec(r) for r in stream(path, fmt, on_bad_line="skip") if r.id in ids}

    return checks
