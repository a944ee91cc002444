"""The FP8 round trip of a 16-bit tensor by table lookup: the same values, a fraction of the work.

:func:`kvcal._fp8.fp8_roundtrip` is elementwise: each output depends on one input value and
its KV head's scale. A bf16 or fp16 tensor has 65,536 possible values, so the round trip of
each of them, computed once per scale by that same function, is a table, and a tensor's
round trip is a gather by its 16-bit patterns: bit for bit what the arithmetic gives (a test
compares every pattern), in one pass instead of some twenty elementwise passes over float32.
``kvcal advise`` writes every layer's K and V through it dozens of times per request.
"""

from __future__ import annotations

import functools

import torch

from ._fp8 import fp8_roundtrip

SIXTEEN_BIT = (torch.bfloat16, torch.float16)
_PATTERNS = 1 << 16  # 16-bit patterns, indexed by the pattern read as an int16 plus 2**15


@functools.lru_cache(maxsize=256)
def _table(
    scales: tuple[float, ...], rounding: str, kind: str, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Every 16-bit value's round trip at each scale: ``[len(scales) * 65536]``, one run of
    65,536 per scale (head), in pattern order."""
    values = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int16, device=device).view(dtype)
    s = torch.tensor(scales, dtype=torch.float32, device=device).reshape(-1, 1)
    return fp8_roundtrip(values.reshape(1, -1), s, rounding=rounding, kind=kind).reshape(-1)


def fp8_roundtrip_lookup(
    x: torch.Tensor, scale: torch.Tensor | float, *, rounding: str, kind: str
) -> torch.Tensor | None:
    """``fp8_roundtrip(x, scale, rounding=..., kind=...)`` by lookup, or None where the
    lookup does not apply: ``x`` not bf16 or fp16, a Python-float scale (the arithmetic
    checks those), or fewer values than a table has (a decode step's: the arithmetic on
    them costs less than a table that is not cached yet, and none evicts another)."""
    if x.dtype not in SIXTEEN_BIT or not isinstance(scale, torch.Tensor):
        return None
    if x.numel() < _PATTERNS * scale.numel():
        return None
    s = scale.detach().to(torch.float32)
    table = _table(tuple(s.flatten().tolist()), rounding, kind, x.dtype, x.device)
    index = x.view(torch.int16).to(torch.int32) + (1 << 15)
    if s.numel() > 1:  # per head: each head's run of the table, broadcast as its scale is
        heads = torch.arange(s.numel(), dtype=torch.int32, device=x.device).reshape(s.shape)
        index = index + heads * _PATTERNS
    return table[index]
