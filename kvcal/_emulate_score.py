"""Every evaluation request scored under a setting against BF16: teacher-forced NLL and top-1
agreement of the reference answer, and greedy answers on a small sample.

BF16 first: the greedy answers (each request's reference answer, unless a replay run gave
one) and the teacher-forced reference scores; then each setting against them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._emulate import Setting, eos_ids, greedy, new_cache, teacher_forced
from ._emulate_requests import Item

Score = dict[str, Any]  # replay's teacher-forced row: {"n", "nll", "top1", "error"}


@dataclass
class Reference:
    """BF16 teacher-forced scores of every item's answer: NLL and argmax per token."""

    nll: dict[str, list[float]] = field(default_factory=dict)
    argmax: dict[str, list[int]] = field(default_factory=dict)


def reference_scores(
    model: Any, items: Sequence[Item], chunk: int, advance: Callable[[int], None]
) -> Reference:
    ref = Reference()
    for it in items:
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
) -> None:
    """Each item's BF16 greedy answer (its reference answer unless a run gave one)."""
    eos = eos_ids(model)
    for it in items:
        it.bf16_greedy = tuple(
            greedy(model, it.prompt, it.max_new, eos, new_cache(model, None), chunk)
        )
        if not it.answer:
            it.answer = it.bf16_greedy
        advance(1)


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
