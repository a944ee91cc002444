"""A quantized KV cache (FP8 E4M3/E5M2, per-token-head INT8/FP8/INT4, NVFP4) emulated inside a
real vLLM server that stores BF16.

vLLM CPU serves an FP8 KV cache only where the CPU has AVX-512 or AMX, and the other formats
only on GPUs. Elsewhere this plugin lets the replay, grading and verdict paths run anyway:
the server keeps its BF16 cache, and every K and V written to it first goes through the round
trip the real cache applies (``kvcal._kv_formats``), at the layer's scale for the formats
that read one. Attention then reads what that cache would have returned, up to the attention
kernel's own arithmetic (about a bf16 step). Capacity and kernel speed are those of BF16: an
emulated target's capacity figures are never "served".

The hook is the cache write, ``CPUAttentionBackendImpl.do_kv_cache_update``: vLLM calls it
through its ``unified_kv_cache_update`` custom op, in Python, also under torch.compile. It is
the same point kvcal observes and ``kvcal emulate`` rounds at (after RoPE).

Scales: the layer's ``_k_scale``/``_v_scale`` tensors, which hold what a quantization method
loaded from the checkpoint even when the cache is not quantized (seen on vLLM CPU 0.32: 6.69
for the twin's overlay, while the float copies the FP8 kernels read stay 1.0), and vLLM's
defaults of 1.0 for a checkpoint without a quantization config. A calibrated overlay is thus
emulated at its own scales, per tensor or per KV head. Its server must name the model's dtype
as ``--kv-cache-dtype``: under ``auto`` vLLM serves a real FP8 cache for a checkpoint that
declares a ``kv_cache_scheme``, and the plugin then leaves it alone (never rounding twice).

It is a ``vllm.general_plugins`` entry point, so vLLM imports it in every process of every
server in this environment; it does nothing unless ``KVCANARY_KV_EMULATION=FORMAT`` (a
``--kv-cache-dtype`` name) is in that server's environment (the replay sets it only for
targets with ``kv_cache_dtype = "FORMAT-emulated"``). ``KVCANARY_KV_EMULATION_ROUNDING`` is
``cpu`` (truncation, vLLM CPU's FP8) or ``cuda``, by default the engine's for the format
(``ENGINE_ROUNDING``). ``KVCANARY_KV_EMULATION_SKIP_LAYERS=0,3`` keeps layers in BF16, as
``--kv-cache-dtype-skip-layers`` does on a served cache. It announces itself in the server log
with :data:`MARKER` followed by ``[FORMAT, ROUNDING rounding]``, which is how the replay knows
which emulation really ran.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "KVCANARY_KV_EMULATION"
ENV_ROUNDING = "KVCANARY_KV_EMULATION_ROUNDING"
ENV_SKIP = "KVCANARY_KV_EMULATION_SKIP_LAYERS"
MARKER = "kvcanary kv emulation:"


def register() -> None:
    """The entry point vLLM calls in each process; a no-op unless the server asked for it."""
    fmt = os.environ.get(ENV, "").strip()
    if not fmt:
        return
    from ._kv_formats import ENGINE_ROUNDING, check_format

    check_format(fmt)
    rounding = os.environ.get(ENV_ROUNDING, "").strip() or ENGINE_ROUNDING[fmt]
    if rounding not in ("cpu", "cuda"):
        raise ValueError(f"{ENV_ROUNDING}={rounding!r}: expected cpu or cuda")
    skip = parse_skip_layers(os.environ.get(ENV_SKIP, ""))
    _patch_cache_write(fmt, rounding, skip)
    _log().info(
        "%s active [%s, %s rounding] (round trip at the cache write, BF16 storage, skip layers %s)",
        MARKER,
        fmt,
        rounding,
        ",".join(map(str, sorted(skip))) or "none",
    )


def parse_skip_layers(text: str) -> frozenset[int]:
    try:
        return frozenset(int(p) for p in text.replace(" ", "").split(",") if p)
    except ValueError:
        raise ValueError(f"{ENV_SKIP}={text!r}: expected layer indices such as 0,3") from None


def _log() -> Any:
    from vllm.logger import init_logger

    # under "vllm.": vLLM configures handlers for its own logger tree only
    return init_logger("vllm.kvcanary_fp8_emulation")


def _patch_cache_write(fmt: str, rounding: str, skip: frozenset[int]) -> None:
    import torch
    from vllm.utils.torch_utils import is_quantized_kv_cache
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from ._fp8 import vllm_head_scale
    from ._kv_formats import SCALED, kv_roundtrip

    original = CPUAttentionBackendImpl.do_kv_cache_update
    if getattr(original, "_kvcanary", False):
        return
    announced: set[str] = set()

    def scale_of(layer: Any, name: str, heads: int) -> torch.Tensor | float:
        scale = getattr(layer, f"_{name}", None)
        if scale is None or not bool((scale > 0).all()):
            return 1.0
        # per KV head: [1, heads, 1] over vLLM's [tokens, kv_heads, head_size]
        return vllm_head_scale(scale, heads)

    def emulated_write(
        self: Any,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        name = getattr(layer, "layer_name", "")
        # a served FP8 cache quantizes itself: never round twice
        if not is_quantized_kv_cache(self.kv_cache_dtype) and _index(name) not in skip:
            k_scale = scale_of(layer, "k_scale", key.shape[1])
            v_scale = scale_of(layer, "v_scale", value.shape[1])
            if name not in announced:
                announced.add(name)
                _announce(name, fmt in SCALED, k_scale, v_scale, _loads_scales(layer))
            key = kv_roundtrip(fmt, key, k_scale, rounding=rounding)
            value = kv_roundtrip(fmt, value, v_scale, rounding=rounding)
        original(self, layer, key, value, kv_cache, slot_mapping)

    emulated_write._kvcanary = True  # type: ignore[attr-defined]
    CPUAttentionBackendImpl.do_kv_cache_update = emulated_write  # type: ignore[method-assign]


def _announce(name: str, scaled: bool, k_scale: Any, v_scale: Any, loaded: bool) -> None:
    if not scaled:  # vLLM resets a per-token-head layer's checkpoint scales to 1.0 too
        _log().info("%s %s scales per token and head, at the cache write", MARKER, name)
        return
    source = "checkpoint" if loaded else "default"
    _log().info(
        "%s %s k_scale %s v_scale %s (%s)",
        MARKER,
        name,
        _describe(k_scale),
        _describe(v_scale),
        source,
    )


def _index(layer_name: str) -> int | None:
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return int(extract_layer_index(layer_name))
    except (AssertionError, ValueError):
        return None


def _loads_scales(layer: Any) -> bool:
    """Whether a quantization method loaded this layer's scales from the checkpoint (else
    they are vLLM's defaults of 1.0, as for a model without a quantization config)."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    return isinstance(getattr(layer, "quant_method", None), BaseKVCacheMethod)


def _describe(scale: Any) -> str:
    values = [scale] if isinstance(scale, float) else scale.flatten().tolist()
    if len(values) == 1:
        return f"{values[0]:.6g}"
    return "per head [" + ", ".join(f"{v:.4g}" for v in values) + "]"
