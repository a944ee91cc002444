"""Power and sample size of the equivalence bound: how many pairs a bucket needs.

:func:`equivalence_power` is the exact chance that n pairs show equivalence
(``equivalence.equivalent``) when pairs disagree at given rates; :func:`pairs_needed` inverts it
into the "need N" that an open bucket's evidence names.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

from replay.analysis.stats.binomial import binom_cdf, log_factorials
from replay.analysis.stats.equivalence import (
    ALPHA,
    MIN_PAIRS,
    TOLERANCE,
    check_tolerance_alpha,
    equivalence_ps,
)

POWER = 0.8
"""Chance that a bucket of the size "need N" names shows equivalence, if its rates hold."""

MAX_NEEDED = 5000
"""Beyond this many pairs "need N" says "more than" instead of a number."""


def critical_regressions(
    n: int,
    discordant: Sequence[int] | npt.NDArray[np.int_],
    *,
    tolerance: float = TOLERANCE,
    alpha: float = ALPHA,
) -> npt.NDArray[np.int_]:
    """For each count m of discordant pairs among n, the most regressions x for which
    ``equivalence.equivalence_p`` is at most ``alpha`` (-1: none): a bucket of n pairs shows
    equivalence exactly when x <= this. The p-value grows with x at fixed n and m (more of
    the same discordant pairs are losses), so the region is ``x <= critical``; x is searched
    only while the observed drop (2x - m) / n stays below the tolerance, where an upper bound
    that lies above its own estimate can ever fall below the tolerance."""
    check_tolerance_alpha(tolerance, alpha, "critical_regressions")
    return np.array([_critical(n, int(m), tolerance, alpha) for m in discordant], dtype=int)


@functools.lru_cache(maxsize=1 << 16)
def _critical(n: int, m: int, tolerance: float, alpha: float) -> int:
    if not 0 <= m <= n or n == 0:
        raise ValueError(f"critical_regressions: need 0 <= m <= n, n > 0 (got {m}, {n})")
    top = math.ceil((m + n * tolerance) / 2) - 1  # largest x with (2x - m) / n < tolerance
    if top < 0:
        return -1
    ps = equivalence_ps(n, m, top, tolerance)
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
    check_tolerance_alpha(tolerance, alpha, "equivalence_power")
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
    lf = log_factorials(n)
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
            total += float(pm[mi - m[0]]) * binom_cdf(int(crit), int(mi), share)
    return min(1.0, total)


def zero_discordance_pairs(tolerance: float = TOLERANCE, alpha: float = ALPHA) -> int:
    """Fewest pairs that show equivalence when none disagrees: the least n with
    ``(1 - tolerance)^n <= alpha`` (59 at 5 points and alpha 0.05)."""
    check_tolerance_alpha(tolerance, alpha, "zero_discordance_pairs")
    n = max(1, math.ceil(math.log(alpha) / math.log1p(-tolerance)) - 1)
    while binom_cdf(0, n, tolerance) > alpha:  # the float log may be one off
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
    check_tolerance_alpha(tolerance, alpha, "pairs_needed")
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
