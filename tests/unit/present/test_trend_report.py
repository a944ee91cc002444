"""The trend across context length in the reports and the terminal: each compared target's
slope per doubling of context, for its pass-rate difference and its teacher-forced ΔNLL, with
the A/A control's beside it, in words."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from replay.analysis.grading.quality import assess_quality
from replay.analysis.schemas import Summary
from replay.analysis.schemas.manifest import Manifest
from replay.analysis.verdict.facts import facts_from_run
from replay.analysis.verdict.rule import decide
from replay.present import report
from replay.present.table import quality_table
from replay.rundir.files import write_json
from tests.unit.present.test_report import BUCKETS, make_run_dir, sections

SLOPE = r"[+-]\d+\.\d \[[+-]\d+\.\d, [+-]\d+\.\d\]"
POINTS = r"[+-]\d+\.\d points per doubling of context \[[+-]\d+\.\d, [+-]\d+\.\d\]"
NLL = r"[+-]\d\.\d{3}/token per doubling of context \[[+-]\d\.\d{3}, [+-]\d\.\d{3}\]"


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def trend_run(tmp_path: Path) -> Path:
    """``make_run_dir``'s run, its quality analysed with the prompts' lengths: fp8's
    teacher-forced NLL grows with the prompt (the control's does not)."""
    run = make_run_dir(tmp_path, unlabeled=10)
    results = _lines(run / "results.jsonl")
    tokens = {r["request_id"]: float(r["prompt_tokens"]) for r in results if r["target"] == "bf16"}
    tf = [
        {
            "target": r["target"],
            "request_id": r["request_id"],
            "n": 2,
            "nll": [0.1 + (1e-4 * tokens[r["request_id"]] if r["target"] == "fp8" else 0.0)] * 2,
            "top1": [True, True],
            "error": None,
        }
        for r in results
    ]
    summary = orjson.loads((run / "summary.json").read_bytes())
    grades = _lines(run / "grades.jsonl")
    q = assess_quality(grades, tf, "bf16", BUCKETS, prompt_tokens=tokens)
    summary["quality"] = q.to_json()
    manifest = Manifest.from_json(orjson.loads((run / "manifest.json").read_bytes()))
    facts = facts_from_run(Summary.from_json(summary), manifest, candidate="fp8")
    summary["verdict"] = decide(facts).to_json()
    write_json(run / "summary.json", summary)
    return run


def test_the_quality_section_says_each_trend_with_the_controls(tmp_path: Path) -> None:
    run = trend_run(tmp_path)
    s = sections(report.render_html(run))
    text = " ".join(s.text["quality"].split())
    assert "Trend across context length" in text
    assert re.search(f"fp8's pass-rate difference changes by {POINTS}", text)
    assert re.search(f"fp8's teacher-forced ΔNLL changes by {NLL}", text)
    assert re.search(r"the A/A control's: \+0\.000 \[\+0\.000, \+0\.000\]", text)
    assert "bf16-control's" not in text  # its own trend is every target's floor, not a line
    md = report.render_markdown(run)
    assert "Trend across context length, per doubling of the prompt's tokens:" in md
    assert re.search(f"- fp8's teacher-forced ΔNLL changes by {NLL}", md)


def test_the_terminal_table_has_a_trend_row(tmp_path: Path) -> None:
    run = trend_run(tmp_path)
    q = Summary.from_json(orjson.loads((run / "summary.json").read_bytes())).quality
    assert q is not None
    console = Console(width=400, record=True)
    console.print(quality_table(q))
    rows = [line for line in console.export_text().splitlines() if "trend per doubling" in line]
    assert len(rows) == 2  # fp8 and the control; never the reference
    fp8 = next(r for r in rows if "fp8" in r)
    assert re.search(SLOPE, fp8) and re.search(r"[+-]\d\.\d{4} \[", fp8) and "(A/A +0.0000)" in fp8


def test_a_summary_written_before_the_trend_shows_no_trend(tmp_path: Path) -> None:
    run = make_run_dir(tmp_path)
    text = sections(report.render_html(run)).text["quality"]
    assert "Trend across context length" not in text
    assert "Trend across context length" not in report.render_markdown(run)
