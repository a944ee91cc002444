"""The trend across context length of one target in one phase (``Trend``): each request's
paired difference to the reference against its prompt tokens (``stats.trend``).

Two differences per request. Graded: the pairs the verdict pools (``pairing.combined_pairs``:
a check's grade against the reference's, a derived grade against the A/A control's), target
minus baseline. Teacher-forced: the reference's answer scored under the target, its mean
ΔNLL per token against the reference's own score (the early warning, ``compare.teacher_forced``
per bucket). The A/A control's graded trend reads its explicit checks only: its derived grades
are every candidate's baseline, with nothing of its own to pair them with.

A request's context is its prompt tokens as the run counted them (``prompt_token_counts``:
the reference's count, else another target's); a request whose count is unknown is left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from replay.analysis.grading.compare import scored
from replay.analysis.grading.pairing import combined_differences, graded_in_both
from replay.analysis.schemas import TargetQuality
from replay.analysis.schemas.trend import LengthSlope, Trend
from replay.analysis.stats.trend import NoTrend, length_trend

if TYPE_CHECKING:
    import pandas as pd

    from replay.analysis.result_table import ResultTable


def prompt_token_counts(results: ResultTable, reference: str) -> dict[str, float]:
    """Request id -> its prompt tokens: the reference's count where it has one (the prompt
    every target was sent is the same; the reference's tokenizer counted it), else the first
    other target's."""
    import numpy as np

    tokens = results.floats("prompt_tokens")
    codes = results.codes("request_id")
    ids = results.values("request_id")
    known = np.isfinite(tokens) & (tokens > 0)
    is_ref = results.codes("target") == results.code_of("target", reference)
    out: dict[str, float] = {}
    # The reference's counts last, so that they win.
    for mask in (known & ~is_ref, known & is_ref):
        at = np.flatnonzero(mask)
        out.update(zip((ids[c] for c in codes[at]), tokens[at].tolist(), strict=True))
    return out


def with_trends(
    out: Mapping[str, TargetQuality],
    targets: Mapping[str, pd.DataFrame],
    tf: Mapping[str, Mapping[str, Mapping[str, Any]]],
    tokens: Mapping[str, float],
    names: tuple[str, str],
    *,
    demoted: frozenset[str] = frozenset(),
    seed: int = 0,
    alpha: float = 0.05,
) -> dict[str, TargetQuality]:
    """One phase's ``TargetQuality`` records (``out``, by target) with their trends: every
    target but the reference (``names``: the reference's and the A/A control's names), the
    control's slopes copied into the others' as their floor."""
    reference, control = names
    ref, floor = targets.get(reference), targets.get(control)
    trends = {
        name: target_trend(
            targets[name],
            ref,
            floor,
            (tf.get(name, {}), tf.get(reference, {})),
            tokens,
            is_control=name == control,
            demoted=demoted,
            seed=seed,
            alpha=alpha,
        )
        for name in out
        if name != reference and name in targets
    }
    own = trends.get(control)
    if own is not None:
        trends = {
            name: t
            if name == control
            else replace(t, graded_floor=own.graded, teacher_forced_floor=own.teacher_forced)
            for name, t in trends.items()
        }
    return {name: replace(q, trend=trends.get(name)) for name, q in out.items()}


def target_trend(
    rows: pd.DataFrame,
    ref: pd.DataFrame | None,
    control: pd.DataFrame | None,
    tf: tuple[Mapping[str, Mapping[str, Any]], Mapping[str, Mapping[str, Any]]],
    tokens: Mapping[str, float],
    *,
    is_control: bool,
    demoted: frozenset[str] = frozenset(),
    seed: int = 0,
    alpha: float = 0.05,
) -> Trend:
    """The graded and teacher-forced trends of one target's rows in one phase (``rows``: its
    grade rows, indexed by request id; ``ref``, ``control``: the reference's and the A/A
    control's; ``tf``: the target's and the reference's teacher-forced scores by request)."""
    if is_control:  # its explicit checks against the reference's (module docstring)
        graded = {} if ref is None else _explicit_differences(rows, ref)
    else:
        graded = _by_id(combined_differences(rows, ref, control, demoted))
    ids = rows.index.tolist()
    # Plain lists and dicts: a pandas string column read an item at a time is 5x slower.
    buckets = dict(zip(ids, rows["bucket"].tolist(), strict=True))
    deltas = tf_differences(*tf, ids)
    return Trend(
        graded=_slope(graded, buckets, tokens, seed, alpha, none="no graded pair"),
        teacher_forced=_slope(deltas, buckets, tokens, seed, alpha, none="no teacher-forced score"),
    )


def _by_id(diffs: pd.Series) -> dict[str, float]:
    return dict(zip(diffs.index.tolist(), diffs.astype(float).tolist(), strict=True))


def _explicit_differences(rows: pd.DataFrame, ref: pd.DataFrame) -> dict[str, float]:
    theirs, mine = graded_in_both(rows, ref, "passed")
    return _by_id(mine.astype(float) - theirs.astype(float))


def tf_differences(
    tf: Mapping[str, Mapping[str, Any]], tf_ref: Mapping[str, Mapping[str, Any]], ids: Any
) -> dict[str, float]:
    """Request id -> the mean ΔNLL per token of the reference's answer under the target,
    against the reference's own score, for the requests both scored alike (``scored``)."""
    out: dict[str, float] = {}
    if not tf or not tf_ref:  # no teacher-forced scoring in this run
        return out
    for rid in ids:
        s, base = tf.get(rid), tf_ref.get(rid)
        if s is None or base is None or not scored(s, base) or not s["nll"]:
            continue
        d = [x - y for x, y in zip(s["nll"], base["nll"], strict=True)]
        out[rid] = float(sum(d)) / len(d)
    return out


def _slope(
    diffs: Mapping[str, float],
    buckets: Mapping[str, str],
    tokens: Mapping[str, float],
    seed: int,
    alpha: float,
    none: str,
) -> LengthSlope:
    """The slope of ``diffs`` (request id -> difference) against the requests' prompt tokens,
    its requests in their buckets; a request of unknown length is left out. ``none``: the
    reason when there is no difference at all."""
    known = [rid for rid in diffs if rid in tokens]
    fit = length_trend(
        [diffs[r] for r in known],
        [tokens[r] for r in known],
        [str(buckets[r]) for r in known],
        alpha=alpha,
        seed=seed,
    )
    if isinstance(fit, NoTrend):
        return LengthSlope(
            requests=fit.requests,
            buckets=fit.buckets,
            slope=None,
            lo=None,
            hi=None,
            p_value=None,
            reason=none if not diffs else _reason(fit, len(diffs)),
        )
    return LengthSlope(
        requests=fit.requests,
        buckets=fit.buckets,
        slope=fit.slope,
        lo=fit.lo,
        hi=fit.hi,
        p_value=fit.p_value,
    )


def _reason(fit: NoTrend, paired: int) -> str:
    unknown = paired - fit.requests
    return fit.reason + (f" ({unknown} more of unknown length)" if unknown else "")
