"""Systems comparison: is FP8 faster or bigger, per bucket, and from which context length?

What the verdict weighs is ``systems_cells``' rule (every metric per phase and bucket, with
distribution-free intervals and the A/A floor); the figures here describe the first phase.
Latency deltas are paired (same request on both targets) with bootstrap intervals. The
break-even context length comes from a least-squares line of latency against prompt tokens per
target: short contexts can lose to BF16 because FP8's fixed overhead has not amortized, and
prefill can regress while decode improves, so TTFT and ITL are fitted separately.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from replay.analysis.schemas import (
    Fit,
    LatencyDelta,
    Summary,
    Systems,
    SystemsBucket,
    SystemsRule,
)
from replay.analysis.stats.intervals import paired_bootstrap
from replay.analysis.systems_cells import LOWER_IS_BETTER
from replay.analysis.timings import Timings, timings
from replay.core.records import Result

METRICS = ("ttft_ms", "e2e_ms", "itl_ms")  # in the order the summary lists them


def fit_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float] | None:
    """(intercept, slope) by least squares; None with fewer than 3 points or no spread."""
    if len(x) < 3 or np.ptp(np.asarray(x, dtype=float)) == 0:
        return None
    slope, intercept = np.polyfit(np.asarray(x, dtype=float), np.asarray(y, dtype=float), 1)
    return float(intercept), float(slope)


def crossing(
    ref: tuple[float, float] | None,
    cand: tuple[float, float] | None,
) -> tuple[float | None, str]:
    """Where the candidate's line drops below the reference's, in prompt tokens, and on which
    side of it the candidate wins ("always", "never", "above", "below", "unknown")."""
    if ref is None or cand is None:
        return None, "unknown"
    (a0, b0), (a1, b1) = ref, cand
    if np.isclose(b0, b1):
        return None, "always" if a1 < a0 else "never"
    x = (a1 - a0) / (b0 - b1)
    # The candidate growing slower wins from x on.
    return max(0.0, x), "above" if b1 < b0 else "below"


def systems(
    results: Sequence[Result],
    reference: str,
    candidate: str,
    phase: str,
    seed: int = 0,
    *,
    rule: SystemsRule | None = None,
) -> Systems:
    """Per bucket of ``phase``: paired latency deltas (candidate - reference) with intervals,
    and fits; with ``rule`` (``systems_cells.rule``), the cells the verdict weighs. The output
    throughput ratio comes from the summary (``throughput_ratio``): None here."""
    tm = timings(results)
    ref, cand = tm.rows(reference, phase), tm.rows(candidate, phase)
    common = sorted(set(ref) & set(cand))
    buckets: dict[str, dict[str, LatencyDelta]] = defaultdict(dict)
    for name in METRICS:
        per_bucket: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
        for rid in common:
            a, b = tm.value(name, ref[rid]), tm.value(name, cand[rid])
            if a is not None and b is not None:
                per_bucket[tm.bucket[ref[rid]]][0].append(a)
                per_bucket[tm.bucket[ref[rid]]][1].append(b)
        for bucket, (xs, ys) in per_bucket.items():
            buckets[bucket][name] = _delta(xs, ys, seed)
    fits = {name: _fit(tm, name, ref, cand) for name in ("ttft_ms", "itl_ms", "e2e_ms")}
    prompts = [float(x) for i in ref.values() if (x := tm.prompt_tokens[i]) == x]
    median_ctx = float(np.median(prompts)) if prompts else None
    return Systems(
        reference=reference,
        candidate=candidate,
        phase=phase,
        pairs=len(common),
        buckets={b: SystemsBucket(**row) for b, row in buckets.items()},
        fits=fits,
        median_context_tokens=median_ctx,
        latency_better=_latency_better(rule),
        below_break_even=_below(fits["e2e_ms"], median_ctx),
        throughput_ratio=None,
        rule=rule,
    )


def _delta(xs: Sequence[float], ys: Sequence[float], seed: int) -> LatencyDelta:
    """The mean difference in ms; its bootstrap interval only over two pairs or more (one
    pair resampled is the same pair: a point, not an interval)."""
    d = paired_bootstrap(xs, ys, seed=seed)
    assert d is not None  # a bucket here has a pair
    interval = d.n >= 2
    return LatencyDelta(
        reference_median=float(np.median(xs)),
        candidate_median=float(np.median(ys)),
        delta_mean=d.diff,
        lo=d.lo if interval else None,
        hi=d.hi if interval else None,
        pairs=d.n,
    )


def _latency_better(rule: SystemsRule | None) -> bool | None:
    """A latency cell better and none worse; None when no latency cell was weighed."""
    cells = [
        c
        for c in (rule.cells if rule else ())
        if c.metric in LOWER_IS_BETTER and c.call != "unweighed"
    ]
    if not cells:
        return None
    calls = {c.call for c in cells}
    return "better" in calls and "worse" not in calls


def _fit(tm: Timings, metric: str, ref: Mapping[str, int], cand: Mapping[str, int]) -> Fit:
    lines = []
    for rows in (ref, cand):
        pts = [
            (float(p), v)
            for i in rows.values()
            if (p := tm.prompt_tokens[i]) == p and (v := tm.value(metric, i)) is not None
        ]
        lines.append(fit_line([p[0] for p in pts], [p[1] for p in pts]))
    tokens, wins = crossing(lines[0], lines[1])
    return Fit(reference=lines[0], candidate=lines[1], tokens=tokens, fp8_wins=wins)


def _below(e2e: Fit, median_ctx: float | None) -> bool | None:
    """Does the workload's median context sit where FP8's E2E line loses?"""
    if median_ctx is None or e2e.fp8_wins == "unknown":
        return None
    return (
        e2e.fp8_wins == "never"
        or (e2e.fp8_wins == "above" and median_ctx < (e2e.tokens or 0))
        or (e2e.fp8_wins == "below" and median_ctx > (e2e.tokens or 0))
    )


def throughput_ratio(summary: Summary, reference: str, candidate: str, phase: str) -> float | None:
    """The candidate's output throughput over the reference's in ``phase``."""

    def tput(name: str) -> float | None:
        target = summary.targets.get(name)
        ph = None if target is None else target.phases.get(phase)
        return None if ph is None else ph.all.throughput_out_tok_s

    a, b = tput(reference), tput(candidate)
    return b / a if a and b else None
