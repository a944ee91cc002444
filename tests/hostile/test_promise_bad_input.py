"""What a run promises on bad input (docs/run-directory.md): it is refused before anything is
sent, by file, line and field (or option), never taken as something else; and what it writes
for a later step reads back as it meant.

Each test is one promise, named after it. Ids, numbers and types in traces, grading specs, and
the run directory's options; the full disk is
tests/hostile/test_promise_full_disk.py, hostile answers
tests/hostile/test_promise_hostile_answer.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.checkers import Answer, Grader, SpecError, parse_check
from replay.cli import main
from replay.cli.run_directory import reconcile_resume, resume_options
from replay.cli.run_options import RunOptions
from replay.core.errors import InputError, TraceError
from replay.core.ids import id_problem, read_ids, write_ids
from replay.run.exclude import exclusion
from replay.rundir.files import file_digest
from replay.serving.client import Client
from replay.traces.importers import load, scan
from replay.traces.trace import FIRST_CLASS, Request
from tests.conftest import within
from tests.support.promise_run import tmpfs

CHAT = [{"role": "user", "content": "q"}]


def trace_of(tmp_path: Path, records: list[dict[str, Any]], name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def refused(tmp_path: Path, record: dict[str, Any]) -> TraceError:
    """The error of a trace whose second line is ``record`` (the first is fine)."""
    path = trace_of(tmp_path, [{"id": "ok", "messages": CHAT}, {"messages": CHAT, **record}])
    with pytest.raises(TraceError) as info:
        load(path)
    assert info.value.line == 2, info.value
    return info.value


# -- ids: one grammar, and the id files hold every id it accepts --------------------------------

# Ids an id file (one a line, stripped, '#' a comment) would read back as another id, or as none.
AMBIGUOUS_IDS = [
    "a\nb",  # two lines
    "a\r",
    "\tab",
    " lead",
    "trail ",
    "#comment",
    "a\x00b",
    "a\x1bb",
    "a\u202eb",  # a bidi override
    "a\u2028b",  # a line separator (str.splitlines splits there)
    "a\x85b",
    "a\x1cb",
    "\u00a0nbsp",  # stripped by str.strip
    "a\u200bb",  # zero-width space
]


@pytest.mark.parametrize("rid", AMBIGUOUS_IDS, ids=[ascii(i) for i in AMBIGUOUS_IDS])
def test_bad_input_an_id_no_id_file_could_hold_is_refused_at_load_by_line_and_field(
    tmp_path: Path, rid: str
) -> None:
    err = refused(tmp_path, {"id": rid})
    assert err.field == "id"
    assert id_problem(rid) is not None and id_problem(rid) in err.reason


def test_bad_input_every_importer_refuses_such_an_id_too(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    row = {"id": " padded", "timestamp": 1.0, "request": {"messages": CHAT}}
    log.write_text(json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(TraceError) as info:
        load(log, "openai-log")
    assert (info.value.line, info.value.field) == (1, "id")


# Ids the grammar accepts that a careless id file would still get wrong.
TRICKY_IDS = [
    "a b",
    "x#1",
    "q'\"\\",
    "ünï-código",
    "日本語",
    "emoji-😀",
    "1e3",
    "-",
]


@given(st.text(min_size=1, max_size=40))
@settings(max_examples=300, deadline=None)
def test_bad_input_every_id_the_trace_accepts_reads_back_from_an_id_file_unchanged(
    rid: str,
) -> None:
    import tempfile

    accepted = id_problem(rid) is None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ids.txt"
        if not accepted:
            with pytest.raises(ValueError):
                write_ids(path, [rid])
            return
        write_ids(path, [rid, "other"])
        assert read_ids(path, "--exclude-ids") == {rid, "other"}


def test_bad_input_a_calibration_request_is_never_evaluated(tmp_path: Path) -> None:
    """kvcal sample's calibration_ids.txt, as the replay's --exclude-ids reads it, leaves out
    exactly the requests calibrated on, whatever their ids."""
    from kvcal.cli import main as kvcal_main
    from replay.testmodel.factory import ensure_default_model

    ids = [f"{base}-{k}" for k in range(6) for base in TRICKY_IDS]
    trace = trace_of(
        tmp_path, [{"id": i, "messages": [{"role": "user", "content": i}]} for i in ids]
    )
    out = tmp_path / "cal"
    model = ensure_default_model()
    res = CliRunner().invoke(
        kvcal_main,
        ["sample", str(model), "--trace", str(trace), "--per-bucket", "20", "-o", str(out)],
    )
    assert res.exit_code == 0, res.output
    calibrated = {json.loads(line)["id"] for line in (out / "samples.jsonl").open()}
    assert calibrated and calibrated < set(ids)
    keep = exclusion(out / "calibration_ids.txt")
    assert keep is not None
    evaluated = [r.id for r in scan(trace, keep=keep).iter_requests()]
    assert not calibrated & set(evaluated)
    assert sorted(evaluated + sorted(calibrated)) == sorted(ids)
    assert read_ids(out / "evaluation_ids.txt", "evaluation_ids.txt") == set(evaluated)


def test_bad_input_kvcal_refuses_a_trace_whose_ids_an_id_file_cannot_hold(tmp_path: Path) -> None:
    from kvcal.cli import main as kvcal_main
    from replay.testmodel.factory import ensure_default_model

    trace = trace_of(tmp_path, [{"id": "a", "messages": CHAT}, {"id": "b ", "messages": CHAT}])
    res = CliRunner().invoke(
        kvcal_main,
        ["sample", str(ensure_default_model()), "--trace", str(trace), "-o", str(tmp_path / "o")],
    )
    assert res.exit_code == 2, res.output
    assert says(res.output, "t.jsonl:2: field 'id'") and not (tmp_path / "o").exists()


def test_bad_input_an_id_file_line_that_is_no_id_names_itself(tmp_path: Path) -> None:
    path = tmp_path / "ids.txt"
    path.write_text("# calibration\nfine\r\nbad\u202eid\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"ids.txt:3: 'bad\\u202eid' is not a request id"):
        read_ids(path, "--exclude-ids")


# -- numbers and types: one strictness rule --------------------------------------------------


@pytest.mark.parametrize(
    ("record", "field", "words"),
    [
        ({"max_tokens": True}, "max_tokens", "must be an integer, got true"),
        ({"max_tokens": "16"}, "max_tokens", "must be an integer, got '16'"),
        ({"max_tokens": 16.5}, "max_tokens", "must be an integer, got 16.5"),
        ({"input_tokens": False}, "input_tokens", "must be an integer, got false"),
        ({"t": True}, "t", "must be a finite number, got true"),
        ({"t": "0.5"}, "t", "must be a finite number"),
        (
            {"api": "completions", "messages": None, "prompt": ["1", "2"]},
            "prompt",
            "item 0 is '1'",
        ),
        ({"api": "completions", "messages": None, "prompt": [5, True]}, "prompt", "item 1 is true"),
        ({"api": "completions", "messages": None, "prompt": [5, -1]}, "prompt", "item 1 is -1"),
        (
            {"api": "completions", "messages": None, "synth": {"input_tokens": True}},
            "synth.input_tokens",
            "must be an integer",
        ),
        (
            {
                "api": "completions",
                "messages": None,
                "synth": {"input_tokens": 8, "hash_ids": ["1"]},
            },
            "synth.hash_ids.0",
            "must be an integer",
        ),
    ],
)
def test_bad_input_a_value_of_the_wrong_type_is_refused_never_coerced(
    tmp_path: Path, record: dict[str, Any], field: str, words: str
) -> None:
    record = {"id": "x", **record}
    if record.get("messages", "") is None:
        del record["messages"]
    err = refused(tmp_path, record)
    assert err.field == field and words in err.reason, err


def test_bad_input_an_integral_number_is_an_integer() -> None:
    assert (
        Request.model_validate({"id": "x", "messages": CHAT, "max_tokens": 16.0}).max_tokens == 16
    )


@pytest.mark.parametrize("key", sorted(FIRST_CLASS))
def test_bad_input_params_never_override_a_first_class_field(tmp_path: Path, key: str) -> None:
    err = refused(tmp_path, {"id": "x", "params": {"temperature": 0.7, key: 99999}})
    assert err.field == f"params.{key}" and "params cannot override it" in err.reason


def test_bad_input_what_goes_out_is_what_the_record_says() -> None:
    # Built without validation, as no trace can build it: the body still says the record's.
    params = {"temperature": 0.7, "max_tokens": 99999, "stream": False, "model": "other"}
    req = Request.model_construct(id="x", api="chat", messages=tuple(CHAT), max_tokens=16)
    req = req.model_copy(update={"params": params})
    _, body = Client("http://127.0.0.1:9", "m").payload(req, cache_salt="s")
    assert (body["max_tokens"], body["stream"], body["model"]) == (16, True, "m")
    assert body["temperature"] == 0.7  # a sampling parameter is the record's to set


# -- grading specs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string"},
        {"type": "integer", "minimum": 3},
        {"type": ["number", "boolean"]},
        {"const": 3},
        {"enum": ["yes", "no"]},
        {"not": {}},
        {"allOf": [{"type": "object"}, {"type": "array"}]},
        {"anyOf": [{"type": "string"}, {"type": "null"}]},
    ],
)
def test_bad_input_a_json_schema_check_no_answer_can_pass_is_refused_at_load(
    tmp_path: Path, schema: dict[str, Any]
) -> None:
    err = refused(tmp_path, {"id": "x", "check": {"type": "json_schema", "schema": schema}})
    assert err.field == "check.schema" and "no answer could pass" in err.reason


def test_bad_input_a_json_schema_check_that_can_pass_still_loads() -> None:
    for schema in (
        {"type": ["object", "null"]},
        {"anyOf": [{"type": "string"}, {"type": "array"}]},
    ):
        parse_check({"type": "json_schema", "schema": schema})


def test_bad_input_a_schema_pattern_is_read_when_the_trace_loads(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": r"\p{Foo}"}}}
    err = refused(tmp_path, {"id": "x", "check": {"type": "json_schema", "schema": schema}})
    assert err.field == "check.schema.properties.a.pattern", err
    with pytest.raises(SpecError, match="patternProperties"):
        parse_check(
            {
                "type": "json_schema",
                "schema": {"patternProperties": {"^a": {}}, "unevaluatedProperties": False},
            }
        )


@pytest.mark.parametrize(
    ("schema", "text"),
    [
        (
            {"type": "array", "items": {"type": "string", "pattern": "(x+x+)+y"}},
            '["' + "x" * 5000 + '"]',
        ),
        (
            {"type": "object", "patternProperties": {"(x+x+)+y": {"type": "integer"}}},
            '{"' + "x" * 5000 + '": 1}',
        ),
        (
            {
                "type": "object",
                "patternProperties": {"(x+x+)+y": {}},
                "additionalProperties": False,
            },
            '{"' + "x" * 5000 + '": 1}',
        ),
    ],
)
def test_bad_input_a_backtracking_schema_pattern_is_bounded_as_a_regex_check_is(
    schema: dict[str, Any], text: str
) -> None:
    spec = {"type": "json_schema", "schema": schema}
    with Grader(time_s=30.0) as grader:  # the worker's limit, far past the pattern's own
        grade = within(60, lambda: grader.grade(spec, Answer(text)))
    assert not grade.passed and grade.detail == {"checker_error": "timeout"}
    assert "backtracking" in grade.reason, grade.reason


# -- the run directory's options ------------------------------------------------------------


def cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def says(output: str, words: str) -> bool:
    """Whether ``output`` says ``words``, however the console wrapped its lines."""
    return "".join(words.split()) in "".join(output.split())


def run_args(tmp_path: Path, *extra: str) -> list[str]:
    trace = trace_of(tmp_path, [{"id": "a", "messages": CHAT}])
    return ["--trace", str(trace), "--targets", "x=http://127.0.0.1:9", *extra]


def test_bad_input_out_naming_a_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    res = cli(*run_args(tmp_path, "--out", str(tmp_path / "file")))
    assert res.exit_code == 2 and says(res.output, "is a file, not a folder")
    assert res.exception is None or isinstance(res.exception, SystemExit)


@contextmanager
def read_only_folder(path: Path) -> Iterator[Path]:
    """A folder nobody may write: a read-only tmpfs as root (root ignores modes), else 0o555."""
    if os.geteuid() == 0:
        with tmpfs(path, "ro,size=64k"):
            yield path
        return
    path.mkdir()
    path.chmod(0o555)
    try:
        yield path
    finally:
        path.chmod(0o755)


def test_bad_input_out_naming_a_read_only_folder_is_a_clear_error(tmp_path: Path) -> None:
    with read_only_folder(tmp_path / "ro") as ro:
        res = cli(*run_args(tmp_path, "--out", str(ro)))
    assert res.exit_code == 2 and says(res.output, "is not writable"), res.output


def test_bad_input_a_run_id_that_exists_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    res = cli(*run_args(tmp_path, "--out", str(tmp_path / "runs"), "--run-id", "r1"))
    assert (
        res.exit_code == 2 and says(res.output, "exists already") and says(res.output, "--resume")
    )


@pytest.mark.parametrize("run_id", ["../../x", "a/b", "..", "ABSOLUTE", "x\x1b[2J"])
def test_bad_input_a_run_id_never_writes_outside_out(tmp_path: Path, run_id: str) -> None:
    out = tmp_path / "a" / "b" / "runs"
    if run_id == "ABSOLUTE":  # a path of this test's own, outside --out
        run_id = str(tmp_path / "elsewhere")
    args = run_args(tmp_path, "--out", str(out), "--run-id", run_id)
    before = set(tmp_path.rglob("*"))
    res = cli(*args)
    assert res.exit_code == 2 and says(res.output, "--run-id"), res.output
    assert set(tmp_path.rglob("*")) == before


def saved_run(tmp_path: Path, trace: Path) -> Path:
    """A run directory as an interrupted run leaves it (its manifest)."""
    ctx = main.make_context("replay", run_args(tmp_path), resilient_parsing=True)
    options = RunOptions.from_click(ctx.params).replace(trace_path=trace).to_json()
    run = tmp_path / "run"
    run.mkdir()
    manifest = {"cli_options": options, "trace": {"sha256": file_digest(trace)}}
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def test_bad_input_resume_with_another_trace_is_refused_with_a_word(tmp_path: Path) -> None:
    run = saved_run(tmp_path, trace_of(tmp_path, [{"id": "a", "messages": CHAT}], "own.jsonl"))
    other = trace_of(tmp_path, [{"id": "b", "messages": CHAT}], "other.jsonl")
    res = cli("--resume", str(run), "--trace", str(other))
    assert res.exit_code == 2 and says(res.output, "is not the trace this run replays"), res.output


def test_bad_input_resume_with_other_options_is_refused_naming_them(tmp_path: Path) -> None:
    run = saved_run(tmp_path, trace_of(tmp_path, [{"id": "a", "messages": CHAT}], "own.jsonl"))
    res = cli("--resume", str(run), "--concurrency", "8", "--run-id", "z")
    assert res.exit_code == 2 and says(res.output, "leave out --concurrency, --run-id"), res.output


def test_bad_input_resume_reads_a_moved_trace_when_it_is_the_same_file(tmp_path: Path) -> None:
    own = trace_of(tmp_path, [{"id": "a", "messages": CHAT}], "own.jsonl")
    run = saved_run(tmp_path, own)
    moved = tmp_path / "moved.jsonl"
    own.rename(moved)
    o, resuming = resume_options(run)
    o = reconcile_resume(o, resuming, {"trace_path": "--trace"}, {"trace_path": moved})
    assert o.trace_path == moved
