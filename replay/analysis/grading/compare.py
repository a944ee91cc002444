"""One target against its baseline in one bucket (or phase): explicit checks against the
reference, derived grades against the A/A control, both pooled (what the verdict decides on),
and the teacher-forced scores beside them.

Each comparison applies the paired statistics (``stats``) to pairs from ``pairing`` under the
verdict's evidence rule (``stats.rule.Rule``, the run's ``Thresholds.rule``), so grading's
evidence column says what the verdict says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from replay.analysis.grading.pairing import combined_pairs, outcomes, paired_outcomes
from replay.analysis.schemas import (
    Agreement,
    Combined,
    DerivedComparison,
    EvidenceRule,
    EvidenceSummary,
    RuleCounts,
    TeacherForced,
    VsControl,
    VsReference,
)
from replay.analysis.stats.exact_tests import McNemar, mcnemar_exact
from replay.analysis.stats.intervals import PairedDiff, cluster_ci, paired_bootstrap, wilson
from replay.analysis.stats.rule import Rule

if TYPE_CHECKING:
    import pandas as pd


def _rate(values: Iterable[bool]) -> float | None:
    v = list(values)
    return sum(v) / len(v) if v else None


def _evidence(rule: Rule, a: Sequence[bool], b: Sequence[bool]) -> EvidenceSummary:
    """What the pairs (a: baseline, b: target) settle under ``rule``, as summary.json records
    it."""
    ev = rule.paired_evidence(a, b)
    return EvidenceSummary(
        status=ev.status,
        sufficient=ev.sufficient,
        needed=ev.needed,
        p_value=ev.p_value,
        drop_bound=ev.drop_bound,
        rule=EvidenceRule(
            tolerance=ev.tolerance, alpha=ev.alpha, min_pairs=ev.min_pairs, power=ev.power
        ),
        short=ev.short,
        reason=ev.reason,
    )


@dataclass(frozen=True)
class _Paired:
    """The statistics of pairs (a: baseline, b: target): the bootstrap difference and McNemar."""

    diff: PairedDiff
    mc: McNemar

    def fields(self, baseline_only: str) -> dict[str, Any]:
        """The fields every paired record holds, its baseline's discordant count under the
        record's name for it (``baseline_only``)."""
        return {
            "pairs": self.diff.n,
            "diff": self.diff.diff,
            "lo": self.diff.lo,
            "hi": self.diff.hi,
            "mcnemar_p": self.mc.p_value,
            baseline_only: self.mc.a_only,
            "target_only": self.mc.b_only,
        }


def _paired(a: Sequence[bool], b: Sequence[bool], seed: int) -> _Paired | None:
    """None without a pair."""
    diff = paired_bootstrap([float(x) for x in a], [float(x) for x in b], seed=seed)
    return None if diff is None else _Paired(diff, mcnemar_exact(a, b))


def _pass_counts(outcome: pd.Series) -> dict[str, Any]:
    """Graded and passed answers of a column of outcomes (None: ungraded), the pass rate and
    its Wilson interval."""
    graded = outcome.dropna()
    k, n = int(graded.astype(bool).sum()), len(graded)
    return {"graded": n, "passed": k, "pass_rate": k / n if n else None, "wilson": wilson(k, n)}


def compare_explicit(
    rows: pd.DataFrame, ref: pd.DataFrame | None, rule: Rule, seed: int
) -> dict[str, Any]:
    """``Comparison``'s fields: pass rate, paired difference to the reference, McNemar,
    agreement, and ``evidence`` (whether the pairs show a loss or a drop bounded below the
    tolerance, and only while they show neither, how many pairs would)."""
    a, b = paired_outcomes(rows, ref, "passed")
    paired = _paired(a, b, seed)
    agree = rows[rows["agreed"]]
    divs = agree["divergence"].dropna().tolist()
    return {
        "answered": int(rows["answered"].sum()),
        "requests": len(rows),
        **_pass_counts(rows["passed"]),
        "vs_reference": None if paired is None else VsReference(**paired.fields("ref_only")),
        "agreement": Agreement(
            compared=len(agree),
            exact=_rate(agree["exact"].tolist()),
            normalized=_rate(agree["normalized"].tolist()),
            first_divergence_median=float(np.median(divs)) if divs else None,
        ),
        "evidence": _evidence(rule, a, b),
    }


def compare_derived(
    rows: pd.DataFrame, control: pd.DataFrame | None, seed: int
) -> DerivedComparison:
    """Derived grades of one target: pass rate, counts (by rule, ungraded, checker errors), the
    normalized exact rate beside them, and ``vs_control``: the paired comparison with the A/A
    control's derived grades of the same requests, its floor (None for the control itself, the
    reference, or when no control ran)."""
    import pandas as pd

    recs = rows[rows["rule"].notna()]
    outcome = recs["d_passed"]
    passes = _pass_counts(outcome)
    counts = (
        pd.DataFrame(
            {
                "rule": recs["rule"],
                "graded": outcome.notna(),
                "passed": outcome.eq(True),
                "ungraded": outcome.isna(),
            }
        )
        .groupby("rule")
        .sum()
    )
    vs = None
    if control is not None:
        paired = _paired(*paired_outcomes(recs, control, "d_passed"), seed)
        vs = (
            None
            if paired is None
            else VsControl(
                control_pass_rate=paired.diff.mean_a,
                pass_rate=paired.diff.mean_b,
                **paired.fields("control_only"),
            )
        )
    return DerivedComparison(
        **passes,
        ungraded=len(recs) - passes["graded"],
        checker_errors=int(recs["d_error"].sum()),
        by_rule={
            str(r): RuleCounts(
                graded=int(c["graded"]), passed=int(c["passed"]), ungraded=int(c["ungraded"])
            )
            for r, c in counts.iterrows()
        },
        exact_rate=_rate(outcomes(recs["d_exact"].dropna())),
        vs_control=vs,
    )


def compare_combined(
    rows: pd.DataFrame,
    ref: pd.DataFrame | None,
    control: pd.DataFrame | None,
    rule: Rule,
    seed: int,
    demoted: frozenset[str] = frozenset(),
) -> Combined | None:
    """The paired comparison the verdict decides on: ``combined_pairs`` under the same
    statistics and evidence rule as the explicit grades alone."""
    a, b, derived = combined_pairs(rows, ref, control, demoted)
    paired = _paired(a, b, seed)
    if paired is None:
        return None
    return Combined(
        explicit=paired.diff.n - derived,
        derived=derived,
        baseline="control" if control is not None else "pass",
        evidence=_evidence(rule, a, b),
        **paired.fields("ref_only"),
    )


def scored(s: Mapping[str, Any], base: Mapping[str, Any]) -> bool:
    """Whether a request's teacher-forced scores under a target (``s``) and the reference
    (``base``) compare: both scored without an error, the same tokens."""
    return bool(s and base and not s["error"] and not base["error"] and s["n"] == base["n"])


def teacher_forced(
    tf: Mapping[str, Mapping[str, Any]],
    tf_ref: Mapping[str, Mapping[str, Any]],
    ids: Iterable[str],
    seed: int = 0,
) -> TeacherForced:
    """Mean NLL difference per token to the reference's own scores, and top-1 agreement, with
    intervals of the same per-token means over requests resampled whole (tokens of one answer
    are not independent), the early warning the verdict reports beside the outcomes."""
    deltas: list[float] = []
    top1: list[bool] = []
    sums: list[float] = []  # per request: its answer's summed ΔNLL, top-1 hits and tokens
    hits: list[float] = []
    counts: list[int] = []
    errors = 0
    for rid in ids:
        s, base = tf.get(rid), tf_ref.get(rid)
        if s is None or base is None or not scored(s, base):
            errors += s is not None
            continue
        d = [x - y for x, y in zip(s["nll"], base["nll"], strict=True)]
        deltas.extend(d)
        top1.extend(s["top1"])
        if d:
            sums.append(float(sum(d)))
            hits.append(float(sum(map(bool, s["top1"]))))
            counts.append(len(d))
    # The point estimate is the per-token mean, so the interval is the per-token mean's too,
    # with each request resampled whole (its tokens are not independent).
    nll_ci = cluster_ci(sums, counts, seed=seed)
    top1_ci = cluster_ci(hits, counts, seed=seed)
    return TeacherForced(
        tokens=len(deltas),
        requests=len(counts),
        errors=errors,
        nll_delta_mean=float(np.mean(deltas)) if deltas else None,
        nll_delta_lo=None if nll_ci is None else nll_ci[0],
        nll_delta_hi=None if nll_ci is None else nll_ci[1],
        top1_agreement=_rate(top1),
        top1_lo=None if top1_ci is None else top1_ci[0],
        top1_hi=None if top1_ci is None else top1_ci[1],
        identical_to_reference=bool(deltas) and all(d == 0.0 for d in deltas),
    )
