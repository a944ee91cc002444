"""Trace format v1 validation: every bad line names file, line, field and reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.core.errors import InputError, TraceError
from replay.traces.importers import load, scan

ROOT = Path(__file__).resolve().parents[3]


def write(tmp_path: Path, lines: list[object]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


GOOD = {"id": "a", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("line", "field", "reason"),
    [
        ("{not json", "(line)", "not valid JSON"),
        ("[1, 2]", "(line)", "must be a JSON object"),
        ({"messages": [{"role": "user", "content": "x"}]}, "id", "required"),
        ({"id": "b", "api": "chat"}, "messages", "non-empty"),
        ({"id": "b", "api": "completions"}, "prompt", "exactly one"),
        ({"id": "b", "messages": [{"content": "x"}]}, "messages.0.role", "role"),
        (
            {"id": "b", "prompt": "x", "api": "completions", "max_tokens": 0},
            "max_tokens",
            "greater than 0",
        ),
        ({"id": "b", "t": -1, **{k: v for k, v in GOOD.items() if k != "id"}}, "t", "greater"),
        ({"id": "b", "task": "poetry", "messages": GOOD["messages"]}, "task", "retrieval"),
        ({"id": "b", "colour": "red", "messages": GOOD["messages"]}, "colour", "unknown field"),
        ({"id": "b", "api": "completions", "prompt": []}, "prompt", "empty"),
        (
            {"id": "b", "messages": GOOD["messages"], "params": {"n": 2}},
            "params.n",
            "one answer a request",
        ),
        (
            {"id": "b", "messages": GOOD["messages"], "params": {"n": True}},
            "params.n",
            "one answer a request",
        ),
    ],
)
def test_bad_line_names_line_field_and_reason(
    tmp_path: Path, line: object, field: str, reason: str
) -> None:
    path = write(tmp_path, [GOOD, line])
    with pytest.raises(TraceError) as info:
        load(path)
    err = info.value
    assert (err.path, err.line, err.field) == (str(path), 2, field)
    assert reason.lower() in err.reason.lower()
    assert f"{path}:2: field '{field}'" in str(err)


def test_nan_timestamp_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "a", "t": NaN, "messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(TraceError) as info:
        load(path)
    assert info.value.line == 1


def test_duplicate_ids_name_the_first_line(tmp_path: Path) -> None:
    path = write(tmp_path, [GOOD, {**GOOD, "id": "z"}, GOOD])
    with pytest.raises(TraceError, match="duplicate id 'a' \\(first on line 1\\)"):
        load(path)


def test_skip_counts_and_keeps_every_bad_line(tmp_path: Path) -> None:
    path = write(tmp_path, [GOOD, "oops", {"id": "c"}, {**GOOD, "id": "d"}, "", GOOD])
    loaded = load(path, on_bad_line="skip")
    assert [r.id for r in loaded.requests] == ["a", "d"]
    assert [(e.line, e.field) for e in loaded.bad] == [(2, "(line)"), (3, "messages"), (6, "id")]
    assert loaded.lines == 5  # blank lines are not records


def test_empty_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(TraceError, match="empty"):
        load(path)


def test_invalid_utf8_is_a_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b'\n{"id": "\xff\xfe"}\n')
    loaded = load(path, on_bad_line="skip")
    assert len(loaded.requests) == 1 and loaded.bad[0].line == 2


def test_byte_order_mark_is_not_part_of_the_first_line(tmp_path: Path) -> None:
    """What Windows editors write at the start of a UTF-8 file; line 1 is still line 1."""
    path = tmp_path / "t.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf"
        + json.dumps(GOOD).encode()
        + b"\n"
        + json.dumps({**GOOD, "id": "b"}).encode()
        + b"\n"
    )
    assert [r.id for r in load(path).requests] == ["a", "b"]
    assert [r.id for r in scan(path).iter_requests()] == ["a", "b"]


def test_bom_later_in_the_file_is_still_a_bad_line(tmp_path: Path) -> None:
    path = write(tmp_path, [GOOD, "\ufeff" + json.dumps({**GOOD, "id": "b"})])
    with pytest.raises(TraceError) as info:
        load(path)
    assert info.value.line == 2


def test_a_directory_or_a_missing_path_is_named_as_such(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="is a directory; give the trace file in it"):
        load(tmp_path)
    with pytest.raises(InputError, match="no such trace file"):
        load(tmp_path / "missing.jsonl")


def test_shipped_sample_is_valid_and_varied() -> None:
    loaded = load(ROOT / "traces" / "sample.jsonl")
    reqs = loaded.requests
    assert not loaded.bad
    assert {r.api for r in reqs} == {"chat", "completions"}
    assert any(r.tools for r in reqs)
    assert any(isinstance(r.prompt, str) for r in reqs) and any(r.synth for r in reqs)
