from __future__ import annotations

from pathlib import Path

import pytest

from replay.core.buckets import Buckets
from replay.core.errors import ConfigError, InputError
from replay.serving.local_server import failure_reason
from replay.serving.targets import (
    cache_dtype_matches,
    load_targets_config,
    parse_targets,
)


def test_default_buckets() -> None:
    b = Buckets.parse()
    assert b.labels == ["<8K", "8K-32K", "32K-64K", ">=64K"]
    assert [b.label(n) for n in (1, 8191, 8192, 32767, 32768, 65536, 10**6)] == [
        "<8K",
        "<8K",
        "8K-32K",
        "8K-32K",
        "32K-64K",
        ">=64K",
        ">=64K",
    ]


def test_small_buckets_and_bad_specs() -> None:
    assert Buckets.parse("256,1K").labels == ["<256", "256-1K", ">=1K"]
    for bad in ("", "1K,256", "x", "0,5"):
        with pytest.raises(InputError):
            Buckets.parse(bad)


def test_parse_targets() -> None:
    model = Path("/models/m")
    bf16, fp8 = parse_targets("bf16,fp8", model)
    assert (bf16.model, bf16.kv_cache_dtype, fp8.kv_cache_dtype) == (str(model), "auto", "fp8")
    ext = parse_targets("fp8-gpu=http://127.0.0.1:8001/,base=http://127.0.0.1:8000", None)
    assert ext[0].url == "http://127.0.0.1:8001" and ext[0].expect_cache_dtype == "fp8"
    assert ext[1].expect_cache_dtype is None
    with pytest.raises(ConfigError, match=r"unknown target 'int4'.*Available: bf16, fp8"):
        parse_targets("int4", model)
    with pytest.raises(ConfigError, match="duplicate"):
        parse_targets("bf16,bf16", model)
    with pytest.raises(ConfigError, match="name=http"):
        parse_targets("x=localhost:80", model)


def test_targets_config_errors_name_the_table(tmp_path: Path) -> None:
    p = tmp_path / "t.toml"
    p.write_text(
        '[targets.cal]\nmodel = "/m"\nkv_cache_dtype = "fp8"\nargs = ["--x"]\n'
        '[targets.remote]\nurl = "http://127.0.0.1:9"\napi_key_env = "KEY"\n'
    )
    cfg = load_targets_config(p)
    assert cfg["cal"].expect_cache_dtype == "fp8" and cfg["cal"].args == ("--x",)
    assert (
        "KEY" not in str(cfg["remote"].describe().values())
        or cfg["remote"].describe()["api_key_env"] == "KEY"
    )
    p.write_text('[targets.bad]\nmodel = "/m"\nurl = "http://x"\n')
    with pytest.raises(ConfigError, match=r"\[targets\.bad\]: set exactly one"):
        load_targets_config(p)
    p.write_text('[targets.bad]\nmodel = "/m"\ncolour = 1\n')
    with pytest.raises(ConfigError, match=r"unknown key.*colour"):
        load_targets_config(p)
    p.write_text("not toml [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_targets_config(p)


def test_api_key_is_read_from_the_environment_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    p = tmp_path / "t.toml"
    p.write_text('[targets.remote]\nurl = "http://127.0.0.1:9"\napi_key_env = "KVC_TEST_KEY"\n')
    spec = load_targets_config(p)["remote"]
    with pytest.raises(ConfigError, match="KVC_TEST_KEY"):
        spec.api_key()
    monkeypatch.setenv("KVC_TEST_KEY", "sk-secret-123")
    assert spec.api_key() == "sk-secret-123"
    assert "sk-secret-123" not in repr(spec.describe())


def test_cache_dtype_matching() -> None:
    assert cache_dtype_matches("auto", "auto") and cache_dtype_matches("auto", "bfloat16")
    assert cache_dtype_matches("fp8", "fp8_e4m3") and not cache_dtype_matches("fp8", "auto")
    assert not cache_dtype_matches("auto", "fp8")


def test_failure_reason_finds_the_root_cause() -> None:
    log = (
        "INFO starting\n"
        "(APIServer pid=1) WARNING 11-30 12:12:29 [system_utils.py:255] Found ulimit of 20000"
        " and failed. This can cause fd limit errors like `OSError: [Errno 24] Too many`\n"
        "(Worker pid=1) ERROR 11-30 12:14:12 [multiproc_executor.py:1063]     raise "
        "NotImplementedError(\n"
        "(Worker pid=1) ERROR 11-30 12:14:12 [multiproc_executor.py:1063] "
        "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX.\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert failure_reason(log) == (
        "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
    )
    assert failure_reason("") == "the server exited without output"


def test_shipped_example_targets_file_loads() -> None:
    root = Path(__file__).resolve().parents[3]
    cfg = load_targets_config(root / "scenarios" / "targets.example.toml")
    assert set(cfg) == {"bf16-gpu", "fp8-gpu", "fp8-local", "e5m2-local", "nvfp4-emu"}
    assert cfg["fp8-local"].is_local and cfg["fp8-local"].expect_cache_dtype == "fp8"
    assert cfg["e5m2-local"].expect_cache_dtype == "fp8_e5m2"
    assert cfg["nvfp4-emu"].emulated_format == "nvfp4" and cfg["nvfp4-emu"].rounding == "cuda"
    assert cfg["fp8-gpu"].api_key_env == "FP8_SERVER_KEY"
