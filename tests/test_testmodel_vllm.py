"""The test model's outlier twin on real vLLM CPU servers: the keys are 2^n times larger, the
queries 2^n times smaller, and every greedy answer is the same as the original's in BF16."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from replay._targets import LocalServer

from .conftest import ROOT, _serve

pytestmark = pytest.mark.vllm

SAMPLE = ROOT / "traces" / "sample.jsonl"


@pytest.fixture(scope="module")
def twin_server(twin_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                ) -> Iterator[LocalServer]:
    yield from _serve("twin", "auto", twin_dir, tmp_path_factory.mktemp("twin"))


def test_twin_answers_identically_in_bf16(bf16_server: LocalServer, twin_server: LocalServer,
                                          twin_dir: Path, tmp_path: Path) -> None:
    manifest = json.loads((twin_dir / "kvcanary_model.json").read_text())
    assert manifest["k_proj_factor"] >= 2
    # One request at a time: greedy answers then do not depend on how requests are batched.
    cmd = [sys.executable, "-m", "replay.cli", "--trace", str(SAMPLE),
           "--targets", f"bf16={bf16_server.url},twin={twin_server.url}",
           "--concurrency", "1", "--buckets", "256,1K", "--no-teacher-forced",
           "--out", str(tmp_path), "--run-id", "run"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    grades = tmp_path / "run" / "grades.jsonl"
    assert grades.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in grades.read_text().splitlines()]
    twin = [r for r in rows if r["target"] == "twin"]
    assert len(twin) == 30 and all(r["answered"] for r in twin)
    assert {r["bucket"] for r in twin} == {"<256", "256-1K", ">=1K"}
    different = [r["request_id"] for r in twin if not r["agreement"]["exact"]]
    assert not different
