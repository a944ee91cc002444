"""Always-valid evidence about a bucket's paired drop: betting capital, its confidence sequence
and how many pairs it would take to decide.

Each pair of grades is one ``Z = ref_pass - cand_pass`` in {-1, 0, 1}: +1 a regression (the
reference passed, the candidate failed), -1 an improvement, 0 agreement. The drop is
``E[Z] = P(ref pass) - P(cand pass)`` in [-1, 1]. To test "the drop is at most m" a bettor
starts with capital 1 and stakes a fraction of it on every pair, winning when the pair is a
regression; with a bet that is fair whenever the null holds, the capital is a nonnegative
supermartingale under it, so by Ville's inequality it ever reaches ``1 / alpha`` with
probability at most alpha, however often it is looked at (Waudby-Smith & Ramdas 2024,
"Estimating means of bounded random variables by betting", JRSS B 86(1):1-27: the capital
process ``prod(1 + lambda (Z_i - m))``; the same for "at least m" with the sign turned).

What is implemented is a *mixture* of those capital processes over a fixed grid of constant
bets (Robbins' method of mixtures, Cover's universal portfolio; Waudby-Smith & Ramdas average
capital processes over a grid of bets too), not their predictable plug-in bets: with the bet
fraction ``c`` of the largest fair stake fixed, each bet's capital depends on the counts alone
(pairs, regressions, improvements), so the evidence is the same whatever the order of the pairs
and whatever rounds they came in, and the counts are all a resumed run needs. An average of test
supermartingales is one, so the mixture keeps the level exactly, with no approximation. Each
bet's capital is monotone in m, so the values of m the mixture does not reject form an interval
(:func:`lower_bound`, :func:`upper_bound`). The weights on the grid, proportional to
``c (1 - c)^(1/2)`` (a Beta(2, 3/2) shape), put little weight on bets too timid to matter and on
bets so bold that one pair the wrong way ruins them; they were chosen on the simulation
(``bench/sequential_sim.py``) over uniform weights, which need about 5% more pairs at no drop.

:func:`pairs_to_cross` projects, at the rates seen so far, when the capital would reach its
threshold. Everything here is pure and vectorised over numpy arrays of counts.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import numpy.typing as npt

Side = Literal["above", "below"]
"""``above``: evidence that the drop is above m (null "drop <= m"); ``below``: that it is
below m (null "drop >= m")."""

BETS = 64
"""Constant bets in the mixture: fractions ``c = (d - 1/2) / BETS`` of the largest fair stake."""

MAX_PROJECTED = 100_000
"""Beyond this many pairs a projection says "more than" instead of a number."""

_C = (np.arange(BETS) + 0.5) / BETS
_W = _C * np.sqrt(1.0 - _C)
_LOG_W = np.log(_W / _W.sum())
_EDGE = 1e-12  # m stays inside (-1, 1), where every fair stake is finite

Counts = int | float | npt.NDArray[np.float64] | npt.NDArray[np.int_]


def _factors(m: float, side: Side) -> npt.NDArray[np.float64]:
    """log of each bet's capital multiplier for a regression, an improvement and an agreeing
    pair (rows), per bet (columns).

    For "above m" the stake on a pair is ``lambda (Z - m)`` with ``lambda = c / (1 + m)``, the
    largest that a run of improvements (Z = -1) cannot take below zero: the multiplier is
    ``(1 - c) + c (1 + Z) / (1 + m)``, decreasing in m. "Below m" mirrors it with
    ``lambda = c / (1 - m)`` and ``(1 - c) + c (1 - Z) / (1 - m)``, increasing in m.
    """
    m = min(1.0 - _EDGE, max(-1.0 + _EDGE, m))
    if side == "above":
        u = 1.0 / (1.0 + m)
        rows = (np.log1p(_C * (2 * u - 1)), np.log1p(-_C), np.log1p(_C * (u - 1)))
    else:
        v = 1.0 / (1.0 - m)
        rows = (np.log1p(-_C), np.log1p(_C * (2 * v - 1)), np.log1p(_C * (v - 1)))
    return np.stack(rows)


def log_capital(
    n: Counts, regressions: Counts, improvements: Counts, m: float, side: Side
) -> npt.NDArray[np.float64]:
    """log of the mixture capital after ``n`` pairs with the given counts (arrays broadcast).

    Its exponential is an e-value for the side's null: at most ``1 / alpha`` with probability
    ``1 - alpha`` at every n at once, when the null holds. Counts may be fractional (a
    projection of expected counts).
    """
    x = np.asarray(regressions, dtype=float)[..., None]
    y = np.asarray(improvements, dtype=float)[..., None]
    z = np.asarray(n, dtype=float)[..., None] - x - y
    f = _factors(m, side)
    terms = _LOG_W + x * f[0] + y * f[1] + z * f[2]
    top = terms.max(axis=-1, keepdims=True)
    out: npt.NDArray[np.float64] = (top + np.log(np.exp(terms - top).sum(-1, keepdims=True)))[
        ..., 0
    ]
    return out


def threshold(alpha: float) -> float:
    """The log capital at which the side's null is rejected at level alpha (Ville)."""
    return math.log(1.0 / alpha)


def rejects(
    n: Counts, regressions: Counts, improvements: Counts, m: float, side: Side, alpha: float
) -> npt.NDArray[np.bool_]:
    """Does the capital reach ``1 / alpha`` (reject the side's null at m)?"""
    return log_capital(n, regressions, improvements, m, side) >= threshold(alpha)


def _capital_at(n: int, x: int, y: int, m: float, side: Side) -> float:
    return float(log_capital(n, x, y, m, side))


def lower_bound(n: int, regressions: int, improvements: int, alpha: float) -> float:
    """The confidence sequence's lower end at level alpha: the largest m (to 1e-9) whose null
    "drop <= m" the "above" capital rejects, -1.0 where none is. The capital decreases in m,
    so bisection finds the edge; 0 is its first probe, so the bound is >= 0 exactly when
    "drop <= 0" is rejected."""
    a = threshold(alpha)
    lo, hi = -1.0, 1.0
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        if _capital_at(n, regressions, improvements, mid, "above") >= a:
            lo = mid
        else:
            hi = mid
    return lo


def upper_bound(n: int, regressions: int, improvements: int, alpha: float) -> float:
    """The confidence sequence's upper end at level alpha: the smallest m (to 1e-9) whose null
    "drop >= m" the "below" capital rejects, 1.0 where none is."""
    a = threshold(alpha)
    lo, hi = -1.0, 1.0
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        if _capital_at(n, regressions, improvements, mid, "below") >= a:
            hi = mid
        else:
            lo = mid
    return hi


def pairs_to_cross(
    rates: tuple[float, float], m: float, side: Side, alpha: float, at_least: int = 1
) -> int | None:
    """Fewest pairs (at least ``at_least``) whose expected counts at these (regression,
    improvement) rates put the capital at its threshold; ``None`` if none up to
    :data:`MAX_PROJECTED` do.

    Along expected counts ``(N r10, N r01)`` the log capital is a log-sum-exp of lines in N
    through 0, hence convex with value 0 at N = 0: once above the (positive) threshold it stays
    above, so bisection finds the first N. It only rises at all if some bet grows on average,
    which is when the rates put the drop on the rejecting side of m.
    """
    r10, r01 = rates
    a = threshold(alpha)
    growth = _factors(m, side).T @ np.array([r10, r01, 1.0 - r10 - r01])

    def crossed(big_n: int) -> bool:
        return float(np.logaddexp.reduce(_LOG_W + big_n * growth)) >= a

    at_least = max(1, at_least)
    if growth.max() <= 0.0 or not crossed(MAX_PROJECTED):
        return None
    if crossed(at_least):
        return at_least
    lo, hi = at_least, MAX_PROJECTED
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if crossed(mid) else (mid, hi)
    return hi
