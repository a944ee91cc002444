"""The per-token-head KV-cache formats: a scale computed for each token and KV head when the
cache is written (no checkpoint scale applies), INT8, FP8 (E4M3) or INT4.

What vLLM 0.32's kernels do (installed source; checked bit for bit against those kernels run
in Triton's interpreter on CPU tensors, and ``single_rht`` on CPU, in the tests):

INT8 and FP8, ``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py``
(``_reshape_cache_per_token_head``), per token and head over head_dim, in fp32::

    scale = max(max|x| / QUANT_MAX, 1e-6)        # QUANT_MAX 127 (int8), 448 (fp8)
    q = x * (1.0 / scale)
    int8: q = q + 0.5 if q >= 0 else q - 0.5     # "round half away from zero before the
                                                 #  int8 store truncates"
    q = clamp(q, QUANT_MIN, QUANT_MAX)           # -128 / -448
    store q: int8 truncates toward zero; fp8 rounds to nearest even (Triton's conversion)

and attention reads ``q * scale`` (``triton_unified_attention``).

INT4, ``vllm/v1/attention/ops/int4_per_token_head.py`` (``reshape_and_cache_int4``): K and V
are first rotated, ``single_rht(x.float()).to(x.dtype)`` (a sign flip by a fixed +-1 vector,
then an unnormalized Walsh-Hadamard transform over head_dim, block-diagonal over its largest
power-of-two divisor ``b``), then quantized asymmetrically::

    scale = max((max - min) / 15, 1e-6);  zp = clamp(round_half_away(-min / scale), 0, 15)
    q = clamp(round_half_away(x * (1.0 / scale) + zp), 0, 15)

and the zero point hides in the fp32 scale's 4 low mantissa bits, so attention reads
``(q - zp) * (scale with those bits cleared)``. It scores rotated queries against these
rotated keys with ``softmax_scale / b`` and rotates the output back (``single_rht(out,
inverse=True) / b``): the same as attending over ``single_rht(deq, inverse=True) / b``,
which is what the round trip here returns (up to the query's own bf16 rounding after its
rotation, which is not the cache's).

``rounding="cuda"`` is all of the above (the only platform vLLM serves these formats on);
``rounding="cpu"`` stores the element codes truncated toward zero instead of rounded, vLLM
CPU's FP8 rounding applied as a what-if (the scales and the INT4 zero point as above). GPU
Triton may fuse ``x * inv + zp`` into one FMA and uses approximate fp32 division; the
interpreter, and this module, round each operation (a code can differ at an exact tie).
"""

from __future__ import annotations

import torch

from ._fp8 import ROUNDINGS, fp8_codes

_INT8 = (127.0, -128.0)
_FP8 = (448.0, -448.0)
_SCALE_FLOOR = 1e-6
_KEEP_SCALE_BITS = -16  # & ~0xF: the INT4 zero point lives in the scale's low 4 bits


def _check(rounding: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, not {rounding!r}")


def _half_away(v: torch.Tensor) -> torch.Tensor:
    """``where(v >= 0, v + 0.5, v - 0.5)``: truncated later, rounds half away from zero."""
    return torch.where(v >= 0, v + 0.5, v - 0.5)


def _per_row_scale(x: torch.Tensor, top: float) -> torch.Tensor:
    amax = x.abs().amax(dim=-1, keepdim=True)
    return torch.clamp_min(amax / top, _SCALE_FLOOR)


def int8_codes(x: torch.Tensor, rounding: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes as fp32, scale per row) of ``x`` (fp32, head_dim last)."""
    _check(rounding)
    scale = _per_row_scale(x, _INT8[0])
    q = x * torch.reciprocal(scale)
    if rounding == "cuda":
        q = _half_away(q)
    return torch.trunc(q.clamp(_INT8[1], _INT8[0])), scale


def fp8_head_codes(x: torch.Tensor, rounding: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 values as fp32, scale per row) of ``x`` (fp32, head_dim last)."""
    scale = _per_row_scale(x, _FP8[0])
    q = (x * torch.reciprocal(scale)).clamp(_FP8[1], _FP8[0])
    return fp8_codes(q, rounding, "e4m3"), scale


def per_token_head_roundtrip(x: torch.Tensor, kind: str, *, rounding: str = "cuda") -> torch.Tensor:
    """``x`` (head_dim last) through an ``int8``, ``fp8`` or ``int4`` per-token-head cache and
    back, in ``x``'s dtype."""
    xf = x.to(torch.float32)
    if kind == "int8":
        q, scale = int8_codes(xf, rounding)
        out = q * scale
    elif kind == "fp8":
        q, scale = fp8_head_codes(xf, rounding)
        out = q * scale
    elif kind == "int4":
        out = int4_roundtrip_f32(x, rounding)
    else:
        raise ValueError(f"per-token-head kind must be int8, fp8 or int4, not {kind!r}")
    return out.to(x.dtype)


# -- INT4: rotation, asymmetric codes -------------------------------------------------------


def _largest_pow2_divisor(n: int) -> int:
    return n & -n


def _rht_signs(d: int) -> torch.Tensor:
    """vLLM's fixed +-1 vector for head_dim ``d`` (``_get_rht_signs(d, 0)``)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(0x9E3779B9)
    return 2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform over the last (power-of-two) dim: vLLM's
    butterfly (``fast_hadamard_transform``, its CPU tier)."""
    d = x.shape[-1]
    h = 1
    while h < d:
        xv = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = xv[..., 0, :], xv[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(x.shape)
        h <<= 1
    return x


def single_rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """vLLM's ``single_rht``: ``H D x`` (``D H y`` inverse, unnormalized), block-diagonal
    over the largest power-of-two divisor of the last dim."""
    d = x.shape[-1]
    block = _largest_pow2_divisor(d)
    if block < d:
        lead = x.shape[:-1]
        return single_rht(x.reshape(*lead, d // block, block), inverse).reshape(*lead, d)
    signs = _rht_signs(d).to(x.device)
    return _hadamard(x) * signs if inverse else _hadamard(x * signs)


def int4_codes(
    rotated: torch.Tensor, rounding: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes 0..15, zero point, scale as stored) of rotated K/V (fp32, head_dim last); the
    stored scale keeps the zero point in its 4 low mantissa bits, as the kernel packs it."""
    _check(rounding)
    lo = rotated.amin(dim=-1, keepdim=True)
    hi = rotated.amax(dim=-1, keepdim=True)
    scale = torch.clamp_min((hi - lo) / 15.0, _SCALE_FLOOR)
    zp = torch.trunc(_half_away(-lo / scale)).clamp(0.0, 15.0)
    v = rotated * torch.reciprocal(scale) + zp
    q = torch.trunc(_half_away(v) if rounding == "cuda" else v).clamp(0.0, 15.0)
    bits = scale.view(torch.int32)
    packed = ((bits & _KEEP_SCALE_BITS) | zp.to(torch.int32)).view(torch.float32)
    return q, zp, packed


def int4_roundtrip_f32(x: torch.Tensor, rounding: str = "cuda") -> torch.Tensor:
    """What attention over an INT4 per-token-head cache reads for ``x``, in the unrotated
    space, fp32."""
    rotated = single_rht(x.float()).to(x.dtype).float()
    q, zp, packed = int4_codes(rotated, rounding)
    read_scale = (packed.view(torch.int32) & _KEEP_SCALE_BITS).view(torch.float32)
    deq = (q - zp) * read_scale
    return single_rht(deq, inverse=True) / _largest_pow2_divisor(x.shape[-1])
