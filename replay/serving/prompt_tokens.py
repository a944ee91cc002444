"""Prompt lengths and prompt-building token ids, from the target's own ``/tokenize``: the
bucket of a request is its prompt length on the target's tokenizer (chat template applied),
and synthetic prompts are made of the target's token ids."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import aiohttp

from replay.core.credentials import redact
from replay.core.errors import EndpointError, TargetError
from replay.core.iterate import closing, pooled
from replay.core.strict import token_ids
from replay.serving.endpoints import fetch_json
from replay.traces.synth import POOL_TEXT, TokenPool
from replay.traces.trace import Request


async def token_pool(session: aiohttp.ClientSession, url: str, model: str) -> TokenPool:
    """Synthetic prompts are made of the target's own token ids: a target that cannot
    tokenize cannot replay them (TargetError naming what /tokenize answered)."""
    why = "synthetic prompts are made of the target's own token ids"
    try:
        ids = await _tokenize(
            session, url, {"model": model, "prompt": POOL_TEXT, "add_special_tokens": False}
        )
        return TokenPool(ids)
    except EndpointError as exc:
        raise TargetError(
            f"{redact(url)} has no usable /tokenize endpoint ({exc}); {why}"
        ) from None
    except ValueError as exc:  # too few distinct ids to build prompts from
        raise TargetError(
            f"{redact(url)} has no usable /tokenize endpoint (POST /tokenize: {exc}); {why}"
        ) from None


async def _tokenize(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[int]:
    """The token ids /tokenize gives for ``body``; EndpointError when it gives none."""
    ans = await fetch_json(session, "POST", url, "/tokenize", json_body=body, timeout_s=60.0)
    v = ans.value
    tokens = token_ids(v.get("tokens")) if isinstance(v, dict) else None
    if tokens is None:
        raise ans.wrong('an object with a "tokens" list of token ids')
    return tokens


UNKNOWN = -1  # a prompt length the target could not count (``counts`` hold no None)


def known_count(n: int) -> int | None:
    return None if n == UNKNOWN else n


async def prompt_token_counts(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    reqs: Iterable[Request],
    n: int,
    concurrency: int = 16,
    problems: list[str] | None = None,
) -> array[int]:
    """Prompt length of each of the ``n`` requests on the target's own tokenizer (chat
    template applied), by position in ``reqs``; where /tokenize cannot count one, the
    trace's ``input_tokens`` or ``UNKNOWN``, and a line in ``problems`` says how many and
    why. Eight bytes a request, whatever the prompts hold."""
    out = array("q", [UNKNOWN]) * n
    failed, first = 0, ""

    async def one(item: tuple[int, Request]) -> None:
        nonlocal failed, first
        i, req = item
        known = req.declared_tokens
        if known is None:
            if req.api == "chat":
                body: dict[str, Any] = {
                    "model": model,
                    "messages": list(req.messages or ()),
                    "add_generation_prompt": True,
                }
                if req.tools:
                    body["tools"] = list(req.tools)
            else:
                body = {"model": model, "prompt": req.prompt}
            try:
                known = len(await _tokenize(session, url, body))
            except EndpointError as exc:
                failed, first = failed + 1, first or str(exc)
                known = req.input_tokens
        out[i] = UNKNOWN if known is None else known

    with closing(iter(reqs)) as items:
        await pooled(enumerate(items), one, concurrency)
    if failed and problems is not None:
        problems.append(
            f"{failed} of {n} prompt(s) not counted on the target's tokenizer "
            f"(bucketed by the trace's input_tokens, else 'unknown'); first: "
            f"{first}"
        )
    return out


async def count_tokens(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    reqs: Sequence[Request],
    concurrency: int = 16,
    problems: list[str] | None = None,
) -> dict[str, int | None]:
    """``prompt_token_counts`` by request id, for callers that hold their requests."""
    counts = await prompt_token_counts(session, url, model, reqs, len(reqs), concurrency, problems)
    return {r.id: known_count(c) for r, c in zip(reqs, counts, strict=True)}
