"""The real models' figures in docs/models.md are what bench/real_model.py and
bench/long_model.py render from their committed results files, so each one is a figure a run
recorded."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _run_figures
import long_model
import real_model


def test_the_readme_block_is_what_the_results_render() -> None:
    text = real_model.README.read_text(encoding="utf-8")
    block = real_model.render(_run_figures.load(real_model.RESULTS))
    assert real_model.rewrite(text, block) == text, "run: python bench/real_model.py"


def test_the_recorded_commands_hold_no_path_of_the_machine_that_ran_them() -> None:
    argv = ["/x/.venv/bin/replay", "canary", "--out", "/tmp/r", "--run-id", "a", "--model", "real"]
    assert _run_figures.user_command(argv) == ["replay", "canary", "--model", "real"]
    for results in (real_model.RESULTS, long_model.RESULTS):
        raw = results.read_text(encoding="utf-8")
        assert "/tmp/" not in raw and "/root/" not in raw and "/home/" not in raw, results


def test_the_long_models_block_is_what_its_results_render() -> None:
    text = long_model.DOC.read_text(encoding="utf-8")
    block = long_model.render(_run_figures.load(long_model.RESULTS))
    assert long_model.rewrite(text, block) == text, "run: python bench/long_model.py"


def test_a_readme_without_the_markers_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no '<!-- generated: bench/real_model\.py"):
        real_model.rewrite("# kvcanary\n", "block\n")
