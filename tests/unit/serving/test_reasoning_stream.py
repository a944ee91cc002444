"""Reasoning streams, against a server that streams as a reasoning model behind a reasoning
parser does (``fault_server``'s reasoning modes): the chain of thought first, in
``delta.reasoning`` (vLLM 0.32) or ``delta.reasoning_content`` (older), then the answer in
``delta.content``. Real vLLM with a reasoning parser is tests/integration/test_reasoning_vllm.py.

What a user expects: TTFT is the first token of either kind (GuideLLM's count), the time to
the first answer token is its own figure, ITL and tokens/s cover every token, reasoning is
kept apart from the answer (grading reads the answer only), and a chain of thought cut by
max_tokens before any answer is an answer of no text, not a protocol error.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
from typing import Any

import pytest

from replay.analysis.summary import summarize
from replay.core.records import Result
from replay.serving.client import Client
from replay.traces.trace import Request
from tests.support.fault_server import fault_server

REQ = Request(id="r", messages=({"role": "user", "content": "why?"},), max_tokens=64)
GAP_S = 0.01


def send(url: str) -> Result:
    async def go() -> Result:
        client = Client(url, "m", timeout_s=30.0)  # clock: perf_counter, as the server's
        try:
            return await client.send(REQ, Result("r", "t", "p", "b", 0.0))
        finally:
            await client.close()

    return asyncio.run(go())


def stream(mode: str, **options: Any) -> tuple[Result, list[float]]:
    with fault_server(mode, gap_s=GAP_S, **options) as server:
        result = send(server.url)
        return result, list(server.stamps)


@pytest.mark.parametrize(
    ("usage", "field", "details"),
    [
        ("every", "reasoning", True),
        ("every", "reasoning_content", True),
        ("every", "reasoning", False),
        ("end", "reasoning", True),
        ("end", "reasoning_content", False),
        ("none", "reasoning", False),
    ],
)
def test_reasoning_is_kept_apart_and_every_token_is_timed(
    usage: str, field: str, details: bool
) -> None:
    thinking, answer = 10, 20
    result, stamps = stream(
        f"reasoning_{usage}", thinking=thinking, chunks=answer, field=field, details=details
    )
    assert result.status == "ok", result.error
    assert result.reasoning_text == "".join(f"t{i} " for i in range(1, thinking + 1))
    assert result.output_text == "".join(
        "ab"[i % 2] for i in range(thinking + 1, thinking + answer + 1)
    )
    # TTFT is the first reasoning token; the first answer token comes `thinking` gaps later.
    assert result.first_token is not None and result.first_answer_token is not None
    assert abs(result.first_token - stamps[0]) < 0.005 + GAP_S / 2
    assert abs(result.first_answer_token - stamps[thinking]) < 0.005 + GAP_S / 2
    # The server's own count where it gives one, else the reasoning arrivals' tokens.
    assert result.reasoning_tokens == thinking
    assert result.reasoning_tokens_estimated == (not details or usage == "none")
    # output_tokens and ITL cover both kinds.
    assert result.output_tokens == thinking + answer + (0 if usage == "none" else 1)
    assert sum(result.chunk_tokens) == thinking + answer
    server_gap_ms = 1000 * statistics.fmean(b - a for a, b in itertools.pairwise(stamps))
    stats = summarize([result])
    assert stats.itl_ms.mean == pytest.approx(server_gap_ms, rel=0.2)
    # tokens/s counts both: not the answer's tokens over the answer's time (the old 4x).
    assert stats.decode_tok_s_median == pytest.approx(1000 / server_gap_ms, rel=0.25)
    assert stats.reasoning is not None and stats.reasoning.tokens == thinking
    ttfa = stats.reasoning.time_to_answer_ms.p50
    assert ttfa is not None and stats.ttft_ms.p50 is not None
    assert ttfa - stats.ttft_ms.p50 == pytest.approx(1000 * (stamps[thinking] - stamps[0]), abs=8)


@pytest.mark.parametrize("usage", ["every", "end", "none"])
def test_a_chain_of_thought_cut_by_max_tokens_is_an_ok_answer_without_text(usage: str) -> None:
    """max_tokens reached while still reasoning: the model answered nothing; an ok result
    with no answer (graded as such), with or without usage from the server."""
    result, _ = stream(f"reasoning_{usage}", thinking=12, thinking_only=True)
    assert (result.status, result.error) == ("ok", None)
    assert result.output_text == "" and result.finish_reason == "length"
    assert result.reasoning_tokens == 12 and result.first_answer_token is None
    assert result.time_to_answer is None and result.ttft is not None
    reasoning = summarize([result]).reasoning
    assert reasoning is not None and reasoning.no_answer == 1
    assert reasoning.time_to_answer_ms.p50 is None  # no answer: no time to it, never 0


def test_an_answer_that_did_not_reason_has_no_reasoning_figures() -> None:
    result, _ = stream("usage_every", chunks=5)
    assert result.first_answer_token == result.first_token
    assert result.reasoning_tokens == 0 and result.reasoning_text == ""
    assert summarize([result]).reasoning is None
