"""How long each target reasons, per bucket, against the reference and the A/A floor.

A reasoning model served with an FP8 cache may reach the same answer by a longer chain of
thought: every extra reasoning token is decode time and cache the answer did not need, a
systems cost that pass rates do not show, and a sign that the cache changed what the model
computes. Per phase and bucket, each target's reasoning tokens are paired with the
reference's on the requests both answered (candidate - reference, mean with a paired
bootstrap interval); the A/A control (the reference replayed) gives the floor, the same
difference between two runs of one server. The verdict warns where a target reasons longer
beyond that floor (``verdict.rule.reasoning_warnings``), as it warns on teacher-forced
divergence: an early warning, never the reason for a decision.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import replace

from replay.analysis.grading.quality import CONTROL_SUFFIX
from replay.analysis.schemas import ReasoningDelta, ReasoningLength
from replay.analysis.stats.intervals import paired_bootstrap
from replay.core.records import Result


def reasoning_length(
    results: Iterable[Result], reference: str, bucket_order: Sequence[str], seed: int = 0
) -> ReasoningLength | None:
    """phase -> target -> bucket: each target's reasoning tokens minus the reference's on the
    same requests, with the A/A control's upper bound as the floor; None when no answer of
    any target reasoned, or no target was compared with the reference."""
    # phase -> target -> request id -> (bucket, reasoning tokens), answered requests only
    tokens: dict[str, dict[str, dict[str, tuple[str, int]]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    reasoned = False
    for r in results:
        if r.status == "ok":
            tokens[r.phase][r.target][r.request_id] = (r.bucket, r.reasoning_tokens)
            reasoned = reasoned or r.reasoning_tokens > 0
    if not reasoned:
        return None
    control = reference + CONTROL_SUFFIX
    phases = {}
    for phase, by_target in tokens.items():
        ref = by_target.get(reference)
        if ref is None:
            continue
        floor = _deltas(ref, by_target.get(control, {}), bucket_order, seed)
        compared = {
            target: {
                bucket: _with_floor(d, floor.get(bucket), control in by_target)
                for bucket, d in _deltas(ref, mine, bucket_order, seed).items()
            }
            for target, mine in by_target.items()
            if target != reference  # the control too: its row is the floor itself
        }
        if compared:
            phases[phase] = compared
    if not phases:  # the reference alone: nothing to compare its reasoning with
        return None
    return ReasoningLength(
        reference=reference,
        control=control if any(control in t for t in tokens.values()) else None,
        phases=phases,
    )


def _deltas(
    ref: dict[str, tuple[str, int]],
    mine: dict[str, tuple[str, int]],
    bucket_order: Sequence[str],
    seed: int,
) -> dict[str, ReasoningDelta]:
    pairs: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for rid, (bucket, n) in mine.items():
        if rid in ref:
            pairs[bucket][0].append(float(ref[rid][1]))
            pairs[bucket][1].append(float(n))
    out = {}
    for bucket in sorted(pairs, key=lambda b: (_index(bucket_order, b), b)):
        xs, ys = pairs[bucket]
        d = paired_bootstrap(xs, ys, seed=seed)
        if d is not None:  # never None: a bucket here has a pair
            out[bucket] = ReasoningDelta(
                pairs=d.n,
                reference_mean=d.mean_a,
                target_mean=d.mean_b,
                delta_mean=d.diff,
                lo=d.lo,
                hi=d.hi,
                floor_hi=None,
            )
    return out


def _with_floor(d: ReasoningDelta, floor: ReasoningDelta | None, control: bool) -> ReasoningDelta:
    """The target's delta with the A/A control's upper bound in its bucket (None without a
    control, or where the control has no pair there)."""
    if not control or floor is None:
        return d
    return replace(d, floor_hi=floor.hi)


def _index(order: Sequence[str], bucket: str) -> int:
    return order.index(bucket) if bucket in order else len(order)
