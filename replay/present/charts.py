"""Inline SVG charts as lists of plain shapes: box plots, bar charts, a usage line over
time and curves of latency against load. A chart is data (``Chart`` of ``Shape``s) that the
template draws, so every label in it is escaped like any other text; nothing here writes
markup.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from replay.present.formatting import f_int, f_sig


@dataclass(frozen=True)
class Shape:
    """One SVG element: rect, line, text or poly (a polyline)."""

    kind: str
    x: float = 0.0
    y: float = 0.0
    w: float = 0.0
    h: float = 0.0
    x2: float = 0.0
    y2: float = 0.0
    color: str = "#334155"
    opacity: float = 1.0
    text: str = ""
    anchor: str = "start"
    size: int = 11
    bold: bool = False
    points: str = ""
    dash: str = ""
    title: str = ""


@dataclass
class Chart:
    width: int
    height: int
    label: str
    shapes: list[Shape]


def _axis(hi: float, n: int = 5) -> tuple[float, list[float]]:
    """A round upper bound >= hi and its ticks."""
    hi = hi if hi > 0 else 1.0
    mag = 10 ** math.floor(math.log10(hi / n))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= hi / n)
    top = math.ceil(hi / step - 1e-9) * step
    return top, [i * step for i in range(round(top / step) + 1)]


def _xaxis(
    x0: float, x1: float, y: float, top: float, ticks: Sequence[float], unit: str, y_top: float
) -> list[Shape]:
    out = []
    for t in ticks:
        x = round(x0 + (x1 - x0) * t / top, 1)
        out += [
            Shape("line", x, y_top, x2=x, y2=y, color="#e2e8f0"),
            Shape("text", x, y + 14, text=f"{t:,.6g}", anchor="middle", size=10, color="#64748b"),
        ]
    return [*out, Shape("text", x1, y + 28, text=unit, anchor="end", size=10, color="#64748b")]


BoxRow = tuple[str, str, Sequence[float]]  # (label, color, values)


def box_chart(
    groups: Sequence[tuple[str, Sequence[BoxRow]]],
    unit: str,
    label: str,
) -> Chart | None:
    """Horizontal box plots (box p25-p75, median, whiskers p5-p95), one row per label, in
    groups (buckets). None when there is nothing to draw."""
    stats = [(g, [(name, color, _quantiles(v)) for name, color, v in rows]) for g, rows in groups]
    highs = [q[4] for _, rows in stats for _, _, q in rows if q]
    if not highs:
        return None
    top, ticks = _axis(max(highs))
    left, right, row_h, width = 200.0, 760.0, 20, 960
    y, shapes = 6.0, []
    for group, rows in stats:
        shapes.append(Shape("text", 4, y + 13, text=group, bold=True))
        y += row_h
        for name, color, q in rows:
            shapes += _box_row(name, color, q, y, left, right, top, unit)
            y += row_h
    shapes = _xaxis(left, right, y + 4, top, ticks, unit, 6) + shapes
    return Chart(width, int(y + 40), label, shapes)


def _quantiles(values: Sequence[float]) -> tuple[float, ...] | None:
    if not len(values):
        return None
    return tuple(float(v) for v in np.percentile(np.asarray(values, float), (5, 25, 50, 75, 95)))


def _box_row(
    name: str,
    color: str,
    q: tuple[float, ...] | None,
    y: float,
    left: float,
    right: float,
    top: float,
    unit: str,
) -> list[Shape]:
    out = [Shape("text", 20, y + 14, text=name, color=color)]
    if q is None:
        return [*out, Shape("text", left, y + 14, text="no data", color="#94a3b8")]

    def sx(v: float) -> float:
        return round(left + (right - left) * min(v, top) / top, 1)

    tip = (
        f"{name}: p5 {f_sig(q[0])}, p25 {f_sig(q[1])}, median {f_sig(q[2])}, "
        f"p75 {f_sig(q[3])}, p95 {f_sig(q[4])} {unit}"
    )
    mid = y + 10
    return [
        *out,
        Shape("line", sx(q[0]), mid, x2=sx(q[4]), y2=mid, color=color),
        Shape(
            "rect",
            sx(q[1]),
            y + 4,
            w=max(1.0, sx(q[3]) - sx(q[1])),
            h=12,
            color=color,
            opacity=0.35,
            title=tip,
        ),
        Shape("line", sx(q[2]), y + 3, x2=sx(q[2]), y2=y + 17, color=color),
        Shape(
            "text", right + 8, y + 14, text=f"median {f_sig(q[2])} {unit}", size=10, color="#475569"
        ),
    ]


def line_chart(
    points: Sequence[tuple[float, float]],
    color: str,
    windows: Sequence[tuple[str, float, float]],
    label: str,
) -> Chart | None:
    """A usage fraction over seconds since its first point, with phase windows shaded. The
    y axis runs to a round value above the peak (at most 100%) so a small peak stays visible;
    its top label says where that is."""
    if not points:
        return None
    t0 = points[0][0]
    top, ticks = _axis(max(points[-1][0] - t0, 1.0), 8)
    ytop = min(1.0, _axis(max(max(v for _, v in points), 0.01), 2)[0])
    left, right, y0, y1, width = 50.0, 940.0, 10.0, 150.0, 960

    def sx(t: float) -> float:
        return round(left + (right - left) * (min(max(t, t0), t0 + top) - t0) / top, 1)

    def sy(v: float) -> float:
        return round(y1 - (y1 - y0) * max(0.0, min(v / ytop, 1.0)), 1)

    shapes = _xaxis(left, right, y1, top, ticks, "s", y0)
    for i, (name, a, b) in enumerate(windows):  # labels alternate rows: windows can be narrow
        if sx(b) > sx(a):
            shapes += [
                Shape(
                    "rect",
                    sx(a),
                    y0,
                    w=sx(b) - sx(a),
                    h=y1 - y0,
                    color="#94a3b8",
                    opacity=0.12,
                    title=name,
                ),
                Shape(
                    "text", sx(a) + 3, y0 + 11 + 12 * (i % 2), text=name, size=10, color="#475569"
                ),
            ]
    shapes += _ygrid(left, right, [(sy(v), f"{100 * v:.3g}%") for v in (0.0, ytop / 2, ytop)])
    pts = " ".join(f"{sx(t)},{sy(v)}" for t, v in _thin(points))
    shapes.append(Shape("poly", points=pts, color=color))
    return Chart(width, int(y1 + 36), label, shapes)


Curve = tuple[str, str, str, Sequence[tuple[float, float | None]]]  # name, color, dash, (x, y)
Mark = tuple[float, str, str]  # x, color, label: a dashed vertical line (a knee)


def curve_chart(
    curves: Sequence[Curve], marks: Sequence[Mark], x_unit: str, y_unit: str, label: str
) -> Chart | None:
    """Lines of y against x (latency against load), both axes from zero, a dot at each point
    with its value as a tooltip, a legend on the right, and each mark a labelled dashed
    vertical line. A missing y leaves its point out. None when there is nothing to draw."""
    known = [(x, y) for *_, pts in curves for x, y in pts if y is not None]
    if not known:
        return None
    xtop, xticks = _axis(max(x for x, _ in known), 8)
    ytop, yticks = _axis(max(y for _, y in known), 4)
    left, right, y0, y1, width = 60.0, 760.0, 10.0, 190.0, 960

    def sx(x: float) -> float:
        return round(left + (right - left) * max(0.0, min(x / xtop, 1.0)), 1)

    def sy(y: float) -> float:
        return round(y1 - (y1 - y0) * max(0.0, min(y / ytop, 1.0)), 1)

    shapes = _xaxis(left, right, y1, xtop, xticks, x_unit, y0)
    top = len(yticks) - 1
    shapes += _ygrid(
        left,
        right,
        [(sy(t), f"{t:,.6g}" + (f" {y_unit}" if i == top else "")) for i, t in enumerate(yticks)],
    )
    for i, (x, color, text) in enumerate(marks):  # labels step down: knees can coincide
        shapes += [
            Shape("line", sx(x), y0, x2=sx(x), y2=y1, color=color, dash="4 3"),
            Shape("text", sx(x) + 3, y0 + 11 + 12 * i, text=text, size=10, color=color),
        ]
    for i, (name, color, dash, pts) in enumerate(curves):
        line = [(x, y) for x, y in pts if y is not None]
        if len(line) > 1:
            xy = " ".join(f"{sx(x)},{sy(y)}" for x, y in line)
            shapes.append(Shape("poly", points=xy, color=color, dash=dash))
        shapes += [
            Shape(
                "rect",
                sx(x) - 2.5,
                sy(y) - 2.5,
                w=5,
                h=5,
                color=color,
                title=f"{name}: {f_sig(y)} {y_unit} at {x:,.6g} {x_unit}",
            )
            for x, y in line
        ]
        ly = y0 + 6 + 14 * i
        shapes += [
            Shape("line", right + 16, ly, x2=right + 36, y2=ly, color=color, dash=dash),
            Shape("text", right + 42, ly + 4, text=name, size=10, color=color),
        ]
    return Chart(width, int(max(y1 + 36, y0 + 14 * len(curves) + 10)), label, shapes)


def _ygrid(left: float, right: float, ticks: Sequence[tuple[float, str]]) -> list[Shape]:
    """Horizontal grid lines at the given heights, labelled left of the plot."""
    out = []
    for y, label in ticks:
        out += [
            Shape("line", left, y, x2=right, y2=y, color="#e2e8f0"),
            Shape("text", left - 6, y + 4, text=label, anchor="end", size=10, color="#64748b"),
        ]
    return out


def _thin(points: Sequence[tuple[float, float]], n: int = 1500) -> list[tuple[float, float]]:
    """At most about n points, keeping each stretch's peak (peaks are what matter here)."""
    k = math.ceil(len(points) / n)
    if k <= 1:
        return list(points)
    return [max(points[i : i + k], key=lambda p: p[1]) for i in range(0, len(points), k)]


def bar_chart(
    bars: Sequence[tuple[str, str, float | None]],
    unit: str,
    label: str,
) -> Chart | None:
    """Horizontal bars (label, color, value); a missing value is a dash, not a zero bar."""
    values = [v for _, _, v in bars if v is not None]
    if not values:
        return None
    top, ticks = _axis(max(values))
    left, right, row_h, width = 200.0, 760.0, 26, 960
    shapes: list[Shape] = []
    for i, (name, color, v) in enumerate(bars):
        y = 6.0 + i * row_h
        shapes.append(Shape("text", 4, y + 15, text=name, color=color))
        w = 0.0 if v is None else (right - left) * v / top
        if v is not None:
            shapes.append(
                Shape(
                    "rect",
                    left,
                    y + 3,
                    w=max(1.0, round(w, 1)),
                    h=16,
                    color=color,
                    opacity=0.8,
                    title=f"{name}: {f_int(v)} {unit}",
                )
            )
        shapes.append(Shape("text", left + w + 6, y + 15, text=f"{f_int(v)} {unit}", size=10))
    y_axis = 6.0 + len(bars) * row_h + 4
    return Chart(
        width, int(y_axis + 36), label, _xaxis(left, right, y_axis, top, ticks, unit, 6) + shapes
    )
