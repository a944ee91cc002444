"""The run as data: replay.load_run gives results, grades, metrics and teacher-forced scores as
DataFrames, and `replay export` writes the same tables as CSV or Parquet. The run directory is a
real replay's (against the in-process fake server: the tables' shape does not depend on which
server answered)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

import replay
from replay.cli import main
from replay.core.errors import InputError
from replay.rundir import rundata
from replay.rundir.files import read_results
from tests.conftest import ROOT
from tests.support.fault_server import fault_server

TRACE = ROOT / "traces" / "sample.jsonl"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    with fault_server("split") as good:
        res = CliRunner().invoke(
            main,
            [
                "--trace",
                str(TRACE),
                "--targets",
                f"fp8={good.url}",
                "--buckets",
                "256,1K",
                "--out",
                str(out),
                "--run-id",
                "run",
                "--limit",
                "12",
            ],
        )
    assert res.exit_code == 0, res.output
    return out / "run"


def test_load_run_gives_one_row_per_result_with_named_timings(run_dir: Path) -> None:
    run = replay.load_run(run_dir)
    saved = list(read_results(run_dir))
    assert len(run.results) == len(saved) == 12
    by_id = {r.request_id: r for r in saved}
    for row in run.results.itertuples():
        r = by_id[row.request_id]
        assert row.ttft_s == pytest.approx(r.ttft) and row.output_tokens == r.output_tokens
        assert row.chunks == len(r.chunk_times)
    assert set(run.results["status"]) == {"ok"}
    # Grades: one row per result; the sample's checks are flattened into named columns.
    assert len(run.grades) == 12 and run.grades["grade_passed"].notna().sum() >= 10
    assert {"derived_rule", "agree_exact"} <= set(run.grades.columns)
    # Metrics: every scrape of the target, histogram sums and counts as columns.
    scrapes = (run_dir / "metrics" / "fp8.jsonl").read_text().count("\n")
    assert len(run.metrics) == scrapes >= 2 and set(run.metrics["target"]) == {"fp8"}
    assert run.results.groupby("bucket")["e2e_s"].median().notna().all()


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_export_writes_the_same_tables(run_dir: Path, tmp_path: Path, fmt: str) -> None:
    if fmt == "parquet":
        pytest.importorskip("pyarrow", reason="parquet export comes with the data extra")
    run = replay.load_run(run_dir)
    out = tmp_path / fmt
    res = CliRunner().invoke(main, ["export", str(run_dir), "--format", fmt, "-o", str(out)])
    assert res.exit_code == 0, res.output
    for name, frame in run.tables().items():
        path = out / f"{name}.{fmt}"
        back = pd.read_csv(path) if fmt == "csv" else pd.read_parquet(path)
        assert list(back.columns) == list(frame.columns) and len(back) == len(frame)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_export_writes_a_table_a_few_rows_at_a_time(
    run_dir: Path, tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Export holds ``EXPORT_ROWS`` rows at a time: written in pieces of 5, each table reads
    back as ``load_run`` gives it, value for value, and a whole number is written whole (in
    CSV too, where some rows have none)."""
    if fmt == "parquet":
        pytest.importorskip("pyarrow", reason="parquet export comes with the data extra")
    monkeypatch.setattr(rundata, "EXPORT_ROWS", 5)
    run = replay.load_run(run_dir)
    out = tmp_path / fmt
    rundata.export_run(run_dir, out, fmt)
    for name, frame in run.tables().items():
        path = out / f"{name}.{fmt}"
        back = pd.read_csv(path) if fmt == "csv" else pd.read_parquet(path)
        assert list(back.columns) == list(frame.columns) and len(back) == len(frame)
        for column in frame.columns:
            want, got = frame[column].astype(object), back[column].astype(object)
            for w, g in zip(want, got, strict=True):
                assert (pd.isna(w) and pd.isna(g)) or w == g or str(w) == str(g), (name, column)
    results = (out / "results.csv").read_text() if fmt == "csv" else ""
    assert ",200," in results or fmt == "parquet"  # http_status, not 200.0
    # A whole number stays whole in a piece where some rows have none.
    rows = [{"target": "a", "http_status": 200}, {"target": "b", "http_status": None}]
    (piece,) = rundata._typed_chunks(rows, {"target": "text", "http_status": "int"})
    assert piece.to_csv(index=False) == "target,http_status\na,200\nb,\n"


def test_not_a_run_directory_is_bad_input(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="is this a kvcanary run directory"):
        replay.load_run(tmp_path)
    res = CliRunner().invoke(main, ["export", str(tmp_path)])
    assert res.exit_code == 2 and "kvcanary run directory" in res.output


def test_a_run_without_grades_or_scores_gives_empty_tables(run_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "manifest.json").write_text(json.dumps({"targets": {}}))
    (bare / "results.jsonl").write_text((run_dir / "results.jsonl").read_text())
    run = replay.load_run(bare)
    assert len(run.results) == 12 and run.grades.empty and run.metrics.empty
    assert list(run.teacher_forced.columns)[:2] == ["target", "request_id"]
