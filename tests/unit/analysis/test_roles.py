"""Which target plays which part: explicit roles win, the name-based guess is only the default,
and a name that merely contains "cal" is not the calibrated arm."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.analysis.roles import Roles, looks_calibrated, resolve
from replay.analysis.schemas import TargetSummary
from replay.analysis.schemas.manifest import Manifest
from replay.analysis.verdict.serving_path import serving_problems
from replay.core.errors import ConfigError
from replay.serving.targets import load_targets_config


def test_the_guess_reads_words_not_letters() -> None:
    assert not looks_calibrated("fp8-local") and not looks_calibrated("fp8-vocal")
    assert looks_calibrated("fp8-cal") and looks_calibrated("fp8_kvcal")
    assert looks_calibrated("FP8-Calibrated-v2")
    assert resolve(["bf16", "fp8-local"]) == Roles("bf16", "fp8-local", None)
    assert resolve(["bf16", "fp8", "fp8-cal"]) == Roles("bf16", "fp8", "fp8-cal")
    assert resolve(["a", "b"]) == Roles("a", "b", None)  # no bf16: the first is the reference


def test_explicit_roles_win_and_bad_ones_are_refused() -> None:
    assert resolve(
        ["bf16", "fp8-local", "fp8-cal"], candidate="fp8-cal", calibrated="fp8-local"
    ) == Roles("bf16", "fp8-cal", "fp8-local")
    assert resolve(["bf16", "x", "y"], declared={"y": "calibrated", "x": "reference"}) == Roles(
        "x", "bf16", "y"
    )
    # The command line wins over the targets file.
    assert resolve(["bf16", "x", "y"], calibrated="x", declared={"y": "calibrated"}) == Roles(
        "bf16", "y", "x"
    )
    with pytest.raises(ConfigError, match="--candidate: 'nope' is not one of the targets"):
        resolve(["bf16", "fp8"], candidate="nope")
    with pytest.raises(ConfigError, match="two roles"):
        resolve(["bf16", "fp8"], candidate="fp8", calibrated="fp8")
    with pytest.raises(ConfigError, match="role 'judge' is not one of"):
        resolve(["bf16", "fp8"], declared={"fp8": "judge"})


def test_a_targets_file_declares_roles(tmp_path: Path) -> None:
    f = tmp_path / "t.toml"
    f.write_text(
        '[targets.fp8-local]\nurl = "http://127.0.0.1:9"\nexpect_cache_dtype = "fp8"\n'
        'role = "calibrated"\n[targets.bf16]\nurl = "http://127.0.0.1:8"\n'
    )
    specs = load_targets_config(f)
    assert specs["fp8-local"].role == "calibrated" and specs["bf16"].role is None
    assert specs["fp8-local"].describe()["role"] == "calibrated"
    f.write_text('[targets.x]\nurl = "http://127.0.0.1:9"\nrole = 3\n')
    with pytest.raises(ConfigError, match="'role' must be a string"):
        load_targets_config(f)


def test_the_manifest_keeps_the_roles_and_odd_ones_fall_back() -> None:
    names = ["bf16", "fp8-local"]
    saved = {
        "reference": "bf16",
        "roles": {"reference": "bf16", "candidate": None, "calibrated": "fp8-local"},
    }
    assert Roles.from_manifest(Manifest.from_json(saved), names) == Roles("bf16", None, "fp8-local")
    odd = Manifest.from_json({"reference": [1, 2]}, problems=[])
    assert Roles.from_manifest(odd, names) == Roles("bf16", "fp8-local")
    assert Roles.from_manifest(Manifest.from_json({}), []) == Roles("bf16")


def test_a_bf16_candidate_is_a_deliberate_comparison_not_a_fallback() -> None:
    served = TargetSummary.from_json({"status": "ok", "cache_dtype": "auto"})

    def problems(spec: dict[str, str]) -> list[str]:
        manifest = {"reference": "bf16", "targets": {"bf16": {}, "other": {"spec": spec}}}
        return serving_problems("other", served, Manifest.from_json(manifest), calibrated=False)

    assert problems({"kv_cache_dtype": "auto", "expect_cache_dtype": "auto"}) == []
    assert any("fell back" in p for p in problems({"kv_cache_dtype": "fp8"}))
    assert any("fell back" in p for p in problems({}))  # unknown kind: must serve FP8
