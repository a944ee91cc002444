"""The sequential canary's driver against two in-process servers that answer alike: it sends
rounds per bucket, folds them into sequential.json, stops once decided (or at its bounds),
writes the summary's sequential block and decides the verdict on it; a resume keeps the
state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.fault_server import fault_server

ROOT = Path(__file__).resolve().parents[3]


def _trace(path: Path, n: int) -> Path:
    with path.open("w") as fh:
        for i in range(n):
            rec = {
                "id": f"r{i}",
                "api": "chat",
                "task": "chat",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": f"say a {i}"}],
                "check": {"type": "contains", "values": ["a"]},
            }
            fh.write(json.dumps(rec) + "\n")
    return path


def _canary(tmp: Path, urls: str, *extra: str) -> tuple[int, dict[str, Any], dict[str, Any]]:
    cmd = [
        sys.executable,
        "-m",
        "replay.cli",
        "canary",
        "--trace",
        str(_trace(tmp / "trace.jsonl", 400)),
        "--targets",
        urls,
        "--out",
        str(tmp),
        "--run-id",
        "run",
        "--reference",
        "ref",
        "--candidate",
        "cand",
        "--sequential",
        "--no-teacher-forced",
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    run = tmp / "run"
    assert (run / "summary.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    return proc.returncode, summary, json.loads((run / "sequential.json").read_text())


def test_alike_servers_stop_equivalent_before_the_trace_runs_out(tmp_path: Path) -> None:
    with (
        fault_server("usage_every", chunks=4, gap_s=0.0) as a,
        fault_server("usage_every", chunks=4, gap_s=0.0) as b,
    ):
        urls = f"ref={a.url},cand={b.url}"
        _, summary, state = _canary(tmp_path, urls, "--round-size", "10")
    seq = summary["sequential"]
    assert seq["decision"] == "equivalent" and seq["stopped"] == "decided", seq
    assert seq["requests_sent"] < 400 and seq["requests_sent"] == len(state["run"]["sent"])
    assert state["round"] == seq["rounds"] and state["decision"] == "equivalent"
    assert [r["pairs"] for r in seq["path"]] == sorted(r["pairs"] for r in seq["path"])
    assert summary["verdict"]["verdict"] != "insufficient_evidence", summary["verdict"]
    # The report shows the path to the decision and the requests against the fixed design.
    html = (tmp_path / "run" / "report.html").read_text()
    assert 'id="sequential"' in html and html.count("<svg") >= 1
    assert f"{seq['requests_sent']} requests sent to every arm" in html
    md = (tmp_path / "run" / "report.md").read_text()
    assert "### Sequential canary" in md and f"would have sent {seq['fixed_n']}" in md


def test_max_requests_stops_undecided_and_resume_keeps_the_state(tmp_path: Path) -> None:
    with (
        fault_server("usage_every", chunks=4, gap_s=0.0) as a,
        fault_server("usage_every", chunks=4, gap_s=0.0) as b,
    ):
        urls = f"ref={a.url},cand={b.url}"
        _, summary, state = _canary(tmp_path, urls, "--round-size", "5", "--max-requests", "20")
        seq = summary["sequential"]
        assert seq["stopped"] == "max_requests" and seq["requests_sent"] == 20, seq
        assert summary["verdict"]["verdict"] == "insufficient_evidence"
        assert seq["needs"], seq
        rows = [json.loads(x) for x in (tmp_path / "run" / "results.jsonl").read_text().split()]
        # Each request went to the reference, its A/A control (on by default) and the candidate.
        assert len(rows) == 60 and {r["phase"] for r in rows} == {"seq"}
        assert {r["target"] for r in rows} == {"ref", "ref-control", "cand"}
        # --resume reloads the state; its --max-requests is spent, so nothing more is sent.
        cmd = [sys.executable, "-m", "replay.cli", "canary", "--resume", str(tmp_path / "run")]
        subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    again = json.loads((tmp_path / "run" / "sequential.json").read_text())
    assert again["round"] == state["round"] and again["run"]["sent"] == state["run"]["sent"]
    assert again["buckets"] == state["buckets"]
