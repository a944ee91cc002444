"""Checkers: passing, failing and hostile answers; bad specs rejected at trace load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replay.checkers import Answer, SpecError, parse_check
from replay.core.errors import TraceError
from replay.core.records import ToolCall
from replay.traces.importers import load


def grade(spec: dict[str, Any], text: str, calls: tuple[ToolCall, ...] = ()) -> Any:
    return parse_check(spec).grade(Answer(text, calls))


@pytest.mark.parametrize(
    ("spec", "text", "passed"),
    [
        ({"type": "exact", "value": "Paris"}, "  paris. ", True),
        ({"type": "exact", "value": "Paris", "normalize": False}, "paris", False),
        ({"type": "exact", "value": 4821}, "4,821", True),
        ({"type": "contains", "values": ["oslo", "rain"]}, "Oslo: RAIN today", True),
        ({"type": "contains", "values": ["oslo", "sun"]}, "Oslo: rain", False),
        ({"type": "contains", "values": ["x", "rain"], "all": False}, "rain", True),
        ({"type": "regex", "pattern": r"^\d{4}$", "fullmatch": True}, " 1234 ", True),
        ({"type": "regex", "pattern": "abc", "flags": "i"}, "xABCx", True),
        ({"type": "regex", "pattern": "abc"}, "ab c", False),
        ({"type": "number", "value": 3.14, "tolerance": 0.01}, "pi is about 3.141", True),
        ({"type": "number", "value": 1000}, "It costs 1,000 dollars", True),
        ({"type": "number", "value": 7}, "first 7 then 8", False),
        ({"type": "number", "value": 7, "which": "any"}, "first 7 then 8", True),
        ({"type": "number", "value": 7}, "seven", False),
        (
            {"type": "retrieval", "passage_ids": ["P3"], "fact": "4821"},
            "Per [P3], it is 4,821.",
            True,
        ),
        (
            {"type": "retrieval", "passage_ids": ["P3"], "fact": "4821"},
            "Per [P13], it is 4821.",
            False,
        ),
        ({"type": "retrieval", "fact": "blue whale"}, "The BLUE   whale!", True),
        ({"type": "retrieval", "passage_ids": ["P3", "P7"]}, "P3 and P7", True),
        (
            {
                "type": "json_schema",
                "schema": {
                    "type": "object",
                    "required": ["a"],
                    "properties": {"a": {"type": "integer"}},
                },
            },
            'Sure:\n```json\n{"a": 3}\n```',
            True,
        ),
        (
            {"type": "json_schema", "schema": {"type": "object", "required": ["a"]}},
            '{"b": 1}',
            False,
        ),
        ({"type": "json_schema", "schema": {"type": "object"}}, "no json here", False),
    ],
)
def test_text_checkers(spec: dict[str, Any], text: str, passed: bool) -> None:
    g = grade(spec, text)
    assert g.passed is passed, g.reason
    assert g.reason


def test_retrieval_reason_says_what_is_missing() -> None:
    g = grade({"type": "retrieval", "passage_ids": ["P3"], "fact": "4821"}, "P9 says 12")
    assert "P3" in g.reason and "4821" in g.reason and g.score == 0.0


WEATHER = {
    "type": "tool_call",
    "calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}],
}


def call(name: str, args: str, index: int = 0) -> ToolCall:
    return ToolCall(index=index, id=f"c{index}", name=name, arguments=args)


@pytest.mark.parametrize(
    ("spec", "text", "calls", "passed", "why"),
    [
        (WEATHER, "", (call("get_weather", '{"city": "Oslo", "days": 3}'),), True, "match"),
        (WEATHER, "", (call("get_weather", '{"days": 3, "city": "Oslo"}'),), True, "match"),
        (WEATHER, "", (call("get_weather", '{"city": "Oslo", "days": "3"}'),), False, "arguments"),
        (
            {**WEATHER, "coerce_types": True},
            "",
            (call("get_weather", '{"city": "Oslo", "days": "3"}'),),
            True,
            "match",
        ),
        (WEATHER, "", (call("get_weather", '{"city": "Oslo"}'),), False, "arguments"),
        (
            {**WEATHER, "match": "subset"},
            "",
            (call("get_weather", '{"city": "Oslo", "days": 3, "unit": "C"}'),),
            True,
            "match",
        ),
        (WEATHER, "", (call("get_time", '{"city": "Oslo"}'),), False, "missing call get_weather"),
        (
            WEATHER,
            "",
            (call("get_weather", '{"city": "Oslo", "days": 3}'), call("get_time", "{}", 1)),
            False,
            "extra call",
        ),
        (WEATHER, "I cannot call tools.", (), False, "no tool call"),
        (
            WEATHER,
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}'
            "</tool_call>",
            (),
            True,
            "JSON in the text",
        ),
        (
            WEATHER,
            '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", \\"days\\": 3}"}',
            (),
            True,
            "match",
        ),
        (WEATHER, "", (call("get_weather", '{"city": "Oslo", "days": 3'),), False, "arguments"),
    ],
)
def test_tool_call_checker(
    spec: dict[str, Any], text: str, calls: tuple[ToolCall, ...], passed: bool, why: str
) -> None:
    g = grade(spec, text, calls)
    assert g.passed is passed, g.reason
    assert why in g.reason


def test_bool_is_not_an_integer() -> None:
    spec = {"type": "tool_call", "calls": [{"name": "f", "arguments": {"on": True, "n": 1}}]}
    assert grade(spec, "", (call("f", '{"on": true, "n": 1}'),)).passed
    assert not grade(spec, "", (call("f", '{"on": 1, "n": true}'),)).passed


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"type": "poem"}, "type"),
        ({"type": "exact"}, "value"),
        ({"type": "regex", "pattern": "("}, "pattern"),
        ({"type": "regex", "pattern": "a", "flags": "q"}, "flags"),
        ({"type": "number", "value": "three"}, "value"),
        ({"type": "number", "value": True}, "value"),
        ({"type": "contains", "values": []}, "values"),
        ({"type": "retrieval"}, "fact"),
        ({"type": "tool_call", "calls": [{"arguments": {}}]}, "calls.0.name"),
        ({"type": "tool_call", "calls": [{"name": "f"}], "match": "fuzzy"}, "match"),
        ({"type": "json_schema", "schema": {"type": "nonsense"}}, "schema"),
        ({"type": "json_schema", "schema": {"$ref": "https://example.com/s.json"}}, "schema.$ref"),
        ({"type": "json_schema", "schema": {"items": [{"$ref": "s.json"}]}}, "schema.items.0.$ref"),
        ({"type": "code", "tests": "assert f(1) ==="}, "tests"),
        ({"type": "code", "tests": "pass", "language": "rust"}, "language"),
        ({"type": "exact", "value": "x", "colour": 1}, "colour"),
    ],
)
def test_bad_specs_name_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_check(spec)
    assert info.value.field == field


def test_bad_spec_fails_the_trace_load_with_line_and_field(tmp_path: Path) -> None:
    good = {
        "id": "a",
        "messages": [{"role": "user", "content": "x"}],
        "check": {"type": "exact", "value": "y"},
    }
    bad = {**good, "id": "b", "check": {"type": "regex", "pattern": "(("}}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(TraceError) as info:
        load(path)
    assert (info.value.line, info.value.field) == (2, "check.pattern")
    assert "regular expression" in info.value.reason


HOSTILE = st.one_of(
    st.text(max_size=400),
    st.sampled_from(
        [
            "```\n",
            "```python\n```",
            "<tool_call>",
            "<tool_call>{</tool_call>",
            "{" * 500,
            "[" * 300 + "]" * 300,
            "\x00\udcff",
            "1e999",
            "-0.0",
            "NaN",
            "1,2,3,4,5,6,7,8",
            "{}[]{}",
        ]
    ),
)


@given(HOSTILE)
def test_hostile_answers_never_raise(text: str) -> None:
    for spec in (
        {"type": "exact", "value": "x"},
        {"type": "number", "value": 1},
        {"type": "retrieval", "passage_ids": ["P1"], "fact": "1"},
        {"type": "json_schema", "schema": {"type": "object"}},
        WEATHER,
        {"type": "regex", "pattern": "a+"},
        {"type": "contains", "values": ["a"]},
    ):
        g = grade(spec, text)
        assert isinstance(g.passed, bool) and g.reason
