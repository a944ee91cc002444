"""Whether a rising load sweep may stop for a target (``--stop-at-saturation``): after each
level, the target's results so far are summarized as the analysis does and judged by
``replay.analysis.saturation.saturated`` (its throughput fell, or a knee lies below the level
just run and that level missed the SLOs; without SLOs, a knee passed). The levels above are
then not run; the manifest says where the sweep stopped and why."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from replay.analysis.saturation import saturated, saturation_of
from replay.analysis.schemas import Summary
from replay.analysis.summary import SUMMARY_VERSION, summarize_targets
from replay.core.slo import SloSpec
from replay.pipeline.analyse import load_results


def stop_rising(
    run_dir: Path,
    name: str,
    phases: Mapping[str, Mapping[str, Any]],
    bucket_labels: Sequence[str],
    slo: SloSpec | None,
) -> str | None:
    """Why the sweep may stop rising for ``name`` after the levels in ``phases``, or None."""
    if len(phases) < 2:
        return None
    results = [r for r in load_results(run_dir, prompt_ids=False) if r.target == name]
    info = {name: {"status": "ok", "reason": None, "cache_config": {}, "phases": phases}}
    targets = summarize_targets(results, info, {name: []}, bucket_labels, slo)
    sweep = saturation_of(Summary(version=SUMMARY_VERSION, targets=targets), list(phases))
    curves = sweep.targets.get(name) if sweep is not None else None
    if curves is None or not saturated(curves):
        return None
    last = list(phases)[-1]
    knee = curves.all.knee
    if knee is not None:
        return f"saturated at {last}: knee at {knee.phase} ({knee.reason})"
    return f"saturated at {last}: its throughput fell below an earlier level's"
