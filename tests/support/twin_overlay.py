"""kvcal's scales for the outlier twin, calibrated as the tests and the bench both use them:
from the sample trace, which no evaluated trace shares, so no scored request was seen by the
calibration (tests/conftest.py's ``twin_overlay``, bench/kvcal_formats.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "traces" / "sample.jsonl"


def calibrate_command(twin: str | Path, overlay: str | Path) -> list[str]:
    """``kvcal calibrate TWIN --trace traces/sample.jsonl --buckets 256,1K --per-bucket 8
    -o OVERLAY`` (run from the repository, or with ``overlay`` relative to where it runs)."""
    cmd = [sys.executable, "-m", "kvcal.cli", "calibrate", str(twin), "--trace", str(SAMPLE)]
    return [*cmd, "--buckets", "256,1K", "--per-bucket", "8", "-o", str(overlay)]


def calibrate_twin(twin_dir: Path, overlay: Path, timeout: float = 1800) -> Path:
    """The twin's overlay, calibrated into ``overlay``, run as a user runs it."""
    subprocess.run(calibrate_command(twin_dir, overlay), cwd=ROOT, check=True, timeout=timeout)
    return overlay
