"""Importers on the real public traces, unchanged; every format's rows as published, their
bad rows, format recognition that never guesses; and synthesis of exact-length prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from replay.cli import main
from replay.core.errors import InputError, TraceError
from replay.traces.importers import LengthPolicy, load, scan, sniff_format
from replay.traces.synth import TokenPool, synthesize
from tests.conftest import SHARED_DATA

MOONCAKE = SHARED_DATA / "mooncake_conversation_trace.jsonl"
AZURE = SHARED_DATA / "azure_llm_2023_conv.csv"
needs_data = pytest.mark.skipif(not MOONCAKE.exists(), reason="shared trace data not present")


@needs_data
def test_mooncake_whole_file_imports() -> None:
    assert sniff_format(MOONCAKE) == "mooncake"
    loaded = load(MOONCAKE)
    assert len(loaded.requests) == 12031 and not loaded.bad
    first = loaded.requests[0]
    # {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0..13]}
    assert first.synth is not None
    assert (first.synth.input_tokens, first.max_tokens, first.t) == (6758, 500, 0.0)
    assert first.synth.hash_ids == tuple(range(14)) and first.synth.block_tokens == 512
    assert first.api == "completions" and first.params == {"ignore_eos": True}
    ts = [r.t or 0.0 for r in loaded.requests]
    assert ts == sorted(ts) and ts[-1] > 3000  # one hour of traffic, in seconds


@needs_data
def test_azure_whole_file_imports() -> None:
    assert sniff_format(AZURE) == "azure"
    loaded = load(AZURE)
    rows = sum(1 for line in AZURE.open() if line.strip()) - 1  # minus the header
    assert rows > 19000 and len(loaded.requests) == rows and not loaded.bad
    a, b = loaded.requests[:2]
    # 2023-11-16 18:15:46.6805900,374,44 then 18:15:50.9951690,396,109
    assert (a.input_tokens, a.max_tokens, a.t) == (374, 44, 0.0)
    assert b.t == pytest.approx(4.314579, abs=1e-6)
    assert a.synth is not None and a.synth.hash_ids == ()


@needs_data
def test_length_policy_scales_blocks_and_caps() -> None:
    policy = LengthPolicy(scale=0.25, max_input_tokens=1000, max_output_tokens=16)
    first = load(MOONCAKE, policy=policy).requests[0]
    assert first.synth is not None
    assert first.synth.block_tokens == 128
    assert first.synth.input_tokens == 1000  # 6758 * 0.25 = 1690, capped
    assert first.synth.hash_ids == tuple(range(8))  # ceil(1000 / 128) blocks
    assert first.max_tokens == 16
    assert first.meta["orig_input_tokens"] == 6758


def test_bad_rows_name_line_and_field(tmp_path: Path) -> None:
    mc = tmp_path / "m.jsonl"
    mc.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'
        '{"timestamp": -5, "input_length": 10, "output_length": 5}\n'
        '{"timestamp": 1, "input_length": "ten", "output_length": 5}\n'
        '{"timestamp": 1, "input_length": 10, "output_length": 5, "hash_ids": "x"}\n'
    )
    loaded = load(mc, "mooncake", on_bad_line="skip")
    assert len(loaded.requests) == 1
    assert [(e.line, e.field) for e in loaded.bad] == [
        (2, "timestamp"),
        (3, "input_length"),
        (4, "hash_ids"),
    ]
    az = tmp_path / "a.csv"
    az.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,5\n"
        "yesterday,10,5\n2023-11-16 18:15:47,0,5\n"
    )
    loaded = load(az, "azure", on_bad_line="skip")
    assert [(e.line, e.field) for e in loaded.bad] == [(3, "TIMESTAMP"), (4, "ContextTokens")]
    wrong = tmp_path / "w.csv"
    wrong.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(TraceError, match="missing column"):
        load(wrong, "azure")


BOM = b"\xef\xbb\xbf"
BOM_CASES = {
    "mooncake": b'{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'
    b'{"timestamp": 5, "input_length": 20, "output_length": 5}\n',
    "azure": b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,5\n"
    b"2023-11-16 18:15:47,20,5\n",
    "v1": b'{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n'
    b'{"id": "b", "api": "completions", "prompt": "hi"}\n',
}


@pytest.mark.parametrize("fmt", list(BOM_CASES))
@pytest.mark.parametrize("given", ["auto", "named"])
def test_a_byte_order_mark_is_accepted(fmt: str, given: str, tmp_path: Path) -> None:
    """Files saved by Excel or Windows editors start with a UTF-8 BOM: the format is still
    recognised and the first record is still read."""
    path = tmp_path / ("t.csv" if fmt == "azure" else "t.jsonl")
    path.write_bytes(BOM + BOM_CASES[fmt])
    assert sniff_format(path) == fmt
    loaded = load(path, fmt if given == "named" else "auto")
    assert not loaded.bad and len(loaded.requests) == 2
    first = {"mooncake": "mooncake-1", "azure": "azure-2", "v1": "a"}[fmt]
    assert loaded.requests[0].id == first


POOL = TokenPool(range(100, 400))


def synth_req(rid: str, n: int, hash_ids: list[int], block: int = 16):  # type: ignore[no-untyped-def]
    from replay.traces.trace import Request, Synth

    return Request(
        id=rid,
        api="completions",
        synth=Synth(input_tokens=n, hash_ids=tuple(hash_ids), block_tokens=block),
    )


def test_synth_exact_length_and_shared_prefixes() -> None:
    a = synthesize(synth_req("a", 40, [1, 2, 3]), POOL)
    b = synthesize(synth_req("b", 45, [1, 2, 9]), POOL)
    c = synthesize(synth_req("c", 40, [7, 2, 3]), POOL)
    assert (len(a), len(b), len(c)) == (40, 45, 40)
    assert a[:32] == b[:32] and a[32:] != b[32:40]  # two shared blocks, then different
    assert a[:16] != c[:16]
    assert synthesize(synth_req("a", 40, [1, 2, 3]), POOL) == a  # deterministic
    assert set(a) <= set(POOL.ids)


def test_synth_without_hash_ids_is_unique_per_request() -> None:
    a = synthesize(synth_req("x", 50, []), POOL)
    b = synthesize(synth_req("y", 50, []), POOL)
    assert len(a) == 50 and a[:16] != b[:16]


# -- Qwen-Bailian ----------------------------------------------------------------------------

# Four rows in the published format (alibaba-edu/qwen-bailian-usagetraces-anon README): two
# conversations, 16-token blocks, seconds since the trace began.
BAILIAN_ROWS: list[dict[str, object]] = [
    {
        "chat_id": 0,
        "parent_chat_id": -1,
        "timestamp": 0.0,
        "input_length": 40,
        "output_length": 12,
        "type": "text",
        "turn": 1,
        "hash_ids": [1, 2, 3],
    },
    {
        "chat_id": 1,
        "parent_chat_id": -1,
        "timestamp": 0.75,
        "input_length": 20,
        "output_length": 5,
        "type": "search",
        "turn": 1,
        "hash_ids": [9, 10],
    },
    {
        "chat_id": 2,
        "parent_chat_id": 0,
        "timestamp": 61.114,
        "input_length": 70,
        "output_length": 8,
        "type": "text",
        "turn": 2,
        "hash_ids": [1, 2, 3, 4, 5],
    },
    {
        "chat_id": 3,
        "parent_chat_id": 2,
        "timestamp": 90.5,
        "input_length": 90,
        "output_length": 3,
        "type": "image",
        "turn": 3,
        "hash_ids": [1, 2, 3, 4, 5, 6],
    },
]


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_bailian_sessions_seconds_and_16_token_blocks(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qwen_traceA_blksz_16.jsonl", list(BAILIAN_ROWS))
    assert sniff_format(path) == "bailian"
    loaded = load(path)
    assert not loaded.bad and [r.id for r in loaded.requests] == [f"bailian-{i}" for i in range(4)]
    assert [r.session for r in loaded.requests] == ["0", "1", "0", "0"]  # root of each chain
    assert [r.t for r in loaded.requests] == [0.0, 0.75, 61.114, 90.5]  # seconds, as given
    third = loaded.requests[2]
    assert third.synth is not None and third.synth.block_tokens == 16
    assert third.synth.hash_ids == (1, 2, 3, 4, 5) and third.synth.input_tokens == 70
    assert third.max_tokens == 8 and third.params == {"ignore_eos": True}
    assert {k: third.meta[k] for k in ("chat_id", "parent_chat_id", "turn", "type")} == {
        "chat_id": 2,
        "parent_chat_id": 0,
        "turn": 2,
        "type": "text",
    }
    scanned = scan(path)  # a re-read finds the same sessions
    assert [r.session for r in scanned.iter_requests()] == ["0", "1", "0", "0"]


def test_bailian_is_not_taken_for_mooncake(tmp_path: Path) -> None:
    """Regression: Bailian rows have Mooncake's length fields, and were read as Mooncake
    (t / 1000, 512-token blocks, chat_id, parent_chat_id, type and turn dropped)."""
    path = write_jsonl(tmp_path / "qwen.jsonl", list(BAILIAN_ROWS))
    assert sniff_format(path) == "bailian"
    out = CliRunner().invoke(main, ["trace", "validate", str(path)])
    assert out.exit_code == 0 and out.output.strip() == f"{path}: 4 valid request(s), 0 bad line(s)"
    assert all(r.synth and r.synth.block_tokens == 16 for r in load(path).requests)
    # Named as Mooncake, every row is refused by its first field Mooncake does not have.
    forced = load(path, "mooncake", on_bad_line="skip")
    assert not forced.requests and [(e.line, e.field) for e in forced.bad] == [
        (i, "chat_id") for i in range(1, 5)
    ]
    assert "not a Mooncake field" in forced.bad[0].reason
    assert "--trace-format bailian" in forced.bad[0].reason
    assert "parent_chat_id" in forced.bad[0].reason and "turn" in forced.bad[0].reason


def test_bailian_child_of_a_missing_parent_is_a_bad_row(tmp_path: Path) -> None:
    orphan = {**BAILIAN_ROWS[3], "chat_id": 7, "parent_chat_id": 42}
    path = write_jsonl(tmp_path / "cut.jsonl", [*BAILIAN_ROWS[:2], orphan])
    with pytest.raises(TraceError) as info:
        load(path)
    assert (info.value.line, info.value.field) == (3, "parent_chat_id")
    assert "chat 42 is not an earlier valid record" in info.value.reason
    loaded = load(path, on_bad_line="skip")
    assert len(loaded.requests) == 2 and [e.line for e in loaded.bad] == [3]


def test_bailian_malformed_rows_name_the_field(tmp_path: Path) -> None:
    root = BAILIAN_ROWS[0]
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            root,
            {**root, "chat_id": 5, "timestamp": "soon"},
            {**root, "chat_id": 6, "turn": 0},
            {**root, "chat_id": 8, "hash_ids": ["a"]},
            {**root, "chat_id": 9, "region": "cn"},
            {**root, "chat_id": 10, "parent_chat_id": 10},
            {**root},  # chat 0 again
            "{oops",
        ],
    )
    loaded = load(path, "bailian", on_bad_line="skip")
    assert [r.id for r in loaded.requests] == ["bailian-0"]
    assert [(e.line, e.field) for e in loaded.bad] == [
        (2, "timestamp"),
        (3, "turn"),
        (4, "hash_ids"),
        (5, "region"),
        (6, "parent_chat_id"),
        (7, "id"),
        (8, "(line)"),
    ]
    assert "duplicate id 'bailian-0'" in loaded.bad[5].reason


# -- recognising a format -------------------------------------------------------------------


def test_a_record_that_fits_two_formats_is_not_guessed(tmp_path: Path) -> None:
    both = {**BAILIAN_ROWS[0], "region": "cn"}  # Mooncake's and Bailian's fields, and one more
    path = write_jsonl(tmp_path / "t.jsonl", [both])
    with pytest.raises(InputError) as info:
        sniff_format(path)
    msg = str(info.value)
    assert "mooncake (timestamp in milliseconds" in msg and "bailian (timestamp in seconds" in msg
    assert "--trace-format" in msg
    with pytest.raises(InputError, match="fit more than one format"):
        load(path)


@pytest.mark.parametrize(
    ("first_line", "want"),
    [
        ('{"when": 1, "prompt_tokens": 3}', "match no known format"),
        ("ts,prompt_tokens,completion_tokens", "csv:t=COL,in=COL,out=COL"),
        ("TIMESTAMP,ContextTokens", "match no known format"),
    ],
)
def test_a_file_of_no_known_format_says_so(tmp_path: Path, first_line: str, want: str) -> None:
    path = tmp_path / "t.txt"
    path.write_text(first_line + "\n1,2,3\n")
    with pytest.raises(InputError) as info:
        sniff_format(path)
    assert str(info.value).startswith(f"{path}: ") and want in str(info.value)
    assert "--trace-format" in str(info.value)


def test_unknown_fields_and_columns_are_refused(tmp_path: Path) -> None:
    mc = write_jsonl(
        tmp_path / "m.jsonl",
        [{"timestamp": 0, "input_length": 10, "output_length": 5, "priority": 1}],
    )
    assert sniff_format(mc) == "mooncake"  # the only format with all its fields
    with pytest.raises(TraceError) as info:
        load(mc)
    assert (info.value.line, info.value.field) == (1, "priority")
    # An empty key (found by the fuzzer) is still named: quoted.
    blank = write_jsonl(
        tmp_path / "b.jsonl",
        [{"timestamp": 0, "input_length": 10, "output_length": 5, "": 1}],
    )
    bad = load(blank, "mooncake", on_bad_line="skip").bad
    assert [(e.line, e.field) for e in bad] == [(1, "''")]
    az = tmp_path / "a.csv"
    az.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,Region\n2023-11-16 18:15:46,10,5,eu\n")
    with pytest.raises(TraceError, match=r"column\(s\) \['Region'\]") as info:
        load(az)
    assert (info.value.line, info.value.field) == (1, "(header)")
    wide = tmp_path / "w.csv"
    wide.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,5,9\n")
    with pytest.raises(TraceError, match="4 fields; the header has 3"):
        load(wide)


# -- BurstGPT -------------------------------------------------------------------------------

BURSTGPT = (
    "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    "5,ChatGPT,472,18,490,Conversation log\n"
    "45,GPT-4,1021,0,1021,API log\n"  # failed: no response tokens
    "47.5,ChatGPT,88,120,208,API log\n"
    "48,ChatGPT,many,3,3,API log\n"  # malformed
)


def test_burstgpt_failed_rows_are_counted_not_replayed(tmp_path: Path) -> None:
    path = tmp_path / "BurstGPT_1.csv"
    path.write_text(BURSTGPT)
    assert sniff_format(path) == "burstgpt"
    loaded = load(path, on_bad_line="skip")
    assert [r.id for r in loaded.requests] == ["burstgpt-2", "burstgpt-4"]
    assert loaded.skipped == {"failed": 1} and loaded.lines == 4
    assert [(e.line, e.field) for e in loaded.bad] == [(5, "Request tokens")]
    a, b = loaded.requests
    assert (a.t, a.input_tokens, a.max_tokens, b.t) == (5.0, 472, 18, 47.5)
    assert a.synth is not None and a.synth.hash_ids == ()
    assert a.meta["model"] == "ChatGPT" and b.meta["log_type"] == "API log"
    scanned = scan(path, on_bad_line="skip")
    assert scanned.skipped == {"failed": 1} and scanned.count == 2
    assert [r.id for r in scanned.iter_requests()] == ["burstgpt-2", "burstgpt-4"]
    out = CliRunner().invoke(main, ["trace", "validate", str(path)])
    assert out.output.splitlines()[-1] == (
        f"{path}: 2 valid request(s), 1 bad line(s), not replayed: 1 failed request(s)"
    )


# -- OpenAI-style request logs --------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
}
OPENAI_LOG: list[dict[str, object]] = [
    {
        "id": "req-7",
        "timestamp": "2025-01-31T12:00:00.250Z",
        "request": {
            "model": "prod-model",
            "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": [WEATHER_TOOL],
            "tool_choice": "auto",
            "max_completion_tokens": 64,
            "temperature": 0,
            "seed": 3,
            "stream": True,
        },
        "response": {
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                    "finish_reason": "tool_calls",
                }
            ],
        },
    },
    {
        "timestamp": "2025-01-31T13:00:02.750+01:00",  # 2.5 s after the first
        "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": None},
        "response": {"choices": [{"message": {"role": "assistant", "content": "Hello!"}}]},
        "meta": {"tenant": "t1"},
    },
    {
        "t": 1738324805.25,  # POSIX seconds: 5 s after the first
        "request": {"messages": [{"role": "user", "content": "x"}]},
        "response": {"error": {"message": "upstream timeout"}},
    },
]


def test_openai_log_becomes_chat_requests_with_reference_answers(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "gateway.jsonl", list(OPENAI_LOG))
    assert sniff_format(path) == "openai-log"
    loaded = load(path)
    assert not loaded.bad and loaded.skipped == {"failed": 1}
    a, b = loaded.requests
    assert (a.id, a.api, a.t, b.id, b.t) == ("req-7", "chat", 0.0, "openai-2", 2.5)
    assert a.messages == ({"role": "user", "content": "Weather in Oslo?"},)
    assert a.tools == (WEATHER_TOOL,) and a.tool_choice == "auto" and a.max_tokens == 64
    assert a.params == {"temperature": 0, "seed": 3}  # stream: the replay always streams
    assert a.meta["reference"] == {"content": None, "tool_calls": [TOOL_CALL]}
    assert a.meta["model"] == "prod-model"
    assert b.meta["reference"] == {"content": "Hello!", "tool_calls": []}
    assert b.max_tokens == 128 and b.meta["log"] == {"tenant": "t1"}


@pytest.mark.parametrize(
    ("change", "field", "reason"),
    [
        ({"status": 200}, "status", "not a request-log field"),
        ({"request": {"messages": [{"role": "user", "content": "x"}], "functions": []}},
         "functions", "not a chat/completions request field"),
        ({"request": {"messages": []}}, "request.messages", "non-empty"),
        ({"request": {"messages": [{"content": "x"}]}}, "request.messages.0.role", "role"),
        ({"timestamp": 1738324800250}, "timestamp", "milliseconds"),
        ({"timestamp": "yesterday"}, "timestamp", "ISO-8601"),
        ({"t": 1.0}, "t", "not both"),
        ({"response": {"choices": [{"message": {"tool_calls": [{"function": {}}]}}]}},
         "response.choices.0.message.tool_calls.0.function", "name"),
        ({"request": {"messages": [{"role": "user", "content": "x"}], "n": 2}},
         "request.n", "only one answer a request"),
    ],
)  # fmt: skip
def test_openai_log_malformed_rows_name_the_field(
    tmp_path: Path, change: dict[str, object], field: str, reason: str
) -> None:
    first = {k: v for k, v in OPENAI_LOG[0].items() if k != "response"}
    path = write_jsonl(tmp_path / "log.jsonl", [first, {**OPENAI_LOG[0], "id": "b", **change}])
    with pytest.raises(TraceError) as info:
        load(path, "openai-log")
    assert (info.value.line, info.value.field) == (2, field)
    assert reason in info.value.reason


def test_openai_log_earlier_than_the_first_record_is_a_bad_row(tmp_path: Path) -> None:
    late = {**OPENAI_LOG[0], "id": "late", "timestamp": "2025-01-31T11:59:59Z"}
    path = write_jsonl(tmp_path / "log.jsonl", [OPENAI_LOG[0], late])
    with pytest.raises(TraceError, match=r"1\.250 s before the first record's"):
        load(path)


# -- column mappings ------------------------------------------------------------------------


def test_a_csv_column_mapping(tmp_path: Path) -> None:
    path = tmp_path / "mine.csv"
    path.write_text(
        "ts,sid,prompt_tokens,completion_tokens,region\n"
        "1000,a,30,4,eu\n1250,,12,7,us\n3000,a,40,2,eu\n"
    )
    spec = "csv:t=ts,in=prompt_tokens,out=completion_tokens,session=sid,t_unit=ms"
    loaded = load(path, spec)
    assert [(r.id, r.t, r.session, r.input_tokens, r.max_tokens) for r in loaded.requests] == [
        ("csv-2", 0.0, "a", 30, 4),
        ("csv-3", 0.25, None, 12, 7),
        ("csv-4", 2.0, "a", 40, 2),
    ]
    v1 = tmp_path / "v1.jsonl"
    out = CliRunner().invoke(main, ["trace", "import", str(path), "--format", spec, "-o", str(v1)])
    assert out.exit_code == 0 and "wrote 3 request(s)" in out.output, out.output
    assert [r.id for r in load(v1).requests] == ["csv-2", "csv-3", "csv-4"]


def test_a_jsonl_column_mapping(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "mine.jsonl",
        [
            {"at": "2025-01-31T12:00:00Z", "n_in": 5, "n_out": 2, "rid": "x"},
            {"at": "2025-01-31T12:00:03Z", "n_in": 6, "n_out": 2, "rid": 9},
            {"at": "2025-01-31T12:00:04Z", "n_out": 2, "rid": "z"},
        ],
    )
    spec = "jsonl:t=at,in=n_in,out=n_out,id=rid,t_unit=iso"
    loaded = load(path, spec, on_bad_line="skip")
    assert [(r.id, r.t) for r in loaded.requests] == [("x", 0.0), ("9", 3.0)]
    assert [(e.line, e.field, e.reason) for e in loaded.bad] == [
        (3, "n_in", "missing (mapped as in=n_in)")
    ]


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("csv:t=ts,in=a,out=b,colour=c", "unknown key 'colour'"),
        ("csv:t=ts,in=a", "missing mapping for out"),
        ("csv:t=ts,in=a,out=b,t_unit=days", "t_unit=days"),
        ("csv:t=ts,in,out=b", "'in' is not KEY=COLUMN"),
        ("csv:t=ts,in=a,out=b,in=c", "'in' is mapped twice"),
        ("tsv:t=ts,in=a,out=b", "unknown format 'tsv:t=ts,in=a,out=b'"),
    ],
)
def test_bad_column_mappings_say_what_is_wrong(tmp_path: Path, spec: str, want: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text("ts,a,b\n1,2,3\n")
    with pytest.raises(InputError) as info:
        load(path, spec)
    assert want in str(info.value)
    out = CliRunner().invoke(main, ["trace", "validate", str(path), "--format", spec])
    assert out.exit_code == 2 and want in out.output


def test_a_mapped_column_missing_from_the_header_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("ts,prompt,completion\n1,2,3\n")
    with pytest.raises(TraceError) as info:
        load(path, "csv:t=ts,in=prompt_tokens,out=completion")
    err = info.value
    assert (err.path, err.line, err.field) == (str(path), 1, "(header)")
    assert "['prompt_tokens']" in err.reason and "csv:t=ts,in=prompt_tokens" in err.reason


def test_openai_log_sessions(tmp_path: Path) -> None:
    rows = [
        {"t": 0, "session": "c", "request": {"messages": [{"role": "user", "content": "a"}]}},
        {"t": 1, "session": 7, "request": {"messages": [{"role": "user", "content": "b"}]}},
        {"t": 2, "request": {"messages": [{"role": "user", "content": "c"}]}},
        {"t": 3, "session": True, "request": {"messages": [{"role": "user", "content": "d"}]}},
    ]
    path = write_jsonl(tmp_path / "log.jsonl", rows)
    loaded = load(path, "openai-log", on_bad_line="skip")
    assert [r.session for r in loaded.requests] == ["c", "7", None]
    assert [(e.line, e.field) for e in loaded.bad] == [(4, "session")]
