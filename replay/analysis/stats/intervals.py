"""Intervals: a pass rate's for one target in one bucket (Wilson), and the paired FP8 - BF16
mean difference's (percentile bootstrap over pairs).

The bootstrap is deterministic: its resamples come from ``np.random.default_rng(seed)``. Up to
``BOOT_INDEX_MAX`` pairs it resamples indices; a larger sample's interval costs what its
distinct values cost (``_interval``): at a million results, resampling a third of a
million pairs 2,000 times by index was most of the time quality and the systems comparison
took.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

from replay.analysis.stats.pairs import paired_arrays

Z95 = 1.959963984540054
"""Two-sided 95% normal quantile, the default for Wilson intervals."""

_BOOT_CHUNK = 1 << 20  # resampled indices held in memory at once by the bootstrap
# Pairs up to which the paired bootstrap resamples indices: the intervals of every run of up
# to this size are what they always were.
BOOT_INDEX_MAX = 65_536
# Distinct differences up to which a larger sample is resampled as counts of each value
# (grades differ by -1, 0 or 1; scores take a few values).
BOOT_VALUES_MAX = 256


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


def resample_indices(
    n: int, n_boot: int, rng: np.random.Generator
) -> Iterator[npt.NDArray[np.int64]]:
    """The bootstrap's resamples of n items, n_boot of them: each a row of n indices drawn
    with replacement, a chunk of rows at a time (about ``_BOOT_CHUNK`` indices held at once).
    Every bootstrap here draws its resamples this way, so one seed gives one set of draws."""
    rows = max(1, _BOOT_CHUNK // n)
    for i in range(0, n_boot, rows):
        yield rng.integers(0, n, size=(min(rows, n_boot - i), n))


def _boot_means(d: npt.NDArray[np.float64], n_boot: int, seed: int) -> npt.NDArray[np.float64]:
    """Means of n_boot resamples (with replacement) of the pair differences d."""
    rng = np.random.default_rng(seed)
    return np.concatenate([d[idx].mean(axis=1) for idx in resample_indices(d.size, n_boot, rng)])


def _interval(
    d: npt.NDArray[np.float64], n_boot: int, alpha: float, seed: int
) -> tuple[float, float]:
    """The percentile-bootstrap (1 - alpha) interval of the mean of the differences ``d``.

    Up to ``BOOT_INDEX_MAX`` pairs each resample draws n indices. Above it, with at most
    ``BOOT_VALUES_MAX`` distinct values, each resample is drawn as how often it holds each value
    (a multinomial): the same bootstrap, exact, at k values a resample instead of n indices.
    With more values (latencies) it is the normal interval, mean +- z * sd / sqrt(n), the
    bootstrap's large-sample limit: it differs from the percentile bootstrap by about
    skew / (6 sqrt n) * (z^2 - 1) standard errors, under the bootstrap's own resampling noise
    at this size even for heavy-tailed latencies
    (``test_large_sample_intervals_match_the_bootstrap``)."""
    n = d.size
    if n <= BOOT_INDEX_MAX:
        means = _boot_means(d, n_boot, seed)
    else:
        values, counts = np.unique(d, return_counts=True)
        if values.size > BOOT_VALUES_MAX:
            half = NormalDist().inv_cdf(1 - alpha / 2) * float(d.std()) / math.sqrt(n)
            mean = float(d.mean())
            return mean - half, mean + half
        draws = np.random.default_rng(seed).multinomial(n, counts / n, size=n_boot)
        means = draws @ values / n
    lo, hi = np.percentile(means, [50 * alpha, 100 - 50 * alpha])
    return float(lo), float(hi)


def cluster_ci(
    sums: Sequence[float],
    counts: Sequence[float],
    *,
    n_boot: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Percentile-bootstrap (1 - alpha) interval of ``sum(sums) / sum(counts)``, resampling
    clusters (a request with all its tokens): the interval of a per-token mean whose tokens
    are not independent within a request. It always contains the point estimate; None
    without a cluster or a token."""
    s, c = np.asarray(sums, dtype=float), np.asarray(counts, dtype=float)
    if s.size == 0 or c.sum() <= 0:
        return None
    point = float(s.sum() / c.sum())
    parts = []
    for idx in resample_indices(s.size, n_boot, np.random.default_rng(seed)):
        with np.errstate(invalid="ignore", divide="ignore"):  # a resample of 0-token clusters
            parts.append(s[idx].sum(axis=1) / c[idx].sum(axis=1))
    est = np.concatenate(parts)
    lo, hi = np.nanpercentile(est, [50 * alpha, 100 - 50 * alpha])
    return min(float(lo), point), max(float(hi), point)


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
    xa, xb = paired_arrays(a, b, "paired_bootstrap")
    if xa.size == 0:
        return None
    d = xb - xa
    diff = float(d.mean())
    lo, hi = _interval(d, n_boot, alpha, seed)
    return PairedDiff(
        n=int(d.size),
        mean_a=float(xa.mean()),
        mean_b=float(xb.mean()),
        diff=diff,
        lo=min(float(lo), diff),
        hi=max(float(hi), diff),
    )
