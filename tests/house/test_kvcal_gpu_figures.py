"""bench/README.md's kvcal_gpu block is what bench/kvcal_gpu.py makes of the committed GPU run:
its figures where one is recorded, and "not yet recorded" where none is, never a made-up one."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _kvcal_gpu_figures as figures
import kvcal_gpu


def test_the_readme_block_is_what_the_recorded_run_generates() -> None:
    text = kvcal_gpu.README.read_text(encoding="utf-8")
    assert kvcal_gpu.readme_text(kvcal_gpu.committed()) == text, (
        "run: python bench/kvcal_gpu.py render"
    )


def test_the_block_says_whether_a_gpu_run_is_recorded() -> None:
    text = kvcal_gpu.README.read_text(encoding="utf-8")
    block = text[text.index(figures.BEGIN) : text.index(figures.END)]
    recorded = kvcal_gpu.RESULTS.is_file()
    assert ("Not yet recorded" in block) is not recorded
    assert ("Measured on" in block) is recorded
