"""Teacher-forced divergence: the reference's own output, scored under every target.

The prompt is the reference's chat-templated prompt tokens followed by its output tokens,
sent to ``/v1/completions`` with ``prompt_logprobs``; each output position gives the target's
negative log-likelihood of the reference token and whether its top-1 choice was that token.
Free-running outputs diverge at the first different token and say little after it; this
measures every position. Identical scores between a BF16 and an FP8 target mean this path did
not exercise the FP8 cache on this backend, and the report says so rather than "no loss".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from replay.core.iterate import closing, pooled
from replay.core.records import Result
from replay.core.strict import number
from replay.run.progress import Progress
from replay.run.rundir import JsonlWriter
from replay.serving.introspect import EndpointError, fetch_json, quote

# One prompt_logprobs entry is about 100 bytes a position: room for prompts of ~500k tokens.
MAX_SCORES_BODY = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TFScore:
    """Scores of ``n`` reference tokens under one target, or why there are none."""

    n: int
    nll: tuple[float, ...] = ()
    top1: tuple[bool, ...] = ()
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"n": self.n, "nll": list(self.nll), "top1": list(self.top1), "error": self.error}


def _position(entry: Any, token: int) -> tuple[float, bool] | None:
    """(nll, is_top1) of ``token`` in one prompt_logprobs position."""
    if not isinstance(entry, dict):
        return None
    hit = entry.get(str(token))
    if not isinstance(hit, dict):
        return None
    lp = number(hit.get("logprob"))
    if lp is None:
        return None
    return -lp, hit.get("rank") == 1


def parse_scores(body: Any, prompt_len: int, output_ids: Sequence[int]) -> TFScore:
    try:
        plp = body["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        return TFScore(0, error="no prompt_logprobs in the response")
    if not isinstance(plp, list) or len(plp) != prompt_len + len(output_ids):
        return TFScore(0, error="prompt_logprobs has the wrong length")
    nll, top1 = [], []
    for i, tok in enumerate(output_ids):
        pos = _position(plp[prompt_len + i], tok)
        if pos is None:
            return TFScore(0, error=f"position {i}: reference token missing from logprobs")
        nll.append(pos[0])
        top1.append(pos[1])
    return TFScore(len(nll), tuple(nll), tuple(top1))


async def score(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    *,
    salt: str | None = None,
    timeout_s: float = 600.0,
) -> TFScore:
    """Score ``output_ids`` after ``prompt_ids`` under the target at ``url``."""
    if not output_ids:
        return TFScore(0, error="the reference produced no tokens")
    body: dict[str, Any] = {
        "model": model,
        "prompt": [*prompt_ids, *output_ids],
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 1,
    }
    if salt:
        body["cache_salt"] = salt
    try:
        ans = await fetch_json(
            session,
            "POST",
            url,
            "/v1/completions",
            json_body=body,
            timeout_s=timeout_s,
            max_bytes=MAX_SCORES_BODY,
        )
    except EndpointError as exc:
        return TFScore(0, error=str(exc))
    scored = parse_scores(ans.value, len(prompt_ids), output_ids)
    if scored.error is not None:
        return TFScore(0, error=f"{ans.label}: {scored.error}; got {quote(ans.body)}")
    return scored


def reference_answers(results: Path, reference: str, first_phase: str) -> Iterator[Result]:
    """The reference's answers in the first phase that scoring can use (token ids of the
    prompt and the output), read back from results.jsonl rather than kept in memory."""
    if not results.exists():
        return
    with results.open("rb") as fh:
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
                yield Result.from_json(row)


@dataclass(frozen=True)
class Scoring:
    """Where one target's teacher-forced scores go, and how they are sent."""

    session: aiohttp.ClientSession
    url: str
    model: str
    writer: JsonlWriter
    progress: Progress
    timeout_s: float
    salt: str
    concurrency: int = 4


async def score_answers(target: str, answers: Callable[[], Iterator[Result]], how: Scoring) -> None:
    """Score each of ``answers()`` under ``target``, a row per answer in the writer. The
    answers are read from the results file as the workers take them (their token ids are the
    bulk of a result), never all at once."""
    due = sum(1 for _ in answers())
    if not due:
        return
    how.progress.phase(target, "teacher-forced", due)

    async def one(ref: Result) -> None:
        assert ref.prompt_ids is not None
        s = await score(
            how.session,
            how.url,
            how.model,
            ref.prompt_ids,
            ref.output_ids,
            salt=how.salt,
            timeout_s=how.timeout_s,
        )
        how.writer.write(
            {"target": target, "request_id": ref.request_id, "bucket": ref.bucket, **s.to_json()}
        )
        how.progress.advance(target, "teacher-forced", s.error is None)

    with closing(answers()) as items:
        await pooled(items, one, how.concurrency)
