"""Systems cells and rules built by hand, for the table tests of the stop rule's systems half
(``verdict.payoff``): each cell's figures agree with its call."""

from __future__ import annotations

from replay.analysis.schemas import SystemsCell, SystemsRule

# (change, lo, hi) of a cell with each call, latency's sense (a rate's is the same numbers:
# "better" is then more requests per second).
FIGURES = {
    "better": (-0.2, -0.25, -0.15),
    "worse": (0.2, 0.15, 0.25),
    "same": (0.01, -0.03, 0.05),
    "unweighed": (0.3, None, None),
}


def cell(
    metric: str = "ttft_ms",
    call: str = "same",
    bucket: str | None = "<8K",
    phase: str = "c4",
    pairs: int = 64,
) -> SystemsCell:
    change, lo, hi = FIGURES[call]
    if metric.endswith("_rps") and lo is not None and hi is not None:
        change, lo, hi = -change, -hi, -lo  # a rate is better higher
    return SystemsCell(
        phase=phase,
        bucket=None if metric.endswith("_rps") else bucket,
        metric=metric,
        unit="blocks" if metric.endswith("_rps") else "requests",
        pairs=pairs,
        reference=100.0,
        candidate=100.0 * (1 + change),
        change=change,
        lo=lo,
        hi=hi,
        floor=None if call == "unweighed" else 0.04,
        call=call,
        why="3 pair(s): an interval needs 9" if call == "unweighed" else "",
    )


def rule(*cells: SystemsCell, control: str | None = "bf16-control") -> SystemsRule:
    family = max(1, len(cells))
    return SystemsRule(
        alpha=0.05,
        threshold=0.05,
        family=family,
        level=1 - 0.05 / family,
        min_pairs=9,
        control=control,
        interleaved=True,
        cells=cells,
    )
