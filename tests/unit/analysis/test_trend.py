"""The trend across context length: the slope estimator (``stats.trend``), the quality
analysis that feeds it per target and phase (``grading.trend``), and how the verdict reads it
(``verdict.trend``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import orjson
import pytest

from replay.analysis.grading.quality import assess_quality
from replay.analysis.grading.trend import prompt_token_counts
from replay.analysis.result_table import ResultTable
from replay.analysis.schemas import LengthSlope, Quality
from replay.analysis.schemas.manifest import Manifest
from replay.analysis.stats import trend as trend_stats
from replay.analysis.stats.trend import LengthTrend, NoTrend, length_trend
from replay.analysis.thresholds import Thresholds
from replay.analysis.verdict.facts import ArmFacts, BucketFacts, Facts
from replay.analysis.verdict.rule import decide
from replay.analysis.verdict.trend import TrendFacts
from replay.core.records import Result

LENGTHS = {"<2K": 1024, "2K-8K": 4096, "8K-16K": 12288, "16K-32K": 24576}


def _sample(
    rng: np.random.Generator, per_bucket: int, slope: float, noise: float
) -> tuple[list[float], list[float], list[str]]:
    """Requests spread over four length buckets (each within its bucket's range), each
    difference ``slope`` per doubling of context plus normal noise."""
    diffs, tokens, buckets = [], [], []
    for name, mid in LENGTHS.items():
        t = np.exp(rng.uniform(np.log(mid / 1.4), np.log(mid * 1.4), per_bucket))
        diffs += list(slope * np.log2(t) + rng.normal(0.0, noise, per_bucket))
        tokens += list(np.round(t))
        buckets += [name] * per_bucket
    return diffs, tokens, buckets


# -- the estimator ----------------------------------------------------------------------------


def test_a_known_linear_trend_is_recovered() -> None:
    diffs, tokens, buckets = _sample(np.random.default_rng(1), 60, 0.01, 0.01)
    fit = length_trend(diffs, tokens, buckets, seed=3)
    assert isinstance(fit, LengthTrend)
    assert (fit.requests, fit.buckets) == (240, 4)
    assert fit.slope == pytest.approx(0.01, abs=0.002)
    assert 0 < fit.lo < 0.01 < fit.hi and fit.p_value < 0.001
    # Per doubling: the same differences at twice every length give the same slope.
    again = length_trend(diffs, [2 * t for t in tokens], buckets, seed=3)
    assert isinstance(again, LengthTrend) and again.slope == pytest.approx(fit.slope)


def test_without_a_trend_the_interval_covers_zero_at_about_its_level() -> None:
    """120 requests in 4 buckets, heavy-tailed noise, 300 canaries: a 95% interval covers 0
    in 95% of them (give or take the simulation's and the bootstrap's own error)."""
    rng = np.random.default_rng(20261204)
    covered, small_p = 0, 0
    runs = 300
    for k in range(runs):
        diffs, tokens, buckets = _sample(rng, 30, 0.0, 1.0)
        diffs = list(np.asarray(diffs) + rng.standard_t(3, len(diffs)) * 0.02)
        fit = length_trend(diffs, tokens, buckets, n_boot=400, seed=k)
        assert isinstance(fit, LengthTrend)
        covered += fit.lo <= 0.0 <= fit.hi
        small_p += fit.p_value < 0.05
    assert 0.90 <= covered / runs <= 0.99
    assert small_p / runs <= 0.10


def test_the_same_seed_gives_the_same_interval() -> None:
    diffs, tokens, buckets = _sample(np.random.default_rng(2), 20, 0.0, 0.5)
    a, b = (length_trend(diffs, tokens, buckets, seed=7) for _ in range(2))
    c = length_trend(diffs, tokens, buckets, seed=8)
    assert a == b
    assert isinstance(a, LengthTrend) and isinstance(c, LengthTrend)
    assert a.slope == c.slope and (a.lo, a.hi) != (c.lo, c.hi)


def test_graded_differences_with_ties() -> None:
    """-1/0/+1 differences, most of them ties: losses only at the long end fall with length;
    all ties are a slope of exactly 0 with nothing either side."""
    tokens = [1000.0] * 20 + [4000.0] * 20 + [16000.0] * 20
    buckets = ["a"] * 20 + ["b"] * 20 + ["c"] * 20
    diffs = [0.0] * 40 + [-1.0] * 8 + [0.0] * 12
    fit = length_trend(diffs, tokens, buckets, seed=0)
    assert isinstance(fit, LengthTrend) and fit.hi < 0 and fit.p_value < 0.05
    flat = length_trend([0.0] * 60, tokens, buckets, seed=0)
    assert flat == LengthTrend(0.0, 0.0, 0.0, 1.0, 60, 3)


@pytest.mark.parametrize(
    ("diffs", "tokens", "buckets", "why"),
    [
        ([0.1] * 9, [2.0**k for k in range(9)], ["a", "b"] * 4 + ["a"], "9 requests"),
        ([0.1, 0.2] * 10, [2.0**k for k in range(20)], ["a"] * 20, "one bucket"),
        ([0.1, 0.2] * 10, [512.0] * 20, ["a", "b"] * 10, "same context length"),
    ],
)
def test_too_little_to_fit_is_refused_with_the_reason(
    diffs: list[float], tokens: list[float], buckets: list[str], why: str
) -> None:
    fit = length_trend(diffs, tokens, buckets)
    assert isinstance(fit, NoTrend) and why in fit.reason
    assert fit.requests == len(diffs)


def test_bad_input_is_an_error() -> None:
    with pytest.raises(ValueError, match="positive"):
        length_trend([0.0] * 12, [0.0] + [1.0] * 11, ["a", "b"] * 6)
    with pytest.raises(ValueError, match="one length"):
        length_trend([0.0] * 12, [1.0] * 11, ["a", "b"] * 6)


def test_the_large_sample_limit_matches_the_bootstrap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above ``BOOT_INDEX_MAX`` requests the interval is the stratified bootstrap's normal
    limit: at 2,000 requests the two agree to a small part of the interval's width."""
    diffs, tokens, buckets = _sample(np.random.default_rng(5), 500, 0.004, 0.3)
    boot = length_trend(diffs, tokens, buckets, seed=1)
    monkeypatch.setattr(trend_stats, "BOOT_INDEX_MAX", 100)
    normal = length_trend(diffs, tokens, buckets, seed=1)
    assert isinstance(boot, LengthTrend) and isinstance(normal, LengthTrend)
    width = boot.hi - boot.lo
    assert normal.slope == boot.slope
    assert abs(normal.lo - boot.lo) < 0.1 * width and abs(normal.hi - boot.hi) < 0.1 * width
    assert normal.p_value == pytest.approx(boot.p_value, abs=0.02)


# -- in the quality analysis ------------------------------------------------------------------


def _row(target: str, rid: str, bucket: str, passed: bool | None, derived: Any = None) -> Any:
    return {
        "phase": "c1",
        "target": target,
        "request_id": rid,
        "bucket": bucket,
        "answered": True,
        "grade": None if passed is None else {"passed": passed, "reason": "", "detail": {}},
        "derived": derived,
        "agreement": None,
    }


def _tf(target: str, rid: str, nll: float) -> dict[str, Any]:
    return {
        "target": target,
        "request_id": rid,
        "n": 2,
        "nll": [nll] * 2,
        "top1": [1, 1],
        "error": None,
    }


def declining_run() -> tuple[list[Any], list[Any], dict[str, float]]:
    """fp8 passes every short request and fails more the longer the prompt (0, 2, 4, 6 of 15
    per bucket); its teacher-forced NLL rises with length. The control matches the
    reference; 3 requests have no known length."""
    rows, tf, tokens = [], [], {}
    for k, (bucket, mid) in enumerate(LENGTHS.items()):
        for i in range(15):
            rid = f"{bucket}-{i}"
            tokens[rid] = float(mid + 10 * i)
            rows += [
                _row("bf16", rid, bucket, True),
                _row("bf16-control", rid, bucket, True),
                _row("fp8", rid, bucket, i >= 2 * k),
            ]
            tf += [
                _tf("bf16", rid, 0.5),
                _tf("bf16-control", rid, 0.5),
                _tf("fp8", rid, 0.5 + 0.01 * k),
            ]
    for rid in ("<2K-0", "<2K-1", "<2K-2"):
        del tokens[rid]
    return rows, tf, tokens


def _quality(rows: list[Any], tf: list[Any], tokens: dict[str, float] | None) -> Quality:
    return assess_quality(rows, tf, "bf16", list(LENGTHS), seed=4, prompt_tokens=tokens)


def test_quality_gives_every_compared_target_its_trend_and_the_controls_floor() -> None:
    rows, tf, tokens = declining_run()
    c1 = _quality(rows, tf, tokens).phases["c1"]
    assert c1["bf16"].trend is None and "trend" not in c1["bf16"].to_json()
    fp8, control = c1["fp8"].trend, c1["bf16-control"].trend
    assert fp8 is not None and control is not None
    g, t = fp8.graded, fp8.teacher_forced
    assert (g.requests, g.buckets) == (57, 4)  # 3 of unknown length left out
    assert g.slope is not None and g.hi is not None and g.slope < 0 and g.hi < 0
    assert t.slope == pytest.approx(0.01 / np.log2(3), rel=0.5) and t.lo is not None and t.lo > 0
    # The control's own trend, and every other target's floor.
    assert control.graded.slope == 0.0 and control.graded_floor is None
    assert fp8.graded_floor == control.graded
    assert fp8.teacher_forced_floor == control.teacher_forced
    # Without prompt lengths there is no trend (older callers, older summaries).
    assert _quality(rows, tf, None).phases["c1"]["fp8"].trend is None


def test_derived_grades_trend_against_the_control_and_the_controls_floor_is_explicit() -> None:
    """Traffic without checks: fp8's derived grades pair with the control's; the control has
    no explicit pair, so its graded trend is refused and the floor says why."""
    rows, tokens = [], {}
    for k, (bucket, mid) in enumerate(LENGTHS.items()):
        for i in range(10):
            rid = f"u{k}-{i}"
            tokens[rid] = float(mid)
            rows += [
                _row("bf16", rid, bucket, None),
                _row("bf16-control", rid, bucket, None, {"rule": "derived:facts", "passed": True}),
                _row("fp8", rid, bucket, None, {"rule": "derived:facts", "passed": i >= 3 * k}),
            ]
    fp8 = _quality(rows, [], tokens).phases["c1"]["fp8"].trend
    assert fp8 is not None and fp8.graded.requests == 40 and fp8.graded.hi is not None
    assert fp8.graded.hi < 0
    assert fp8.graded_floor is not None and fp8.graded_floor.slope is None
    assert fp8.graded_floor.reason == "no graded pair"
    assert fp8.teacher_forced.reason == "no teacher-forced score"


def test_prompt_token_counts_prefer_the_references() -> None:
    def result(target: str, rid: str, tokens: int | None) -> Result:
        return Result(
            request_id=rid,
            target=target,
            phase="c1",
            bucket="a",
            scheduled=0.0,
            prompt_tokens=tokens,
        )

    table = ResultTable.of(
        [
            result("bf16", "r1", 100),
            result("fp8", "r1", 101),
            result("fp8", "r2", 200),
            result("bf16", "r2", None),
            result("fp8", "r3", None),
        ]
    )
    assert prompt_token_counts(table, "bf16") == {"r1": 100.0, "r2": 200.0}


# -- in the verdict ---------------------------------------------------------------------------


def slope(s: float, lo: float, hi: float, p: float, n: int = 240) -> LengthSlope:
    return LengthSlope(requests=n, buckets=4, slope=s, lo=lo, hi=hi, p_value=p)


FALLING = slope(-0.03, -0.05, -0.01, 0.002)
FLAT = slope(0.0, -0.01, 0.01, 0.9)
REFUSED = LengthSlope(
    requests=4, buckets=1, slope=None, lo=None, hi=None, p_value=None, reason="4 requests"
)


def matching() -> tuple[BucketFacts, ...]:
    """Every bucket shown within tolerance: without a trend this is KEEP."""
    return tuple(BucketFacts(b, 200, 0.0, -0.02, 0.02, 1.0, None, None, 2, 2) for b in LENGTHS)


def arm(*trends: TrendFacts, name: str = "fp8") -> ArmFacts:
    return ArmFacts(name, buckets=matching(), trends=trends, phases=max(1, len(trends)))


def test_a_loss_that_grows_with_length_asks_for_calibration() -> None:
    v = decide(Facts("bf16", arm(TrendFacts(None, FALLING, FLAT)), capacity_ratio=2.0))
    assert v.verdict == "calibrate"
    assert v.reasons[0].startswith("a loss that grows with context length: fp8's pass-rate")
    assert "-3.0 points per doubling of context [-5.0, -1.0]" in v.reasons[0]
    assert "the A/A control's (its explicit checks): +0.0 [-1.0, +1.0]" in v.reasons[0]
    assert any(e["kind"] == "quality" and "grows with context" in e["text"] for e in v.evidence)


@pytest.mark.parametrize(
    "trend",
    [
        TrendFacts(None, FALLING, slope(-0.04, -0.06, -0.02, 0.001)),  # within the floor
        TrendFacts(None, slope(-0.03, -0.05, 0.001, 0.06), None),  # interval reaches 0
        TrendFacts(None, slope(-0.02, -0.04, -0.001, 0.04), None),  # p above alpha / 2 phases
        TrendFacts(None, slope(0.03, 0.01, 0.05, 0.002), None),  # grows better, not worse
        TrendFacts(None, REFUSED),  # no slope fitted
        TrendFacts(None),  # not measured
    ],
)
def test_no_falling_trend_leaves_the_verdict_as_it_was(trend: TrendFacts) -> None:
    phases = 2 if trend.graded is not None and trend.graded.p_value == 0.04 else 1
    a = replace(arm(trend), phases=phases)
    v = decide(Facts("bf16", a, capacity_ratio=2.0))
    assert v == decide(Facts("bf16", replace(a, trends=()), capacity_ratio=2.0))
    assert v.verdict == "keep"


def test_the_teacher_forced_trend_only_warns() -> None:
    rising = TrendFacts(
        None, FLAT, None, slope(0.008, 0.003, 0.013, 0.001), slope(0.0, -0.001, 0.001, 0.8)
    )
    v = decide(Facts("bf16", arm(rising), capacity_ratio=2.0))
    assert v.verdict == "keep"
    warning = [e for e in v.evidence if e["kind"] == "warning"]
    assert len(warning) == 1
    assert (
        "fp8's teacher-forced ΔNLL changes by +0.008/token per doubling of context "
        "[+0.003, +0.013]" in warning[0]["text"]
    )
    assert "the A/A control's: +0.000 [-0.001, +0.001]" in warning[0]["text"]
    # Inside the control's own trend it is not even a warning.
    inside = replace(rising, teacher_forced_floor=slope(0.01, 0.005, 0.015, 0.001))
    assert (
        decide(Facts("bf16", arm(inside), capacity_ratio=2.0)).evidence
        == decide(Facts("bf16", arm(), capacity_ratio=2.0)).evidence
    )


def test_a_calibration_whose_loss_still_grows_with_length_is_not_shipped() -> None:
    cal = arm(TrendFacts(None, FALLING, None), name="fp8-cal")
    v = decide(Facts("bf16", arm(), calibrated=cal), Thresholds())
    assert v.verdict == "reject"
    assert "calibrated quality still misses (growing with context length)" in v.reasons[0]


def test_a_bucket_loss_stays_the_reason_and_the_trend_is_evidence() -> None:
    lost = replace(
        matching()[3], diff=-0.12, lo=-0.17, hi=-0.07, mcnemar_p=0.0001, ref_only=26, target_only=2
    )
    a = replace(arm(TrendFacts(None, FALLING, None)), buckets=(*matching()[:3], lost))
    v = decide(Facts("bf16", a, capacity_ratio=2.0))
    assert v.verdict == "calibrate" and v.reasons[0].startswith("repeatable loss in 16K-32K")
    assert any("grows with context length" in e["text"] for e in v.evidence)


# -- in summary.json --------------------------------------------------------------------------


def test_the_golden_runs_trends_reach_the_verdicts_facts_and_older_summaries_still_read() -> None:
    from replay.analysis.schemas import Summary
    from replay.analysis.verdict.facts import facts_from_run
    from tests.support import analysis_run
    from tests.support.analysis_run import GOLDEN, SORTED

    doc = orjson.loads((GOLDEN / "run_summary.json").read_bytes())
    manifest = Manifest.from_json(analysis_run.manifest())
    facts = facts_from_run(Summary.from_json(doc), manifest, candidate="fp8")
    assert facts.candidate is not None
    assert [t.phase for t in facts.candidate.trends] == ["c1", "c4"]
    assert all(t.graded_floor is not None for t in facts.candidate.trends)
    # A summary written before the trend: no key, no trend, the same bytes back.
    for phase in doc["quality"]["phases"].values():
        for target in phase.values():
            target.pop("trend", None)
    older = Summary.from_json(doc)
    assert older.quality is not None
    assert all(q.trend is None for p in older.quality.phases.values() for q in p.values())
    assert orjson.dumps(older.to_json(), option=SORTED) == orjson.dumps(doc, option=SORTED)
    before = facts_from_run(older, manifest, candidate="fp8").candidate
    assert before is not None and before.trends == ()
