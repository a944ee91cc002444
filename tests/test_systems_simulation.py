"""The systems rule, simulated: how often it claims a change under pure noise, and how often it
finds a true 20% one.

Each simulated canary replays ``BUCKETS`` buckets of ``n`` requests on three arms: the
reference, its A/A control and the candidate. Request i's latency on an arm, for each of TTFT,
ITL and E2E, is its own base latency (which the paired ratios cancel) times the candidate's
true change (1 for the other arms), times the machine's load at the moment the arm measured it,
times noise: a Student-t with 3 degrees of freedom (heavy tails: stragglers) scaled to the
metric's ``NOISE`` in log units, shared in part by a request's metrics (correlation ``RHO``).
The noise scales come from real runs on the project's 2-core machine (``NOISE``: "busy" and
"overloaded", the log ratio's robust spread there over sqrt 2). The
machine's load rises by ``DRIFT`` (x1.5) over the run in the drifting cases; measured one after
another, the arms see it at different times; interleaved (blocks of 16 requests, the arms'
order rotated per block) at nearly the same times. Every canary is then judged by the product's
own code: ``stats.median_change`` for each cell's interval at alpha over the family (buckets x
metrics), ``systems_cells.direction`` for its call against the A/A floor and the threshold.

Asserted: under pure noise (steady or drifting, busy or overloaded, interleaved) some cell
claims a change in at most alpha of the canaries (with a Monte Carlo allowance of 3 standard
errors); a true 20% change is found (the right way, in at least 80% of the canaries) at the
bucket sizes the README states: 64 requests per bucket when every metric changes on a busy
machine, 160 when only one metric of one bucket does, 400 on an overloaded machine. Measured
one after another on the drifting machine, noise alone claims a change in most canaries: why
interleaving is the default. The capacity phase's cell (its 24 blocks at half of alpha)
claims a change under noise in at most alpha / 2 of the canaries, and finds a 30% gain.

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
# Per-arm noise in log units (the robust spread of log(control / reference), over sqrt 2), as
# measured on the project's 2-core machine: "busy" at a load average near 3 (other work
# beside the run), "overloaded" at a load average of 30 to 50 (README, "Does FP8 pay?").
NOISE = {
    "busy": {"ttft_ms": 0.20, "itl_ms": 0.25, "e2e_ms": 0.15},
    "overloaded": {"ttft_ms": 0.70, "itl_ms": 0.80, "e2e_ms": 0.60},
}
RHO = 0.5  # share of a request's noise its three metrics have in common
DRIFT = 0.5  # the machine's load rises by half over a drifting run
BLOCK = 16
# The capacity phase's cell: 24 blocks, per-block rate noise (log, per arm) as measured there
# at a load average near 40, and half of alpha (``systems_cells.rule``).
BLOCKS, BLOCK_SIGMA = 24, 0.17


@dataclass(frozen=True)
class Case:
    name: str
    change: float = 1.0  # the candidate's true ratio in the cells it changes
    only_one: bool = False  # only TTFT of the first bucket changes
    drift: float = 0.0
    interleaved: bool = True
    n: int = N
    noise: str = "busy"


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
        sigma = NOISE[case.noise][metric]
        noise = sigma * (math.sqrt(RHO) * shared + math.sqrt(1 - RHO) * own)
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
    Case("pure noise"),
    Case("pure noise, load rising x1.5 over the run", drift=DRIFT),
    Case("pure noise, load rising x1.5, one arm after another", drift=DRIFT, interleaved=False),
    Case("pure noise, overloaded machine, load rising x1.5", drift=DRIFT, noise="overloaded"),
    Case("candidate 20% slower everywhere", change=1.2),
    Case("candidate 20% slower everywhere, load rising x1.5", change=1.2, drift=DRIFT),
    Case("candidate 20% faster everywhere", change=1 / 1.2),
    Case("only TTFT of one bucket 20% slower", change=1.2, only_one=True),
    Case("only TTFT of one bucket 20% slower", change=1.2, only_one=True, n=160),
    Case("candidate 20% slower everywhere", change=1.2, n=32),
    Case("candidate 10% slower everywhere", change=1.1),
    Case("candidate 20% slower everywhere, overloaded machine", change=1.2, noise="overloaded"),
    Case(
        "candidate 20% slower everywhere, overloaded machine", change=1.2, noise="overloaded", n=400
    ),
]


def simulate_blocks(change: float, seed: int, blocks: int = BLOCKS) -> np.ndarray:
    """Per canary, the capacity cell's call: +1 more requests/s, -1 fewer, 0 none."""
    rng = np.random.default_rng(seed)
    logs = BLOCK_SIGMA * rng.standard_t(3, (CANARIES, 3, blocks)) / math.sqrt(3)
    logs[:, 2] += math.log(change)
    med, lo, hi = median_changes(logs[:, 2] - logs[:, 0], ALPHA / 2)
    _, flo, fhi = median_changes(logs[:, 1] - logs[:, 0], ALPHA / 2)
    return direction(med, lo, hi, np.maximum(np.abs(flo), np.abs(fhi)), THRESHOLD)


BLOCK_CASES = [
    ("pure noise", 1.0),
    ("candidate 20% more", 1.2),
    ("candidate 30% more", 1.3),
    ("candidate 50% more", 1.5),
]


def shares(case: Case, seed: int) -> tuple[float, float, float]:
    """(any cell claims slower, any claims faster, any claims either)."""
    calls = simulate(case, seed)
    up = (calls > 0).any(axis=(1, 2))
    down = (calls < 0).any(axis=(1, 2))
    return float(up.mean()), float(down.mean()), float((up | down).mean())


def allowance(p: float) -> float:
    return 3 * math.sqrt(p * (1 - p) / CANARIES)


@pytest.mark.parametrize("i", [0, 1, 3])
def test_pure_noise_claims_a_change_in_at_most_alpha_of_the_canaries(i: int) -> None:
    _, _, either = shares(CASES[i], SEED + i)
    assert either <= ALPHA + allowance(ALPHA), (CASES[i], either)


def test_one_after_another_on_a_drifting_machine_claims_what_is_not_there() -> None:
    slower, _, _ = shares(CASES[2], SEED + 2)
    assert slower > 0.5, slower  # the candidate ran last, when the load was highest


@pytest.mark.parametrize(
    ("i", "sense"), [(4, "slower"), (5, "slower"), (6, "faster"), (8, "slower"), (12, "slower")]
)
def test_a_true_20_percent_change_is_found_at_the_sizes_the_readme_states(
    i: int, sense: str
) -> None:
    slower, faster, _ = shares(CASES[i], SEED + i)
    found, wrong = (slower, faster) if sense == "slower" else (faster, slower)
    assert found >= 0.8, (CASES[i], found)
    assert wrong <= ALPHA + allowance(ALPHA), (CASES[i], wrong)


def test_the_capacity_cell_under_noise_and_a_true_change() -> None:
    noise = simulate_blocks(1.0, SEED + 50)
    assert (noise != 0).mean() <= ALPHA / 2 + allowance(ALPHA / 2)
    assert (simulate_blocks(1.3, SEED + 52) > 0).mean() >= 0.8


def table() -> str:
    rows = [
        "| case | noise | pairs per bucket | claims slower | claims faster |",
        "| --- | --- | --- | --- | --- |",
    ]
    for i, case in enumerate(CASES):
        slower, faster, _ = shares(case, SEED + i)
        rows.append(f"| {case.name} | {case.noise} | {case.n} | {slower:.4f} | {faster:.4f} |")
    rows += [
        "",
        "| capacity cell | blocks | claims fewer | claims more |",
        "| --- | --- | --- | --- |",
    ]
    for j, (name, change) in enumerate(BLOCK_CASES):
        calls = simulate_blocks(change, SEED + 50 + j)
        rows.append(f"| {name} | {BLOCKS} | {(calls < 0).mean():.4f} | {(calls > 0).mean():.4f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    noise = "; ".join(
        f"{name}: " + ", ".join(f"{k} {v:g}" for k, v in sig.items()) for name, sig in NOISE.items()
    )
    print(
        f"{CANARIES} canaries per case, seed {SEED} (+ case index), {BUCKETS} buckets x "
        f"{len(METRICS)} metrics, alpha {ALPHA}, threshold {THRESHOLD}, per-arm noise (log) "
        f"{noise}; t(3) tails, correlation {RHO}, blocks of {BLOCK}; capacity cell: "
        f"{BLOCKS} blocks, block noise {BLOCK_SIGMA}, alpha / 2"
    )
    print(table())
