"""The sequential canary, simulated: error rates and pairs to a decision, against the fixed
design's N.

    python bench/sequential_sim.py [--canaries 10000] [--seed 20240521] [--out PATH]
    python bench/sequential_sim.py --markdown [PATH]   # the README's table from the JSON

Every simulated canary is a run of :data:`BUCKETS` context-length buckets, fed in rounds of
:data:`ROUND` pairs per open bucket (what ``analysis.sequential.plan.plan_round`` gives with enough
requests) until the run is decided (``replay.analysis.sequential.state``) or the budget per bucket
is spent. The pass model: the reference passes a request with probability :data:`P_REF`; the
candidate fails one the reference passed with probability ``p10 / P_REF`` and passes one it
failed with ``p01 / (1 - P_REF)``, so per pair a regression has probability p10, an
improvement p01 and the drop is ``p10 - p01``; only those counts reach the rule, so a round's
counts are drawn as that trinomial. Every case has the same 5% of disagreement both ways as
noise (2.5 points each way), plus its drop in regressions:

* (a) no drop: the right decision is KEEP-compatible (wrong: LOSS);
* (b) a drop of exactly the tolerance in every bucket, (c) twice the tolerance: wrong is KEEP;
* (d) the shift spread thinly: a drop of exactly the tolerance in every bucket with a quarter
  of the budget each (250 pairs, the run's 1000 spread over four), too few for most buckets'
  own LOSS question to show it, while the pool's drop is at the tolerance: the pooled question
  settles it (row "(d) without the pool" switches it off, the buckets sharing all of alpha).

Two rows watch one question to the budget with nothing else stopping the run, the hardest
test of "peeking does not inflate the error": LOSS at no drop, and EQUIVALENT at a drop of the
tolerance (per bucket). A last row peeks at the fixed design's own loss tests (per-bucket
McNemar and the stratified test, each at alpha) after every round, for contrast.

The fixed design beside each case, in pairs per bucket from exact power, twice:

* at the usual 80% chance of the right decision: ``stats.power.pairs_needed`` (the equivalence
  bound; in brackets with 80% for the run, i.e. 0.8^(1/4) per bucket) for (a), exact McNemar
  per bucket for (b)-(d) (in brackets the stratified test's, per bucket);
* at the sequential canary's own chance of the right decision (the 95% lower confidence bound
  of its simulated share), the same alpha: what "the fixed design at the same alpha and
  power" means, and what the target (median at most half of it) is judged on. A fixed design
  sized for 80% leaves a fifth of its runs wrong or undecided; the sequential canary, with its
  budget, decides almost every run.

For (a), ``sequential_floor_at_80`` is Wald's lower bound on the average pairs of *any*
sequential test reaching equivalence with an 80% chance: above half the 80% fixed N, so
"half of the 80% design" is out of every design's reach there.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replay.analysis.sequential.capital import rejects  # noqa: E402
from replay.analysis.stats import binomial, power  # noqa: E402
from replay.analysis.stats.rule import Rule  # noqa: E402

CANARIES = 10_000
SEED = 20240521
P_REF = 0.8
BUCKETS = 4
ROUND = 20
BUDGET = 1000
NOISE = 0.025  # disagreement each way
RULE = Rule()
TOL, ALPHA = RULE.tolerance, RULE.alpha
TABLE = 2 * BUCKETS * BUDGET  # discordant pairs the exact tests' tables cover
OUT = ROOT / "bench" / "results" / "sequential.json"
OPEN, EQUIVALENT, LOSS = 0, 1, 2
NAMES = {OPEN: "open", EQUIVALENT: "equivalent", LOSS: "loss"}


@dataclass(frozen=True)
class Case:
    key: str
    name: str
    drop: float  # in every bucket, on top of the noise
    wrong: int  # the wrong run decision
    budget: int = BUDGET
    pool: bool = True
    questions: str = "both"  # or "loss" / "equivalence": watched alone to the budget
    fixed: str = ""  # which fixed-design test the right decision needs: "eq" or "loss"
    target: float | None = None  # median pairs at most this share of the fixed N
    p10: float = field(init=False)
    p01: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "p10", NOISE + self.drop)
        object.__setattr__(self, "p01", NOISE)
        assert self.p10 <= P_REF and self.p01 <= 1 - P_REF


CASES = [
    Case("a", "(a) no drop", 0.0, LOSS, fixed="eq", target=0.5),
    Case("b", "(b) drop = tolerance", TOL, EQUIVALENT, fixed="loss"),
    Case("c", "(c) drop = 2 x tolerance", 2 * TOL, EQUIVALENT, fixed="loss", target=0.5),
    Case("d", "(d) drop = tolerance, a quarter of the pairs", TOL, EQUIVALENT, 250, fixed="loss"),
    Case("d0", "(d) without the pool", TOL, EQUIVALENT, 250, pool=False, fixed="loss"),
    Case("a-loss", "no drop, LOSS watched alone to the budget", 0.0, LOSS, questions="loss"),
    Case(
        "b-eq",
        "drop = tolerance, EQUIVALENT watched alone to the budget (per bucket)",
        TOL,
        EQUIVALENT,
        questions="equivalence",
    ),
]
TESTED = (
    "a",
    "b",
    "c",
    "d",
    "a-loss",
    "b-eq",
)  # what tests/unit/analysis/test_sequential.py asserts


@dataclass
class Outcome:
    """Per canary: the run's decision, its pairs (all buckets), and each bucket's status;
    ``pool_only``: losses no bucket showed; ``rounds``: every round's new counts of the first
    ``keep`` canaries, (round, canary, bucket, [pairs, regressions, improvements])."""

    decision: np.ndarray
    pairs: np.ndarray
    status: np.ndarray
    pool_only: np.ndarray
    rounds: np.ndarray


def _levels(case: Case) -> tuple[float, float]:
    """(bucket LOSS level, pool LOSS level): without the pool the buckets share all of it."""
    if not case.pool:
        return ALPHA / BUCKETS, 0.0
    return RULE.bucket_loss_alpha(BUCKETS), RULE.pool_loss_alpha()


def _settle(case: Case, n: np.ndarray, x: np.ndarray, y: np.ndarray, st: np.ndarray) -> None:
    """The buckets' statuses after a round, in place: ``SequentialState._settle``, vectorised
    (a loss first, then equivalence with at least min_pairs)."""
    a_bucket, _ = _levels(case)
    if case.questions != "equivalence":
        st[(st == OPEN) & rejects(n, x, y, 0.0, "above", a_bucket)] = LOSS
    if case.questions != "loss":
        eq = rejects(n, x, y, TOL, "below", ALPHA) & (n >= RULE.min_pairs)
        st[(st == OPEN) & eq] = EQUIVALENT


def _decide(case: Case, n: np.ndarray, x: np.ndarray, y: np.ndarray, st: np.ndarray) -> tuple:
    """(run decision, pool loss) per canary: ``SequentialState.decision``, vectorised."""
    _, a_pool = _levels(case)
    pool = np.zeros(len(n), dtype=bool)
    if case.pool and case.questions != "equivalence":
        pool = rejects(n.sum(1), x.sum(1), y.sum(1), 0.0, "above", a_pool)
    run = np.full(len(n), OPEN)
    run[pool | (st == LOSS).any(1)] = LOSS
    if case.questions == "both":
        run[(run == OPEN) & (st == EQUIVALENT).all(1)] = EQUIVALENT
    return run, pool


def simulate(case: Case, canaries: int = CANARIES, seed: int = SEED, keep: int = 0) -> Outcome:
    """``canaries`` runs of ``case``, vectorised over canaries and buckets."""
    rng = np.random.default_rng(seed)
    shape = (canaries, BUCKETS)
    n, x, y = (np.zeros(shape, dtype=np.int64) for _ in range(3))
    status = np.full(shape, OPEN)
    decision, pool_loss = np.full(canaries, OPEN), np.zeros(canaries, dtype=bool)
    rounds = []
    q = case.p01 / (1 - case.p10)
    while True:
        live = decision == OPEN
        k = np.where((status == OPEN) & live[:, None], np.minimum(ROUND, case.budget - n), 0)
        if not k.any():
            break
        dx = rng.binomial(k, case.p10)
        dy = rng.binomial(k - dx, q)
        rounds.append(np.stack([k[:keep], dx[:keep], dy[:keep]], axis=-1))
        n += k
        x += dx
        y += dy
        idx = np.nonzero(live)[0]
        st = status[idx]
        _settle(case, n[idx], x[idx], y[idx], st)
        status[idx] = st
        decision[idx], pool_loss[idx] = _decide(case, n[idx], x[idx], y[idx], st)
    pool_only = pool_loss & ~(status == LOSS).any(1)
    empty = np.zeros((0, keep, BUCKETS, 3), dtype=np.int64)
    return Outcome(decision, n.sum(1), status, pool_only, np.array(rounds) if rounds else empty)


def peeked_fixed_losses(canaries: int = CANARIES, seed: int = SEED) -> float:
    """Share of no-drop canaries in which the fixed design's loss tests (exact two-sided
    McNemar per bucket, one-sided stratified on the pooled counts, each at alpha) fire at
    some round when looked at after every round up to the budget."""
    rng = np.random.default_rng(seed)
    mcnemar, stratified = _critical(TABLE, ALPHA / 2), _critical(TABLE, ALPHA)
    x = np.zeros((canaries, BUCKETS), dtype=np.int64)
    y = np.zeros_like(x)
    fired = np.zeros(canaries, dtype=bool)
    for _ in range(BUDGET // ROUND):
        dx = rng.binomial(ROUND, NOISE, size=x.shape)
        x, y = x + dx, y + rng.binomial(ROUND - dx, NOISE / (1 - NOISE))
        fired |= (x >= mcnemar[x + y]).any(1)
        fired |= x.sum(1) >= stratified[(x + y).sum(1)]
    return float(fired.mean())


@functools.lru_cache(maxsize=8)
def _critical(top: int, level: float) -> np.ndarray:
    """For m = 0..top discordant pairs, the fewest regressions x whose upper tail P(X >= x),
    X ~ Binomial(m, 1/2), is below ``level`` (m + 1 where none is): the exact one-sided
    sign test at ``level``, and two-sided McNemar (``mcnemar_p(x, m - x) < alpha``) at
    ``alpha / 2``. Summed in log space over x up to 8 SD above m / 2 (the rest is below
    1e-15 of the tail)."""
    lf = binomial.log_factorials(top)
    out = np.empty(top + 1, dtype=np.int64)
    for m in range(top + 1):
        j = np.arange(m // 2, min(m, m // 2 + math.ceil(4 * math.sqrt(m)) + 8) + 1)
        logs = lf[m] - lf[j] - lf[m - j] - m * math.log(2.0)
        upper = np.cumsum(np.exp(logs)[::-1])[::-1]  # upper[i] = P(X >= j[i])
        below = np.nonzero(upper < level * (1 - 1e-12))[0]
        out[m] = j[below[0]] if below.size else m + 1
    return out


def _at_least(ok: Any, start: int) -> int:
    """The smallest n with ok(n), "about": doubling from ``start``, then bisection to half a
    percent (exact power saws up and down with n, as in ``stats.power.pairs_needed``)."""
    lo, hi = 0, max(1, start)
    while not ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > max(1, hi // 200):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def _test_power(n: int, p10: float, p01: float, crit: np.ndarray) -> float:
    """Exact chance that n pairs reach ``crit[m]`` regressions among their m discordant ones,
    summed over m within 8 SD of its mean (the rest is below 1e-14, as in ``stats.power``)."""
    psi, share = p10 + p01, p10 / (p10 + p01)
    sd = math.sqrt(n * psi * (1 - psi))
    m = np.arange(
        max(0, math.floor(n * psi - 8 * sd) - 2), min(n, math.ceil(n * psi + 8 * sd) + 2) + 1
    )
    lf = binomial.log_factorials(n)
    pm = np.exp(lf[n] - lf[m] - lf[n - m] + m * math.log(psi) + (n - m) * math.log1p(-psi))
    tail = [1.0 - binomial.binom_cdf(int(crit[k]) - 1, int(k), share) for k in m]
    return float(pm @ np.array(tail))


def kl_inf(p10: float, p01: float) -> float:
    """KL_inf of the pair distribution at these rates from the null "drop >= tolerance": the
    growth per pair of the best constant bet knowing the rates (its dual form, a maximum over
    the bet; Honda & Takemura 2010)."""
    lam = np.linspace(0.0, 1.0 / (1.0 - TOL), 100_001)[:-1]
    growth = (
        (1 - p10 - p01) * np.log1p(lam * TOL)
        + p10 * np.log1p(lam * (TOL - 1))
        + p01 * np.log1p(lam * (TOL + 1))
    )
    return float(growth.max())


def e_process_floor(p10: float, p01: float) -> float:
    """Pairs an e-process for "drop >= tolerance" needs on average at these rates, at the
    least: ``log(1 / alpha) / KL_inf`` (Wald's identity; no bet learned from the data grows
    faster than the best constant one)."""
    return math.log(1 / ALPHA) / kl_inf(p10, p01)


def sequential_floor(p10: float, p01: float, chance: float) -> float:
    """Pairs *any* sequential test of "drop >= tolerance" at level alpha needs on average at
    these rates to reject it with probability ``chance``: Wald's lower bound on the expected
    sample size, ``[c log(c / alpha) + (1 - c) log((1 - c) / (1 - alpha))] / KL_inf`` (Wald
    1947, section 3.6; Hoeffding 1953). Below it no design, fixed or sequential, can go."""
    c = chance
    info = c * math.log(c / ALPHA) + (1 - c) * math.log((1 - c) / (1 - ALPHA))
    return info / kl_inf(p10, p01)


def lower_confidence(k: int, n: int, level: float = 0.05) -> float:
    """Clopper-Pearson lower bound at ``1 - level`` for a share seen k times in n: the
    smallest p under which k or more successes have probability above ``level``."""
    if k == 0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        tail = 1.0 - binomial.binom_cdf(k - 1, n, mid)
        lo, hi = (mid, hi) if tail <= level else (lo, mid)
    return lo


def fixed_n(case: Case) -> dict[str, int | None]:
    """The fixed design's pairs per bucket for 80% (see the module docstring)."""
    return _fixed_n(case.fixed, case.p10, case.p01)


@functools.lru_cache(maxsize=16)
def _fixed_n(fixed: str, p10: float, p01: float) -> dict[str, int | None]:
    if fixed == "eq":
        run_power = power.POWER ** (1 / BUCKETS)
        n = power.pairs_needed(p10, p01)
        assert n is not None
        return {
            "per_bucket": n,
            "for_the_run": power.pairs_needed(p10, p01, power=run_power),
            "power_at_half": power.equivalence_power(n // 2, p10, p01),
            "e_process_floor": e_process_floor(p10, p01),
        }
    if fixed != "loss":
        return {}
    mcnemar, stratified = _critical(TABLE, ALPHA / 2), _critical(TABLE, ALPHA)
    per_bucket = _at_least(lambda k: _test_power(k, p10, p01, mcnemar) >= power.POWER, 64)
    pooled = _at_least(lambda k: _test_power(BUCKETS * k, p10, p01, stratified) >= power.POWER, 16)
    return {"per_bucket": per_bucket, "stratified": pooled}


@functools.lru_cache(maxsize=16)
def equal_power_n(fixed: str, p10: float, p01: float, chance: float) -> int | None:
    """The fixed design's pairs per bucket for the run to reach the right decision with
    ``chance``, the sequential canary's own (its lower confidence bound), at the same alpha:
    every bucket's equivalence bound at ``chance ** (1 / BUCKETS)`` for (a), the stratified
    test (the most powerful fixed test of a drop shared by every bucket, so the smallest N)
    for (b)-(d)."""
    if fixed == "eq":
        return power.pairs_needed(p10, p01, power=chance ** (1 / BUCKETS))
    stratified = _critical(TABLE, ALPHA)
    return _at_least(lambda k: _test_power(BUCKETS * k, p10, p01, stratified) >= chance, 16)


def summarize(case: Case, out: Outcome) -> dict[str, Any]:
    """The figures of one case: wrong-decision share (per bucket for an EQUIVALENT row
    watched alone), decisions, pairs per bucket to a decision, the fixed design's N."""
    if case.questions == "equivalence":
        wrong = float((out.status == EQUIVALENT).mean())
        count = out.status.size
    else:
        wrong = float((out.decision == case.wrong).mean())
        count = out.decision.size
    decided = out.decision != OPEN
    per_bucket = out.pairs[decided] / BUCKETS
    row: dict[str, Any] = {
        "key": case.key,
        "name": case.name,
        "rates": {"p10": case.p10, "p01": case.p01, "drop": case.drop},
        "budget_per_bucket": case.budget,
        "pool": case.pool,
        "questions": case.questions,
        "wrong_decision": NAMES[case.wrong],
        "wrong_share": wrong,
        "wrong_counted_over": count,
        "allowance": ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / count),
        "shares": {NAMES[k]: float((out.decision == k).mean()) for k in NAMES},
        "pool_only_loss_share": float(out.pool_only.mean()),
        "undecided_at_budget": float((~decided).mean()),
        "mean_pairs_per_bucket": float(out.pairs.mean() / BUCKETS),
    }
    if case.questions == "both" and decided.any():
        row["median_pairs_per_bucket"] = float(np.median(per_bucket))
        row["p90_pairs_per_bucket"] = float(np.percentile(per_bucket, 90))
    if case.fixed:
        _compare_with_fixed(case, out, row)
    return row


def _compare_with_fixed(case: Case, out: Outcome, row: dict[str, Any]) -> None:
    """The fixed design beside the case: its N at 80% (``median_over_fixed``) and at the
    sequential canary's own chance of the right decision (``median_over_equal_power``, what
    the target is judged on: the same alpha and the same power)."""
    right = EQUIVALENT if case.wrong == LOSS else LOSS
    chance = lower_confidence(int((out.decision == right).sum()), out.decision.size)
    row["fixed_n"] = dict(fixed_n(case))
    row["fixed_n"]["equal_power"] = {
        "chance_of_the_right_decision": chance,
        "per_bucket": equal_power_n(case.fixed, case.p10, case.p01, chance),
    }
    if case.fixed == "eq":
        row["fixed_n"]["sequential_floor_at_80"] = sequential_floor(case.p10, case.p01, power.POWER)
    median = row.get("median_pairs_per_bucket")
    fixed, equal = row["fixed_n"]["per_bucket"], row["fixed_n"]["equal_power"]["per_bucket"]
    if median is not None and fixed:
        row["median_over_fixed"] = median / fixed
    if median is not None and equal:
        row["median_over_equal_power"] = median / equal
    if case.target is not None:
        row["target_median_over_fixed"] = case.target
        row["target_met"] = row.get("median_over_equal_power", math.inf) <= case.target


def machine() -> dict[str, Any]:
    return {
        "cpu_model": cpu_model(),
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def run_all(canaries: int, seed: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    cases = []
    for i, case in enumerate(CASES):
        t = time.perf_counter()
        row = summarize(case, simulate(case, canaries, seed + i))
        row["seed"] = seed + i
        row["seconds"] = round(time.perf_counter() - t, 2)
        cases.append(row)
    peeked = peeked_fixed_losses(canaries, seed + len(CASES))
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "seed": seed,
        "config": {
            "canaries": canaries,
            "buckets": BUCKETS,
            "round_pairs_per_bucket": ROUND,
            "budget_per_bucket": BUDGET,
            "reference_pass_rate": P_REF,
            "noise_each_way": NOISE,
            "tolerance": TOL,
            "alpha": ALPHA,
            "min_pairs": RULE.min_pairs,
            "pool_share": RULE.pool_share,
            "bucket_loss_alpha": RULE.bucket_loss_alpha(BUCKETS),
            "pool_loss_alpha": RULE.pool_loss_alpha(),
        },
        "cases": cases,
        "fixed_design_peeked": {
            "name": "no drop, the fixed design's loss tests looked at after every round",
            "seed": seed + len(CASES),
            "false_loss_share": peeked,
        },
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _fixed_cell(row: dict[str, Any]) -> str:
    f = row.get("fixed_n") or {}
    if "for_the_run" in f:
        return f"{f['per_bucket']} ({f['for_the_run']} for the run)"
    if "stratified" in f:
        return f"{f['per_bucket']} ({f['stratified']} stratified)"
    return "-"


def _equal_power_cell(row: dict[str, Any]) -> str:
    e = (row.get("fixed_n") or {}).get("equal_power")
    if not e or e["per_bucket"] is None:
        return "-"
    return f"{e['per_bucket']} (at {e['chance_of_the_right_decision']:.4f})"


def _ratio(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}" if key in row else "-"


def markdown(result: dict[str, Any]) -> str:
    """The README's table."""
    rows = [
        "| case | wrong decision: share | LOSS / KEEP-compatible / undecided | pairs per "
        "bucket to a decision: median / p90 | fixed design's N per bucket at 80% | at the "
        "sequential canary's chance of the right decision | median / N: at 80% / at equal "
        "power |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["cases"]:
        s = r["shares"]
        shares = f"{s['loss']:.3f} / {s['equivalent']:.3f} / {s['open']:.3f}"
        if r["pool_only_loss_share"] > 0:
            shares += f" (pool alone {r['pool_only_loss_share']:.3f})"
        pairs = (
            f"{r['median_pairs_per_bucket']:g} / {r['p90_pairs_per_bucket']:g}"
            if "median_pairs_per_bucket" in r
            else "-"
        )
        ratio = f"{_ratio(r, 'median_over_fixed')} / {_ratio(r, 'median_over_equal_power')}"
        if ratio == "- / -":
            ratio = "-"
        wrong = (
            f"{r['wrong_decision'].replace('equivalent', 'KEEP').upper()} {r['wrong_share']:.4f}"
        )
        rows.append(
            f"| {r['name']} | {wrong} | {shares} | {pairs} | {_fixed_cell(r)} | "
            f"{_equal_power_cell(r)} | {ratio} |"
        )
    p = result["fixed_design_peeked"]
    rows.append(f"| {p['name']} | LOSS {p['false_loss_share']:.4f} | - | - | - | - | - |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--canaries", type=int, default=CANARIES)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--markdown",
        nargs="?",
        const=OUT,
        type=Path,
        help="print the table of an existing result (default: --out's) and exit",
    )
    opts = ap.parse_args()
    if opts.markdown is not None:
        print(markdown(json.loads(opts.markdown.read_text())))
        return
    result = run_all(opts.canaries, opts.seed)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    print(
        f"\n{opts.canaries} canaries per case, seed {opts.seed} (+ case index), "
        f"{result['seconds']} s; written to {opts.out}"
    )


if __name__ == "__main__":
    main()
