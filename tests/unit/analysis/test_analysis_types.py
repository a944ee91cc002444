"""The analysis records: summary.json in and out, unchanged, and the pipeline that fills them.

The goldens in tests/data/analysis/ were written by the analysis before it passed typed
records (``tests/support/analysis_run.py`` builds the run): every summary.json byte and every grade
must come out the same, and every summary.json must read back into the records and out again
as the same JSON.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from replay.analysis.schemas import (
    OMITTED,
    BucketQuality,
    Combined,
    Percentiles,
    Summary,
    SummaryError,
    TargetSummary,
)
from replay.analysis.schemas.manifest import Manifest
from replay.cli import main
from replay.pipeline import analyse as analyze
from replay.pipeline.analyse import analyse
from replay.present import report
from replay.rundir.files import write_json
from tests.support import analysis_run
from tests.support.analysis_run import GOLDEN, SORTED
from tests.unit.present.test_report import make_run_dir

GOLDENS = ["run_summary.json", "locust_summary.json"]


def _golden(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = orjson.loads((GOLDEN / name).read_bytes())
    return doc


def _bytes(doc: Any) -> bytes:
    return orjson.dumps(doc, option=SORTED)


@pytest.mark.parametrize("name", GOLDENS)
def test_a_summary_written_before_the_records_reads_back_byte_for_byte(name: str) -> None:
    raw = (GOLDEN / name).read_bytes()
    summary = Summary.from_json(orjson.loads(raw))
    assert _bytes(summary.to_json()) == raw


def test_the_report_fixtures_summaries_read_back_too(tmp_path: Path) -> None:
    for unlabeled in (0, 10):
        run = make_run_dir(tmp_path / str(unlabeled), unlabeled=unlabeled)
        raw = orjson.loads((run / "summary.json").read_bytes())
        assert _bytes(Summary.from_json(raw).to_json()) == _bytes(raw)


def test_the_pipeline_writes_what_it_wrote_before(tmp_path: Path) -> None:
    summary = analyse(*analysis_run.analysis(tmp_path / "run"))
    written = orjson.loads((tmp_path / "run" / "summary.json").read_bytes())
    assert written.pop("run_dir") == str(tmp_path / "run")
    assert _bytes(written) == (GOLDEN / "run_summary.json").read_bytes()
    assert (tmp_path / "run" / "grades.jsonl").read_bytes() == (
        GOLDEN / "run_grades.jsonl"
    ).read_bytes()
    assert (
        _bytes({k: v for k, v in summary.to_json().items() if k != "run_dir"})
        == (GOLDEN / "run_summary.json").read_bytes()
    )
    # In memory the run's order, not the file's sorted keys.
    fp8 = summary.targets["fp8"].phases["c1"]
    assert list(fp8.buckets) == ["<256", "256-1K", ">=1K", "unlisted"]
    assert summary.verdict is not None and summary.verdict.exit_code == 13

    locust = analyse(*analysis_run.locust_analysis(tmp_path / "locust"))
    assert locust.quality is None and locust.verdict is None
    assert locust.driver == {"name": "locust", "version": "2.x"}
    written = orjson.loads((tmp_path / "locust" / "summary.json").read_bytes())
    written.pop("run_dir")
    assert _bytes(written) == (GOLDEN / "locust_summary.json").read_bytes()


def test_grading_says_how_it_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The analysis tells its caller how many answers are graded, a batch at a time and at
    the end, and writes what it writes untold."""
    monkeypatch.setattr(analyze, "GRADE_BATCH", 50)
    told: list[tuple[int, int]] = []
    case = analysis_run.analysis(tmp_path / "run")
    sources = dataclasses.replace(case.sources, progress=lambda k, n: told.append((k, n)))
    analyse(case.run_dir, case.manifest, sources)
    n = len(analysis_run.results())
    assert told == [(50, n), (100, n), (150, n), (200, n), (n, n)]
    assert (tmp_path / "run" / "grades.jsonl").read_bytes() == (
        GOLDEN / "run_grades.jsonl"
    ).read_bytes()


def test_keys_left_out_stay_left_out() -> None:
    """The reference and its control have no combined comparison (the key is absent), a
    candidate bucket without pairs has null; a Locust summary has no quality at all."""
    s = Summary.from_json(_golden("run_summary.json"))
    assert s.quality is not None
    c1 = s.quality.phases["c1"]
    assert c1["bf16"].buckets["<256"].combined is OMITTED
    assert isinstance(c1["fp8"].buckets["<256"].combined, Combined)
    assert "combined" not in c1["bf16"].buckets["<256"].to_json()
    locust = Summary.from_json(_golden("locust_summary.json")).to_json()
    assert set(locust) == {"version", "targets", "driver"}


def test_an_older_summary_reads_its_missing_keys_as_missing() -> None:
    doc = _golden("run_summary.json")
    row = doc["quality"]["phases"]["c1"]["fp8"]["buckets"]["<256"]
    for key in ("derived", "combined", "noise_floor", "evidence"):
        del row[key]
    del doc["quality"]["alpha"]
    del doc["targets"]["fp8"]["phases"]["c1"]["all"]["ttft_ms"]
    s = Summary.from_json(doc)
    assert s.quality is not None and s.quality.alpha is None
    bucket = s.quality.phases["c1"]["fp8"].buckets["<256"]
    assert (bucket.derived, bucket.combined, bucket.noise_floor, bucket.evidence) == (
        None,
        OMITTED,
        OMITTED,
        None,
    )
    assert s.targets["fp8"].phases["c1"].all.ttft_ms == Percentiles(
        mean=None, p50=None, p90=None, p99=None
    )
    back = bucket.to_json()
    assert not {"derived", "combined", "noise_floor", "evidence"} & set(back)


@pytest.mark.parametrize(
    ("path", "junk", "message"),
    [
        (
            ("targets", "fp8", "phases", "c1", "buckets", "<256", "requests"),
            "12",
            "targets.fp8.phases.c1.buckets.<256.requests: expected an integer, got '12'",
        ),
        (
            ("quality", "phases", "c4", "fp8", "buckets", "256-1K", "wilson"),
            [0.1],
            "quality.phases.c4.fp8.buckets.256-1K.wilson: expected a list of 2, got [0.1]",
        ),
        (("systems", "latency_better"), 1, "systems.latency_better: expected true or false"),
        (("verdict", "reasons"), "one", "verdict.reasons: expected a list, got 'one'"),
        (
            ("targets", "bf16", "phases", "c1"),
            None,
            "targets.bf16.phases.c1: expected an object, got None",
        ),
    ],
)
def test_a_wrong_type_is_an_error_naming_the_field(
    path: tuple[str, ...], junk: Any, message: str
) -> None:
    doc = _golden("run_summary.json")
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = junk
    with pytest.raises(
        SummaryError,
        match="^summary.json: "
        + message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\."),
    ):
        Summary.from_json(doc, where="summary.json")
    # Leniently (the report), the problem is noted and the value reads as missing.
    problems: list[str] = []
    Summary.from_json(doc, where="summary.json", problems=problems)
    assert len(problems) == 1 and message in problems[0]


def test_lenient_reading_keeps_everything_else() -> None:
    doc = _golden("run_summary.json")
    doc["targets"]["fp8"]["phases"]["c1"]["buckets"]["<256"]["ttft_ms"] = "fast"
    doc["targets"]["fp8"]["phases"]["c1"]["buckets"]["256-1K"] = [1, 2]
    doc["verdict"]["evidence"][0] = "x"
    problems: list[str] = []
    s = Summary.from_json(doc, problems=problems)
    assert len(problems) == 3, problems
    phase = s.targets["fp8"].phases["c1"]
    assert phase.buckets["<256"].ttft_ms.p50 is None and phase.buckets["<256"].requests == 9
    assert "256-1K" not in phase.buckets and ">=1K" in phase.buckets
    assert s.verdict is not None and len(s.verdict.evidence) == 11
    assert Summary.from_json("junk", problems=problems).targets == {}


def test_the_verdict_and_report_read_records_and_json_alike(tmp_path: Path) -> None:
    from replay.analysis.verdict.facts import facts_from_run

    doc = _golden("run_summary.json")
    typed = Summary.from_json(doc)
    manifest = Manifest.from_json(analysis_run.manifest())
    # The record, written as JSON and read back, gives the verdict the same facts.
    written = Summary.from_json(json.loads(json.dumps(typed.to_json())))
    assert facts_from_run(written, manifest, candidate="fp8") == facts_from_run(
        typed, manifest, candidate="fp8"
    )
    target = TargetSummary.from_json(doc["targets"]["fp8"])
    assert target.phases["c1"].all.errors_by_kind == {"timeout": 1}
    row = typed.quality.phases["c1"]["fp8"].buckets["256-1K"]  # type: ignore[union-attr]
    assert isinstance(row, BucketQuality) and row.derived is not None
    assert row.derived.by_rule["derived:json"].passed == 1


def test_replay_report_renders_a_summary_written_before_the_records(tmp_path: Path) -> None:
    run = tmp_path / "run"
    analyse(*analysis_run.analysis(run))
    (run / "summary.json").write_bytes((GOLDEN / "run_summary.json").read_bytes())
    write_json(run / "manifest.json", {**analysis_run.manifest(), "trace": {"path": "gone"}})
    out = CliRunner().invoke(main, ["report", str(run)])
    assert out.exit_code == 0, out.output
    html = report.render_html(run)
    assert "Problems reading this run" not in html and "could not be rendered" not in html
    assert "INSUFFICIENT EVIDENCE" in html


def test_report_lists_a_wrong_value_as_a_problem(tmp_path: Path) -> None:
    run = make_run_dir(tmp_path)
    doc = json.loads((run / "summary.json").read_text())
    doc["targets"]["fp8"]["phases"]["c1"]["all"]["requests"] = "many"
    write_json(run / "summary.json", doc)
    html = report.render_html(run)
    assert "targets.fp8.phases.c1.all.requests: expected an integer, got &#39;many&#39;" in html
    assert "could not be rendered" not in html


def test_replay_compare_names_the_bad_field(tmp_path: Path) -> None:
    a = make_run_dir(tmp_path / "a")
    b = make_run_dir(tmp_path / "b")
    doc = json.loads((b / "summary.json").read_text())
    doc["quality"]["phases"]["c1"]["fp8"]["buckets"]["<256"]["pass_rate"] = "high"
    write_json(b / "summary.json", doc)
    out = CliRunner().invoke(main, ["compare", str(a), str(b)])
    assert out.exit_code == 2
    assert "quality.phases.c1.fp8.buckets.<256.pass_rate: expected a number" in " ".join(
        out.output.split()
    )
