"""Per-layer sensitivity of an emulated setting, and the layers to keep in BF16.

On each format at scale 1.0 (FP8 first): ΔNLL with one layer in the format (the others BF16),
and with one layer kept in BF16 (the others in the format). A layer's "recovered" loss is the
all-layers ΔNLL minus the ΔNLL with it kept in BF16. The smallest set of the best-ranked
layers whose recoveries add up to the target share is scored to confirm it (and grown a layer
at a time until it does). Emulation is deterministic, so there is no A/A noise floor: the
loss counts as real when its interval lies above 0 and the mean reaches ``min_loss``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .cache import Setting
from .requests import Item
from .score import Reference, Score, score_setting, tf_summary

Track = Callable[[str, int], Callable[[int], None]]  # (description, total) -> advance(n)
# vLLM 0.32 (engine/arg_utils.py, CacheConfig.kv_cache_dtype_skip_layers: list[str]) takes the
# layer indices as separate words, "--kv-cache-dtype-skip-layers 0 3"; "0,3" parses as the one
# pattern '0,3', which matches no layer (attention.py compares str(layer_idx) with each).
FLAG = "--kv-cache-dtype-skip-layers"


def layer_list(layers: Sequence[int]) -> str:
    return ",".join(map(str, layers))


def _mean(summary: dict[str, Any]) -> float:
    m = summary.get("nll_delta_mean")
    return 0.0 if m is None else float(m)


@dataclass
class Scorer:
    """Scores settings over every item against the BF16 reference."""

    model: Any
    items: Sequence[Item]
    ref: Reference
    chunk: int
    track: Track

    def overall(
        self, setting: Setting, what: str | None = None
    ) -> tuple[dict[str, Score], dict[str, Any]]:
        advance = self.track(what or f"scoring {setting.name}", len(self.items))
        scores = score_setting(self.model, self.items, setting, self.ref, self.chunk, advance)
        return scores, tf_summary(scores, self.ref, [it.id for it in self.items])


def _nll(x: float) -> str:
    return f"{x:+.1e}" if x and abs(x) < 5e-4 else f"{x:+.4f}"


def why_no_loss(summary: Mapping[str, Any], min_loss: float) -> str | None:
    """Why a ΔNLL summary shows no real loss (None when it does: its interval lies above 0
    and its mean reaches ``min_loss``)."""
    mean, lo, hi = (summary.get(k) for k in ("nll_delta_mean", "nll_delta_lo", "nll_delta_hi"))
    if mean is None or lo is None or hi is None:
        return "no scored tokens"
    if mean <= 0:
        return "no loss"
    if lo <= 0:
        return "within noise (the interval reaches 0)"
    if mean < min_loss:
        return f"below --min-loss {min_loss:g}"
    return None


def loss_is_real(summary: Mapping[str, Any], min_loss: float) -> tuple[bool, str]:
    """Whether the loss is real, and its figure with the reason when it is not."""
    why = why_no_loss(summary, min_loss)
    mean, lo, hi = (summary.get(k) for k in ("nll_delta_mean", "nll_delta_lo", "nll_delta_hi"))
    if mean is None or lo is None or hi is None:
        return False, str(why)
    figure = f"ΔNLL {_nll(mean)}/token [{_nll(lo)}, {_nll(hi)}]"
    return why is None, figure if why is None else f"{figure}: {why}"


def layer_rows(scorer: Scorer, base: Setting, loss: float) -> list[dict[str, Any]]:
    rows = []
    layers = len(base.k)
    for layer in range(layers):
        _, only = scorer.overall(base.only(layer), f"sensitivity: layer {layer} alone {base.fmt}")
        _, kept = scorer.overall(base.skipping([layer]), f"sensitivity: layer {layer} kept BF16")
        recovered = loss - _mean(kept)
        rows.append(
            {
                "layer": layer,
                "only_fp8": only,
                "kept_bf16": kept,
                "recovered": recovered,
                "recovered_share": recovered / loss if loss else None,
            }
        )
    return rows


def choose_skip(
    scorer: Scorer, base: Setting, rows: Sequence[dict[str, Any]], loss: float, target: float
) -> dict[str, Any]:
    """The smallest prefix of the ranking whose estimated recovery reaches ``target`` of the
    loss, scored to confirm; grown one layer at a time until the confirmation reaches it."""
    ranked = [r["layer"] for r in sorted(rows, key=lambda r: -r["recovered"])]
    k, total = 0, 0.0
    while k < len(ranked) and (k == 0 or total < target * loss):
        total += rows[ranked[k]]["recovered"]
        k += 1
    tries: list[dict[str, Any]] = []
    while True:
        chosen = sorted(ranked[:k])
        _, summary = scorer.overall(
            base.skipping(chosen, f"{base.name} skip {layer_list(chosen)}"),
            f"confirming skip layers {layer_list(chosen)}",
        )
        recovered = loss - _mean(summary)
        tries.append(
            {
                "skip_layers": chosen,
                "summary": summary,
                "recovered": recovered,
                "recovered_share": recovered / loss,
            }
        )
        if recovered >= target * loss or k >= len(ranked):
            break
        k += 1
    last = tries[-1]
    return {
        "ranking": ranked,
        "estimated_share": total / loss,
        "confirmations": tries,
        "skip_layers": last["skip_layers"],
        "confirmed_share": last["recovered_share"],
        "reached": bool(last["recovered"] >= target * loss),
    }


def sensitivity(
    scorer: Scorer, base: Setting, base_summary: dict[str, Any], target: float, min_loss: float
) -> dict[str, Any]:
    real, why = loss_is_real(base_summary, min_loss)
    loss = _mean(base_summary)
    out: dict[str, Any] = {
        "base": base.name,
        "loss": loss,
        "loss_summary": base_summary,
        "target_share": target,
        "loss_is_real": real,
        "why": why,
    }
    out["layers"] = layer_rows(scorer, base, loss)
    if not real:
        for row in out["layers"]:
            row["recovered_share"] = None  # a share of no loss means nothing
        out.update(skip_layers=[], flag=None, advice=f"no layer needs to stay BF16: {why}")
        return out
    choice = choose_skip(scorer, base, out["layers"], loss, target)
    out.update(choice)
    chosen = choice["skip_layers"]
    flag = f"{FLAG} {' '.join(map(str, chosen))}"
    out["flag"] = flag
    layers = len(base.k)
    if len(chosen) == layers:
        # kvcal calibrates E4M3 scales; the other formats have no scale it could fix
        instead = "; calibrate (kvcal calibrate) instead" if base.fmt in ("fp8", "fp8_e4m3") else ""
        out["advice"] = (
            f"only every layer in BF16 recovers {target:.0%} of the loss: {base.name} "
            f"is not worth keeping here{instead}"
        )
    else:
        share = choice["confirmed_share"]
        out["advice"] = (
            f"keep layer(s) {', '.join(map(str, chosen))} in BF16: {flag} "
            f"(confirmed: recovers {share:.0%} of the {base.name} loss; {why} before)"
        )
    return out
