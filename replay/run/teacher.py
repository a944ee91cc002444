"""Teacher-forced divergence: the reference's own output, scored under every target.

Each position of the reference's answer gives the target's negative log-likelihood of the
reference's token after the same prompt and the answer before it, and whether the target's
top-1 choice was that token. Free-running outputs diverge at the first different token and say
little after it; this measures every position. Identical scores between a BF16 and an FP8
target mean this path did not exercise the FP8 cache on this backend, and the report says so
rather than "no loss".

Scoring costs little, because most of it was computed when the target answered:

* where the target's own answer to the request begins with the same tokens as the
  reference's (all of it for the reference itself, most of it for an A/A control), those
  positions are scored by the log-probabilities the target gave its own tokens as it
  generated them (``Result.output_logprobs``; top-1 by greedy decoding);
* the rest is asked of the target with ``prompt_logprobs`` (``replay.serving.prompt_scores``),
  through the endpoint that may reuse its prefix cache when it has one (what is left of the
  prompt the target answered, under the phase's own cache salt), so that only the answer's
  positions are computed. Answers are scored most recent first, while their prompts are
  still likely to be cached; a miss costs a whole prefill, as without the cache.

Each row records how many positions came from the target's own answer (``own``) and how many
prompt tokens the server took from its cache (``cached``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from replay.core.iterate import pooled
from replay.core.records import Result
from replay.run.progress import Progress
from replay.rundir.files import JsonlWriter
from replay.serving.prompt_scores import Scores, score_cached, score_completions
from replay.traces.sessions import common_prefix


@dataclass(frozen=True, slots=True)
class TFScore:
    """Scores of ``n`` reference tokens under one target, or why there are none."""

    n: int
    nll: tuple[float, ...] = ()
    top1: tuple[bool, ...] = ()
    error: str | None = None
    own: int = 0  # positions scored by the target's own generation
    cached: int = 0  # prompt tokens the scoring request read from the prefix cache

    def to_json(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "nll": list(self.nll),
            "top1": list(self.top1),
            "error": self.error,
            "own": self.own,
            "cached": self.cached,
        }


@dataclass(frozen=True, slots=True)
class OwnAnswer:
    """What of a target's own answer scores the reference's: its tokens, their logprobs
    and which prompt they answered."""

    prompt: bytes  # sha1 of the prompt's token ids
    output_ids: array[int]
    logprobs: array[float]


def _digest(ids: Sequence[int]) -> bytes:
    return hashlib.sha1(array("q", ids).tobytes()).digest()


def own_answers(results: Path, target: str, phase: str) -> dict[str, OwnAnswer]:
    """The target's answers in ``phase`` that carry their logprobs, in the order they came."""
    out: dict[str, OwnAnswer] = {}
    for row in _rows(results):
        if row["target"] != target or row["phase"] != phase or row["status"] != "ok":
            continue
        lps = row.get("output_logprobs")
        if lps and row.get("prompt_ids"):
            n = min(len(lps), len(row["output_ids"]))
            out[row["request_id"]] = OwnAnswer(
                _digest(row["prompt_ids"]),
                array("q", row["output_ids"][:n]),
                array("d", lps[:n]),
            )
    return out


def reference_offsets(results: Path, reference: str, first_phase: str) -> dict[str, int]:
    """Where in the results file each reference answer that scoring can use is (the
    answers' token ids are the bulk of a result: they are read back one at a time)."""
    out: dict[str, int] = {}
    if not results.exists():
        return out
    with results.open("rb") as fh:
        offset = 0
        for raw in fh:
            if not raw.endswith(b"\n"):
                break  # another target's line, still being written (after ours)
            row = orjson.loads(raw)
            if (
                row["target"] == reference
                and row["phase"] == first_phase
                and row["status"] == "ok"
                and row.get("prompt_ids")
                and row.get("output_ids")
            ):
                out[row["request_id"]] = offset
            offset += len(raw)
    return out


def _rows(results: Path) -> Iterator[dict[str, Any]]:
    if not results.exists():
        return
    with results.open("rb") as fh:
        for raw in fh:
            if not raw.endswith(b"\n"):
                break
            yield orjson.loads(raw)


def read_result(results: Path, offset: int) -> Result:
    with results.open("rb") as fh:
        fh.seek(offset)
        return Result.from_json(orjson.loads(fh.readline()))


@dataclass(frozen=True)
class Scoring:
    """Where one target's teacher-forced scores go, and how they are asked for: ``salt`` is
    the cache salt of the target's first phase (its prefix cache), ``cached`` whether the
    target serves scores that may read it."""

    session: aiohttp.ClientSession
    url: str
    model: str
    writer: JsonlWriter
    progress: Progress
    timeout_s: float
    salt: str | None
    cached: bool = False
    concurrency: int = 4


async def score_tokens(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    *,
    salt: str | None = None,
    timeout_s: float = 600.0,
) -> TFScore:
    """``output_ids`` after ``prompt_ids`` scored under the target at ``url``, every position
    computed (``kvcal verify`` compares two servers on the same sequences)."""
    if not output_ids:
        return TFScore(0, error="no tokens to score")
    tokens = [*prompt_ids, *output_ids]
    s = await score_completions(
        session, url, model, tokens, len(prompt_ids), salt=salt, timeout_s=timeout_s
    )
    return TFScore(0, error=s.error) if s.error else TFScore(len(s.nll), s.nll, s.top1)


async def score(ref: Result, own: OwnAnswer | None, how: Scoring) -> TFScore:
    """The reference's answer ``ref`` under the target: from the target's own answer as far
    as the two agree, then from the server."""
    answer = ref.output_ids
    if not answer:
        return TFScore(0, error="the reference produced no tokens")
    assert ref.prompt_ids is not None
    same = 0
    if own is not None and own.prompt == _digest(ref.prompt_ids):
        same = common_prefix(own.output_ids, answer)
    head = TFScore(same, tuple(-x for x in own.logprobs[:same]) if own else (), (True,) * same)
    if same == len(answer):
        return TFScore(same, head.nll, head.top1, own=same)
    tokens = [*ref.prompt_ids, *answer]
    start = len(ref.prompt_ids) + same
    salt, timeout_s = how.salt, how.timeout_s
    rest: Scores = (
        await score_cached(
            how.session, how.url, how.model, tokens, start, salt=salt, timeout_s=timeout_s
        )
        if how.cached
        else await score_completions(
            how.session, how.url, how.model, tokens, start, salt=salt, timeout_s=timeout_s
        )
    )
    if rest.error is not None:
        return TFScore(0, error=rest.error)
    return TFScore(
        len(answer), head.nll + rest.nll, head.top1 + rest.top1, own=same, cached=rest.cached
    )


async def score_answers(
    target: str,
    results: Path,
    reference: str,
    first_phase: str,
    done: set[tuple[str, str]],
    how: Scoring,
) -> None:
    """Score every reference answer of ``first_phase`` not in ``done`` under ``target``, a row
    per answer in the writer: those the target answered itself most recent first (their
    prompts are the likeliest still cached), then the others."""
    offsets = reference_offsets(results, reference, first_phase)
    mine = own_answers(results, target, first_phase)
    due = [rid for rid in offsets if (target, rid) not in done]
    if not due:
        return
    order = [rid for rid in reversed(mine) if rid in offsets and (target, rid) not in done]
    ordered = set(order)
    order += [rid for rid in due if rid not in ordered]
    how.progress.phase(target, "teacher-forced", len(order))

    async def one(rid: str) -> None:
        ref = read_result(results, offsets[rid])
        s = await score(ref, mine.get(rid), how)
        how.writer.write({"target": target, "request_id": rid, "bucket": ref.bucket, **s.to_json()})
        how.progress.advance(target, "teacher-forced", s.error is None)

    await pooled(iter(order), one, how.concurrency)
