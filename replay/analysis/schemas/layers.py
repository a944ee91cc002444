"""The served KV cache read per layer type, in summary.json (``TargetSummary.layer_capacity``).

A model whose layers attend differently (Gemma 3: 15 of 18 layers slide over 512 tokens) holds
a request's cache per layer type: its sliding-window layers keep at most their window, so
``kv_cache_size_tokens / context`` (what a model of full-attention layers holds at once) is
wrong at every context. Where a target's model folder is here (a local target's, or the folder
its server reports), the summary reads each layer's attention type off its ``config.json``
(``serving.kv_layout``, ``serving.kv_served``): this record says what it read, and each
bucket's ``Capacity`` is then computed from it (``per_layer_type``). ``schemas`` re-exports it.
"""

from __future__ import annotations

from replay.core.record_json import Record, record


@record
class LayerCapacity(Record):
    """The layout the capacity figures were computed from, and the cache it predicts."""

    model: str  # the folder whose config.json gave each layer's attention type
    layers: int
    sliding_layers: int  # of ``layers``, those with a sliding window
    sliding_window: int | None  # tokens (the longest, if they differ); None: none slides
    skip_layers: tuple[int, ...]  # layers served in BF16 (the server's skip layers, resolved)
    cache_bytes: float  # the served cache, from ``cache_bytes_from``
    # kv_cache_memory_bytes, num_gpu_blocks (times a block's bytes) or, where the server
    # reports neither, kv_cache_size_tokens read back through the layout (no prediction then).
    cache_bytes_from: str
    # The kv_cache_size_tokens these bytes give at max_model_len, counted per layer type as
    # vLLM does; None without max_model_len or when the bytes came from that figure.
    predicted_kv_cache_size_tokens: float | None
