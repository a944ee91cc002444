"""A request whose prompt does not fit the target's context is not sent: it is a result of its
own (``skipped``, ``too_long``, with the reason), counted apart in the summary, and never one
of the target's errors (the real server's refusal is in
tests/integration/test_real_model_vllm.py)."""

from __future__ import annotations

import pytest

from replay.analysis.schemas import Summary
from replay.analysis.summary import summarize
from replay.cli.replay_run import target_errors
from replay.core.records import Result
from replay.run.phase import does_not_fit


@pytest.mark.parametrize(
    ("prompt", "limit", "fits"),
    [(8191, 8192, True), (8192, 8192, False), (8241, 8192, False), (None, 8192, True)],
)
def test_a_prompt_that_fills_the_context_does_not_fit(
    prompt: int | None, limit: int, fits: bool
) -> None:
    why = does_not_fit(prompt, limit)
    assert (why is None) == fits
    if not fits:
        assert f"prompt of {prompt:,} tokens does not fit" in str(why)
        assert "max_model_len of 8,192" in str(why)
    assert does_not_fit(prompt, None) is None  # an unknown context never stops a send


def _result(rid: str, status: str, kind: str | None = None) -> Result:
    r = Result(request_id=rid, target="bf16", phase="c1", bucket=">=4K", scheduled=0.0)
    r.status, r.error_kind = status, kind  # type: ignore[assignment]
    if status == "ok":
        r.sent, r.first_token, r.done, r.output_tokens = 0.0, 0.1, 0.2, 3
    return r


def test_skipped_requests_are_counted_apart_and_not_as_errors() -> None:
    results = [_result("a", "ok"), _result("b", "skipped", "too_long")]
    stats = summarize(results)
    assert (stats.requests, stats.ok, stats.errors, stats.skipped_too_long) == (2, 1, 0, 1)
    assert stats.errors_by_kind == {}
    assert summarize([_result("a", "ok")]).skipped_too_long is None  # absent when none


def test_a_target_whose_only_failures_are_too_long_is_not_failing() -> None:
    target = {
        "status": "ok",
        "phases": {
            "c1": {
                "all": {"requests": 3, "ok": 1, "errors": 0, "skipped_too_long": 2},
                "buckets": {},
                "server": {},
            }
        },
    }
    assert target_errors(Summary.from_json({"targets": {"bf16": target}}), 0.05) == []
