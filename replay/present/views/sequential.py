"""The sequential section: how a sequential canary reached its decision. Per bucket (and the
pool of every bucket) the drop's always-valid interval narrowing round by round against the
pairs graded, its status and the round that decided it; and the requests sent beside what the
fixed design would have sent (``analysis.sequential.summary_block``). Absent for other runs."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from replay.analysis.schemas import Sequential, SequentialBucket
from replay.present.charts import Chart, Curve, curve_chart
from replay.present.formatting import DASH, f_int, num
from replay.present.reading import Run
from replay.present.views import Table

POOL = "pool"  # the path rows' name for the pooled question
UPPER, LOWER, LINE = "#2563eb", "#ea580c", "#64748b"


def sequential_view(run: Run) -> dict[str, Any] | None:
    seq = run.summary.sequential
    if seq is None:
        return None
    paths: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for row in seq.path:
        pairs, lo, hi = (num(row.get(k)) for k in ("pairs", "lower", "upper"))
        if pairs is not None and lo is not None and hi is not None:
            paths[str(row.get("bucket") or POOL)].append((pairs, lo, hi))
    charts = [_chart(name, pts, seq.tolerance) for name, pts in paths.items()]
    return {
        "note": _note(seq),
        "table": _table(seq),
        "charts": [c for c in charts if c],
        "needs": list(seq.needs),
    }


def _note(seq: Sequential) -> str:
    return (
        f"Decision: {seq.decision} (stopped: {seq.stopped}) after {seq.rounds} round(s) of up "
        f"to {seq.round_size} requests per open bucket: {seq.requests_sent} requests sent to "
        f"every arm. The fixed design at the same alpha ({seq.alpha:g}) and tolerance "
        f"({100 * seq.tolerance:g} points) would have sent {seq.fixed_n} ({seq.fixed_method}); "
        f"the trace holds {seq.trace_requests}."
    )


def _points(x: float) -> str:
    return f"{100 * x:+.1f}"


def _row(b: SequentialBucket) -> list[str]:
    return [
        b.name or "pool (every bucket)",
        b.status,
        f_int(b.pairs),
        f"{b.regressions} / {b.improvements}",
        f"[{_points(b.lower)}, {_points(b.upper)}]",
        str(b.decided_round) if b.decided_round is not None else DASH,
    ]


def _table(seq: Sequential) -> Table:
    t = Table(
        ["Bucket", "Status", "Pairs", "Lost / gained", "Drop (points)", "Decided in round"],
        caption="A loss once the drop's lower bound is above 0; equivalent once its upper "
        f"bound is below the tolerance ({100 * seq.tolerance:g} points).",
    )
    for b in seq.buckets:
        t.add(*_row(b))
    if seq.pool is not None:
        t.add(*_row(seq.pool))
    return t


def _chart(name: str, pts: list[tuple[float, float, float]], tolerance: float) -> Chart | None:
    """The drop's bounds in points against pairs graded, with the tolerance line; the lower
    bound is drawn from 0 up (a loss once it leaves 0)."""
    xs = [p for p, _, _ in pts]
    curves: list[Curve] = [
        ("upper bound", UPPER, "", [(p, 100 * hi) for p, _, hi in pts]),
        ("lower bound (from 0)", LOWER, "4 3", [(p, max(0.0, 100 * lo)) for p, lo, _ in pts]),
        ("tolerance", LINE, "2 2", [(x, 100 * tolerance) for x in xs]),
    ]
    where = "every bucket pooled" if name == POOL else f"bucket {name}"
    return curve_chart(curves, [], "pairs", "points", f"The drop's interval, {where}")
