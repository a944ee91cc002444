"""Does FP8 pay? The systems half of the stop rule, once the quality half found a match.

Its inputs are plain facts: the capacity ratio and whether the workload's own load filled the
reference's cache (``Facts.capacity_needed``), and the systems rule's cells
(``analysis.systems_cells``: every latency per phase and bucket, goodput per phase with SLOs,
the capacity phase's rate, each called better, worse, same or unweighed against the A/A floor
and the threshold). In order, the first that holds decides:

1. capacity the workload needs: FP8 holds ``required_capacity_ratio`` x the cache and the
   reference's ran close to full -> KEEP;
2. with SLOs, goodput at the workload's load: fewer requests/s within the SLOs in any phase
   -> REJECT; more (and fewer nowhere) -> KEEP. With SLOs the service's own goal speaks for
   latency, so the latency cells are evidence only;
3. without SLOs (or goodput unweighed), latency where the workload runs: slower beyond the
   floor in any cell -> REJECT (too short or prefill-heavy to pay off); faster in some cell
   and slower in none -> KEEP;
4. the capacity phase, where the reference's cache is full: more requests/s -> KEEP (no cost at
   the workload's own load, and the larger cache turns into throughput); same or fewer ->
   REJECT;
5. otherwise nothing shows a gain -> REJECT, saying what was not measured.

So "faster" is never said while a weighed latency is slower, and an answer rests on cells
whose intervals lie beyond the threshold and the floor: under pure noise each cell claims a
change with chance at most alpha / family, the whole rule at most alpha.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from replay.analysis.schemas import SystemsCell, SystemsRule, Verdict
from replay.analysis.systems_cells import CAPACITY, LOWER_IS_BETTER
from replay.analysis.thresholds import Thresholds
from replay.analysis.verdict.facts import Facts
from replay.analysis.verdict.wording import evidence_entry, verdict_record

NAMES = {
    "ttft_ms": "TTFT",
    "itl_ms": "ITL",
    "e2e_ms": "E2E",
    "goodput_rps": "goodput within the SLOs",
    "answered_rps": "answered requests/s",
}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def call_word(c: SystemsCell) -> str:
    if c.call == "unweighed":
        return f"not weighed: {c.why}"
    latency = c.metric in LOWER_IS_BETTER
    words = {"better": ("faster", "more"), "worse": ("slower", "fewer")}
    if c.call in words:
        return words[c.call][0 if latency else 1]
    return "no change beyond the floor and the threshold"


def where(c: SystemsCell) -> str:
    return f"{c.bucket} ({c.phase})" if c.bucket is not None else c.phase


def cell_text(c: SystemsCell, cand: str, ref: str) -> str:
    """One cell in a sentence: medians, change with interval, pairs, floor, call."""
    unit = "ms" if c.metric in LOWER_IS_BETTER else "req/s"
    medians = (
        f"median {c.candidate:.4g} against {c.reference:.4g} {unit}"
        if c.candidate is not None and c.reference is not None
        else "no medians"
    )
    interval = f" [{_pct(c.lo)}, {_pct(c.hi)}]" if c.lo is not None else ""
    floor = f", A/A floor ±{100 * c.floor:.1f}%" if c.floor is not None else ""
    return (
        f"{NAMES.get(c.metric, c.metric)} in {where(c)}: {cand} {_pct(c.change)}{interval} "
        f"against {ref} over {c.pairs} {c.unit} ({medians}{floor}): {call_word(c)}"
    )


def _list(cells: Sequence[SystemsCell]) -> str:
    shown = [f"{NAMES.get(c.metric, c.metric)} {_pct(c.change)} in {where(c)}" for c in cells]
    more = f" and {len(shown) - 4} more" if len(shown) > 4 else ""
    return ", ".join(shown[:4]) + more


def systems_evidence(f: Facts, th: Thresholds) -> list[dict[str, Any]]:
    """The systems entries: capacity ratio, the rule's setting, every cell, the capacity
    phase (what it ran and whether the reference's cache was full)."""
    ev = []
    if f.capacity_ratio is not None:
        need = {True: "ran close to full", False: "never ran close to full", None: "unknown"}
        ev.append(
            evidence_entry(
                "systems",
                f"KV-cache capacity {f.capacity_ratio:.2f}x the reference "
                f"(required {th.required_capacity_ratio:g}x); the reference's cache "
                f"{need[f.capacity_needed]} at the workload's load",
            )
        )
    s, cand, ref = f.systems, f.candidate.name if f.candidate else "candidate", f.reference
    if s is not None:
        how = "interleaved in blocks" if s.interleaved else "one after another"
        floor = f"A/A control {s.control}" if s.control else "no A/A control (no floor)"
        ev.append(
            evidence_entry(
                "systems",
                f"systems rule: {s.family} cells measured {how}, {levels(s)}, threshold "
                f"{100 * th.systems_threshold:g}%, floor from the {floor}",
            )
        )
        ev += [
            {**evidence_entry("systems", cell_text(c, cand, ref)), "cell": c.to_json()}
            for c in s.cells
        ]
    cap = f.capacity_phase
    if cap is not None:
        ev.append(evidence_entry("systems", capacity_text(f)))
    return ev


def levels(rule: SystemsRule) -> str:
    """The cells' levels in words: alpha shared by the workload's cells (half of it, beside a
    capacity phase's cell, which has the other half)."""
    load = sum(c.phase != CAPACITY for c in rule.cells)
    text = f"the workload's {load} at {100 * rule.level:.2f}% each"
    if load == len(rule.cells):
        return f"{text} (alpha {rule.alpha:g} / {load})"
    capacity = 100 * (1 - rule.alpha / 2)
    return f"{text} (alpha {rule.alpha:g} / 2 / {load}), the capacity phase's at {capacity:g}%"


def capacity_text(f: Facts) -> str:
    cap = f.capacity_phase
    assert cap is not None
    if cap.status != "ran":
        return f"capacity phase {cap.status}: {cap.reason}"
    ref = cap.arms.get(f.reference)
    peak = (
        f"peak KV usage {100 * ref.peak_kv_usage:.0f}%, peak waiting "
        f"{ref.peak_waiting or 0:g}, preemptions {ref.preemptions or 0:g}"
        if ref is not None and ref.peak_kv_usage is not None
        else "no KV usage scraped"
    )
    full = "full" if cap.reference_full else "not full"
    stopped = f" ({cap.stopped})" if cap.stopped else ""
    return (
        f"capacity phase at concurrency {cap.concurrency}, {cap.cache_bytes or 0:,} bytes of KV "
        f"cache per server, {cap.blocks} blocks{stopped}: the reference's cache {full} ({peak})"
    )


def _cells(f: Facts, phase: str | None = None) -> list[SystemsCell]:
    cells = list(f.systems.cells) if f.systems is not None else []
    return [c for c in cells if (c.phase == CAPACITY) == (phase == CAPACITY)]


def gain(f: Facts, th: Thresholds, ev: list[dict[str, Any]]) -> Verdict:
    """Quality matched: does FP8 pay here? (The module's rule, in its order.)"""
    ref = f.reference
    if f.candidate is not None and f.candidate.emulated:
        ev.append(
            evidence_entry(
                "systems",
                f"{f.candidate.name} is emulated: its capacity and speed "
                "are a BF16 server's, so FP8's gain is not measured here",
            )
        )
        why = "emulated FP8, quality only: capacity and speed not measured"
        return verdict_record("keep", [f"matches {ref} in every bucket ({why})"], ev)
    ev += systems_evidence(f, th)
    cap_ok = f.capacity_ratio is not None and f.capacity_ratio >= th.required_capacity_ratio
    if cap_ok and f.capacity_needed is not False:
        held = f"holds {f.capacity_ratio:.2f}x the KV cache the workload fills"
        return verdict_record("keep", [f"matches {ref} in every bucket and {held}"], ev)
    load = _cells(f)
    decided = _at_load(load, ref, ev) or _capacity(f, _goodput(load), ev)
    if decided is not None:
        return decided
    return verdict_record("reject", _no_gain(f, cap_ok, load), ev)


def _goodput(cells: Sequence[SystemsCell]) -> list[SystemsCell]:
    return [c for c in cells if c.metric == "goodput_rps" and c.call != "unweighed"]


def _at_load(cells: Sequence[SystemsCell], ref: str, ev: list[dict[str, Any]]) -> Verdict | None:
    """Steps 2 and 3: goodput where the run has SLOs, else latency, at the workload's load."""
    goodput = _goodput(cells)
    weighed = goodput or [c for c in cells if c.metric in LOWER_IS_BETTER]
    worse = [c for c in weighed if c.call == "worse"]
    better = [c for c in weighed if c.call == "better"]
    if worse:
        if goodput:
            why = f"fewer requests per second within the SLOs ({_list(worse)})"
        else:
            why = (
                f"too short or prefill-heavy to pay off: slower beyond the A/A floor and the "
                f"threshold in {_list(worse)}"
            )
        return verdict_record("reject", [why], ev)
    if better:
        what = (
            f"serves more requests per second within the SLOs ({_list(better)})"
            if goodput
            else f"is faster ({_list(better)}) and slower in no cell weighed"
        )
        return verdict_record("keep", [f"matches {ref} in every bucket and {what}"], ev)
    return None


def _capacity(f: Facts, goodput: Sequence[SystemsCell], ev: list[dict[str, Any]]) -> Verdict | None:
    """Step 4: no loss at the workload's load; does the larger cache pay where it is full?
    The first reason says what decides (more there, or no gain), not the cell's figures nor
    whether "no gain" was fewer or no change (the second reason has them): so the same canary
    twice gives the same headline wherever it decides the same."""
    cells = [c for c in _cells(f, CAPACITY) if c.call != "unweighed"]
    if not cells:
        return None
    c, cap = cells[0], f.capacity_phase
    at = f"at concurrency {cap.concurrency}" if cap is not None else "in the capacity phase"
    name = NAMES.get(c.metric, c.metric)
    figures = (
        f"{name} where the reference's cache is full: {_pct(c.change)} [{_pct(c.lo)}, {_pct(c.hi)}]"
    )
    if c.call == "better":
        load = (
            "as many requests per second within the SLOs at the workload's load"
            if goodput
            else "no latency slower beyond the A/A floor at the workload's load"
        )
        return verdict_record(
            "keep",
            [
                f"matches {f.reference} in every bucket, {load}, and where the reference's "
                f"cache is full ({at}) it serves more {name} beyond the A/A floor and the "
                "threshold",
                figures,
            ],
            ev,
        )
    return verdict_record(
        "reject",
        [
            f"no gain: none at the workload's load, nor where the reference's cache is full ({at})",
            f"{figures}: {call_word(c)}",
        ],
        ev,
    )


def _no_gain(f: Facts, cap_ok: bool, load: Sequence[SystemsCell]) -> list[str]:
    """Why nothing shows a gain: the first reason in words that stay the same run after run,
    the second (where there is one) why the capacity phase's cell was not weighed."""
    weighed = [c for c in load if c.call != "unweighed"]
    speed = (
        "no latency beyond the A/A floor and the threshold"
        if weighed
        else "latency not weighed (" + (load[0].why if load else "no systems cells") + ")"
    )
    if not cap_ok:
        return [f"no memory or latency gain on this backend ({speed})"]
    cap = f.capacity_phase
    unweighed = [c.why for c in _cells(f, CAPACITY) if c.call == "unweighed"]
    capacity = (
        "no capacity phase"
        if cap is None
        else f"capacity phase {cap.status}: {cap.reason}"
        if cap.status != "ran"
        else "the capacity phase's cell not weighed"
    )
    first = f"no gain shown: the reference's cache never ran close to full, {speed}, and {capacity}"
    return [first, *(f"the capacity phase's cell: {why}" for why in unweighed[:1])]
