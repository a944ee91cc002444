"""Paired FP8-vs-BF16 statistics: known answers, a planted shift, and properties.

Convention throughout: ``a`` is the reference (BF16), ``b`` the candidate (FP8).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.analysis.stats import intervals
from replay.analysis.stats.binomial import EXACT_MAX, binom_cdf_half
from replay.analysis.stats.equivalence import MIN_PAIRS, drop_upper_bound, equivalence_p, equivalent
from replay.analysis.stats.evidence import evidence
from replay.analysis.stats.exact_tests import mcnemar_exact, stratified_shift, stratified_sign_test
from replay.analysis.stats.intervals import PairedDiff, cluster_ci, paired_bootstrap, wilson
from replay.analysis.stats.power import (
    MAX_NEEDED,
    critical_regressions,
    equivalence_power,
    pairs_needed,
    zero_discordance_pairs,
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
        assert binom_cdf_half(m, n) == pytest.approx(cdf[m], rel=1e-9)


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
    boot, swapped = (
        paired_bootstrap(a, b, n_boot=200, seed=seed),
        paired_bootstrap(b, a, n_boot=200, seed=seed),
    )
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
        flat.n,
        flat.a_only,
        flat.b_only,
        flat.p_value,
        flat.direction,
    )
    assert s.strata == len(strata)


@given(bool_pairs())
def test_sign_test_on_grades_matches_shift(ab: BoolPairs) -> None:
    a, b = ab
    s = stratified_shift([(a, b)])
    sign = stratified_sign_test([([float(x) for x in a], [float(x) for x in b])])
    assert (sign.a_only, sign.b_only, sign.p_value) == (s.a_only, s.b_only, s.p_value)


# --- evidence -------------------------------------------------------------------------------


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k), X ~ Binomial(n, p), from math.comb (the test's own oracle)."""
    return sum(math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(k + 1))


def test_no_disagreement_is_the_binomial_bound() -> None:
    """No discordant pair in n bounds the drop below t at alpha once (1 - t)^n <= alpha."""
    for n in (1, 10, 58, 59, 300):
        assert equivalence_p(n, 0, 0, 0.05) == pytest.approx(0.95**n, rel=1e-12)
    assert zero_discordance_pairs(0.05, 0.05) == 59  # 0.95^58 = 0.051, 0.95^59 = 0.0485
    assert zero_discordance_pairs(0.02, 0.05) == 149
    assert zero_discordance_pairs(0.05, 0.01) == 90
    assert not equivalent(58, 0, 0) and equivalent(59, 0, 0)
    assert not equivalent(59, 0, 0, min_pairs=60)


def test_the_issue_examples() -> None:
    """57/57 passing on both sides: about 60 pairs (59), not the normal approximation's 155;
    a 70-point loss at McNemar p ~ 1e-15 is a loss and names no N."""
    e = evidence(57)
    assert (e.status, e.sufficient, e.needed) == ("open", False, 59)
    assert "at least 59 needed" in e.reason and e.short == "at least 59 needed"
    lost = evidence(60, 50, 8)
    assert (lost.status, lost.sufficient, lost.needed) == ("loss", True, None)
    assert "show a loss" in lost.reason and "needed" not in lost.reason
    ok = evidence(59)
    assert (ok.status, ok.sufficient, ok.needed, ok.short) == (
        "equivalent",
        True,
        None,
        "within tolerance",
    )
    assert ok.drop_bound < 0.05 and "at most 4.95 points" in ok.reason


def test_no_improvement_is_clopper_pearson() -> None:
    """With no improvement the bound is the exact binomial one on the regression rate."""
    for n, x in ((20, 0), (100, 1), (100, 2), (333, 7)):
        assert equivalence_p(n, x, 0, 0.05) == pytest.approx(binom_cdf(x, n, 0.05), rel=1e-9)


def test_tolerance_zero_is_one_sided_mcnemar() -> None:
    """At a tolerance of 0 the bound is the exact McNemar test that FP8 is no worse."""
    for n, x, y in ((100, 3, 7), (40, 1, 9), (500, 20, 20)):
        assert equivalence_p(n, x, y, 1e-9) == pytest.approx(exact_lower_tail(x, x + y), rel=1e-6)


def test_quadrature_is_converged() -> None:
    from replay.analysis.stats.equivalence import equivalence_ps

    for n, m, x, t in (
        (200, 4, 2, 0.05),
        (1000, 40, 35, 0.05),
        (60, 4, 1, 0.2),
        (3000, 500, 240, 0.02),
        (80, 79, 40, 0.1),
    ):
        fine = float(equivalence_ps(n, m, x, t, panels=64)[x])
        assert equivalence_p(n, x, m - x, t) == pytest.approx(fine, rel=1e-7, abs=1e-12)


@pytest.mark.parametrize(("tolerance", "alpha"), [(0.05, 0.05), (0.1, 0.05), (0.05, 0.01)])
def test_exact_size_at_a_drop_of_exactly_the_tolerance(tolerance: float, alpha: float) -> None:
    """Fay & Lumbard conjecture the melded bound keeps its level; here it is computed
    exactly (trinomial sums over the region) where a true drop equals the tolerance."""
    for n in (20, 59, 100, 250):
        for psi in (tolerance, 0.1, 0.3, 0.7, 1.0):
            if psi < tolerance:
                continue
            improve = (psi - tolerance) / 2
            size = equivalence_power(
                n, improve + tolerance, improve, tolerance=tolerance, alpha=alpha
            )
            assert size <= alpha + 1e-9, (n, psi, size)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 160).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.integers(0, n).flatmap(lambda m: st.tuples(st.integers(0, m), st.just(m))),
        )
    ),
    st.sampled_from([0.02, 0.05, 0.1, 0.3]),
)
def test_critical_region_is_the_rule(case: tuple[int, tuple[int, int]], tol: float) -> None:
    """The region power is computed over is exactly where ``equivalent`` says yes, and no
    drop seen at or above the tolerance is ever shown below it."""
    n, (x, m) = case
    crit = int(critical_regressions(n, [m], tolerance=tol)[0])
    assert equivalent(n, x, m - x, tolerance=tol, min_pairs=0) == (x <= crit)
    p = equivalence_p(n, x, m - x, tol)
    if (2 * x - m) / n >= tol:
        assert p > 0.05
    if x > 0:
        assert equivalence_p(n, x - 1, m - x + 1, tol) <= p + 1e-12  # fewer losses: smaller


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 400).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.integers(0, n).flatmap(lambda m: st.tuples(st.integers(0, m), st.just(m))),
        )
    )
)
def test_drop_bound_is_where_the_p_value_crosses_alpha(case: tuple[int, tuple[int, int]]) -> None:
    n, (x, m) = case
    u = drop_upper_bound(n, x, m - x)
    assert 0.0 <= u <= 1.0 and u >= (2 * x - m) / n - 1e-9
    if 1e-6 < u < 1.0 - 1e-6:
        assert equivalence_p(n, x, m - x, u + 1e-6) <= 0.05 < equivalence_p(n, x, m - x, u - 1e-6)


@pytest.mark.parametrize(
    ("n", "lost", "gained"), [(100, 3, 3), (60, 1, 0), (200, 8, 2), (50, 2, 2), (150, 7, 4)]
)
def test_needed_has_the_promised_power(n: int, lost: int, gained: int) -> None:
    """Need N: at the rates seen so far, N pairs show equivalence with chance >= 80%."""
    e = evidence(n, lost, gained)
    assert e.status == "open" and e.needed is not None and e.needed > n
    assert f"about {e.needed} needed" in e.reason and "80% chance" in e.reason
    assert equivalence_power(e.needed, lost / n, gained / n) >= 0.8
    assert pairs_needed(lost / n, gained / n, at_least=1) <= e.needed  # type: ignore[operator]


def test_need_n_only_where_it_can_be_reached() -> None:
    far = evidence(40, 4, 0)  # a 10-point drop so far, no loss shown yet
    assert (far.status, far.needed) == ("open", None)
    assert "no number of pairs would show a match" in far.reason
    assert pairs_needed(0.06, 0.0) is None
    close = evidence(400, 40, 25)  # 3.75 points so far: more than MAX_NEEDED pairs
    assert close.status == "open" and close.needed is None
    assert f"more than {MAX_NEEDED} needed" in close.reason


def test_evidence_rule_is_configuration() -> None:
    e = evidence(15, tolerance=0.2, min_pairs=10)
    assert e.status == "equivalent" and e.to_json()["rule"] == {
        "tolerance": 0.2,
        "alpha": 0.05,
        "min_pairs": 10,
        "power": 0.8,
    }
    assert evidence(15, tolerance=0.2).needed == 20  # the minimum pairs still apply
    assert evidence(0, min_pairs=0, alpha=0.01).needed == 90
    # a loss at alpha / phases: the verdict's level for one phase of a sweep
    assert evidence(200, 14, 4).status == "loss"
    assert evidence(200, 14, 4, loss_alpha=0.025).status == "open"


def test_needed_strictly_decreases_with_tolerance() -> None:
    needed = [evidence(0, tolerance=t, min_pairs=0).needed for t in (0.02, 0.05, 0.1, 0.2)]
    assert needed == [149, 59, 29, 14]
    rates = [pairs_needed(0.02, 0.02, tolerance=t) for t in (0.05, 0.1, 0.2)]
    assert rates == sorted(rates, reverse=True) and len(set(rates)) == 3  # type: ignore[type-var]


def test_evidence_rejects_bad_input() -> None:
    for args, kw in (
        ((5, 4, 2), {}),
        ((-1,), {}),
        ((10,), {"tolerance": 0.0}),
        ((10,), {"alpha": 0.6}),
        ((10,), {"min_pairs": -1}),
    ):
        with pytest.raises(ValueError):
            evidence(*args, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        pairs_needed(0.01, 0.01, power=1.0)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 300).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.integers(0, n).flatmap(lambda m: st.tuples(st.integers(0, m), st.just(m))),
        )
    )
)
def test_need_n_appears_only_while_the_question_is_open(case: tuple[int, tuple[int, int]]) -> None:
    n, (x, m) = case
    e = evidence(n, x, m - x)
    assert e.sufficient == (e.status != "open") and e.to_json()["status"] == e.status
    if e.status == "open":
        assert e.needed is None or e.needed > max(n, MIN_PAIRS - 1)
        assert not equivalent(n, x, m - x)
    else:
        assert e.needed is None and "needed" not in e.short + e.reason
    if e.status == "loss":
        assert x > m - x and mcnemar_exact(*pairs(0, x, m - x, n - m)).p_value < 0.05


def test_cluster_interval_is_of_the_per_token_mean() -> None:
    # Many short answers that lose much and few long ones that lose little: the mean of the
    # requests' means (0.40) lies far above the per-token mean (0.03); the interval is
    # of the per-token mean and holds it.
    sums = [0.5 * 2] * 20 + [0.01 * 200] * 5
    counts = [2] * 20 + [200] * 5
    point = sum(sums) / sum(counts)
    ci = cluster_ci(sums, counts, seed=1)
    assert ci is not None and ci[0] <= point <= ci[1] < 0.2
    assert cluster_ci([], []) is None and cluster_ci([0.0], [0]) is None


@given(st.lists(st.tuples(st.floats(-5, 5), st.integers(1, 50)), min_size=1, max_size=30))
@settings(max_examples=50, deadline=None)
def test_cluster_interval_holds_its_point(rows: list[tuple[float, int]]) -> None:
    sums = [s * n for s, n in rows]
    counts = [n for _, n in rows]
    ci = cluster_ci(sums, counts, n_boot=200)
    point = sum(sums) / sum(counts)
    assert ci is not None and ci[0] - 1e-12 <= point <= ci[1] + 1e-12


def _index_bootstrap(d: list[float], seed: int, monkeypatch: pytest.MonkeyPatch) -> PairedDiff:
    """The interval of ``d`` by resampling indices, however many pairs it has."""
    monkeypatch.setattr(intervals, "BOOT_INDEX_MAX", len(d))
    got = paired_bootstrap([0.0] * len(d), d, seed=seed)
    monkeypatch.undo()
    assert got is not None
    return got


@pytest.mark.parametrize("kind", ["grades", "latencies"])
def test_large_sample_intervals_match_the_bootstrap(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above ``BOOT_INDEX_MAX`` pairs the interval is drawn from counts of each distinct
    difference (grades) or is the normal interval (latencies, heavy-tailed here: lognormal
    with sigma 1.5, skewness about 33). Both land within the index bootstrap's own
    resampling noise: two runs of 2,000 resamples differ by about 0.09 standard errors
    (sd, measured over 40 seeds), and these are within 0.3 of it."""
    rng = np.random.default_rng(7)
    n = intervals.BOOT_INDEX_MAX + 1
    if kind == "grades":
        d = rng.choice([-1.0, 0.0, 1.0], size=n, p=[0.06, 0.9, 0.04]).tolist()
    else:
        d = (rng.lognormal(0.0, 1.5, size=n) - 1.0).tolist()
    fast = paired_bootstrap([0.0] * n, d, seed=3)
    slow = _index_bootstrap(d, 3, monkeypatch)
    assert fast is not None
    se = float(np.std(d)) / math.sqrt(n)
    assert fast.diff == slow.diff
    assert abs(fast.lo - slow.lo) < 0.3 * se
    assert abs(fast.hi - slow.hi) < 0.3 * se
    assert fast.lo < fast.diff < fast.hi
    assert paired_bootstrap([0.0] * n, d, seed=3) == fast  # deterministic


def test_a_large_sample_of_grades_is_resampled_by_seed() -> None:
    """The counts bootstrap is a bootstrap: another seed gives other resamples."""
    n = intervals.BOOT_INDEX_MAX + 1
    rng = np.random.default_rng(1)
    d = rng.choice([-1.0, 0.0, 1.0], size=n, p=[0.1, 0.8, 0.1]).tolist()
    one = paired_bootstrap([0.0] * n, d, seed=1)
    two = paired_bootstrap([0.0] * n, d, seed=2)
    assert one is not None and two is not None
    assert (one.lo, one.hi) != (two.lo, two.hi)
