"""Traffic without labels, on real vLLM CPU servers: every request of the trace has its `check`
removed, so each answer is graded against the reference's answer to the same request (derived
grades), with the A/A control that `canary` turns on for them. A BF16 candidate that truly
answers differently (the embedded model served with `rms_norm_eps` 1.0 instead of 1e-5: most
answers change, some stay right) is found out by its derived grades; the reference's own
server under another name is not. Runs on every machine: both targets serve a BF16 cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from replay.serving.local_server import LocalServer
from replay.serving.targets import DEFAULT_MODEL_ARGS
from tests.conftest import ROOT

pytestmark = pytest.mark.vllm

FIRST_RUN = ROOT / "traces" / "first_run.jsonl"


@pytest.fixture(scope="module")
def unlabeled_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every third request of the first-run trace (all task families, all three buckets) with
    its check and task removed, as production traffic comes."""
    out = tmp_path_factory.mktemp("trace") / "unlabeled.jsonl"
    lines = FIRST_RUN.read_text().splitlines()
    with out.open("w") as fh:
        for line in lines[::3]:
            rec = json.loads(line)
            rec.pop("check", None)
            rec.pop("task", None)
            fh.write(json.dumps(rec) + "\n")
    return out


def canary(trace: Path, targets_toml: str, out: Path) -> tuple[int, dict[str, Any]]:
    tf = out / "targets.toml"
    tf.write_text(targets_toml)
    cmd = [
        sys.executable,
        "-m",
        "replay.cli",
        "canary",
        "--trace",
        str(trace),
        "--targets-file",
        str(tf),
        "--targets",
        "bf16,other",
        "--buckets",
        "256,1K",
        "--no-teacher-forced",
        "--out",
        str(out),
        "--run-id",
        "run",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    summary = out / "run" / "summary.json"
    assert summary.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, json.loads(summary.read_text())


def _derived_rows(summary: dict[str, Any], target: str) -> dict[str, dict[str, Any]]:
    (phase,) = summary["quality"]["phases"].values()
    return phase[target]["buckets"]


def test_a_candidate_that_answers_differently_is_found_by_derived_grades(
    bf16_server: LocalServer, model_dir: Path, unlabeled_trace: Path, tmp_path: Path
) -> None:
    args = json.dumps([*DEFAULT_MODEL_ARGS, "--hf-overrides", '{"rms_norm_eps": 1.0}'])
    code, summary = canary(
        unlabeled_trace,
        f"""
[targets.bf16]
url = "{bf16_server.url}"
expect_cache_dtype = "auto"
[targets.other]
model = "{model_dir}"
args = {args}
role = "candidate"
""",
        tmp_path,
    )
    verdict = summary["verdict"]
    assert verdict["verdict"] in ("calibrate", "reject") and code in (10, 12), verdict
    assert "bf16-control" in summary["targets"]  # on by default: the trace has no checks
    buckets = _derived_rows(summary, "other")
    assert set(buckets) == {"<256", "256-1K", ">=1K"}
    losses = []
    for b, row in buckets.items():
        derived, combined = row["derived"], row["combined"]
        # Every pair is derived, judged against the control's agreement with the reference.
        assert combined["explicit"] == 0 and combined["derived"] == combined["pairs"] > 0
        assert combined["baseline"] == "control" and derived["vs_control"]["pairs"] > 0
        assert combined["diff"] <= 0, (b, row)
        losses += [b] if combined["evidence"]["status"] == "loss" else []
    assert len(losses) >= 2, buckets
    quality = [e for e in verdict["evidence"] if e["kind"] == "quality"]
    assert {e["bucket"] for e in quality} == {"<256", "256-1K", ">=1K"}
    assert all("derived)" in e["text"] for e in quality)
    grades = [json.loads(x) for x in (tmp_path / "run" / "grades.jsonl").read_text().splitlines()]
    rules = {g["derived"]["rule"] for g in grades if g["target"] == "other" and g["derived"]}
    assert {"derived:facts", "derived:tool_args", "derived:code"} <= rules, rules


def test_the_reference_itself_under_another_name_shows_no_loss(
    bf16_server: LocalServer, unlabeled_trace: Path, tmp_path: Path
) -> None:
    code, summary = canary(
        unlabeled_trace,
        f"""
[targets.bf16]
url = "{bf16_server.url}"
expect_cache_dtype = "auto"
[targets.other]
url = "{bf16_server.url}"
expect_cache_dtype = "auto"
role = "candidate"
""",
        tmp_path,
    )
    verdict = summary["verdict"]
    # Quality shows no loss; with the same cache it has no gain either, so no KEEP is due.
    assert verdict["verdict"] in ("reject", "insufficient_evidence") and code in (12, 13), verdict
    assert not any("repeatable loss" in r for r in verdict["reasons"])
    for b, row in _derived_rows(summary, "other").items():
        assert row["combined"]["evidence"]["status"] != "loss", (b, row)
        assert row["derived"]["pass_rate"] >= 0.9, (b, row["derived"])
