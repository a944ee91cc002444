"""The systems rule, simulated: how often it claims a change under pure noise, and how often it
finds a true 20% one.

Each simulated canary replays ``BUCKETS`` buckets of ``K x M`` requests on three arms (the
reference, its A/A control and the candidate), interleaved in ``K`` blocks that each hold
``M`` requests of every bucket (a closed loop's strided blocks), the arms' order rotated per
block. Request i's log latency on an arm, for each of TTFT, ITL and E2E, is its own base
(which the paired ratios cancel), plus the candidate's true change (0 for the other arms), plus
the machine's state while that arm sent that block (shared by the block's requests: a
neighbour's burst in one arm's turn), plus the machine's load at that moment when it drifts,
plus the request's own noise. Both noises are Student-t with 3 degrees of freedom (heavy tails:
stragglers), the request's shared in part by its three metrics (correlation ``RHO``). Their
scales are ``NOISE``'s, from runs on the project's 2-core machine: "busy" (a load average near
3) and "overloaded" (30 to 50, where requests of one block moved together). Every canary is
judged by the product's own code: each cell's value per block is the median of its requests'
log ratios, ``stats.median_change`` gives its interval over blocks at alpha over the family
(buckets x metrics), ``systems_cells.direction`` its call against the A/A floor and the
threshold. "per request" rows judge the same canaries with intervals over requests instead of
blocks, as the rule first did: on the overloaded machine that claimed changes that were not
there (the README's runs), since a block's requests are not independent.

Asserted: under pure noise, steady or drifting, busy or overloaded, some cell claims a change
in at most alpha of the canaries (a Monte Carlo allowance of 3 standard errors); a true 20%
change is found the right way in at least 80% of the canaries at the sizes the README states;
the capacity phase's cell (24 blocks at half of alpha) claims a change under noise in at most
alpha / 2 of the canaries and finds a 50% gain.

``python bench/simulations.py`` records every row in ``bench/results/systems_simulation.json``,
from which ``bench/doc_figures.py`` renders docs/canary.md's table; the tests here check that
the rows they simulate are the recorded ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from replay.analysis.stats.median_change import median_changes
from replay.analysis.systems_cells import direction
from replay.analysis.thresholds import SYSTEMS_THRESHOLD as THRESHOLD

CANARIES = 4000
SEED = 20261214
ALPHA = 0.05
BUCKETS = 3
METRICS = ("ttft_ms", "itl_ms", "e2e_ms")
K, M = 28, 2  # blocks, and requests of each bucket in a block (the first-run trace: 28, 2-3)
# Per-arm noise in log units: (a request's own, the block's shared) for TTFT, ITL, E2E.
NOISE = {
    "busy": {"ttft_ms": (0.20, 0.05), "itl_ms": (0.25, 0.05), "e2e_ms": (0.15, 0.05)},
    "overloaded": {"ttft_ms": (0.50, 0.25), "itl_ms": (0.65, 0.25), "e2e_ms": (0.55, 0.25)},
}
RHO = 0.5  # share of a request's noise its three metrics have in common
DRIFT = 0.5  # the machine's load rises by half over a drifting run
# The capacity phase's cell: 24 blocks, per-block rate noise (log, per arm) as measured there
# at a load average near 30 (the robust spread of the A/A's block log ratios, 0.42, over
# sqrt 2), and half of alpha (``systems_cells.rule``).
BLOCKS, BLOCK_SIGMA = 24, 0.3
CAPACITY_SEED = SEED + 50  # plus the case's index
RECORDED = Path(__file__).resolve().parents[3] / "bench" / "results" / "systems_simulation.json"


@dataclass(frozen=True)
class Case:
    name: str
    change: float = 1.0  # the candidate's true ratio in the cells it changes
    only_one: bool = False  # only TTFT of the first bucket changes
    drift: float = 0.0
    noise: str = "busy"
    k: int = K
    m: int = M
    per_request: bool = False  # intervals over requests, not blocks


def _load(k: int, drift: float) -> np.ndarray:
    """The machine's log load while each arm sent each block: shape (3, k)."""
    blocks = np.arange(k)
    slot = np.stack([(a - blocks) % 3 for a in range(3)])  # the arm's turn, rotated
    return np.log1p(drift * (blocks * 3 + slot + 0.5) / (k * 3))


def _t3(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_t(3, shape) / math.sqrt(3)


def simulate(case: Case, seed: int) -> np.ndarray:
    """Per canary, per cell (bucket x metric): +1 slower, -1 faster, 0 no claim."""
    rng = np.random.default_rng(seed)
    shape = (CANARIES, 3, case.k, BUCKETS, case.m)  # arm, block, bucket, request
    shared = _t3(rng, shape)
    miss = ALPHA / (BUCKETS * len(METRICS))
    calls = np.zeros((CANARIES, BUCKETS, len(METRICS)), dtype=int)
    for m, metric in enumerate(METRICS):
        own, blk = NOISE[case.noise][metric]
        noise = own * (math.sqrt(RHO) * shared + math.sqrt(1 - RHO) * _t3(rng, shape))
        noise += blk * _t3(rng, (CANARIES, 3, case.k, 1, 1))  # the block's shared state
        logs = noise + _load(case.k, case.drift)[None, :, :, None, None]
        if not case.only_one or m == 0:
            logs[:, 2, :, : 1 if case.only_one else BUCKETS] += math.log(case.change)
        ab, aa = logs[:, 2] - logs[:, 0], logs[:, 1] - logs[:, 0]  # (canary, block, bucket, req)
        if case.per_request:
            ab = ab.transpose(0, 2, 1, 3).reshape(CANARIES, BUCKETS, -1)
            aa = aa.transpose(0, 2, 1, 3).reshape(CANARIES, BUCKETS, -1)
        else:  # a block's value: the median of its requests
            ab, aa = (
                np.median(ab, axis=3).transpose(0, 2, 1),
                np.median(aa, axis=3).transpose(0, 2, 1),
            )
        med, lo, hi = median_changes(ab, miss)
        _, flo, fhi = median_changes(aa, miss)
        calls[:, :, m] = direction(med, lo, hi, np.maximum(np.abs(flo), np.abs(fhi)), THRESHOLD)
    return calls


CASES = [
    Case("pure noise"),
    Case("pure noise, load rising x1.5 over the run", drift=DRIFT),
    Case("pure noise, overloaded, load rising x1.5", drift=DRIFT, noise="overloaded"),
    Case("pure noise, overloaded, per request", noise="overloaded", per_request=True),
    Case(
        "pure noise, overloaded, per request, 4 consecutive blocks of 16",
        noise="overloaded",
        per_request=True,
        k=4,
        m=16,
    ),
    Case("candidate 20% slower everywhere", change=1.2),
    Case("candidate 20% slower everywhere, load rising x1.5", change=1.2, drift=DRIFT),
    Case("candidate 20% faster everywhere", change=1 / 1.2),
    Case("candidate 20% slower everywhere, 14 blocks", change=1.2, k=14),
    Case("only TTFT of one bucket 20% slower", change=1.2, only_one=True),
    Case("candidate 10% slower everywhere", change=1.1),
    Case("candidate 20% slower everywhere, overloaded", change=1.2, noise="overloaded"),
    Case("candidate 20% slower everywhere, overloaded", change=1.2, noise="overloaded", k=168),
]


def shares(case: Case, seed: int) -> tuple[float, float, float]:
    """(any cell claims slower, any claims faster, any claims either)."""
    calls = simulate(case, seed)
    up = (calls > 0).any(axis=(1, 2))
    down = (calls < 0).any(axis=(1, 2))
    return float(up.mean()), float(down.mean()), float((up | down).mean())


def simulate_blocks(change: float, seed: int, blocks: int = BLOCKS) -> np.ndarray:
    """Per canary, the capacity cell's call: +1 more requests/s, -1 fewer, 0 none."""
    rng = np.random.default_rng(seed)
    logs = BLOCK_SIGMA * _t3(rng, (CANARIES, 3, blocks))
    logs[:, 2] += math.log(change)
    med, lo, hi = median_changes(logs[:, 2] - logs[:, 0], ALPHA / 2)
    _, flo, fhi = median_changes(logs[:, 1] - logs[:, 0], ALPHA / 2)
    return direction(med, lo, hi, np.maximum(np.abs(flo), np.abs(fhi)), THRESHOLD)


BLOCK_CASES = [
    ("pure noise", 1.0),
    ("candidate 20% more", 1.2),
    ("candidate 50% more", 1.5),
    ("candidate twice as many", 2.0),
]


def allowance(p: float) -> float:
    return 3 * math.sqrt(p * (1 - p) / CANARIES)


@pytest.mark.parametrize("i", [0, 1, 2])
def test_pure_noise_claims_a_change_in_at_most_alpha_of_the_canaries(i: int) -> None:
    slower, faster, either = shares(CASES[i], SEED + i)
    assert recorded(i) == (slower, faster), "run: python bench/simulations.py"
    assert either <= ALPHA + allowance(ALPHA), (CASES[i], either)


def test_intervals_over_requests_claim_what_is_not_there_on_an_overloaded_machine() -> None:
    _, _, either = shares(CASES[4], SEED + 4)
    assert either > ALPHA + allowance(ALPHA), either  # beyond alpha: why blocks are the units


@pytest.mark.parametrize(
    ("i", "sense"), [(5, "slower"), (6, "slower"), (7, "faster"), (12, "slower")]
)
def test_a_true_20_percent_change_is_found_at_the_sizes_the_readme_states(
    i: int, sense: str
) -> None:
    slower, faster, _ = shares(CASES[i], SEED + i)
    assert recorded(i) == (slower, faster), "run: python bench/simulations.py"
    found, wrong = (slower, faster) if sense == "slower" else (faster, slower)
    assert found >= 0.8, (CASES[i], found)
    assert wrong <= ALPHA + allowance(ALPHA), (CASES[i], wrong)


def test_the_capacity_cell_under_noise_and_a_true_change() -> None:
    noise = simulate_blocks(1.0, CAPACITY_SEED)
    assert (noise != 0).mean() <= ALPHA / 2 + allowance(ALPHA / 2)
    assert (simulate_blocks(1.5, CAPACITY_SEED + 2) > 0).mean() >= 0.8
    assert capacity_row(0) == recorded_capacity(0), "run: python bench/simulations.py"


def cell_rows() -> list[dict[str, Any]]:
    """Every latency case: the share of canaries in which some cell claims slower, faster."""
    out = []
    for i, case in enumerate(CASES):
        slower, faster, either = shares(case, SEED + i)
        out.append(
            {
                "case": case.name,
                "noise": case.noise,
                "blocks": case.k,
                "requests": case.m,
                "seed": SEED + i,
                "slower": slower,
                "faster": faster,
                "either": either,
            }
        )
    return out


def capacity_row(j: int) -> dict[str, Any]:
    name, change = BLOCK_CASES[j]
    calls = simulate_blocks(change, CAPACITY_SEED + j)
    return {
        "case": name,
        "change": change,
        "blocks": BLOCKS,
        "seed": CAPACITY_SEED + j,
        "fewer": float((calls < 0).mean()),
        "more": float((calls > 0).mean()),
    }


def config() -> dict[str, Any]:
    return {
        "canaries": CANARIES,
        "seed": SEED,
        "alpha": ALPHA,
        "buckets": BUCKETS,
        "metrics": list(METRICS),
        "threshold": THRESHOLD,
        "noise": {name: {m: list(v) for m, v in sig.items()} for name, sig in NOISE.items()},
        "rho": RHO,
        "drift": DRIFT,
        "capacity_blocks": BLOCKS,
        "capacity_block_sigma": BLOCK_SIGMA,
    }


def recorded(i: int) -> tuple[float, float]:
    """(claims slower, claims faster) of the ``i``-th case in the results file."""
    row = orjson.loads(RECORDED.read_bytes())["cells"][i]
    return row["slower"], row["faster"]


def recorded_capacity(j: int) -> dict[str, Any]:
    return dict(orjson.loads(RECORDED.read_bytes())["capacity"][j])
