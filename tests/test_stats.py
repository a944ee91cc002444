"""Paired FP8-vs-BF16 statistics: known answers, a planted shift, and properties.

Convention throughout: ``a`` is the reference (BF16), ``b`` the candidate (FP8).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay._stats import (
    EXACT_MAX,
    _binom_cdf_half,
    evidence,
    mcnemar_exact,
    paired_bootstrap,
    pairs_needed,
    stratified_shift,
    stratified_sign_test,
    wilson,
)

BoolPairs = tuple[list[bool], list[bool]]


def pairs(both: int, a_only: int, b_only: int, neither: int) -> BoolPairs:
    """Deterministic paired grades with the given cell counts of the 2x2 table."""
    a = [True] * both + [True] * a_only + [False] * b_only + [False] * neither
    b = [True] * both + [False] * a_only + [True] * b_only + [False] * neither
    return a, b


def exact_lower_tail(m: int, n: int) -> float:
    """P(X <= m), X ~ Binomial(n, 1/2), straight from math.comb (the test's own oracle)."""
    return sum(math.comb(n, k) for k in range(m + 1)) / (1 << n)


@st.composite
def bool_pairs(draw: st.DrawFn, max_size: int = 60) -> BoolPairs:
    n = draw(st.integers(0, max_size))
    a = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    b = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return a, b


# --- Wilson ---------------------------------------------------------------------------------

def test_wilson_known_values() -> None:
    assert wilson(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert wilson(0, 10)[0] == 0.0  # type: ignore[index]
    assert wilson(0, 0) is None


def test_wilson_rejects_bad_counts() -> None:
    for k, n in ((11, 10), (-1, 10), (0, -1)):
        with pytest.raises(ValueError):
            wilson(k, n)


@given(st.integers(1, 5000).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
def test_wilson_contains_proportion(kn: tuple[int, int]) -> None:
    k, n = kn
    ci = wilson(k, n)
    assert ci is not None
    lo, hi = ci
    assert 0.0 <= lo <= k / n <= hi <= 1.0
    wider = wilson(k, n, z=3.0)
    assert wider is not None and wider[0] <= lo and wider[1] >= hi


# --- identical arms -------------------------------------------------------------------------

def test_identical_arms_show_nothing() -> None:
    """The same grades on both targets: zero difference, no test fires."""
    a, _ = pairs(30, 5, 0, 15)
    boot = paired_bootstrap(a, a, seed=7)
    assert boot is not None
    assert (boot.diff, boot.lo, boot.hi) == (0.0, 0.0, 0.0)
    m = mcnemar_exact(a, a)
    assert (m.n, m.a_only, m.b_only, m.p_value) == (50, 0, 0, 1.0)
    s = stratified_shift([(a, a), (a[:20], a[:20])])
    assert (s.strata, s.n, s.p_value, s.direction) == (2, 70, 1.0, "none")
    scores = [0.1 * i for i in range(20)]
    sign = stratified_sign_test([(scores, scores)])
    assert (sign.a_only, sign.b_only, sign.p_value, sign.direction) == (0, 0, 1.0, "none")


def test_balanced_disagreement_is_not_a_shift() -> None:
    """FP8 loses 5 and wins 5: disagreement, but no direction."""
    a, b = pairs(20, 5, 5, 10)
    assert mcnemar_exact(a, b).p_value == 1.0
    s = stratified_shift([(a, b)])
    assert s.direction == "none" and s.p_value > 0.5


# --- McNemar --------------------------------------------------------------------------------

def test_mcnemar_known_values() -> None:
    m = mcnemar_exact(*pairs(10, 0, 6, 4))
    assert (m.n, m.a_only, m.b_only) == (20, 0, 6)
    assert m.p_value == pytest.approx(2 * 0.5**6)  # 0.03125
    assert mcnemar_exact(*pairs(3, 1, 9, 0)).p_value == pytest.approx(2 * 11 / 1024)
    assert mcnemar_exact(*pairs(3, 9, 1, 0)).p_value == pytest.approx(0.021484375)
    assert mcnemar_exact(*pairs(0, 3, 4, 0)).p_value == 1.0  # capped


def test_mcnemar_rejects_unpaired() -> None:
    with pytest.raises(ValueError):
        mcnemar_exact([True, False], [True])


def test_binomial_tail_large_n_matches_exact() -> None:
    """Beyond EXACT_MAX the log-space sum must agree with exact integer arithmetic."""
    n = EXACT_MAX + 904
    cdf, term, total = [], 1, 0
    for k in range(n // 2 + 31):
        total += term
        cdf.append(total / (1 << n))
        term = term * (n - k) // (k + 1)
    for m in (n // 2 - 80, n // 2, n // 2 + 30):
        assert _binom_cdf_half(m, n) == pytest.approx(cdf[m], rel=1e-9)


# --- planted shift --------------------------------------------------------------------------

@pytest.mark.parametrize(("a_only", "b_only"), [(4, 0), (5, 1), (4, 1)])
def test_planted_shift_found_only_when_pooled(a_only: int, b_only: int) -> None:
    """FP8 fails a few more requests than BF16 in every one of 4 buckets of 40 pairs.

    No bucket is significant alone; pooled, the consistent downward shift is.
    """
    buckets = [pairs(25, a_only, b_only, 40 - 25 - a_only - b_only) for _ in range(4)]
    for a, b in buckets:
        assert mcnemar_exact(a, b).p_value > 0.05
    s = stratified_shift(buckets)
    assert (s.strata, s.n, s.a_only, s.b_only) == (4, 160, 4 * a_only, 4 * b_only)
    assert s.direction == "down"
    assert s.p_value < 0.05
    assert s.p_value == pytest.approx(exact_lower_tail(4 * b_only, 4 * (a_only + b_only)))


def test_upward_shift_is_not_a_regression() -> None:
    """FP8 better everywhere: direction up, one-sided p near 1."""
    s = stratified_shift([pairs(25, 0, 4, 11) for _ in range(4)])
    assert s.direction == "up" and s.p_value == 1.0


def test_planted_score_shift_sign_test() -> None:
    """Continuous scores: FP8 slightly lower on most requests in every bucket."""
    buckets = []
    for j in range(4):
        a = [float(i + 10 * j) for i in range(20)]
        b = [x - 0.01 if i < 8 else x + 0.01 if i < 10 else x for i, x in enumerate(a)]
        buckets.append((a, b))
    one = stratified_sign_test(buckets[:1])
    assert (one.a_only, one.b_only) == (8, 2) and one.p_value > 0.05
    s = stratified_sign_test(buckets)
    assert (s.n, s.a_only, s.b_only, s.direction) == (80, 32, 8, "down")
    assert s.p_value < 0.001
    # NLL: lower is better, so the same numbers mean FP8 improved
    assert stratified_sign_test(buckets, higher_is_better=False).direction == "up"
    # differences within the tie band are dropped
    assert stratified_sign_test(buckets, tie=0.02).p_value == 1.0


# --- bootstrap ------------------------------------------------------------------------------

def test_bootstrap_deterministic_and_seeded() -> None:
    a = [0.1 * (i % 7) for i in range(50)]
    b = [x + 0.05 * ((i * 3) % 5 - 2) for i, x in enumerate(a)]
    one = paired_bootstrap(a, b, seed=3)
    assert one == paired_bootstrap(a, b, seed=3)
    assert one != paired_bootstrap(a, b, seed=4)
    assert one is not None and one.lo <= one.diff <= one.hi
    assert one.diff == pytest.approx(one.mean_b - one.mean_a)


def test_bootstrap_clear_shift_excludes_zero() -> None:
    a, b = pairs(100, 30, 2, 68)
    boot = paired_bootstrap(a, b, seed=0)
    assert boot is not None
    assert boot.diff == pytest.approx(-28 / 200)
    assert boot.hi < 0


def test_bootstrap_edge_cases() -> None:
    assert paired_bootstrap([], []) is None
    with pytest.raises(ValueError):
        paired_bootstrap([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        paired_bootstrap([1.0], [math.nan])
    with pytest.raises(ValueError):
        paired_bootstrap([1.0], [1.0], alpha=0.0)


# --- properties -----------------------------------------------------------------------------

@given(bool_pairs())
def test_mcnemar_properties(ab: BoolPairs) -> None:
    a, b = ab
    m, swapped = mcnemar_exact(a, b), mcnemar_exact(b, a)
    assert 0.0 <= m.p_value <= 1.0
    assert swapped.p_value == m.p_value
    assert (swapped.a_only, swapped.b_only) == (m.b_only, m.a_only)
    assert m.a_only + m.b_only <= m.n == len(a)


@settings(max_examples=50, deadline=None)
@given(bool_pairs(), st.integers(0, 2**32 - 1))
def test_bootstrap_properties(ab: BoolPairs, seed: int) -> None:
    a, b = ab
    boot, swapped = paired_bootstrap(a, b, n_boot=200, seed=seed), paired_bootstrap(
        b, a, n_boot=200, seed=seed)
    if not a:
        assert boot is None and swapped is None
        return
    assert boot is not None and swapped is not None
    assert boot.lo <= boot.diff <= boot.hi
    assert boot.lo >= -1.0 and boot.hi <= 1.0
    assert swapped.diff == -boot.diff
    assert boot.diff == pytest.approx(boot.mean_b - boot.mean_a)


@given(bool_pairs())
def test_single_stratum_is_one_sided_mcnemar(ab: BoolPairs) -> None:
    a, b = ab
    m, s = mcnemar_exact(a, b), stratified_shift([(a, b)])
    assert (s.strata, s.n, s.a_only, s.b_only) == (1, m.n, m.a_only, m.b_only)
    assert 0.0 <= s.p_value <= 1.0
    assert s.p_value == pytest.approx(exact_lower_tail(m.b_only, m.a_only + m.b_only))
    if m.a_only > m.b_only:
        assert m.p_value == pytest.approx(min(1.0, 2 * s.p_value))


@given(st.lists(bool_pairs(max_size=30), min_size=1, max_size=5))
def test_stratified_is_pooling(strata: list[BoolPairs]) -> None:
    """Bucketing partitions the pairs; the pooled test does not depend on the partition."""
    merged = ([x for a, _ in strata for x in a], [x for _, b in strata for x in b])
    s, flat = stratified_shift(strata), stratified_shift([merged])
    assert (s.n, s.a_only, s.b_only, s.p_value, s.direction) == (
        flat.n, flat.a_only, flat.b_only, flat.p_value, flat.direction)
    assert s.strata == len(strata)


@given(bool_pairs())
def test_sign_test_on_grades_matches_shift(ab: BoolPairs) -> None:
    a, b = ab
    s = stratified_shift([(a, b)])
    sign = stratified_sign_test([([float(x) for x in a], [float(x) for x in b])])
    assert (sign.a_only, sign.b_only, sign.p_value) == (s.a_only, s.b_only, s.p_value)


# --- evidence -------------------------------------------------------------------------------

def test_evidence_small_bucket_is_insufficient() -> None:
    e = evidence(12)
    assert not e.sufficient and e.needed > 12 and e.n == 12
    assert "12 graded pairs" in e.reason and f"about {e.needed} needed" in e.reason
    assert "5-point drop" in e.reason and "80% power" in e.reason
    big = evidence(e.needed)
    assert big.sufficient and big.needed == e.needed
    assert not evidence(5, tolerance=0.9).sufficient  # the floor `minimum` applies
    assert evidence(0).needed == e.needed


def test_pairs_needed_known_value() -> None:
    """n = ((1.96 sqrt(.1) + 0.8416 sqrt(.1 - .0025)) / .05)^2 = 311.6 -> 312."""
    assert pairs_needed(0.05, 0.1) == 312
    assert evidence(0).needed == 312
    # observed discordance below the tolerance is raised to it
    assert evidence(0, discordance=0.0).needed == pairs_needed(0.05, 0.05)


@given(st.floats(0.01, 0.5), st.floats(0.01, 0.5), st.none() | st.floats(0.0, 1.0))
def test_needed_decreases_with_tolerance(t1: float, t2: float, psi: float | None) -> None:
    lo, hi = min(t1, t2), max(t1, t2)
    small = evidence(0, tolerance=lo, discordance=psi)
    large = evidence(0, tolerance=hi, discordance=psi)
    assert small.needed >= large.needed >= 10


def test_needed_strictly_decreases() -> None:
    needed = [evidence(0, tolerance=t).needed for t in (0.02, 0.05, 0.1, 0.2)]
    assert needed == sorted(needed, reverse=True) and len(set(needed)) == 4
