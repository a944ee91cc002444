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
  positions are computed. An interleaved run scores an arm's answers right after its own
  turn in each block of the first phase, while its server still holds their prompts
  (replay/run/interleave.py); what is left is scored after the phases, most recent first,
  while their prompts are the likeliest still cached. A miss costs a whole prefill, as
  without the cache: after the phases of a long run, most are misses.

Each row records how many positions came from the target's own answer (``own``) and how many
prompt tokens the server took from its cache (``cached``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
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


def read_result(results: Path, offset: int) -> Result:
    with results.open("rb") as fh:
        fh.seek(offset)
        return Result.from_json(orjson.loads(fh.readline()))


class Answers:
    """The results file read as it grows, each line once: where each reference answer of
    the first phase is (``ref``) and each arm's own answers of that phase that carry their
    logprobs, in the order they came (``own``), held only until scored; ``done``: the
    (target, request) pairs scored (a resumed run's, then each as it is)."""

    def __init__(
        self, results: Path, reference: str, first_phase: str, done: set[tuple[str, str]]
    ) -> None:
        self.results, self.reference, self.first_phase = results, reference, first_phase
        self.done = done
        self.ref: dict[str, int] = {}
        self.own: dict[str, dict[str, OwnAnswer]] = {}
        self._offset = 0

    def update(self) -> None:
        """Read the lines written since the last call (a line still being written waits)."""
        if not self.results.exists():
            return
        with self.results.open("rb") as fh:
            if fh.seek(0, 2) < self._offset:  # rewritten (a resume's repair): read it again
                self.ref.clear()
                self.own.clear()
                self._offset = 0
            fh.seek(self._offset)
            for raw in fh:
                if not raw.endswith(b"\n"):
                    break
                self._add(orjson.loads(raw), self._offset)
                self._offset += len(raw)

    def _add(self, row: dict[str, Any], offset: int) -> None:
        if row["phase"] != self.first_phase or row["status"] != "ok" or not row.get("prompt_ids"):
            return
        if row["target"] == self.reference and row.get("output_ids"):
            self.ref[row["request_id"]] = offset
        lps = row.get("output_logprobs")
        if lps and (row["target"], row["request_id"]) not in self.done:
            n = min(len(lps), len(row["output_ids"]))
            self.own.setdefault(row["target"], {})[row["request_id"]] = OwnAnswer(
                _digest(row["prompt_ids"]),
                array("q", row["output_ids"][:n]),
                array("d", lps[:n]),
            )


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


async def score_answers(target: str, answers: Answers, how: Scoring, *, ready: bool = False) -> int:
    """Score the reference's first-phase answers not yet scored under ``target``, a row per
    answer in the writer (each added to ``answers.done``): those the target answered itself most
    recent first (their prompts are the likeliest still cached), then the others; ``ready``:
    only those the target has answered so far (between an interleaved phase's blocks, their
    prompts still in its cache), without a progress bar of their own. Returns the rows
    written."""
    answers.update()
    offsets, mine, done = answers.ref, answers.own.get(target, {}), answers.done
    order = [rid for rid in reversed(mine) if rid in offsets and (target, rid) not in done]
    if not ready:
        ordered = set(order)
        order += [rid for rid in offsets if (target, rid) not in done and rid not in ordered]
    if not order:
        return 0
    if not ready:
        how.progress.phase(target, "teacher-forced", len(order))

    async def one(rid: str) -> None:
        ref = read_result(answers.results, offsets[rid])
        s = await score(ref, mine.get(rid), how)
        how.writer.write({"target": target, "request_id": rid, "bucket": ref.bucket, **s.to_json()})
        done.add((target, rid))
        mine.pop(rid, None)  # held only until scored: a long run's answers are not all held
        if not ready:
            how.progress.advance(target, "teacher-forced", s.error is None)

    await pooled(iter(order), one, how.concurrency)
    return len(order)
