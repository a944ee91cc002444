"""A target's log-probabilities of a token sequence it is given (``prompt_logprobs``).

Two ways to ask, by what the server offers:

* ``/v1/completions`` with ``prompt_logprobs``: every server has it, but vLLM computes a request
  that asks for prompt logprobs from scratch (``SamplingParams.skip_reading_prefix_cache``), so
  scoring an answer costs a prefill of its whole prompt again;
* vLLM's token-in/token-out endpoint ``/inference/v1/generate`` (served with
  ``--enable-scale-out``), which takes the sampling parameters whole, so the scoring request
  may read the prefix cache that the target's own answer to the same prompt left (same
  ``cache_salt``): only the positions after the cached ones are computed. vLLM fills only
  those rows of the prompt logprobs (the others hold whatever the buffer held before), and
  says how many it took from the cache (``usage.prompt_tokens_details.cached_tokens``, with
  ``--enable-prompt-tokens-details``): a score is taken only from computed rows. The unset
  rows are never decoded (``detokenize`` off: a garbage token id stops vLLM's output
  handler), and when they hold a value JSON cannot carry (vLLM answers 400, "Out of range
  float values") or the cache reached the positions asked for, the score is asked of
  ``/v1/completions`` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from replay.core.errors import EndpointError
from replay.core.strict import number
from replay.serving.endpoints import fetch_json, quote

# One prompt_logprobs entry is about 100 bytes a position: room for prompts of ~500k tokens.
MAX_SCORES_BODY = 64 * 1024 * 1024
GENERATE = "/inference/v1/generate"
# What a local server is started with so that its scores can reuse its prefix cache.
CACHED_SCORING_ARGS = ("--enable-scale-out", "--enable-prompt-tokens-details")


@dataclass(frozen=True, slots=True)
class Scores:
    """NLL and top-1 of ``tokens[start:]``, each given the tokens before it, or why there are
    none; ``cached``: prompt tokens the server took from its prefix cache."""

    nll: tuple[float, ...] = ()
    top1: tuple[bool, ...] = ()
    error: str | None = None
    cached: int = 0


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


def parse_positions(plp: Any, tokens: Sequence[int], start: int) -> Scores:
    """The scores of ``tokens[start:]`` from a ``prompt_logprobs`` list over ``tokens``."""
    if not isinstance(plp, list) or len(plp) != len(tokens):
        return Scores(error="prompt_logprobs has the wrong length")
    nll, top1 = [], []
    for i in range(start, len(tokens)):
        pos = _position(plp[i], tokens[i])
        if pos is None:
            return Scores(error=f"position {i}: the token is missing from logprobs")
        nll.append(pos[0])
        top1.append(pos[1])
    return Scores(tuple(nll), tuple(top1))


async def score_completions(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    tokens: Sequence[int],
    start: int,
    *,
    salt: str | None,
    timeout_s: float,
) -> Scores:
    """``tokens[start:]`` scored through ``/v1/completions`` (the whole sequence computed)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(tokens),
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,  # the token's own logprob and rank: all a score needs
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
        return Scores(error=str(exc))
    try:
        plp = ans.value["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        return Scores(
            error=f"{ans.label}: no prompt_logprobs in the response; got {quote(ans.body)}"
        )
    scored = parse_positions(plp, tokens, start)
    if scored.error is not None:
        return Scores(error=f"{ans.label}: {scored.error}; got {quote(ans.body)}")
    return scored


async def score_cached(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    tokens: Sequence[int],
    start: int,
    *,
    salt: str | None,
    timeout_s: float,
) -> Scores:
    """``tokens[start:]`` scored through ``/inference/v1/generate``, reading the prefix cache
    up to the positions asked for; when that cannot be used (the cache reached them, or the
    rows vLLM left unset held values JSON cannot carry), through ``/v1/completions``."""
    first = await _generate(session, url, tokens, start, salt, timeout_s, read_cache=True)
    if first.error is None:
        return first
    return await score_completions(
        session, url, model, tokens, start, salt=salt, timeout_s=timeout_s
    )


async def _generate(
    session: aiohttp.ClientSession,
    url: str,
    tokens: Sequence[int],
    start: int,
    salt: str | None,
    timeout_s: float,
    *,
    read_cache: bool,
) -> Scores:
    params = {
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,
        "skip_reading_prefix_cache": not read_cache,
        # The unset rows' token ids are whatever the buffer held: vLLM must not decode them
        # (a negative id stops its output handler, and every request of the server with it).
        "detokenize": False,
    }
    body: dict[str, Any] = {"token_ids": list(tokens), "sampling_params": params}
    if salt:
        body["cache_salt"] = salt
    try:
        ans = await fetch_json(
            session,
            "POST",
            url,
            GENERATE,
            json_body=body,
            timeout_s=timeout_s,
            max_bytes=MAX_SCORES_BODY,
        )
    except EndpointError as exc:
        return Scores(error=str(exc))
    value = ans.value if isinstance(ans.value, dict) else {}
    cached = _cached_tokens(value.get("usage"))
    if cached is None:
        return Scores(error=f"{ans.label}: no usage.prompt_tokens_details.cached_tokens")
    # Row i (token i given those before it) was computed when position i - 1 was: i > cached.
    if cached >= start:
        return Scores(
            error=f"{ans.label}: the prefix cache reached the scored positions", cached=cached
        )
    scored = parse_positions(value.get("prompt_logprobs"), tokens, start)
    if scored.error is not None:
        return Scores(error=f"{ans.label}: {scored.error}; got {quote(ans.body)}")
    return Scores(scored.nll, scored.top1, cached=cached)


def _cached_tokens(usage: Any) -> int | None:
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    n = details.get("cached_tokens") if isinstance(details, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


async def serves_cached_scores(session: aiohttp.ClientSession, url: str) -> bool:
    """Whether the target answers ``/inference/v1/generate`` with the cached-token count
    (one token's generation: vLLM served with ``CACHED_SCORING_ARGS``)."""
    probe = await _generate(session, url, [0, 0], 1, None, 30.0, read_cache=False)
    return probe.error is None
