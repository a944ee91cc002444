"""Exact paired tests: does FP8 disagree with BF16 in one direction more often than chance?

* :func:`mcnemar_exact` - two-sided, within one bucket.
* :func:`stratified_shift` / :func:`stratified_sign_test` - one-sided, for a *consistent*
  downward FP8 shift across buckets, which can be significant even when no single bucket is.

Each reduces to an exact Binomial(discordant, 1/2) tail (``binomial.binom_cdf_half``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from replay.analysis.stats.binomial import binom_cdf_half
from replay.analysis.stats.pairs import discordant, paired_arrays


@dataclass(frozen=True, slots=True)
class McNemar:
    """Exact McNemar test within one bucket.

    ``a_only``: BF16 passed and FP8 failed (FP8 regressions); ``b_only``: FP8 passed and BF16
    failed. Pairs where both agree say nothing about a difference and are ignored.
    """

    n: int
    a_only: int
    b_only: int
    p_value: float


def mcnemar_p(a_only: int, b_only: int) -> float:
    """The exact two-sided McNemar p-value of discordant counts: twice the smaller tail of
    Binomial(a_only + b_only, 1/2), capped at 1 (1.0 with no discordant pair)."""
    return min(1.0, 2.0 * binom_cdf_half(min(a_only, b_only), a_only + b_only))


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> McNemar:
    """Exact two-sided McNemar test for paired pass/fail grades.

    Under "FP8 and BF16 are equally good", each discordant pair is equally likely to favour
    either side, so ``a_only`` ~ Binomial(a_only + b_only, 1/2). The p-value is twice the
    smaller tail (capped at 1), and 1.0 when there are no discordant pairs. A small p means
    the targets disagree in one direction more than chance allows in this bucket.
    """
    n, a_only, b_only = discordant(a, b, "mcnemar_exact")
    return McNemar(n=n, a_only=a_only, b_only=b_only, p_value=mcnemar_p(a_only, b_only))


@dataclass(frozen=True, slots=True)
class StratifiedShift:
    """One-sided test for a consistent FP8 shift across buckets (strata).

    ``a_only``/``b_only`` are pooled counts of pairs where b did worse / better than a.
    ``p_value`` is one-sided for "b (FP8) is worse than a (BF16)"; ``direction`` is which way
    the pooled counts lean ("down" = FP8 worse), regardless of significance.
    """

    strata: int
    n: int
    a_only: int
    b_only: int
    p_value: float
    direction: str


def _shift(strata: int, n: int, worse: int, better: int) -> StratifiedShift:
    """One-sided exact binomial test on pooled counts: P(X >= worse), X ~ Bin(worse+better, .5).

    By the symmetry of Binomial(., 1/2) that tail equals P(X <= better).
    """
    p = binom_cdf_half(better, worse + better)
    direction = "down" if worse > better else "up" if better > worse else "none"
    return StratifiedShift(
        strata=strata, n=n, a_only=worse, b_only=better, p_value=p, direction=direction
    )


def stratified_shift(strata: Sequence[tuple[Sequence[bool], Sequence[bool]]]) -> StratifiedShift:
    """Is FP8 consistently worse than BF16 across buckets? (pass/fail grades)

    Each stratum is one bucket's paired grades ``(a, b)``. The Mantel-Haenszel test for
    matched pairs treats every pair as its own 2x2 stratum; only discordant pairs contribute,
    and the statistic reduces to McNemar on the pooled discordant counts. Grouping pairs into
    length buckets only partitions those pair-strata, so the same pooled test applies: under
    the null "within every pair, a-only and b-only are equally likely" (however much the
    discordance rate differs between buckets), the pooled ``a_only`` is exactly
    Binomial(a_only + b_only, 1/2) conditional on the discordant total. We use that exact
    one-sided tail.

    Why this finds what per-bucket tests miss: 4 regressions vs 0 in each of four buckets is
    p = 0.125 per bucket (two-sided), but 16 vs 0 pooled is p = 2**-16. The test is tuned to a
    *consistent* direction; opposite shifts in different buckets cancel, so per-bucket McNemar
    results should still be reported alongside it.
    """
    n = worse = better = 0
    for i, (a, b) in enumerate(strata):
        k, a_only, b_only = discordant(a, b, f"stratified_shift stratum {i}")
        n, worse, better = n + k, worse + a_only, better + b_only
    return _shift(len(strata), n, worse, better)


def stratified_sign_test(
    strata: Sequence[tuple[Sequence[float], Sequence[float]]],
    *,
    higher_is_better: bool = True,
    tie: float = 0.0,
) -> StratifiedShift:
    """Pooled paired sign test for a consistent downward FP8 shift in continuous scores.

    For each pair, "worse" means b < a (or b > a with ``higher_is_better=False``, e.g. for
    per-request NLL); pairs with ``|b - a| <= tie`` are ties and dropped. The sign test is the
    continuous-score counterpart of McNemar: under "no shift" (each pair's difference has
    median 0) the pooled count of worse pairs is Binomial(non-ties, 1/2), whatever the scale
    of scores in each bucket, so buckets with different score ranges pool without weighting.
    It ignores magnitudes, which makes it robust to a few huge outliers at long context;
    ``intervals.paired_bootstrap`` gives the size of the shift. ``a_only`` counts worse pairs,
    ``b_only`` better ones; ``p_value`` is one-sided for "b worse".
    """
    if tie < 0:
        raise ValueError(f"stratified_sign_test: tie must be >= 0, got {tie}")
    sign = 1.0 if higher_is_better else -1.0
    n = worse = better = 0
    for i, (a, b) in enumerate(strata):
        xa, xb = paired_arrays(a, b, f"stratified_sign_test stratum {i}")
        d = sign * (xb - xa)
        n += int(d.size)
        worse += int((d < -tie).sum())
        better += int((d > tie).sum())
    return _shift(len(strata), n, worse, better)
