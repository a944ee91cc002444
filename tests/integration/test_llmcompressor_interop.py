"""kvcal against LLM Compressor: the same recipe and samples give the same K/V scales.

LLM Compressor runs in its own environment (scripts/setup-llmcompressor: it caps transformers
below kvcanary's), created once per cache folder; `.ci/run` creates it before the suite, and
this test creates it on first use elsewhere (about a minute). Its oneshot runs kvcal's exported
recipe.yaml on kvcal's samples.jsonl, and every k_scale/v_scale must be within one bf16 step
of kvcal's: they observe the same tensors, LLM Compressor with eager attention and kvcal with
SDPA, which can move one amax by a bf16 rounding.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.interop


def bf16_step(x: float) -> float:
    """The spacing of bfloat16 values around ``x`` (8 significant bits)."""
    return float(2.0 ** (math.floor(math.log2(abs(x))) - 7))


@pytest.fixture(scope="module")
def llmc_python() -> str:
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup-llmcompressor")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_llmcompressor_oneshot_gives_kvcals_scales(
    twin_dir: Path, twin_overlay: Path, llmc_python: str, tmp_path: Path
) -> None:
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    overlay = twin_overlay
    out = tmp_path / "llmc_scales.json"
    proc = subprocess.run(
        [
            llmc_python,
            str(ROOT / "tests" / "support" / "interop" / "llmc_oneshot.py"),
            str(twin_dir),
            str(overlay),
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-4000:]
    theirs = json.loads(out.read_text())
    with safe_open(str(overlay / "kv_scales.safetensors"), "pt") as f:
        ours = {name: float(f.get_tensor(name).float()) for name in f.keys()}  # noqa: SIM118
    assert ours and set(ours) == set(theirs)
    for name, value in ours.items():
        (other,) = theirs[name]  # LLM Compressor writes a per-tensor scale as shape [1]
        assert abs(value - other) <= bf16_step(max(value, other)), (name, value, other)
