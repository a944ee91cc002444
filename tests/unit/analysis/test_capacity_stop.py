"""The capacity phase's stop rule (``systems_cells.settled``): a cell short of its planned blocks
gets the call those would give as soon as the blocks not sent cannot change it, and none while
they could. Checked against the fixed design itself: every early call must be the call of the
planned blocks, whatever the missing ones turn out to be."""

from __future__ import annotations

import math

import numpy as np
import pytest

from replay.analysis.systems_cells import (
    CAPACITY,
    Planned,
    capacity_miss,
    judge,
    rule,
    settled,
)

MISS = capacity_miss(0.05)  # the capacity cell's share of alpha: 0.025
T = 0.05


def cell(changes: list[float], control: list[float], planned: int | None = 24) -> Planned:
    """A rate cell: block k's reference at 10 req/s, the candidate at 10 x e^change; the A/A
    control's blocks likewise."""
    pairs = [(k, 10.0, 10.0 * math.exp(d)) for k, d in enumerate(changes)]
    aa = [(k, 10.0, 10.0 * math.exp(d)) for k, d in enumerate(control)]
    return Planned(CAPACITY, None, "answered_rps", pairs, aa, planned_blocks=planned)


def complete(p: Planned, mine: list[float], control: list[float]) -> Planned:
    """``p`` with these blocks sent as well, judged as the fixed design would."""
    n, c = len(p.pairs), len(p.control or [])
    more = [(n + i, 10.0, 10.0 * math.exp(d)) for i, d in enumerate(mine)]
    aa = [(c + i, 10.0, 10.0 * math.exp(d)) for i, d in enumerate(control)]
    return Planned(p.phase, p.bucket, p.metric, p.pairs + more, (p.control or []) + aa)


def test_no_change_is_settled_once_neither_way_can_be_reached() -> None:
    """The interval at 24 blocks runs from d(7) to d(18): seven blocks below +5% already keep
    its lower end there, and seven above -5% its upper end, whatever the rest give."""
    rng = np.random.default_rng(3)
    small = list(rng.uniform(-0.03, 0.03, 7))
    assert settled(cell(small, small), MISS, T) == "same"
    assert settled(cell(small[:6], small[:6]), MISS, T) is None  # six: one more could decide
    c = judge(cell(small, small), MISS, T)
    assert c.call == "same" and c.pairs == 7 and c.why == ""


def test_a_clear_gain_is_settled_only_when_no_block_can_undo_it() -> None:
    """Twice the rate in every block: 'more' needs the interval's lower end past +5% and the
    median past the floor whatever comes; with the control's blocks missing, its floor could
    still be anything until only a few blocks are left."""
    gain, flat = [math.log(2.0)] * 20, [0.0] * 20
    assert settled(cell(gain, flat), MISS, T) == "better"
    assert settled(cell(gain[:10], flat[:10]), MISS, T) is None
    assert judge(cell(gain[:10], flat[:10]), MISS, T).call == "unweighed"


@pytest.mark.parametrize("seed", range(40))
def test_an_early_call_is_the_planned_blocks_call_whatever_the_rest_give(seed: int) -> None:
    rng = np.random.default_rng(seed)
    planned = 24
    shift = rng.choice([0.0, 0.3, -0.3, 1.0])
    have = int(rng.integers(6, planned))
    mine = list(rng.normal(shift, 0.2, have))
    control = list(rng.normal(0.0, 0.2, have))
    p = cell(mine, control, planned)
    call = settled(p, MISS, T)
    for _ in range(30):
        spread = rng.choice([0.05, 0.5, 5.0])
        rest = list(rng.normal(rng.normal(0, 1), spread, planned - have))
        aa = list(rng.normal(rng.normal(0, 1), spread, planned - have))
        full = judge(complete(p, rest, aa), MISS, T).call
        if call is not None:
            assert full == call, (seed, have, call, full)


def test_a_phase_stopped_short_undecided_says_so() -> None:
    p = cell([0.0, 0.4, -0.4], [0.0, 0.1, -0.1])
    short = Planned(
        p.phase, p.bucket, p.metric, p.pairs, p.control, planned_blocks=24,
        stopped="stopped by its time bound, 600 s",
    )  # fmt: skip
    c = judge(short, MISS, T)
    assert c.call == "unweighed"
    assert c.why.startswith("undecided after 3 of 24 blocks (stopped by its time bound, 600 s)")


def test_at_its_planned_blocks_the_cell_is_judged_as_before() -> None:
    rng = np.random.default_rng(5)
    mine, control = list(rng.normal(0, 0.1, 24)), list(rng.normal(0, 0.1, 24))
    planned = judge(cell(mine, control, 24), MISS, T)
    fixed = judge(cell(mine, control, None), MISS, T)
    assert planned == fixed


def test_the_rule_judges_a_capacity_cell_at_its_share_of_alpha() -> None:
    small = [0.01, -0.01, 0.02, -0.02, 0.0, 0.01, -0.01]
    r = rule([cell(small, small)], alpha=0.05, threshold=T, control="c", interleaved=True)
    (c,) = r.cells
    assert c.call == "same" and c.level == pytest.approx(1 - MISS)
