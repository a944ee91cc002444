"""Quality per bucket: pass rates with their intervals, the paired difference to the
reference, its noise floor, agreement and teacher-forced divergence, and what the evidence
settles, one table per phase."""

from __future__ import annotations

from typing import Any

from replay.analysis.schemas import (
    BucketQuality,
    Combined,
    Comparison,
    DerivedComparison,
    NoiseFloor,
    RuleCounts,
    RuleFloor,
    TargetQuality,
    VsReference,
)
from replay.analysis.verdict.trend import graded_text, tf_text
from replay.present.formatting import DASH, f_est, f_int, f_nll, f_p, f_pct, f_pts, num, text
from replay.present.reading import CONTROL_SUFFIX, Run
from replay.present.views import Cell, Table

QUALITY_HEADERS = [
    "Target",
    "Bucket",
    "Explicit checks: pass rate [95% Wilson] (passed/graded)",
    "Derived from the reference: pass rate [95% Wilson] (passed/graded)",
    "Δ vs reference, pts [95% CI] (every pair)",
    "Pairs (explicit + derived)",
    "McNemar p",
    "Noise floor Δ, pts [95% CI]",
    "Agreement exact / normalized",
    "First divergence (median token)",
    "Teacher-forced ΔNLL / top-1",
    "Evidence",
]


def quality_view(run: Run) -> dict[str, Any]:
    q = run.summary.quality
    tol = q.tolerance if q else None
    tables = []
    for phase, targets in run.in_order(q.phases if q else {}, "phase"):
        t = Table(QUALITY_HEADERS, caption=f"phase {phase}")
        shifts, trends = [], []
        for target, tq in run.in_order(targets, "target"):
            if target != f"{run.reference}{CONTROL_SUFFIX}":  # the control's is every floor
                trends += trend_lines(target, tq)
            for bucket, row in run.in_order(tq.buckets, "bucket"):
                t.add(*_quality_row(target, bucket, row, tol, target == run.reference))
            if tq.shift:
                shifts.append(
                    f"{target}: stratified shift across buckets "
                    f"p={f_p(tq.shift.p_value)} ({text(tq.shift.direction)})"
                )
        tables.append(
            {"table": t, "shifts": shifts, "trends": trends, "rules": _rules_table(run, phase)}
        )
    return {
        "present": bool(tables),
        "tables": tables,
        "reference": text(q.reference if q else None),
        "tolerance": f_pts(tol).lstrip("+") if tol is not None else DASH,
        "notes": list(q.notes if q else ()),
    }


def trend_lines(target: str, tq: TargetQuality) -> list[str]:
    """The target's trend across context length in words: its pass-rate difference and its
    teacher-forced ΔNLL per doubling of context, each with the A/A control's (none: the
    reference, or a summary written before the trend)."""
    t = tq.trend
    if t is None:
        return []
    return [
        graded_text(target, t.graded, t.graded_floor),
        tf_text(target, t.teacher_forced, t.teacher_forced_floor),
    ]


RULE_HEADERS = [
    "Derived rule",
    "Share of requests (graded/requests)",
    "A/A floor: control pass rate (passed/graded)",
    "Pass rate per target (passed/graded)",
    "In the verdict",
]


def _rules_table(run: Run, phase: str) -> Table | None:
    """Each derived rule's floor in the phase: what the reference scores against itself."""
    q = run.summary.quality
    rules = ((q.rules if q else None) or {}).get(phase)
    if not rules:
        return None
    t = Table(RULE_HEADERS, caption=f"phase {phase}")
    for name, f in sorted(rules.items()):
        t.add(*_rule_row(run, name, f))
    return t


def _rule_row(run: Run, name: str, f: RuleFloor) -> list[str | Cell]:
    share = f.graded / f.requests if f.requests else None
    targets = "; ".join(
        f"{target} {_counts_rate(c)}" for target, c in run.in_order(f.targets, "target")
    )
    return [
        name.removeprefix("derived:"),
        f"{f_pct(share)} ({f_int(f.graded)}/{f_int(f.requests)})",
        f"{f_pct(f.floor)} ({f_int(f.passed)}/{f_int(f.graded)})",
        targets or DASH,
        Cell("demoted: noise", "bad") if f.demoted else "yes",
    ]


def _counts_rate(c: RuleCounts) -> str:
    return f"{f_pct(c.passed / c.graded if c.graded else None)} ({c.passed}/{c.graded})"


def _quality_row(
    target: str, bucket: str, row: BucketQuality, tol: float | None, is_reference: bool
) -> list[str | Cell]:
    # What the verdict decides on: every graded pair, explicit and derived (summaries from
    # before derived grading have the explicit comparison only).
    combined = row.combined if isinstance(row.combined, Combined) else None
    vs = combined or row.vs_reference
    floor = row.noise_floor if isinstance(row.noise_floor, NoiseFloor) else None
    ag, tf = row.agreement, row.teacher_forced
    # The reference paired with itself settles nothing: no evidence (and no "need N") there.
    ev = None if is_reference else combined.evidence if combined else row.evidence
    evidence = (
        DASH
        if ev is None
        else ev.short
        if ev.short
        else ("sufficient" if ev.sufficient else f"~{f_int(ev.needed)} needed")
    )
    pairs = f_int(vs.pairs if vs else None)
    if combined:
        pairs += f" ({f_int(combined.explicit)} + {f_int(combined.derived)})"
    diff, lo, hi, p = (vs.diff, vs.lo, vs.hi, vs.mcnemar_p) if vs else (None,) * 4
    versus: list[str | Cell] = (
        [Cell("reference", "dim"), DASH, DASH]
        if is_reference
        else [Cell(f_est(diff, lo, hi, f_pts), "num " + _loss_class(vs, tol)), pairs, f_p(p)]
    )
    derived = row.derived
    return [
        target,
        bucket,
        _f_rate(row),
        _f_rate(derived) if derived and derived.graded else DASH,
        *versus,
        f_est(*((floor.diff, floor.lo, floor.hi) if floor else (None,) * 3), f_pts),
        f"{f_pct(ag.exact)} / {f_pct(ag.normalized)}",
        f_int(ag.first_divergence_median),
        f"{f_nll(tf.nll_delta_mean)} / {f_pct(tf.top1_agreement)}",
        Cell(
            evidence,
            "nowrap" + ("" if ev and ev.sufficient else " dim"),
            text(ev.reason) if ev else "",
        ),
    ]


def _f_rate(row: Comparison | DerivedComparison) -> str:
    """``60.0% [42.3, 75.4] (18/30)``."""
    lo, hi = row.wilson or (None, None)
    rate = f_pct(row.pass_rate)
    if num(lo) is not None or num(hi) is not None:
        rate += f" [{f_pct(lo).rstrip('%')}, {f_pct(hi).rstrip('%')}]"
    if not row.graded:
        return f"{rate} (none graded)"
    return f"{rate} ({f_int(row.passed)}/{f_int(row.graded)})"


def _loss_class(vs: Combined | VsReference | None, tol: float | None) -> str:
    if vs is None:
        return ""
    diff, lo, hi, p = (num(x) for x in (vs.diff, vs.lo, vs.hi, vs.mcnemar_p))
    tol = 0.05 if tol is None else tol
    if diff is not None and (
        (p is not None and p < 0.05 and diff < 0) or (hi is not None and hi < -tol)
    ):
        return "bad"
    return "good" if lo is not None and lo >= -tol else ""
