"""The systems rule, simulated: how often it claims a change under pure noise, and how often it
finds a true 20% one.

Each simulated canary replays ``BUCKETS`` buckets of ``n`` requests on three arms: the
reference, its A/A control and the candidate. Request i's latency on an arm, for each of TTFT,
ITL and E2E, is its own base latency (which the paired ratios cancel) times the candidate's
true change (1 for the other arms), times the machine's load at the moment the arm measured it,
times noise: a Student-t with 3 degrees of freedom (heavy tails: stragglers) scaled to ``SIGMA``
of the metric in log units, shared in part by a request's metrics (correlation ``RHO``). The
noise scales come from the A/A control of real runs on the project's 2-core machine while
other work shared it (``SIGMA``: the log ratio's robust spread there, over sqrt 2). The
machine's load rises by ``DRIFT`` (x1.5) over the run in the drifting cases; measured one after
another, the arms see it at different times; interleaved (blocks of 16 requests, the arms'
order rotated per block) at nearly the same times. Every canary is then judged by the product's
own code: ``stats.median_change`` for each cell's interval at alpha over the family (buckets x
metrics), ``systems_cells.direction`` for its call against the A/A floor and the threshold.

Asserted: under pure noise (quiet or drifting, interleaved) some cell claims a change in at
most alpha of the canaries (with a Monte Carlo allowance of 3 standard errors); a candidate
20% slower in every metric is found slower in at least 80% of the canaries at the bucket size
the README states (``N``); one that changes only one metric in one bucket is found in at least
80% too. Measured one after another on the drifting machine, noise alone claims a change in
most canaries: why interleaving is the default.

``python -m tests.test_systems_simulation`` prints the table the README quotes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from replay.analysis.stats.median_change import median_changes
from replay.analysis.systems_cells import THRESHOLD, direction

CANARIES = 4000
SEED = 20261214
ALPHA = 0.05
BUCKETS = 3
METRICS = ("ttft_ms", "itl_ms", "e2e_ms")
N = 64  # requests per bucket (the first-run trace has 70-78)
# Per-arm noise in log units, from the A/A control of the README's runs (see the docstring).
SIGMA = {"ttft_ms": 0.25, "itl_ms": 0.20, "e2e_ms": 0.20}
RHO = 0.5  # share of a request's noise its three metrics have in common
DRIFT = 0.5  # the machine's load rises by half over a drifting run
BLOCK = 16


@dataclass(frozen=True)
class Case:
    name: str
    change: float = 1.0  # the candidate's true ratio in the cells it changes
    only_one: bool = False  # only TTFT of the first bucket changes
    drift: float = 0.0
    interleaved: bool = True
    n: int = N


def _times(n_total: int, interleaved: bool) -> np.ndarray:
    """When (0..1 of the run) each arm measured each request: shape (3, n_total)."""
    i = np.arange(n_total)
    if not interleaved:  # reference, then its control, then the candidate
        return np.stack([(i + 0.5) / n_total / 3 + a / 3 for a in range(3)])
    k = i // BLOCK
    blocks = math.ceil(n_total / BLOCK)
    slot = np.stack([(a - k) % 3 for a in range(3)])  # the arm's turn in block k, rotated
    return (k * 3 + slot + (i % BLOCK + 0.5) / BLOCK) / (blocks * 3)


def simulate(case: Case, seed: int) -> np.ndarray:
    """Per canary, per cell (bucket x metric): +1 slower, -1 faster, 0 no claim."""
    rng = np.random.default_rng(seed)
    n_total = case.n * BUCKETS
    load = np.log1p(case.drift * _times(n_total, case.interleaved))  # (3, n_total)
    shared = rng.standard_t(3, (CANARIES, 3, n_total)) / math.sqrt(3)
    miss = ALPHA / (BUCKETS * len(METRICS))
    calls = np.zeros((CANARIES, BUCKETS, len(METRICS)), dtype=int)
    for m, metric in enumerate(METRICS):
        own = rng.standard_t(3, (CANARIES, 3, n_total)) / math.sqrt(3)
        noise = SIGMA[metric] * (math.sqrt(RHO) * shared + math.sqrt(1 - RHO) * own)
        logs = noise + load[None]
        effect = np.zeros(n_total)
        if not case.only_one or m == 0:
            effect[: case.n if case.only_one else n_total] = math.log(case.change)
        logs[:, 2] += effect
        ab = (logs[:, 2] - logs[:, 0]).reshape(CANARIES, BUCKETS, case.n)
        aa = (logs[:, 1] - logs[:, 0]).reshape(CANARIES, BUCKETS, case.n)
        med, lo, hi = median_changes(ab, miss)
        _, flo, fhi = median_changes(aa, miss)
        floor = np.maximum(np.abs(flo), np.abs(fhi))
        calls[:, :, m] = direction(med, lo, hi, floor, THRESHOLD)
    return calls


CASES = [
    Case("pure noise, quiet machine"),
    Case("pure noise, load rising x1.5 over the run", drift=DRIFT),
    Case("pure noise, load rising x1.5, one arm after another", drift=DRIFT, interleaved=False),
    Case("candidate 20% slower everywhere", change=1.2),
    Case("candidate 20% slower everywhere, load rising x1.5", change=1.2, drift=DRIFT),
    Case("candidate 20% faster everywhere", change=1 / 1.2),
    Case("only TTFT of one bucket 20% slower", change=1.2, only_one=True),
    Case("candidate 20% slower everywhere, 32 per bucket", change=1.2, n=32),
    Case("candidate 10% slower everywhere", change=1.1),
]


def shares(case: Case, seed: int) -> tuple[float, float, float]:
    """(any cell claims slower, any claims faster, any claims either)."""
    calls = simulate(case, seed)
    up = (calls > 0).any(axis=(1, 2))
    down = (calls < 0).any(axis=(1, 2))
    return float(up.mean()), float(down.mean()), float((up | down).mean())


def allowance(p: float) -> float:
    return 3 * math.sqrt(p * (1 - p) / CANARIES)


@pytest.mark.parametrize("i", [0, 1])
def test_pure_noise_claims_a_change_in_at_most_alpha_of_the_canaries(i: int) -> None:
    _, _, either = shares(CASES[i], SEED + i)
    assert either <= ALPHA + allowance(ALPHA), (CASES[i], either)


def test_one_after_another_on_a_drifting_machine_claims_what_is_not_there() -> None:
    slower, _, _ = shares(CASES[2], SEED + 2)
    assert slower > 0.5, slower  # the candidate ran last, when the load was highest


@pytest.mark.parametrize(
    ("i", "sense"), [(3, "slower"), (4, "slower"), (5, "faster"), (6, "slower")]
)
def test_a_true_20_percent_change_is_found(i: int, sense: str) -> None:
    slower, faster, _ = shares(CASES[i], SEED + i)
    found, wrong = (slower, faster) if sense == "slower" else (faster, slower)
    assert found >= 0.8, (CASES[i], found)
    assert wrong <= ALPHA + allowance(ALPHA), (CASES[i], wrong)


def table() -> str:
    rows = [
        "| case | pairs per bucket | claims slower | claims faster |",
        "| --- | --- | --- | --- |",
    ]
    for i, case in enumerate(CASES):
        slower, faster, _ = shares(case, SEED + i)
        rows.append(f"| {case.name} | {case.n} | {slower:.4f} | {faster:.4f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sigmas = ", ".join(f"{k} {v:g}" for k, v in SIGMA.items())
    print(
        f"{CANARIES} canaries per case, seed {SEED} (+ case index), {BUCKETS} buckets x "
        f"{len(METRICS)} metrics, alpha {ALPHA}, threshold {THRESHOLD}, noise (log) {sigmas}, "
        f"t(3) tails, correlation {RHO}, blocks of {BLOCK}"
    )
    print(table())
