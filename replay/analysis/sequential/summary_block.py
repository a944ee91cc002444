"""A sequential canary's round in, its counts and its summary block out.

:func:`round_counts` turns one round's grade rows (``grading.rows.grade_rows``) into the
``(pairs, regressions, improvements)`` of each bucket that ``SequentialState.update`` folds in:
the same pairs the fixed design's quality counts (``grading.pairing.combined_pairs``: explicit
checks against the reference's, derived grades against the A/A control's, or against a pass
without a control). :func:`sequential_record` writes the summary's ``sequential`` block: the
decision, why the run stopped, each bucket and the pool, what the undecided ones still need
(``sequential_plan.needs``), the interval path, and the pairs sent against the fixed design's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from replay.analysis.grading.pairing import combined_pairs, grades_frame
from replay.analysis.schemas import Sequential, SequentialBucket
from replay.analysis.sequential.plan import needs
from replay.analysis.sequential.state import HISTORY_COLUMNS, SequentialState, Tally
from replay.analysis.stats.pairs import discordant
from replay.analysis.stats.power import pairs_needed

FIXED_METHOD = (
    "per bucket, the pairs the fixed design needs for an 80% chance of showing the match "
    "at the disagreement rates seen (stats.power.pairs_needed); a bucket whose drop is at "
    "or beyond the tolerance, where no number would do, counts the requests the trace holds "
    "for it (what a fixed canary sends)"
)


def round_counts(
    rows: Sequence[Mapping[str, Any]],
    buckets: Mapping[str, str],
    candidate: str,
    reference: str,
    control: str | None,
) -> dict[str, tuple[int, int, int]]:
    """Each bucket's new pairs from one round's grade rows. ``buckets``: the round's request
    ids and the bucket each was planned in. A request some arm did not answer is no pair."""
    if not rows:
        return {}
    frame = grades_frame(rows)
    frame = frame[frame["request_id"].isin(list(buckets))]
    by_target = {t: f for t, f in frame.groupby("target", sort=False)}
    cand = by_target.get(candidate)
    out: dict[str, tuple[int, int, int]] = {}
    for bucket in dict.fromkeys(buckets.values()):
        ids = [i for i, b in buckets.items() if b == bucket]
        if cand is None:
            out[bucket] = (0, 0, 0)
            continue
        mine = cand[cand["request_id"].isin(ids)]
        ref = by_target.get(reference)
        ctl = by_target.get(control) if control is not None else None
        base, got, _ = combined_pairs(mine, ref, ctl)
        out[bucket] = discordant(base, got, "round_counts")
    return out


def fixed_design_pairs(state: SequentialState, pools: Mapping[str, int]) -> int:
    """What the fixed design would have sent (``FIXED_METHOD``); ``pools``: the trace's
    requests per bucket."""
    r, total = state.rule, 0
    for b in state.buckets:
        rates = (b.regressions / b.pairs, b.improvements / b.pairs) if b.pairs else (0.0, 0.0)
        n = pairs_needed(*rates, tolerance=r.tolerance, alpha=r.alpha, at_least=r.min_pairs)
        total += n if n is not None else pools.get(str(b.name), 0)
    return total


def _bucket(t: Tally) -> SequentialBucket:
    return SequentialBucket(
        name=t.name,
        status=t.status,
        pairs=t.pairs,
        regressions=t.regressions,
        improvements=t.improvements,
        decided_round=t.decided_round,
        lower=t.lower,
        upper=t.upper,
    )


def sequential_record(
    state: SequentialState,
    *,
    stopped: str,
    round_size: int,
    requests_sent: int,
    pools: Mapping[str, int],
    left: Mapping[str, int],
) -> Sequential:
    """The summary's ``sequential`` block. ``pools``: the trace's requests per bucket;
    ``left``: those not sent yet (what ``needs`` says would or would not cover a bucket)."""
    return Sequential(
        decision=state.decision,
        stopped=stopped,
        rounds=state.round,
        round_size=round_size,
        requests_sent=requests_sent,
        fixed_n=fixed_design_pairs(state, pools),
        fixed_method=FIXED_METHOD,
        trace_requests=sum(pools.values()),
        tolerance=state.rule.tolerance,
        alpha=state.rule.alpha,
        buckets=tuple(_bucket(b) for b in state.buckets),
        pool=_bucket(state.pool) if state.pooled else None,
        needs=tuple(n.reason for n in needs(state, left)),
        path=tuple(_path_rows(r.to_json() for r in state.history)),
    )


def _path_rows(rows: Iterable[list[Any]]) -> Iterable[dict[str, Any]]:
    return (dict(zip(HISTORY_COLUMNS, row, strict=True)) for row in rows)
