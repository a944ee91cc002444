"""A run's ``--targets`` are saved redacted (a URL's user-info and query values are
credentials), so ``--resume`` asks for them again, and takes only the run's own targets."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.cli import main
from replay.cli.run_directory import Resuming, reconcile_resume
from replay.cli.run_options import RunOptions
from replay.core.errors import InputError

SECRET = "s3cret-T0KEN"
TARGETS = f"gw=http://me:{SECRET}@127.0.0.1:9/?api_key={SECRET},bf16"


def saved() -> RunOptions:
    """The options of a run with credentials in --targets, as its manifest reads back."""
    args = ["--trace", "t.jsonl", "--targets", TARGETS]
    ctx = main.make_context("replay", args, resilient_parsing=True)
    return RunOptions.from_saved(RunOptions.from_click(ctx.params).to_json(), "manifest.json")


def resume(targets: str | None) -> RunOptions:
    given = {"resume_dir": "--resume"} | ({"targets": "--targets"} if targets else {})
    opts = {"resume_dir": Path("run"), "targets": targets}
    return reconcile_resume(saved(), Resuming(Path("run"), "0" * 64), given, opts)


def test_the_saved_targets_hold_no_credential() -> None:
    assert saved().targets == "gw=http://***@127.0.0.1:9/?api_key=***,bf16"


def test_resume_asks_for_the_credentials_again() -> None:
    with pytest.raises(InputError, match="give --targets again as first typed") as info:
        resume(None)
    assert SECRET not in str(info.value)


def test_resume_takes_them_back_with_the_runs_own_targets_only() -> None:
    assert resume(TARGETS).targets == TARGETS
    with pytest.raises(InputError, match="only gives back the credentials") as info:
        resume(TARGETS.replace(",bf16", ",fp8"))
    assert SECRET not in str(info.value)
