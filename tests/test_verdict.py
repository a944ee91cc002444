"""The stop rule over a table of cases: every verdict, its exit code and its evidence."""

from __future__ import annotations

import pytest

from replay._verdict import VERDICTS, ArmFacts, BucketFacts, Facts, Thresholds, decide

BUCKETS = ("<8K", "8K-32K", "32K-64K")


def same(n: int = 200) -> tuple[BucketFacts, ...]:
    """FP8 indistinguishable from BF16 with plenty of pairs."""
    return tuple(BucketFacts(b, n, 0.0, -0.02, 0.02, 1.0, None, 50) for b in BUCKETS)


def lose(bucket: str, n: int = 200) -> tuple[BucketFacts, ...]:
    return tuple(BucketFacts(b, n, -0.12, -0.17, -0.07, 0.0001, None, 50) if b == bucket
                 else BucketFacts(b, n, 0.0, -0.02, 0.02, 1.0, None, 50) for b in BUCKETS)


def thin() -> tuple[BucketFacts, ...]:
    return tuple(BucketFacts(b, 6, 0.0, -0.3, 0.3, 1.0, None, 312) for b in BUCKETS)


def slight_shift() -> tuple[BucketFacts, ...]:
    return tuple(BucketFacts(b, 40, -0.1, -0.2, 0.0, 0.125, None, 312) for b in BUCKETS)


CASES = {
    "keep: matches everywhere, twice the cache": (
        Facts("bf16", ArmFacts("fp8", buckets=same()), capacity_ratio=2.0), "keep"),
    "keep: matches, capacity not needed but faster": (
        Facts("bf16", ArmFacts("fp8", buckets=same()), capacity_ratio=2.0, capacity_needed=False,
              latency_better=True), "keep"),
    "calibrate: significant loss in one bucket": (
        Facts("bf16", ArmFacts("fp8", buckets=lose("32K-64K")), capacity_ratio=2.0), "calibrate"),
    "calibrate: consistent shift, no bucket significant (Kimi-K2.5)": (
        Facts("bf16", ArmFacts("fp8", buckets=slight_shift(), shift_p=0.01,
                               shift_direction="down"), capacity_ratio=2.0), "calibrate"),
    "calibrate: calibrated target fixes the loss": (
        Facts("bf16", ArmFacts("fp8", buckets=lose("<8K")),
              calibrated=ArmFacts("fp8-cal", buckets=same())), "calibrate"),
    "per-head/skip: calibration leaves one bucket": (
        Facts("bf16", ArmFacts("fp8", buckets=lose("<8K")),
              calibrated=ArmFacts("fp8-cal", buckets=lose("32K-64K")),
              outlier_layers=(0, 3)), "per_head_or_skip_layers"),
    "reject: calibrated still misses broadly": (
        Facts("bf16", ArmFacts("fp8", buckets=lose("<8K")),
              calibrated=ArmFacts("fp8-cal", buckets=lose("<8K")[:1] + lose("8K-32K")[1:2]
                                  + lose("32K-64K")[2:])), "reject"),
    "reject: served cache dtype fell back": (
        Facts("bf16", ArmFacts("fp8", serving_problems=("served cache_dtype is 'auto', not FP8",),
                               buckets=same())), "reject"),
    "reject: calibrated scales not applied": (
        Facts("bf16", ArmFacts("fp8", buckets=lose("<8K")),
              calibrated=ArmFacts("fp8-cal", serving_problems=(
                  "the server log says 'Using KV cache scaling factor 1.0'",), buckets=same())),
        "reject"),
    "reject: too short to pay off": (
        Facts("bf16", ArmFacts("fp8", buckets=same()), capacity_ratio=2.0, capacity_needed=False,
              latency_better=False, below_break_even=True), "reject"),
    "reject: no gain at all": (
        Facts("bf16", ArmFacts("fp8", buckets=same()), capacity_ratio=1.0), "reject"),
    "insufficient: too few graded pairs": (
        Facts("bf16", ArmFacts("fp8", buckets=thin()), capacity_ratio=2.0),
        "insufficient_evidence"),
    "insufficient: no candidate": (Facts("bf16", None), "insufficient_evidence"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_stop_rule(name: str) -> None:
    facts, expected = CASES[name]
    v = decide(facts)
    assert v.verdict == expected, v.reasons
    assert v.exit_code == VERDICTS[expected][0]
    assert v.reasons and v.headline.startswith(VERDICTS[expected][1])


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
    noisy = tuple(BucketFacts(b, 200, -0.03, -0.05, -0.01, 0.01, -0.06, 50) for b in BUCKETS)
    v = decide(Facts("bf16", ArmFacts("fp8", buckets=noisy), capacity_ratio=2.0))
    assert v.verdict == "keep", v.reasons


def test_thresholds_are_configuration() -> None:
    facts = Facts("bf16", ArmFacts("fp8", buckets=same(n=15)), capacity_ratio=2.0)
    assert decide(facts).verdict == "insufficient_evidence"
    assert decide(facts, Thresholds(min_pairs=10)).verdict == "keep"
    assert decide(facts, Thresholds(min_pairs=10, required_capacity_ratio=2.5)).verdict == \
        "reject"


def _manifest(**fp8: object) -> dict[str, object]:
    base = {"engine_version": "0.32.0", "model_root": "/m", "max_model_len": 8192,
            "cache_config": {}, "scale_log_lines": [], "spec": {"args": []}}
    return {"reference": "bf16", "targets": {"bf16": dict(base), "fp8": {**base, **fp8}}}


@pytest.mark.parametrize(("target", "manifest", "calibrated", "problem"), [
    ({"status": "failed", "reason": "server did not start: AVX-512"}, _manifest(), False,
     "target failed: server did not start"),
    ({"status": "ok", "cache_dtype": "auto"}, _manifest(), False, "not FP8"),
    ({"status": "ok", "cache_dtype": "fp8"}, _manifest(engine_version="0.31.0"), False,
     "engine version 0.31.0 differs"),
    ({"status": "ok", "cache_dtype": "fp8"}, _manifest(model_root="/other"), False,
     "serves model /other"),
    ({"status": "ok", "cache_dtype": "fp8"}, _manifest(scale_log_lines=[
        "WARNING Using KV cache scaling factor 1.0 for fp8_e4m3."]), True, "not applied"),
    ({"status": "ok", "cache_dtype": "fp8"}, _manifest(
        spec={"args": ["--kv-cache-dtype-skip-layers", "0,3"]},
        cache_config={"kv_cache_dtype_skip_layers": "[0]"}), False, "skip-layers configured"),
])
def test_serving_path_problems(target: dict[str, object], manifest: dict[str, object],
                               calibrated: bool, problem: str) -> None:
    from replay._verdict import serving_problems

    problems = serving_problems("fp8", target, manifest, calibrated)
    assert any(problem in p for p in problems), problems


def test_clean_serving_path_has_no_problems() -> None:
    from replay._verdict import serving_problems

    ok = {"status": "ok", "cache_dtype": "fp8_e4m3"}
    assert serving_problems("fp8", ok, _manifest(), False) == []
    skip = _manifest(spec={"args": ["--kv-cache-dtype-skip-layers", "0,3"]},
                     cache_config={"kv_cache_dtype_skip_layers": "[0, 3]"})
    assert serving_problems("fp8", ok, skip, False) == []
