"""The capacity phase on real vLLM CPU servers: the reference, its control and FP8 restarted
with the same small KV-cache memory, the reference's cache full there, and the rule's capacity
cell weighed (FP8 served: a CPU with AVX-512 or AMX)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import fp8_emulated

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm, pytest.mark.fp8]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_capacity_phase_fills_the_reference_cache(tmp_path: Path) -> None:
    if fp8_emulated():
        pytest.skip("an emulated FP8 cache has BF16's capacity: nothing to measure")
    cmd = [
        sys.executable,
        "-m",
        "replay.cli",
        "--trace",
        "traces/first_run.jsonl",
        "--limit",
        "60",
        "--targets",
        "bf16,fp8",
        "--buckets",
        "256,1K",
        "--capacity-phase",
        "--capacity-concurrency",
        "8",
        "--no-teacher-forced",
        "--out",
        str(tmp_path),
        "--run-id",
        "cap",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    run = tmp_path / "cap"
    assert (run / "summary.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    manifest = json.loads((run / "manifest.json").read_text())
    cap = summary["systems"]["capacity"]
    assert cap["status"] == "ran", cap
    block = manifest["capacity"]
    # The same memory for every server, as the manifest states; FP8 holds twice the tokens.
    for name in ("bf16", "bf16-control", "fp8"):
        command = block["servers"][name]["server"]["command"]
        assert command[command.index("--kv-cache-memory-bytes") + 1] == str(block["cache_bytes"])
        assert _gone(block["servers"][name]["server"]["pid"])
    arms = cap["arms"]
    ratio = arms["fp8"]["kv_cache_size_tokens"] / arms["bf16"]["kv_cache_size_tokens"]
    assert 1.9 <= ratio <= 2.1
    assert {a["requests"] for a in arms.values()} == {arms["bf16"]["requests"]} != {0}
    cell = next(c for c in summary["systems"]["rule"]["cells"] if c["phase"] == "capacity")
    # The cell is weighed exactly when the reference's cache ran full (a preemption, or a
    # sampled peak of 90% while requests queued), and the phase stops once its call at the
    # planned blocks is decided (or sends them all): the call is then the fixed design's.
    bf16 = arms["bf16"]
    full = (bf16["preemptions"] or 0) > 0 or (
        bf16["peak_kv_usage"] >= 0.9 and (bf16["peak_waiting"] or 0) > 0
    )
    assert cap["reference_full"] is full, bf16
    stop = block["stop"]
    assert stop["planned"] == block["blocks_planned"] == cap["blocks_planned"] == 24
    assert block["pressure"] >= 1.5  # the loop's demand over the reference's served cache
    if full:
        assert cell["call"] != "unweighed", cell
        assert cell["level"] == pytest.approx(1 - 0.05 / 2)
        assert stop["why"] in ("decided", "all_blocks"), stop
        assert cell["pairs"] == stop["blocks"] and (stop["why"] == "decided") == (
            stop["blocks"] < 24
        )
    else:
        assert cell["call"] == "unweighed" and stop["why"] == "all_blocks", (cell, stop)
        assert (bf16["peak_waiting"] or 0) > 0, bf16  # it was pressed, if not full
    assert (run / "capacity" / "servers" / "fp8.log").stat().st_size > 0
