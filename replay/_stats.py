"""Paired statistics for FP8-vs-BF16 comparisons, one context-length bucket at a time.

Both targets answer the *same* requests, so every comparison is paired: request i graded on
BF16 (``a``, the reference) and on FP8 (``b``, the candidate). Pairing removes the
request-to-request variation (easy vs hard prompts) that would otherwise swamp a small FP8
effect, which is why nothing here compares two independent pass rates.

* :func:`wilson` - a pass rate's interval for one target in one bucket.
* :func:`paired_bootstrap` - FP8 - BF16 mean difference with a paired percentile interval.
* :func:`mcnemar_exact` - exact two-sided test: do the targets disagree in one direction more
  often than chance within one bucket?
* :func:`stratified_shift` / :func:`stratified_sign_test` - one-sided test for a *consistent*
  downward FP8 shift across buckets, which can be significant even when no single bucket is
  (the Kimi-K2.5 pattern: a small drift in every length bucket, not a few noisy failures).
* :func:`evidence` - whether a bucket has enough graded pairs to say anything, and how many it
  would need.

Everything is pure and deterministic: randomness comes only from a private
``np.random.default_rng(seed)``. Exact binomial tails use integer arithmetic (``math.comb``
style) up to :data:`EXACT_MAX` trials and log-space sums beyond.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

Z95 = 1.959963984540054
"""Two-sided 95% normal quantile, the default for Wilson intervals."""

EXACT_MAX = 4096
"""Binomial tails with at most this many trials are summed exactly in integers."""

_BOOT_CHUNK = 1 << 20  # resampled indices held in memory at once by the bootstrap


# --- binomial tails -------------------------------------------------------------------------

def _binom_cdf_half(m: int, n: int) -> float:
    """P(X <= m) for X ~ Binomial(n, 1/2): the null distribution of discordant pairs."""
    if m < 0:
        return 0.0
    if m >= n:
        return 1.0
    if n <= EXACT_MAX:
        term, total = 1, 1
        for k in range(m):
            term = term * (n - k) // (k + 1)
            total += term
        return min(1.0, total / (1 << n))  # int / int is correctly rounded in Python
    return _binom_cdf_half_log(m, n)


def _binom_cdf_half_log(m: int, n: int) -> float:
    """Log-space version of :func:`_binom_cdf_half` for large n (lgamma + log-sum-exp)."""
    ln = math.lgamma(n + 1) - n * math.log(2.0)
    logs = np.array([ln - math.lgamma(k + 1) - math.lgamma(n - k + 1) for k in range(m + 1)])
    top = float(logs.max())
    return min(1.0, math.exp(top + math.log(float(np.exp(logs - top).sum()))))


# --- pass rates -----------------------------------------------------------------------------

def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """Wilson score interval for k passes out of n graded requests; ``None`` when n == 0.

    Unlike the normal (Wald) interval it stays inside [0, 1] and is honest at 0/n and n/n,
    which matter here: a bucket where BF16 passes 10/10 still has an upper-tail doubt, and a
    bucket where FP8 passes 0/10 is not "certainly 0%".
    """
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"wilson: need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return None
    p, z2 = k / n, z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    lo = 0.0 if k == 0 else max(0.0, min(p, centre - half))
    hi = 1.0 if k == n else min(1.0, max(p, centre + half))
    return lo, hi


# --- paired difference ----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PairedDiff:
    """Mean FP8 - BF16 difference over paired requests, with a bootstrap interval.

    ``diff`` < 0 means the candidate (b, FP8) scores lower than the reference (a, BF16).
    An interval that excludes 0 says the shift is larger than resampling noise.
    """

    n: int
    mean_a: float
    mean_b: float
    diff: float
    lo: float
    hi: float


def _paired_arrays(
    a: Sequence[float], b: Sequence[float], what: str
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    xa, xb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if xa.ndim != 1 or xb.ndim != 1 or xa.shape != xb.shape:
        raise ValueError(f"{what}: a and b must be flat and of the same length "
                         f"({xa.shape} vs {xb.shape})")
    if not (np.isfinite(xa).all() and np.isfinite(xb).all()):
        raise ValueError(f"{what}: values must be finite")
    return xa, xb


def _boot_means(d: npt.NDArray[np.float64], n_boot: int, seed: int) -> npt.NDArray[np.float64]:
    """Means of n_boot resamples (with replacement) of the pair differences d."""
    rng = np.random.default_rng(seed)
    n = d.size
    rows = max(1, _BOOT_CHUNK // n)
    out = [d[rng.integers(0, n, size=(min(rows, n_boot - i), n))].mean(axis=1)
           for i in range(0, n_boot, rows)]
    return np.concatenate(out)


def paired_bootstrap(
    a: Sequence[float], b: Sequence[float], *, n_boot: int = 2000, alpha: float = 0.05,
    seed: int = 0,
) -> PairedDiff | None:
    """Mean of ``b - a`` with a paired percentile-bootstrap (1 - alpha) interval.

    Pairs (request i on BF16, request i on FP8) are resampled together, so the interval
    reflects only how the *difference* varies across requests. Values may be 0/1 grades or
    continuous scores. ``None`` when there are no pairs. The percentile interval is widened,
    if needed, to contain the point estimate (this only matters for last-digit rounding or
    tiny samples at extreme alphas).
    """
    if n_boot < 1 or not 0.0 < alpha < 1.0:
        raise ValueError(f"paired_bootstrap: need n_boot >= 1 and 0 < alpha < 1 "
                         f"(got {n_boot}, {alpha})")
    xa, xb = _paired_arrays(a, b, "paired_bootstrap")
    if xa.size == 0:
        return None
    d = xb - xa
    diff = float(d.mean())
    lo, hi = np.percentile(_boot_means(d, n_boot, seed), [50 * alpha, 100 - 50 * alpha])
    return PairedDiff(n=int(d.size), mean_a=float(xa.mean()), mean_b=float(xb.mean()),
                      diff=diff, lo=min(float(lo), diff), hi=max(float(hi), diff))


# --- McNemar --------------------------------------------------------------------------------

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


def _discordant(a: Sequence[bool], b: Sequence[bool], what: str) -> tuple[int, int, int]:
    """(pairs, a passed & b failed, b passed & a failed)."""
    xa, xb = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    if xa.ndim != 1 or xb.ndim != 1 or xa.shape != xb.shape:
        raise ValueError(f"{what}: a and b must be flat and of the same length "
                         f"({xa.shape} vs {xb.shape})")
    return int(xa.size), int((xa & ~xb).sum()), int((xb & ~xa).sum())


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> McNemar:
    """Exact two-sided McNemar test for paired pass/fail grades.

    Under "FP8 and BF16 are equally good", each discordant pair is equally likely to favour
    either side, so ``a_only`` ~ Binomial(a_only + b_only, 1/2). The p-value is twice the
    smaller tail (capped at 1), and 1.0 when there are no discordant pairs. A small p means
    the targets disagree in one direction more than chance allows in this bucket.
    """
    n, a_only, b_only = _discordant(a, b, "mcnemar_exact")
    p = min(1.0, 2.0 * _binom_cdf_half(min(a_only, b_only), a_only + b_only))
    return McNemar(n=n, a_only=a_only, b_only=b_only, p_value=p)


# --- stratified shift -----------------------------------------------------------------------

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
    p = _binom_cdf_half(better, worse + better)
    direction = "down" if worse > better else "up" if better > worse else "none"
    return StratifiedShift(strata=strata, n=n, a_only=worse, b_only=better, p_value=p,
                           direction=direction)


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
        k, a_only, b_only = _discordant(a, b, f"stratified_shift stratum {i}")
        n, worse, better = n + k, worse + a_only, better + b_only
    return _shift(len(strata), n, worse, better)


def stratified_sign_test(
    strata: Sequence[tuple[Sequence[float], Sequence[float]]], *, higher_is_better: bool = True,
    tie: float = 0.0,
) -> StratifiedShift:
    """Pooled paired sign test for a consistent downward FP8 shift in continuous scores.

    For each pair, "worse" means b < a (or b > a with ``higher_is_better=False``, e.g. for
    per-request NLL); pairs with ``|b - a| <= tie`` are ties and dropped. The sign test is the
    continuous-score counterpart of McNemar: under "no shift" (each pair's difference has
    median 0) the pooled count of worse pairs is Binomial(non-ties, 1/2), whatever the scale
    of scores in each bucket, so buckets with different score ranges pool without weighting.
    It ignores magnitudes, which makes it robust to a few huge outliers at long context;
    :func:`paired_bootstrap` gives the size of the shift. ``a_only`` counts worse pairs,
    ``b_only`` better ones; ``p_value`` is one-sided for "b worse".
    """
    if tie < 0:
        raise ValueError(f"stratified_sign_test: tie must be >= 0, got {tie}")
    sign = 1.0 if higher_is_better else -1.0
    n = worse = better = 0
    for i, (a, b) in enumerate(strata):
        xa, xb = _paired_arrays(a, b, f"stratified_sign_test stratum {i}")
        d = sign * (xb - xa)
        n += int(d.size)
        worse += int((d < -tie).sum())
        better += int((d > tie).sum())
    return _shift(len(strata), n, worse, better)


# --- sample size ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Evidence:
    """Whether a bucket has enough graded pairs to judge an FP8 shift of a given size.

    ``needed`` is the number of pairs for the stated power; ``reason`` says it in words.
    """

    sufficient: bool
    n: int
    needed: int
    reason: str


def pairs_needed(tolerance: float, psi: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Pairs for a two-sided McNemar test to detect a paired difference ``tolerance``.

    Normal approximation for paired proportions (Connor 1987 / Miettinen):
    ``n = ((z_{1-alpha/2} sqrt(psi) + z_{power} sqrt(psi - delta^2)) / delta)^2``,
    where delta is the difference in pass rates and psi the proportion of discordant pairs.
    psi must be at least delta (a 5-point drop needs at least 5% of pairs to disagree).
    """
    if not 0.0 < tolerance < 1.0 or not tolerance <= psi <= 1.0:
        raise ValueError(f"pairs_needed: need 0 < tolerance <= psi <= 1 "
                         f"(got {tolerance}, {psi})")
    nd = NormalDist()
    za, zb = nd.inv_cdf(1 - alpha / 2), nd.inv_cdf(power)
    root = (za * math.sqrt(psi) + zb * math.sqrt(psi - tolerance**2)) / tolerance
    return math.ceil(root * root - 1e-9)


def evidence(
    n_pairs: int, *, tolerance: float = 0.05, discordance: float | None = None,
    alpha: float = 0.05, power: float = 0.8, minimum: int = 10,
) -> Evidence:
    """Say "insufficient evidence" for a bucket with too few graded pairs, and how many it needs.

    ``needed`` is :func:`pairs_needed` (at least ``minimum``). The discordance proportion psi
    is the observed one when given (raised to ``tolerance`` if lower, the least a shift of that
    size implies), otherwise a prior of ``max(2 * tolerance, 0.1)``: FP8 and BF16 grades
    usually agree, but long generations diverge on sampling alone.
    """
    if n_pairs < 0 or not 0.0 < alpha < 1.0 or not 0.0 < power < 1.0:
        raise ValueError(f"evidence: bad n_pairs/alpha/power ({n_pairs}, {alpha}, {power})")
    if discordance is not None and not 0.0 <= discordance <= 1.0:
        raise ValueError(f"evidence: discordance must be in [0, 1], got {discordance}")
    psi = max(2 * tolerance, 0.1) if discordance is None else discordance
    psi = min(1.0, max(psi, tolerance))
    needed = max(minimum, pairs_needed(tolerance, psi, alpha, power))
    ok = n_pairs >= needed
    verb = "suffice" if ok else "needed"
    reason = (f"{n_pairs} graded pairs; about {needed} {verb} to detect a "
              f"{100 * tolerance:g}-point drop ({100 * power:g}% power, alpha {alpha:g})")
    return Evidence(sufficient=ok, n=n_pairs, needed=needed, reason=reason)
