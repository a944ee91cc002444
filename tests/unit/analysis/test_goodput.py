"""Attainment and goodput under ``--slo``: per target x phase x bucket, in agreement with a
computation by hand over a recorded run's results; in the terminal table; and goodput deciding
whether FP8 pays when the run has SLOs. The grammar is tests/unit/core/test_slo.py."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from replay.analysis.schemas import Summary
from replay.analysis.thresholds import Thresholds
from replay.analysis.verdict.facts import ArmFacts, BucketFacts, Facts
from replay.analysis.verdict.rule import decide
from replay.core.records import Result
from replay.core.slo import meets, parse_slo
from replay.pipeline.analyse import analyse
from replay.present.table import summary_table
from tests.support import analysis_run
from tests.support.systems_cases import cell, rule


def by_hand(results: list[Result], spec_text: str, labels: list[str]) -> dict[tuple, tuple]:
    """(target, phase, bucket) -> (sent, met), counted request by request."""
    spec = parse_slo(spec_text, labels)
    out: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for r in results:
        if r.status == "cancelled":
            continue
        tpot = None
        if r.done is not None and r.first_token is not None and r.output_tokens > 1:
            tpot = (r.done - r.first_token) / (r.output_tokens - 1)
        key = (r.target, r.phase, r.bucket)
        out[key][0] += 1
        out[key][1] += meets(spec.for_bucket(r.bucket), r.status == "ok", r.ttft, tpot, r.e2e)
    return {k: (v[0], v[1]) for k, v in out.items()}


def test_attainment_and_goodput_agree_with_a_hand_computation(tmp_path: Path) -> None:
    a = analysis_run.analysis(tmp_path / "run")
    labels = list(a.manifest.buckets.labels)
    text = f"ttft=400ms,itl=40ms,e2e=3s;{labels[-1]}:ttft=900ms"
    summary = analyse(*a.with_slo(text))
    hand = by_hand(list(analysis_run.results()), text, labels)
    checked = 0
    for (target, phase, bucket), (sent, met) in hand.items():
        ph = summary.targets[target].phases[phase]
        slo = ph.buckets[bucket].slo
        assert slo is not None
        assert (slo.sent, slo.met) == (sent, met), (target, phase, bucket)
        assert slo.attainment == pytest.approx(met / sent)
        assert slo.goodput_rps == pytest.approx(met / ph.duration_s)
        checked += 1
    assert checked >= 6 and 0 < sum(m for _, m in hand.values()) < sum(s for s, _ in hand.values())
    # The phase totals sum their buckets; the bounds shown are each bucket's own.
    for t in summary.targets.values():
        for ph in t.phases.values():
            assert ph.all.slo is not None
            assert ph.all.slo.met == sum(b.slo.met for b in ph.buckets.values() if b.slo)
    last = summary.targets["fp8"].phases["c1"].buckets.get(labels[-1])
    if last is not None and last.slo is not None:
        assert last.slo.bounds_ms["ttft_ms"] == pytest.approx(900.0)
    # Written to summary.json and read back the same.
    again = Summary.from_json(summary.to_json())
    assert again == summary


def test_without_slos_the_summary_is_unchanged(tmp_path: Path) -> None:
    summary = analyse(*analysis_run.analysis(tmp_path / "run"))
    assert "slo" not in summary.to_json()["targets"]["fp8"]["phases"]["c1"]["all"]
    columns = [c.header for c in summary_table(summary).columns]
    assert "SLO met" not in columns


def test_the_table_shows_attainment_and_goodput(tmp_path: Path) -> None:
    a = analysis_run.analysis(tmp_path / "run")
    summary = analyse(*a.with_slo("ttft=400ms,e2e=3s"))
    columns = [c.header for c in summary_table(summary).columns]
    assert columns[-2:] == ["SLO met", "goodput/s"]


def matching(**systems: object) -> Facts:
    same = tuple(
        BucketFacts(b, 200, 0.0, -0.02, 0.02, 1.0, None, None, 2, 2) for b in ("<8K", ">=8K")
    )
    return Facts("bf16", ArmFacts("fp8", buckets=same), **systems)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("facts", "verdict", "reason"),
    [
        # With SLOs the service's goal decides whether FP8 pays, not raw latency.
        (matching(systems=rule(cell("goodput_rps", "better"))), "keep", "within the SLOs"),
        (
            matching(systems=rule(cell("goodput_rps", "same"), cell("ttft_ms", "better"))),
            "reject",
            "no memory or latency gain",
        ),
        (
            matching(systems=rule(cell("goodput_rps", "worse"), cell("ttft_ms", "better"))),
            "reject",
            "fewer requests per second within the SLOs",
        ),
        # Capacity the workload needs still wins first.
        (
            matching(systems=rule(cell("goodput_rps", "worse")), capacity_ratio=2.0),
            "keep",
            "the KV cache",
        ),
        (matching(systems=rule(cell("ttft_ms", "better"))), "keep", "is faster"),
    ],
)
def test_fp8_pays_by_goodput_when_the_run_has_slos(facts: Facts, verdict: str, reason: str) -> None:
    v = decide(facts, Thresholds())
    assert v.verdict == verdict and reason in v.reasons[0], v.reasons
    assert facts.systems is not None
    if any(c.metric == "goodput_rps" for c in facts.systems.cells):
        assert any("goodput" in str(e.get("text")) for e in v.evidence)
