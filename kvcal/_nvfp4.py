"""The NVFP4 KV cache: E2M1 values, an E4M3 scale per 16 values along head_dim, and the
layer's per-tensor k/v scale above them; and its 4-over-6 variant.

What vLLM does (``nvfp4``, ``nvfp4_4over6``; served by FlashInfer on Blackwell and some
Hopper/Ampere paths, never on CPU):

* the store, vllm-project/vllm ``csrc/libtorch_stable/quantization/fp4/
  nvfp4_kv_cache_kernels.cu`` (``reshape_and_cache_nvfp4_kernel``): ``global_scale = 1 /
  k_scale`` (the checkpoint's, else 1.0), then ``nvfp4_utils.cuh``
  (``cvt_warp_fp16_to_fp4``) per 16 values: ``sf = global_scale * (max|x| * (1/6))`` as E4M3
  (round to nearest even, saturating), ``out_scale = 1 / (sf * (1 / global_scale))`` (0 when
  sf is 0) and each ``x * out_scale`` to E2M1 (``cvt.rn.satfinite.e2m1x2.f32``: nearest even,
  saturating at 6); attention reads ``e2m1 * sf * k_scale``;
* the engine's reference of the same arithmetic, which runs on CPU and which this module
  matches bit for bit (codes and block scales, in the tests): ``vllm/model_executor/layers/
  quantization/utils/nvfp4_emulation_utils.py`` (``ref_nvfp4_quant``, ``cast_to_fp4``). The
  CUDA kernel's reciprocals are ``rcp.approx.ftz``; the reference's, and this module's, are
  exact, which can move a value across a rounding boundary by an ulp;
* ``nvfp4_4over6`` (``vllm/config/cache.py``: it "selects between max/6 and max/4 scales per
  16 values by minimizing squared reconstruction error"; the kernel is not in the installed
  package): both candidates quantized as above, the block keeps max/4's when its squared
  error is strictly smaller (a tie keeps max/6, as TransformerEngine's 4-over-6 does).

``rounding="cuda"`` is that; ``rounding="cpu"`` truncates both conversions toward zero (the
E4M3 block scale as vLLM CPU truncates FP8, and E2M1) as a what-if: no CPU kernel stores NVFP4.
"""

from __future__ import annotations

import torch

from ._fp8 import E4M3_MAX, ROUNDINGS, fp8_codes

BLOCK = 16
E2M1_MAX = 6.0
_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_nearest(v: torch.Tensor) -> torch.Tensor:
    """E2M1 to nearest, ties to even (vLLM's ``cast_to_fp4`` thresholds; ``v`` in [-6, 6])."""
    a = v.abs()
    out = torch.zeros_like(a)
    out = torch.where(a > 0.25, 0.5, out)
    out = torch.where(a >= 0.75, 1.0, out)
    out = torch.where(a > 1.25, 1.5, out)
    out = torch.where(a >= 1.75, 2.0, out)
    out = torch.where(a > 2.5, 3.0, out)
    out = torch.where(a >= 3.5, 4.0, out)
    out = torch.where(a > 5.0, 6.0, out)
    return torch.copysign(out, v)


def e2m1_truncated(v: torch.Tensor) -> torch.Tensor:
    """E2M1 toward zero: the largest grid value not above ``|v|`` (``v`` in [-6, 6])."""
    a = v.abs()
    out = torch.zeros_like(a)
    for g in _GRID[1:]:
        out = torch.where(a >= g, g, out)
    return torch.copysign(out, v)


def _check(rounding: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, not {rounding!r}")


def _blocks(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    if d % BLOCK:
        raise ValueError(f"NVFP4 needs head_dim divisible by {BLOCK}, not {d}")
    return x.to(torch.float32).reshape(*x.shape[:-1], d // BLOCK, BLOCK)


def _quantize(
    xb: torch.Tensor, sf_raw: torch.Tensor, gs: torch.Tensor, rounding: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 values, E4M3 block scale) of blocks ``xb`` for a raw block scale."""
    sf = fp8_codes(sf_raw.clamp(-E4M3_MAX, E4M3_MAX), rounding, "e4m3")
    denom = sf * torch.reciprocal(gs)
    out_scale = torch.where(sf == 0, torch.zeros_like(sf), torch.reciprocal(denom))
    v = (xb * out_scale).clamp(-E2M1_MAX, E2M1_MAX)
    return (e2m1_nearest(v) if rounding == "cuda" else e2m1_truncated(v)), sf


def nvfp4_codes(
    x: torch.Tensor,
    scale: torch.Tensor | float = 1.0,
    *,
    rounding: str = "cuda",
    four_over_six: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E2M1 values ``[..., blocks, 16]``, E4M3 block scales ``[..., blocks, 1]``), fp32, of
    ``x`` (head_dim last) at the per-tensor ``scale`` (vLLM's k_scale / v_scale)."""
    _check(rounding)
    xb = _blocks(x)
    s = torch.as_tensor(scale, dtype=torch.float32, device=xb.device)
    gs = torch.reciprocal(s)
    vec_max = xb.abs().amax(dim=-1, keepdim=True)
    q6, sf6 = _quantize(xb, gs * (vec_max * torch.tensor(1 / E2M1_MAX)), gs, rounding)
    if not four_over_six:
        return q6, sf6
    q4, sf4 = _quantize(xb, gs * (vec_max * 0.25), gs, rounding)
    err6 = (xb - q6 * sf6 * s).square().sum(dim=-1, keepdim=True)
    err4 = (xb - q4 * sf4 * s).square().sum(dim=-1, keepdim=True)
    use4 = err4 < err6
    return torch.where(use4, q4, q6), torch.where(use4, sf4, sf6)


def nvfp4_roundtrip(
    x: torch.Tensor,
    scale: torch.Tensor | float = 1.0,
    *,
    rounding: str = "cuda",
    four_over_six: bool = False,
) -> torch.Tensor:
    """``x`` written to an NVFP4 cache at per-tensor ``scale`` and read back
    (``e2m1 * block scale * scale``), in ``x``'s dtype."""
    q, sf = nvfp4_codes(x, scale, rounding=rounding, four_over_six=four_over_six)
    s = torch.as_tensor(scale, dtype=torch.float32, device=q.device)
    return (q * sf * s).reshape(x.shape).to(x.dtype)
