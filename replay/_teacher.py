"""Teacher-forced divergence: the reference's own output, scored under every target.

The prompt is the reference's chat-templated prompt tokens followed by its output tokens,
sent to ``/v1/completions`` with ``prompt_logprobs``; each output position gives the target's
negative log-likelihood of the reference token and whether its top-1 choice was that token.
Free-running outputs diverge at the first different token and say little after it; this
measures every position. Identical scores between a BF16 and an FP8 target mean this path did
not exercise the FP8 cache on this backend, and the report says so rather than "no loss".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp


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
    if not isinstance(hit, dict) or not isinstance(hit.get("logprob"), int | float):
        return None
    return -float(hit["logprob"]), hit.get("rank") == 1


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


async def score(session: aiohttp.ClientSession, url: str, model: str,
                prompt_ids: Sequence[int], output_ids: Sequence[int], *,
                salt: str | None = None, timeout_s: float = 600.0) -> TFScore:
    """Score ``output_ids`` after ``prompt_ids`` under the target at ``url``."""
    if not output_ids:
        return TFScore(0, error="the reference produced no tokens")
    body: dict[str, Any] = {"model": model, "prompt": [*prompt_ids, *output_ids],
                            "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 1}
    if salt:
        body["cache_salt"] = salt
    try:
        async with session.post(url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return TFScore(0, error=f"HTTP {r.status}: {(await r.text())[:300]}")
            data = await r.json()
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        return TFScore(0, error=f"request failed: {exc!r}")
    return parse_scores(data, len(prompt_ids), output_ids)
