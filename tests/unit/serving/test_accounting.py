"""Token accounting and tool-call assembly from streamed chunks (no server needed)."""

from __future__ import annotations

from replay.core.records import Result
from replay.serving.accumulator import StreamAccumulator


class Ticks:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.010
        return self.t


def fold(events: list[dict]) -> Result:  # type: ignore[type-arg]
    r = Result(request_id="r", target="t", phase="p", bucket="b", scheduled=0.0, sent=0.0)
    acc = StreamAccumulator(r, Ticks())
    for ev in events:
        acc.add(ev)
    acc.finish()
    return r


def chunk(text: str, completion_tokens: int | None) -> dict:  # type: ignore[type-arg]
    ev: dict = {"choices": [{"index": 0, "delta": {"content": text}}]}  # type: ignore[type-arg]
    if completion_tokens is not None:
        ev["usage"] = {"prompt_tokens": 9, "completion_tokens": completion_tokens}
    return ev


def test_multi_token_chunks_count_tokens_not_chunks() -> None:
    role = {
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 0},
    }
    r = fold(
        [
            role,
            chunk("a", 1),
            chunk("bcd", 4),
            chunk("ef", 6),
            {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 6}},
        ]
    )
    assert r.output_tokens == 6
    assert r.chunk_tokens == [1, 3, 2]
    assert r.output_text == "abcdef"
    assert r.prompt_tokens == 9
    assert not r.tokens_estimated
    # The role chunk carries no token: TTFT is the first content chunk.
    assert r.first_token == r.chunk_times[0]
    itl = r.itl()
    assert len(itl) == 5  # 6 tokens, the first has no gap
    gap1 = (r.chunk_times[1] - r.chunk_times[0]) / 3
    assert itl[:3] == [gap1] * 3


def test_without_usage_tokens_are_estimated_from_chunks() -> None:
    r = fold([chunk("a", None), chunk("b", None)])
    assert r.output_tokens == 2
    assert r.tokens_estimated


def tool_delta(index: int, **fn: str) -> dict:  # type: ignore[type-arg]
    frag: dict = {"index": index, "function": fn}  # type: ignore[type-arg]
    if "name" in fn:
        frag["id"] = f"call_{index}"
    return {"choices": [{"index": 0, "delta": {"tool_calls": [frag]}}]}


def test_tool_calls_are_joined_by_index() -> None:
    r = fold(
        [
            tool_delta(0, name="get_weather"),
            tool_delta(1, name="search"),
            tool_delta(0, arguments='{"city": '),
            tool_delta(1, arguments='{"q": "x"}'),
            tool_delta(0, arguments='"Oslo"}'),
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        ]
    )
    assert [(c.index, c.id, c.name, c.arguments) for c in r.tool_calls] == [
        (0, "call_0", "get_weather", '{"city": "Oslo"}'),
        (1, "call_1", "search", '{"q": "x"}'),
    ]
    assert r.finish_reason == "tool_calls"
    assert r.first_token is not None  # a tool-call delta is a first token too


def test_error_event_is_a_result() -> None:
    r = fold([chunk("a", 1), {"error": {"message": "engine died"}}])
    assert r.status == "error" and r.error_kind == "server_error"
    assert "engine died" in (r.error or "")
