"""The systems rule's tables: every cell it weighed (medians, change with its interval, the
A/A floor, the call) and the capacity phase's arms (``systems`` lays out the rest)."""

from __future__ import annotations

from replay.analysis.schemas import CapacityPhase, SystemsRule
from replay.analysis.verdict.payoff import call_word, levels
from replay.present.formatting import DASH, f_int, f_pct, f_sig, text
from replay.present.views import Cell, Table

METRIC_NAMES = {
    "ttft_ms": "TTFT (ms)",
    "itl_ms": "ITL (ms)",
    "e2e_ms": "E2E (ms)",
    "goodput_rps": "goodput (req/s)",
    "answered_rps": "answered (req/s)",
}


def _rel(x: float | None) -> str:
    return DASH if x is None else f"{100 * x:+.1f}%"


def rule_table(rule: SystemsRule | None, ref: str, cand: str) -> Table | None:
    """Every cell the systems rule weighed: medians, change with interval, floor, call."""
    if rule is None or not rule.cells:
        return None
    t = Table(
        [
            "Phase",
            "Bucket",
            "Metric",
            "Pairs",
            f"{ref} median",
            f"{cand} median",
            f"{cand} / {ref} − 1 [interval]",
            "A/A floor",
            "Call",
        ],
        caption=f"{cand} against {ref}; intervals over blocks: {levels(rule)}; threshold "
        f"{100 * rule.threshold:g}%",
    )
    for c in rule.cells:
        cls = {"better": "good", "worse": "bad"}.get(c.call, "")
        word = "same" if c.call == "same" else call_word(c)
        t.add(
            c.phase,
            text(c.bucket) if c.bucket is not None else "all",
            METRIC_NAMES.get(c.metric, c.metric),
            f"{c.pairs} {c.unit}" + (f" ({c.requests} requests)" if c.requests else ""),
            f_sig(c.reference),
            f_sig(c.candidate),
            Cell(f"{_rel(c.change)} [{_rel(c.lo)}, {_rel(c.hi)}]", "num " + cls),
            DASH if c.floor is None else f"±{100 * c.floor:.1f}%",
            Cell(word, cls),
        )
    return t


def rule_note(rule: SystemsRule | None) -> str | None:
    if rule is None:
        return None
    how = "interleaved in blocks" if rule.interleaved else "one target after another"
    floor = f"the A/A control {rule.control}" if rule.control else "no A/A control: no floor"
    return (
        f"Measured {how}; floors from {floor}. A cell is faster or slower (more or fewer) only "
        f"when its interval lies beyond ±{100 * rule.threshold:g}% and its median beyond the "
        f"floor; an interval needs {rule.min_pairs} pairs at this level."
    )


def capacity_table(cap: CapacityPhase | None, ref: str) -> Table | None:
    """The capacity phase: each arm's cache, load and rate where the reference's is full."""
    if cap is None:
        return None
    full = {True: "full", False: "not full", None: "unknown"}[cap.reference_full]
    caption = (
        f"{cap.status}: {cap.reason}"
        if cap.status != "ran"
        else f"concurrency {cap.concurrency}, {f_int(cap.cache_bytes)} bytes of KV cache per "
        f"server, {cap.blocks} blocks per arm"
        + (f" ({cap.stopped})" if cap.stopped else "")
        + f"; the reference's ({ref}) cache: {full}"
    )
    t = Table(
        [
            "Arm",
            "KV cache (tokens)",
            "Requests",
            "Met",
            "Busy (s)",
            "Rate (req/s)",
            "Peak KV usage",
            "Peak waiting",
            "Preemptions",
        ],
        caption=caption,
    )
    for name, a in cap.arms.items():
        t.add(
            name,
            f_int(a.kv_cache_size_tokens),
            f_int(a.requests),
            f_int(a.met),
            f_sig(a.busy_s),
            f_sig(a.rate_rps),
            f_pct(a.peak_kv_usage),
            f_int(a.peak_waiting),
            f_int(a.preemptions),
        )
    return t
