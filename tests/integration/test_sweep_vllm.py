"""A concurrency sweep on a real vLLM CPU server: the target's knee and its highest load
within the SLOs, in summary.json and on the terminal, and a sweep that stops rising once a
target is saturated (the levels above are not run, and the manifest says why)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: these tests start vLLM servers")

from replay.rundir.files import read_results
from replay.serving.local_server import LocalServer
from tests.conftest import ROOT

pytestmark = pytest.mark.vllm
SAMPLE = ROOT / "traces" / "sample.jsonl"
FIRST_RUN = ROOT / "traces" / "first_run.jsonl"


def replay(
    tmp_path: Path, run_id: str, *args: str, trace: Path = SAMPLE, limit: int = 24
) -> tuple[dict, subprocess.CompletedProcess[str]]:
    done = subprocess.run(
        [sys.executable, "-m", "replay.cli", "--trace", str(trace), "--limit", str(limit),
         "--buckets", "256,1K", "--no-teacher-forced", "--out", str(tmp_path),
         "--run-id", run_id, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((tmp_path / run_id / "summary.json").read_text()), done


def test_a_sweep_reports_a_knee(bf16_server: LocalServer, tmp_path: Path) -> None:
    """One target, so no other load shares its server, and levels far enough apart that the
    bend is not a few requests' noise: 32 long prompts at once queue for prefill on two
    cores, where 1 or 4 do not (24 short requests at c16 beside a second target on the same
    server read as flat or bent from one run to the next)."""
    summary, done = replay(
        tmp_path, "sweep", "--targets", f"bf16={bf16_server.url}", "--concurrency", "1,4,32",
        "--slo", "ttft=1s,e2e=20s", trace=FIRST_RUN, limit=64,
    )  # fmt: skip
    sat = summary["saturation"]
    assert sat["kind"] == "concurrency" and sat["phases"] == ["c1", "c4", "c32"]
    curve = sat["targets"]["bf16"]["all"]
    assert [p["load"] for p in curve["points"]] == [1.0, 4.0, 32.0]
    assert curve["knee"] is not None, curve
    assert curve["knee"]["phase"] in ("c1", "c4"), curve["knee"]
    assert "max_load_meeting_slo" in curve
    assert f"saturation bf16: knee at {curve['knee']['phase']}" in done.stderr
    report = (tmp_path / "sweep" / "report.html").read_text()
    assert 'id="load"' in report


def test_the_sweep_stops_rising_once_saturated(bf16_server: LocalServer, tmp_path: Path) -> None:
    summary, _ = replay(
        tmp_path, "stop", "--targets", f"bf16={bf16_server.url}", "--concurrency", "1,4,16,32",
        "--stop-at-saturation",
    )  # fmt: skip
    manifest = json.loads((tmp_path / "stop" / "manifest.json").read_text())
    stopped = manifest["targets"]["bf16"]["sweep_stopped"]
    assert stopped["skipped"] and "c32" in stopped["skipped"], stopped
    assert "saturated at" in stopped["reason"]
    ran = set(manifest["targets"]["bf16"]["phases"])
    assert ran.isdisjoint(stopped["skipped"]) and stopped["after"] in ran
    # Only the levels that ran have results: every request once in each of them.
    phases = {r.phase for r in read_results(tmp_path / "stop")}
    assert phases == ran and set(summary["targets"]["bf16"]["phases"]) == ran
