"""What a setting's cache costs, layer by attention type, at a stated context length.

In a hybrid model (Gemma 3: 15 of 18 layers slide over 512 tokens) a sliding-window layer
caches at most its window, so a request's cache grows with its length in the full layers
alone: counting layers, or multiplying a per-layer figure by the layer count, misstates both
the cache a request takes and what keeping layers in BF16 costs. The arithmetic is
``replay.serving.kv_layout``'s (vLLM 0.32's blocks and windows), read at one context length:
the model's max length, where vLLM states its cache size (``kv_cache_size_tokens`` is the
concurrency at ``max_model_len``) and where a long request holds the most. For a model whose
layers all attend in full every layer holds the same tokens, the context cancels out, and
the figures are exactly the per-token sums they always were.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.serving.kv_layout import Engine, KvLayout, capacity_ratio

# Where a config states no max length: a context at which any sliding window up to 4K is
# already full, so the figures are those of a long request.
FALLBACK_CONTEXT = 32768


@dataclass(frozen=True)
class Capacity:
    """The model's cache layout and the context length its figures are stated at."""

    layout: KvLayout
    context: int

    @property
    def hybrid(self) -> bool:
        return self.layout.hybrid

    def ratio(self, fmt: str = "fp8", skip: Collection[int] = ()) -> float:
        """Requests of ``context`` tokens the cache holds in ``fmt`` (``skip`` in BF16) over
        those it holds in BF16."""
        return capacity_ratio(self.layout, self.context, fmt, tuple(skip))

    def bytes_per_token(self, fmt: str = "fp8", skip: Collection[int] = ()) -> float:
        """A request's cache bytes at ``context`` tokens over the slots a full layer gives
        it: a uniform model's bytes per token exactly, a hybrid's mean at that length."""
        block = Engine().block_size
        slots = math.ceil(self.context / block) * block
        return self.layout.request_bytes(self.context, fmt, tuple(skip)) / slots

    def at(self) -> str:
        """Where the figures hold: nothing to say for a uniform model (any length), the
        context for a hybrid one."""
        return f" at {self.context:,} tokens" if self.hybrid else ""

    def to_json(self) -> dict[str, Any]:
        return {
            "context_tokens": self.context,
            "context_from": "the model's max length (max_position_embeddings)",
            "hybrid": self.hybrid,
            "sliding_layers": list(self.layout.sliding),
            "windows": list(self.layout.windows),
        }


def model_capacity(model_dir: Path, config: Any, shape: tuple[int, int, int]) -> Capacity:
    """The capacity arithmetic of the model in ``model_dir``: its ``config.json`` read as
    vLLM reads it (each layer's attention type), else every layer in full at ``shape``
    (layers, kv_heads, head_dim); stated at the model's max length."""
    layers, kv_heads, head_dim = shape
    layout = KvLayout.of_model(model_dir)
    if layout is None or layout.layers != layers:
        layout = KvLayout((None,) * layers, kv_heads, head_dim)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = getattr(text, "max_position_embeddings", None)
    if not isinstance(context, int) or context < 1:
        context = FALLBACK_CONTEXT
    return Capacity(layout, context)
