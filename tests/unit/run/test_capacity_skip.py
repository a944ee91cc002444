"""Whether the capacity phase runs: not where the quality side decides the verdict alone
(``rule.quality_decides``, asked through ``analyze.quality_verdict`` on the workload's results),
the same verdict the analysis at the end gives, and not without an A/A control."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from replay.analysis.schemas.manifest import Manifest
from replay.analysis.thresholds import Thresholds
from replay.analysis.verdict.facts import ArmFacts, BucketFacts, Facts
from replay.analysis.verdict.rule import decide, quality_decides
from replay.pipeline.analyse import analyse, quality_verdict
from replay.run.capacity_phase import why_not
from replay.run.capacity_step import not_needed
from replay.rundir.files import GRADES
from replay.serving.targets import TargetSpec
from tests.support.analysis_run import analysis, manifest

MATCH = tuple(BucketFacts(b, 200, 0.0, -0.02, 0.02, 1.0, None, None, 2, 2) for b in "ab")
LOSS = (BucketFacts("a", 200, -0.2, -0.3, -0.1, 1e-6, None, None, 40, 0), MATCH[1])
FEW = tuple(BucketFacts(b, 10, 0.0, -0.3, 0.3, 1.0, None, None, 0, 0) for b in "ab")

QUALITY = {
    "a loss asks for calibration": (Facts("bf16", ArmFacts("fp8", buckets=LOSS)), "calibrate"),
    "a fallback is rejected": (
        Facts("bf16", ArmFacts("fp8", ("served cache dtype auto",), MATCH)),
        "reject",
    ),
    "too few pairs": (Facts("bf16", ArmFacts("fp8", buckets=FEW)), "insufficient_evidence"),
    "a match leaves it to whether FP8 pays": (Facts("bf16", ArmFacts("fp8", buckets=MATCH)), None),
}


@pytest.mark.parametrize("name", list(QUALITY))
def test_the_quality_side_decides_alone_exactly_where_the_verdict_does(name: str) -> None:
    facts, kind = QUALITY[name]
    v = quality_decides(facts, Thresholds())
    if kind is None:
        assert v is None
        # Whatever the systems side then says, it decides: the capacity phase is needed.
        assert decide(facts, Thresholds()).verdict in ("keep", "reject")
        return
    assert v is not None and v.verdict == kind
    assert v.headline == decide(facts, Thresholds()).headline  # the same verdict, and why


def test_the_runs_quality_verdict_is_the_analysis_verdict_without_writing_grades(
    tmp_path: Path,
) -> None:
    """The deterministic run's calibrated arm decides it on quality: what the run asks before
    its capacity phase is what its analysis at the end says, and no grades.jsonl is written."""
    a = analysis(tmp_path / "run")
    early = quality_verdict(*a)
    assert not (a.run_dir / GRADES).exists()
    final = analyse(*a).verdict
    assert early is not None and final is not None
    assert (early.verdict, early.headline) == (final.verdict, final.headline)
    assert (a.run_dir / GRADES).exists()
    reason = not_needed(early)
    assert reason.startswith(f"not needed: the quality side decided {final.headline}")


def test_at_scale_one_the_runs_quality_verdict_is_the_analysis_verdict(tmp_path: Path) -> None:
    """The same run with no calibrated role: FP8 at scale 1.0 against the reference."""
    m = manifest()
    m["roles"] = {"reference": "bf16", "candidate": "fp8"}
    a = replace(analysis(tmp_path / "run"), manifest=Manifest.from_json(m))
    early = quality_verdict(*a)
    final = analyse(*a).verdict
    assert early is not None and final is not None
    assert final.verdict in ("calibrate", "insufficient_evidence")
    assert (early.verdict, early.headline) == (final.verdict, final.headline)


def test_no_control_no_phase() -> None:
    bf16, fp8 = TargetSpec("bf16", model="/m"), TargetSpec("fp8", model="/m")
    why = why_not("auto", bf16, fp8, False, 0.1, 0.5, control=False)
    assert why is not None and "no A/A control" in why
    assert why_not("auto", bf16, fp8, False, 0.1, 0.5, control=True) is None
