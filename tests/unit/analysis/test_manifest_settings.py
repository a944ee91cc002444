"""What the analysis reads of how a run was asked to run comes from the manifest's run spec,
and, for a run written before manifests recorded one, from that run's options and flags: the
same settings either way."""

from __future__ import annotations

from typing import Any

from replay.analysis.run_spec import (
    BudgetSpec,
    LoadSpec,
    QualitySpec,
    RunDirSpec,
    RunSpec,
    TraceSpec,
)
from replay.analysis.schemas.manifest import Manifest
from replay.analysis.thresholds import Thresholds

SPEC = RunSpec(
    trace=TraceSpec(path="t.jsonl", format="v1", sha256="ab", requests=7),
    load=LoadSpec(targets=("fp8", "bf16"), schedules=("c1", "c4"), seed=7, interleave=True),
    quality=QualitySpec(buckets="256,1K", slo="ttft=2s", quality_phase="c1", tolerance=0.1),
    budget=BudgetSpec(max_error_rate=0.2),
    run_dir=RunDirSpec(path="reports/r1"),
)
# The same run as a manifest written before the run spec held it.
OLDER = {
    "options": {"seed": 7, "interleave": {"block_size": "auto"}, "quality_phase": "c1"},
    "cli_options": {
        "targets": "fp8=http://a/v1, bf16",
        "tolerance": 0.1,
        "max_error_rate": 0.2,
        "slo": "ttft=2s",
    },
}


def _manifest(**keys: Any) -> Manifest:
    return Manifest.from_json({"schedules": ["c1", "c4"], "targets": {}, **keys}, where="m")


def _settings(m: Manifest) -> tuple[Any, ...]:
    return (m.seed, m.interleaved, m.quality_phase, m.slo, m.target_order, m.thresholds())


def test_the_run_spec_and_an_older_runs_keys_give_the_same_settings() -> None:
    recorded = _manifest(run_spec=SPEC.to_json(), options={})
    older = _manifest(**OLDER)
    assert recorded.run_spec == SPEC
    assert _settings(recorded) == _settings(older)
    assert _settings(recorded) == (
        7,
        True,
        "c1",
        "ttft=2s",
        ("fp8", "bf16"),
        Thresholds(tolerance=0.1, max_error_rate=0.2),
    )


def test_a_run_that_recorded_neither_reads_the_defaults() -> None:
    bare = _manifest(options={})
    assert _settings(bare) == (0, False, None, None, (), Thresholds())
