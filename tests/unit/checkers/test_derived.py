"""Derived grades: the reference's answer as the label of a request without a check.

Each rule with passing, failing and hostile answers, the Grader's bounds around them, and
grade_rows / quality on hand-made results (no server needed; code runs in the sandbox).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from replay.analysis.grading.quality import assess_quality
from replay.analysis.grading.rows import (
    PROMPT_KEEP_CHARS,
    GradingSpec,
    grade_rows,
    grading_spec,
    prompt_text,
)
from replay.checkers import Answer, Grader, derive, derived_record
from replay.checkers.derived.checker import reference_label
from replay.checkers.derived.prompt_facts import facts_of
from replay.checkers.sandbox.limits import SandboxLimits
from replay.core.records import Result, ToolCall
from replay.traces.trace import Request
from tests.conftest import within

DEEP = "[" * 5000


def streamed(*calls: tuple[str, str]) -> Answer:
    return Answer("", tuple(ToolCall(i, f"c{i}", n, a) for i, (n, a) in enumerate(calls)))


def rec(reference: Answer, answer: Answer, prompt: str = "", **kw: Any) -> dict[str, Any]:
    return derived_record(derive(reference, answer, prompt, **kw))


# -- tool calls -------------------------------------------------------------------------------

TIMER = streamed(("set_timer", '{"minutes": 4, "label": "call"}'))


def test_tool_call_with_reordered_keys_passes() -> None:
    r = rec(TIMER, streamed(("set_timer", '{"label": "call", "minutes": 4}')))
    assert (r["rule"], r["passed"]) == ("derived:tool_args", True)


def test_a_string_is_not_a_number_in_tool_arguments() -> None:
    """The documented choice: "4" differs from 4 (a tool given a string where it takes a
    number got something else); 4.0 equals 4 (JSON has one number type)."""
    r = rec(TIMER, streamed(("set_timer", '{"label": "call", "minutes": "4"}')))
    assert r["passed"] is False
    assert "$.minutes" in r["reason"] and "(number)" in r["reason"] and "(string)" in r["reason"]
    assert rec(TIMER, streamed(("set_timer", '{"label": "call", "minutes": 4.0}')))["passed"]
    flag = streamed(("f", '{"on": true}'))
    assert rec(flag, streamed(("f", '{"on": 1}')))["passed"] is False


def test_a_call_written_in_the_text_equals_the_streamed_call() -> None:
    hermes = Answer(
        '<tool_call>\n{"name": "set_timer", "arguments": {"label": "call", '
        '"minutes": 4}}\n</tool_call>'
    )
    r = rec(TIMER, hermes)
    assert r["passed"] is True
    assert r["detail"]["reference_from"] == "streamed tool_calls"
    assert r["detail"]["answer_from"] == "<tool_call> blocks in the text"
    bare = Answer('{"name": "set_timer", "parameters": {"minutes": 4, "label": "call"}}')
    assert rec(TIMER, bare)["passed"] is True
    # And the other way round: the reference wrote it, the answer streamed it.
    assert rec(hermes, TIMER)["rule"] == "derived:tool_args"
    assert rec(hermes, TIMER)["passed"] is True


def test_several_calls_compare_as_a_list_in_order() -> None:
    two = streamed(("a", '{"x": 1}'), ("b", '{"y": [1, 2]}'))
    assert rec(two, streamed(("a", '{"x": 1}'), ("b", '{"y": [1, 2]}')))["passed"] is True
    swapped = rec(two, streamed(("b", '{"y": [1, 2]}'), ("a", '{"x": 1}')))
    assert swapped["passed"] is False and "call 1" in swapped["reason"]
    missing = rec(two, streamed(("a", '{"x": 1}')))
    assert missing["passed"] is False and "2 call(s) expected, 1 made" in missing["reason"]
    order = rec(two, streamed(("a", '{"x": 1}'), ("b", '{"y": [2, 1]}')))
    assert order["passed"] is False and "$.y[0]" in order["reason"]
    none = rec(two, Answer("I would call a and b."))
    assert none["passed"] is False and "0 made" in none["reason"]


def test_deeply_nested_tool_arguments_fail_with_a_reason() -> None:
    r = within(10, lambda: rec(TIMER, streamed(("set_timer", DEEP))))
    assert r["passed"] is False and "nested too deeply" in r["reason"]
    r = within(10, lambda: rec(TIMER, Answer(f"<tool_call>{DEEP}</tool_call>")))
    assert r["passed"] is False and "nested too deeply" in r["reason"]


# -- JSON -------------------------------------------------------------------------------------


def test_json_value_with_reordered_keys_and_a_fence_passes() -> None:
    ref = Answer('{"name": "Ada", "langs": ["en", "fr"], "age": 36}')
    r = rec(ref, Answer('```json\n{"age": 36.0, "langs": ["en", "fr"], "name": "Ada"}\n```'))
    assert (r["rule"], r["passed"]) == ("derived:json", True)


def test_a_different_json_value_fails_at_its_path() -> None:
    ref = Answer('{"name": "Ada", "langs": ["en", "fr"], "age": 36}')
    r = rec(ref, Answer('{"name": "Ada", "langs": ["en", "de"], "age": 36}'))
    assert r["passed"] is False and "$.langs[1]" in r["reason"]
    r = rec(ref, Answer('{"name": "Ada", "langs": ["en", "fr"], "age": "36"}'))
    assert r["passed"] is False and "$.age" in r["reason"]
    r = rec(ref, Answer('{"name": "Ada", "langs": ["en", "fr"]}'))
    assert r["passed"] is False and "'age'" in r["reason"] and "missing" in r["reason"]
    r = rec(ref, Answer("Ada, 36, speaks en and fr"))
    assert r["passed"] is False and "no JSON value" in r["reason"]


def test_five_thousand_brackets_fail_the_json_rule_with_a_reason() -> None:
    r = within(10, lambda: rec(Answer("[1, 2]"), Answer(DEEP)))
    assert r["rule"] == "derived:json" and r["passed"] is False
    assert "nested too deeply" in r["reason"]
    # As the reference's answer it is not JSON either: graded as text, not a crash.
    r = within(10, lambda: rec(Answer(DEEP), Answer("[]"), "a prompt"))
    assert r["rule"] == "derived:facts" and r["passed"] is None


def test_a_bare_number_is_text_not_json() -> None:
    assert reference_label(Answer("42"), "what is 6 x 7? say 42").rule == "derived:facts"


# -- code -------------------------------------------------------------------------------------

SQUARE_PROMPT = "Write a Python function square(x) that returns x squared. Example: square(3) == 9"
SQUARE = Answer("```python\ndef square(x):\n    return x * x\n```")


def test_code_that_behaves_the_same_passes_whatever_its_text() -> None:
    r = rec(
        SQUARE,
        Answer('Sure:\n```python\ndef square(n):\n    """Square."""\n    return n ** 2\n```'),
        SQUARE_PROMPT,
    )
    assert (r["rule"], r["passed"]) == ("derived:code", True), r["reason"]
    assert r["detail"]["calls"][0] == "square(3)"  # the prompt's example comes first
    assert r["detail"]["sources"]["generated"] >= 1
    assert r["detail"]["reference_outcomes"][0] == "returns 9"


def test_code_that_prints_the_right_answer_but_computes_wrongly_fails_on_a_second_call() -> None:
    wrong = Answer("```python\nprint(9)\n\ndef square(x):\n    print(9)\n    return x * 3\n```")
    r = rec(SQUARE, wrong, SQUARE_PROMPT)
    assert (r["rule"], r["passed"]) == ("derived:code", False)
    # square(3) is right (9); the next call shows it: 2 * 3 is not 2 * 2.
    assert "first square(2)" in r["reason"] and "returns 4" in r["reason"]
    assert "returns 6" in r["reason"]


def test_code_that_loops_forever_is_bounded() -> None:
    loops = Answer("```python\ndef square(x):\n    while True:\n        pass\n```")
    start = time.monotonic()
    r = within(60, lambda: rec(SQUARE, loops, SQUARE_PROMPT))
    assert r["passed"] is False and "times out" in r["reason"]
    assert time.monotonic() - start < 20
    # A loop at import time: the sandbox's wall limit ends the whole run.
    at_import = Answer("```python\nwhile True:\n    pass\n\ndef square(x):\n    return x * x\n```")
    r = within(
        60, lambda: rec(SQUARE, at_import, SQUARE_PROMPT, limits=SandboxLimits(wall_s=3.0, cpu_s=2))
    )
    assert r["passed"] is False and ("timed out" in r["reason"] or "killed" in r["reason"])


def test_code_calls_come_from_asserts_and_the_references_own_calls() -> None:
    prompt = "Write clamp(x, lo, hi).\nassert clamp(5, 0, 3) == 3\nassert clamp(-1, 0, 3) == 0"
    ref = Answer(
        "```python\ndef clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n\n"
        "print(clamp(2, 0, 3))\n```"
    )
    ok = rec(
        ref,
        Answer(
            "```python\ndef clamp(x, lo, hi):\n    if x < lo:\n        return lo\n"
            "    return hi if x > hi else x\n```"
        ),
        prompt,
    )
    assert ok["passed"] is True, ok["reason"]
    assert ok["detail"]["calls"][:3] == ["clamp(5, 0, 3)", "clamp(-1, 0, 3)", "clamp(2, 0, 3)"]
    assert ok["detail"]["sources"] == {"prompt": 2, "reference": 1, "generated": 1}
    # Right on the prompt's examples, wrong on the value the reference tried itself.
    bad = rec(
        ref,
        Answer("```python\ndef clamp(x, lo, hi):\n    return hi if x > hi else lo\n```"),
        prompt,
    )
    assert bad["passed"] is False and "clamp(2, 0, 3)" in bad["reason"]


def test_exceptions_are_outcomes_compared_by_type() -> None:
    prompt = "Write inv(x) returning 1 / x. inv(0) must raise ZeroDivisionError; inv(2) == 0.5"
    ref = Answer("```python\ndef inv(x):\n    return 1 / x\n```")
    same = Answer(
        "```python\ndef inv(x):\n    if x == 0:\n        raise ZeroDivisionError\n"
        "    return 1.0 / x\n```"
    )
    assert rec(ref, same, prompt)["passed"] is True
    other = Answer(
        "```python\ndef inv(x):\n    if x == 0:\n        raise ValueError('zero')\n"
        "    return 1 / x\n```"
    )
    r = rec(ref, other, prompt)
    assert r["passed"] is False and "raises ZeroDivisionError" in r["reason"]
    assert "raises ValueError" in r["reason"]


def test_generated_calls_follow_the_annotations() -> None:
    ref = Answer("```python\ndef shout(s: str) -> str:\n    return s.upper() + '!'\n```")
    r = rec(ref, Answer("```python\ndef shout(s: str) -> str:\n    return f'{s.upper()}!'\n```"))
    assert r["passed"] is True, r["reason"]
    assert all(c.startswith("shout('") for c in r["detail"]["calls"])


def test_generated_calls_follow_what_the_body_does_with_an_argument() -> None:
    """Unannotated, no example: integers would make both raise TypeError and agree."""
    ref = Answer("```python\ndef vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())\n```")
    r = rec(ref, Answer("```python\ndef vowels(s):\n    return len(s)\n```"), "Count vowels.")
    assert r["passed"] is False and "vowels('" in r["reason"], r["reason"]


def test_the_same_function_under_another_name_is_the_same_behaviour() -> None:
    r = rec(SQUARE, Answer("```python\ndef sq(v):\n    return v * v\n```"), "Square a number.")
    assert r["passed"] is True, r["reason"]


def test_code_without_behaviour_to_compare_is_graded_by_normalized_text() -> None:
    script = Answer("```python\nx = 2\nprint(x * 21)  # the answer\n```")
    r = rec(script, Answer("```python\nx = 2\nprint( x*21 )\n```"), "Print 42 in Python.")
    assert (r["rule"], r["passed"]) == ("derived:code_text", True)
    assert "no behaviour to compare" in r["reason"]
    r = rec(script, Answer("```python\nprint(42)\n```"), "Print 42 in Python.")
    assert (r["rule"], r["passed"]) == ("derived:code_text", False)
    # The reference's code does not run to its end: no behaviour, so the text decides.
    broken = Answer("```python\nimport no_such_module\n\ndef f(x):\n    return x\n```")
    r = rec(broken, Answer("```python\ndef f(x):\n    return x + 0\n```"), "f(1) == 1")
    assert r["rule"] == "derived:code_text" and r["passed"] is False
    assert "did not run to its end" in r["reason"]


def test_an_answer_without_code_or_with_broken_code_fails() -> None:
    r = rec(SQUARE, Answer("Multiply x by itself."), SQUARE_PROMPT)
    assert (r["rule"], r["passed"]) == ("derived:code", False)
    assert r["reason"] == "no code in the answer"
    r = rec(SQUARE, Answer("```python\ndef square(x) return x\n```"), SQUARE_PROMPT)
    assert r["passed"] is False and "does not parse" in r["reason"]
    deep = Answer("```python\ndef square(x):\n    return " + "(" * 5000 + "\n```")
    r = within(10, lambda: rec(SQUARE, deep, SQUARE_PROMPT))
    assert r["passed"] is False and "does not parse" in r["reason"]


# -- facts ------------------------------------------------------------------------------------

RECORDS = (
    "Records:\n- zuze 4,821 (P30) near Lake Tahoe.\n- nipi 963 (P43) by the harbor.\n"
    'The vault code is "blue falcon". Find the value of zuze.'
)
REF_TEXT = Answer('The value of zuze is 4,821 (P30), by Lake Tahoe; the code is "blue falcon".')


def test_facts_copied_from_the_prompt() -> None:
    facts, capped = facts_of(REF_TEXT.text, RECORDS)
    assert [(f.kind, f.text) for f in facts] == [
        ("number", "4,821"),
        ("identifier", "P30"),
        ("name", "Lake Tahoe"),
        ("quote", "blue falcon"),
    ]
    assert not capped


def test_every_fact_present_passes_and_one_missing_fails() -> None:
    ok = rec(REF_TEXT, Answer("zuze = 4821, record P30 (lake tahoe). Code: blue falcon."), RECORDS)
    assert (ok["rule"], ok["passed"]) == ("derived:facts", True)
    bad = rec(REF_TEXT, Answer("zuze = 4821, record P31 (Lake Tahoe). Code: blue falcon."), RECORDS)
    assert bad["passed"] is False
    assert bad["detail"]["missing"] == ["P30"] and "missing 1 of 4" in bad["reason"]
    # Identifiers are case-sensitive; names and spans are not.
    assert rec(REF_TEXT, Answer("4821 p30 Lake Tahoe blue falcon"), RECORDS)["passed"] is False


def test_a_reference_that_copies_no_fact_gives_no_grade() -> None:
    r = rec(Answer("Hello! How can I help you today?"), Answer("asdf qwer"), RECORDS)
    assert (r["rule"], r["passed"]) == ("derived:facts", None)
    assert r["reason"].startswith("ungraded")
    assert rec(Answer(""), Answer("anything"), RECORDS)["passed"] is None


def test_list_numbers_and_sentence_words_are_not_facts() -> None:
    facts, _ = facts_of("1. The harbor is calm.\n2. Find it.", "Step 1 and 2: The harbor. Find")
    assert facts == []


# -- bounds -----------------------------------------------------------------------------------


def test_the_grader_bounds_derived_grades_like_checks() -> None:
    with Grader() as grader:
        ok = grader.grade_derived(TIMER, streamed(("set_timer", '{"label":"call","minutes":4}')))
        assert derived_record(ok)["passed"] is True
        huge = derived_record(grader.grade_derived(TIMER, Answer("x" * 1_000_001)))
        assert huge["rule"] == "derived" and huge["passed"] is False
        assert huge["detail"]["checker_error"] == "size"
        deep = within(
            30, lambda: derived_record(grader.grade_derived(Answer('{"a": 1}'), Answer(DEEP)))
        )
        assert deep["passed"] is False and "nested too deeply" in deep["reason"]
        code = derived_record(
            grader.grade_derived(
                SQUARE, Answer("```python\ndef square(x):\n    return x * 3\n```"), SQUARE_PROMPT
            )
        )
        assert (code["rule"], code["passed"]) == ("derived:code", False)
        assert len(grader._code_outcomes) == 1  # the reference ran once, and is kept
    with Grader(time_s=0.001) as slow:
        slow.grade_derived(TIMER, TIMER)  # starts the worker (its start has its own limit)
        out = derived_record(slow.grade_derived(REF_TEXT, Answer("x " * 400_000), RECORDS))
        assert out["passed"] is False and out["detail"]["checker_error"] == "timeout"


# -- grading rows and quality -----------------------------------------------------------------


def result(
    target: str,
    rid: str,
    text: str = "",
    calls: tuple[ToolCall, ...] = (),
    status: str = "ok",
    bucket: str = "<256",
) -> Result:
    return Result(
        request_id=rid,
        target=target,
        phase="c1",
        bucket=bucket,
        scheduled=0.0,
        status=status,
        output_text=text,
        tool_calls=list(calls),  # type: ignore[arg-type]
        output_ids=[len(text)],
    )


def call(name: str, args: str) -> tuple[ToolCall, ...]:
    return (ToolCall(0, "c0", name, args),)


def chat(rid: str, content: str, check: dict[str, Any] | None = None) -> Request:
    return Request(id=rid, messages=({"role": "user", "content": content},), check=check)


def test_grade_rows_derives_a_grade_for_each_request_without_a_check() -> None:
    reqs = {
        "checked": grading_spec(chat("checked", "Say yes.", {"type": "exact", "value": "yes"})),
        "tool": grading_spec(chat("tool", "Set a 4 minute timer called call.")),
        "facts": grading_spec(chat("facts", RECORDS)),
        "chat": grading_spec(chat("chat", "Hi!")),
    }
    timer = call("set_timer", '{"minutes": 4, "label": "call"}')
    results = []
    for target in ("bf16", "bf16-control", "fp8"):
        results += [result(target, "checked", "yes"), result(target, "chat", "Hello there.")]
    results += [
        result("bf16", "tool", calls=timer),
        result("bf16", "facts", REF_TEXT.text),
        result("bf16-control", "tool", calls=timer),
        result("bf16-control", "facts", REF_TEXT.text),
        result("fp8", "tool", calls=call("set_timer", '{"label": "call", "minutes": "4"}')),
        result("fp8", "facts", "The value is 4821 (P30), by Lake Tahoe: blue falcon."),
        result("fp8", "gone", status="error"),
    ]
    rows = grade_rows(results, reqs, "bf16")
    by = {(r["target"], r["request_id"]): r for r in rows}
    assert all(r["derived"] is None for r in rows if r["target"] == "bf16")
    assert by["fp8", "checked"]["derived"] is None  # explicit checks win
    assert by["fp8", "checked"]["grade"]["passed"] is True
    assert by["fp8", "gone"]["derived"] is None and by["fp8", "gone"]["answered"] is False
    tool = by["fp8", "tool"]["derived"]
    assert (tool["rule"], tool["passed"], tool["exact"]) == ("derived:tool_args", False, False)
    facts = by["fp8", "facts"]["derived"]
    assert (facts["rule"], facts["passed"], facts["exact"]) == ("derived:facts", True, False)
    control = by["bf16-control", "facts"]["derived"]
    assert (control["passed"], control["exact"]) == (True, True)  # graded like a candidate
    assert by["fp8", "chat"]["derived"]["passed"] is None  # no fact to check

    q = assess_quality(rows, [], "bf16", ["<256"]).to_json()
    fp8 = q["phases"]["c1"]["fp8"]["buckets"]["<256"]
    assert fp8["graded"] == 1 and fp8["passed"] == 1  # the explicit grades
    d = fp8["derived"]
    assert (d["graded"], d["passed"], d["ungraded"], d["checker_errors"]) == (2, 1, 1, 0)
    assert d["by_rule"] == {
        "derived:facts": {"graded": 1, "passed": 1, "ungraded": 1},
        "derived:tool_args": {"graded": 1, "passed": 0, "ungraded": 0},
    }
    assert d["exact_rate"] == pytest.approx(1 / 3)
    vs = d["vs_control"]
    assert (vs["pairs"], vs["control_pass_rate"], vs["pass_rate"]) == (2, 1.0, 0.5)
    assert (vs["control_only"], vs["target_only"], vs["diff"]) == (1, 0, -0.5)
    floor = q["phases"]["c1"]["bf16-control"]["buckets"]["<256"]["derived"]
    assert (floor["graded"], floor["pass_rate"], floor["vs_control"]) == (2, 1.0, None)
    assert q["phases"]["c1"]["fp8"]["all"]["derived"]["graded"] == 2
    assert q["phases"]["c1"]["bf16"]["buckets"]["<256"]["derived"]["graded"] == 0
    assert not any("noise floor" in n for n in q["notes"])

    others = [r for r in rows if r["target"] != "bf16-control"]
    alone = assess_quality(others, [], "bf16", ["<256"]).to_json()
    assert alone["phases"]["c1"]["fp8"]["buckets"]["<256"]["derived"]["vs_control"] is None
    assert any("no A/A control" in n for n in alone["notes"])


def test_grade_rows_reads_the_prompt_of_a_request_record_too() -> None:
    """Locust hands records, tests too: their messages are the prompt."""
    reqs = {"f": chat("f", RECORDS)}
    rows = grade_rows(
        [result("bf16", "f", REF_TEXT.text), result("fp8", "f", "no idea")], reqs, "bf16"
    )
    assert rows[1]["derived"]["passed"] is False
    assert "missing 4 of 4" in rows[1]["derived"]["reason"]


def test_grading_specs_keep_a_capped_prompt_only_where_derived_grades_read_it() -> None:
    checked = grading_spec(chat("a", "x" * 10, {"type": "exact", "value": "y"}))
    assert checked.prompt_z == b"" and checked.prompt_text == ""
    parts = Request(
        id="b",
        messages=(
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Look up P30."}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"type": "function", "function": {"name": "lookup", "arguments": {"id": "P30"}}}
                ],
            },
            {"role": "tool", "content": "P30 is 4821"},
        ),
    )
    assert (
        prompt_text(grading_spec(parts))
        == 'Be brief.\nLook up P30.\nlookup({"id": "P30"})\nP30 is 4821'
    )
    long = grading_spec(chat("c", "head " + "y" * (3 * PROMPT_KEEP_CHARS) + " tail"))
    text = long.prompt_text
    assert len(text) <= PROMPT_KEEP_CHARS + 1
    assert text.startswith("head ") and text.endswith(" tail")
    assert len(long.prompt_z) < 2_000  # compressed in memory
    assert prompt_text(GradingSpec("d", "chat", None)) == ""
    completion = Request(id="e", api="completions", prompt="Once upon a time")
    assert prompt_text(completion) == "Once upon a time"
    assert prompt_text(Request(id="f", api="completions", prompt=(1, 2, 3))) == ""
