"""The load section: a sweep's latency against load per target (the knee marked), throughput,
SLO attainment and goodput at each level, and per bucket the knee and the highest load that
still met the SLOs (``analysis.saturation``). Absent when the run's phases are not a sweep."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from replay.analysis.schemas.sweep import LoadCurve, LoadPoint, Saturation, SloCeiling
from replay.present.charts import Chart, Curve, Mark, curve_chart
from replay.present.formatting import DASH, f_pct, f_sig, num
from replay.present.reading import Run
from replay.present.views import Cell, Table

ALL = "all"  # the phase totals, beside the buckets
KINDS = {"concurrency": ("Concurrency", "in flight"), "rate": ("Rate (req/s)", "req/s")}
P50_DASH = "2 2"  # the p50 line; the p90 line is solid


def load_view(run: Run) -> dict[str, Any] | None:
    sat = run.summary.saturation
    if sat is None or not sat.targets:
        return None
    names = [name for name, _ in run.in_order(sat.targets, "target")]
    buckets = {b: None for t in sat.targets.values() for b in t.buckets}
    groups = [ALL, *(b for b, _ in run.in_order(buckets, "bucket"))]
    has_slo = any(
        p.slo_attainment is not None
        for t in sat.targets.values()
        for c in (t.all, *t.buckets.values())
        for p in c.points
    )
    charts = [_chart(run, sat, names, g) for g in groups]
    totals = _curve_table(sat, "Target", has_slo, [(n, sat.targets[n].all) for n in names])
    totals.caption = "All requests of each phase"
    per_target = [
        (name, _curve_table(sat, "Bucket", has_slo, run.in_order(t.buckets, "bucket")))
        for name in names
        if (t := sat.targets[name]).buckets
    ]
    return {
        "note": _rule_note(sat),
        "charts": [c for c in charts if c],
        "knees": _knee_table(sat, names, groups, has_slo),
        "totals": totals,
        "buckets": [{"target": name, "table": table} for name, table in per_target],
    }


def _curve(sat: Saturation, name: str, group: str) -> LoadCurve | None:
    target = sat.targets.get(name)
    if target is None:
        return None
    return target.all if group == ALL else target.buckets.get(group)


def _where(group: str) -> str:
    return "all requests" if group == ALL else f"bucket {group}"


def _chart(run: Run, sat: Saturation, names: Sequence[str], group: str) -> Chart | None:
    """TTFT p90 (solid) and p50 (dashed) against load, a line per target, its knee marked."""
    curves: list[Curve] = []
    marks: list[Mark] = []
    for name in names:
        curve = _curve(sat, name, group)
        if curve is None:
            continue
        color = run.color(name)
        pts = [(x, p) for p in curve.points if (x := num(p.load)) is not None]
        curves += [
            (f"{name} p90", color, "", [(x, num(p.ttft_p90_ms)) for x, p in pts]),
            (f"{name} p50", color, P50_DASH, [(x, num(p.ttft_p50_ms)) for x, p in pts]),
        ]
        knee = curve.knee
        if knee is not None and (x := num(knee.load)) is not None:
            marks.append((x, color, f"{name} knee {knee.phase}"))
    return curve_chart(
        curves,
        marks,
        _kind(sat)[1],
        "ms",
        f"TTFT p90 (solid) and p50 (dashed) against load, {_where(group)}",
    )


def _kind(sat: Saturation) -> tuple[str, str]:
    return KINDS.get(sat.kind, ("Load", "load"))


def _f_load(x: object) -> str:
    v = num(x)
    return DASH if v is None else f"{v:,.6g}"


def _f_ceiling(c: SloCeiling | None) -> str:
    if c is None:
        return DASH
    return "none met them" if c.phase is None else f"{c.phase} ({_f_load(c.load)})"


def _curve_table(
    sat: Saturation, first: str, has_slo: bool, curves: Sequence[tuple[str, LoadCurve]]
) -> Table:
    """Each curve's levels: throughput, latency and, with SLOs, attainment and goodput; the
    knee's row and the SLOs' ceiling say so in the last column."""
    slo_cols = ["SLO attainment", "Goodput (req/s)"] if has_slo else []
    t = Table(
        [
            first,
            _kind(sat)[0],
            "Phase",
            "Throughput (req/s)",
            "Output tok/s",
            "TTFT p50 / p90 (ms)",
            "Queue delay p90 (ms)",
            *slo_cols,
            "Note",
        ]
    )
    for label, curve in curves:
        for p in curve.points:
            t.add(label, _f_load(p.load), p.phase, *_point_cells(p, has_slo), _note(curve, p))
    return t


def _point_cells(p: LoadPoint, has_slo: bool) -> list[str]:
    cells = [
        f_sig(p.throughput_rps),
        f_sig(p.throughput_out_tok_s),
        f"{f_sig(p.ttft_p50_ms)} / {f_sig(p.ttft_p90_ms)}",
        f_sig(p.queue_delay_p90_ms),
    ]
    return [*cells, f_pct(p.slo_attainment), f_sig(p.goodput_rps)] if has_slo else cells


def _note(curve: LoadCurve, p: LoadPoint) -> Cell:
    at_knee = curve.knee is not None and curve.knee.phase == p.phase
    ceiling = curve.max_load_meeting_slo
    notes = ["knee"] if at_knee else []
    if ceiling is not None and ceiling.phase == p.phase:
        notes.append("highest meeting the SLOs")
    return Cell("; ".join(notes), "", curve.knee.reason if at_knee and curve.knee else "")


def _knee_table(
    sat: Saturation, names: Sequence[str], groups: Sequence[str], has_slo: bool
) -> Table:
    share = num(sat.attainment)
    slo_col = [f"Highest load meeting the SLOs (≥ {f_pct(share)} within them)"] if has_slo else []
    t = Table(["Target", "Bucket", "Knee", "What bent", *slo_col])
    for name in names:
        for group in groups:
            curve = _curve(sat, name, group)
            if curve is None:
                continue
            knee = curve.knee
            where = f"{knee.phase} ({_f_load(knee.load)})" if knee else "no knee within the sweep"
            slo = [_f_ceiling(curve.max_load_meeting_slo)] if has_slo else []
            t.add(name, group, where, knee.reason if knee else DASH, *slo)
    return t


def _rule_note(sat: Saturation) -> str:
    rule: Mapping[str, float] = sat.rule

    def get(key: str, default: float) -> float:
        v = num(rule.get(key))
        return default if v is None else v

    return (
        f"Phases {', '.join(sat.phases) or DASH} in rising load. The knee is the last level "
        "before the curve bends for good: TTFT or queue-delay p90 rises at least "
        f"{get('min_rise', 0.5):.0%} and {get('min_rise_ms', 10.0):g} ms at over "
        f"{get('slope_multiple', 3.0):g}× the slope below it, or throughput grows by less than "
        f"{get('throughput_fraction', 0.25):.0%} of the load's rise, at every higher level."
    )
