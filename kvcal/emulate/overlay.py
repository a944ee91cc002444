"""The k/v scales of a calibrated overlay, as emulated settings.

Read from the overlay's ``*.safetensors`` as ``kvcal calibrate`` (or LLM Compressor) writes
them, checked against the model's layers and KV heads, with the calibration ids its manifest
names (left out of the evaluation).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from replay.core.errors import InputError

from .._fp8 import hf_head_scale
from .cache import Scale, Setting

_SCALE_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\..*\b([kv])_scale$")


@dataclass(frozen=True)
class OverlayScales:
    k: tuple[Scale, ...]
    v: tuple[Scale, ...]
    per_head: bool
    notes: tuple[str, ...] = ()
    calibration_ids: frozenset[str] = frozenset()
    model: str | None = None  # what its manifest says it was calibrated on


def _read_scale_tensors(overlay: Path) -> dict[tuple[int, str], torch.Tensor]:
    from safetensors import safe_open

    found: dict[tuple[int, str], torch.Tensor] = {}
    for shard in sorted(overlay.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                m = _SCALE_KEY.search(key)
                if m:
                    found[(int(m.group(1)), m.group(2))] = f.get_tensor(key).float()
    return found


def carries_scales(model_dir: Path) -> bool:
    """Whether a checkpoint folder has k/v scale tensors (a calibrated overlay)."""
    return bool(_read_scale_tensors(model_dir))


def read_overlay(overlay: Path, layers: int, kv_heads: int) -> OverlayScales:
    """The k/v scales an overlay checkpoint carries, as ``kvcal calibrate`` (or LLM
    Compressor) writes them: ``[]``/``[1]`` per tensor, ``[kv_heads, 1, 1]`` per head. A layer
    without scales runs at 1.0, as vLLM runs it."""
    import json

    if not overlay.is_dir():
        raise InputError(f"--overlay {overlay}: no such folder")
    found = _read_scale_tensors(overlay)
    if not found:
        raise InputError(
            f"--overlay {overlay}: no *.k_scale / *.v_scale tensors in its "
            "*.safetensors; write one with `kvcal calibrate`"
        )
    scales: dict[str, list[Scale]] = {"k": [], "v": []}
    notes: list[str] = []
    per_head = False
    for layer in range(layers):
        for which in ("k", "v"):
            t = found.get((layer, which))
            if t is None:
                notes.append(f"layer {layer} has no {which}_scale: emulated at 1.0, as vLLM")
                t = torch.tensor(1.0)
            if (
                t.numel() not in (1, kv_heads)
                or not bool((t > 0).all())
                or not bool(torch.isfinite(t).all())
            ):
                raise InputError(
                    f"--overlay {overlay}: layer {layer} {which}_scale has shape "
                    f"{tuple(t.shape)} / values {t.flatten().tolist()[:4]}; expected "
                    f"one positive scale or one per KV head ({kv_heads})"
                )
            per_head = per_head or t.numel() > 1
            scales[which].append(hf_head_scale(t, kv_heads))
    extra = sorted({la for la, _ in found if la >= layers})
    if extra:
        raise InputError(
            f"--overlay {overlay}: scales for layer(s) {extra}, but the model has "
            f"{layers} layers; is it the overlay of this model?"
        )
    ids: frozenset[str] = frozenset()
    model = None
    manifest = overlay / "kvcal_manifest.json"
    if manifest.is_file():
        try:
            data = json.loads(manifest.read_text("utf-8"))
            model = str(data["model"]) if data.get("model") else None
            ids = frozenset(map(str, data["sample_ids"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            notes.append(f"{manifest}: no readable sample_ids; calibration requests not excluded")
    return OverlayScales(tuple(scales["k"]), tuple(scales["v"]), per_head, tuple(notes), ids, model)


def overlay_setting(name: str, scales: OverlayScales, source: Path, rounding: str) -> Setting:
    return Setting(name, scales.k, scales.v, str(source), rounding)
