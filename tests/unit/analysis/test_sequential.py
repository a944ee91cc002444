"""The sequential canary (replay.analysis.sequential.state*): its capital, state, planner and, by
simulation, its error rates and the pairs it needs.

The simulation is ``bench/sequential_sim.py``'s, which the README's table comes from, with
10,000 canaries per case. A wrong-decision share must stay within alpha plus a Monte Carlo
allowance of 3 standard errors at alpha (0.0565 for 10,000 canaries; a share of exactly alpha
is above it with chance 0.13%); the exact tests below check the level with no allowance at all,
summing the exact probability that the capital ever crosses, looked at after every pair.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from replay.analysis.sequential import plan as sequential_plan
from replay.analysis.sequential.capital import (
    BETS,
    log_capital,
    lower_bound,
    pairs_to_cross,
    rejects,
    upper_bound,
)
from replay.analysis.sequential.state import (
    EQUIVALENT,
    LOSS,
    OPEN,
    SequentialState,
)
from replay.analysis.stats.rule import Rule

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import sequential_sim as sim

NAMES = ("<8K", "8K-32K", "32K-64K", ">=64K")
TOL, ALPHA = Rule().tolerance, Rule().alpha


def _rounds(seed: int, count: int, p10: float = 0.04, p01: float = 0.02) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        r = {}
        for name in NAMES:
            n = int(rng.integers(0, 30))
            x = int(rng.binomial(n, p10))
            r[name] = (n, x, int(rng.binomial(n - x, p01 / (1 - p10))))
        out.append(r)
    return out


def _run(rounds: list[dict], state: SequentialState | None = None) -> SequentialState:
    state = state or SequentialState.start(NAMES)
    for r in rounds:
        state = state.update({k: v for k, v in r.items() if k in state.open_buckets})
    return state


# --- the capital -------------------------------------------------------------------------


def test_the_mixture_is_the_average_of_constant_bets_pair_by_pair() -> None:
    """Counts are enough: the capital of the pairs one at a time, in any order, is the
    counts' capital."""
    rng = np.random.default_rng(7)
    z = rng.choice([1, -1, 0], size=120, p=[0.1, 0.05, 0.85])
    c = (np.arange(BETS) + 0.5) / BETS
    w = c * np.sqrt(1 - c)
    w /= w.sum()
    x, y = int((z == 1).sum()), int((z == -1).sum())
    for m, side in ((0.0, "above"), (0.03, "above"), (TOL, "below"), (-0.2, "below")):
        lam = c / (1 + m) if side == "above" else c / (1 - m)
        sign = 1 if side == "above" else -1
        for order in (z, rng.permutation(z)):
            each = np.prod(1 + lam[:, None] * sign * (order[None, :] - m), axis=1)
            got = float(log_capital(len(z), x, y, m, side))
            assert got == pytest.approx(math.log(float(w @ each)), rel=1e-10)


def test_no_pairs_no_evidence() -> None:
    assert float(log_capital(0, 0, 0, 0.0, "above")) == pytest.approx(0.0, abs=1e-12)
    assert lower_bound(0, 0, 0, ALPHA) == -1.0
    assert upper_bound(0, 0, 0, ALPHA) == 1.0


def test_bounds_are_where_the_capital_crosses() -> None:
    for n, x, y in ((100, 2, 2), (300, 30, 5), (60, 0, 0), (400, 10, 40)):
        lo, hi = lower_bound(n, x, y, ALPHA), upper_bound(n, x, y, ALPHA)
        assert lo < (x - y) / n < hi
        assert bool(rejects(n, x, y, lo - 1e-6, "above", ALPHA))
        assert not bool(rejects(n, x, y, lo + 1e-6, "above", ALPHA))
        assert bool(rejects(n, x, y, hi + 1e-6, "below", ALPHA))
        assert not bool(rejects(n, x, y, hi - 1e-6, "below", ALPHA))
        # 0 is the bisection's first probe: the lower end is >= 0 exactly on a loss
        assert (lo >= 0.0) == bool(rejects(n, x, y, 0.0, "above", ALPHA))


def test_the_projection_finds_the_first_crossing() -> None:
    """At rates with exact counts (no agreeing pair disagrees) the projection is the first n
    at which the real capital crosses."""
    first = next(n for n in range(1, 500) if rejects(n, 0, 0, TOL, "below", ALPHA))
    assert pairs_to_cross((0.0, 0.0), TOL, "below", ALPHA) == first
    assert pairs_to_cross((0.0, 0.0), TOL, "below", ALPHA, at_least=first + 7) == first + 7
    first_loss = next(n for n in range(1, 500) if rejects(n, n, 0, 0.0, "above", ALPHA))
    assert pairs_to_cross((1.0, 0.0), 0.0, "above", ALPHA) == first_loss
    assert pairs_to_cross((0.1, 0.0), TOL, "below", ALPHA) is None  # drop above the tolerance
    assert pairs_to_cross((0.02, 0.02), 0.0, "above", ALPHA) is None  # no drop: never a loss


def _ever_crosses(p10: float, p01: float, m: float, side: str, alpha: float, n: int) -> float:
    """Exact chance that the capital crosses at some pair up to n, looked at after every
    pair, plus the mass that wandered off the table (an upper bound on the level used)."""
    top = 100
    mass = np.zeros((top + 1, top + 1))
    mass[0, 0] = 1.0
    xs, ys = np.meshgrid(np.arange(top + 1), np.arange(top + 1), indexing="ij")
    crossed = 0.0
    for k in range(1, n + 1):
        step = (1 - p10 - p01) * mass
        step[1:, :] += p10 * mass[:-1, :]
        step[:, 1:] += p01 * mass[:, :-1]
        mass = step
        hit = rejects(k, xs, ys, m, side, alpha) & (xs + ys <= k)
        if side == "below":
            hit &= k >= Rule().min_pairs
        crossed += float(mass[hit].sum())
        mass[hit] = 0.0
    return crossed + (1.0 - crossed - float(mass.sum()))


@pytest.mark.parametrize(
    ("p10", "p01", "m", "side"),
    [
        (TOL, 0.0, TOL, "below"),  # a drop of exactly the tolerance, only regressions
        (TOL + 0.025, 0.025, TOL, "below"),  # ... with 10% disagreement
        (TOL + 0.1, 0.1, TOL, "below"),  # ... with 25%
        (0.025, 0.025, 0.0, "above"),  # no drop: a loss
        (0.1, 0.1, 0.0, "above"),
    ],
)
def test_the_level_holds_exactly_when_looked_at_after_every_pair(
    p10: float, p01: float, m: float, side: str
) -> None:
    assert _ever_crosses(p10, p01, m, side, ALPHA, 300) <= ALPHA


# --- the state -----------------------------------------------------------------------------


def test_the_state_round_trips_exactly_and_resumes() -> None:
    rounds = _rounds(1, 12)
    state = _run(rounds[:6])
    d = state.to_json()
    back = SequentialState.from_json(json.loads(json.dumps(d)))
    assert back == state
    assert back.to_json() == d
    assert _run(rounds[6:], back) == _run(rounds[6:], state)
    assert len(state.history) == sum(1 for _ in state.history)
    assert set(d) >= {"format", "rule", "round", "decision", "buckets", "pool", "history"}


def test_from_json_refuses_what_it_cannot_resume() -> None:
    d = _run(_rounds(2, 3)).to_json()
    with pytest.raises(ValueError, match="format"):
        SequentialState.from_json({**d, "format": "other/9"})
    bad = json.loads(json.dumps(d))
    bad["buckets"][0]["regressions"] = bad["buckets"][0]["pairs"] + 1
    with pytest.raises(ValueError, match="regressions"):
        SequentialState.from_json(bad)


def test_intervals_only_narrow_round_by_round() -> None:
    state = _run(_rounds(3, 25, p10=0.05, p01=0.03))
    for name in (*NAMES, None):
        path = state.path(name)
        assert path, name
        lows, highs = [r.lower for r in path], [r.upper for r in path]
        assert lows == sorted(lows) and highs == sorted(highs, reverse=True), name
        assert [r.round for r in path] == sorted({r.round for r in path})
    # one row per round per open bucket, and the pool's
    for k in range(1, state.round + 1):
        assert len([r for r in state.history if r.round == k and r.bucket is None]) == 1


def test_a_clear_loss_and_a_clear_match() -> None:
    state = SequentialState.start(NAMES)
    state = state.update({NAMES[0]: (60, 15, 0)})
    assert state.bucket(NAMES[0]).status == LOSS and state.decision == LOSS
    assert state.bucket(NAMES[0]).lower >= 0.0 and state.open_buckets == ()

    n0 = pairs_to_cross((0.0, 0.0), TOL, "below", ALPHA, at_least=Rule().min_pairs)
    assert n0 is not None
    state = SequentialState.start(NAMES)
    state = state.update({b: (n0 - 1, 0, 0) for b in NAMES})
    assert state.decision == OPEN
    state = state.update({b: (1, 0, 0) for b in NAMES})
    assert state.decision == EQUIVALENT and state.round == 2
    assert all(b.upper <= TOL and b.decided_round == 2 for b in state.buckets)


def test_min_pairs_holds_back_equivalence() -> None:
    rule = Rule(min_pairs=200)
    state = SequentialState.start(["only"], rule).update({"only": (150, 0, 0)})
    assert state.bucket("only").status == OPEN and state.bucket("only").upper < TOL
    state = state.update({"only": (50, 0, 0)})
    assert state.bucket("only").status == EQUIVALENT


def test_a_shift_in_every_bucket_is_a_pooled_loss() -> None:
    """6 regressions and no improvement in each of four buckets of 40 pairs: no bucket shows
    a loss at its level, the pool does (the stratified test's case in exact_tests)."""
    state = SequentialState.start(NAMES).update({b: (40, 6, 0) for b in NAMES})
    assert all(b.status == OPEN for b in state.buckets)
    assert state.pool.status == LOSS and state.decision == LOSS and state.pool.lower > 0


def test_one_bucket_has_no_pool_and_all_of_the_loss_alpha() -> None:
    rule = Rule()
    assert rule.bucket_loss_alpha(1) == ALPHA
    assert rule.bucket_loss_alpha(4) == pytest.approx(ALPHA / 8)
    assert rule.pool_loss_alpha() == pytest.approx(ALPHA / 2)
    state = SequentialState.start(["only"]).update({"only": (30, 8, 1)})
    assert not state.pooled and state.pool.pairs == 0
    assert [r.bucket for r in state.history] == ["only"]


def test_a_loss_wins_over_a_match_in_the_same_round_and_decided_buckets_stay() -> None:
    # a drop of about 2 points, well measured: both questions settle at once
    state = SequentialState.start(["only"]).update({"only": (40_000, 1_400, 600)})
    assert state.bucket("only").status == LOSS
    assert state.bucket("only").upper < TOL
    later = state.update({"only": (100, 0, 100)})  # requests that were in flight
    assert later.bucket("only").status == LOSS and later.bucket("only").pairs == 40_100


def test_update_and_rule_refuse_bad_input() -> None:
    state = SequentialState.start(NAMES)
    with pytest.raises(KeyError, match="no bucket"):
        state.update({"nope": (1, 0, 0)})
    with pytest.raises(ValueError, match="regressions"):
        state.update({NAMES[0]: (3, 2, 2)})
    with pytest.raises(ValueError, match="distinct"):
        SequentialState.start(["a", "a"])
    with pytest.raises(ValueError, match="pool_share"):
        Rule(pool_share=1.0)


# --- what more, and the next round ---------------------------------------------------------


def test_needs_names_the_question_and_the_pairs() -> None:
    state = SequentialState.start(NAMES)
    fresh = sequential_plan.needs(state)
    n0 = pairs_to_cross((0.0, 0.0), TOL, "below", ALPHA, at_least=Rule().min_pairs)
    assert [x.bucket for x in fresh] == [*NAMES, None]
    assert all(x.question == EQUIVALENT and x.pairs == n0 for x in fresh[:-1])
    assert "if no pair disagrees" in fresh[0].reason
    assert fresh[-1].question is None and "only the buckets" in fresh[-1].reason

    state = state.update({NAMES[0]: (100, 9, 1), NAMES[1]: (100, 2, 2)})
    got = {x.bucket: x for x in sequential_plan.needs(state, {NAMES[0]: 10, NAMES[1]: 10_000})}
    assert got[NAMES[0]].question == LOSS and got[NAMES[0]].more is not None
    assert "more than the 10 requests left" in got[NAMES[0]].reason
    assert got[NAMES[1]].question == EQUIVALENT and "left" not in got[NAMES[1]].reason
    assert got[NAMES[1]].pairs == got[NAMES[1]].more + 100
    assert sequential_plan.needs(state.update({NAMES[0]: (60, 15, 0)})) == []


def test_plan_round_shares_among_open_buckets_only() -> None:
    state = SequentialState.start(NAMES)
    plenty = dict.fromkeys(NAMES, 1000)
    assert sequential_plan.plan_round(state, plenty, 80) == dict.fromkeys(NAMES, 20)
    # the odd requests go to the least-paired buckets (then the later ones)
    state = state.update({NAMES[0]: (5, 0, 0)})
    assert sequential_plan.plan_round(state, plenty, 10) == {
        NAMES[0]: 2,
        NAMES[1]: 2,
        NAMES[2]: 3,
        NAMES[3]: 3,
    }
    # a short pool gives what it has; the others share the rest; no pool, no requests
    short = {NAMES[0]: 3, NAMES[1]: 1000, NAMES[2]: 1000}
    assert sequential_plan.plan_round(state, short, 40) == {NAMES[0]: 3, NAMES[1]: 18, NAMES[2]: 19}
    # a decided bucket stops; a decided run stops everything
    n0 = pairs_to_cross((0.0, 0.0), TOL, "below", ALPHA, at_least=Rule().min_pairs)
    state = state.update({NAMES[1]: (n0, 0, 0)})
    assert NAMES[1] not in sequential_plan.plan_round(state, plenty, 90)
    assert sum(sequential_plan.plan_round(state, plenty, 90).values()) == 90
    lost = state.update({NAMES[2]: (60, 15, 0)})
    assert sequential_plan.plan_round(lost, plenty, 90) == {}
    with pytest.raises(ValueError, match="round_size"):
        sequential_plan.plan_round(state, plenty, -1)
    with pytest.raises(ValueError, match="left"):
        sequential_plan.plan_round(state, {NAMES[0]: -2}, 10)


# --- the simulation --------------------------------------------------------------------------

CASES = {c.key: c for c in sim.CASES}


@pytest.fixture(scope="module")
def results() -> dict[str, tuple[sim.Outcome, dict]]:
    out = {}
    for i, case in enumerate(sim.CASES):
        if case.key in sim.TESTED:
            o = sim.simulate(case, sim.CANARIES, sim.SEED + i, keep=25)
            out[case.key] = (o, sim.summarize(case, o))
    return out


@pytest.mark.parametrize("key", sim.TESTED)
def test_wrong_decisions_stay_within_alpha(key: str, results: dict) -> None:
    _, row = results[key]
    count = row["wrong_counted_over"]
    assert count >= sim.CANARIES
    assert row["wrong_share"] <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / count), row


@pytest.mark.parametrize("key", ["a", "b", "c", "d"])
def test_the_simulation_is_the_state(key: str, results: dict) -> None:
    """The vectorised simulation decides like SequentialState on the same rounds."""
    out, _ = results[key]
    for i in range(out.rounds.shape[1]):
        state = SequentialState.start(NAMES)
        for rnd in out.rounds[:, i]:
            if rnd[:, 0].any():
                state = state.update(
                    {NAMES[b]: tuple(int(v) for v in rnd[b]) for b in range(4) if rnd[b, 0]}
                )
        code = {OPEN: sim.OPEN, EQUIVALENT: sim.EQUIVALENT, LOSS: sim.LOSS}
        assert code[state.decision] == out.decision[i]
        assert [code[b.status] for b in state.buckets] == list(out.status[i])
        assert sum(b.pairs for b in state.buckets) == out.pairs[i]


def test_the_pairs_to_a_decision(results: dict) -> None:
    """(a) no drop and (c) a drop of twice the tolerance: the median is at most half the fixed
    design's N at the same alpha and power (the sequential canary's own chance of the right
    decision). At the fixed design's usual 80%, half is out of reach for (a), for any design:
    Wald's bound on a sequential test's average pairs is above it, and the fixed test planned
    for half its N shows equivalence in under half of the canaries; there the sequential
    canary needs about the 80% N per bucket and less than the N giving the run an 80% chance."""
    _, c = results["c"]
    _, a = results["a"]
    for row in (a, c):
        assert row["target_met"] and row["median_over_equal_power"] <= 0.5, row
        assert row["fixed_n"]["equal_power"]["chance_of_the_right_decision"] >= 0.95, row
    assert c["median_over_fixed"] <= 0.5, c
    fixed = sim.fixed_n(CASES["a"])
    assert fixed["power_at_half"] < 0.5
    assert a["fixed_n"]["sequential_floor_at_80"] > fixed["per_bucket"] / 2, a
    assert a["median_pairs_per_bucket"] <= 1.1 * fixed["per_bucket"], a
    assert a["median_pairs_per_bucket"] <= 0.75 * fixed["for_the_run"], a
    assert a["undecided_at_budget"] <= 0.01 and a["shares"]["equivalent"] >= 0.95


def test_the_bounds_the_comparison_rests_on() -> None:
    """Clopper-Pearson's lower bound and Wald's floor against values worked by hand: for 19 of
    20 the bound p solves P(X >= 19) = 20 p^19 - 19 p^20 = 0.05, for 20 of 20 it is
    0.05^(1/20); the floor is the binary KL of (chance, alpha) over KL_inf, so it grows with
    the chance asked for."""
    p = sim.lower_confidence(19, 20)
    assert abs(20 * p**19 - 19 * p**20 - 0.05) < 1e-9 and 0.78 < p < 0.79
    assert abs(sim.lower_confidence(20, 20) - 0.05 ** (1 / 20)) < 1e-9
    assert sim.lower_confidence(0, 20) == 0.0
    p10 = p01 = sim.NOISE
    low, high = sim.sequential_floor(p10, p01, 0.8), sim.sequential_floor(p10, p01, 0.99)
    assert low < high < sim.e_process_floor(p10, p01) * 1.01
    by_hand = (0.8 * math.log(0.8 / 0.05) + 0.2 * math.log(0.2 / 0.95)) / sim.kl_inf(p10, p01)
    assert abs(low - by_hand) < 1e-9


def test_the_pool_settles_what_no_bucket_shows(results: dict) -> None:
    _, d = results["d"]
    assert d["pool_only_loss_share"] >= 0.8 and d["undecided_at_budget"] <= 0.05, d


def test_peeking_at_the_fixed_design_inflates_its_error() -> None:
    assert sim.peeked_fixed_losses(2000, sim.SEED) > 3 * ALPHA
