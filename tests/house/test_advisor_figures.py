"""The KV-format advisor's tables in docs/kvcal.md are what bench/advisor.py renders from the
committed reports, so every figure there is one a run of ``kvcal emulate`` recorded."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import advisor


def test_the_docs_blocks_are_what_the_reports_render() -> None:
    text = advisor.DOC.read_text(encoding="utf-8")
    results = advisor.load()
    assert {"embedded", "twin", "real"} <= set(results)
    assert advisor.rewrite(text, results) == text, "run: python bench/advisor.py"


def test_the_recorded_commands_hold_no_output_file_of_the_machine() -> None:
    argv = [
        "kvcal",
        "emulate",
        "real",
        "--json",
        "/tmp/a.json",
        "--markdown",
        "/x/a.md",
        "--rounding",
        "both",
    ]
    assert advisor.user_command(argv) == "kvcal emulate real --rounding both"
    for path in advisor.RESULTS.glob("advisor_*.json"):
        raw = path.read_text(encoding="utf-8")
        assert "/tmp/" not in raw and "/root/" not in raw and "/home/" not in raw, path.name


def test_a_doc_without_a_models_markers_is_refused() -> None:
    results = advisor.load()
    with pytest.raises(ValueError, match=r"no '<!-- generated: bench/advisor\.py embedded"):
        advisor.rewrite("# kvcal\n", {"embedded": results["embedded"]})
