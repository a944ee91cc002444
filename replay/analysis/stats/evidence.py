"""What a bucket's graded pairs settle, in numbers and in words: a loss, a drop shown below
the tolerance, or neither yet, and then how many pairs would settle it.

:func:`evidence` is the one reading behind grading's evidence column, the report and the
verdict: a loss is exact McNemar (``exact_tests``), a match the exact one-sided bound
(``equivalence``), and "need N" exact power (``power``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from replay.analysis.stats.equivalence import (
    ALPHA,
    MIN_PAIRS,
    TOLERANCE,
    check_counts,
    check_tolerance_alpha,
    drop_upper_bound,
    equivalence_p,
)
from replay.analysis.stats.exact_tests import mcnemar_p
from replay.analysis.stats.power import MAX_NEEDED, POWER, pairs_needed


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
    regressions than improvements) and shown equivalence (``equivalence.equivalent``) both
    settle it and name no N; otherwise N is ``power.pairs_needed`` at the rates seen so far
    (with no pair at all, or no disagreement yet, that is ``power.zero_discordance_pairs``:
    the fewest that could ever do). The verdict passes ``loss_alpha = alpha / phases`` for a
    sweep.
    """
    check_tolerance_alpha(tolerance, alpha, "evidence")
    check_counts(n_pairs, regressions, improvements, "evidence")
    if min_pairs < 0:
        raise ValueError(f"evidence: min_pairs must be >= 0, got {min_pairs}")
    x, y, n = regressions, improvements, n_pairs
    p_eq = equivalence_p(n, x, y, tolerance)
    bound = drop_upper_bound(n, x, y, alpha)
    mc = mcnemar_p(x, y)
    needed: int | None = None
    if x > y and mc < (alpha if loss_alpha is None else loss_alpha):
        status, short = "loss", "loss shown"
        reason = (
            f"{n} graded pairs show a loss: {_seen(x, y)} (McNemar p={mc:.3g}, drop "
            f"{100 * (x - y) / n:.1f} points)"
        )
    elif n >= min_pairs and p_eq <= alpha:
        status, short = "equivalent", "within tolerance"
        reason = (
            f"{n} graded pairs ({_seen(x, y)}) bound the drop below the {_tol(tolerance)} "
            f"tolerance: at most {100 * bound:.2f} points ({_conf(alpha)})"
        )
    else:
        status = "open"
        rates = (x / n, y / n) if n else (0.0, 0.0)
        needed = pairs_needed(
            *rates, tolerance=tolerance, alpha=alpha, power=power, at_least=max(min_pairs, n + 1)
        )
        short, reason = _open_words(n, x, y, needed, bound, tolerance, alpha, power)
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


def _seen(x: int, y: int) -> str:
    return f"{x} lost, {y} gained"


def _tol(tolerance: float) -> str:
    return f"{100 * tolerance:g}-point"


def _conf(alpha: float) -> str:
    return f"exact one-sided {100 * (1 - alpha):g}%"


def _open_words(
    n: int,
    x: int,
    y: int,
    needed: int | None,
    bound: float,
    tolerance: float,
    alpha: float,
    power: float,
) -> tuple[str, str]:
    """(short, reason) of a bucket its pairs do not settle yet: how many would, or why no
    number of pairs at these rates would show a match."""
    tol, conf = _tol(tolerance), _conf(alpha)
    now = (
        "no graded pairs"
        if n == 0
        else (
            f"{n} graded pairs ({_seen(x, y)}) bound the drop only below {100 * bound:.1f} points"
        )
    )
    if needed is not None and x + y == 0:
        return f"at least {needed} needed", (
            f"{now}; at least {needed} needed for the {tol} tolerance ({conf}: that "
            "many pairs with no disagreement)"
        )
    if needed is not None:
        return f"about {needed} needed", (
            f"{now}; about {needed} needed for the {tol} tolerance ({100 * power:g}% "
            f"chance at {conf}, if pairs keep disagreeing at the rates seen so far)"
        )
    if (x - y) / n >= tolerance - 1e-12:
        return f"drop so far {100 * (x - y) / n:.1f} points, not below tolerance", (
            f"{now}; at the rates seen so far (a drop of {100 * (x - y) / n:.1f} "
            f"points, not below the {tol} tolerance) no number of pairs would show a "
            "match: more pairs will tell whether the loss is real"
        )
    return f"more than {MAX_NEEDED} needed", (
        f"{now}; more than {MAX_NEEDED} needed for the {tol} tolerance at the rates seen so far"
    )
