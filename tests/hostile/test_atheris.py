"""Coverage-guided fuzzing in CI: each atheris target (tests/support/fuzz/atheris_targets.py) runs a
few seconds from its seed corpus; any exception other than the parser's own named error is a
crash, and fails the test with the input that caused it. Skipped where atheris is not
installed (it is in the dev extra; wheels exist for CPython on Linux x86-64)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytest.importorskip("atheris")

HARNESS = ROOT / "tests" / "support" / "fuzz" / "atheris_targets.py"
# Not imported from the harness: importing it instruments modules in this process.
TARGETS = (
    "azure",
    "bailian",
    "burstgpt",
    "checker",
    "mooncake",
    "openai-log",
    "sse",
    "targets_toml",
    "trace_line",
    "v1_file",
)
SECONDS = 5  # per target: seven targets, about a minute in all with start-up


def test_every_harness_target_is_run_here() -> None:
    usage = (
        subprocess.run([sys.executable, str(HARNESS)], capture_output=True, text=True, timeout=120)
        .stderr.strip()
        .splitlines()[-1]
    )
    assert set(usage.split("{", 1)[1].split("}", 1)[0].split(",")) == set(TARGETS)


@pytest.mark.parametrize("target", TARGETS)
def test_atheris_target_finds_no_crash(target: str, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            str(HARNESS),
            target,
            str(corpus),
            f"-max_total_time={SECONDS}",
            "-seed=1",
            "-timeout=20",
            "-rss_limit_mb=2048",
            f"-artifact_prefix={tmp_path}/",
        ],
        capture_output=True,
        text=True,
        timeout=SECONDS + 120,
        env={**os.environ, "KVCANARY_FUZZ_SCRATCH": str(tmp_path)},
    )
    log = "\n".join(
        ln
        for ln in (proc.stdout + proc.stderr).splitlines()
        if not ln.startswith("INFO: Instrumenting")
    )
    crashes = sorted(p.name for p in tmp_path.glob("crash-*"))
    assert proc.returncode == 0 and not crashes, f"{target}: {crashes}\n{log[-4000:]}"
    assert re.search(r"^Done [1-9]\d* runs", log, re.M)  # it fuzzed, not exited early
    assert len(list(corpus.iterdir())) > 1  # seeds written, and the fuzzer added inputs
