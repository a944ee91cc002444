"""The capacity phase, analysed: did the reference's cache run full, and what did each arm
serve there (``run.capacity_phase`` runs it; its figures are in the manifest's ``capacity`` block,
``capacity/results.jsonl`` and ``capacity/metrics/``).

Each arm (the reference, its A/A control on the same server, the candidate) sent the same
blocks of requests in turn; its rate in a block is the requests it served within the SLOs (or,
without SLOs, answered) over the block's time, and the rule's capacity cell pairs the
candidate's blocks with the reference's (``systems_cells.rate_cell``). The reference's cache
counts as full when it preempted a request, or when its peak KV usage reached ``FULL_USAGE``
while requests queued: only then is the cell weighed, since only then does it measure what a
larger cache buys.

The phase stops as soon as its cell's call at its planned blocks is decided
(``systems_cells.settled``) once the reference's cache was seen full: :func:`settled_call`,
which the run asks after every block and which reads the same figures as the analysis. A
phase stopped short of that (its time bound, an interrupt) is undecided, and its cell says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from replay.analysis.schemas import CapacityArm, CapacityPhase
from replay.analysis.summary import server_over
from replay.analysis.systems_cells import CAPACITY as PHASE
from replay.analysis.systems_cells import (
    Block,
    Planned,
    block_counts,
    block_list,
    block_rates,
    capacity_miss,
    rate_cell,
    settled,
)
from replay.core.records import Result
from replay.core.slo import SloSpec

FULL_USAGE = 0.9  # peak KV usage of the reference that counts as a full cache


def metric_name(slo: SloSpec | None) -> str:
    return "goodput_rps" if slo is not None else "answered_rps"


def _arm(
    results: Sequence[Result],
    blocks: Sequence[Block],
    series: Sequence[Mapping[str, Any]],
    cache: Mapping[str, Any],
    counts: Mapping[int, tuple[int, float]],
) -> CapacityArm:
    spans = [(a, b) for _, a, b in blocks]
    server = server_over(series, spans) if spans else None
    busy = sum(b - a for a, b in spans) if spans else None
    met = sum(n for n, _ in counts.values())
    size = cache.get("kv_cache_size_tokens")
    return CapacityArm(
        kv_cache_size_tokens=float(size) if size not in (None, "", "None") else None,
        requests=len(results),
        ok=sum(r.status == "ok" for r in results),
        met=met,
        busy_s=busy,
        rate_rps=met / busy if busy else None,
        peak_kv_usage=server.peak_kv_usage if server else None,
        peak_waiting=server.peak_waiting if server else None,
        preemptions=server.preemptions if server else None,
    )


def full(arm: CapacityArm | None) -> bool | None:
    """The cache ran full: the server preempted a request (it does so only when the cache
    cannot hold the running ones; the counter is exact), or its peak usage reached
    ``FULL_USAGE`` while requests queued (the usage gauge is sampled, every quarter second in
    the capacity phase, so a preemption between two scrapes is the surer sign)."""
    if arm is None or arm.peak_kv_usage is None:
        return None
    if (arm.preemptions or 0) > 0:
        return True
    return arm.peak_kv_usage >= FULL_USAGE and (arm.peak_waiting or 0) > 0


def capacity_phase(
    block: Mapping[str, Any],
    results: Sequence[Result],
    series: Mapping[str, Sequence[Mapping[str, Any]]],
    slo: SloSpec | None,
    reference: str,
    candidate: str,
    control: str | None,
) -> tuple[CapacityPhase, Planned | None]:
    """The phase's record and, when it ran, its cell to judge with the rest."""
    status, reason = str(block.get("status") or "skipped"), str(block.get("reason") or "")
    if status != "ran":
        return CapacityPhase(status=status, reason=reason), None
    return measured(block, results, series, slo, reference, candidate, control)


def settled_call(
    block: Mapping[str, Any],
    results: Sequence[Result],
    series: Mapping[str, Sequence[Mapping[str, Any]]],
    slo: SloSpec | None,
    roles: tuple[str, str, str | None],
    alpha: float,
    threshold: float,
) -> str | None:
    """The call the phase's cell gets at its planned blocks, once its blocks so far decide it
    (``systems_cells.settled``, at the capacity cell's share of ``alpha``) and the reference's
    cache was seen full; None while the phase must go on. ``roles``: the reference, the
    candidate and the A/A control."""
    record, cell = measured(block, results, series, slo, *roles)
    if not record.reference_full:
        return None
    return settled(cell, capacity_miss(alpha), threshold)


def measured(
    block: Mapping[str, Any],
    results: Sequence[Result],
    series: Mapping[str, Sequence[Mapping[str, Any]]],
    slo: SloSpec | None,
    reference: str,
    candidate: str,
    control: str | None,
) -> tuple[CapacityPhase, Planned]:
    """What the phase's blocks so far measured, and its cell."""
    arms_info: Mapping[str, Any] = block.get("arms") or {}
    metric = metric_name(slo)
    rates: dict[str, dict[int, float]] = {}
    arms: dict[str, CapacityArm] = {}
    for name, info in arms_info.items():
        mine = [r for r in results if r.target == name]
        blocks = block_list(info)
        counts = block_counts(mine, blocks, slo)
        rates[name] = block_rates(counts)
        server = series.get(str(info.get("server") or name), ())
        arms[name] = _arm(mine, blocks, server, info.get("cache_config") or {}, counts)
    is_full = full(arms.get(reference))
    why = "" if is_full else _not_full(arms.get(reference))
    stop: Mapping[str, Any] = block.get("stop") or {}
    record = CapacityPhase(
        status=str(block.get("status") or "ran"),
        reason=str(block.get("reason") or ""),
        concurrency=_int(block.get("concurrency")),
        cache_bytes=_int(block.get("cache_bytes")),
        max_model_len=_int(block.get("max_model_len")),
        blocks=max((len(block_list(i)) for i in arms_info.values()), default=0),
        metric=metric,
        arms=arms,
        reference_full=is_full,
        blocks_planned=_int(block.get("blocks_planned")),
        stopped=str(stop["words"]) if stop.get("words") else None,
    )
    cell = rate_cell(
        PHASE, metric, rates, reference, candidate, control if control in rates else None, why
    )
    cause = str(stop.get("cause") or "")
    return record, replace(cell, planned_blocks=record.blocks_planned, stopped=cause)


def _not_full(arm: CapacityArm | None) -> str:
    if arm is None or arm.peak_kv_usage is None:
        return "no KV usage was scraped from the reference's server"
    return (
        f"the reference's cache did not run full (peak KV usage {100 * arm.peak_kv_usage:.0f}%, "
        f"peak waiting {arm.peak_waiting or 0:g}, preemptions {arm.preemptions or 0:g})"
    )


def _int(x: Any) -> int | None:
    return int(x) if isinstance(x, int | float) and not isinstance(x, bool) else None
