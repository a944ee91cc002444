"""Every evaluation request scored under a setting against BF16: teacher-forced NLL and top-1
agreement of the reference answer, and greedy answers on a small sample; and their summaries
with intervals.

BF16 first: the greedy answers (each request's reference answer, unless a replay run gave
one) and the teacher-forced reference scores; then each setting against them.

ΔNLL per token is the mean over every answer token of (NLL under the setting - NLL under
BF16), as replay reports it; its 95% interval is a percentile bootstrap over requests (2,000
resamples, seeded): requests are resampled with all their tokens, since the tokens of one
answer are not independent, and the per-token mean is recomputed (a cluster bootstrap, so the
interval is that of the reported figure; replay's own interval is over per-request means).
Top-1 agreement is the share of answer positions where the setting's argmax is BF16's argmax,
with the same kind of interval. Greedy agreement (a small sample per bucket) is the
exact-match rate with a Wilson interval and the mean common prefix in tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from replay.analysis.stats.intervals import cluster_ci

from .cache import Setting, eos_ids, greedy, greedy_scored, new_cache, teacher_forced
from .requests import Item

Score = dict[str, Any]  # replay's teacher-forced row: {"n", "nll", "top1", "error"}


@dataclass
class Reference:
    """BF16 teacher-forced scores of every item's answer: NLL and argmax per token."""

    nll: dict[str, list[float]] = field(default_factory=dict)
    argmax: dict[str, list[int]] = field(default_factory=dict)


def reference_scores(
    model: Any,
    items: Sequence[Item],
    chunk: int,
    advance: Callable[[int], None],
    known: Reference | None = None,
) -> Reference:
    """Every item's BF16 teacher-forced scores: ``known``'s where it has them (the greedy
    answers' own, :func:`bf16_answers`), the rest scored here (``advance`` per item)."""
    ref = Reference()
    for it in items:
        if known is not None and it.id in known.nll:
            ref.nll[it.id], ref.argmax[it.id] = known.nll[it.id], known.argmax[it.id]
            continue
        ref.nll[it.id], ref.argmax[it.id] = teacher_forced(
            model, it.prompt, it.answer, new_cache(model, None), chunk
        )
        advance(1)
    return ref


def score_setting(
    model: Any,
    items: Sequence[Item],
    setting: Setting,
    ref: Reference,
    chunk: int,
    advance: Callable[[int], None],
) -> dict[str, Score]:
    """Teacher-forced scores under ``setting``; top-1 = the argmax agrees with BF16's."""
    out: dict[str, Score] = {}
    for it in items:
        nll, top = teacher_forced(model, it.prompt, it.answer, new_cache(model, setting), chunk)
        agree = [a == b for a, b in zip(top, ref.argmax[it.id], strict=True)]
        out[it.id] = {"n": len(nll), "nll": nll, "top1": agree, "error": None}
        advance(1)
    return out


def bf16_answers(
    model: Any, items: Sequence[Item], chunk: int, advance: Callable[[int], None]
) -> Reference:
    """Each item's BF16 greedy answer (its reference answer unless a run gave one), and the
    reference scores of the answers it gives: they share the prompt's prefill."""
    eos = eos_ids(model)
    scored = Reference()
    for it in items:
        if it.answer:  # a run's answer is the reference: the greedy one only compared
            it.bf16_greedy = tuple(
                greedy(model, it.prompt, it.max_new, eos, new_cache(model, None), chunk)
            )
            advance(1)
            continue
        answer, nll, top = greedy_scored(model, it.prompt, it.max_new, eos, chunk)
        it.bf16_greedy = tuple(answer)
        if answer:
            it.answer = it.bf16_greedy
            scored.nll[it.id], scored.argmax[it.id] = nll, top
        advance(1)
    return scored


def greedy_agreement(
    model: Any, items: Sequence[Item], setting: Setting, chunk: int, advance: Callable[[int], None]
) -> dict[str, dict[str, Any]]:
    """Greedy answers under ``setting`` against the BF16 greedy answers: exact match and the
    common prefix, in tokens."""
    eos = eos_ids(model)
    out: dict[str, dict[str, Any]] = {}
    for it in items:
        assert it.bf16_greedy is not None
        got = greedy(
            model,
            it.prompt,
            len(it.bf16_greedy) or it.max_new,
            eos,
            new_cache(model, setting),
            chunk,
        )
        prefix = next(
            (i for i, (a, b) in enumerate(zip(got, it.bf16_greedy, strict=False)) if a != b),
            min(len(got), len(it.bf16_greedy)),
        )
        out[it.id] = {
            "bucket": it.bucket,
            "exact": tuple(got) == it.bf16_greedy,
            "common_prefix": prefix,
            "tokens": len(it.bf16_greedy),
        }
        advance(1)
    return out


# -- summaries with intervals ---------------------------------------------------------------


N_BOOT = 2000


def tf_summary(
    scores: dict[str, Score], ref: Reference, ids: Sequence[str], seed: int = 0
) -> dict[str, Any]:
    """ΔNLL per token and top-1 agreement over the answer tokens of ``ids``, each with a
    request-level (cluster) bootstrap interval; the keys of replay's teacher-forced summary."""
    sums, agree, counts = [], [], []
    identical = True
    for rid in ids:
        s, base = scores[rid], ref.nll[rid]
        d = [x - y for x, y in zip(s["nll"], base, strict=True)]
        identical = identical and all(x == 0.0 for x in d)
        sums.append(sum(d))
        agree.append(float(sum(s["top1"])))
        counts.append(len(d))
    tokens = sum(counts)
    nll_ci, top1_ci = cluster_ci(sums, counts, seed=seed), cluster_ci(agree, counts, seed=seed)
    return {
        "tokens": tokens,
        "requests": len(counts),
        "nll_delta_mean": sum(sums) / tokens if tokens else None,
        "nll_delta_lo": None if nll_ci is None else nll_ci[0],
        "nll_delta_hi": None if nll_ci is None else nll_ci[1],
        "top1_agreement": sum(agree) / tokens if tokens else None,
        "top1_lo": None if top1_ci is None else top1_ci[0],
        "top1_hi": None if top1_ci is None else top1_ci[1],
        "identical_to_bf16": bool(tokens) and identical,
    }


def greedy_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    from replay.analysis.stats.intervals import wilson

    if not rows:
        return None
    exact = sum(bool(r["exact"]) for r in rows)
    ci = wilson(exact, len(rows))
    return {
        "requests": len(rows),
        "exact": exact,
        "exact_rate": exact / len(rows),
        "exact_lo": ci[0] if ci else None,
        "exact_hi": ci[1] if ci else None,
        "mean_common_prefix": sum(r["common_prefix"] for r in rows) / len(rows),
        "mean_tokens": sum(r["tokens"] for r in rows) / len(rows),
    }


def by_bucket(items: Sequence[Item], labels: Sequence[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {label: [] for label in labels}
    for it in items:
        out[it.bucket].append(it.id)
    return {label: ids for label, ids in out.items() if ids}
