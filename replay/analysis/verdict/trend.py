"""The trend across context length in the verdict: a graded loss that grows with the context
is a repeatable loss; a teacher-forced divergence that grows with it is a warning.

Each phase's ``Trend`` (``schemas.trend``) becomes one ``TrendFacts``. A graded trend
*falls* when its slope per doubling of context is significantly negative (its interval below
0 and its p-value below alpha / phases, as every loss test of a sweep) and beyond the A/A
control's (below the low end of the control's interval; without a control, or where the
control has no slope, the interval alone). A teacher-forced trend *rises* the same way upwards
(above the high end of the control's interval). The stop rule (``rule``) asks for calibration
on a falling graded trend when nothing stronger decided; a rising teacher-forced one only
warns, as the per-bucket teacher-forced warnings do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from replay.analysis.schemas import LengthSlope, TargetQuality


@dataclass(frozen=True)
class TrendFacts:
    """One arm's trends in one phase, with the A/A control's (None: not measured)."""

    phase: str | None  # named only when the run has several
    graded: LengthSlope | None = None
    graded_floor: LengthSlope | None = None
    teacher_forced: LengthSlope | None = None
    teacher_forced_floor: LengthSlope | None = None


def trend_facts(per_phase: Sequence[tuple[str, TargetQuality]]) -> tuple[TrendFacts, ...]:
    """An arm's ``TrendFacts``, one per phase whose quality has a trend (a summary written
    before the trend has none)."""
    several = len(per_phase) > 1
    return tuple(
        TrendFacts(
            phase if several else None,
            t.graded,
            t.graded_floor,
            t.teacher_forced,
            t.teacher_forced_floor,
        )
        for phase, q in per_phase
        if (t := q.trend) is not None
    )


def _beyond(s: LengthSlope | None, floor: LengthSlope | None, level: float, down: bool) -> bool:
    """Whether ``s`` is significant in its direction at ``level`` and beyond the floor's
    interval (no floor, or a floor without a slope: the interval alone)."""
    if s is None or s.slope is None or s.lo is None or s.hi is None or s.p_value is None:
        return False
    significant = s.p_value < level and (s.hi < 0 if down else s.lo > 0)
    if not significant:
        return False
    if floor is None or floor.lo is None or floor.hi is None:
        return True
    return s.slope < floor.lo if down else s.slope > floor.hi


def falling(trends: Sequence[TrendFacts], level: float) -> list[TrendFacts]:
    """The phases whose graded difference falls with context length, beyond the floor."""
    return [t for t in trends if _beyond(t.graded, t.graded_floor, level, down=True)]


def rising(trends: Sequence[TrendFacts], level: float) -> list[TrendFacts]:
    """The phases whose teacher-forced ΔNLL rises with context length, beyond the floor."""
    return [t for t in trends if _beyond(t.teacher_forced, t.teacher_forced_floor, level, False)]


# -- in words: the verdict's and the report's ------------------------------------------------


def _pts(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}"


def _nll(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.3f}"


def _counted(s: LengthSlope) -> str:
    p = "" if s.p_value is None else f", p={s.p_value:.3g}"
    return f"{s.requests} requests in {s.buckets} buckets{p}"


def _floor(floor: LengthSlope | None, graded: bool) -> str:
    fmt = _pts if graded else _nll
    if floor is None:
        return "no A/A control"
    if floor.slope is None:
        return f"the A/A control's: not fitted ({floor.reason or 'no slope'})"
    own = " (its explicit checks)" if graded else ""
    return f"the A/A control's{own}: {fmt(floor.slope)} [{fmt(floor.lo)}, {fmt(floor.hi)}]"


def graded_text(name: str, s: LengthSlope | None, floor: LengthSlope | None) -> str:
    """``fp8's pass-rate difference changes by -3.1 points per doubling of context [-5.0,
    -1.2] over 240 requests in 4 buckets, p=0.002; the A/A control's: ...``."""
    if s is None or s.slope is None:
        why = "not measured" if s is None else s.reason
        return f"{name}'s pass-rate difference: no trend across context ({why})"
    return (
        f"{name}'s pass-rate difference changes by {_pts(s.slope)} points per doubling of "
        f"context [{_pts(s.lo)}, {_pts(s.hi)}] over {_counted(s)}; {_floor(floor, True)}"
    )


def tf_text(name: str, s: LengthSlope | None, floor: LengthSlope | None) -> str:
    """``fp8's teacher-forced ΔNLL changes by +0.008/token per doubling of context [+0.003,
    +0.013] over ...; the A/A control's: +0.000 [-0.001, +0.001]``."""
    if s is None or s.slope is None:
        why = "not measured" if s is None else s.reason
        return f"{name}'s teacher-forced ΔNLL: no trend across context ({why})"
    return (
        f"{name}'s teacher-forced ΔNLL changes by {_nll(s.slope)}/token per doubling of "
        f"context [{_nll(s.lo)}, {_nll(s.hi)}] over {_counted(s)}; {_floor(floor, False)}"
    )


def _in(t: TrendFacts) -> str:
    return "" if t.phase is None else f" (phase {t.phase})"


def falling_reason(name: str, t: TrendFacts) -> str:
    """The verdict's reason when a falling graded trend decides it."""
    return (
        f"a loss that grows with context length{_in(t)}: "
        f"{graded_text(name, t.graded, t.graded_floor)}"
    )


def trend_evidence(name: str, trends: Sequence[TrendFacts], level: float) -> list[dict[str, Any]]:
    """An evidence entry per falling graded trend (quality) and per rising teacher-forced one
    (a warning: the early signal, never the reason)."""
    out = [
        {"kind": "quality", "text": falling_reason(name, t), "phase": t.phase}
        for t in falling(trends, level)
    ]
    for t in rising(trends, level):
        text = (
            f"{tf_text(name, t.teacher_forced, t.teacher_forced_floor)}{_in(t)}: the "
            "reference's answers grow less likely under this target as the context grows. "
            "An early warning only: the verdict rests on the graded outcomes"
        )
        out.append({"kind": "warning", "text": text, "phase": t.phase})
    return out
