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
* :func:`evidence` - what a bucket's pairs settle (a loss, or a drop bounded below the
  tolerance by an exact one-sided bound: :func:`equivalence_p`), and while they settle
  neither, how many pairs it needs (:func:`pairs_needed`, from exact power).

Everything is pure and deterministic: randomness comes only from a private
``np.random.default_rng(seed)``. Exact binomial tails use integer arithmetic (``math.comb``
style) up to :data:`EXACT_MAX` trials and log-space sums beyond.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

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
        raise ValueError(
            f"{what}: a and b must be flat and of the same length ({xa.shape} vs {xb.shape})"
        )
    if not (np.isfinite(xa).all() and np.isfinite(xb).all()):
        raise ValueError(f"{what}: values must be finite")
    return xa, xb


def _boot_means(d: npt.NDArray[np.float64], n_boot: int, seed: int) -> npt.NDArray[np.float64]:
    """Means of n_boot resamples (with replacement) of the pair differences d."""
    rng = np.random.default_rng(seed)
    n = d.size
    rows = max(1, _BOOT_CHUNK // n)
    out = [
        d[rng.integers(0, n, size=(min(rows, n_boot - i), n))].mean(axis=1)
        for i in range(0, n_boot, rows)
    ]
    return np.concatenate(out)


def paired_bootstrap(
    a: Sequence[float],
    b: Sequence[float],
    *,
    n_boot: int = 2000,
    alpha: float = 0.05,
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
        raise ValueError(
            f"paired_bootstrap: need n_boot >= 1 and 0 < alpha < 1 (got {n_boot}, {alpha})"
        )
    xa, xb = _paired_arrays(a, b, "paired_bootstrap")
    if xa.size == 0:
        return None
    d = xb - xa
    diff = float(d.mean())
    lo, hi = np.percentile(_boot_means(d, n_boot, seed), [50 * alpha, 100 - 50 * alpha])
    return PairedDiff(
        n=int(d.size),
        mean_a=float(xa.mean()),
        mean_b=float(xb.mean()),
        diff=diff,
        lo=min(float(lo), diff),
        hi=max(float(hi), diff),
    )


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
        raise ValueError(
            f"{what}: a and b must be flat and of the same length ({xa.shape} vs {xb.shape})"
        )
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
        k, a_only, b_only = _discordant(a, b, f"stratified_shift stratum {i}")
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


# --- evidence: is the drop bounded below the tolerance? -----------------------------------

TOLERANCE = 0.05
"""Largest acceptable FP8 - BF16 pass-rate drop per bucket (0.05 = 5 points)."""

ALPHA = 0.05
"""Level of every test here: a loss, and the one-sided bound that shows a drop is smaller."""

MIN_PAIRS = 20
"""Graded pairs a bucket needs before its evidence counts at all."""

POWER = 0.8
"""Chance that a bucket of the size "need N" names shows equivalence, if its rates hold."""

MAX_NEEDED = 5000
"""Beyond this many pairs "need N" says "more than" instead of a number."""

_GL_X, _GL_W = np.polynomial.legendre.leggauss(16)
_PANELS = 8  # panels of 16 Gauss-Legendre nodes (half once T is near normal): 1e-7 of 64 panels


def _check_tol_alpha(tolerance: float, alpha: float, what: str) -> None:
    if not 0.0 < tolerance < 1.0 or not 0.0 < alpha < 0.5:
        raise ValueError(
            f"{what}: need 0 < tolerance < 1 and 0 < alpha < 0.5 (got {tolerance}, {alpha})"
        )


def _check_tolerance(tolerance: float, what: str) -> None:
    if not 0.0 < tolerance < 1.0:
        raise ValueError(f"{what}: need 0 < tolerance < 1, got {tolerance}")


def _check_counts(n: int, regressions: int, improvements: int, what: str) -> None:
    if regressions < 0 or improvements < 0 or regressions + improvements > n:
        raise ValueError(
            f"{what}: need 0 <= regressions + improvements <= n (got "
            f"{regressions} + {improvements} of {n})"
        )


@functools.lru_cache(maxsize=4)
def _log_factorials(size: int) -> npt.NDArray[np.float64]:
    return np.array([math.lgamma(k + 1.0) for k in range(size + 1)])


def _lf(n: int) -> npt.NDArray[np.float64]:
    """log k! for k = 0..n at least (grown in powers of two, so few tables are ever built)."""
    return _log_factorials(1 << max(10, (n + 1).bit_length()))


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lf, j = _lf(n), np.arange(k + 1)
    logs = lf[n] - lf[j] - lf[n - j] + j * math.log(p) + (n - j) * math.log1p(-p)
    return min(1.0, float(np.exp(logs).sum()))


def _discordance_nodes(
    n: int, m: int, tolerance: float, panels: int = 0
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]] | None:
    """Quadrature nodes s in [tolerance, 1] and weights w * density of T ~ Beta(m + 1, n - m).

    T is the exact (Clopper-Pearson) upper confidence distribution of the discordance rate
    after m discordant pairs in n (0 < m < n). The window runs from 15 SD below to 40 SD
    above T's mean (12 and 16 once m >= 30, where T is close to normal): less than 1e-20 of
    T lies outside it. ``None``: T has no mass above the tolerance.
    """
    mu = (m + 1) / (n + 1)
    sd = math.sqrt(mu * (1 - mu) / (n + 2))
    below, above = (12, 16) if m >= 30 else (15, 40)
    lo, hi = max(tolerance, mu - below * sd), min(1.0, mu + above * sd)
    if lo >= hi:
        return None
    panels = panels or (_PANELS // 2 if m >= 30 else _PANELS)
    edges = np.linspace(lo, hi, panels + 1)
    a, b = edges[:-1, None], edges[1:, None]
    s = ((a + b) / 2 + (b - a) / 2 * _GL_X[None, :]).ravel()
    w = ((b - a) / 2 * _GL_W[None, :]).ravel()
    lf = _lf(n)
    log_density = m * np.log(s) + (n - m - 1) * np.log1p(-s) - (lf[m] + lf[n - m - 1] - lf[n])
    return s, w * np.exp(log_density)


def _equivalence_ps(
    n: int, m: int, top: int, tolerance: float, panels: int = 0
) -> npt.NDArray[np.float64]:
    """:func:`equivalence_p` for x = 0..top regressions among m discordant pairs, at once.

    For fixed n and m the discordance's confidence distribution is shared, so one quadrature
    serves every split of the m pairs: the inner binomial CDFs are one cumulative sum. Terms
    more than 12 SD (+5) below the smallest binomial mean are left out (under 1e-30); x
    below them gets p = 0.
    """
    top = min(top, m)
    if m == 0:
        return np.array([_binom_cdf(0, n, tolerance)])
    lf, j = _lf(max(n, m)), np.arange(top + 1)
    out: npt.NDArray[np.float64]
    if m == n:  # every pair disagrees: the discordance rate is 1 for sure
        u0 = (1 + tolerance) / 2
        logs = lf[m] - lf[j] - lf[m - j] + j * math.log(u0) + (m - j) * math.log1p(-u0)
        out = np.minimum(1.0, np.cumsum(np.exp(logs)))
    else:
        nodes = _discordance_nodes(n, m, tolerance, panels)
        out = np.zeros(top + 1)
        if nodes is not None:
            s, w = nodes
            u = (1 + tolerance / s) / 2  # the regression share of discordant pairs needed
            um = float(u.min())
            first = max(0, math.floor(m * um - 12 * math.sqrt(m * um * (1 - um))) - 5)
            if first <= top:
                k = j[first:]
                logs = (
                    lf[m]
                    - lf[k][None, :]
                    - lf[m - k][None, :]
                    + k[None, :] * np.log(u)[:, None]
                    + (m - k)[None, :] * np.log1p(-u)[:, None]
                )
                out[first:] = np.minimum(1.0, w @ np.cumsum(np.exp(logs), axis=1))
    if top == m:  # no improvement at all: the regression share is 1, the bound is exact
        out[m] = _binom_cdf(m, n, tolerance)
    return out


def equivalence_p(n: int, regressions: int, improvements: int, tolerance: float) -> float:
    """Exact one-sided p-value for "the drop is at least ``tolerance``" (small: it is smaller).

    The drop is ``delta = p10 - p01``: the share of requests the reference passes and the
    candidate fails (regressions) minus the share it fails and the candidate passes
    (improvements). Write ``delta = T (2 B - 1)`` with T = p10 + p01 the discordance rate and
    B = p10 / T the regression share of discordant pairs. The melded confidence bound of Fay
    & Lumbard (2021, "Confidence intervals for difference in proportions for matched pairs
    compatible with exact McNemar's or sign tests", Statistics in Medicine 40:1147-1159;
    ``exact2x2::mcnemarExactDP`` in R) combines the exact (Clopper-Pearson) upper confidence
    distributions of the two, ``T_U ~ Beta(m + 1, n - m)`` after m discordant pairs in n and
    ``B_U ~ Beta(x + 1, m - x)`` after x regressions in m, into

        p = P(T_U (2 B_U - 1) >= tolerance)
          = integral over s of density_T_U(s) * P(Binomial(m, (1 + tolerance / s) / 2) <= x),

    integrated here by Gauss-Legendre quadrature over T_U's mass. Two cases are closed form:
    with no improvement (``B_U = 1``) it is the exact binomial bound on the regression rate,
    ``P(Binomial(n, tolerance) <= x)``; with no discordant pair at all that is
    ``(1 - tolerance)^n``. As ``tolerance -> 0`` it is the exact one-sided McNemar p-value, so
    the bound never contradicts :func:`mcnemar_exact`. Fay & Lumbard conjecture, from
    extensive numerical checks, that the test never exceeds its level; this project checks it
    too: the exact size at a true drop of exactly ``tolerance`` (tests/test_stats.py) and a
    simulation (tests/test_evidence_simulation.py, figures in the README).
    """
    _check_tolerance(tolerance, "equivalence_p")
    _check_counts(n, regressions, improvements, "equivalence_p")
    return _equivalence_p(n, regressions, improvements, tolerance)


@functools.lru_cache(maxsize=4096)
def _equivalence_p(n: int, x: int, y: int, tolerance: float) -> float:
    if n == 0:
        return 1.0
    return float(_equivalence_ps(n, x + y, x, tolerance)[x])


def equivalent(
    n: int,
    regressions: int,
    improvements: int,
    *,
    tolerance: float = TOLERANCE,
    alpha: float = ALPHA,
    min_pairs: int = MIN_PAIRS,
) -> bool:
    """Is the drop shown to be below ``tolerance`` (at level ``alpha``, with enough pairs)?

    The one rule behind grading's "sufficient", the report's evidence column and the KEEP
    and CALIBRATE verdicts.
    """
    _check_tol_alpha(tolerance, alpha, "equivalent")
    return n >= min_pairs and equivalence_p(n, regressions, improvements, tolerance) <= alpha


def drop_upper_bound(n: int, regressions: int, improvements: int, alpha: float = ALPHA) -> float:
    """The one-sided (1 - alpha) upper bound of the drop: the tolerance at which
    :func:`equivalence_p` equals ``alpha`` (by bisection, to 1e-7). A bound at or below 0
    (the candidate significantly better) is given as 0.0."""
    _check_tol_alpha(0.5, alpha, "drop_upper_bound")
    _check_counts(n, regressions, improvements, "drop_upper_bound")
    return _drop_upper_bound(n, regressions, improvements, alpha)


@functools.lru_cache(maxsize=4096)
def _drop_upper_bound(n: int, x: int, y: int, alpha: float) -> float:
    if n == 0:
        return 1.0
    lo, hi = 0.0, 1.0
    if _equivalence_p(n, x, y, 1e-9) <= alpha:
        return 0.0
    while hi - lo > 1e-7:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _equivalence_p(n, x, y, mid) <= alpha else (mid, hi)
    return hi


def critical_regressions(
    n: int,
    discordant: Sequence[int] | npt.NDArray[np.int_],
    *,
    tolerance: float = TOLERANCE,
    alpha: float = ALPHA,
) -> npt.NDArray[np.int_]:
    """For each count m of discordant pairs among n, the most regressions x for which
    :func:`equivalence_p` is at most ``alpha`` (-1: none): a bucket of n pairs shows
    equivalence exactly when x <= this. The p-value grows with x at fixed n and m (more of
    the same discordant pairs are losses), so the region is ``x <= critical``; x is searched
    only while the observed drop (2x - m) / n stays below the tolerance, where an upper bound
    that lies above its own estimate can ever fall below the tolerance."""
    _check_tol_alpha(tolerance, alpha, "critical_regressions")
    return np.array([_critical(n, int(m), tolerance, alpha) for m in discordant], dtype=int)


@functools.lru_cache(maxsize=1 << 16)
def _critical(n: int, m: int, tolerance: float, alpha: float) -> int:
    if not 0 <= m <= n or n == 0:
        raise ValueError(f"critical_regressions: need 0 <= m <= n, n > 0 (got {m}, {n})")
    top = math.ceil((m + n * tolerance) / 2) - 1  # largest x with (2x - m) / n < tolerance
    if top < 0:
        return -1
    ps = _equivalence_ps(n, m, top, tolerance)
    above = np.nonzero(ps > alpha)[0]
    return int(above[0]) - 1 if above.size else len(ps) - 1


def equivalence_power(
    n: int,
    regression_rate: float,
    improvement_rate: float,
    *,
    tolerance: float = TOLERANCE,
    alpha: float = ALPHA,
) -> float:
    """Exact chance that n pairs show equivalence when each pair independently is a
    regression with probability ``regression_rate`` and an improvement with
    ``improvement_rate``: the trinomial mass of the region of :func:`critical_regressions`,
    summed over discordant counts m ~ Binomial(n, rate sum) within 8 SD (the rest is below
    1e-14) and regressions ~ Binomial(m, regression share)."""
    _check_tol_alpha(tolerance, alpha, "equivalence_power")
    psi = regression_rate + improvement_rate
    if regression_rate < 0 or improvement_rate < 0 or psi > 1:
        raise ValueError(f"equivalence_power: bad rates ({regression_rate}, {improvement_rate})")
    if n <= 0:
        return 0.0
    if psi == 0.0:
        return float(_critical(n, 0, tolerance, alpha) >= 0)
    share = regression_rate / psi
    sd = math.sqrt(n * psi * (1 - psi))
    m = np.arange(
        max(0, math.floor(n * psi - 8 * sd) - 2), min(n, math.ceil(n * psi + 8 * sd) + 2) + 1
    )
    lf = _lf(n)
    if psi < 1.0:
        log_pm = lf[n] - lf[m] - lf[n - m] + m * math.log(psi) + (n - m) * math.log1p(-psi)
        pm = np.exp(log_pm)
    else:
        pm = (m == n).astype(float)
    total = 0.0
    for mi, crit in zip(
        m, critical_regressions(n, m, tolerance=tolerance, alpha=alpha), strict=True
    ):
        if crit >= 0 and pm[mi - m[0]] > 0.0:
            total += float(pm[mi - m[0]]) * _binom_cdf(int(crit), int(mi), share)
    return min(1.0, total)


def zero_discordance_pairs(tolerance: float = TOLERANCE, alpha: float = ALPHA) -> int:
    """Fewest pairs that show equivalence when none disagrees: the least n with
    ``(1 - tolerance)^n <= alpha`` (59 at 5 points and alpha 0.05)."""
    _check_tol_alpha(tolerance, alpha, "zero_discordance_pairs")
    n = max(1, math.ceil(math.log(alpha) / math.log1p(-tolerance)) - 1)
    while _binom_cdf(0, n, tolerance) > alpha:  # the float log may be one off
        n += 1
    return n


def pairs_needed(
    regression_rate: float,
    improvement_rate: float,
    *,
    tolerance: float = TOLERANCE,
    alpha: float = ALPHA,
    power: float = POWER,
    at_least: int = MIN_PAIRS,
) -> int | None:
    """Pairs a bucket needs to show equivalence with chance ``power``, if its pairs go on
    disagreeing at the given rates (the ones seen so far).

    Exact: the n returned has :func:`equivalence_power` at least ``power`` (found by
    bisection from a normal-approximation bracket; exact power saws up and down with n, so a
    few smaller n may pass too). With no discordance the power is 0 or 1 and this is
    :func:`zero_discordance_pairs`. ``None`` when no n up to :data:`MAX_NEEDED` does: the
    drop is at or beyond the tolerance (more pairs can show a loss, never equivalence), or so
    close to it that the bucket would need more than MAX_NEEDED pairs. Never less than
    ``at_least`` (the minimum pairs, or one more than the bucket has).
    """
    _check_tol_alpha(tolerance, alpha, "pairs_needed")
    if not 0.0 < power < 1.0:
        raise ValueError(f"pairs_needed: need 0 < power < 1, got {power}")
    return _pairs_needed(
        regression_rate, improvement_rate, tolerance, alpha, power, max(1, at_least)
    )


@functools.lru_cache(maxsize=1024)
def _pairs_needed(
    r10: float, r01: float, tolerance: float, alpha: float, power: float, at_least: int
) -> int | None:
    drop = r10 - r01
    if drop >= tolerance - 1e-12 or at_least > MAX_NEEDED:  # 0.06 - 0.01 is 0.04999...
        return None
    if r10 + r01 == 0.0:
        n0 = max(at_least, zero_discordance_pairs(tolerance, alpha))
        return n0 if n0 <= MAX_NEEDED else None

    def ok(n: int) -> bool:
        return equivalence_power(n, r10, r01, tolerance=tolerance, alpha=alpha) >= power

    nd = NormalDist()
    var = r10 + r01 - drop * drop
    guess = math.ceil(
        (nd.inv_cdf(1 - alpha) + nd.inv_cdf(power)) ** 2 * var / (tolerance - drop) ** 2
    )
    lo, hi = at_least - 1, min(MAX_NEEDED, max(at_least, guess))
    while not ok(hi):
        if hi >= MAX_NEEDED:
            return None
        lo, hi = hi, min(MAX_NEEDED, math.ceil(hi * 1.5) + 10)
    while hi - lo > max(1, hi // 200):  # "about N": half a percent is close enough
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


@dataclass(frozen=True, slots=True)
class Evidence:
    """What a bucket's graded pairs settle about an FP8 drop of ``tolerance``.

    ``status``: "equivalent" (the exact one-sided bound of the drop is below the tolerance,
    with at least the minimum pairs), "loss" (the exact McNemar test finds the candidate worse
    at ``alpha``) or "open" (neither yet). ``needed`` is only given while the question is
    open and can be settled for equivalence: see :func:`pairs_needed`. ``sufficient`` is
    "not open". ``short`` is the few words a table cell shows, ``reason`` the sentence.
    """

    status: str
    sufficient: bool
    n: int
    regressions: int
    improvements: int
    needed: int | None
    p_value: float  # exact one-sided p for "the drop is at least the tolerance"
    drop_bound: float  # exact one-sided (1 - alpha) upper bound of the drop
    tolerance: float
    alpha: float
    min_pairs: int
    power: float
    short: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "sufficient": self.sufficient,
            "needed": self.needed,
            "p_value": self.p_value,
            "drop_bound": self.drop_bound,
            "rule": {
                "tolerance": self.tolerance,
                "alpha": self.alpha,
                "min_pairs": self.min_pairs,
                "power": self.power,
            },
            "short": self.short,
            "reason": self.reason,
        }


def evidence(
    n_pairs: int,
    regressions: int = 0,
    improvements: int = 0,
    *,
    tolerance: float = TOLERANCE,
    alpha: float = ALPHA,
    min_pairs: int = MIN_PAIRS,
    power: float = POWER,
    loss_alpha: float | None = None,
) -> Evidence:
    """Whether a bucket's pairs settle the question, and how many it needs while they do not.

    ``regressions``: pairs the reference passed and the candidate failed; ``improvements``:
    the reverse. A loss (exact two-sided McNemar p < ``loss_alpha``, default alpha, more
    regressions than improvements) and shown equivalence (:func:`equivalent`) both settle it
    and name no N; otherwise N is :func:`pairs_needed` at the rates seen so far (with no pair
    at all, or no disagreement yet, that is :func:`zero_discordance_pairs`: the fewest that
    could ever do). The verdict passes ``loss_alpha = alpha / phases`` for a sweep.
    """
    _check_tol_alpha(tolerance, alpha, "evidence")
    _check_counts(n_pairs, regressions, improvements, "evidence")
    if min_pairs < 0:
        raise ValueError(f"evidence: min_pairs must be >= 0, got {min_pairs}")
    x, y, n = regressions, improvements, n_pairs
    p_eq = equivalence_p(n, x, y, tolerance)
    bound = drop_upper_bound(n, x, y, alpha)
    mc = min(1.0, 2.0 * _binom_cdf_half(min(x, y), x + y))
    tol, conf = f"{100 * tolerance:g}-point", f"exact one-sided {100 * (1 - alpha):g}%"
    seen = f"{x} lost, {y} gained"
    needed: int | None = None
    if x > y and mc < (alpha if loss_alpha is None else loss_alpha):
        status, short = "loss", "loss shown"
        reason = (
            f"{n} graded pairs show a loss: {seen} (McNemar p={mc:.3g}, drop "
            f"{100 * (x - y) / n:.1f} points)"
        )
    elif n >= min_pairs and p_eq <= alpha:
        status, short = "equivalent", "within tolerance"
        reason = (
            f"{n} graded pairs ({seen}) bound the drop below the {tol} tolerance: at "
            f"most {100 * bound:.2f} points ({conf})"
        )
    else:
        status = "open"
        rates = (x / n, y / n) if n else (0.0, 0.0)
        needed = pairs_needed(
            *rates, tolerance=tolerance, alpha=alpha, power=power, at_least=max(min_pairs, n + 1)
        )
        now = (
            "no graded pairs"
            if n == 0
            else (f"{n} graded pairs ({seen}) bound the drop only below {100 * bound:.1f} points")
        )
        if needed is not None and x + y == 0:
            short = f"at least {needed} needed"
            reason = (
                f"{now}; at least {needed} needed for the {tol} tolerance ({conf}: that "
                "many pairs with no disagreement)"
            )
        elif needed is not None:
            short = f"about {needed} needed"
            reason = (
                f"{now}; about {needed} needed for the {tol} tolerance ({100 * power:g}% "
                f"chance at {conf}, if pairs keep disagreeing at the rates seen so far)"
            )
        elif (x - y) / n >= tolerance - 1e-12:
            short = f"drop so far {100 * (x - y) / n:.1f} points, not below tolerance"
            reason = (
                f"{now}; at the rates seen so far (a drop of {100 * (x - y) / n:.1f} "
                f"points, not below the {tol} tolerance) no number of pairs would show a "
                "match: more pairs will tell whether the loss is real"
            )
        else:
            short = f"more than {MAX_NEEDED} needed"
            reason = (
                f"{now}; more than {MAX_NEEDED} needed for the {tol} tolerance at the "
                "rates seen so far"
            )
    return Evidence(
        status=status,
        sufficient=status != "open",
        n=n,
        regressions=x,
        improvements=y,
        needed=needed,
        p_value=p_eq,
        drop_bound=bound,
        tolerance=tolerance,
        alpha=alpha,
        min_pairs=min_pairs,
        power=power,
        short=short,
        reason=reason,
    )
