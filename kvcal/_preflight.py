"""What kvcal checks of a checkpoint folder before it trusts what the folder says.

A broken folder gets one line that names the file, what is wrong and what to do, instead of a
traceback from json, safetensors or transformers; or, worse, a model that transformers quietly
completes with random weights (a config that claims more layers than the weights hold), or
scales that no FP8 cache can use, printed as if they were fine.

    read_config      config.json: there, JSON, an object; its quantization_config an object
    TOKENIZER_VOCAB  the files one of which a tokenizer needs
    weight_map       every tensor's name and its shard: the index's map, or the shards' headers,
                     each header checked against its file's size (no torch, nothing loaded)
    check_layers     num_hidden_layers against the layer indices the weights hold
    check_weights    both, before transformers loads the folder
    unusable_scales  k/v scales that are NaN, infinite, negative, zero or absurd
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from replay.core.errors import InputError

INDEX = "model.safetensors.index.json"
# A tokenizer's vocabulary is in one of these (the fast one's, SentencePiece's, BPE's, WordPiece's).
TOKENIZER_VOCAB = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
# safetensors refuses a header above 100 MB; a length past that is not a header.
_HEADER_LIMIT = 100_000_000
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_AGAIN = "download or copy the checkpoint again"

# A scale is amax / 448. A model's largest K or V stays within a few thousand (the outlier
# twin's keys, pushed past FP8's range on purpose, reach that) and far above 1e-6: a scale
# outside these bounds, orders of magnitude beyond both, comes from a broken file or a broken
# calibration (K/V observed through random scale parameters, say), not from a model.
SCALE_FLOOR, SCALE_CEILING = 1e-9, 1e9  # as the messages write them: 1e-9..1e9


def _kind(value: Any) -> str:
    """How JSON would name ``value``'s type, for a message."""
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "a number"
    )


def read_config(model_dir: Path) -> dict[str, Any]:
    """``config.json`` as a JSON object, with ``quantization_config`` an object where present."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise InputError(f"{model_dir}: no config.json; give the model folder the server loads")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(
            f"{path}: not valid JSON ({exc}); restore the model's own config.json"
        ) from None
    if not isinstance(config, dict):
        raise InputError(
            f"{path}: must be a JSON object of model settings, got {_kind(config)}; "
            "restore the model's own config.json"
        )
    qcfg = config.get("quantization_config")
    if qcfg is not None and not isinstance(qcfg, dict):
        raise InputError(
            f"{path}: field 'quantization_config': must be an object (quant_method, "
            f"kv_cache_scheme, ...), got {_kind(qcfg)}; delete the field for an unquantized model"
        )
    return config


def shard_tensors(shard: Path) -> list[str]:
    """A safetensors file's tensor names, once its header parses and the tensors it describes
    fill the file exactly (what safetensors itself demands when it opens the file)."""
    try:
        size = shard.stat().st_size
        with shard.open("rb") as fh:
            head = fh.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else 0
            if not 0 < length <= min(_HEADER_LIMIT, size - 8):
                raise InputError(
                    f"{shard}: not a safetensors file (its first 8 bytes give no header "
                    f"length that fits its {size} bytes); {_AGAIN}"
                )
            header = json.loads(fh.read(length))
    except OSError as exc:
        raise InputError(f"{shard}: cannot read it ({exc.strerror}); {_AGAIN}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InputError(
            f"{shard}: not a safetensors file (its header is not JSON); {_AGAIN}"
        ) from None
    if not isinstance(header, dict):
        raise InputError(f"{shard}: not a safetensors file (its header is no object); {_AGAIN}")
    names = [k for k in header if k != "__metadata__"]
    end = _data_end(shard, {name: header[name] for name in names})
    held = size - 8 - length
    if end != held:
        what = "truncated" if end > held else f"{held - end} bytes past its last tensor"
        raise InputError(
            f"{shard}: {what}: its header describes {end} bytes of tensors, the file holds "
            f"{held}; {_AGAIN}"
        )
    return names


def _data_end(shard: Path, entries: Mapping[str, Any]) -> int:
    """Where the tensors' data ends, once their ``data_offsets`` tile it without a gap or an
    overlap (as safetensors checks)."""
    spans = []
    for name, entry in entries.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise InputError(
                f"{shard}: not a safetensors file (tensor '{name}' has no data_offsets); {_AGAIN}"
            )
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end or stop < begin:
            raise InputError(
                f"{shard}: not a safetensors file (tensor '{name}' overlaps another or "
                f"leaves a gap); {_AGAIN}"
            )
        end = stop
    return end


def weight_map(model_dir: Path) -> dict[str, str]:
    """Every tensor's name and the file that holds it: the index's ``weight_map`` where there
    is an index (each shard it names checked), else every ``*.safetensors`` file's header;
    empty for a folder without safetensors weights."""
    index = model_dir / INDEX
    if not index.is_file():
        return {
            name: shard.name
            for shard in sorted(model_dir.glob("*.safetensors"))
            for name in shard_tensors(shard)
        }
    try:
        mapping = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        mapping = None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise InputError(
            f"{index}: field 'weight_map': must map tensor names to shard files; {_AGAIN}"
        )
    for name in sorted(set(mapping.values())):
        shard = model_dir / name
        if not shard.is_file():
            raise InputError(f"{index}: names {name}, which {model_dir} lacks; {_AGAIN}")
        shard_tensors(shard)
    return dict(mapping)


def check_layers(model_dir: Path, config: Mapping[str, Any], names: Iterable[str]) -> None:
    """Refuse a config whose ``num_hidden_layers`` the weights contradict: transformers gives
    a layer without weights random ones (a log line says so) and kvcal would calibrate, or
    emulate, noise. Weights named otherwise than ``layers.N`` (``h.N``) have nothing to
    compare, and neither has a config without the field."""
    path = model_dir / "config.json"
    text = config if "num_hidden_layers" in config else config.get("text_config")
    declared = text.get("num_hidden_layers") if isinstance(text, dict) else None
    if declared is None:
        return
    if not isinstance(declared, int) or isinstance(declared, bool) or declared < 1:
        raise InputError(
            f"{path}: field 'num_hidden_layers': must be a positive integer, got "
            f"{json.dumps(declared)}; restore the model's own config.json"
        )
    held = {int(m.group(1)) for name in names if (m := _LAYER.search(name))}
    missing = sorted(set(range(declared)) - held)
    if not held or not missing:
        return
    raise InputError(
        f"{path}: num_hidden_layers is {declared}, but the weights hold none for layers "
        f"{_spans(missing)} ({len(missing)} of {declared}), which transformers would fill "
        f"with random weights; set num_hidden_layers to {max(held) + 1}, the layers the "
        "weights hold, or add the missing shards"
    )


def _spans(indices: Sequence[int]) -> str:
    """``[4, 5, 6, 9]`` as ``4-6, 9``."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def check_weights(model_dir: Path) -> dict[str, Any]:
    """What transformers would otherwise trip over, or paper over, when it loads the folder:
    config.json, every safetensors header, the layer count. Returns the config."""
    config = read_config(model_dir)
    check_layers(model_dir, config, weight_map(model_dir))
    return config


def unusable_scales(scales: Mapping[str, Sequence[float]]) -> dict[str, str]:
    """The k/v scale tensors no FP8 cache can use, each with its first bad value and why:
    NaN, infinite, negative, zero, or outside ``SCALE_FLOOR``..``SCALE_CEILING``."""
    out = {}
    for name, values in scales.items():
        for v in values:
            why = _scale_problem(v)
            if why is not None:
                out[name] = why
                break
    return out


def _scale_problem(v: float) -> str | None:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return f"{v} (infinite)"
    if v < 0:
        return f"{v:.4g} (negative)"
    if v == 0:
        return "0 (zero)"
    if not SCALE_FLOOR <= v <= SCALE_CEILING:
        return f"{v:.4g} (absurd: outside 1e-9..1e9)"
    return None
