"""Systems comparison: is FP8 faster or bigger, per bucket, and from which context length?

Latency deltas are paired (same request on both targets) with bootstrap intervals. The
break-even context length comes from a least-squares line of latency against prompt tokens per
target: short contexts can lose to BF16 because FP8's fixed overhead has not amortized, and
prefill can regress while decode improves, so TTFT and ITL are fitted separately.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import _stats as stats
from ._records import Result

Metric = Callable[[Result], float | None]
METRICS: dict[str, Metric] = {
    "ttft_ms": lambda r: None if r.ttft is None else 1000 * r.ttft,
    "e2e_ms": lambda r: None if r.e2e is None else 1000 * r.e2e,
    "itl_ms": lambda r: (1000 * float(np.mean(r.itl()))) if r.itl() else None,
}


def fit_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float] | None:
    """(intercept, slope) by least squares; None with fewer than 3 points or no spread."""
    if len(x) < 3 or np.ptp(np.asarray(x, dtype=float)) == 0:
        return None
    slope, intercept = np.polyfit(np.asarray(x, dtype=float), np.asarray(y, dtype=float), 1)
    return float(intercept), float(slope)


def break_even(ref: tuple[float, float] | None, cand: tuple[float, float] | None,
               ) -> dict[str, Any]:
    """Where the candidate's line drops below the reference's ("from" / "below" / never)."""
    if ref is None or cand is None:
        return {"tokens": None, "fp8_wins": "unknown"}
    (a0, b0), (a1, b1) = ref, cand
    if np.isclose(b0, b1):
        return {"tokens": None, "fp8_wins": "always" if a1 < a0 else "never"}
    x = (a1 - a0) / (b0 - b1)
    if b1 < b0:  # candidate grows slower: wins from x on
        return {"tokens": max(0.0, x), "fp8_wins": "above"}
    return {"tokens": max(0.0, x), "fp8_wins": "below"}


def compare_systems(results: Sequence[Result], reference: str, candidate: str, phase: str,
                    seed: int = 0) -> dict[str, Any]:
    """Per bucket: paired latency deltas (candidate - reference) with intervals; fits."""
    by: dict[str, dict[str, Result]] = defaultdict(dict)
    for r in results:
        if r.phase == phase and r.status == "ok" and r.target in (reference, candidate):
            by[r.target][r.request_id] = r
    ref, cand = by.get(reference, {}), by.get(candidate, {})
    common = sorted(set(ref) & set(cand))
    buckets: dict[str, Any] = defaultdict(dict)
    for name, metric in METRICS.items():
        per_bucket: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
        for rid in common:
            a, b = metric(ref[rid]), metric(cand[rid])
            if a is not None and b is not None:
                per_bucket[ref[rid].bucket][0].append(a)
                per_bucket[ref[rid].bucket][1].append(b)
        for bucket, (xs, ys) in per_bucket.items():
            d = stats.paired_bootstrap(xs, ys, seed=seed)
            buckets[bucket][name] = None if d is None else {
                "reference_median": float(np.median(xs)),
                "candidate_median": float(np.median(ys)),
                "delta_mean": d.diff, "lo": d.lo, "hi": d.hi, "pairs": d.n}
    fits: dict[str, Any] = {}
    for name in ("ttft_ms", "itl_ms", "e2e_ms"):
        lines = {}
        for target, rs in ((reference, ref), (candidate, cand)):
            pts = [(float(r.prompt_tokens), v) for r in rs.values()
                   if r.prompt_tokens is not None and (v := METRICS[name](r)) is not None]
            lines[target] = fit_line([p[0] for p in pts], [p[1] for p in pts])
        fits[name] = {"reference": lines[reference], "candidate": lines[candidate],
                      **break_even(lines[reference], lines[candidate])}
    prompts = [float(r.prompt_tokens) for r in ref.values() if r.prompt_tokens is not None]
    median_ctx = float(np.median(prompts)) if prompts else None
    faster = any((row.get("e2e_ms") or {}).get("hi", 0) < 0 or
                 (row.get("ttft_ms") or {}).get("hi", 0) < 0 for row in buckets.values())
    be = fits["e2e_ms"]
    below = None
    if median_ctx is not None and be["fp8_wins"] != "unknown":
        below = (be["fp8_wins"] == "never" or
                 (be["fp8_wins"] == "above" and median_ctx < (be["tokens"] or 0)) or
                 (be["fp8_wins"] == "below" and median_ctx > (be["tokens"] or 0)))
    return {"reference": reference, "candidate": candidate, "phase": phase,
            "pairs": len(common), "buckets": dict(buckets), "fits": fits,
            "median_context_tokens": median_ctx, "latency_better": faster if common else None,
            "below_break_even": below}


def throughput_ratio(summary: Mapping[str, Any], reference: str, candidate: str,
                     phase: str) -> float | None:
    def tput(name: str) -> float | None:
        ph = ((summary["targets"].get(name) or {}).get("phases") or {}).get(phase) or {}
        return (ph.get("all") or {}).get("throughput_out_tok_s")

    a, b = tput(reference), tput(candidate)
    return b / a if a and b else None
