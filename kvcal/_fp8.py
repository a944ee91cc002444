"""The FP8 (E4M3) round trip that vLLM applies to K and V when it writes them to an fp8 cache.

``e4m3_roundtrip(x, scale)`` returns what attention reads back from an FP8 cache slot: ``x``
quantized at ``scale`` exactly as vLLM's cache-write kernel stores it, dequantized as
``code * scale`` and rounded once to ``x``'s dtype. This module imports only torch: vLLM
plugins call it inside a server process, ``kvcal emulate`` inside transformers.

What vLLM's kernels do (vLLM 0.32; checked bit for bit against the installed CPU kernel
``torch.ops._C.cpu_attn_reshape_and_cache``, VEC and AMX layouts, bf16 and fp32 inputs):

``rounding="cpu"`` (the default: vLLM's CPU backend, ``--kv-cache-dtype fp8`` = fp8_e4m3)
    vllm-project/vllm ``csrc/cpu/cpu_attn.cpp`` (``cpu_attn_reshape_and_cache``) passes
    ``k_inv = 1.0f / (float)k_scale``; ``csrc/cpu/cpu_attn_fp8.hpp``
    (``float_to_fp8e4m3_scalar``, used by the VEC and AMX ``reshape_and_cache``) computes
    ``v = (float)x * inv``, clamps to [-448, 448] (``std::max(-448, std::min(448, v))``: +-inf
    saturate, NaN becomes +448), returns +0 for v == 0, and packs ``(v * 2**-120)``'s fp32
    bits as sign | bits[30:20]: the mantissa is TRUNCATED to 3 bits (round toward zero, not to
    nearest), negative values that truncate to zero keep their sign (-0). Below 2**-6 the
    product ``v * 2**-120`` is an fp32 subnormal, which rounds v to a multiple of 2**-29 (ties
    to even) before the truncation to E4M3's 2**-9 grid; that is reproduced here too.
``rounding="cuda"`` (vLLM's CUDA kernels)
    vllm-project/vllm ``csrc/cache_kernels.cu`` (``reshape_and_cache_flash_kernel``) calls
    ``fp8::scaled_convert<cache_t, scalar_t, kFp8E4M3>(x, k_scale)``;
    ``csrc/quantization/fp8/nvidia/quant_utils.cuh`` (``scaled_vec_conversion``) computes
    ``__nv_cvt_float_to_fp8((float)x / scale, __NV_SATFINITE, __NV_E4M3)``: a true fp32
    division, round to nearest even, +-inf and out-of-range values saturate to +-448, NaN
    stays NaN.

So CPU and CUDA differ: truncation vs round-to-nearest (CPU codes are biased toward zero by
half a step on average), reciprocal multiply vs division (1 ulp), NaN -> 448 vs NaN. torch's
own ``.to(torch.float8_e4m3fn)`` rounds to nearest even and, depending on the torch version,
saturates (2.13) or turns values past 464 into NaN (older c10 code); neither mode here relies
on which.

Dequantization is ``code * scale`` in fp32, then one rounding to ``x``'s dtype (or
``dtype=``). vLLM's attention kernels apply the scale inside their own arithmetic instead, so
with a scale that is not a power of two an emulated K/V can differ from what the kernel uses
by one rounding of the output dtype (about a bf16 step); at scale 1.0 every E4M3 value is
exact in bf16 and the two agree exactly.

Scale layout: a Python float, a 0-d (or one-element) tensor, or a tensor that broadcasts
against ``x`` with one scale per KV head on the head axis. vLLM hands its cache write
``[tokens, kv_heads, head_dim]`` (:func:`vllm_head_scale` gives ``[1, kv_heads, 1]``);
transformers' cache gets ``[batch, kv_heads, seq, head_dim]`` (:func:`hf_head_scale` gives
``[1, kv_heads, 1, 1]``). A checkpoint stores per-tensor scales as ``[]`` or ``[1]`` and
per-head scales as ``[kv_heads, 1, 1]``; both helpers accept any of these.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
ROUNDINGS = ("cpu", "cuda")
# fp32 bits kept by the CPU kernel's packing: sign, 8 exponent bits, top 3 mantissa bits
_KEEP_E4M3_BITS = -(1 << 20)  # 0xFFF00000 as int32
_SMALLEST_NORMAL = 2.0**-6


def _scale_f32(scale: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        return scale.to(device=like.device, dtype=torch.float32)
    s = float(scale)
    if not s > 0 or s == float("inf"):
        raise ValueError(f"an FP8 scale must be positive and finite, not {scale!r}")
    return torch.tensor(s, dtype=torch.float32, device=like.device)


def _codes_cpu(v: torch.Tensor) -> torch.Tensor:
    """E4M3 values (in fp32) that vLLM's CPU kernel stores for ``v = x * (1 / scale)``."""
    v = torch.where(torch.isnan(v), torch.full_like(v, E4M3_MAX), v)
    v = v.clamp(-E4M3_MAX, E4M3_MAX)
    a = v.abs()
    normal = (a.view(torch.int32) & _KEEP_E4M3_BITS).view(torch.float32)
    # subnormal E4M3 (|v| < 2**-6): v to a multiple of 2**-29 (ties to even), then truncated
    # to a multiple of 2**-9; every step is exact in fp32
    sub = torch.floor(torch.round(a * 2.0**29) * 2.0**-20) * 2.0**-9
    codes = torch.copysign(torch.where(a >= _SMALLEST_NORMAL, normal, sub), v)
    return torch.where(v == 0, torch.zeros_like(v), codes)


def _codes_cuda(v: torch.Tensor) -> torch.Tensor:
    """E4M3 values (in fp32) of ``__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)``."""
    # clamp keeps NaN; the cast then rounds to nearest even and never sees |v| > 448
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def e4m3_values(
    x: torch.Tensor, scale: torch.Tensor | float = 1.0, rounding: str = "cpu"
) -> torch.Tensor:
    """The E4M3 values (float32, before multiplying by the scale) that vLLM stores for ``x``."""
    s = _scale_f32(scale, x)
    xf = x.to(torch.float32)
    if rounding == "cpu":
        return _codes_cpu(xf * torch.reciprocal(s))
    if rounding == "cuda":
        return _codes_cuda(xf / s)
    raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, not {rounding!r}")


def e4m3_bytes(
    x: torch.Tensor, scale: torch.Tensor | float = 1.0, rounding: str = "cpu"
) -> torch.Tensor:
    """The uint8 codes an fp8 (e4m3) cache holds for ``x`` (to compare with a kernel's bytes)."""
    # the values are on the E4M3 grid, so this cast is exact whatever torch's own rounding
    return e4m3_values(x, scale, rounding).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_roundtrip(
    x: torch.Tensor,
    scale: torch.Tensor | float = 1.0,
    *,
    rounding: str = "cpu",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x`` written to an FP8 E4M3 cache at ``scale`` and read back, in ``x``'s dtype (or
    ``dtype``). ``scale``: a float, a 0-d tensor, or per KV head in a shape that broadcasts
    against ``x`` (see :func:`vllm_head_scale`, :func:`hf_head_scale`)."""
    s = _scale_f32(scale, x)
    out = e4m3_values(x, s, rounding) * s
    return out.to(dtype or x.dtype)


def _per_head(scale: torch.Tensor | float, kv_heads: int | None) -> torch.Tensor:
    s = (
        scale.detach().to(torch.float32)
        if isinstance(scale, torch.Tensor)
        else torch.tensor(float(scale), dtype=torch.float32)
    )
    if s.numel() == 1:
        return s.reshape(())
    if kv_heads is not None and s.numel() != kv_heads:
        raise ValueError(
            f"{s.numel()} scales for {kv_heads} KV heads: give one scale, or one per KV head"
        )
    return s.reshape(-1)


def vllm_head_scale(scale: torch.Tensor | float, kv_heads: int | None = None) -> torch.Tensor:
    """A scale for vLLM's ``[tokens, kv_heads, head_dim]``: 0-d, or ``[1, kv_heads, 1]``."""
    s = _per_head(scale, kv_heads)
    return s if s.dim() == 0 else s.reshape(1, -1, 1)


def hf_head_scale(scale: torch.Tensor | float, kv_heads: int | None = None) -> torch.Tensor:
    """A scale for transformers' ``[batch, kv_heads, seq, head_dim]``: 0-d, or
    ``[1, kv_heads, 1, 1]``."""
    s = _per_head(scale, kv_heads)
    return s if s.dim() == 0 else s.reshape(1, -1, 1, 1)
