"""What the sequential canary does next: how many more pairs each open bucket would need, and
which buckets the next round's requests go to.

:func:`needs` projects, at the rates seen so far, when each open bucket's capital (and the
pool's) would settle one of its questions: a typical path, not a guarantee, the sequential
counterpart of the fixed design's "need N". :func:`plan_round` shares a round's requests among
the open buckets only: a decided bucket stops, and so does every bucket once the run is
decided.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from replay.analysis.sequential.capital import MAX_PROJECTED, pairs_to_cross
from replay.analysis.sequential.state import EQUIVALENT, LOSS, OPEN, SequentialState, Tally
from replay.analysis.stats.rule import Rule


@dataclass(frozen=True, slots=True)
class Need:
    """What an open bucket (or the pool: ``bucket`` None) would still need.

    ``question``: the one it would settle first at the rates seen so far ("loss" or
    "equivalent"); ``pairs``: its total pairs by then, ``more`` the pairs beyond those it has.
    All three are None when no number would do; ``reason`` says why, or says the number in
    words (and whether its requests left would cover it).
    """

    bucket: str | None
    question: str | None
    pairs: int | None
    more: int | None
    reason: str


def needs(state: SequentialState, available: Mapping[str, int] | None = None) -> list[Need]:
    """For each open bucket, and for the pool while it is asked, what it would still need.
    ``available``: requests left in each bucket's pool, to say when they would not cover it.
    Empty once the run is decided."""
    if state.decision != OPEN:
        return []
    left = dict(available) if available is not None else None
    buckets = len(state.buckets)
    out = [
        _need(b, state.rule, buckets, None if left is None else left.get(str(b.name), 0))
        for b in state.buckets
        if b.status == OPEN
    ]
    if state.pooled and state.pool.status == OPEN:
        pooled_left = None if left is None else sum(left.get(n, 0) for n in state.open_buckets)
        out.append(_need(state.pool, state.rule, buckets, pooled_left))
    return out


def _need(t: Tally, rule: Rule, buckets: int, left: int | None) -> Need:
    n, x, y = t.pairs, t.regressions, t.improvements
    who = "the pool" if t.name is None else f"bucket {t.name}"
    rates = (x / n, y / n) if n else (0.0, 0.0)
    a_loss = rule.pool_loss_alpha() if t.name is None else rule.bucket_loss_alpha(buckets)
    options: list[tuple[int, str]] = []
    loss_at = pairs_to_cross(rates, 0.0, "above", a_loss, at_least=n + 1)
    if loss_at is not None:
        options.append((loss_at, LOSS))
    if t.name is not None:
        at_least = max(rule.min_pairs, n + 1)
        eq_at = pairs_to_cross(rates, rule.tolerance, "below", rule.alpha, at_least=at_least)
        if eq_at is not None:
            options.append((eq_at, EQUIVALENT))
    seen = f"{n} pairs, {x} lost, {y} gained" if n else "no graded pairs yet"
    if not options:
        if t.name is None:
            why = "the pooled pairs show no drop so far: only the buckets' own questions settle"
        else:
            why = f"neither question settles within {MAX_PROJECTED} pairs at these rates"
        return Need(t.name, None, None, None, f"{who} ({seen}): {why}")
    total, question = min(options)
    what = (
        "show a loss"
        if question == LOSS
        else (f"bound the drop below the {100 * rule.tolerance:g}-point tolerance")
    )
    how = "if no pair disagrees" if n == 0 else "if pairs keep disagreeing at these rates"
    reason = f"{who} ({seen}): about {total - n} more pairs to {what}, {how}"
    if left is not None and total - n > left:
        reason += f"; more than the {left} requests left"
    return Need(t.name, question, total, total - n, reason)


def plan_round(
    state: SequentialState, available: Mapping[str, int], round_size: int
) -> dict[str, int]:
    """Requests per bucket for the next round: ``round_size`` shared as evenly as the pools
    allow among the open buckets (``SequentialState.open_buckets``) that have requests left.

    ``available``: requests left in each bucket's pool (a bucket left out has none; fold a
    per-bucket budget in by passing the smaller of the two). A bucket with fewer left than its
    share gets all it has and the others share the rest; an odd request goes to the bucket
    with the fewest pairs so far (then the later one in the state's order). Buckets that get
    nothing are left out; the plan is empty once the run is decided or nothing is left.
    """
    if round_size < 0:
        raise ValueError(f"plan_round: round_size must be >= 0, got {round_size}")
    for name, k in available.items():
        state.bucket(name)
        if k < 0:
            raise ValueError(f"plan_round: bucket {name!r} has {k} requests left")
    index = {name: i for i, name in enumerate(state.names)}
    room = {b: available.get(b, 0) for b in state.open_buckets if available.get(b, 0) > 0}
    # Smallest room first, so a short pool's unused share passes to the later buckets; among
    # equal rooms the most-paired bucket first, so the odd requests go to the least paired.
    order = sorted(room, key=lambda b: (room[b], -state.bucket(b).pairs, index[b]))
    plan: dict[str, int] = {}
    left = round_size
    for i, b in enumerate(order):
        give = min(room[b], left // (len(order) - i))
        if give > 0:
            plan[b] = give
        left -= give
    return {b: plan[b] for b in state.names if b in plan}
