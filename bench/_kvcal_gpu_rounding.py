"""kvcal's emulated CUDA rounding (``kvcal/_fp8.py``, ``rounding="cuda"``) against torch's own
float8 cast on a device, value for value.

The reference is what vLLM's CUDA cache write does (``csrc/cache_kernels.cu`` through
``scaled_convert``: ``__nv_cvt_float_to_fp8((float)x / scale, __NV_SATFINITE, ...)``): a true
fp32 division, finite values beyond the format's largest saturated to it (+-inf too), NaN kept,
then round to nearest even. On the device that is ``(x.float() / scale).clamp(-max, max)`` cast
to ``torch.float8_e4m3fn`` (``float8_e5m2``): the clamp stands for ``__NV_SATFINITE`` (torch's
cast alone makes NaN or inf of what is beyond range) and keeps NaN, as the kernel does. The
scale is a tensor on the device: CUDA torch divides by a Python number as a multiply by its
reciprocal, which is not the kernel's division.

kvcal runs the emulation where the model runs, so it is compared twice: computed on the CPU
(as ``kvcal emulate --device cpu`` rounds) and on the device. vLLM CPU's truncation is
compared too: its count of differing values shows that the comparison sees a rounding that is
not the kernel's. On a machine without a GPU the same comparison runs against torch's CPU cast
(also round to nearest even), which exercises the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvcal._fp8 import fp8_values

KINDS = {"e4m3": (448.0, torch.float8_e4m3fn), "e5m2": (57344.0, torch.float8_e5m2)}
# Powers of two (exact division) and not; a calibrated scale is amax / 448, often small.
SCALES = (1.0, 0.125, 0.0217, 1.7, 37.5)
EXAMPLES = 3  # mismatching values kept per row, to read what went wrong


def _bits(g: torch.Generator, n: int) -> torch.Tensor:
    """``n`` uniformly random fp32 bit patterns: every exponent, subnormals, inf and NaN."""
    raw = torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64) - 2**31
    return raw.to(torch.int32).view(torch.float32)


def _subnormals(g: torch.Generator, n: int) -> torch.Tensor:
    """fp32 subnormals of both signs (exponent bits 0, a random non-zero mantissa)."""
    mantissa = torch.randint(1, 2**23, (n,), generator=g, dtype=torch.int64)
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64)
    return (mantissa - sign * 2**31).to(torch.int32).view(torch.float32)


def _grid(kind: str) -> torch.Tensor:
    """Every finite value of the format, the midpoints between neighbours (the ties round to
    nearest even decides) and the fp32 values either side of each midpoint, both signs."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(KINDS[kind][1]).float()
    v = torch.unique(codes[torch.isfinite(codes)])
    mid = (v[:-1] + v[1:]) / 2  # exact: the format's values have few significant bits
    up = torch.nextafter(mid, torch.full_like(mid, float("inf")))
    down = torch.nextafter(mid, torch.full_like(mid, float("-inf")))
    return torch.cat([v, mid, up, down])


def _beyond(kind: str) -> torch.Tensor:
    """Around and past the largest value (448 and the next step's midpoint 464 for E4M3;
    57344 and 61440 for E5M2), up to fp32's largest, both signs."""
    top = KINDS[kind][0]
    near = torch.linspace(top * 0.9, top * 1.2, 30_001)
    far = torch.logspace(torch.log10(torch.tensor(top)).item(), 38.5, 2_001)
    x = torch.cat([near, far])
    return torch.cat([x, -x])


def input_sets(kind: str, scale: float, random_values: int, seed: int) -> Iterator[tuple[str, Any]]:
    """(name, values) for one format and scale: bf16 as K and V are, fp32 beyond. The grid
    and range sets are given times the scale, so that divided by it they land where the
    rounding decides."""
    g = torch.Generator().manual_seed(seed)
    yield (
        "bf16: all 65,536 bit patterns",
        torch.arange(-(2**15), 2**15).to(torch.int16).view(torch.bfloat16),
    )
    yield "fp32: random bit patterns", _bits(g, random_values)
    yield "fp32: subnormals", _subnormals(g, random_values // 4)
    yield "fp32: the format's grid, midpoints and their neighbours", _grid(kind) * scale
    yield "fp32: near and beyond the largest value", _beyond(kind) * scale


def cast_on(x: torch.Tensor, scale: float, kind: str, device: torch.device) -> torch.Tensor:
    """What the CUDA kernel stores for ``x`` (fp32 values on the CPU), by torch's own cast."""
    top, dtype = KINDS[kind]
    s = torch.tensor(scale, dtype=torch.float32, device=device)
    v = x.to(device).to(torch.float32) / s
    return v.clamp(-top, top).to(dtype).to(torch.float32).cpu()


def _differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where two fp32 tensors differ bit for bit (any NaN equals any NaN; -0 is not +0)."""
    same = (a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b))
    return ~same


def _examples(
    x: torch.Tensor, emulated: torch.Tensor, cast: torch.Tensor, scale: float
) -> list[dict[str, Any]]:
    where = torch.nonzero(_differ(emulated, cast)).flatten()[:EXAMPLES]
    xf = x.to(torch.float32)
    return [
        {
            "x": float(xf[i]).hex(),
            "scale": scale,
            "emulated": float(emulated[i]).hex(),
            "cast": float(cast[i]).hex(),
        }
        for i in where.tolist()
    ]


def compare_one(x: torch.Tensor, scale: float, kind: str, device: torch.device) -> dict[str, Any]:
    """Counts of values where each emulation differs from the device's cast."""
    cast = cast_on(x, scale, kind, device)
    emulated = fp8_values(x, scale, "cuda", kind)
    on_device = fp8_values(x.to(device), scale, "cuda", kind).cpu()
    truncated = fp8_values(x, scale, "cpu", kind)
    return {
        "values": x.numel(),
        "emulated_vs_cast": int(_differ(emulated, cast).sum()),
        "emulated_on_device_vs_cast": int(_differ(on_device, cast).sum()),
        "truncation_vs_cast": int(_differ(truncated, cast).sum()),
        "examples": _examples(x, emulated, cast, scale),
    }


COUNTS = ("values", "emulated_vs_cast", "emulated_on_device_vs_cast", "truncation_vs_cast")


def compare(
    device: str, random_values: int, seed: int = 0, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    """Every input set at every format and scale; a row per (inputs, format), summed over the
    scales, and the totals."""
    dev = torch.device(device)
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for kind in KINDS:
        for scale in SCALES:
            for name, x in input_sets(kind, scale, random_values, seed):
                one = compare_one(x, scale, kind, dev)
                row = rows.setdefault((name, kind), {"inputs": name, "kind": kind, "examples": []})
                for key in COUNTS:
                    row[key] = row.get(key, 0) + one[key]
                row["examples"] = (row["examples"] + one["examples"])[:EXAMPLES]
        progress(f"rounding, {kind}: compared at scales {', '.join(map(str, SCALES))}")
    listed = list(rows.values())
    return {
        "device": str(dev),
        "kinds": list(KINDS),
        "scales": list(SCALES),
        "random_values": random_values,
        "seed": seed,
        "rows": listed,
        **{key: sum(r[key] for r in listed) for key in COUNTS},
    }
