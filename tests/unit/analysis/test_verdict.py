"""The stop rule over a table of cases: every verdict, its exit code and its evidence."""

from __future__ import annotations

from dataclasses import replace

import pytest

from replay.analysis.schemas import Summary, TargetSummary
from replay.analysis.schemas.manifest import Manifest
from replay.analysis.thresholds import Thresholds
from replay.analysis.verdict.advice import Advice
from replay.analysis.verdict.facts import ArmFacts, BucketFacts, Facts
from replay.analysis.verdict.rule import decide
from replay.analysis.verdict.wording import VERDICTS
from tests.support.systems_cases import cell, rule

BUCKETS = ("<8K", "8K-32K", "32K-64K")


# Facts carry the discordant counts (ref_only: BF16 passed and FP8 failed; target_only: the
# reverse): the exact bound that shows a match is computed from them.


def same(n: int = 200, each: int = 2) -> tuple[BucketFacts, ...]:
    """FP8 indistinguishable from BF16 with plenty of pairs (``each`` lost and gained)."""
    return tuple(BucketFacts(b, n, 0.0, -0.02, 0.02, 1.0, None, None, each, each) for b in BUCKETS)


def lose(bucket: str, n: int = 200) -> tuple[BucketFacts, ...]:
    return tuple(
        BucketFacts(b, n, -0.12, -0.17, -0.07, 0.0001, None, None, 26, 2)
        if b == bucket
        else BucketFacts(b, n, 0.0, -0.02, 0.02, 1.0, None, None, 2, 2)
        for b in BUCKETS
    )


def thin() -> tuple[BucketFacts, ...]:
    return tuple(BucketFacts(b, 6, 0.0, -0.3, 0.3, 1.0, None, None, 0, 0) for b in BUCKETS)


def slight_shift() -> tuple[BucketFacts, ...]:
    return tuple(BucketFacts(b, 40, -0.1, -0.2, 0.0, 0.125, None, None, 4, 0) for b in BUCKETS)


CASES = {
    "keep: matches everywhere, twice the cache": (
        Facts("bf16", ArmFacts("fp8", buckets=same()), capacity_ratio=2.0),
        "keep",
    ),
    "keep: matches, capacity not needed but faster": (
        Facts(
            "bf16",
            ArmFacts("fp8", buckets=same()),
            capacity_ratio=2.0,
            capacity_needed=False,
            systems=rule(cell("ttft_ms", "better"), cell("e2e_ms", "same")),
        ),
        "keep",
    ),
    "calibrate: significant loss in one bucket": (
        Facts("bf16", ArmFacts("fp8", buckets=lose("32K-64K")), capacity_ratio=2.0),
        "calibrate",
    ),
    "calibrate: consistent shift, no bucket significant (Kimi-K2.5)": (
        Facts(
            "bf16",
            ArmFacts("fp8", buckets=slight_shift(), shift_p=0.01, shift_direction="down"),
            capacity_ratio=2.0,
        ),
        "calibrate",
    ),
    "calibrate: calibrated target fixes the loss": (
        Facts(
            "bf16",
            ArmFacts("fp8", buckets=lose("<8K")),
            calibrated=ArmFacts("fp8-cal", buckets=same()),
        ),
        "calibrate",
    ),
    "per-head/skip: calibration leaves one bucket": (
        Facts(
            "bf16",
            ArmFacts("fp8", buckets=lose("<8K")),
            calibrated=ArmFacts("fp8-cal", buckets=lose("32K-64K")),
            outlier_layers=(0, 3),
        ),
        "per_head_or_skip_layers",
    ),
    "reject: calibrated still misses broadly": (
        Facts(
            "bf16",
            ArmFacts("fp8", buckets=lose("<8K")),
            calibrated=ArmFacts(
                "fp8-cal", buckets=lose("<8K")[:1] + lose("8K-32K")[1:2] + lose("32K-64K")[2:]
            ),
        ),
        "reject",
    ),
    "per-head/skip: a served layers arm matches after calibration still missed": (
        Facts(
            "bf16",
            ArmFacts("fp8", buckets=lose("<8K")),
            calibrated=ArmFacts("fp8-cal", buckets=lose("<8K")[:1] + lose("8K-32K")[1:]),
            layers=ArmFacts("fp8-skip", buckets=same()),
            layers_skipped=(0, 29),
        ),
        "per_head_or_skip_layers",
    ),
    "per-head/skip: no calibration, a served layers arm matches": (
        Facts(
            "bf16",
            ArmFacts("fp8", buckets=lose("<8K")),
            layers=ArmFacts("fp8-skip", buckets=same()),
            layers_skipped=(0,),
        ),
        "per_head_or_skip_layers",
    ),
    "per-head/skip: calibration misses broadly, emulation measured a layer set": (
        Facts(
            "bf16",
            ArmFacts("fp8", buckets=lose("<8K")),
            calibrated=ArmFacts("fp8-cal", buckets=lose("<8K")[:1] + lose("8K-32K")[1:]),
            advice=Advice("skip_layers", ("layers [0, 29] recover 85%",), (0, 29), 0.2, "cpu"),
        ),
        "per_head_or_skip_layers",
    ),
    "reject: the served layers arm still loses": (
        Facts(
            "bf16",
            ArmFacts("fp8", buckets=lose("<8K")),
            calibrated=ArmFacts("fp8-cal", buckets=lose("<8K")),
            layers=ArmFacts("fp8-skip", buckets=lose("<8K")),
            layers_skipped=(0, 29),
        ),
        "reject",
    ),
    "reject: emulation found nothing that recovers it (the backend's rounding)": (
        Facts(
            "bf16",
            ArmFacts("fp8", buckets=lose("<8K")),
            calibrated=ArmFacts("fp8-cal", buckets=lose("<8K")),
            advice=Advice("reject", ("76% of the loss is the backend's rounding",), (), 0.76),
        ),
        "reject",
    ),
    "reject: served cache dtype fell back": (
        Facts(
            "bf16",
            ArmFacts(
                "fp8", serving_problems=("served cache_dtype is 'auto', not FP8",), buckets=same()
            ),
        ),
        "reject",
    ),
    "reject: calibrated scales not applied": (
        Facts(
            "bf16",
            ArmFacts("fp8", buckets=lose("<8K")),
            calibrated=ArmFacts(
                "fp8-cal",
                serving_problems=("the server log says 'Using KV cache scaling factor 1.0'",),
                buckets=same(),
            ),
        ),
        "reject",
    ),
    "reject: too short to pay off": (
        Facts(
            "bf16",
            ArmFacts("fp8", buckets=same()),
            capacity_ratio=2.0,
            capacity_needed=False,
            systems=rule(cell("ttft_ms", "worse"), cell("e2e_ms", "same")),
            below_break_even=True,
        ),
        "reject",
    ),
    "reject: no gain at all": (
        Facts("bf16", ArmFacts("fp8", buckets=same()), capacity_ratio=1.0),
        "reject",
    ),
    "insufficient: too few graded pairs": (
        Facts("bf16", ArmFacts("fp8", buckets=thin()), capacity_ratio=2.0),
        "insufficient_evidence",
    ),
    "insufficient: no candidate": (Facts("bf16", None), "insufficient_evidence"),
    "emulated: no decision on an emulated FP8 arm unless accepted": (
        Facts("bf16", ArmFacts("fp8", buckets=lose("<8K"), emulated=True)),
        "emulated",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_stop_rule(name: str) -> None:
    facts, expected = CASES[name]
    v = decide(facts)
    assert v.verdict == expected, v.reasons
    assert v.exit_code == VERDICTS[expected][0]
    assert v.reasons and v.headline.startswith(VERDICTS[expected][1])


def test_the_next_step_names_what_was_measured() -> None:
    """A served arm names its layers; emulated advice is evidence and names its command;
    without any measurement the reason says how to measure, never a placeholder."""
    served = decide(
        CASES["per-head/skip: a served layers arm matches after calibration still missed"][0]
    )
    assert "--kv-cache-dtype-skip-layers 0 29" in served.reasons[0]
    emulated = decide(
        CASES["per-head/skip: calibration misses broadly, emulation measured a layer set"][0]
    )
    assert "--skip-layers NAME=0,29" in emulated.reasons[0]
    assert any(e["kind"] == "emulation" for e in emulated.evidence)
    rounding = decide(
        CASES["reject: emulation found nothing that recovers it (the backend's rounding)"][0]
    )
    assert any("backend's rounding" in e["text"] for e in rounding.evidence)
    bare = decide(CASES["reject: calibrated still misses broadly"][0])
    assert any("kvcal advise" in r for r in bare.reasons)
    one_bucket = replace(
        CASES["per-head/skip: calibration leaves one bucket"][0], outlier_layers=()
    )
    assert "LAYERS" not in decide(one_bucket).reasons[0]
    assert "kvcal advise" in decide(one_bucket).reasons[0]


def test_every_verdict_is_covered_and_codes_are_distinct() -> None:
    assert {e for _, e in CASES.values()} == set(VERDICTS)
    codes = [c for c, _ in VERDICTS.values()]
    assert len(set(codes)) == len(codes) and 0 in codes


def test_evidence_names_bucket_numbers_and_interval() -> None:
    v = decide(CASES["calibrate: significant loss in one bucket"][0])
    assert "32K-64K" in v.reasons[0] and "-12.0 points [-17.0, -7.0]" in v.reasons[0]
    quality = [e for e in v.evidence if e["kind"] == "quality"]
    assert {e["bucket"] for e in quality} == set(BUCKETS)


def test_a_loss_inside_the_noise_floor_is_not_a_loss() -> None:
    """Significant (35 lost, 5 gained) but inside the A/A floor, and bounded below 5 points."""
    noisy = tuple(
        BucketFacts(b, 1000, -0.03, -0.045, -0.015, 1e-6, -0.06, None, 35, 5) for b in BUCKETS
    )
    v = decide(Facts("bf16", ArmFacts("fp8", buckets=noisy), capacity_ratio=2.0))
    assert v.verdict == "keep", v.reasons


def test_inside_the_floor_but_not_bounded_is_not_a_match() -> None:
    """The floor keeps a drop from being a loss; it does not make it a match: 200 pairs
    with 7 lost and 1 gained bound the drop only below ~6 points."""
    noisy = tuple(
        BucketFacts(b, 200, -0.03, -0.055, -0.005, 0.07, -0.06, None, 7, 1) for b in BUCKETS
    )
    v = decide(Facts("bf16", ArmFacts("fp8", buckets=noisy), capacity_ratio=2.0))
    assert v.verdict == "insufficient_evidence", v.reasons
    assert "about" in v.reasons[0] and "needed" in v.reasons[0]


def test_thresholds_are_configuration() -> None:
    facts = Facts("bf16", ArmFacts("fp8", buckets=same(n=15, each=0)), capacity_ratio=2.0)
    assert decide(facts).verdict == "insufficient_evidence"
    # 15 agreeing pairs cannot bound a 5-point drop ((1 - 0.05)^15 = 0.46 > alpha) whatever
    # the minimum; they bound a 20-point one ((1 - 0.2)^15 = 0.035).
    few = decide(facts, Thresholds(min_pairs=10))
    assert few.verdict == "insufficient_evidence" and "at least 59 needed" in few.reasons[0]
    assert decide(facts, Thresholds(min_pairs=10, tolerance=0.2)).verdict == "keep"
    assert (
        decide(facts, Thresholds(min_pairs=10, tolerance=0.2, required_capacity_ratio=2.5)).verdict
        == "reject"
    )


def test_need_n_only_where_the_question_is_open() -> None:
    """The issue's two cases: a -70-point loss at McNemar p ~ 1e-15 names no N (it is a loss);
    57 of 57 passing on both sides needs 59 pairs, from (1 - 0.05)^n <= 0.05."""
    lost = BucketFacts("<8K", 60, -0.7, -0.8, -0.6, 1.7e-15, None, None, 50, 8)
    agree = BucketFacts("8K-32K", 57, 0.0, 0.0, 0.0, 1.0, None, None, 0, 0)
    v = decide(Facts("bf16", ArmFacts("fp8", buckets=(lost, agree)), capacity_ratio=2.0))
    assert v.verdict == "calibrate" and "needed" not in v.reasons[0]
    by_bucket = {e["bucket"]: e for e in v.evidence if e["kind"] == "quality"}
    assert by_bucket["<8K"]["needed"] is None and by_bucket["<8K"]["status"] == "loss"
    assert by_bucket["8K-32K"]["needed"] == 59
    v = decide(Facts("bf16", ArmFacts("fp8", buckets=(agree,)), capacity_ratio=2.0))
    assert v.verdict == "insufficient_evidence"
    assert "8K-32K: 57 graded pairs, at least 59 needed" in v.reasons[0]
    enough = BucketFacts("8K-32K", 59, 0.0, 0.0, 0.0, 1.0, None, None, 0, 0)
    v = decide(Facts("bf16", ArmFacts("fp8", buckets=(enough,)), capacity_ratio=2.0))
    assert v.verdict == "keep", v.reasons


def test_keep_needs_the_exact_bound_below_tolerance() -> None:
    """A bootstrap interval inside +-tolerance is not enough: 30 pairs, 1 lost, 1 gained."""
    b = BucketFacts("<8K", 30, 0.0, -0.033, 0.033, 1.0, None, None, 1, 1)
    v = decide(Facts("bf16", ArmFacts("fp8", buckets=(b,)), capacity_ratio=2.0))
    assert v.verdict == "insufficient_evidence", v.reasons


def test_facts_without_counts_are_never_a_match() -> None:
    b = BucketFacts("<8K", 500, 0.0, -0.01, 0.01, 1.0, None, 120)
    v = decide(Facts("bf16", ArmFacts("fp8", buckets=(b,)), capacity_ratio=2.0))
    assert v.verdict == "insufficient_evidence" and "about 120 needed" in v.reasons[0]


# -- every phase of a sweep ------------------------------------------------------------------


def _row(n: int, lost: int, gained: int) -> dict[str, object]:
    from replay.analysis.stats.exact_tests import mcnemar_exact

    a = [True] * lost + [False] * gained + [True] * (n - lost - gained)
    b = [False] * lost + [True] * gained + [True] * (n - lost - gained)
    d = (gained - lost) / n
    return {
        "vs_reference": {
            "pairs": n,
            "diff": d,
            "lo": d - 0.03,
            "hi": d + 0.03,
            "mcnemar_p": mcnemar_exact(a, b).p_value,
            "ref_only": lost,
            "target_only": gained,
        },
        "evidence": {"needed": 999},
    }


def _sweep(cells: dict[str, dict[str, tuple[int, int, int]]]) -> Summary:
    """A summary with phase -> bucket -> (pairs, lost, gained) for fp8 against bf16."""
    phases = {
        ph: {
            "fp8": {
                "buckets": {b: _row(*c) for b, c in rows.items()},
                "shift": {"p_value": 1.0, "direction": "none"},
            }
        }
        for ph, rows in cells.items()
    }
    return Summary.from_json(
        {
            "quality": {"reference": "bf16", "phases": phases},
            "targets": {
                "bf16": {"status": "ok", "kv_cache_size_tokens": 1000, "phases": {}},
                "fp8": {
                    "status": "ok",
                    "cache_dtype": "fp8",
                    "kv_cache_size_tokens": 2000,
                    "phases": {},
                },
            },
        }
    )


def test_a_loss_in_a_loaded_phase_counts() -> None:
    """Before, only the first phase was read: c16's loss was ignored and the verdict KEEP."""
    from replay.analysis.verdict.facts import facts_from_run

    fine = {"<8K": (200, 2, 2), "8K-32K": (200, 2, 2)}
    summary = _sweep({"c1": fine, "c16": {"<8K": (200, 2, 2), "8K-32K": (200, 30, 2)}})
    facts = facts_from_run(summary, NO_MANIFEST, candidate="fp8")
    assert facts.candidate is not None and facts.candidate.phases == 2
    assert [(b.bucket, b.phase) for b in facts.candidate.buckets] == [
        ("<8K", "c1"),
        ("<8K", "c16"),
        ("8K-32K", "c1"),
        ("8K-32K", "c16"),
    ]
    v = decide(facts)
    assert v.verdict == "calibrate" and "8K-32K (c16)" in v.reasons[0], v.reasons
    assert (
        decide(facts_from_run(_sweep({"c1": fine}), NO_MANIFEST, candidate="fp8")).verdict == "keep"
    )


def test_every_phase_must_show_the_match() -> None:
    from replay.analysis.verdict.facts import facts_from_run

    summary = _sweep({"c1": {"<8K": (200, 2, 2)}, "c4": {"<8K": (40, 0, 0)}})
    v = decide(facts_from_run(summary, NO_MANIFEST, candidate="fp8"))
    assert v.verdict == "insufficient_evidence"
    assert "<8K (c4): 40 graded pairs, at least 59 needed" in v.reasons[0]


def test_phases_are_not_pooled_into_more_evidence() -> None:
    """Three phases of the same 40 agreeing requests are still 40 requests, not 120 pairs."""
    from replay.analysis.verdict.facts import facts_from_run

    summary = _sweep({ph: {"<8K": (40, 0, 0)} for ph in ("c1", "c4", "c16")})
    assert (
        decide(facts_from_run(summary, NO_MANIFEST, candidate="fp8")).verdict
        == "insufficient_evidence"
    )


def test_loss_tests_share_alpha_across_phases() -> None:
    """Bonferroni: p = 0.03 in one of two phases is below alpha but not below alpha / 2."""
    b = BucketFacts("<8K", 200, -0.05, -0.09, -0.01, 0.03, None, None, 14, 4, "c4")
    ok = BucketFacts("<8K", 200, 0.0, -0.02, 0.02, 1.0, None, None, 2, 2, "c1")
    one = decide(
        Facts("bf16", ArmFacts("fp8", buckets=(replace(b, phase=None),)), capacity_ratio=2.0)
    )
    assert one.verdict == "calibrate"
    two = decide(Facts("bf16", ArmFacts("fp8", buckets=(ok, b), phases=2), capacity_ratio=2.0))
    assert two.verdict == "insufficient_evidence", two.reasons


def test_thresholds_reach_the_facts() -> None:
    from replay.analysis.verdict.facts import facts_from_run

    summary = _sweep({"c1": {"<8K": (30, 0, 0)}})
    facts = facts_from_run(
        summary, NO_MANIFEST, candidate="fp8", thresholds=Thresholds(tolerance=0.2)
    )
    assert facts.candidate is not None
    assert facts.candidate.buckets[0].needed is None  # shown at 20 points: nothing needed
    facts = facts_from_run(summary, NO_MANIFEST, candidate="fp8")
    assert facts.candidate is not None and facts.candidate.buckets[0].needed == 59


NO_MANIFEST = Manifest.from_json({})


def _manifest(**fp8: object) -> Manifest:
    base = {
        "engine_version": "0.32.0",
        "model_root": "/m",
        "max_model_len": 8192,
        "cache_config": {},
        "scale_log_lines": [],
        "spec": {"args": []},
    }
    return Manifest.from_json(
        {"reference": "bf16", "targets": {"bf16": dict(base), "fp8": {**base, **fp8}}}
    )


@pytest.mark.parametrize(
    ("target", "manifest", "calibrated", "problem"),
    [
        (
            {"status": "failed", "reason": "server did not start: AVX-512"},
            _manifest(),
            False,
            "target failed: server did not start",
        ),
        ({"status": "ok", "cache_dtype": "auto"}, _manifest(), False, "not FP8"),
        (
            {"status": "ok", "cache_dtype": "fp8"},
            _manifest(engine_version="0.31.0"),
            False,
            "engine version 0.31.0 differs",
        ),
        (
            {"status": "ok", "cache_dtype": "fp8"},
            _manifest(model_root="/other"),
            False,
            "serves model /other",
        ),
        (
            {"status": "ok", "cache_dtype": "fp8"},
            _manifest(scale_log_lines=["WARNING Using KV cache scaling factor 1.0 for fp8_e4m3."]),
            True,
            "not applied",
        ),
        (
            {"status": "ok", "cache_dtype": "fp8"},
            _manifest(
                spec={"args": ["--kv-cache-dtype-skip-layers", "0", "3"]},
                cache_config={"kv_cache_dtype_skip_layers": "['0']"},
            ),
            False,
            "skip-layers configured",
        ),
        (
            {"status": "ok", "cache_dtype": "fp8"},
            _manifest(
                spec={"args": ["--kv-cache-dtype-skip-layers", "0,3"]},
                cache_config={"kv_cache_dtype_skip_layers": "['0,3']"},
            ),
            False,
            "one layer index per word (0 3)",
        ),
    ],
)
def test_serving_path_problems(
    target: dict[str, object], manifest: Manifest, calibrated: bool, problem: str
) -> None:
    from replay.analysis.verdict.serving_path import serving_problems

    problems = serving_problems("fp8", TargetSummary.from_json(target), manifest, calibrated)
    assert any(problem in p for p in problems), problems


def test_clean_serving_path_has_no_problems() -> None:
    from replay.analysis.verdict.serving_path import serving_problems

    ok = TargetSummary.from_json({"status": "ok", "cache_dtype": "fp8_e4m3"})
    assert serving_problems("fp8", ok, _manifest(), False) == []
    skip = _manifest(
        spec={"args": ["--kv-cache-dtype-skip-layers", "0", "3"]},
        cache_config={"kv_cache_dtype_skip_layers": "['0', '3']"},
    )
    assert serving_problems("fp8", ok, skip, False) == []


def test_one_bucket_losing_in_several_phases_is_still_localized() -> None:
    ok = [replace(b, phase=ph) for b in same() for ph in ("c1", "c4")]
    bad = [
        replace(b, phase=ph)
        for b in lose("32K-64K")
        if b.bucket == "32K-64K"
        for ph in ("c1", "c4")
    ]
    cal = tuple([b for b in ok if b.bucket != "32K-64K"] + bad)
    v = decide(
        Facts(
            "bf16",
            ArmFacts("fp8", buckets=lose("<8K")),
            calibrated=ArmFacts("fp8-cal", buckets=cal, phases=2),
        )
    )
    assert v.verdict == "per_head_or_skip_layers", v.reasons
    assert "32K-64K (c1)" in v.reasons[0]


# -- teacher-forced divergence warns, never decides -------------------------------------------


def _diverging(b: BucketFacts, nll: float, floor_hi: float | None) -> BucketFacts:
    return replace(
        b,
        tf_nll=nll,
        tf_nll_lo=nll - 0.1,
        tf_nll_hi=nll + 0.1,
        tf_top1=0.73,
        tf_top1_hi=0.8,
        tf_floor_nll_hi=floor_hi,
        tf_floor_top1_lo=None,
    )


def test_teacher_forced_divergence_is_a_warning_not_a_reason() -> None:
    # The outcomes match in every bucket; one bucket's ΔNLL is +0.66/token (top-1 73%).
    buckets = same()
    warned = (*buckets[:2], _diverging(buckets[2], 0.66, floor_hi=0.01))
    v = decide(Facts("bf16", ArmFacts("fp8", buckets=warned), capacity_ratio=2.0))
    assert v.verdict == "keep"
    warnings = [e for e in v.evidence if e["kind"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["bucket"] == "32K-64K"
    assert "+0.660/token" in warnings[0]["text"] and "early warning" in warnings[0]["text"]
    # The same divergence beside a real loss: still CALIBRATE for the loss, with the warning.
    lost = lose("<8K")
    v = decide(
        Facts(
            "bf16",
            ArmFacts("fp8", buckets=(*lost[:2], _diverging(lost[2], 0.66, None))),
            capacity_ratio=2.0,
        )
    )
    assert v.verdict == "calibrate" and "<8K" in v.headline
    assert any(e["kind"] == "warning" and "no A/A control" in e["text"] for e in v.evidence)


def test_divergence_inside_the_floor_or_below_the_threshold_is_no_warning() -> None:
    buckets = same()
    # The A/A control diverges as much (same server, batching), or the divergence is tiny.
    for b in (
        replace(_diverging(buckets[0], 0.66, floor_hi=0.9), tf_floor_top1_lo=0.7),
        replace(_diverging(buckets[0], 0.03, None), tf_top1_hi=1.0),
    ):
        v = decide(Facts("bf16", ArmFacts("fp8", buckets=(b, *buckets[1:])), capacity_ratio=2.0))
        assert v.verdict == "keep" and not [e for e in v.evidence if e["kind"] == "warning"]


# -- emulated FP8: quality evidence, a decision only when accepted, never systems ------------


def test_emulated_arm_is_reported_but_not_decided_unless_accepted() -> None:
    broken = Facts("bf16", ArmFacts("fp8", buckets=lose("<8K"), emulated=True))
    refused = decide(broken)
    assert refused.verdict == "emulated" and refused.exit_code == 14
    assert "--accept-emulated" in refused.reasons[0]
    assert {e["bucket"] for e in refused.evidence if e["kind"] == "quality"} == set(BUCKETS)
    accepted = decide(broken, Thresholds(accept_emulated=True))
    assert accepted.verdict == "calibrate", accepted.reasons


def test_an_accepted_emulated_match_keeps_on_quality_alone() -> None:
    """Its capacity and speed are a BF16 server's: KEEP says so instead of REJECT for no
    gain, and never quotes a capacity ratio."""
    ok = Facts("bf16", ArmFacts("fp8", buckets=same(), emulated=True))
    v = decide(ok, Thresholds(accept_emulated=True))
    assert v.verdict == "keep" and "emulated FP8, quality only" in v.reasons[0]
    assert not any("capacity" in e["text"] and "x the reference" in e["text"] for e in v.evidence)


def test_emulated_target_serves_bf16_without_a_fallback_problem() -> None:
    from replay.analysis.verdict.facts import facts_from_run
    from replay.analysis.verdict.serving_path import serving_problems

    manifest = _manifest(
        spec={"kv_cache_dtype": "fp8-emulated", "expect_cache_dtype": "fp8-emulated"}
    )
    target = {"status": "ok", "cache_dtype": "bfloat16", "kv_cache_size_tokens": 1000}
    assert serving_problems("fp8", TargetSummary.from_json(target), manifest, False) == []
    summary = {
        "targets": {
            "bf16": {"status": "ok", "cache_dtype": "auto", "kv_cache_size_tokens": 1000},
            "fp8": target,
        }
    }
    facts = facts_from_run(Summary.from_json(summary), manifest)
    assert facts.candidate is not None and facts.candidate.emulated
    assert facts.capacity_ratio is None  # 1.0x here: BF16's, never presented as FP8's


def test_a_layers_arm_at_a_url_on_the_calibrated_overlay_is_judged_as_calibrated() -> None:
    """A target at a URL has no model in its spec: the folder its server reports says
    whether it serves an overlay (then its scales must be applied, its path differs)."""
    from replay.analysis.verdict.facts import _on_overlay

    on_overlay = _manifest(model_root="/m-kvcal", spec={"args": []})
    assert _on_overlay(on_overlay, "fp8", "bf16")
    assert not _on_overlay(_manifest(), "fp8", "bf16")
    local = {"reference": "bf16", "targets": {"bf16": {"spec": {"model": "/m"}}}}
    local["targets"]["fp8"] = {"spec": {"model": "/m-kvcal"}}  # type: ignore[index]
    assert _on_overlay(Manifest.from_json(local), "fp8", "bf16")
