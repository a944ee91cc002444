"""A model pass resumed at a layer: what every setting below that layer shares, computed once.

Two emulated caches that quantize layers ``0 .. L-1`` alike give those layers the same inputs,
so they compute the same hidden states, bit for bit: a layer reads only the hidden states
below it, the positions, the mask and its own cache. ``kvcal advise`` scores dozens of
settings that differ from one base setting only from some layer on (each layer kept in BF16
alone, the growing sets it confirms). A :class:`Tape` holds what a pass of one setting wrote
at the output of its layers (one tensor per model call: each prefill chunk and each answer
step); a pass of another setting replays that output at the first layer where the two
differ and computes only the layers from there (:func:`resuming`). Layers that are replayed
still write zeros of the right shape to the cache, so that every length the model reads
from it (positions, mask sizes) is what a full pass would see; their cache is never read.

Only every ``stride``-th layer's output is kept when the budget asks for it: a pass then
resumes at the last kept layer before the first difference, and computes the few layers
between again (:func:`tape_stride`). A model whose decoder layers are not where transformers
keeps them (``get_decoder().layers``) is scored by whole passes, as before.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from .emulate import Setting

# Kept layer outputs of every scored request, for the two tapes advise keeps at once (the
# base setting's and the growing confirmed set's): at most this many bytes, else a stride.
TAPE_BUDGET = 4 << 30


@dataclass
class Tape:
    """One setting's layer outputs for one request: ``outputs[layer][call]``."""

    setting: Setting
    outputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def resume_layer(self, setting: Setting) -> int:
        """The layer a pass of ``setting`` may start at from this tape (0: from the start):
        one past the last kept output below the first layer where the two settings differ."""
        first = first_difference(setting, self.setting)
        kept = [layer for layer in self.outputs if layer < first]
        return max(kept) + 1 if kept else 0


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a is b or (a.shape == b.shape and bool(torch.equal(a, b)))


def first_difference(a: Setting, b: Setting) -> int:
    """The first layer whose cache the two settings write differently (the layer count when
    none does); 0 when their format or rounding differ."""
    if a.fmt != b.fmt or a.rounding != b.rounding or len(a.k) != len(b.k):
        return 0
    for layer, pair in enumerate(zip(a.k, b.k, a.v, b.v, strict=True)):
        if not (_same(pair[0], pair[1]) and _same(pair[2], pair[3])):
            return layer
    return len(a.k)


def decoder_layers(model: Any) -> Sequence[torch.nn.Module] | None:
    """The model's decoder layers in order, or None where they are not where transformers
    keeps them (such a model is scored by whole passes)."""
    try:
        layers = model.get_decoder().layers
    except AttributeError:
        return None
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    count = getattr(config or model.config, "num_hidden_layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) != count:
        return None
    if not all(hasattr(getattr(m, "self_attn", None), "layer_idx") for m in layers):
        return None
    return list(layers)


def tape_stride(layers: int, tokens: int, hidden: int, elem: int, budget: int) -> int:
    """Every how many layers an output is kept so that two tapes of ``tokens`` tokens (every
    request's, all calls) fit ``budget`` bytes."""
    per_layer = 2 * tokens * hidden * elem
    if per_layer <= 0:
        return 1
    return max(1, math.ceil(layers * per_layer / budget))


@contextmanager
def recording(layers: Sequence[torch.nn.Module], keep: Sequence[int], tape: Tape) -> Iterator[Tape]:
    """Keep the outputs of ``keep``'s layers, call after call, in ``tape``."""
    handles = []
    for index in keep:
        calls = tape.outputs.setdefault(index, [])

        def hook(_m: Any, _a: Any, out: Any, calls: list[torch.Tensor] = calls) -> None:
            calls.append(out)  # a fresh tensor: the next layer never writes into its input

        handles.append(layers[index].register_forward_hook(hook))
    try:
        yield tape
    finally:
        for h in handles:
            h.remove()


@contextmanager
def resuming(
    layers: Sequence[torch.nn.Module], tape: Tape, start: int, kv: tuple[int, int]
) -> Iterator[None]:
    """Layers below ``start`` replayed from ``tape`` (layer ``start - 1``'s output, call
    after call), their cache filled with zeros of the right length; ``kv``: (KV heads, head
    dim). ``start`` 0 computes every layer."""
    if start <= 0:
        yield
        return
    replayed = iter(tape.outputs[start - 1])
    kv_heads, head_dim = kv

    def replay(layer: int) -> Any:
        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            cache = kwargs.get("past_key_values")
            if isinstance(cache, DynamicCache):
                n = hidden_states.shape[1]
                zeros = hidden_states.new_zeros(hidden_states.shape[0], kv_heads, n, head_dim)
                DynamicCache.update(cache, zeros, zeros, layer)  # no format: never read
            return next(replayed) if layer == start - 1 else hidden_states

        return forward

    for index in range(start):
        attn: Any = layers[index].self_attn
        layers[index].forward = replay(int(attn.layer_idx))
    try:
        yield
    finally:
        for index in range(start):
            del layers[index].forward
