"""``--skip-layers NAME=LAYERS`` as the command line reads it: layer indices and vLLM's
``sliding_window``, checked against the model's config.json, and a layers arm named only by
``--skip-layers`` (``--targets bf16,fp8,fp8-swa --skip-layers fp8-swa=sliding_window``) served
as FP8 on the model under test. No server is started."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from replay.analysis.roles import resolve
from replay.cli import main
from replay.cli.plan import resolve_targets
from replay.cli.run_options import RunOptions
from replay.core.errors import ConfigError, InputError
from replay.serving.targets import TargetSpec
from tests.support.gemma_layout import GEMMA

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "traces" / "sample.jsonl"
FLAG = "--kv-cache-dtype-skip-layers"
LLAMA: dict[str, Any] = {
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 256,
}


def model(tmp_path: Path, config: dict[str, Any], name: str = "m") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def targets(*args: str) -> list[TargetSpec]:
    ctx = main.make_context("replay", ["--trace", str(SAMPLE), *args], resilient_parsing=True)
    return resolve_targets(RunOptions.from_click(dict(ctx.params)))


def test_a_layers_arm_needs_no_folder_of_its_own(tmp_path: Path) -> None:
    gemma = model(tmp_path, GEMMA)
    specs = targets(
        "--targets", "bf16,fp8,fp8-swa", "--skip-layers", "fp8-swa=sliding_window",
        "--model", str(gemma),
    )  # fmt: skip
    bf16, fp8, swa = specs
    assert swa.model == bf16.model == fp8.model == str(gemma.resolve())
    assert (swa.kv_cache_dtype, swa.expect_cache_dtype, swa.role) == ("fp8", "fp8", "layers")
    assert swa.args[-2:] == (FLAG, "sliding_window")
    assert FLAG not in bf16.args and FLAG not in fp8.args
    roles = resolve([s.name for s in specs], declared={s.name: s.role for s in specs if s.role})
    assert (roles.reference, roles.candidate, roles.layers) == ("bf16", "fp8", "fp8-swa")


def test_a_layers_arm_takes_its_format_from_its_name(tmp_path: Path) -> None:
    gemma = model(tmp_path, GEMMA)
    specs = targets(
        "--targets", "bf16,fp8_e5m2-skip", "--skip-layers", "fp8_e5m2-skip=5,11",
        "--model", str(gemma),
    )  # fmt: skip
    assert specs[1].kv_cache_dtype == "fp8_e5m2"
    assert specs[1].args[-3:] == (FLAG, "5", "11")


def test_indices_and_the_keyword_go_one_word_each(tmp_path: Path) -> None:
    gemma = model(tmp_path, GEMMA)
    specs = targets(
        "--targets", "bf16,fp8-swa", "--skip-layers", "fp8-swa=17,sliding_window, 5 17",
        "--model", str(gemma),
    )  # fmt: skip
    assert specs[1].args[specs[1].args.index(FLAG) :] == (FLAG, "5", "17", "sliding_window")


def test_an_overlay_layers_arm_still_works(tmp_path: Path) -> None:
    gemma, overlay = model(tmp_path, GEMMA), model(tmp_path, GEMMA, "overlay")
    specs = targets(
        "--targets", f"bf16,fp8-skip={overlay}", "--skip-layers", "fp8-skip=0,5",
        "--model", str(gemma),
    )  # fmt: skip
    assert specs[1].model == str(overlay.resolve())
    assert specs[1].args[-3:] == (FLAG, "0", "5") and specs[1].role == "layers"


@pytest.mark.parametrize(
    ("config", "skip", "words"),
    [
        (GEMMA, "fp8-swa=18", r"layer\(s\) 18 out of range: .* has 18 layers \(0-17\)"),
        (GEMMA, "fp8-swa=3,40", r"layer\(s\) 40 out of range"),
        (LLAMA, "fp8-swa=sliding_window", "has no sliding-window layer"),
        (GEMMA, "fp8-swa=sliding", "expected NAME=LAYERS, layer indices from 0 and/or"),
        (GEMMA, "fp8-swa=-1", "expected NAME=LAYERS"),
        (GEMMA, "fp8-swa=", "expected NAME=LAYERS"),
    ],
)
def test_layers_the_model_lacks_are_bad_input(
    tmp_path: Path, config: dict[str, Any], skip: str, words: str
) -> None:
    folder = model(tmp_path, config)
    with pytest.raises(InputError, match=words):
        targets("--targets", "bf16,fp8-swa", "--skip-layers", skip, "--model", str(folder))


def test_a_name_skip_layers_does_not_give_is_still_unknown(tmp_path: Path) -> None:
    gemma = model(tmp_path, GEMMA)
    with pytest.raises(ConfigError, match="unknown target 'fp8-other'"):
        targets(
            "--targets", "bf16,fp8-other,fp8-swa", "--skip-layers", "fp8-swa=sliding_window",
            "--model", str(gemma),
        )  # fmt: skip
    with pytest.raises(ConfigError, match="unknown target 'fp8-swa'"):
        targets("--targets", "bf16,fp8-swa", "--model", str(gemma))


def test_a_layers_arm_named_for_no_quantized_format_is_refused(tmp_path: Path) -> None:
    gemma = model(tmp_path, GEMMA)
    for name in ("swa", "bf16-swa"):
        with pytest.raises(ConfigError, match="start its name with a quantized KV format"):
            targets(
                "--targets", f"bf16,{name}", "--skip-layers", f"{name}=sliding_window",
                "--model", str(gemma),
            )  # fmt: skip
