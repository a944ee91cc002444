"""The systems rule: its distribution-free intervals, the call of one cell, and the decision
table of "does FP8 pay?" (``verdict.payoff``), with the promise it keeps: "faster" is never said
while a weighed latency is slower."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest

from replay.analysis.schemas import CapacityArm, CapacityPhase
from replay.analysis.stats.binomial import binom_cdf_half
from replay.analysis.stats.median_change import (
    log_ratios,
    median_change,
    median_changes,
    min_pairs,
    order_rank,
)
from replay.analysis.systems import systems
from replay.analysis.systems_cells import (
    ONE_BLOCK,
    Planned,
    block_changes,
    direction,
    judge,
    latency_cells,
)
from replay.analysis.thresholds import Thresholds
from replay.analysis.verdict.facts import ArmFacts, BucketFacts, Facts
from replay.analysis.verdict.rule import decide
from replay.core.records import Result
from tests.support.systems_cases import cell, rule

# -- the interval ------------------------------------------------------------------------------


@pytest.mark.parametrize("miss", [0.05, 0.05 / 9, 0.05 / 36])
@pytest.mark.parametrize("n", [1, 5, 8, 9, 10, 20, 64, 200])
def test_the_order_statistics_cover_at_least_the_level_and_no_tighter_pair_does(
    n: int, miss: float
) -> None:
    k = order_rank(n, miss)
    if k == 0:
        assert 2 * binom_cdf_half(0, n) > miss  # even the extremes miss too often
        assert n < min_pairs(miss)
        return
    assert n >= min_pairs(miss)
    assert 2 * binom_cdf_half(k - 1, n) <= miss  # coverage >= 1 - miss, exactly
    assert k == (n + 1) // 2 or 2 * binom_cdf_half(k, n) > miss  # the tightest such pair


def test_min_pairs_is_the_first_n_with_an_interval() -> None:
    for miss in (0.05, 0.01, 0.05 / 9, 0.05 / 40):
        n = min_pairs(miss)
        assert order_rank(n, miss) == 1 and order_rank(n - 1, miss) == 0


def test_one_pair_is_a_point_never_an_interval() -> None:
    ch = median_change(log_ratios([925.0], [0.5]), 0.05)
    assert ch is not None and ch.n == 1 and ch.lo is None and ch.hi is None
    assert median_change([], 0.05) is None


def test_the_interval_is_the_order_statistics_of_the_log_ratios() -> None:
    ref = np.full(20, 100.0)
    cand = 100.0 * np.exp(np.linspace(-0.2, 0.2, 20))
    ch = median_change(log_ratios(ref, cand), 0.05)
    assert ch is not None
    k = order_rank(20, 0.05)  # 6: P(X <= 5) = 0.0207 for Binomial(20, 1/2)
    d = np.sort(np.log(cand / ref))
    assert (ch.lo, ch.hi) == pytest.approx((d[k - 1], d[20 - k]))
    assert ch.median == pytest.approx(0.0, abs=1e-12)
    med, lo, hi = median_changes(np.log(cand / ref)[None, :], 0.05)
    assert (med[0], lo[0], hi[0]) == pytest.approx((ch.median, ch.lo, ch.hi))


def test_log_ratios_leave_out_what_was_not_measured() -> None:
    # A latency of 0 (coalesced stamps) or a missing value is no measurement.
    d = log_ratios([10.0, 0.0, 10.0, float("nan")], [20.0, 5.0, 0.0, 1.0])
    assert d.tolist() == pytest.approx([math.log(2.0)])
    with pytest.raises(ValueError, match="reference values"):
        log_ratios([1.0], [1.0, 2.0])


# -- one cell's call ---------------------------------------------------------------------------

T = math.log1p(0.05)


@pytest.mark.parametrize(
    ("median", "lo", "hi", "floor", "want"),
    [
        (0.20, 0.10, 0.30, 0.05, 1),  # beyond the threshold and the floor: higher
        (-0.20, -0.30, -0.10, 0.05, -1),  # lower
        (0.20, 0.04, 0.30, 0.05, 0),  # its interval reaches below the threshold
        (0.20, 0.10, 0.30, 0.25, 0),  # its median within the A/A floor
        (0.02, 0.01, 0.03, 0.0, 0),  # significant, but smaller than the threshold
        (0.20, float("nan"), float("nan"), 0.05, 0),  # no interval: nothing to judge
        (0.20, 0.10, 0.30, float("nan"), 0),  # no floor: nothing to judge
    ],
)
def test_direction(median: float, lo: float, hi: float, floor: float, want: int) -> None:
    assert int(direction(median, lo, hi, floor, 0.05)) == want


def _planned(cand_scale: float, control: bool = True, n: int = 40) -> Planned:
    """n blocks of two requests each."""
    rng = np.random.default_rng(7)
    ref = 100 * np.exp(rng.normal(0, 0.05, 2 * n))
    cand = cand_scale * 100 * np.exp(rng.normal(0, 0.05, 2 * n))
    ctl = 100 * np.exp(rng.normal(0, 0.05, 2 * n))
    blocks = [i // 2 for i in range(2 * n)]
    pairs = list(zip(blocks, ref.tolist(), cand.tolist(), strict=True))
    aa = list(zip(blocks, ref.tolist(), ctl.tolist(), strict=True)) if control else None
    return Planned("c4", "<256", "ttft_ms", pairs, aa)


def test_judge_calls_a_slower_a_faster_and_an_unchanged_cell() -> None:
    assert judge(_planned(1.3), 0.05 / 9, 0.05).call == "worse"
    assert judge(_planned(0.7), 0.05 / 9, 0.05).call == "better"
    same = judge(_planned(1.0), 0.05 / 9, 0.05)
    assert same.call == "same" and same.floor is not None and same.lo is not None
    assert same.pairs == 40 and same.requests == 80 and same.unit == "blocks"


def test_judge_leaves_unweighed_what_it_cannot_judge() -> None:
    assert "no A/A control" in judge(_planned(1.3, control=False), 0.05, 0.05).why
    few = judge(_planned(1.3, n=3), 0.05, 0.05)
    assert few.call == "unweighed" and few.lo is None and "needs 6" in few.why
    p = _planned(1.3)
    short = Planned(p.phase, p.bucket, p.metric, p.pairs, [(0, 1.0, 1.0)])
    assert "A/A control has 1 block" in judge(short, 0.05, 0.05).why


def test_a_block_is_one_unit_whatever_its_requests() -> None:
    """Requests of one block moved together (a neighbour's burst in one arm's turn): twenty
    of them in one block are one value, so no interval rests on them."""
    p = _planned(1.3, n=1)
    one = Planned(p.phase, p.bucket, p.metric, [(0, 100.0, 130.0)] * 20, [(0, 100.0, 100.0)] * 20)
    cell = judge(one, 0.05, 0.05)
    assert cell.pairs == 1 and cell.requests == 20 and cell.call == "unweighed"
    assert block_changes([(0, 1.0, 2.0), (0, 1.0, 4.0), (1, 1.0, 1.0)]) == pytest.approx(
        [math.log(2.0) * 1.5, 0.0]
    )


def _result(target: str, rid: str, bucket: str, ttft: float) -> Result:
    return Result(
        request_id=rid,
        target=target,
        phase="c4",
        bucket=bucket,
        scheduled=0.0,
        sent=0.0,
        first_token=ttft,
        done=ttft + 0.1,
        output_tokens=2,
        chunk_times=[ttft, ttft + 0.1],
        chunk_tokens=[1, 1],
    )


def test_a_bucket_with_one_pair_gives_no_interval() -> None:
    # The real model's three-way canary once showed "-925 [-925, -925]" over one pair.
    results = [_result("bf16", "r0", ">=1K", 1.0), _result("fp8", "r0", ">=1K", 0.075)]
    row = systems(results, "bf16", "fp8", "c4").buckets[">=1K"].e2e_ms
    assert row is not None and row.pairs == 1 and row.lo is None and row.hi is None
    blocks = {"bf16": {"c4": [(0, -1.0, 10.0)]}, "fp8": {"c4": [(0, -1.0, 10.0)]}}
    cells = latency_cells(results, "bf16", "fp8", None, ["c4"], blocks)
    assert {judge(c, 0.05, 0.05).call for c in cells} == {"unweighed"}


def test_a_phase_sent_whole_is_one_block_and_weighs_nothing() -> None:
    results = [
        _result(t, f"r{i}", "<256", 0.1 * (1 + i % 3)) for i in range(40) for t in ("a", "b")
    ]
    cells = latency_cells(results, "a", "b", "a", ["c4"], {})
    assert cells and all(judge(c, 0.05, 0.05).why == ONE_BLOCK for c in cells)


# -- the decision ------------------------------------------------------------------------------


def matched(**systems: object) -> Facts:
    same = tuple(BucketFacts(b, 200, 0.0, -0.02, 0.02, 1.0, None, None, 2, 2) for b in "ab")
    return Facts("bf16", ArmFacts("fp8", buckets=same), **systems)  # type: ignore[arg-type]


def capacity(call: str, full: bool = True) -> tuple[CapacityPhase, object]:
    arm = CapacityArm(
        kv_cache_size_tokens=4096.0,
        requests=768,
        ok=768,
        met=768,
        busy_s=30.0,
        rate_rps=25.6,
        peak_kv_usage=1.0 if full else 0.4,
        peak_waiting=8.0 if full else 0.0,
        preemptions=0.0,
    )
    phase = CapacityPhase(
        status="ran",
        reason="sized",
        concurrency=16,
        cache_bytes=8 << 20,
        max_model_len=2048,
        blocks=12,
        metric="answered_rps",
        arms={"bf16": arm},
        reference_full=full,
    )
    return phase, cell("answered_rps", call, phase="capacity", pairs=12)


CAP_BETTER, CAP_BETTER_CELL = capacity("better")
CAP_SAME, CAP_SAME_CELL = capacity("same")
NOT_RUN = CapacityPhase(status="skipped", reason="remote targets")
LATENCY_SAME = (cell("ttft_ms", "same"), cell("e2e_ms", "same"))

TABLE = {
    "keep: the workload fills the reference's cache, whatever the latency": (
        matched(
            capacity_ratio=2.0,
            capacity_needed=True,
            systems=rule(cell("ttft_ms", "worse")),
        ),
        "keep",
        "the KV cache the workload fills",
    ),
    "keep: faster in a cell, slower in none": (
        matched(
            capacity_ratio=2.0,
            capacity_needed=False,
            systems=rule(cell("ttft_ms", "better"), cell("e2e_ms", "same")),
        ),
        "keep",
        "is faster",
    ),
    "reject: slower in one bucket though faster in another": (
        matched(
            capacity_ratio=2.0,
            capacity_needed=False,
            systems=rule(cell("e2e_ms", "better", "<256"), cell("e2e_ms", "worse", ">=1K")),
        ),
        "reject",
        "too short or prefill-heavy",
    ),
    "reject: slower at its own load, even though the capacity phase pays": (
        matched(
            capacity_ratio=2.0,
            capacity_needed=False,
            systems=rule(cell("ttft_ms", "worse"), CAP_BETTER_CELL),
            capacity_phase=CAP_BETTER,
        ),
        "reject",
        "slower beyond the A/A floor",
    ),
    "keep: no loss at its own load, more requests/s where the cache is full": (
        matched(
            capacity_ratio=2.0,
            capacity_needed=False,
            systems=rule(*LATENCY_SAME, CAP_BETTER_CELL),
            capacity_phase=CAP_BETTER,
        ),
        "keep",
        "where the reference's cache is full",
    ),
    "reject: the capacity phase shows no gain": (
        matched(
            capacity_ratio=2.0,
            capacity_needed=False,
            systems=rule(*LATENCY_SAME, CAP_SAME_CELL),
            capacity_phase=CAP_SAME,
        ),
        "reject",
        "no gain",
    ),
    "reject: nothing beyond the floor and no capacity phase": (
        matched(
            capacity_ratio=2.0,
            capacity_needed=False,
            systems=rule(*LATENCY_SAME),
            capacity_phase=NOT_RUN,
        ),
        "reject",
        "capacity phase skipped: remote targets",
    ),
    "reject: every latency unweighed (no control)": (
        matched(
            capacity_ratio=2.0,
            capacity_needed=False,
            systems=rule(cell("ttft_ms", "unweighed"), control=None),
        ),
        "reject",
        "latency not weighed",
    ),
    "keep: with SLOs, more goodput though a latency is slower": (
        matched(
            capacity_ratio=2.0,
            capacity_needed=False,
            systems=rule(cell("goodput_rps", "better"), cell("ttft_ms", "worse")),
        ),
        "keep",
        "within the SLOs",
    ),
    "reject: with SLOs, fewer requests within them": (
        matched(
            capacity_ratio=2.0,
            capacity_needed=False,
            systems=rule(cell("goodput_rps", "worse"), cell("ttft_ms", "better")),
        ),
        "reject",
        "fewer requests per second within the SLOs",
    ),
    "reject: no memory gain and nothing faster": (
        matched(capacity_ratio=1.0, systems=rule(*LATENCY_SAME)),
        "reject",
        "no memory or latency gain",
    ),
}


@pytest.mark.parametrize("name", list(TABLE))
def test_the_systems_decision(name: str) -> None:
    facts, verdict, words = TABLE[name]
    v = decide(facts, Thresholds())
    assert v.verdict == verdict, (name, v.reasons)
    assert words in v.reasons[0], (name, v.reasons)
    # Every cell weighed is in the evidence, with its interval and floor.
    assert facts.systems is not None
    texts = [str(e["text"]) for e in v.evidence if e["kind"] == "systems"]
    for c in facts.systems.cells:
        assert any(e.get("cell") == c.to_json() for e in v.evidence), c
    assert any(t.startswith("systems rule:") for t in texts)


def test_the_capacity_phase_gives_one_headline_per_decision_not_per_figure() -> None:
    """The same canary twice: its capacity cell's figures differ run to run, and where its
    cell says no gain it may say fewer in one run and no change in the next. The headline
    says what decided (no gain), the second reason the figures and the call."""
    worse, _ = capacity("worse")
    heads, seconds = set(), []
    for call in ("same", "worse"):
        c = cell("answered_rps", call, phase="capacity", pairs=12)
        for change in (-0.19, -0.08):
            weighed = replace(c, change=change, lo=change - 0.1, hi=change + 0.1)
            v = decide(
                matched(
                    capacity_ratio=2.0,
                    capacity_needed=False,
                    systems=rule(*LATENCY_SAME, weighed),
                    capacity_phase=worse,
                ),
                Thresholds(),
            )
            assert v.verdict == "reject", v.reasons
            heads.add(v.headline)
            seconds.append(v.reasons[1])
            assert f"{100 * change:+.1f}%" in v.reasons[1] and "%" not in v.headline
    assert heads == {
        "REJECT FP8 for this path: no gain: none at the workload's load, nor where the "
        "reference's cache is full (at concurrency 16)"
    }
    assert seconds[0].endswith("no change beyond the floor and the threshold")
    assert seconds[-1].endswith(": fewer")


CALLS = ("better", "worse", "same", "unweighed")


def test_faster_is_never_said_while_a_weighed_latency_is_slower() -> None:
    """Every combination of calls over two buckets x TTFT and E2E, with and without a
    goodput cell and a capacity phase."""
    for ttft, e2e, ttft2, goodput, cap in itertools.product(
        CALLS, CALLS, CALLS, (None, "better", "same"), (None, "better", "same")
    ):
        cells = [cell("ttft_ms", ttft, "a"), cell("e2e_ms", e2e, "a"), cell("ttft_ms", ttft2, "b")]
        if goodput:
            cells.append(cell("goodput_rps", goodput))
        phase = None
        if cap:
            phase, cap_cell = capacity(cap)
            cells.append(cap_cell)  # type: ignore[arg-type]
        facts = matched(
            capacity_ratio=2.0, capacity_needed=False, systems=rule(*cells), capacity_phase=phase
        )
        v = decide(facts, Thresholds())
        slower = "worse" in (ttft, e2e, ttft2)
        if slower:
            assert "faster" not in v.headline, v.headline
        if v.verdict == "keep":  # with SLOs goodput speaks for latency; without, none slower
            assert goodput is not None or not slower, v.headline


def test_a_preemption_is_a_full_cache_whatever_the_sampled_peak() -> None:
    """The usage gauge is read once a second and misses peaks; a preemption (an exact
    counter) happens only when the cache cannot hold what runs. Queueing alone, below the
    peak, is not enough: a request may wait for the step's token budget."""
    from replay.analysis.capacity import full
    from replay.analysis.schemas import CapacityArm

    def arm(peak: float, waiting: float, preemptions: float) -> CapacityArm:
        return CapacityArm.from_json(
            {"peak_kv_usage": peak, "peak_waiting": waiting, "preemptions": preemptions}
        )

    assert full(arm(0.68, 4, 1)) is True
    assert full(arm(0.95, 2, 0)) is True
    assert full(arm(0.79, 3, 0)) is False
    assert full(arm(0.95, 0, 0)) is False
    assert full(None) is None
