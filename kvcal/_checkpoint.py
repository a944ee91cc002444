"""The calibrated checkpoint: an overlay folder vLLM loads, and what freezes its meaning.

The overlay links every file of the original model (multi-GB weights are never copied),
replaces ``config.json`` with one that declares the compressed-tensors ``kv_cache_scheme``,
adds the k/v scales as an extra shard and writes ``model.safetensors.index.json`` naming
both, so vLLM loads the original shards and the scales together. Beside it: the calibration
manifest (model path, digests of config, weights, tokenizer and chat template, recipe, seed,
sample ids, tool version), an LLM Compressor recipe and the samples as a dataset file, and,
on request, vLLM's deprecated JSON scale file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replay.core.errors import InputError
from replay.rundir.files import file_digest

from . import __version__
from ._preflight import INDEX, weight_map

if TYPE_CHECKING:  # _scales computes with torch; the manifest and digests need none
    from ._scales import TensorReport

SCALES_SHARD = "kv_scales.safetensors"
SINGLE_FILE = "model.safetensors"
SINGLE_FILE_LINK = "model-weights.safetensors"
MANIFEST = "kvcal_manifest.json"  # replay reads "sample_ids" from it to refuse an overlap
RECIPE = "recipe.yaml"
LEGACY_SCALES = "kv_cache_scales.json"
STRATEGIES = ("tensor", "attn_head")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)
OWN_FILES = {"config.json", INDEX, SCALES_SHARD, MANIFEST, RECIPE, LEGACY_SCALES}


def kv_cache_scheme(strategy: str) -> dict[str, Any]:
    return {
        "num_bits": 8,
        "type": "float",
        "strategy": strategy,
        "dynamic": False,
        "symmetric": True,
    }


def quantization_config(original: dict[str, Any] | None, strategy: str) -> dict[str, Any]:
    """DESIGN.md section 4's block, or the model's own compressed-tensors block with the
    KV scheme added (its weight schemes stay)."""
    if original:
        if original.get("quant_method") != "compressed-tensors":
            raise InputError(
                f"the model is quantized with '{original.get('quant_method')}'; "
                "kvcal adds K/V scales to BF16 or compressed-tensors checkpoints "
                "only"
            )
        return {**original, "kv_cache_scheme": kv_cache_scheme(strategy)}
    return {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "compressed",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": kv_cache_scheme(strategy),
    }


def model_digests(model_dir: Path) -> dict[str, Any]:
    """What a scale file means only together with: config, weights, tokenizer, template."""
    weights = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin"))
    tokenizer = [model_dir / n for n in TOKENIZER_FILES if (model_dir / n).is_file()]
    template = [
        p
        for p in (model_dir / "chat_template.jinja", model_dir / "chat_template.json")
        if p.is_file()
    ]
    tok_cfg = model_dir / "tokenizer_config.json"
    embedded = None
    if tok_cfg.is_file():
        embedded = json.loads(tok_cfg.read_text(encoding="utf-8")).get("chat_template")
    return {
        "config": file_digest(model_dir / "config.json"),
        "weights": {p.name: file_digest(p) for p in weights},
        "tokenizer": {p.name: file_digest(p) for p in tokenizer},
        "chat_template": {
            **{p.name: file_digest(p) for p in template},
            **(
                {
                    "tokenizer_config.json:chat_template": hashlib.sha256(
                        json.dumps(embedded).encode()
                    ).hexdigest()
                }
                if embedded
                else {}
            ),
        },
    }


def scale_tensors(reports: Sequence[TensorReport], strategy: str, dtype: Any) -> dict[str, Any]:
    """``model.layers.{i}.self_attn.{k,v}_scale`` in the model's dtype: shape [] per tensor
    (LLM Compressor writes [1]; vLLM's loader takes either), [kv_heads, 1, 1] per head."""
    import torch

    out = {}
    for r in reports:
        name = f"model.layers.{r.layer}.self_attn.{r.which}_scale"
        if strategy == "tensor":
            out[name] = torch.tensor(r.scale, dtype=dtype)
        else:
            out[name] = torch.tensor(r.head_scales, dtype=dtype).reshape(-1, 1, 1)
    return out


def _original_weight_map(model_dir: Path) -> dict[str, str]:
    out = weight_map(model_dir)
    if not out:
        raise InputError(
            f"{model_dir}: no *.safetensors weights; convert the checkpoint to "
            "safetensors first (vLLM and kvcal read those)"
        )
    return out


def write_overlay(
    model_dir: Path, out_dir: Path, reports: Sequence[TensorReport], strategy: str
) -> dict[str, Any]:
    """Write the overlay; returns the config it wrote."""
    import torch
    from safetensors.torch import save_file

    if strategy not in STRATEGIES:
        raise InputError(f"--strategy: '{strategy}' is not one of {', '.join(STRATEGIES)}")
    model_dir = model_dir.resolve()
    if out_dir.resolve() == model_dir:
        raise InputError(f"-o {out_dir}: the overlay must be a new folder, not the model itself")
    weight_map = _original_weight_map(model_dir)
    carried = [k for k in weight_map if k.endswith((".k_scale", ".v_scale"))]
    if carried:
        raise InputError(
            f"{model_dir} already carries k/v scales ({carried[0]}, ...): "
            "calibrate the original BF16 checkpoint, not a calibrated one"
        )
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = quantization_config(config.get("quantization_config"), strategy)
    dtype = getattr(torch, str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for src in sorted(model_dir.iterdir()):
        if src.name in OWN_FILES:
            continue
        link = out_dir / src.name
        if link.is_symlink() or link.exists():
            if link.is_symlink() and Path(os.readlink(link)) == src:
                continue
            raise InputError(
                f"{link} exists and is not a link to {src}; write the overlay into a new folder"
            )
        link.symlink_to(src)
    tensors = scale_tensors(reports, strategy, dtype)
    weight_map = _rename_single_file(out_dir, weight_map)
    save_file(tensors, str(out_dir / SCALES_SHARD), metadata={"format": "pt"})
    weight_map.update({name: SCALES_SHARD for name in tensors})
    (out_dir / INDEX).write_text(
        json.dumps(
            {"metadata": {"kvcal": __version__}, "weight_map": dict(sorted(weight_map.items()))},
            indent=2,
        )
        + "\n",
        encoding="utf-8",
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return config


def _rename_single_file(out_dir: Path, weight_map: dict[str, str]) -> dict[str, str]:
    """transformers loads a folder's ``model.safetensors`` in preference to the index, and
    would miss the scales shard (it reports k_scale/v_scale MISSING and leaves them
    uninitialised). So the link to a single-file checkpoint takes a shard's name, and only
    the index names the weights, as vLLM reads them too."""
    single = out_dir / SINGLE_FILE
    if not single.is_symlink():
        return weight_map
    single.rename(out_dir / SINGLE_FILE_LINK)
    return {k: SINGLE_FILE_LINK if v == SINGLE_FILE else v for k, v in weight_map.items()}


def legacy_scales(reports: Sequence[TensorReport], model_type: str) -> dict[str, Any]:
    """vLLM's deprecated ``--quantization-param-path`` file: one scale per layer (K and V
    share it there, so the larger of the two), tensor-parallel rank 0."""
    per_layer: dict[str, float] = {}
    for r in reports:
        per_layer[str(r.layer)] = max(per_layer.get(str(r.layer), 0.0), r.scale)
    return {
        "model_type": model_type,
        "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": per_layer}},
    }


def recipe_yaml(strategy: str) -> str:
    """The same KV scheme as an LLM Compressor recipe. ``static_minmax`` keeps the min/max
    over every calibration batch, as kvcal does; LLM Compressor's default ``minmax`` is a
    moving average and ``memoryless_minmax`` keeps the last batch only."""
    return (
        "# LLM Compressor recipe for the same K/V scheme kvcal calibrated. Its samples are\n"
        "# samples.jsonl beside it (input_ids): load them with\n"
        "# datasets.load_dataset('json', data_files='samples.jsonl') and pass the dataset to\n"
        "# oneshot (its dataset_path loader skips files that do not end in 'json').\n"
        "quant_stage:\n"
        "  quant_modifiers:\n"
        "    QuantizationModifier:\n"
        "      kv_cache_scheme:\n"
        "        num_bits: 8\n"
        "        type: float\n"
        f"        strategy: {strategy}\n"
        "        dynamic: false\n"
        "        symmetric: true\n"
        "        observer: static_minmax\n"
    )


def read_manifest(overlay: Path) -> dict[str, Any]:
    path = overlay / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError:
        raise InputError(
            f"{overlay}: no {MANIFEST}; is this a folder `kvcal calibrate` wrote?"
        ) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict) or "model" not in data:
        raise InputError(f"{path}: field 'model' is missing; rewrite it with `kvcal calibrate`")
    return dict(data)
