"""``--skip-layers NAME=LAYERS``: the layers arm, served with some layers' KV cache in BF16.

LAYERS are what vLLM's ``--kv-cache-dtype-skip-layers`` takes: layer indices (one a word: vLLM
reads ``0,29`` as one pattern that matches no layer) and ``sliding_window`` for every
sliding-window layer of a hybrid model (Gemma 3's 15 of 18). Where the model's folder is here,
its ``config.json`` says which layers exist and which slide, and a value that would match none
is bad input.
"""

from __future__ import annotations

from dataclasses import replace

from replay.core.errors import InputError
from replay.serving.kv_layout import SLIDING_WINDOW, KvLayout
from replay.serving.targets import TargetSpec


def with_skip_layers(specs: list[TargetSpec], text: str) -> list[TargetSpec]:
    """``--skip-layers NAME=0,29`` or ``NAME=sliding_window``: NAME's server keeps those
    layers' KV cache in BF16 (vLLM's flag takes one index a word, and ``sliding_window`` for
    every sliding-window layer), and NAME is the layers arm (unless declared)."""
    name, sep, layers = text.partition("=")
    name = name.strip()
    words = layers.replace(",", " ").split()
    if not sep or not words or not all(_index(w) or w == SLIDING_WINDOW for w in words):
        raise InputError(
            f"--skip-layers {text!r}: expected NAME=LAYERS, layer indices from 0 and/or "
            f"{SLIDING_WINDOW} (fp8-skip=0,29; fp8-swa={SLIDING_WINDOW})"
        )
    indices = sorted({int(w) for w in words if _index(w)})
    words = [*map(str, indices), *([SLIDING_WINDOW] if SLIDING_WINDOW in words else [])]
    spec = next((s for s in specs if s.name == name), None)
    if spec is None:
        raise InputError(f"--skip-layers: '{name}' is not one of the targets")
    if not spec.is_local:
        raise InputError(
            f"--skip-layers: '{name}' is a server kvcanary does not start; start it with "
            f"--kv-cache-dtype-skip-layers {' '.join(words)} and give it "
            'role = "layers" in a targets file'
        )
    _check_layers(spec, indices, SLIDING_WINDOW in words)
    flag = ("--kv-cache-dtype-skip-layers", *words)
    changed = replace(spec, args=(*spec.args, *flag), role=spec.role or "layers")
    return [changed if s.name == name else s for s in specs]


def _index(word: str) -> bool:
    return word.isascii() and word.isdigit()


def _check_layers(spec: TargetSpec, indices: list[int], sliding: bool) -> None:
    """Layers the model has, where its config.json says (vLLM would match no layer and keep
    the whole cache in FP8, silently)."""
    layout = KvLayout.of_model(spec.model)
    if layout is None:
        return
    out = [i for i in indices if i >= layout.layers]
    if out:
        raise InputError(
            f"--skip-layers: layer(s) {', '.join(map(str, out))} out of range: {spec.model} "
            f"has {layout.layers} layers (0-{layout.layers - 1})"
        )
    if sliding and not layout.sliding:
        raise InputError(
            f"--skip-layers: {spec.model} has no sliding-window layer ({SLIDING_WINDOW} would "
            "keep nothing in BF16): name layer indices instead"
        )
