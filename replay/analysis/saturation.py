"""Saturation in a load sweep: where a target's latency turns up or its throughput stops
growing (the knee), and the highest load that still meets the SLOs. Pure: a ``Summary`` in,
``Saturation`` records out.

A sweep is the run's phases whose labels name a load: ``c<N>`` (a closed loop keeping N
requests in flight) or ``poisson-<r>rps`` (an open loop sending r requests per second). Only
labels of the first load kind named count (a closed-loop level and an open-loop rate are not
points of one curve), taken in rising load. Each target gets a curve of its phase totals
("all") and one per bucket: per level its throughput, TTFT and queue-delay percentiles and,
with ``--slo``, its SLO attainment and goodput.

The knee (``KneeRule``, defaults in brackets) is the first level k, in rising load, past
which the curve bends and stays bent. Level k is the knee when, for the next level and for
every higher level j that has the figure, either

* latency turns up, in TTFT p90 or in queue-delay p90: it rose from k to j by at least
  ``min_rise`` of its value at k [50%] and at least ``min_rise_ms`` [10 ms], at a slope per
  unit load above ``slope_multiple`` [3×] the mean slope from the first level to k (taken
  as flat, zero, at the first level and wherever latency fell); or
* throughput stops growing: successful requests per second rose from k to j by less than
  ``throughput_fraction`` [25%] of the load's relative rise (at 4× the load, under +75%).

Why this shape: a server's latency is nearly flat until it saturates, then a closed loop's
climbs by about 1/throughput per request added, far more than 3× the slope before it; a
steady climb (a constant slope) is not a bend, whatever its size. The rise floors keep a few
milliseconds of jitter on a flat curve from reading as a bend (queue delay is about zero in a
closed loop), and "every higher level" keeps one noisy level from making a knee: a curve that
comes back down did not bend. The last level is never a knee, as nothing above it shows the
bend. With 3-6 levels this needs no smoothing and no fit.

The highest load meeting the SLOs is the highest level up to which every level's SLO
attainment reached the threshold [0.9]: one that meets them again after one that failed is
noise, not headroom. ``saturated`` is the question a runner asks after each level: may the
sweep stop rising? Yes once throughput fell, or a knee lies below the level just run and that
level missed the SLOs (without SLOs, a knee passed is enough).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from replay.analysis.schemas import ResultStats, Summary, TargetSummary
from replay.analysis.schemas.sweep import (
    Knee,
    LoadCurve,
    LoadPoint,
    Saturation,
    SloCeiling,
    TargetSaturation,
)

CONCURRENCY, RATE = "concurrency", "rate"
ATTAINMENT = 0.9  # the share of requests within the SLOs a level must reach to meet them
LATENCY_METRICS = (("ttft_p90_ms", "TTFT p90"), ("queue_delay_p90_ms", "queue delay p90"))
_CLOSED = re.compile(r"c(\d+)")
_OPEN = re.compile(r"poisson-(\d+(?:\.\d*)?(?:e[+-]?\d+)?)rps")


@dataclass(frozen=True)
class KneeRule:
    """The knee's thresholds (the module docstring says how they combine)."""

    slope_multiple: float = 3.0
    min_rise: float = 0.5
    min_rise_ms: float = 10.0
    throughput_fraction: float = 0.25
    # ``saturated``: throughput has fallen when a level's is this far below the best before it
    throughput_drop: float = 0.1

    def to_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)


KNEE_RULE = KneeRule()


def phase_load(label: str) -> tuple[str, float] | None:
    """The load a phase label names: ``("concurrency", N)`` for ``c<N>``, ``("rate", r)`` for
    ``poisson-<r>rps``; None for any other phase (a trace's own timing, say)."""
    if m := _CLOSED.fullmatch(label):
        n = int(m.group(1))
        return (CONCURRENCY, float(n)) if n > 0 else None
    if m := _OPEN.fullmatch(label):
        r = float(m.group(1))
        return (RATE, r) if math.isfinite(r) and r > 0 else None
    return None


def sweep_of(phase_labels: Sequence[str]) -> tuple[str, list[tuple[str, float]]] | None:
    """The sweep in ``phase_labels``: its kind and its (label, load) levels in rising load
    (a repeated load keeps its first label); None with fewer than two levels."""
    parsed = [(label, load) for label in phase_labels if (load := phase_load(label))]
    if not parsed:
        return None
    kind = parsed[0][1][0]
    levels: dict[float, str] = {}
    for label, (k, x) in parsed:
        if k == kind:
            levels.setdefault(x, label)
    if len(levels) < 2:
        return None
    return kind, [(label, x) for x, label in sorted(levels.items())]


def load_point(phase: str, load: float, stats: ResultStats, duration_s: float | None) -> LoadPoint:
    """One level of a curve, from a phase's (or a bucket's) figures and the phase's length."""
    per_s = duration_s if duration_s is not None and duration_s > 0 else None
    slo = stats.slo
    return LoadPoint(
        phase=phase,
        load=load,
        requests=stats.requests,
        ok=stats.ok,
        throughput_rps=stats.ok / per_s if per_s else None,
        throughput_out_tok_s=stats.output_tokens / per_s if per_s else None,
        ttft_p50_ms=stats.ttft_ms.p50,
        ttft_p90_ms=stats.ttft_ms.p90,
        queue_delay_p50_ms=stats.queue_delay_ms.p50,
        queue_delay_p90_ms=stats.queue_delay_ms.p90,
        slo_attainment=slo.attainment if slo else None,
        goodput_rps=slo.goodput_rps if slo else None,
    )


# -- the knee ---------------------------------------------------------------------------------


def _value(p: LoadPoint, metric: str) -> float | None:
    v = getattr(p, metric)
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def _load(p: LoadPoint) -> float:
    return p.load if p.load is not None else math.nan  # never: _levels drops such points


def _levels(points: Sequence[LoadPoint]) -> list[LoadPoint]:
    """The points that have a load (a curve read back from a file may lack one)."""
    return [p for p in points if p.load is not None and math.isfinite(p.load)]


def _latency_bend(points: Sequence[LoadPoint], k: int, metric: str, rule: KneeRule) -> bool:
    """Whether ``metric`` turns up past level k and stays up (the module docstring's rule)."""
    y_k = _value(points[k], metric)
    if y_k is None or _value(points[k + 1], metric) is None:
        return False
    below = [(_load(p), y) for p in points[:k] if (y := _value(p, metric)) is not None]
    x_k = _load(points[k])
    base = max(0.0, (y_k - below[0][1]) / (x_k - below[0][0])) if below else 0.0
    for p in points[k + 1 :]:
        y_j = _value(p, metric)
        if y_j is None:
            continue
        rise = y_j - y_k
        if rise < max(rule.min_rise * y_k, rule.min_rise_ms):
            return False
        if rise / (_load(p) - x_k) <= rule.slope_multiple * base:
            return False
    return True


def _throughput_stall(points: Sequence[LoadPoint], k: int, rule: KneeRule) -> bool:
    """Whether throughput grows by less than its share of the load's rise at every level
    past k."""
    t_k = _value(points[k], "throughput_rps")
    if t_k is None or t_k <= 0 or _value(points[k + 1], "throughput_rps") is None:
        return False
    x_k = _load(points[k])
    for p in points[k + 1 :]:
        t_j = _value(p, "throughput_rps")
        if t_j is not None and t_j / t_k - 1 >= rule.throughput_fraction * (_load(p) / x_k - 1):
            return False
    return True


def _f(v: float) -> str:
    """About three significant figures, never an exponent (3,000 ms, not 3e+03)."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _reason(points: Sequence[LoadPoint], k: int, metric: str, name: str) -> str:
    a, b = points[k], points[k + 1]
    y_a, y_b = _value(a, metric) or 0.0, _value(b, metric) or 0.0
    if metric == "throughput_rps":
        gain = y_b / y_a - 1 if y_a else 0.0
        more = _load(b) / _load(a) - 1
        return (
            f"throughput {'rose' if gain >= 0 else 'fell'} {abs(gain):.0%} "
            f"({_f(y_a)} to {_f(y_b)} req/s) for {more:.0%} more load, {a.phase} to {b.phase}"
        )
    return f"{name} rose from {_f(y_a)} to {_f(y_b)} ms, {a.phase} to {b.phase}"


def knee_of(points: Sequence[LoadPoint], rule: KneeRule = KNEE_RULE) -> Knee | None:
    """The first level past which latency turns up or throughput stops growing, for good;
    None: no knee within the sweep. ``points`` in rising load."""
    points = _levels(points)
    for k in range(len(points) - 1):
        bends = [(m, n) for m, n in LATENCY_METRICS if _latency_bend(points, k, m, rule)]
        if _throughput_stall(points, k, rule):
            bends.append(("throughput_rps", "throughput"))
        if bends:
            metric = bends[0][0]
            return Knee(
                phase=points[k].phase,
                load=points[k].load,
                metric=metric,
                reason="; ".join(_reason(points, k, m, n) for m, n in bends),
            )
    return None


# -- the SLOs, a curve, the summary -----------------------------------------------------------


def max_load_meeting_slo(
    points: Sequence[LoadPoint], attainment: float = ATTAINMENT
) -> SloCeiling | None:
    """The highest level up to which every level's SLO attainment reached ``attainment``: a
    level that meets them after one that failed is noise, not headroom. Levels without an
    attainment (nothing sent) are passed over; None when no level has one (no ``--slo``)."""
    measured = [p for p in points if p.slo_attainment is not None]
    if not measured:
        return None
    best: LoadPoint | None = None
    for p in measured:
        if p.slo_attainment is None or p.slo_attainment < attainment:
            break
        best = p
    return SloCeiling(
        attainment=attainment,
        phase=best.phase if best else None,
        load=best.load if best else None,
    )


def load_curve(
    points: Sequence[LoadPoint], attainment: float = ATTAINMENT, rule: KneeRule = KNEE_RULE
) -> LoadCurve:
    return LoadCurve(
        points=tuple(points),
        knee=knee_of(points, rule),
        max_load_meeting_slo=max_load_meeting_slo(points, attainment),
    )


def target_saturation(
    target: TargetSummary,
    levels: Sequence[tuple[str, float]],
    attainment: float = ATTAINMENT,
    rule: KneeRule = KNEE_RULE,
) -> TargetSaturation | None:
    """A target's curves over ``levels`` (label, load): the phases it ran, with requests in
    them; None when it ran none."""
    totals: list[LoadPoint] = []
    buckets: dict[str, list[LoadPoint]] = {}
    for label, load in levels:
        ph = target.phases.get(label)
        if ph is None or not ph.all.requests:
            continue
        totals.append(load_point(label, load, ph.all, ph.duration_s))
        for name, stats in ph.buckets.items():
            if stats.requests:
                buckets.setdefault(name, []).append(load_point(label, load, stats, ph.duration_s))
    if not totals:
        return None
    return TargetSaturation(
        all=load_curve(totals, attainment, rule),
        buckets={name: load_curve(pts, attainment, rule) for name, pts in buckets.items()},
    )


def saturation_of(
    summary: Summary,
    phase_labels: Sequence[str],
    attainment: float = ATTAINMENT,
    rule: KneeRule = KNEE_RULE,
) -> Saturation | None:
    """Every target's load curves over the sweep in ``phase_labels`` (the run's phases, in
    order); None when they are not a sweep (fewer than two levels of one load kind)."""
    if not 0 <= attainment <= 1:
        raise ValueError(f"attainment must be within 0 and 1, not {attainment}")
    sweep = sweep_of(phase_labels)
    if sweep is None:
        return None
    kind, levels = sweep
    # A target that ran fewer than two of the levels has no curve (a Locust test of one).
    targets = {
        name: curves
        for name, target in summary.targets.items()
        if (curves := target_saturation(target, levels, attainment, rule)) is not None
        and len(curves.all.points) >= 2
    }
    if not targets:
        return None
    return Saturation(
        kind=kind,
        phases=tuple(label for label, _ in levels),
        attainment=attainment,
        rule=rule.to_json(),
        targets=targets,
    )


def saturated(
    curve: LoadCurve | TargetSaturation,
    attainment: float = ATTAINMENT,
    rule: KneeRule = KNEE_RULE,
) -> bool:
    """Whether a sweep may stop rising for this target, given the levels it has run (a
    ``TargetSaturation`` is judged on its totals): True when its throughput fell (the last
    level's is ``rule.throughput_drop`` below the best before it), or when a knee lies below
    the last level and that level missed the SLOs (attainment under ``attainment``); a run
    without SLOs stops at a knee passed. Fewer than two levels are never saturated."""
    points = _levels((curve.all if isinstance(curve, TargetSaturation) else curve).points)
    if len(points) < 2:
        return False
    last = points[-1]
    before = [t for p in points[:-1] if (t := _value(p, "throughput_rps")) is not None]
    now = _value(last, "throughput_rps")
    if before and now is not None and now < (1 - rule.throughput_drop) * max(before):
        return True
    if knee_of(points, rule) is None:  # a knee is never the last level: it lies below it
        return False
    return last.slo_attainment is None or last.slo_attainment < attainment
