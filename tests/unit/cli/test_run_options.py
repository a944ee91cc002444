"""The run's options are one typed object: every command-line option has its field, the
manifest saves them, and a resume reads them back by their types (a bad saved value is an
input error naming the option, not a crash later in the run)."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from replay.cli import main
from replay.cli.run_directory import resume_options
from replay.cli.run_options import RunOptions
from replay.core.errors import InputError


def click_defaults() -> dict[str, Any]:
    """The options as click parses a bare ``--trace t.jsonl``."""
    ctx = main.make_context("replay", ["--trace", "t.jsonl"], resilient_parsing=True)
    return dict(ctx.params)


def test_every_run_option_has_a_field_and_every_field_an_option() -> None:
    names = set(click_defaults()) - {"resume_dir"}
    assert names == {f.name for f in fields(RunOptions)}


def test_saved_options_come_back_with_their_types() -> None:
    o = RunOptions.from_click(click_defaults())
    assert isinstance(o.trace_path, Path) and isinstance(o.out_dir, Path)
    saved = json.loads(json.dumps(o.to_json()))  # through the manifest's JSON
    assert all(not isinstance(v, Path) for v in saved.values())
    assert RunOptions.from_saved(saved, "manifest.json") == o


def test_options_added_later_take_their_defaults_in_an_older_run() -> None:
    saved = RunOptions.from_click(click_defaults()).to_json()
    for newer in ("max_error_rate", "emulate_fp8", "candidate", "control"):
        del saved[newer]
    o = RunOptions.from_saved(saved, "manifest.json")
    assert o.max_error_rate == 0.05 and o.emulate_fp8 is False and o.control is None


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("seed", "7", "cli_options.seed: expected int, got '7'"),
        ("parallel_targets", 1, "cli_options.parallel_targets: expected bool, got 1"),
        ("trace_path", None, "cli_options.trace_path: must not be null"),
        ("tolerance", True, "cli_options.tolerance: expected float, got True"),
    ],
)
def test_a_bad_saved_option_names_itself(key: str, value: Any, message: str) -> None:
    saved = RunOptions.from_click(click_defaults()).to_json()
    saved[key] = value
    with pytest.raises(InputError, match=re.escape(message)):
        RunOptions.from_saved(saved, "manifest.json")


def test_a_missing_required_option_is_named() -> None:
    saved = RunOptions.from_click(click_defaults()).to_json()
    del saved["concurrency"]
    with pytest.raises(InputError, match=r"cli_options\.concurrency: missing"):
        RunOptions.from_saved(saved, "manifest.json")


def test_resume_with_a_bad_manifest_is_an_input_error(tmp_path: Path) -> None:
    saved = RunOptions.from_click(click_defaults()).to_json()
    saved["limit"] = "ten"
    (tmp_path / "manifest.json").write_text(
        json.dumps({"cli_options": saved, "trace": {"sha256": "x"}})
    )
    with pytest.raises(InputError, match=r"manifest.json: cli_options.limit: expected int"):
        resume_options(tmp_path)
    out = CliRunner().invoke(main, ["--resume", str(tmp_path)])
    assert out.exit_code == 2 and "cli_options.limit" in out.output
