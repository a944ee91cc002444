"""The real-model figures of docs/models.md are what bench/real_model.py renders from the committed
results file, so each one is a figure a run recorded."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import real_model


def test_the_readme_block_is_what_the_results_render() -> None:
    text = real_model.README.read_text(encoding="utf-8")
    block = real_model.render(real_model._load(real_model.RESULTS))
    assert real_model.rewrite(text, block) == text, "run: python bench/real_model.py"


def test_the_recorded_commands_hold_no_path_of_the_machine_that_ran_them() -> None:
    argv = ["/x/.venv/bin/replay", "canary", "--out", "/tmp/r", "--run-id", "a", "--model", "real"]
    assert real_model._command(argv) == ["replay", "canary", "--model", "real"]
    raw = real_model.RESULTS.read_text(encoding="utf-8")
    assert "/tmp/" not in raw and "/root/" not in raw and "/home/" not in raw


def test_a_readme_without_the_markers_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no '<!-- generated: bench/real_model\.py"):
        real_model.rewrite("# kvcanary\n", "block\n")
