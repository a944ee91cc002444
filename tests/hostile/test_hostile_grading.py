"""Hostile answers and specs against grading: no crash, no hang, no network; a run whose
analysis never happened is re-analysed from its run directory.

Every case that could hang without its bound runs on a daemon thread with a deadline, so a
missing bound fails the test instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from replay.analysis.grading.rows import grade_rows
from replay.analysis.run_spec import QualitySpec
from replay.checkers import Answer, Grade, Grader, Job, JsonSchema, grade_safely, parse_check
from replay.cli import main
from replay.core.errors import TraceError
from replay.core.records import Result, ToolCall
from replay.core.schedule import ClosedLoop
from replay.pipeline.reanalyse import reanalyse
from replay.run.runner import Runner
from replay.rundir.files import new_run_dir, read_json
from replay.serving.targets import TargetSpec
from replay.traces.importers import load
from tests.conftest import within
from tests.support.fault_server import fault_server
from tests.support.run_config import run_config

DEEP = "[" * 5000


def result(rid: str, text: str, calls: tuple[ToolCall, ...] = (), target: str = "a") -> Result:
    return Result(
        request_id=rid,
        target=target,
        phase="c1",
        bucket="<256",
        scheduled=0.0,
        status="ok",
        output_text=text,
        tool_calls=list(calls),
    )


class Spec:
    def __init__(self, rid: str, check: dict[str, Any]) -> None:
        self.id, self.task, self.check = rid, "t", check


# -- deep nesting ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        {"type": "json_schema", "schema": {"type": "array"}},
        {"type": "tool_call", "calls": [{"name": "f", "arguments": {}}]},
    ],
)
def test_five_thousand_brackets_fail_the_answer_not_the_run(spec: dict[str, Any]) -> None:
    direct = within(10, lambda: parse_check(spec).grade(Answer(DEEP)))
    assert not direct.passed and direct.reason
    rows = within(30, lambda: grade_rows([result("r", DEEP)], {"r": Spec("r", spec)}, "a"))
    assert rows[0]["grade"]["passed"] is False
    assert rows[0]["grade"]["reason"]


def test_deep_tool_call_arguments_fail_with_a_reason() -> None:
    spec = {"type": "tool_call", "calls": [{"name": "f", "arguments": {"x": 1}}]}
    g = parse_check(spec).grade(Answer("", (ToolCall(0, "c0", "f", DEEP),)))
    assert not g.passed and "f: arguments" in g.reason


def test_deeply_nested_value_against_a_recursive_schema_fails_with_a_reason() -> None:
    # Parses (within the JSON parser's depth) but is too deep for the validator's recursion.
    spec = {
        "type": "json_schema",
        "schema": {
            "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
            "$ref": "#/$defs/n",
        },
    }
    text = "[" * 900 + "]" * 900
    with Grader() as grader:
        g = within(30, lambda: grader.grade(spec, Answer(text)))
    assert not g.passed and g.reason


# -- remote references ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "ref",
    [
        "http://127.0.0.1:9/s.json",
        "https://example.com/s.json",
        "file:///etc/passwd",
        "other.json#/x",
        "//host/s",
    ],
)
def test_remote_ref_is_refused_at_trace_load(tmp_path: Path, ref: str) -> None:
    check = {
        "type": "json_schema",
        "schema": {"type": "object", "properties": {"a": {"$ref": ref}}},
    }
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"id": "x", "messages": [{"role": "user", "content": "q"}], "check": check})
        + "\n"
    )
    with pytest.raises(TraceError) as info:
        load(path)
    assert info.value.field == "check.schema.properties.a.$ref"
    assert "not a local reference" in info.value.reason and ref in info.value.reason


def test_local_refs_still_work() -> None:
    spec = {
        "type": "json_schema",
        "schema": {
            "$defs": {"pos": {"type": "integer", "minimum": 1}},
            "type": "object",
            "properties": {"n": {"$ref": "#/$defs/pos"}},
            "required": ["n"],
        },
    }
    assert parse_check(spec).grade(Answer('{"n": 3}')).passed
    assert not parse_check(spec).grade(Answer('{"n": 0}')).passed


@pytest.fixture
def schema_server() -> Iterator[tuple[str, list[str]]]:
    """A loopback HTTP server that would serve a permissive schema; lists what was asked."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            body = b'{"type": "object"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/schema.json", asked
    finally:
        server.shutdown()
        server.server_close()


def test_a_remote_ref_that_reaches_grading_touches_no_network(
    schema_server: tuple[str, list[str]],
) -> None:
    url, asked = schema_server
    schema = {"type": "object", "properties": {"a": {"$ref": url}}}
    g = JsonSchema(schema).grade(Answer('{"a": {}}'))  # past spec validation, as an old run
    assert not g.passed and "unresolvable reference" in g.reason
    with Grader() as grader:  # the spec as a run directory would hand it back
        g = grader.grade({"type": "json_schema", "schema": schema}, Answer('{"a": {}}'))
    assert not g.passed and g.reason.startswith("checker error")
    assert asked == []


# -- backtracking and time ------------------------------------------------------------------


def test_backtracking_regex_is_bounded() -> None:
    spec = {"type": "regex", "pattern": "(a+)+$"}
    started = time.monotonic()
    g = within(10, lambda: parse_check(spec).grade(Answer("a" * 40 + "!")))
    assert not g.passed and g.reason
    # A pattern that backtracks even in the regex module runs into its timeout.
    g = within(
        10, lambda: parse_check({"type": "regex", "pattern": "(x+x+)+y"}).grade(Answer("x" * 5000))
    )
    assert not g.passed and g.reason.startswith("checker error") and "backtracking" in g.reason
    assert time.monotonic() - started < 10


def test_a_checker_past_its_time_is_killed_and_the_next_answer_graded() -> None:
    # uniqueItems compares every pair of items, in jsonschema's own code: no timeout there.
    spec = {"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}}
    text = json.dumps([{"k": i} for i in range(60_000)])  # within the size cap
    with Grader(time_s=1.0) as grader:
        started = time.monotonic()
        g = within(20, lambda: grader.grade(spec, Answer(text)))
        assert time.monotonic() - started < 10
        assert not g.passed
        assert g.reason == "checker error: timed out after 1 s"
        assert g.detail == {"checker_error": "timeout"}
        assert grader.grade(spec, Answer('["a", "b"]')).passed  # a fresh worker


def test_a_batch_is_graded_in_order_and_a_slow_answer_fails_alone() -> None:
    """``grade_many`` writes requests ahead of the worker's replies: the answer past its time
    fails, its worker is killed, and a fresh one grades every answer after it, in order."""
    slow = {"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}}
    exact = {"type": "exact", "value": "x"}
    text = json.dumps([{"k": i} for i in range(60_000)])
    after = [Job(Answer("x" if i % 3 else "y"), spec=exact) for i in range(300)]
    jobs = [Job(Answer("x"), spec=exact)] * 3 + [Job(Answer(text), spec=slow), *after]
    with Grader(time_s=1.0) as grader:
        grades = within(60, lambda: grader.grade_many(jobs))
    assert len(grades) == len(jobs)
    assert all(g.passed for g in grades[:3])
    assert grades[3].detail == {"checker_error": "timeout"}
    assert [g.passed for g in grades[4:]] == [i % 3 != 0 for i in range(300)]


def counting(grader: Grader) -> list[int]:
    """How many requests each exchange with ``grader``'s worker asks, as they happen."""
    asked: list[int] = []
    exchange = grader._exchange_many

    def counted(requests: Any) -> list[Grade]:
        asked.append(len(requests))
        return exchange(requests)

    grader._exchange_many = counted  # type: ignore[method-assign]
    return asked


def test_a_repeated_request_is_asked_of_the_worker_once() -> None:
    """Identical (check, answer) requests share the worker's grade, in a batch and after it;
    a timed-out one is asked again, since its grade describes the worker, not the answer."""
    exact = {"type": "exact", "value": "x"}
    slow = {"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}}
    text = json.dumps([{"k": i} for i in range(60_000)])
    jobs = [Job(Answer("x" if i % 2 else "y"), spec=exact) for i in range(10)]
    with Grader(time_s=1.0) as grader:
        asked = counting(grader)
        first = grader.grade_many(jobs)
        again = grader.grade_many([*jobs, Job(Answer(text), spec=slow)])
        late = within(30, lambda: grader.grade(slow, Answer(text)))
    assert [g.passed for g in first] == [i % 2 == 1 for i in range(10)]
    assert again[:10] == first
    assert again[10].detail == late.detail == {"checker_error": "timeout"}
    assert asked == [2, 1, 1]


def test_a_grader_keeps_as_many_grades_as_it_is_told() -> None:
    """``kept`` bounds the grades a Grader remembers (oldest out): a request asked again after
    its grade went is asked of the worker again. Requests whose replies are the same share
    one ``Grade``."""
    exact = {"type": "exact", "value": "x"}
    jobs = [Job(Answer(text), spec=exact) for text in ("x", " x", "X")]  # each an exact match
    with Grader(kept=2) as grader:
        asked = counting(grader)
        first = grader.grade_many(jobs)
        grader.grade_many(jobs[2:])  # kept: not asked
        grader.grade_many(jobs[:1])  # the oldest, gone: asked again
    assert asked == [3, 1]
    assert all(g.passed for g in first)
    assert first[0] is first[1] is first[2]  # one reply said thrice: one grade


def test_quadratic_unique_items_is_bounded() -> None:
    spec = {"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}}
    text = json.dumps([{"k": i} for i in range(100_000)])
    with Grader(time_s=1.0) as grader:
        g = within(20, lambda: grader.grade(spec, Answer(text)))
    assert not g.passed and g.reason.startswith("checker error")


def test_whitespace_inside_a_tool_call_tag_is_linear() -> None:
    spec = {"type": "tool_call", "calls": [{"name": "f", "arguments": {}}]}
    text = "<tool_call>" + " " * 200_000 + "x"
    g = within(5, lambda: parse_check(spec).grade(Answer(text)))
    assert not g.passed and "no tool call" in g.reason


# -- size and errors ------------------------------------------------------------------------


def test_an_answer_over_the_size_cap_is_failed_unread() -> None:
    with Grader(max_chars=1000) as grader:
        g = grader.grade({"type": "contains", "values": ["x"]}, Answer("x" * 1001))
        assert not g.passed and g.detail == {"checker_error": "size"}
        assert "answer too long to grade: 1,001 characters (the limit is 1,000)" in g.reason
        calls = (ToolCall(0, "c", "f", "y" * 1000),)
        g = grader.grade({"type": "tool_call", "calls": [{"name": "f"}]}, Answer("", calls))
        assert g.detail == {"checker_error": "size"}  # tool-call arguments count too
        assert grader.grade({"type": "contains", "values": ["x"]}, Answer("x" * 1000)).passed


def test_whatever_a_checker_raises_is_the_answers_grade() -> None:
    class Broken:
        kind = "broken"

        def grade(self, answer: Answer) -> Grade:
            raise RecursionError("maximum recursion depth exceeded")

    g = grade_safely(Broken(), Answer("x"))
    assert (g.passed, g.reason) == (
        False,
        "checker error: RecursionError: maximum recursion depth exceeded",
    )


def test_grading_a_run_never_raises_and_notes_checker_errors() -> None:
    specs = {
        "deep": {"type": "json_schema", "schema": {"type": "object"}},
        "bad": {"type": "no-such-checker"},
        "slow": {
            "type": "json_schema",
            "schema": {"type": "array", "items": {"type": "string", "pattern": "(x+x+)+y"}},
        },
        "big": {"type": "exact", "value": "x"},
        "ok": {"type": "exact", "value": "x"},
    }
    texts = {
        "deep": DEEP,
        "bad": "x",
        "slow": '["' + "x" * 5000 + '"]',
        "big": "x" * 2_000_000,
        "ok": "x",
    }
    results = [result(k, texts[k], target=t) for k in specs for t in ("a", "b")]
    with Grader(time_s=1.0) as grader:
        rows = within(
            60, lambda: grade_rows(results, {k: Spec(k, v) for k, v in specs.items()}, "a", grader)
        )
    grades = {(r["target"], r["request_id"]): r["grade"] for r in rows}
    assert grades[("a", "ok")]["passed"] and grades[("b", "ok")]["passed"]
    assert not any(g["passed"] for (_, k), g in grades.items() if k != "ok")
    assert {g["detail"].get("checker_error") for (_, k), g in grades.items() if k != "ok"} == {
        None,
        "exception",
        "timeout",
        "size",
    }
    from replay.analysis.grading.quality import assess_quality

    notes = assess_quality(rows, [], "a", ["<256"]).notes
    assert any(n.startswith("b: 3 answer(s) failed with a checker error") for n in notes), notes


# -- re-analysis from the run directory -------------------------------------------------------


CHECKS = [
    {"type": "contains", "values": ["abc"]},
    {"type": "exact", "value": "nope"},
    {"type": "regex", "pattern": "(a+)+$"},
    {"type": "json_schema", "schema": {"type": "object"}},
]


def _replay(tmp_path: Path) -> Path:
    """A finished two-target replay against the fake server (which answers "abc")."""
    trace_path = tmp_path / "trace.jsonl"
    trace_path.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"r{i}",
                    "task": "chat",
                    "max_tokens": 8,
                    "check": CHECKS[i % len(CHECKS)],
                    "messages": [{"role": "user", "content": f"question {i}"}],
                }
            )
            + "\n"
            for i in range(8)
        )
    )
    trace = load(trace_path)
    with fault_server("split") as server:
        cfg = run_config(
            trace=trace,
            trace_path=trace_path,
            trace_format="v1",
            targets=[
                TargetSpec(name="ref", url=server.url),
                TargetSpec(name="cand", url=server.url),
            ],
            schedules=[ClosedLoop(2)],
            quality=QualitySpec(buckets="256,1K", teacher_forced=False, reference="ref"),
            run_dir=new_run_dir(tmp_path / "reports"),
            cli_options={"targets": "ref=x,cand=y", "tolerance": 0.05},
            load={"timeout_s": 5.0},
        )
        asyncio.run(Runner(cfg).run())
    return cfg.run_dir


def _comparable(summary: dict[str, Any]) -> dict[str, Any]:
    return orjson.loads(orjson.dumps(summary, option=orjson.OPT_SERIALIZE_NUMPY))


def test_report_rebuilds_a_missing_summary_from_the_results(tmp_path: Path) -> None:
    run_dir = _replay(tmp_path)
    original = read_json(run_dir / "summary.json")
    grades = (run_dir / "grades.jsonl").read_text()
    assert original["quality"]["phases"]["c2"]["cand"]["all"]["graded"] == 8
    (run_dir / "summary.json").unlink()
    (run_dir / "grades.jsonl").unlink()

    out = CliRunner().invoke(main, ["report", str(run_dir)])
    assert out.exit_code == 0, out.output
    assert (run_dir / "report.html").exists() and (run_dir / "report.md").exists()
    rebuilt = read_json(run_dir / "summary.json")
    assert _comparable(rebuilt) == _comparable(original)
    assert (run_dir / "grades.jsonl").read_text() == grades


def test_reanalysis_of_a_run_killed_inside_a_phase(tmp_path: Path) -> None:
    run_dir = _replay(tmp_path)
    (run_dir / "summary.json").unlink()
    manifest = read_json(run_dir / "manifest.json")
    for t in manifest["targets"].values():
        t["phases"] = {}  # killed before any phase ended: no windows recorded
        t["status"] = "pending"
    (run_dir / "manifest.json").write_bytes(orjson.dumps(manifest))
    with (run_dir / "results.jsonl").open("ab") as fh:
        fh.write(b'{"request_id": "r9", "tar')  # the line being written when it died
    summary = reanalyse(run_dir)
    for name in ("ref", "cand"):
        phase = summary["targets"][name]["phases"]["c2"]
        assert phase["all"]["requests"] == 8
        assert summary["quality"]["phases"]["c2"][name]["all"]["graded"] == 8
    assert "verdict" in summary


def test_reanalysis_needs_the_runs_own_trace(tmp_path: Path) -> None:
    run_dir = _replay(tmp_path)
    (run_dir / "summary.json").unlink()
    trace = tmp_path / "trace.jsonl"
    moved = tmp_path / "moved.jsonl"
    trace.rename(moved)
    out = CliRunner().invoke(main, ["report", str(run_dir)])
    assert out.exit_code == 2 and "--trace" in out.output
    changed = tmp_path / "changed.jsonl"
    changed.write_text(moved.read_text().replace("question 1", "question one"))
    out = CliRunner().invoke(main, ["report", str(run_dir), "--trace", str(changed)])
    assert out.exit_code == 2 and "sha256" in out.output
    out = CliRunner().invoke(main, ["report", str(run_dir), "--trace", str(moved)])
    assert out.exit_code == 0, out.output
    assert (run_dir / "summary.json").exists()


def test_report_on_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    out = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert out.exit_code == 2 and "no manifest.json" in out.output


def test_one_grader_serves_concurrent_callers() -> None:
    """Locust's users grade from several greenlets at once: each caller must get the reply to
    its own request (interleaved exchanges on the worker's pipes were read as each other's)."""
    from concurrent.futures import ThreadPoolExecutor

    spec = {"type": "exact", "value": "yes"}
    answers = ["yes" if i % 2 else f"no {i}" for i in range(64)]
    with Grader() as grader, ThreadPoolExecutor(8) as pool:
        grades = list(pool.map(lambda a: grader.grade(spec, Answer(a)), answers))
    assert [g.passed for g in grades] == [a == "yes" for a in answers]
    assert all("checker error" not in g.reason for g in grades)
    assert all(a in g.reason for a, g in zip(answers, grades, strict=True) if a != "yes")
