"""The evidence rule, simulated: how often KEEP's per-bucket equivalence is shown.

Each simulated canary is one bucket of n requests graded on both targets: BF16 passes a
request with probability ``P_REF``; FP8 fails a request BF16 passed with probability
``p10 / P_REF`` and passes one BF16 failed with probability ``p01 / (1 - P_REF)``, so the
true drop is ``p10 - p01`` and the discordance ``p10 + p01``. Each canary shows equivalence
exactly where the stop rule's ``matches`` does (``equivalence.equivalent``, through the same
region as ``power.critical_regressions``, checked on a sample here). Two questions:

* size: with a true drop of exactly the tolerance, equivalence may be shown in at most alpha
  of the canaries (Monte Carlo allowance: 3 standard errors; the exact figure from
  ``power.equivalence_power`` must be at most alpha outright);
* power: with no true drop, at the N that "need N" names for a pilot bucket with the same
  rates, equivalence must be shown in at least ``power.POWER`` of them (same allowance).

``python bench/simulations.py`` records every row in ``bench/results/evidence_simulation.json``,
from which ``bench/doc_figures.py`` renders docs/canary.md's table; each test here checks that
the recorded row is what the simulation gives today.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from replay.analysis.stats import equivalence, evidence, exact_tests, power
from replay.analysis.verdict.facts import ArmFacts, BucketFacts, Facts
from replay.analysis.verdict.rule import decide

CANARIES = 10_000
SEED = 20240516
P_REF = 0.8  # BF16 pass rate: leaves room for discordance both ways
TOL, ALPHA, MIN_PAIRS = equivalence.TOLERANCE, equivalence.ALPHA, equivalence.MIN_PAIRS


@dataclass(frozen=True)
class Case:
    name: str
    p10: float  # regression rate: BF16 passes, FP8 fails
    p01: float  # improvement rate
    n: int | None = None  # bucket size; None: what "need N" names for the pilot
    pilot: tuple[int, int, int] | None = None  # (pairs, lost, gained) seen so far


SIZE = [
    Case("true drop = tolerance, only regressions", TOL, 0.0, n=59),
    Case("true drop = tolerance, only regressions", TOL, 0.0, n=300),
    Case("true drop = tolerance, discordance 10%", TOL + 0.025, 0.025, n=100),
    Case("true drop = tolerance, discordance 10%", TOL + 0.025, 0.025, n=400),
    Case("true drop = tolerance, discordance 25%", TOL + 0.1, 0.1, n=200),
    Case("true drop = tolerance, discordance 25%", TOL + 0.1, 0.1, n=800),
]
POWER = [
    Case("no drop, no discordance", 0.0, 0.0, pilot=(57, 0, 0)),
    Case("no drop, discordance 5%", 0.025, 0.025, pilot=(80, 2, 2)),
    Case("no drop, discordance 10%", 0.05, 0.05, pilot=(100, 5, 5)),
    Case("2-point drop, discordance 4%", 0.03, 0.01, pilot=(100, 3, 1)),
]
SIZE_SEED, POWER_SEED = SEED, SEED + 100  # plus the case's index
RECORDED = Path(__file__).resolve().parents[3] / "bench" / "results" / "evidence_simulation.json"


def simulate(n: int, p10: float, p01: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(regressions, improvements) of CANARIES buckets of n paired pass/fail grades."""
    rng = np.random.default_rng(seed)
    ref = rng.random((CANARIES, n)) < P_REF
    flip = rng.random((CANARIES, n))
    cand = np.where(ref, flip >= p10 / P_REF, flip < p01 / (1 - P_REF))
    return (ref & ~cand).sum(axis=1), (~ref & cand).sum(axis=1)


def shown(n: int, lost: np.ndarray, gained: np.ndarray) -> np.ndarray:
    """Per canary: does the stop rule's per-bucket equivalence hold?"""
    m = lost + gained
    values, index = np.unique(m, return_inverse=True)
    crit = power.critical_regressions(n, values, tolerance=TOL, alpha=ALPHA)[index]
    return (lost <= crit) & (n >= MIN_PAIRS)


def bucket_size(case: Case) -> int:
    if case.n is not None:
        return case.n
    assert case.pilot is not None
    ev = evidence.evidence(*case.pilot, tolerance=TOL, alpha=ALPHA, min_pairs=MIN_PAIRS)
    assert ev.status == "open" and ev.needed is not None, ev.reason
    return ev.needed


def run(case: Case, seed: int) -> tuple[int, float, float]:
    """(bucket size, share of canaries with equivalence shown, exact share)."""
    n = bucket_size(case)
    lost, gained = simulate(n, case.p10, case.p01, seed)
    keep = shown(n, lost, gained)
    # The vectorized region is the scalar rule, on a sample of the simulated outcomes.
    for i in range(0, CANARIES, CANARIES // 25):
        assert bool(keep[i]) == equivalence.equivalent(
            n, int(lost[i]), int(gained[i]), tolerance=TOL, alpha=ALPHA, min_pairs=MIN_PAIRS
        )
    exact = power.equivalence_power(n, case.p10, case.p01, tolerance=TOL, alpha=ALPHA)
    return n, float(keep.mean()), exact


def allowance(p: float) -> float:
    return 3 * math.sqrt(p * (1 - p) / CANARIES)


@pytest.mark.parametrize("i", range(len(SIZE)))
def test_a_drop_of_exactly_the_tolerance_is_rarely_kept(i: int) -> None:
    n, share, exact = run(SIZE[i], SIZE_SEED + i)
    assert recorded("size", i) == (n, share, exact), "run: python bench/simulations.py"
    assert exact <= ALPHA + 1e-9, (SIZE[i], n, exact)
    assert share <= ALPHA + allowance(ALPHA), (SIZE[i], n, share)
    assert abs(share - exact) <= allowance(max(exact, 1e-3)) + 1e-3


@pytest.mark.parametrize("i", range(len(POWER)))
def test_need_n_delivers_its_power(i: int) -> None:
    case = POWER[i]
    n, share, exact = run(case, POWER_SEED + i)
    assert recorded("power", i) == (n, share, exact), "run: python bench/simulations.py"
    assert exact >= power.POWER, (case, n, exact)
    assert share >= power.POWER - allowance(power.POWER), (case, n, share)
    assert abs(share - exact) <= allowance(exact) + 1e-3


def test_the_stop_rule_keeps_exactly_where_the_bound_holds() -> None:
    """decide() on one-bucket facts gives KEEP exactly where the simulated rule says so."""
    n = 100
    lost, gained = simulate(n, 0.03, 0.02, SEED + 200)
    keep = shown(n, lost, gained)
    outcomes = sorted(
        {(int(x), int(y), bool(k)) for x, y, k in zip(lost, gained, keep, strict=True)}
    )
    assert {k for *_, k in outcomes} == {True, False}
    for x, y, k in outcomes[:: max(1, len(outcomes) // 40)]:
        d = (y - x) / n
        mc = exact_tests.mcnemar_exact([True] * x + [False] * y, [False] * x + [True] * y).p_value
        b = BucketFacts("<8K", n, d, d, d, mc, None, None, x, y)
        v = decide(Facts("bf16", ArmFacts("fp8", buckets=(b,)), capacity_ratio=2.0))
        assert (v.verdict == "keep") == k, (x, y, v.reasons)


def rows() -> list[dict[str, Any]]:
    """Every case's simulated and exact KEEP share: what the results file records."""
    out = []
    for question, cases, seed in (("size", SIZE, SIZE_SEED), ("power", POWER, POWER_SEED)):
        for i, case in enumerate(cases):
            n, share, exact = run(case, seed + i)
            out.append(
                {
                    "question": question,
                    "case": case.name,
                    "p10": case.p10,
                    "p01": case.p01,
                    "pilot": case.pilot,
                    "seed": seed + i,
                    "pairs": n,
                    "share": share,
                    "exact": float(exact),
                }
            )
    return out


def config() -> dict[str, Any]:
    return {
        "canaries": CANARIES,
        "seed": SEED,
        "reference_pass_rate": P_REF,
        "tolerance": TOL,
        "alpha": ALPHA,
        "min_pairs": MIN_PAIRS,
        "power": power.POWER,
    }


def recorded(question: str, i: int) -> tuple[int, float, float]:
    """(pairs, share, exact) of the ``i``-th case of ``question`` in the results file."""
    doc = orjson.loads(RECORDED.read_bytes())
    row = [r for r in doc["rows"] if r["question"] == question][i]
    return row["pairs"], row["share"], row["exact"]
