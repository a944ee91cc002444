"""The systems rule's evidence: every metric it weighs, per phase and bucket, as a cell.

A cell pairs the candidate with the reference: the same requests (TTFT, ITL, E2E; lower is
better) or, in an interleaved phase, the same blocks of requests (goodput within the SLOs, or
answered requests per second; higher is better). Its change is the median over pairs of
candidate / reference, with the sign test's distribution-free interval
(``stats.median_change``). Every cell of a run is one family: each interval is at level
``1 - alpha / family`` (Bonferroni over phases x buckets x metrics, valid however the cells
depend on each other; with a capacity phase its cell gets half of alpha, :func:`rule`), so the
chance that any cell claims a change under pure noise is at most alpha. The A/A control (the
reference replayed again) gives each cell its floor: the largest change its own interval
reaches at the same level.

A cell's call (:func:`direction`, the one rule, also applied to whole simulated arrays):

* better or worse only when its interval lies beyond the threshold (a change of at least
  ``threshold`` either way: a ratio past 1.05 or 1/1.05 at 5%) **and** its median lies beyond
  the floor, on the same side;
* same otherwise;
* unweighed when it cannot be judged: too few pairs for an interval at the level, no A/A
  control (no floor), or a control with too few pairs of its own.

A cell that may stop before its last block (the capacity phase's: ``Planned.planned_blocks``)
gets the call its planned blocks would give, as soon as the blocks it has not sent can no
longer change it (:func:`settled`: curtailment, so its level is the fixed design's), and is
unweighed, undecided, where they still could.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from replay.analysis.schemas import SystemsCell, SystemsRule
from replay.analysis.stats.median_change import Change, log_ratios, median_change, min_pairs
from replay.analysis.timings import LATENCY, Timings, timings
from replay.core.records import Result
from replay.core.slo import SloSpec, meets

LOWER_IS_BETTER = ("ttft_ms", "itl_ms", "e2e_ms")
CAPACITY_SHARE = 0.5  # of alpha, for a capacity phase's cells (:func:`rule`)
# A log ratio beyond any block's (e^50 times): what a block not sent yet is assumed to give
# when :func:`settled` asks whether it could still change a call.
EXTREME = 50.0


Block = tuple[int, float, float]  # (index, start, end) on the run's clock


def direction(
    median: npt.ArrayLike,
    lo: npt.ArrayLike,
    hi: npt.ArrayLike,
    floor: npt.ArrayLike,
    threshold: float,
) -> npt.NDArray[np.int_]:
    """+1 where the candidate's values are higher beyond the threshold and the floor, -1 where
    lower, 0 otherwise (log ratios; NaN bounds or floor give 0: nothing to judge)."""
    t = math.log1p(threshold)
    med, a, b, f = (np.asarray(x, dtype=float) for x in (median, lo, hi, floor))
    with np.errstate(invalid="ignore"):
        up = (a > t) & (med > f)
        down = (b < -t) & (med < -f)
    return np.where(up, 1, np.where(down, -1, 0))


Pair = tuple[int, float, float]  # (block, reference's value, candidate's value)
ONE_BLOCK = (
    "measured one after another: one block per arm, so the machine's drift and the "
    "candidate cannot be told apart"
)


@dataclass(frozen=True)
class Planned:
    """A cell before it is judged: its pairs by block, and the A/A control's."""

    phase: str
    bucket: str | None
    metric: str
    pairs: list[Pair]
    control: list[Pair] | None  # (block, reference's, control's)
    unweighed: str = ""  # why it cannot be judged whatever its figures (kept for display)
    # A phase that may stop early (the capacity phase): the blocks it planned, which its call
    # is for (``settled``); None: judged on the blocks it has.
    planned_blocks: int | None = None
    stopped: str = ""  # why it sent fewer blocks than it planned, in words


def block_changes(pairs: Sequence[Pair]) -> npt.NDArray[np.float64]:
    """The median log ratio of each block's pairs: the units the interval is over. Requests of
    one block share the machine's state while each arm sent it (a neighbour's burst in one
    arm's turn moves all of them), so they are not independent pairs; blocks are."""
    by: dict[int, list[float]] = defaultdict(list)
    for k, a, b in pairs:
        d = log_ratios([a], [b])
        if d.size:
            by[k].append(float(d[0]))
    return np.asarray([np.median(v) for _, v in sorted(by.items())], dtype=float)


def judge(p: Planned, miss: float, threshold: float) -> SystemsCell:
    """One cell's change, interval, floor and call at level ``1 - miss``; a cell short of its
    planned blocks gets the call they would give (:func:`settled`), or none yet."""
    cell = _judged(p, miss, threshold)
    if p.planned_blocks is None or p.unweighed or cell.pairs >= p.planned_blocks:
        return cell
    call = settled(p, miss, threshold)
    if call is None:
        why = p.stopped or "the others not sent whole to every arm"
        return replace(
            cell,
            call="unweighed",
            why=f"undecided after {cell.pairs} of {p.planned_blocks} blocks ({why}): the blocks "
            "not sent could still change its call",
        )
    return replace(cell, call=call, why=cell.why if call == "unweighed" else "")


def settled(p: Planned, miss: float, threshold: float) -> str | None:
    """The call ``p`` would get at its ``planned_blocks`` whatever its missing blocks give;
    None while they could still change it. Its interval's ends and its median only rise as
    a block's ratio rises, and the A/A floor (the control's interval's larger end, in size)
    is smallest with the control's missing blocks at no change and largest with them all at
    one extreme: so a change either way is possible only if it shows with every missing
    block at that extreme and the control's at zero, and certain only if it still shows with
    every missing block at the other extreme and the control's at either."""
    planned = p.planned_blocks or 0

    def call(mine: float, control: float) -> str:
        return _judged(_filled(p, planned, mine, control), miss, threshold).call

    up, down = call(EXTREME, 0.0), call(-EXTREME, 0.0)
    moved = {c for c in (up, down) if c not in ("same", "unweighed")}
    if not moved:
        return "same" if "same" in (up, down) else up
    if len(moved) == 2:
        return None
    (change,) = moved
    rising = change == ("worse" if p.metric in LOWER_IS_BETTER else "better")
    worst = -EXTREME if rising else EXTREME
    sure = {call(worst, EXTREME), call(worst, -EXTREME)} == {change}
    return change if sure else None


def _filled(p: Planned, planned: int, mine: float, control: float) -> Planned:
    """``p`` with its missing blocks (and its control's) sent: each a pair whose log ratio
    is ``mine`` (``control``)."""

    def fill(pairs: list[Pair], value: float) -> list[Pair]:
        have = int(block_changes(pairs).size)  # the blocks that give a ratio
        start = max((k for k, _, _ in pairs), default=-1) + 1
        return [*pairs, *((start + i, 1.0, math.exp(value)) for i in range(planned - have))]

    aa = fill(p.control, control) if p.control is not None else None
    return replace(p, pairs=fill(p.pairs, mine), control=aa, planned_blocks=None)


def _judged(p: Planned, miss: float, threshold: float) -> SystemsCell:
    """``judge`` on the blocks ``p`` has."""
    d = block_changes(p.pairs)
    ch = median_change(d, miss)
    base = _cell(p, ch, int(d.size), 1.0 - miss)
    if p.unweighed:
        return base(None, "unweighed", p.unweighed)
    if ch is None or ch.lo is None or ch.hi is None:
        n = 0 if ch is None else ch.n
        return base(None, "unweighed", f"{n} block(s): an interval needs {min_pairs(miss)}")
    if p.control is None:
        return base(None, "unweighed", "no A/A control: no floor")
    aa = median_change(block_changes(p.control), miss)
    if aa is None or aa.lo is None or aa.hi is None:
        n = 0 if aa is None else aa.n
        return base(None, "unweighed", f"the A/A control has {n} block(s) here")
    floor = max(abs(aa.lo), abs(aa.hi))
    way = int(direction(ch.median, ch.lo, ch.hi, floor, threshold))
    higher_better = p.metric not in LOWER_IS_BETTER
    call = "same" if way == 0 else "better" if (way > 0) == higher_better else "worse"
    return base(math.expm1(floor), call, "")


def _cell(
    p: Planned, ch: Change | None, blocks: int, level: float
) -> Callable[[float | None, str, str], SystemsCell]:
    def med(xs: Sequence[float]) -> float | None:
        return float(np.median(xs)) if len(xs) else None

    def rel(x: float | None) -> float | None:
        return None if x is None else math.expm1(x)

    def make(floor: float | None, call: str, why: str) -> SystemsCell:
        return SystemsCell(
            phase=p.phase,
            bucket=p.bucket,
            metric=p.metric,
            unit="blocks",
            pairs=blocks,
            reference=med([a for _, a, _ in p.pairs]),
            candidate=med([b for _, _, b in p.pairs]),
            change=rel(ch.median) if ch else None,
            lo=rel(ch.lo) if ch else None,
            hi=rel(ch.hi) if ch else None,
            floor=floor,
            call=call,
            why=why,
            level=level,
            requests=len(p.pairs) if p.metric in LOWER_IS_BETTER else None,
        )

    return make


def latency_cells(
    results: Sequence[Result],
    ref: str,
    cand: str,
    control: str | None,
    phases: Sequence[str],
    blocks: Mapping[str, Mapping[str, Sequence[Block]]],
) -> list[Planned]:
    """TTFT, ITL and E2E per phase and bucket, paired by request and grouped by the block the
    reference sent it in (the bucket is the reference's); a pair counts where both arms sent
    that block whole. A phase sent whole (not interleaved) is one block: unweighed."""
    tm = timings(results)
    out = []
    for ph in phases:
        a, b = tm.rows(ref, ph), tm.rows(cand, ph)
        c = tm.rows(control, ph) if control else None
        mine = list(blocks.get(ref, {}).get(ph, ()))
        k_of = _blocks_of(tm, a, mine)
        whole = {t: _whole(blocks, t, ph) if mine else None for t in (cand, control) if t}
        why = "" if mine else ONE_BLOCK
        for bucket in dict.fromkeys(tm.bucket[a[i]] for i in a if i in b):
            for name in LATENCY:
                pairs = _pairs(tm, a, b, bucket, name, k_of, whole[cand])
                aa = None
                if c is not None and control is not None:
                    aa = _pairs(tm, a, c, bucket, name, k_of, whole[control])
                out.append(Planned(ph, bucket, name, pairs, aa, why))
    return out


def _whole(blocks: Mapping[str, Mapping[str, Sequence[Block]]], arm: str, phase: str) -> set[int]:
    """The blocks ``arm`` sent whole in ``phase``."""
    return {k for k, _, _ in blocks.get(arm, {}).get(phase, ())}


def _blocks_of(tm: Timings, rows: Mapping[str, int], blocks: Sequence[Block]) -> dict[str, int]:
    """The block each request was sent in (its scheduled time in the block's window); 0 for
    all of them when the phase has no blocks."""
    if not blocks:
        return dict.fromkeys(rows, 0)
    starts = np.asarray([s for _, s, _ in blocks])
    out = {}
    for rid, row in rows.items():
        scheduled = float(tm.scheduled[row])
        i = int(np.searchsorted(starts, scheduled, "right")) - 1
        if i >= 0 and scheduled <= blocks[i][2]:
            out[rid] = blocks[i][0]
    return out


def _pairs(
    tm: Timings,
    a: Mapping[str, int],
    b: Mapping[str, int],
    bucket: str,
    metric: str,
    k_of: Mapping[str, int],
    whole: set[int] | None,
) -> list[Pair]:
    out = []
    for rid in sorted(set(a) & set(b) & set(k_of)):
        k = k_of[rid]
        if tm.bucket[a[rid]] != bucket or (whole is not None and k not in whole):
            continue
        x, y = tm.value(metric, a[rid]), tm.value(metric, b[rid])
        if x is not None and y is not None:
            out.append((k, x, y))
    return out


def block_list(window: Mapping[str, Any]) -> list[Block]:
    """A phase window's (or a capacity arm's) blocks, as the manifest stores them."""
    return [(int(k), float(a), float(b)) for k, a, b in window.get("blocks") or []]


def block_counts(
    results: Sequence[Result],
    blocks: Sequence[Block],
    slo: SloSpec | None,
    *,
    target: str | None = None,
    phase: str | None = None,
) -> dict[int, tuple[int, float]]:
    """Per block (one arm, one phase: ``target``'s results in ``phase``, or all of
    ``results``): how many requests sent in it met the SLOs (with no SLOs, were answered), and
    the block's seconds. Read from the results' columns."""
    tm = timings(results)
    t = tm.table
    mine = tm.ok.copy()
    if target is not None:
        mine &= t.codes("target") == t.code_of("target", target)
    if phase is not None:
        mine &= t.codes("phase") == t.code_of("phase", phase)
    rows = np.flatnonzero(mine)
    if slo is not None:
        rows = np.asarray([i for i in rows if _meets(tm, int(i), slo)], dtype=np.int64)
    at = np.sort(tm.scheduled[rows])
    out = {}
    for k, start, end in blocks:
        if end > start:
            n = int(np.searchsorted(at, end, "right") - np.searchsorted(at, start, "left"))
            out[k] = (n, end - start)
    return out


def _meets(tm: Timings, i: int, slo: SloSpec) -> bool:
    """Whether answered row ``i`` met its bucket's SLOs (seconds; NaN: the time is missing)."""

    def seconds(x: float) -> float | None:
        return None if x != x else float(x)

    bounds = slo.for_bucket(str(tm.bucket[i]))
    return meets(bounds, True, seconds(tm.ttft_s[i]), seconds(tm.tpot_s[i]), seconds(tm.e2e_s[i]))


def block_rates(counts: Mapping[int, tuple[int, float]]) -> dict[int, float]:
    """Each block's requests per second."""
    return {k: n / seconds for k, (n, seconds) in counts.items()}


def rate_cell(
    phase: str,
    metric: str,
    rates: Mapping[str, Mapping[int, float]],
    ref: str,
    cand: str,
    control: str | None,
    unweighed: str = "",
) -> Planned:
    """One phase's rate, paired by block: the same requests sent to every arm in turn."""

    def paired(x: str, y: str) -> list[Pair]:
        a, b = rates.get(x, {}), rates.get(y, {})
        return [(k, a[k], b[k]) for k in sorted(set(a) & set(b))]

    aa = paired(ref, control) if control else None
    return Planned(phase, None, metric, paired(ref, cand), aa, unweighed)


CAPACITY = "capacity"  # the capacity phase's label (``analysis.capacity``)


def rule(
    planned: Sequence[Planned],
    *,
    alpha: float,
    threshold: float,
    control: str | None,
    interleaved: bool,
) -> SystemsRule:
    """Every planned cell judged as one family. Bonferroni, weighted by question: the cells of
    the workload's own load share alpha equally; with a capacity phase, which asks another
    question on a dozen blocks, its cell gets half of alpha and the workload's cells share the
    other half. Each cell's miss is at most its share, so the family's is at most alpha."""
    capacity = [p for p in planned if p.phase == CAPACITY]
    load = [p for p in planned if p.phase != CAPACITY]
    load_alpha = alpha * (1 - CAPACITY_SHARE) if capacity else alpha
    miss = load_alpha / max(1, len(load))
    cells = [judge(p, miss, threshold) for p in load]
    cells += [judge(p, capacity_miss(alpha, len(capacity)), threshold) for p in capacity]
    return SystemsRule(
        alpha=alpha,
        threshold=threshold,
        family=max(1, len(planned)),
        level=1.0 - miss,
        min_pairs=min_pairs(miss),
        control=control,
        interleaved=interleaved,
        cells=tuple(cells),
    )


def capacity_miss(alpha: float, cells: int = 1) -> float:
    """The share of alpha each of a capacity phase's ``cells`` gets (:func:`rule`), which the
    phase's stop rule decides at too."""
    return alpha * CAPACITY_SHARE / max(1, cells)
