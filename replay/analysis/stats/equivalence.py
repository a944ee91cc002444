"""Is a bucket's FP8 drop shown to be below the tolerance? The exact one-sided bound.

The rule KEEP rests on, and grading's evidence column with it: at least :data:`MIN_PAIRS`
graded pairs, and an exact one-sided bound at :data:`ALPHA` (:func:`equivalence_p`, the melded
bound of Fay & Lumbard) that puts the drop below :data:`TOLERANCE`. :func:`equivalent` applies
it; :func:`drop_upper_bound` gives the bound itself.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import numpy.typing as npt

from replay.analysis.stats.binomial import binom_cdf, log_factorials

TOLERANCE = 0.05
"""Largest acceptable FP8 - BF16 pass-rate drop per bucket (0.05 = 5 points)."""

ALPHA = 0.05
"""Level of every test here: a loss, and the one-sided bound that shows a drop is smaller."""

MIN_PAIRS = 20
"""Graded pairs a bucket needs before its evidence counts at all."""

_GL_X, _GL_W = np.polynomial.legendre.leggauss(16)
_PANELS = 8  # panels of 16 Gauss-Legendre nodes (half once T is near normal): 1e-7 of 64 panels


def check_tolerance_alpha(tolerance: float, alpha: float, what: str) -> None:
    """``what`` names the caller in the error: every public function here checks its rule."""
    if not 0.0 < tolerance < 1.0 or not 0.0 < alpha < 0.5:
        raise ValueError(
            f"{what}: need 0 < tolerance < 1 and 0 < alpha < 0.5 (got {tolerance}, {alpha})"
        )


def _check_tolerance(tolerance: float, what: str) -> None:
    if not 0.0 < tolerance < 1.0:
        raise ValueError(f"{what}: need 0 < tolerance < 1, got {tolerance}")


def check_counts(n: int, regressions: int, improvements: int, what: str) -> None:
    """A bucket's discordant counts must fit in its pairs."""
    if regressions < 0 or improvements < 0 or regressions + improvements > n:
        raise ValueError(
            f"{what}: need 0 <= regressions + improvements <= n (got "
            f"{regressions} + {improvements} of {n})"
        )


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
    lf = log_factorials(n)
    log_density = m * np.log(s) + (n - m - 1) * np.log1p(-s) - (lf[m] + lf[n - m - 1] - lf[n])
    return s, w * np.exp(log_density)


def equivalence_ps(
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
        return np.array([binom_cdf(0, n, tolerance)])
    lf, j = log_factorials(max(n, m)), np.arange(top + 1)
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
        out[m] = binom_cdf(m, n, tolerance)
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
    the bound never contradicts ``exact_tests.mcnemar_exact``. Fay & Lumbard conjecture, from
    extensive numerical checks, that the test never exceeds its level; this project checks it
    too: the exact size at a true drop of exactly ``tolerance``
    (tests/unit/analysis/test_stats.py) and a simulation
    (tests/unit/analysis/test_evidence_simulation.py, figures in docs/canary.md).
    """
    _check_tolerance(tolerance, "equivalence_p")
    check_counts(n, regressions, improvements, "equivalence_p")
    return _equivalence_p(n, regressions, improvements, tolerance)


@functools.lru_cache(maxsize=4096)
def _equivalence_p(n: int, x: int, y: int, tolerance: float) -> float:
    if n == 0:
        return 1.0
    return float(equivalence_ps(n, x + y, x, tolerance)[x])


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
    check_tolerance_alpha(tolerance, alpha, "equivalent")
    return n >= min_pairs and equivalence_p(n, regressions, improvements, tolerance) <= alpha


def drop_upper_bound(n: int, regressions: int, improvements: int, alpha: float = ALPHA) -> float:
    """The one-sided (1 - alpha) upper bound of the drop: the tolerance at which
    :func:`equivalence_p` equals ``alpha`` (by bisection, to 1e-7). A bound at or below 0
    (the candidate significantly better) is given as 0.0."""
    check_tolerance_alpha(0.5, alpha, "drop_upper_bound")
    check_counts(n, regressions, improvements, "drop_upper_bound")
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
