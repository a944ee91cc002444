"""The report's scan of results.jsonl, and the same scan read off the results' columns
(``replay report --reanalyse`` hands the report the results the analysis read)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from replay.pipeline.analyse import results_table
from replay.present import report
from replay.present.run_scan import scan_run
from tests.support.analysis_run import results
from tests.unit.present.test_report import make_run_dir


@pytest.mark.parametrize("cut_short", [False, True])
def test_report_from_the_analysis_columns(tmp_path: Path, cut_short: bool) -> None:
    """Two phases, four arms, failed and cancelled requests (one after its first tokens), a
    request answered twice in a phase, an answer without a first token: the scan off the
    columns is the line-by-line scan, and so is what it says of a last line a kill cut
    short."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = results()
    rows[5].first_token = None  # answered, no first token stamped: no TTFT
    cut = next(r for r in rows if r.status != "ok")  # failed after its first tokens
    assert cut.sent is not None
    cut.first_token = cut.sent + 0.1
    cut.chunk_times, cut.chunk_tokens = [cut.sent + 0.1, cut.sent + 0.2], [1, 1]
    lines = b"".join(orjson.dumps(r.to_json()) + b"\n" for r in rows)
    (run_dir / "results.jsonl").write_bytes(lines + (b'{"request_id": "q' if cut_short else b""))
    by_lines: list[str] = []
    by_columns: list[str] = []
    want = scan_run(run_dir, "bf16", by_lines)
    got = scan_run(run_dir, "bf16", by_columns, results_table(run_dir))
    assert got == want
    assert by_columns == by_lines == (["results.jsonl: 1 unreadable line(s) skipped"] * cut_short)
    assert want.latency and any(not f.error for f in want.requests.values())
    assert any(f.error for f in want.requests.values())


def test_the_report_is_the_same_either_way(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path)
    html, md = report.write_reports(run_dir)
    by_lines = html.read_bytes(), md.read_bytes()
    report.write_reports(run_dir, results_table(run_dir))
    assert (html.read_bytes(), md.read_bytes()) == by_lines
