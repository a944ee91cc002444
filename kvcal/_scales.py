"""Scales from observed K/V ranges, what they cost, and where per-tensor scales fall short.

scale = amax / 448: the largest observed magnitude maps to E4M3's largest finite value, so
nothing observed clips. Clipping and underflow at a scale are read off the log2 histogram
(within one bin, 1/16 of a power of two, linearly interpolated). The optional MSE search emulates
E4M3 rounding (torch's float8_e4m3fn cast) on points spread through each histogram bin and
reports the scale with the least estimated reconstruction error beside amax; it never
replaces amax in the checkpoint.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

from ._observe import NUM_BINS, TINY_BINS, KVStats, bin_edges

E4M3_MAX = 448.0
# |x|/s below 2**-10 rounds to zero (half the smallest subnormal, 2**-9, ties to even);
# below 2**-6 (the smallest normal) it keeps fewer than E4M3's 3 mantissa bits.
ZERO_BELOW = 2.0**-10
SUBNORMAL_BELOW = 2.0**-6
KV = ("k", "v")


_EDGES = bin_edges()


def fraction_above(hist: torch.Tensor, count: int, threshold: float) -> float:
    """Share of all values with |x| > threshold (linear inside the straddled bin)."""
    if count == 0:
        return 0.0
    i = (
        int(torch.searchsorted(_EDGES, torch.tensor([threshold], dtype=torch.float64), right=True))
        - 1
    )
    if i < 0:
        return float(hist.sum()) / count
    if i >= NUM_BINS:
        return 0.0
    lo, hi = float(_EDGES[i]), float(_EDGES[i + 1])
    above = float(hist[i + 1 :].sum()) + float(hist[i]) * (hi - threshold) / (hi - lo)
    return above / count


def tiny(hist: torch.Tensor) -> int:
    """Zeros and values below 2**-126 (the bin of bfloat16's exponent 0)."""
    return int(hist[:TINY_BINS].sum())


def fraction_below(hist: torch.Tensor, count: int, threshold: float) -> float:
    """Share of all values with 0 < |x| < threshold; exact zeros (and values below 2**-126,
    which share their bin) are not counted as underflow."""
    if count == 0:
        return 0.0
    return max(0.0, (count - tiny(hist)) / count - fraction_above(hist, count, threshold))


@torch.inference_mode()
def estimated_mse(
    hist: torch.Tensor, amax: float, scales: torch.Tensor, points_per_bin: int = 4
) -> torch.Tensor:
    """Mean squared FP8 (E4M3) round-trip error at each scale, over the histogram: each
    bin's values taken as spread evenly through it (and none above ``amax``)."""
    used = torch.nonzero(hist[TINY_BINS:]).flatten() + TINY_BINS
    if used.numel() == 0:
        return torch.zeros_like(scales, dtype=torch.float64)
    lo, hi = _EDGES[used], _EDGES[used + 1]
    offsets = (torch.arange(points_per_bin, dtype=torch.float64) + 0.5) / points_per_bin
    values = (lo[:, None] + (hi - lo)[:, None] * offsets[None, :]).flatten().clamp(max=amax)
    weights = (hist[used].double()[:, None] / points_per_bin).expand(-1, points_per_bin).flatten()
    sc = scales.double()[:, None]
    recon = (values[None, :] / sc).clamp(max=E4M3_MAX).float().to(torch.float8_e4m3fn)
    err = (recon.double() * sc - values[None, :]) ** 2
    return (err * weights[None, :]).sum(dim=1) / hist.sum()


def mse_search(hist: torch.Tensor, amax: float, steps: int = 49) -> tuple[float, float, float]:
    """(best scale, its estimated MSE, amax scale's estimated MSE) over scales
    amax/448 * 2**(-k/16), k = 0..steps-1 (smaller scales trade clipping for resolution)."""
    base = amax / E4M3_MAX
    if amax <= 0:
        return base, 0.0, 0.0
    scales = base * torch.exp2(-torch.arange(steps, dtype=torch.float64) / 16)
    mse = estimated_mse(hist, amax, scales)
    best = int(torch.argmin(mse))
    return float(scales[best]), float(mse[best]), float(mse[0])


@dataclass(frozen=True)
class TensorReport:
    """One layer's K or V: its scales and what each scale does to the observed values."""

    layer: int
    which: str  # "k" or "v"
    amax: float
    head_amax: tuple[float, ...]
    scale: float
    head_scales: tuple[float, ...]
    clip_at_1: float
    zero_at_1: float
    subnormal_at_1: float
    clip_at_scale: float
    zero_at_scale: float
    subnormal_at_scale: float
    mse_scale: float | None = None
    mse_gain: float | None = None  # amax scale's MSE / best scale's MSE

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def tensor_reports(stats: KVStats, search: bool = False) -> list[TensorReport]:
    out = []
    for layer in range(stats.amax.shape[1]):
        for w, which in enumerate(KV):
            hist, count = stats.hist[w, layer], int(stats.count[w, layer])
            heads = tuple(float(x) for x in stats.amax[w, layer])
            amax = max(heads)
            # An all-zero tensor has no range to map; 1.0 is as good as any scale for it.
            scale = amax / E4M3_MAX if amax > 0 else 1.0
            head_scales = tuple(h / E4M3_MAX if h > 0 else scale for h in heads)
            mse_scale = mse_gain = None
            if search:
                best, best_mse, amax_mse = mse_search(hist, amax)
                mse_scale = best
                mse_gain = amax_mse / best_mse if best_mse > 0 else 1.0
            out.append(
                TensorReport(
                    layer,
                    which,
                    amax,
                    heads,
                    scale,
                    head_scales,
                    clip_at_1=fraction_above(hist, count, E4M3_MAX),
                    zero_at_1=fraction_below(hist, count, ZERO_BELOW),
                    subnormal_at_1=fraction_below(hist, count, SUBNORMAL_BELOW),
                    clip_at_scale=0.0,  # amax maps to 448: nothing observed clips, by construction
                    zero_at_scale=fraction_below(hist, count, ZERO_BELOW * scale),
                    subnormal_at_scale=fraction_below(hist, count, SUBNORMAL_BELOW * scale),
                    mse_scale=mse_scale,
                    mse_gain=mse_gain,
                )
            )
    return out


@dataclass(frozen=True)
class Advice:
    outlier_layers: tuple[int, ...]
    outlier_heads: tuple[tuple[int, str, int, float], ...]  # layer, k/v, head, amax / median
    skip_layers_flag: str | None
    reasons: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "outlier_layers": list(self.outlier_layers),
            "outlier_heads": [
                {"layer": la, "tensor": w, "head": h, "ratio_to_median": r}
                for la, w, h, r in self.outlier_heads
            ],
            "skip_layers_flag": self.skip_layers_flag,
            "reasons": list(self.reasons),
        }


def advise(
    reports: list[TensorReport], ratio: float = 4.0, subnormal_share: float = 0.01
) -> Advice:
    """Layers whose range stands ``ratio`` x above the median layer's, or whose calibrated
    scale leaves more than ``subnormal_share`` of values subnormal (a heavy tail the one
    scale cannot serve); heads ``ratio`` x away from their layer's median head."""
    layers: set[int] = set()
    heads: list[tuple[int, str, int, float]] = []
    reasons: list[str] = []
    for which in KV:
        rows = [r for r in reports if r.which == which]
        median = statistics.median(r.amax for r in rows) if rows else 0.0
        for r in rows:
            if median > 0 and r.amax > ratio * median:
                layers.add(r.layer)
                reasons.append(
                    f"layer {r.layer} {which.upper()}: amax {r.amax:.4g} is "
                    f"{r.amax / median:.1f}x the median layer's {median:.4g}"
                )
            if r.subnormal_at_scale > subnormal_share:
                layers.add(r.layer)
                reasons.append(
                    f"layer {r.layer} {which.upper()}: "
                    f"{100 * r.subnormal_at_scale:.2f}% of values are subnormal at "
                    "the calibrated scale (heavy tail)"
                )
            head_median = statistics.median(r.head_amax)
            for h, a in enumerate(r.head_amax):
                if head_median > 0 and (a > ratio * head_median or a * ratio < head_median):
                    heads.append((r.layer, which, h, a / head_median))
    if heads:
        reasons.append(
            f"{len(heads)} head(s) sit {ratio:g}x or more away from their layer's "
            "median head: per-head scales would fit them"
        )
    # one index per word: vLLM 0.32 reads "0,3" as one pattern that matches no layer
    flag = " ".join(str(x) for x in sorted(layers)) or None
    return Advice(
        tuple(sorted(layers)),
        tuple(heads),
        f"--kv-cache-dtype-skip-layers {flag}" if flag else None,
        tuple(reasons),
    )
