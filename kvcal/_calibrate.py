"""One calibration: samples in, overlay checkpoint, manifest and report out."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.core.errors import InputError
from replay.core.ids import write_ids

from . import __version__
from ._backend import per_head_backend_support
from ._checkpoint import (
    LEGACY_SCALES,
    MANIFEST,
    RECIPE,
    legacy_scales,
    model_digests,
    read_manifest,
    recipe_yaml,
    write_overlay,
)
from ._preflight import check_weights
from ._sample import CALIBRATION_IDS, SAMPLES, Sample
from ._scales import advise, tensor_reports

REPORT = "kvcal_report.json"


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the scales, frozen into the manifest."""

    strategy: str = "tensor"
    chunk_tokens: int = 2048
    dtype: str = "auto"
    mse_search: bool = False
    outlier_ratio: float = 4.0

    def to_json(self) -> dict[str, Any]:
        return {
            "observer": "running amax over all samples (static minmax), at the cache "
            "write, after RoPE",
            "scale": "amax / 448 (E4M3)",
            **self.__dict__,
        }


def refuse_uncalibratable(model_dir: Path) -> None:
    """Refuse, before anything is loaded or observed, a folder kvcal cannot calibrate: a broken
    one (:func:`check_weights`), or one whose config already declares a ``kv_cache_scheme``.

    That one is refused rather than recalibrated: transformers runs it through
    compressed-tensors' FP8 K/V quantization with the scales it carries (random ones where it
    carries none), or rejects a block it cannot validate, so kvcal would observe K/V rounded
    by the old scales instead of the model's own; and the overlay cannot drop the scales it
    would link in. The checkpoint it was made from has the K/V to calibrate on."""
    qcfg = check_weights(model_dir).get("quantization_config") or {}
    if qcfg.get("kv_cache_scheme") is None:
        return
    try:
        base = f" ({read_manifest(model_dir)['model']}, as its kvcal_manifest.json says)"
    except InputError:
        base = ""
    raise InputError(
        f"{model_dir / 'config.json'}: this checkpoint already carries k/v scales "
        f"(quantization_config.kv_cache_scheme); calibrate the checkpoint it was made from"
        f"{base} instead"
    )


def calibrate(
    model_dir: Path,
    samples: Sequence[Sample],
    out_dir: Path,
    recipe: Recipe,
    seed: int,
    sampling: dict[str, Any],
    legacy: bool = False,
    on_sample: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Observe, compute scales, write the overlay and everything that explains it."""
    from ._observe import load_model, observe

    refuse_uncalibratable(model_dir)
    model = load_model(str(model_dir), recipe.dtype)
    started = time.perf_counter()
    stats = observe(model, [s.input_ids for s in samples], recipe.chunk_tokens, on_sample)
    seconds = time.perf_counter() - started
    reports = tensor_reports(stats, search=recipe.mse_search)
    advice = advise(reports, ratio=recipe.outlier_ratio)
    per_head_ok, per_head_why = per_head_backend_support()
    config = write_overlay(model_dir, out_dir, reports, recipe.strategy)
    (out_dir / RECIPE).write_text(recipe_yaml(recipe.strategy), encoding="utf-8")
    # replay's overlap refusal points here: the ids to pass to --exclude-ids
    write_ids(out_dir / CALIBRATION_IDS, (s.id for s in samples))
    with (out_dir / SAMPLES).open("w", encoding="utf-8") as fh:
        for s in samples:
            fh.write(json.dumps(s.to_json(), ensure_ascii=False) + "\n")
    if legacy:
        (out_dir / LEGACY_SCALES).write_text(
            json.dumps(legacy_scales(reports, str(config.get("model_type", ""))), indent=2) + "\n",
            encoding="utf-8",
        )
    manifest = {
        "tool": {"name": "kvcal", "version": __version__},
        "created_at": time.time(),
        "model": str(model_dir.resolve()),
        "digests": model_digests(model_dir.resolve()),
        "kv_cache_scheme": config["quantization_config"]["kv_cache_scheme"],
        "recipe": recipe.to_json(),
        "seed": seed,
        "sampling": sampling,
        "sample_ids": [s.id for s in samples],
        "tokens": stats.tokens,
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    report = {
        "model": str(model_dir.resolve()),
        "overlay": str(out_dir),
        "strategy": recipe.strategy,
        "samples": stats.samples,
        "tokens": stats.tokens,
        "observe_seconds": seconds,
        "tokens_per_second": stats.tokens / seconds if seconds > 0 else None,
        "tensors": [r.to_json() for r in reports],
        "advice": advice.to_json(),
        "per_head_supported": per_head_ok,
        "per_head_backend": per_head_why,
    }
    (out_dir / REPORT).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report
