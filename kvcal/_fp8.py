"""The FP8 round trips (E4M3 and E5M2) that vLLM applies to K and V when it writes them to an
fp8 cache.

``fp8_roundtrip(x, scale, kind=...)`` returns what attention reads back from an FP8 cache
slot: ``x`` quantized at ``scale`` exactly as vLLM's cache-write kernel stores it,
dequantized as ``code * scale`` and rounded once to ``x``'s dtype; ``e4m3_*`` are the E4M3
ones. This module imports only torch: vLLM plugins call it inside a server process,
``kvcal emulate`` inside transformers.

What vLLM's kernels do (vLLM 0.32; checked bit for bit against the installed CPU kernel
``torch.ops._C.cpu_attn_reshape_and_cache``, VEC and AMX layouts, bf16 and fp32 inputs, for
``fp8`` and ``fp8_e5m2`` caches):

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
    E5M2 (``float_to_fp8e5m2_scalar``): the same multiply, clamp to [-57344, 57344] (NaN
    becomes +57344) and +0 for zero; the fp32 exponent and the top 2 mantissa bits are kept
    (truncated); below 2**-14 the value is ``floor(|v| * 2**16)`` subnormal steps, exactly.
``rounding="cuda"`` (vLLM's CUDA kernels)
    vllm-project/vllm ``csrc/cache_kernels.cu`` (``reshape_and_cache_flash_kernel``) calls
    ``fp8::scaled_convert<cache_t, scalar_t, kv_dt>(x, k_scale)``;
    ``csrc/quantization/fp8/nvidia/quant_utils.cuh`` (``scaled_vec_conversion``) computes
    ``__nv_cvt_float_to_fp8((float)x / scale, __NV_SATFINITE, __NV_E4M3)`` (``__NV_E5M2``
    for fp8_e5m2): a true fp32 division, round to nearest even, +-inf and out-of-range values
    saturate to the largest finite value (448, 57344), NaN stays NaN.

So CPU and CUDA differ: truncation vs round-to-nearest (CPU codes are biased toward zero by
half a step on average), reciprocal multiply vs division (1 ulp), NaN -> max vs NaN. torch's
own ``.to(torch.float8_*)`` rounds to nearest even; out of range it saturates or overflows
depending on the format and version, so the CUDA mode clamps first and relies on neither.

Dequantization is ``code * scale`` in fp32, then one rounding to ``x``'s dtype (or
``dtype=``). vLLM's attention kernels apply the scale inside their own arithmetic instead, so
with a scale that is not a power of two an emulated K/V can differ from what the kernel uses
by one rounding of the output dtype (about a bf16 step); at scale 1.0 every E4M3 value is
exact in bf16 and the two agree exactly (E5M2 values below bf16's range are the exception).

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
E5M2_MAX = 57344.0
ROUNDINGS = ("cpu", "cuda")
KINDS = ("e4m3", "e5m2")
# fp32 bits kept by the CPU kernels' packing: sign, 8 exponent bits, top 3 (2) mantissa bits
_KEEP_E4M3_BITS = -(1 << 20)  # 0xFFF00000 as int32
_KEEP_E5M2_BITS = -(1 << 21)  # 0xFFE00000 as int32
_SMALLEST_NORMAL = 2.0**-6
_E5M2_SMALLEST_NORMAL = 2.0**-14


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


def _codes_e5m2_cpu(v: torch.Tensor) -> torch.Tensor:
    """E5M2 values (in fp32) that vLLM's CPU kernel stores for ``v = x * (1 / scale)``."""
    v = torch.where(torch.isnan(v), torch.full_like(v, E5M2_MAX), v)
    v = v.clamp(-E5M2_MAX, E5M2_MAX)
    a = v.abs()
    normal = (a.view(torch.int32) & _KEEP_E5M2_BITS).view(torch.float32)
    sub = torch.floor(a * 2.0**16) * 2.0**-16  # exact: a < 2**-14
    codes = torch.copysign(torch.where(a >= _E5M2_SMALLEST_NORMAL, normal, sub), v)
    return torch.where(v == 0, torch.zeros_like(v), codes)


_FP8 = {"e4m3": (E4M3_MAX, torch.float8_e4m3fn), "e5m2": (E5M2_MAX, torch.float8_e5m2)}


def _kind(kind: str) -> tuple[float, torch.dtype]:
    try:
        return _FP8[kind]
    except KeyError:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}") from None


def fp8_codes(v: torch.Tensor, rounding: str = "cpu", kind: str = "e4m3") -> torch.Tensor:
    """The FP8 values (fp32) a kernel stores for ``v``, already divided by its scale: vLLM
    CPU's truncation (``cpu``) or CUDA's ``__NV_SATFINITE`` round-to-nearest-even (``cuda``).
    The per-token-head FP8 format uses it too, on values it scaled itself."""
    top, torch_dtype = _kind(kind)
    if rounding == "cpu":
        return _codes_cpu(v) if kind == "e4m3" else _codes_e5m2_cpu(v)
    if rounding == "cuda":
        # clamp keeps NaN; the cast then rounds to nearest even and never sees |v| > max
        return v.clamp(-top, top).to(torch_dtype).to(torch.float32)
    raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, not {rounding!r}")


def fp8_values(
    x: torch.Tensor, scale: torch.Tensor | float = 1.0, rounding: str = "cpu", kind: str = "e4m3"
) -> torch.Tensor:
    """The FP8 values (float32, before multiplying by the scale) that vLLM stores for ``x``:
    the CPU kernel multiplies by ``1 / scale``, CUDA divides."""
    s = _scale_f32(scale, x)
    xf = x.to(torch.float32)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, not {rounding!r}")
    v = xf * torch.reciprocal(s) if rounding == "cpu" else xf / s
    return fp8_codes(v, rounding, kind)


def fp8_bytes(
    x: torch.Tensor, scale: torch.Tensor | float = 1.0, rounding: str = "cpu", kind: str = "e4m3"
) -> torch.Tensor:
    """The uint8 codes an fp8 cache holds for ``x`` (to compare with a kernel's bytes)."""
    # the values are on the FP8 grid, so this cast is exact whatever torch's own rounding
    return fp8_values(x, scale, rounding, kind).to(_kind(kind)[1]).view(torch.uint8)


def fp8_roundtrip(
    x: torch.Tensor,
    scale: torch.Tensor | float = 1.0,
    *,
    rounding: str = "cpu",
    kind: str = "e4m3",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x`` written to an FP8 cache (``kind`` e4m3 or e5m2) at ``scale`` and read back, in
    ``x``'s dtype (or ``dtype``). ``scale``: a float, a 0-d tensor, or per KV head in a shape
    that broadcasts against ``x`` (see :func:`vllm_head_scale`, :func:`hf_head_scale`)."""
    s = _scale_f32(scale, x)
    out = fp8_values(x, s, rounding, kind) * s
    return out.to(dtype or x.dtype)


def e4m3_values(
    x: torch.Tensor, scale: torch.Tensor | float = 1.0, rounding: str = "cpu"
) -> torch.Tensor:
    """The E4M3 values (float32, before multiplying by the scale) that vLLM stores for ``x``."""
    return fp8_values(x, scale, rounding, "e4m3")


def e4m3_bytes(
    x: torch.Tensor, scale: torch.Tensor | float = 1.0, rounding: str = "cpu"
) -> torch.Tensor:
    """The uint8 codes an fp8 (e4m3) cache holds for ``x``."""
    return fp8_bytes(x, scale, rounding, "e4m3")


def e4m3_roundtrip(
    x: torch.Tensor,
    scale: torch.Tensor | float = 1.0,
    *,
    rounding: str = "cpu",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x`` written to an FP8 E4M3 cache at ``scale`` and read back (:func:`fp8_roundtrip`)."""
    return fp8_roundtrip(x, scale, rounding=rounding, kind="e4m3", dtype=dtype)


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
