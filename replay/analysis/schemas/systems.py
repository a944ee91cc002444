"""The systems rule's records in summary.json (``Systems.rule`` and ``Systems.capacity``):
every metric the rule weighs as a cell (``analysis.systems_cells``), the rule's setting, and
the capacity phase (``analysis.capacity``). ``schemas`` re-exports them beside the rest."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field

from replay.core.record_json import Record, absent_if_none, record


@record
class SystemsCell(Record):
    """One systems metric the rule weighs (``analysis.systems_cells``): the candidate against
    the reference over pairs (the same requests, or the same blocks of an interleaved phase),
    as the median of candidate / reference - 1 with a distribution-free interval at the
    rule's per-cell level, the A/A control's floor, and the call."""

    phase: str
    bucket: str | None  # None: the whole phase (a rate over its blocks)
    metric: str  # ttft_ms | itl_ms | e2e_ms (lower is better) | goodput_rps | answered_rps
    unit: str  # what the interval is over: "blocks" (each the median of its pairs)
    pairs: int  # of those
    reference: float | None  # medians over the pairs
    candidate: float | None
    change: float | None  # median of candidate / reference - 1
    lo: float | None  # None: too few pairs for an interval at the level
    hi: float | None
    floor: float | None  # largest change the A/A control's interval reaches; None: none
    call: str  # better | worse | same | unweighed
    why: str = ""  # unweighed: why
    level: float | None = None  # its interval's (two-sided) level: 1 - its share of alpha
    requests: int | None = None  # a latency cell's requests paired within those blocks


@record
class SystemsRule(Record):
    """The systems rule's setting and every cell it weighed (``verdict.payoff`` decides)."""

    alpha: float
    threshold: float  # smallest change that counts, either way (0.05: x1.05 or /1.05)
    family: int  # cells weighed together (Bonferroni; a capacity cell has half of alpha)
    level: float  # the workload's cells' level (each cell states its own)
    min_pairs: int  # the fewest pairs with an interval at that level
    control: str | None  # the A/A control that gave the floors
    interleaved: bool  # arms measured in alternating blocks
    cells: tuple[SystemsCell, ...]


@record
class CapacityArm(Record):
    """One arm of the capacity phase: its server's cache and what the phase did to it."""

    kv_cache_size_tokens: float | None
    requests: int
    ok: int
    met: int  # within the SLOs (or answered, without SLOs)
    busy_s: float | None
    rate_rps: float | None  # met / busy_s
    peak_kv_usage: float | None
    peak_waiting: float | None
    preemptions: float | None


@record
class CapacityPhase(Record):
    """The capacity phase (``run.capacity_phase``): both servers restarted with the same, smaller
    KV-cache memory and loaded at ``concurrency`` until the reference's cache is full; whether
    it was. Its cell (phase ``capacity`` in ``SystemsRule.cells``) compares the rates."""

    status: str  # ran | skipped | failed
    reason: str
    concurrency: int | None = None
    cache_bytes: int | None = None
    max_model_len: int | None = None
    blocks: int = 0
    metric: str | None = None  # goodput_rps with --slo, else answered_rps
    arms: Mapping[str, CapacityArm] = field(default_factory=dict)
    reference_full: bool | None = None  # its cache ran full and it queued or preempted
    blocks_planned: int | None = absent_if_none()  # its cell's call is for these blocks
    stopped: str | None = absent_if_none()  # decided at a block, its time bound, or all sent
