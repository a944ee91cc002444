"""Exact binomial tails, shared by the exact tests, the equivalence bound and its power.

With p = 1/2 (the null of every paired test here) the tail is summed in integers up to
:data:`EXACT_MAX` trials; any other p, and larger n, is summed in log space from a table of
log-factorials that grows in powers of two.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import numpy.typing as npt

EXACT_MAX = 4096
"""Binomial tails with at most this many trials are summed exactly in integers."""


def binom_cdf_half(m: int, n: int) -> float:
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
    """Log-space version of :func:`binom_cdf_half` for large n (lgamma + log-sum-exp)."""
    ln = math.lgamma(n + 1) - n * math.log(2.0)
    logs = np.array([ln - math.lgamma(k + 1) - math.lgamma(n - k + 1) for k in range(m + 1)])
    top = float(logs.max())
    return min(1.0, math.exp(top + math.log(float(np.exp(logs - top).sum()))))


@functools.lru_cache(maxsize=4)
def _log_factorials(size: int) -> npt.NDArray[np.float64]:
    return np.array([math.lgamma(k + 1.0) for k in range(size + 1)])


def log_factorials(n: int) -> npt.NDArray[np.float64]:
    """log k! for k = 0..n at least (grown in powers of two, so few tables are ever built)."""
    return _log_factorials(1 << max(10, (n + 1).bit_length()))


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lf, j = log_factorials(n), np.arange(k + 1)
    logs = lf[n] - lf[j] - lf[n - j] + j * math.log(p) + (n - j) * math.log1p(-p)
    return min(1.0, float(np.exp(logs).sum()))
