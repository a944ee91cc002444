"""bench/README.md's figures table is what bench/tables.py generates from the committed
results, so no figure there lacks a run behind it."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import tables


def test_the_readme_block_is_what_the_results_generate() -> None:
    text = tables.README.read_text(encoding="utf-8")
    assert tables.rewrite(text, tables.generate()) == text, "run: python bench/tables.py"


def test_every_committed_results_file_has_a_row_with_its_date() -> None:
    table = tables.generate()
    for path in sorted(tables.RESULTS.glob("*.json")):
        date, _ = tables.machine_of(orjson.loads(path.read_bytes()))
        assert f"| {path.name} |" in table
        assert date != "?", path.name


def test_a_figure_comes_from_its_file(tmp_path: Path) -> None:
    doc = {
        "machine": {"date": "2026-12-02T01:00:00+00:00", "cpu_model": "Test CPU", "nproc": 4},
        "config": {"rate_rps": 1000.0, "duration_s": 30.0, "workers": 1},
        "summary": {
            "lag_ms": {"p50": 0.1234, "p99": 0.9876, "max": 3.5},
            "met": True,
            "target": "lag p99 <= 1 ms",
        },
    }
    (tmp_path / "open_loop.json").write_bytes(orjson.dumps(doc))
    table = tables.generate(tmp_path)
    assert "p50 0.123, p99 0.988, max 3.500 (met)" in table
    assert "| 2026-12-02 01:00 | Test CPU, 4 CPUs |" in table


def test_a_readme_without_the_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="no '<!-- generated"):
        tables.rewrite("# bench\n", "| table |\n")


def test_the_readme_opening_block_is_what_the_first_runs_recorded() -> None:
    import first_run

    text = first_run.README.read_text(encoding="utf-8")
    assert first_run.readme_text() == text, "run: python bench/first_run.py --readme"
