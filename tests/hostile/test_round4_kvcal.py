"""kvcal on broken checkpoints: each is refused with one error line that names the file, what is
wrong and what to do (exit 2, no traceback), before anything is loaded or written; a config
that claims layers the weights lack is refused rather than completed with random weights; and
scales no FP8 cache can use are flagged by ``kvcal inspect`` (a warning, or exit 2 with
``--strict``).

Every broken folder is a copy of the embedded test model, broken one way in ``tmp_path``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from click.testing import CliRunner, Result  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from kvcal.cli import main  # noqa: E402
from replay.testmodel.factory import ensure_default_model  # noqa: E402

KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
# compressed-tensors' whole block (transformers quantizes K/V with the scales the weights lack:
# random ones) and a bare one (transformers' pydantic validation rejects it)
FULL_BLOCK = {
    "quant_method": "compressed-tensors",
    "format": "dense",
    "quantization_status": "compressed",
    "config_groups": {},
    "ignore": [],
    "kv_cache_scheme": {**KV_SCHEME, "symmetric": True},
}
BARE_BLOCK = {"quant_method": "compressed-tensors", "kv_cache_scheme": KV_SCHEME}


def line_of(res: Result, start: str) -> str:
    """The one output line that starts with ``start`` (``error:``, ``warning:``)."""
    lines = [line for line in res.output.splitlines() if line.startswith(start)]
    assert len(lines) == 1, res.output
    return lines[0]


def refused(res: Result, *words: str) -> None:
    """Exit 2 with one error line, no traceback, that says each of ``words``."""
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit), res.exception  # not a crash click caught
    assert "Traceback" not in res.output, res.output
    error = line_of(res, "error: ")
    for w in words:
        assert w in error, f"{w!r} not in {error!r}"


def kvcal(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def broken(tmp_path: Path, edit: Callable[[Path], Any]) -> Path:
    """A copy of the embedded test model, broken by ``edit``."""
    model = tmp_path / "model"
    shutil.copytree(ensure_default_model(), model)
    edit(model)
    return model


def edit_config(**fields: Any) -> Callable[[Path], None]:
    def edit(model: Path) -> None:
        path = model / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}), encoding="utf-8")

    return edit


def config_a_list(model: Path) -> None:
    (model / "config.json").write_text("[1, 2]", encoding="utf-8")


def truncated_weights(model: Path) -> None:
    path = model / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # an interrupted download


def garbage_weights(model: Path) -> None:
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 16)


def no_tokenizer(model: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model / name).unlink()


def samples_file(tmp_path: Path) -> Path:
    path = tmp_path / "samples.jsonl"
    path.write_text(json.dumps({"id": "s1", "input_ids": list(range(5, 37))}) + "\n")
    return path


def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# -- kvcal inspect ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (config_a_list, ["config.json: must be a JSON object", "got a list"]),
        (
            edit_config(quantization_config="fp8"),
            ["config.json: field 'quantization_config': must be an object", "got a string"],
        ),
        (truncated_weights, ["model.safetensors: truncated", "download or copy"]),
        (garbage_weights, ["model.safetensors: not a safetensors file", "download or copy"]),
    ],
    ids=["config-a-list", "quantization-config-a-string", "truncated-weights", "garbage-weights"],
)
def test_inspect_refuses_a_broken_checkpoint_in_one_line(
    tmp_path: Path, edit: Callable[[Path], Any], words: list[str]
) -> None:
    model = broken(tmp_path, edit)
    refused(kvcal("inspect", model), str(model), *words)


def with_scales(bad: float) -> Callable[[Path], None]:
    """A calibrated checkpoint (a kv_cache_scheme and a k/v scale per layer) whose layer 2 V
    scale is ``bad``."""

    def edit(model: Path) -> None:
        edit_config(quantization_config=FULL_BLOCK)(model)
        scales = {
            f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(0.01, dtype=torch.bfloat16)
            for i in range(4)
            for w in "kv"
        }
        scales["model.layers.2.self_attn.v_scale"] = torch.tensor(bad, dtype=torch.bfloat16)
        save_file(scales, str(model / "kv_scales.safetensors"))

    return edit


@pytest.mark.parametrize("strict", [False, True], ids=["warning", "strict"])
@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (float("nan"), "NaN"),
        (float("inf"), "inf (infinite)"),
        (-0.5, "-0.5 (negative)"),
        (0.0, "0 (zero)"),
        (1e30, "1e+30 (absurd: outside 1e-9..1e9)"),
    ],
    ids=["nan", "inf", "negative", "zero", "1e30"],
)
def test_inspect_flags_scales_no_fp8_cache_can_use(
    tmp_path: Path, bad: float, why: str, strict: bool
) -> None:
    model = broken(tmp_path, with_scales(bad))
    res = kvcal("inspect", model, *(["--strict"] if strict else []))
    said = [
        f"{model}: 1 k/v scale tensor(s) no FP8 cache can use",
        f"model.layers.2.self_attn.v_scale {why}",
    ]
    if strict:
        refused(res, *said)
        flagged = line_of(res, "error: ")
    else:
        assert res.exit_code == 0, res.output
        flagged = line_of(res, "warning: ")
        assert all(w in flagged for w in [*said, "calibrate again"]), flagged
    assert "layers.0.self_attn" not in flagged  # the fine scales go unnamed


# -- kvcal sample -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (config_a_list, ["config.json: must be a JSON object", "got a list"]),
        (no_tokenizer, ["no tokenizer (none of tokenizer.json", "copy the tokenizer files"]),
    ],
    ids=["config-a-list", "no-tokenizer"],
)
def test_sample_refuses_a_broken_checkpoint_in_one_line(
    tmp_path: Path, edit: Callable[[Path], Any], words: list[str]
) -> None:
    model = broken(tmp_path, edit)
    out = tmp_path / "cal"
    refused(kvcal("sample", model, "--trace", trace_file(tmp_path), "-o", out), str(model), *words)
    assert not out.exists()


# -- kvcal calibrate ----------------------------------------------------------------------------


def calibrate(tmp_path: Path, model: Path) -> tuple[Result, Path]:
    out = tmp_path / "overlay"
    return kvcal("calibrate", model, "--samples", samples_file(tmp_path), "-o", out), out


def test_calibrate_refuses_weights_with_a_garbage_header(tmp_path: Path) -> None:
    model = broken(tmp_path, garbage_weights)
    res, out = calibrate(tmp_path, model)
    refused(res, f"{model}/model.safetensors: not a safetensors file", "download or copy")
    assert not out.exists()


@pytest.mark.parametrize("block", [FULL_BLOCK, BARE_BLOCK], ids=["full-block", "bare-block"])
def test_calibrate_refuses_a_checkpoint_that_already_has_a_kv_cache_scheme(
    tmp_path: Path, block: dict[str, Any]
) -> None:
    """Refused before it is loaded: transformers would observe K/V through the old scheme's
    FP8 rounding (with random scales where the weights carry none), or reject the block."""
    model = broken(tmp_path, edit_config(quantization_config=block))
    res, out = calibrate(tmp_path, model)
    refused(
        res,
        f"{model}/config.json: this checkpoint already carries k/v scales",
        "calibrate the checkpoint it was made from",
    )
    assert not out.exists()


def test_calibrate_refuses_a_config_claiming_layers_the_weights_lack(tmp_path: Path) -> None:
    """100 layers over 4 layers' weights: transformers would give 96 layers random weights
    and kvcal would write 200 scales, 192 of them measured on noise."""
    model = broken(tmp_path, edit_config(num_hidden_layers=100))
    res, out = calibrate(tmp_path, model)
    refused(
        res,
        f"{model}/config.json: num_hidden_layers is 100",
        "hold none for layers 4-99 (96 of 100)",
        "set num_hidden_layers to 4",
    )
    assert not out.exists()


def test_calibrate_refuses_weights_that_lack_a_tensor_the_config_asks_for(tmp_path: Path) -> None:
    """Every layer there, one tensor gone: only loading tells, and transformers fills it with
    random values; the loader's missing keys refuse it."""

    def drop_one(model: Path) -> None:
        path = model / "model.safetensors"
        state = load_file(str(path))
        del state["model.layers.1.self_attn.k_proj.weight"]
        save_file(state, str(path), metadata={"format": "pt"})

    model = broken(tmp_path, drop_one)
    res, out = calibrate(tmp_path, model)
    refused(res, "the weights lack 1 tensor(s)", "model.layers.1.self_attn.k_proj.weight")
    assert not out.exists()
