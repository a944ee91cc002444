"""Bad input everywhere: arbitrary bytes into every parser. Never an unhandled exception;
always an error that names the input and the place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from replay.checkers import SpecError, parse_check
from replay.core.errors import InputError, TraceError
from replay.serving.targets import load_targets_config
from replay.traces.importers import load

FAST = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4)
    ),
    max_leaves=20,
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "id": JSONISH,
        "t": JSONISH,
        "api": st.sampled_from(["chat", "completions", "x"]) | JSONISH,
        "messages": JSONISH,
        "prompt": JSONISH,
        "synth": JSONISH,
        "max_tokens": JSONISH,
        "check": JSONISH,
        "tools": JSONISH,
        "params": JSONISH,
        "task": JSONISH,
    },
)


def _names_place(err: TraceError, path: Path) -> None:
    assert err.path == str(path) and err.line >= 0 and err.field and err.reason


@FAST
@given(
    st.lists(
        st.binary(max_size=200) | FIELDS.map(lambda d: json.dumps(d).encode()),
        min_size=1,
        max_size=6,
    )
)
def test_trace_lines(tmp_path_factory, lines: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("f") / "t.jsonl"
    path.write_bytes(b"\n".join(x.replace(b"\n", b" ") for x in lines) + b"\n")
    try:
        loaded = load(path, "v1", on_bad_line="skip")
    except TraceError as err:  # only the whole file may fail in skip mode: empty, or not UTF-8
        assert "empty" in err.reason or err.field == "encoding", err
        return
    for err in loaded.bad:
        _names_place(err, path)


# Every importer but v1 (fuzzed above), with the header a CSV one needs to get to its rows.
IMPORTER_HEADERS = {
    "mooncake": b"",
    "azure": b"TIMESTAMP,ContextTokens,GeneratedTokens\n",
    "bailian": b"",
    "burstgpt": b"Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n",
    "openai-log": b"",
    "csv:t=a,in=b,out=c,session=d,t_unit=ms": b"a,b,c,d\n",
    "jsonl:t=a,in=b,out=c,id=d,t_unit=iso": b"",
}


@FAST
@given(st.binary(max_size=400), st.sampled_from(list(IMPORTER_HEADERS)))
def test_importers(tmp_path_factory, data: bytes, fmt: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("f") / "t"
    path.write_bytes(IMPORTER_HEADERS[fmt] + data)
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


SPEC_KEYS = (
    "all",
    "calls",
    "case_sensitive",
    "coerce_types",
    "fact",
    "flags",
    "fullmatch",
    "language",
    "match",
    "memory_mb",
    "normalize",
    "passage_ids",
    "pattern",
    "rel_tolerance",
    "schema",
    "tests",
    "timeout_s",
    "tolerance",
    "value",
    "values",
    "which",
)


@FAST
@given(
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(
                [
                    "code",
                    "contains",
                    "exact",
                    "json_schema",
                    "number",
                    "regex",
                    "retrieval",
                    "tool_call",
                ]
            )
            | JSONISH
        },
        optional=dict.fromkeys(SPEC_KEYS, JSONISH),
    )
)
def test_checker_specs_with_real_keys(spec: dict[str, object]) -> None:
    """Every checker's own keys with values of any type (and a 'type' of any type: atheris
    found that a list there was a TypeError, which pydantic does not turn into a bad line)."""
    try:
        parse_check(spec)
    except SpecError as err:
        assert err.field and err.reason


@pytest.mark.parametrize("kind", [["retrieval"], {"a": 1}, None, 3])
def test_unhashable_or_odd_checker_type_is_a_bad_line(tmp_path: Path, kind: object) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps(
            {"id": "a", "messages": [{"role": "user", "content": "x"}], "check": {"type": kind}}
        )
        + "\n"
    )
    with pytest.raises(TraceError) as info:
        load(path, "v1")
    assert (info.value.line, info.value.field) == (1, "check.type")


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


# -- the gaps: SSE event shapes, structured TOML, timestamps, empty files, repeated ids ------

LEAF = st.none() | st.booleans() | st.integers(-3, 50) | st.floats() | st.text(max_size=8)
ANY = st.recursive(
    LEAF,
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=6,
)
# Events shaped like an OpenAI/vLLM stream chunk, with any field of any type: deep enough that
# the accumulator's every branch meets a wrong type, not just a wrong top level.
FRAGMENT = st.fixed_dictionaries(
    {},
    optional={
        "index": ANY,
        "id": ANY,
        "function": st.fixed_dictionaries({}, optional={"name": ANY, "arguments": ANY}) | ANY,
    },
)
CHOICE = st.fixed_dictionaries(
    {},
    optional={
        "delta": st.fixed_dictionaries(
            {}, optional={"content": ANY, "tool_calls": st.lists(FRAGMENT | ANY, max_size=2) | ANY}
        )
        | ANY,
        "text": ANY,
        "token_ids": ANY,
        "prompt_token_ids": ANY,
        "finish_reason": ANY,
    },
)
EVENT = (
    st.fixed_dictionaries(
        {},
        optional={
            "choices": st.lists(CHOICE | ANY, max_size=2) | ANY,
            "usage": st.fixed_dictionaries(
                {}, optional={"prompt_tokens": ANY, "completion_tokens": ANY}
            )
            | ANY,
            "prompt_token_ids": ANY,
            "error": ANY,
        },
    )
    | ANY
)


@FAST
@given(st.lists(EVENT, max_size=6), st.booleans())
# A token id past 64 bits: taken as an integer, it could not be written (orjson stops there).
@example([{"prompt_token_ids": [1.8446744073709552e19]}], False)
@example([{"choices": [{"delta": {"content": "a"}}], "usage": {"completion_tokens": 2**64}}], True)
def test_sse_events_of_any_shape_are_results(events: list[object], done: bool) -> None:
    """Well-formed JSON of the wrong shape is the server's protocol error on that request:
    it never escapes, and whatever the result holds can be written and summarized."""
    import orjson

    from replay.analysis.summary import summarize
    from replay.core.records import Result
    from replay.serving.accumulator import StreamAccumulator
    from replay.serving.sse import DONE, ProtocolError, SSEDecoder

    body = b"".join(b"data: " + json.dumps(ev).encode() + b"\n\n" for ev in events)
    body += b"data: [DONE]\n\n" if done else b""
    result = Result(request_id="r", target="t", phase="c1", bucket="b", scheduled=0.0, sent=0.0)
    acc = StreamAccumulator(result, lambda: 1.0)
    try:
        decoder = SSEDecoder()
        for ev in [*decoder.feed(body), *decoder.close()]:
            if ev is DONE:
                break
            acc.add(ev)
        acc.finish()
    except ProtocolError as err:
        assert str(err)
    orjson.dumps(result.to_json())
    summarize([result]).to_json()


TOML_VALUE = st.one_of(
    st.sampled_from(
        [
            '"http://127.0.0.1:8000"',
            '"ftp://x"',
            '"fp8"',
            '"auto"',
            "1",
            "true",
            "[]",
            '["--x", "1"]',
            "[1, 2]",
            "{}",
            '{ A = "b" }',
            "{ A = 1 }",
            '""',
        ]
    ),
    st.text(max_size=10).map(json.dumps),
)
TOML_TABLE = st.tuples(
    st.sampled_from(["bf16", "fp8", "x.y", '"quoted name"', "a-b"]),
    st.dictionaries(
        st.sampled_from(
            [
                "url",
                "model",
                "api_key_env",
                "kv_cache_dtype",
                "args",
                "env",
                "expect_cache_dtype",
                "colour",
            ]
        ),
        TOML_VALUE,
        max_size=4,
    ),
)


@FAST
@given(st.lists(TOML_TABLE, max_size=3), st.booleans())
def test_targets_config_structured(tmp_path_factory, tables: list, top: bool) -> None:  # type: ignore[no-untyped-def]
    """Valid TOML with wrong keys, types and shapes: a ConfigError naming the file (and the
    table, when one is at fault), or a usable spec."""
    from replay.core.errors import ConfigError

    text = 'targets = "flat"\n' if top else ""
    for name, keys in tables:
        text += f"[targets.{name}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items())
    path = tmp_path_factory.mktemp("f") / "t.toml"
    path.write_text(text, encoding="utf-8")
    try:
        specs = load_targets_config(path)
    except ConfigError as err:
        assert str(err).startswith(f"{path}:")
        return
    for spec in specs.values():
        assert (spec.url is None) != (spec.model is None)


@FAST
@given(
    st.sampled_from(["mooncake", "azure"]),
    st.one_of(st.floats(), st.integers(-(10**20), 10**20), st.text(max_size=12)),
)
def test_importer_timestamps(tmp_path_factory, fmt: str, ts: object) -> None:  # type: ignore[no-untyped-def]
    """NaN, infinite, negative, huge and non-numeric timestamps: a bad line with its field,
    or a record whose time is a finite number >= 0."""
    import math

    path = tmp_path_factory.mktemp("f") / ("t.csv" if fmt == "azure" else "t.jsonl")
    if fmt == "azure":  # one CSV field on one row: no separators, line breaks or quotes
        field = str(ts).translate({ord(c): " " for c in ',"\r\n'})
        path.write_text(
            f"TIMESTAMP,ContextTokens,GeneratedTokens\n{field},10,5\n",
            encoding="utf-8",
            errors="surrogateescape",
        )
    else:
        path.write_text(
            json.dumps({"timestamp": ts, "input_length": 10, "output_length": 5}) + "\n"
        )
    loaded = load(path, fmt, on_bad_line="skip")
    for err in loaded.bad:
        _names_place(err, path)
        assert err.line == (2 if fmt == "azure" else 1)
    for req in loaded.requests:
        assert req.t is not None and math.isfinite(req.t) and req.t >= 0


@pytest.mark.parametrize(
    ("fmt", "data"),
    [
        ("v1", b""),
        ("v1", b"\n  \n\t\n"),
        ("mooncake", b""),
        ("mooncake", b"\n\n"),
        ("azure", b""),
        ("azure", b"TIMESTAMP,ContextTokens,GeneratedTokens\n"),
        ("azure", b"\xff\xfe,\x00\n1,2,3\n"),
        ("bailian", b"\n"),
        ("burstgpt", b""),
        ("burstgpt", IMPORTER_HEADERS["burstgpt"]),
        ("openai-log", b""),
        ("csv:t=a,in=b,out=c", b"a,b\n1,2\n"),
        ("jsonl:t=a,in=b,out=c", b" \n"),
    ],
)
def test_empty_or_headless_files_name_the_file(tmp_path: Path, fmt: str, data: bytes) -> None:
    path = tmp_path / "t"
    path.write_bytes(data)
    for mode in ("fail", "skip"):
        with pytest.raises(TraceError) as info:
            load(path, fmt, on_bad_line=mode)  # type: ignore[arg-type]
        _names_place(info.value, path)


LOG_FIELDS = st.fixed_dictionaries(
    {"timestamp": st.sampled_from([0, "2025-01-31T12:00:00Z"]) | JSONISH},
    optional={
        "id": JSONISH,
        "t": JSONISH,
        "request": st.fixed_dictionaries(
            {"messages": st.just([{"role": "user", "content": "x"}]) | JSONISH},
            optional={k: JSONISH for k in ("tools", "tool_choice", "max_tokens", "n", "seed")},
        )
        | JSONISH,
        "response": st.fixed_dictionaries(
            {"choices": st.lists(st.fixed_dictionaries({"message": JSONISH}), max_size=2)}
        )
        | JSONISH,
        "meta": JSONISH,
    },
)
BAILIAN_FIELDS = st.fixed_dictionaries(
    {
        "chat_id": st.integers(-2, 3) | JSONISH,
        "parent_chat_id": st.integers(-2, 3) | JSONISH,
        "timestamp": st.floats(0, 10) | JSONISH,
        "input_length": st.integers(1, 40) | JSONISH,
        "output_length": st.integers(1, 4) | JSONISH,
    },
    optional={"type": JSONISH, "turn": JSONISH, "hash_ids": JSONISH},
)


@FAST
@given(
    st.sampled_from(["openai-log", "bailian"]),
    st.data(),
)
def test_structured_rows_of_request_logs_and_bailian(tmp_path_factory, fmt: str, data) -> None:  # type: ignore[no-untyped-def]
    """Rows with the right keys and arbitrary values: a request or a named bad row, never a
    crash (the fields' checks, not the JSON parser, are what is exercised)."""
    rows = data.draw(st.lists(LOG_FIELDS if fmt == "openai-log" else BAILIAN_FIELDS, max_size=5))
    path = tmp_path_factory.mktemp("f") / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) or "\n")
    try:
        loaded = load(path, fmt, on_bad_line="skip")
    except TraceError as err:
        assert "empty" in err.reason
        return
    for err in loaded.bad:
        _names_place(err, path)
    assert len(loaded.requests) + len(loaded.bad) + sum(loaded.skipped.values()) == len(rows)


def test_huge_and_undecodable_rows_in_importers(tmp_path: Path) -> None:
    mc = tmp_path / "m.jsonl"
    row = {"timestamp": 0, "input_length": 10, "output_length": 5}
    mc.write_bytes(
        json.dumps(row).encode()
        + b"\n"
        + json.dumps({**row, "hash_ids": list(range(400_000))}).encode()
        + b"\n"
        + b'{"timestamp": 1, "input_length": 10, "output_length": 5, "x": "\xff"}\n'
        + b'{"timestamp": '
        + b"9" * 100_000
        + b"}\n"
    )
    loaded = load(mc, "mooncake", on_bad_line="skip")
    assert len(loaded.requests) == 2
    assert [e.line for e in loaded.bad] == [3, 4]
    az = tmp_path / "a.csv"
    az.write_bytes(
        b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,5\n"
        b"2023-11-16 18:15:4\xff,10,5\n2023-11-16 18:15:47," + b"7" * 100_000 + b",5\n"
    )
    loaded = load(az, "azure", on_bad_line="skip")
    # A 100,000-digit count is past Python's int-parsing limit: a bad field, not a crash.
    assert [(e.line, e.field) for e in loaded.bad] == [(3, "TIMESTAMP"), (4, "ContextTokens")]
    assert len(loaded.requests) == 1


@FAST
@given(st.lists(st.integers(0, 6), min_size=1, max_size=20))
def test_repeated_ids_name_the_first_line(tmp_path_factory, ids: list[int]) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("f") / "t.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": i, "messages": [{"role": "user", "content": "x"}]}) + "\n"
            for i in ids
        )
    )
    loaded = load(path, "v1", on_bad_line="skip")
    first: dict[int, int] = {}
    want = []
    for line, i in enumerate(ids, start=1):
        if first.setdefault(i, line) != line:
            want.append((line, f"duplicate id '{i}' (first on line {first[i]})"))
    assert [(e.line, e.reason) for e in loaded.bad] == want
    assert [r.id for r in loaded.requests] == [str(i) for i in first]
