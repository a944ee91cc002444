"""Trend across context length: does a paired difference grow as the context doubles?

A per-bucket test asks whether a bucket loses; the stratified shift test (``exact_tests``)
whether the buckets lose in one direction together. Neither reads *order*: a difference that
is nil at 1K tokens, small at 8K and larger at 32K is the pattern a KV cache's rounding error
makes (it accumulates over the positions attention reads), and it is stronger evidence than a
few bad prompts. Here each request is one point: its paired difference (candidate minus
reference: a graded pair's -1/0/+1, or its teacher-forced ΔNLL per token) against log2 of its
prompt tokens, and the estimate is the least-squares slope: the change of the difference per
doubling of context.

Its interval is a percentile bootstrap stratified by bucket: each resample draws every bucket's
requests again from that bucket, as many as it holds, so the mix of lengths the trace has is
kept and only the requests within a length vary (``intervals.resample_indices`` draws them,
as every bootstrap here does; seeded). Above ``intervals.BOOT_INDEX_MAX`` requests it is that
bootstrap's large-sample limit, the slope +- z standard errors from the slope's influence
values centred within each bucket (the same stratified resampling, linearized). The p-value is
two-sided for "no trend": twice the smaller share of resampled slopes on either side of 0.

Refused (``NoTrend``, with the reason): fewer than ``MIN_TREND_PAIRS`` requests, fewer than two
buckets holding any, or one context length for every request (no slope to fit). Equal
differences everywhere (ties, identical answers) are a slope of 0 with the interval [0, 0].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

from replay.analysis.stats.intervals import BOOT_INDEX_MAX, resample_indices

# Requests below which no trend is fitted: a slope and its interval from fewer points say
# more about the points than about the cache.
MIN_TREND_PAIRS = 10
MIN_TREND_BUCKETS = 2

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class LengthTrend:
    """The slope of the paired difference against log2(prompt tokens), per doubling of
    context, with its stratified-bootstrap (1 - alpha) interval and two-sided p-value."""

    slope: float
    lo: float
    hi: float
    p_value: float
    requests: int
    buckets: int


@dataclass(frozen=True, slots=True)
class NoTrend:
    """Why no slope was fitted, and what there was."""

    reason: str
    requests: int
    buckets: int


def length_trend(
    diffs: Sequence[float],
    tokens: Sequence[float],
    buckets: Sequence[str],
    *,
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
    min_pairs: int = MIN_TREND_PAIRS,
) -> LengthTrend | NoTrend:
    """The change of ``diffs`` per doubling of ``tokens`` (request i: its difference, its
    prompt tokens, its bucket), or why there is none (module docstring)."""
    if n_boot < 1 or not 0.0 < alpha < 1.0:
        raise ValueError(
            f"length_trend: need n_boot >= 1 and 0 < alpha < 1 (got {n_boot}, {alpha})"
        )
    y, t = np.asarray(diffs, dtype=float), np.asarray(tokens, dtype=float)
    if y.ndim != 1 or y.shape != t.shape or len(buckets) != y.size:
        raise ValueError("length_trend: diffs, tokens and buckets must be flat and of one length")
    if not (np.isfinite(y).all() and np.isfinite(t).all() and (t > 0).all()):
        raise ValueError("length_trend: differences must be finite, tokens finite and positive")
    strata = _strata(buckets)
    n, k = int(y.size), len(strata)
    if n < min_pairs:
        return NoTrend(f"{n} requests: a trend needs {min_pairs}", n, k)
    if k < MIN_TREND_BUCKETS:
        return NoTrend(f"every request is in one bucket: a trend needs {MIN_TREND_BUCKETS}", n, k)
    # Centred once: the slope does not move with x's or y's origin, and centred sums keep
    # their digits (log2 of a context is 10 to 15, its spread a few units).
    x = np.log2(t)
    x, y = x - x.mean(), y - y.mean()
    sxx = float(x @ x)
    if sxx <= 0.0 or np.ptp(x) == 0.0:
        return NoTrend("every request has the same context length: no slope to fit", n, k)
    slope = float(x @ y) / sxx
    if n > BOOT_INDEX_MAX:
        lo, hi, p = _normal_limit(x, y, slope, sxx, strata, alpha)
    else:
        lo, hi, p = _bootstrap(x, y, strata, n_boot, alpha, seed)
    return LengthTrend(slope, min(lo, slope), max(hi, slope), p, n, k)


def _strata(buckets: Sequence[str]) -> list[npt.NDArray[np.intp]]:
    """Each bucket's positions, buckets in sorted order (the order of the draws)."""
    _, inverse = np.unique(np.asarray(buckets, dtype=object), return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    cuts = np.flatnonzero(np.diff(inverse[order])) + 1
    return [part.astype(np.intp) for part in np.split(order, cuts)] if order.size else []


def _bootstrap(
    x: FloatArray,
    y: FloatArray,
    strata: list[npt.NDArray[np.intp]],
    n_boot: int,
    alpha: float,
    seed: int,
) -> tuple[float, float, float]:
    """(lo, hi, p) of the slope over n_boot resamples, each bucket resampled within itself."""
    rng = np.random.default_rng(seed)
    sums = np.zeros((4, n_boot))  # per resample: sum x, sum y, sum xy, sum xx
    for at in strata:
        xh, yh, done = x[at], y[at], 0
        for idx in resample_indices(at.size, n_boot, rng):
            # Two gathers a resample (np.take: a third of fancy indexing's time on 2 cores).
            xs, ys = np.take(xh, idx), np.take(yh, idx)
            rows = slice(done, done + len(idx))
            sums[0, rows] += xs.sum(axis=1)
            sums[1, rows] += ys.sum(axis=1)
            sums[2, rows] += np.einsum("ij,ij->i", xs, ys)
            sums[3, rows] += np.einsum("ij,ij->i", xs, xs)
            done += len(idx)
    n = x.size
    sx, sy, sxy, sxx = sums
    with np.errstate(invalid="ignore", divide="ignore"):  # a resample of one length: no slope
        slopes = (sxy - sx * sy / n) / (sxx - sx * sx / n)
    slopes = slopes[np.isfinite(slopes)]
    if slopes.size == 0:
        return 0.0, 0.0, 1.0
    lo, hi = np.percentile(slopes, [50 * alpha, 100 - 50 * alpha])
    # Two-sided: each side's share counted with the observed slope among the resamples, so a
    # p-value is never 0 from finitely many of them.
    below = (int((slopes <= 0).sum()) + 1) / (slopes.size + 1)
    above = (int((slopes >= 0).sum()) + 1) / (slopes.size + 1)
    return float(lo), float(hi), min(1.0, 2 * min(below, above))


def _normal_limit(
    x: FloatArray,
    y: FloatArray,
    slope: float,
    sxx: float,
    strata: list[npt.NDArray[np.intp]],
    alpha: float,
) -> tuple[float, float, float]:
    """The stratified bootstrap's large-sample limit: slope +- z * se, where se^2 sums each
    bucket's spread of the requests' influence values x_i * residual_i / Sxx (the slope
    moves by about the resample's extra weight on request i times its influence)."""
    psi = x * (y - slope * x) / sxx
    var = sum(float(((psi[at] - psi[at].mean()) ** 2).sum()) for at in strata)
    se = math.sqrt(var)
    if se == 0.0:
        return slope, slope, 1.0 if slope == 0.0 else 0.0
    half = NormalDist().inv_cdf(1 - alpha / 2) * se
    p = 2 * NormalDist().cdf(-abs(slope) / se)
    return slope - half, slope + half, min(1.0, p)
