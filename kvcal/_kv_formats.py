"""Every KV-cache format kvcanary emulates, by vLLM's ``--kv-cache-dtype`` name: one round
trip function for all of them (imports only torch, as the vLLM plugin needs).

    fp8, fp8_e4m3, fp8_e5m2                      per-tensor scale     ``_fp8``
    int8_per_token_head, fp8_per_token_head,     a scale per token    ``_kv_dynamic``
    int4_per_token_head                          and KV head, at write
    nvfp4, nvfp4_4over6                          E4M3 per 16 values   ``_nvfp4``
                                                 + per-tensor scale

``scale`` is the layer's k/v scale (what a checkpoint carries, else 1.0); the per-token-head
formats ignore it, as vLLM does. Every function works on head_dim as the last axis, so vLLM's
``[tokens, kv_heads, head_dim]`` and transformers' ``[batch, kv_heads, seq, head_dim]`` both
take it. The facts about each format (bytes per token, what vLLM CPU serves) are
``replay.serving.kv_formats``'; a test checks that both name the same emulated formats.
"""

from __future__ import annotations

import torch

from ._fp8 import ROUNDINGS, fp8_roundtrip
from ._fp8_table import fp8_roundtrip_lookup
from ._kv_dynamic import per_token_head_roundtrip
from ._nvfp4 import nvfp4_roundtrip

EMULATED = (
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "int8_per_token_head",
    "fp8_per_token_head",
    "int4_per_token_head",
    "nvfp4",
    "nvfp4_4over6",
)
SCALED = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4", "nvfp4_4over6"})
# The engine's rounding for each: vLLM CPU serves the FP8 formats (and kvcanary's servers are
# CPU ones); only CUDA serves the others.
ENGINE_ROUNDING = {f: ("cpu" if f.startswith("fp8") and f in SCALED else "cuda") for f in EMULATED}


def check_format(fmt: str) -> str:
    if fmt not in EMULATED:
        raise ValueError(f"'{fmt}' is not an emulated KV format; choose from {', '.join(EMULATED)}")
    return fmt


def kv_roundtrip(
    fmt: str, x: torch.Tensor, scale: torch.Tensor | float = 1.0, *, rounding: str
) -> torch.Tensor:
    """``x`` (head_dim last) written to a ``fmt`` cache and read back, in ``x``'s dtype."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, not {rounding!r}")
    if fmt in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        kind = "e5m2" if fmt == "fp8_e5m2" else "e4m3"
        looked_up = fp8_roundtrip_lookup(x, scale, rounding=rounding, kind=kind)
        if looked_up is not None:  # a bf16/fp16 tensor: the same values, by table
            return looked_up
        return fp8_roundtrip(x, scale, rounding=rounding, kind=kind)
    if fmt.endswith("_per_token_head"):
        return per_token_head_roundtrip(x, fmt.split("_")[0], rounding=rounding)
    if fmt in ("nvfp4", "nvfp4_4over6"):
        # the store kernel reads one k/v scale (*k_scale_ptr): a per-head one's first
        if isinstance(scale, torch.Tensor) and scale.numel() > 1:
            scale = scale.flatten()[0]
        return nvfp4_roundtrip(x, scale, rounding=rounding, four_over_six=fmt == "nvfp4_4over6")
    raise ValueError(f"'{fmt}' is not an emulated KV format; choose from {', '.join(EMULATED)}")
