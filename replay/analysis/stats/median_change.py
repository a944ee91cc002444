"""A paired relative change with a distribution-free interval: how much longer (or shorter) the
candidate took than the reference on the same request, as the median over requests of
log(candidate / reference).

Latency on a shared machine has stragglers (a garbage collection, a neighbour's burst, a read
that coalesced several chunks), so neither a mean nor a normal-theory interval fits it. The
interval here is the sign test's: with the per-pair log ratios sorted, d(1) <= ... <= d(n),
``[d(k), d(n+1-k)]`` covers their median with probability at least
``1 - 2 P(Binomial(n, 1/2) <= k - 1)`` whatever their distribution (independent pairs, a
continuous distribution), so the level holds exactly for heavy tails and for a handful of
pairs alike. Too few pairs for that level give no interval at all: one pair is a point, never
evidence (``min_pairs``). Working on log ratios makes "5% slower" and "5% faster" mirror
images (a ratio of 1.05 and of 1/1.05).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from replay.analysis.stats.binomial import log_factorials


@dataclass(frozen=True, slots=True)
class Change:
    """The median log ratio over ``n`` pairs and its interval (None: too few pairs)."""

    n: int
    median: float
    lo: float | None
    hi: float | None


@functools.lru_cache(maxsize=4096)
def order_rank(n: int, miss: float) -> int:
    """The largest k >= 1 with ``2 P(Binomial(n, 1/2) <= k - 1) <= miss``: the order statistics
    d(k), d(n+1-k) then bound the median at level ``1 - miss``; 0 when even the extremes do
    not (too few pairs)."""
    if n < 1 or not 0.0 < miss < 1.0:
        return 0
    lf, j = log_factorials(n), np.arange(n + 1)
    pmf = np.exp(lf[n] - lf[j] - lf[n - j] - n * math.log(2.0))
    tails = 2.0 * np.cumsum(pmf)  # tails[m] = 2 P(X <= m)
    within = np.flatnonzero(tails[: (n + 1) // 2] <= miss * (1.0 + 1e-12))
    return int(within[-1]) + 1 if within.size else 0


def min_pairs(miss: float) -> int:
    """The fewest pairs that give an interval at level ``1 - miss``: 2 / 2^n <= miss."""
    return max(1, math.ceil(math.log2(2.0 / miss) - 1e-12))


def log_ratios(reference: Sequence[float], candidate: Sequence[float]) -> npt.NDArray[np.float64]:
    """log(candidate / reference) of the pairs where both values are positive: a latency of
    0 (nothing measured, or chunks whose arrival times coalesced) is no measurement."""
    a = np.asarray(reference, dtype=float)
    b = np.asarray(candidate, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"log_ratios: {a.size} reference values but {b.size} candidate values")
    keep = (a > 0) & (b > 0) & np.isfinite(a) & np.isfinite(b)
    out: npt.NDArray[np.float64] = np.log(b[keep] / a[keep])
    return out


def median_change(d: Sequence[float] | npt.NDArray[np.float64], miss: float) -> Change | None:
    """The median of the log ratios ``d`` with its interval at level ``1 - miss``; None
    without pairs."""
    x = np.sort(np.asarray(d, dtype=float))
    n = int(x.size)
    if n == 0:
        return None
    k = order_rank(n, miss)
    med = float(np.median(x))
    if k == 0:
        return Change(n, med, None, None)
    return Change(n, med, float(x[k - 1]), float(x[n - k]))


def median_changes(
    d: npt.NDArray[np.float64], miss: float
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """``median_change`` along the last axis of an array of log ratios (many simulated cells
    of n pairs each at once): (median, lo, hi); lo and hi are NaN when n is too small."""
    x = np.sort(d, axis=-1)
    n = x.shape[-1]
    k = order_rank(n, miss)
    med = np.median(x, axis=-1)
    if k == 0:
        nan = np.full(med.shape, np.nan)
        return med, nan, nan.copy()
    return med, x[..., k - 1], x[..., n - k]
