"""Agreement, teacher-forced parsing and quality aggregation (no server needed)."""

from __future__ import annotations

from typing import Any

from replay.analysis.grading import rows as rows_module
from replay.analysis.grading.quality import assess_quality
from replay.analysis.grading.rows import GradingSpec, agreement, first_divergence, grade_rows
from replay.checkers import Grader
from replay.core.records import Result
from replay.serving.prompt_scores import parse_positions
from replay.traces.trace import Request


def res(
    target: str, rid: str, text: str, ids: list[int], status: str = "ok", bucket: str = "<256"
) -> Result:
    return Result(
        request_id=rid,
        target=target,
        phase="c1",
        bucket=bucket,
        scheduled=0.0,
        status=status,
        output_text=text,
        output_ids=ids,
    )  # type: ignore[arg-type]


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([], [5]) == 0


def test_agreement_exact_normalized_and_position() -> None:
    a = agreement(
        res("fp8", "x", "The answer is 4,821.", [1, 2, 3]),
        res("bf16", "x", "the answer is 4821", [1, 2, 4]),
    )
    assert a == {"exact": False, "normalized": True, "first_divergence": 2}


def test_prompt_logprobs_are_read_for_the_positions_asked() -> None:
    plp: list[Any] = [
        None,
        {"7": {"logprob": -0.5, "rank": 1}},
        {"8": {"logprob": -2.0, "rank": 3}, "9": {"logprob": -0.1, "rank": 1}},
        {"4": {"logprob": -0.25, "rank": 1}},
    ]
    s = parse_positions(plp, [1, 7, 8, 4], start=2)
    assert (s.nll, s.top1, s.error) == ((2.0, 0.25), (False, True), None)
    assert parse_positions(plp, [1, 7, 5, 4], 2).error == (
        "position 2: the token is missing from logprobs"
    )
    assert parse_positions(plp, [1, 7, 8], 2).error == "prompt_logprobs has the wrong length"


def test_quality_pairs_only_answered_requests_and_flags_identical_tf() -> None:
    reqs = {
        f"r{i}": Request(
            id=f"r{i}",
            messages=({"role": "user", "content": "q"},),
            check={"type": "exact", "value": "yes"},
        )
        for i in range(4)
    }
    results = [res("bf16", f"r{i}", "yes", [1]) for i in range(4)]
    results += [
        res("fp8", "r0", "yes", [1]),
        res("fp8", "r1", "no", [2]),
        res("fp8", "r2", "yes", [1]),
        res("fp8", "r3", "", [], status="error"),
    ]
    rows = grade_rows(results, reqs, "bf16")
    tf = [
        {"target": t, "request_id": f"r{i}", "n": 1, "nll": [0.5], "top1": [True], "error": None}
        for t in ("bf16", "fp8")
        for i in range(3)
    ]
    q = assess_quality(rows, tf, "bf16", ["<256"]).to_json()
    fp8 = q["phases"]["c1"]["fp8"]["buckets"]["<256"]
    assert (fp8["requests"], fp8["answered"], fp8["graded"], fp8["passed"]) == (4, 3, 3, 2)
    assert fp8["vs_reference"]["pairs"] == 3  # the failed request is not a quality result
    assert fp8["vs_reference"]["diff"] == -1 / 3
    assert fp8["agreement"]["exact"] == 2 / 3
    assert fp8["teacher_forced"]["identical_to_reference"] is True
    assert any("does not exercise" in n for n in q["notes"])


def test_grade_rows_turns_a_bad_spec_into_a_failed_grade() -> None:
    """A check that cannot be built (as when a run directory is re-graded by a newer version
    with stricter specs) fails its answers with the reason; the other answers are graded."""
    reqs: dict[str, Any] = {
        "bad": GradingSpec(
            "bad", "json", {"type": "json_schema", "schema": {"$ref": "http://127.0.0.1:9/s"}}
        ),
        "good": GradingSpec("good", "chat", {"type": "exact", "value": "yes"}),
    }
    rows = grade_rows(
        [res("bf16", "bad", "{}", [1]), res("bf16", "good", "yes", [1])], reqs, "bf16"
    )
    bad, good = (r["grade"] for r in rows)
    assert bad["passed"] is False and bad["reason"].startswith("checker error: SpecError")
    assert bad["detail"] == {"checker_error": "exception"}
    assert good["passed"] is True


def test_batches_graded_side_by_side_come_back_in_order(monkeypatch: Any) -> None:
    """Batches graded on a thread of their own while the next is built, by one grader or by
    two taking alternate batches, come back in the results' order, as before."""
    monkeypatch.setattr(rows_module, "GRADE_BATCH", 3)
    monkeypatch.setattr(rows_module, "GRADE_WORKERS", 2)
    reqs: dict[str, Any] = {
        f"r{i}": GradingSpec(f"r{i}", "chat", {"type": "exact", "value": f"v{i % 4}"})
        for i in range(20)
    }
    results = [res(t, f"r{i}", f"v{i % 3}", [i]) for t in ("bf16", "fp8") for i in range(20)]
    with Grader() as one:
        alone = grade_rows(results, reqs, "bf16", one)
    side_by_side = grade_rows(results, reqs, "bf16")
    assert side_by_side == alone
    assert [(r["target"], r["request_id"]) for r in side_by_side] == [
        (r.target, r.request_id) for r in results
    ]
    assert [r["grade"]["passed"] for r in alone[:20]] == [i % 3 == i % 4 for i in range(20)]
