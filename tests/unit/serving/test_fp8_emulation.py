"""Emulated targets (FP8 and every other emulated KV format) without a server: how they are
started and checked. The plugin that patches the emulation in is
tests/unit/kvcal/test_vllm_plugin.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.core.errors import ServingMismatch
from replay.serving.local_server import (
    EMULATION_ENV,
    EMULATION_ROUNDING_ENV,
    EMULATION_SKIP_ENV,
    LocalServer,
)
from replay.serving.targets import (
    EMULATED_FP8,
    EMULATION_MARKER,
    TargetSpec,
    check_served_dtype,
    emulate_fp8,
    emulate_kv,
    load_targets_config,
    parse_targets,
)


def _emulated(*args: str) -> TargetSpec:
    return TargetSpec(
        name="fp8",
        model="/models/m",
        kv_cache_dtype=EMULATED_FP8,
        args=args,
        expect_cache_dtype=EMULATED_FP8,
    )


def test_emulated_server_stores_bf16_and_hands_skip_layers_to_the_plugin(tmp_path: Path) -> None:
    server = LocalServer(
        _emulated("--kv-cache-dtype-skip-layers", "0", "3", "--seed", "1"), tmp_path / "log"
    )
    cmd = server.command()
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "auto"
    assert "--kv-cache-dtype-skip-layers" not in cmd and cmd[-2:] == ["--seed", "1"]
    assert server._emulation()[1] == {EMULATION_ENV: "fp8", EMULATION_SKIP_ENV: "0,3"}
    comma = LocalServer(_emulated("--kv-cache-dtype-skip-layers", "1,2"), tmp_path / "log")
    assert comma._emulation()[1][EMULATION_SKIP_ENV] == "1,2"
    served = LocalServer(TargetSpec(name="fp8", model="/m", kv_cache_dtype="fp8"), tmp_path / "l")
    assert served._emulation()[1] == {} and "fp8" in served.command()
    int4 = TargetSpec(
        name="int4", model="/m", kv_cache_dtype="int4_per_token_head-emulated", rounding="cpu"
    )
    env = LocalServer(int4, tmp_path / "l")._emulation()[1]
    assert env == {EMULATION_ENV: "int4_per_token_head", EMULATION_ROUNDING_ENV: "cpu"}


def test_emulate_fp8_turns_only_local_fp8_targets(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    specs = parse_targets(f"bf16,fp8,fp8-cal={model},remote=http://127.0.0.1:9", model)
    turned = {s.name: s for s in map(emulate_fp8, specs)}
    assert not turned["bf16"].emulated and not turned["remote"].emulated
    assert turned["fp8"].emulated and turned["fp8-cal"].emulated
    assert turned["fp8"].kv_cache_dtype == turned["fp8"].expect_cache_dtype == EMULATED_FP8


def test_every_format_is_a_builtin_target_and_emulate_kv_turns_each(tmp_path: Path) -> None:
    model = tmp_path / "m"
    names = "bf16,fp8,fp8_e5m2,int8_per_token_head,nvfp4,nvfp4_4over6-emulated"
    specs = {s.name: s for s in parse_targets(names, model)}
    assert specs["fp8_e5m2"].kv_cache_dtype == specs["fp8_e5m2"].expect_cache_dtype == "fp8_e5m2"
    assert specs["nvfp4_4over6-emulated"].emulated_format == "nvfp4_4over6"
    assert emulate_fp8(specs["fp8_e5m2"]).emulated_format == "fp8_e5m2"
    assert not emulate_fp8(specs["int8_per_token_head"]).emulated  # not an FP8 format
    turned = {n: emulate_kv(s) for n, s in specs.items()}
    assert turned["int8_per_token_head"].kv_cache_dtype == "int8_per_token_head-emulated"
    assert turned["nvfp4"].emulated_format == "nvfp4" and not turned["bf16"].emulated


def test_targets_file_declares_an_emulated_target(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text('[targets.fp8-emu]\nmodel = "/m"\nkv_cache_dtype = "fp8-emulated"\n')
    assert load_targets_config(path)["fp8-emu"].emulated
    path.write_text(
        '[targets.nv]\nmodel = "/m"\nkv_cache_dtype = "nvfp4-emulated"\nrounding = "cpu"\n'
    )
    nv = load_targets_config(path)["nv"]
    assert nv.emulated_format == "nvfp4" and nv.rounding == "cpu"
    path.write_text('[targets.nv]\nmodel = "/m"\nrounding = "nearest"\n')
    with pytest.raises(Exception, match="'rounding' must be"):
        load_targets_config(path)


def test_served_dtype_check_of_an_emulated_target() -> None:
    spec = _emulated()
    problems: list[str] = []
    check_served_dtype(spec, "auto", f"... {EMULATION_MARKER} [fp8, cpu rounding] ...\n", problems)
    assert problems == []
    with pytest.raises(ServingMismatch, match="emulates another format"):
        check_served_dtype(spec, "auto", f"{EMULATION_MARKER} [fp8_e5m2, cpu rounding]", problems)
    with pytest.raises(ServingMismatch, match="never logged"):
        check_served_dtype(spec, "auto", "INFO engine started\n", problems)
    with pytest.raises(ServingMismatch, match="served cache_dtype is 'fp8_e4m3'"):
        check_served_dtype(spec, "fp8_e4m3", f"{EMULATION_MARKER} [fp8, cpu", problems)
    check_served_dtype(spec, "auto", None, problems)  # a URL target: no log to read
    assert len(problems) == 1 and "cannot see" in problems[0]


def test_an_overlay_is_emulated_on_its_own_dtype_not_auto(tmp_path: Path) -> None:
    """Under --kv-cache-dtype auto vLLM serves FP8 for a checkpoint with a kv_cache_scheme:
    its emulated server names the model's dtype so that it really stores BF16."""
    import json

    from replay.serving.local_server import unquantized_cache_dtype

    plain, overlay = tmp_path / "plain", tmp_path / "overlay"
    for folder, config in (
        (plain, {"torch_dtype": "bfloat16"}),
        (
            overlay,
            {
                "torch_dtype": "float16",
                "quantization_config": {
                    "quant_method": "compressed-tensors",
                    "kv_cache_scheme": {"num_bits": 8, "type": "float"},
                },
            },
        ),
    ):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    assert unquantized_cache_dtype(plain) == "auto"
    assert unquantized_cache_dtype(overlay) == "float16"
    assert unquantized_cache_dtype(tmp_path / "missing") == "auto"
    server = LocalServer(_emulated(), tmp_path / "log")
    object.__setattr__(server.spec, "model", str(overlay))
    cmd = server.command()
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "float16"


def test_a_server_loads_its_compiled_model_unless_the_user_says_otherwise(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """vLLM CPU's ahead-of-time compile cache fails to load, so a server is started without
    it (inductor's cache loads); the user's environment and the target's own env win."""
    from replay.serving.local_server import COMPILE_ENV

    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    spec = TargetSpec(name="bf16", model="/m", kv_cache_dtype="auto")
    assert COMPILE_ENV == {"VLLM_USE_AOT_COMPILE": "0"}
    assert LocalServer(spec, tmp_path / "l").environment()["VLLM_USE_AOT_COMPILE"] == "0"
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert LocalServer(spec, tmp_path / "l").environment()["VLLM_USE_AOT_COMPILE"] == "1"
    own = TargetSpec(name="bf16", model="/m", env={"VLLM_USE_AOT_COMPILE": "1"})
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE")
    assert LocalServer(own, tmp_path / "l").environment()["VLLM_USE_AOT_COMPILE"] == "1"
