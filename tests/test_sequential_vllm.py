"""The sequential canary on real vLLM CPU servers: the outlier twin at FP8 scale 1.0 (served,
or emulated where the CPU cannot serve FP8) stops with CALIBRATE after far fewer requests than
the trace holds; the embedded model's canary stops with its own decision; an interrupted
sequential run resumes from its saved state."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: these tests start vLLM servers")

from .conftest import ROOT, fp8_flags

pytestmark = [pytest.mark.vllm, pytest.mark.fp8]
FIRST_RUN = ROOT / "traces" / "first_run.jsonl"
TRACE_REQUESTS = sum(1 for line in FIRST_RUN.read_text().splitlines() if line.strip())


def command(model: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "replay.cli", "canary", "--sequential", "--trace", str(FIRST_RUN),
        "--targets", "bf16,fp8", "--model", str(model), "--buckets", "256,1K",
        "--round-size", "8", "--concurrency", "4", "--no-teacher-forced", "--no-control",
        "--out", str(out), "--run-id", "run", *fp8_flags(), *extra,
    ]  # fmt: skip


def canary(model: Path, out: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run(
        command(model, out, *extra), cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    summary = out / "run" / "summary.json"
    assert summary.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, json.loads(summary.read_text())


def test_the_twin_at_scale_one_stops_with_calibrate_early(twin_dir: Path, tmp_path: Path) -> None:
    code, summary = canary(twin_dir, tmp_path)
    seq = summary["sequential"]
    assert seq["decision"] == "loss" and seq["stopped"] == "decided", seq
    assert summary["verdict"]["verdict"] == "calibrate" and code == 10, summary["verdict"]
    # Far fewer requests than the trace holds (what a fixed canary sends every arm).
    assert seq["requests_sent"] <= TRACE_REQUESTS // 3, seq
    assert seq["rounds"] >= 1 and seq["path"], seq
    losses = [b for b in seq["buckets"] if b["status"] == "loss"]
    pool = seq["pool"]
    assert losses or (pool is not None and pool["status"] == "loss"), seq
    print(f"twin: {seq['requests_sent']} requests of {TRACE_REQUESTS}, fixed N {seq['fixed_n']}")


def test_the_embedded_models_canary_stops_with_its_decision(
    model_dir: Path, tmp_path: Path
) -> None:
    code, summary = canary(model_dir, tmp_path)
    seq = summary["sequential"]
    # FP8 at scale 1.0 matches on the embedded model: never a loss; the run stops when every
    # bucket is shown equivalent, or when the trace runs out with what more it needs.
    assert seq["decision"] in ("equivalent", "open") and seq["decision"] != "loss", seq
    assert seq["stopped"] in ("decided", "trace"), seq
    if seq["decision"] == "open":
        assert seq["needs"], seq
        assert summary["verdict"]["verdict"] == "insufficient_evidence" and code == 13
    else:
        assert summary["verdict"]["verdict"] in ("keep", "reject"), summary["verdict"]
    print(
        f"embedded: {seq['decision']} after {seq['requests_sent']} requests of "
        f"{TRACE_REQUESTS}, fixed N {seq['fixed_n']}"
    )


def test_an_interrupted_sequential_canary_resumes_its_state(
    model_dir: Path, tmp_path: Path
) -> None:
    proc = subprocess.Popen(
        command(model_dir, tmp_path),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    state = tmp_path / "run" / "sequential.json"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        if state.exists() and json.loads(state.read_text()).get("round", 0) >= 1:
            break
        time.sleep(0.5)
    assert proc.poll() is None, "the run ended before its first round was saved"
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=300)
    before = json.loads(state.read_text())
    done = subprocess.run(
        [sys.executable, "-m", "replay.cli", "canary", "--resume", str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    after = json.loads(state.read_text())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert after["round"] >= before["round"], (before, after)
    assert summary["sequential"]["stopped"] in ("decided", "trace"), done.stderr[-2000:]
    # Every request the state folded in was graded once per arm: no pair counted twice.
    pairs = sum(b["pairs"] for b in summary["sequential"]["buckets"])
    assert pairs == summary["sequential"]["requests_sent"] or pairs <= TRACE_REQUESTS
