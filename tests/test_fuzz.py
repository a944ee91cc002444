"""Bad input everywhere: arbitrary bytes into every parser. Never an unhandled exception;
always an error that names the input and the place."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay._errors import InputError, TraceError
from replay._importers import load
from replay._targets import load_targets_config
from replay.checkers import SpecError, parse_check

FAST = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids,
                                                            max_size=4),
    max_leaves=20)
FIELDS = st.fixed_dictionaries({}, optional={
    "id": JSONISH, "t": JSONISH, "api": st.sampled_from(["chat", "completions", "x"]) | JSONISH,
    "messages": JSONISH, "prompt": JSONISH, "synth": JSONISH, "max_tokens": JSONISH,
    "check": JSONISH, "tools": JSONISH, "params": JSONISH, "task": JSONISH})


def _names_place(err: TraceError, path: Path) -> None:
    assert err.path == str(path) and err.line >= 0 and err.field and err.reason


@FAST
@given(st.lists(st.binary(max_size=200) | FIELDS.map(lambda d: json.dumps(d).encode()),
                min_size=1, max_size=6))
def test_trace_lines(tmp_path_factory, lines: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("f") / "t.jsonl"
    path.write_bytes(b"\n".join(x.replace(b"\n", b" ") for x in lines) + b"\n")
    try:
        loaded = load(path, "v1", on_bad_line="skip")
    except TraceError as err:  # only an empty file may fail in skip mode
        assert "empty" in err.reason
        return
    for err in loaded.bad:
        _names_place(err, path)


@FAST
@given(st.binary(max_size=400), st.sampled_from(["mooncake", "azure"]))
def test_importers(tmp_path_factory, data: bytes, fmt: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("f") / ("t.csv" if fmt == "azure" else "t.jsonl")
    header = b"TIMESTAMP,ContextTokens,GeneratedTokens\n" if fmt == "azure" else b""
    path.write_bytes(header + data)
    try:
        loaded = load(path, fmt, on_bad_line="skip")
    except TraceError as err:
        _names_place(err, path)
        return
    for err in loaded.bad:
        _names_place(err, path)


@FAST
@given(JSONISH)
def test_checker_specs(spec: object) -> None:
    try:
        parse_check(spec)
    except SpecError as err:
        assert err.field and err.reason


@FAST
@given(st.text(max_size=300))
def test_targets_config(tmp_path_factory, text: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("f") / "t.toml"
    path.write_text(text, encoding="utf-8")
    try:
        load_targets_config(path)
    except InputError as err:
        assert str(path) in str(err)


def test_huge_line_and_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = json.dumps({"id": "ok", "messages": [{"role": "user", "content": "hi"}]})
    huge = json.dumps({"id": "big", "messages": [{"role": "user", "content": "x" * 5_000_000}]})
    path.write_bytes(good.encode() + b"\n" + huge.encode() + b"\n\xff\xfe\x00{\n")
    loaded = load(path, "v1", on_bad_line="skip")
    assert [r.id for r in loaded.requests] == ["ok", "big"]
    assert [e.line for e in loaded.bad] == [3]
