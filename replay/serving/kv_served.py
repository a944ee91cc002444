"""A served KV cache read through its model's layout (``kv_layout``): how many requests of a
given length the cache a server reports holds at once, each layer counted by its attention type.

The server's ``vllm:cache_config_info`` labels give the cache's bytes (``kv_cache_memory_bytes``;
on a server given a GPU memory share instead, ``num_gpu_blocks`` times a block's bytes), its
format (``cache_dtype``), its block size and the layers kept in BF16
(``kv_cache_dtype_skip_layers``, as vLLM echoes the flag: indices or ``sliding_window``). With
the model's ``config.json`` (a local target's folder, or the folder a server reports in
``/v1/models`` when it exists here) that is enough to say what the cache holds at any context,
where ``kv_cache_size_tokens / context`` is right only for a model whose layers all attend in
full.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.serving import kv_formats
from replay.serving.kv_layout import SLIDING_WINDOW, Engine, KvLayout, concurrency

# Where a served cache's bytes came from: the engine's own label, its blocks, or (neither
# reported, a hybrid model) its kv_cache_size_tokens read back through the layout, which then
# cannot be checked against the layout's prediction.
FROM_MEMORY, FROM_BLOCKS, FROM_SIZE = (
    "kv_cache_memory_bytes",
    "num_gpu_blocks",
    "kv_cache_size_tokens",
)


def layout_of(*folders: str | Path | None) -> tuple[KvLayout, str] | None:
    """The layout of the first of ``folders`` that is a local model folder, and that folder."""
    for folder in folders:
        layout = KvLayout.of_model(folder)
        if layout is not None:
            return layout, str(folder)
    return None


def skip_words(text: str | Iterable[str] | None) -> tuple[str, ...]:
    """The words of a skip-layers value: ``"['sliding_window']"`` (the label), ``"0,29"``,
    ``["5", "11"]`` (the flag's words); anything but an index or the keyword is left out."""
    if text is None:
        return ()
    joined = text if isinstance(text, str) else " ".join(map(str, text))
    return tuple(w for w in re.findall(r"\w+", joined) if w.isdigit() or w == SLIDING_WINDOW)


def _num(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) and out > 0 else None


def _token_bytes(layout: KvLayout, fmt: str, skip: Iterable[int]) -> float:
    """One token's cache bytes across every layer (those in ``skip`` in BF16)."""
    kept = set(skip)
    return sum(
        kv_formats.FORMATS["bfloat16" if i in kept else fmt].bytes_per_token_head(layout.head_dim)
        * layout.kv_heads
        for i in range(layout.layers)
    )


@dataclass(frozen=True)
class ServedCache:
    """A server's cache in the terms of its model's layout."""

    layout: KvLayout
    fmt: str  # the served cache_dtype, a key of kv_formats.FORMATS
    skip: tuple[int, ...]  # layers kept in BF16
    engine: Engine
    cache_bytes: float
    bytes_from: str  # FROM_MEMORY, FROM_BLOCKS or FROM_SIZE

    @classmethod
    def of(
        cls, layout: KvLayout, labels: Mapping[str, Any], max_model_len: int | None = None
    ) -> ServedCache | None:
        """The cache the labels describe; None where they do not say enough (no format whose
        layout is modelled, no bytes, blocks or size to read the bytes from)."""
        fmt = str(labels.get("cache_dtype") or "auto")
        if kv_formats.FORMATS.get(fmt) is None or kv_formats.FORMATS[fmt].family == "other":
            return None
        skip = layout.skip_indices(skip_words(labels.get("kv_cache_dtype_skip_layers")))
        block = _num(labels.get("block_size"))
        engine = Engine(block_size=int(block)) if block else Engine()
        memory, blocks = (
            _num(labels.get("kv_cache_memory_bytes")),
            _num(labels.get("num_gpu_blocks")),
        )
        size = _num(labels.get("kv_cache_size_tokens"))
        uniform = len(set(layout.windows)) == 1
        if memory:
            cache, source = memory, FROM_MEMORY
        elif blocks and uniform:
            # One KV cache group: a block holds block_size tokens of every layer.
            cache, source = (
                blocks * engine.block_size * _token_bytes(layout, fmt, skip),
                FROM_BLOCKS,
            )
        elif size and max_model_len:
            # vLLM's size is its concurrency at max_model_len times max_model_len.
            per = layout.request_bytes(max_model_len, fmt, skip, engine)
            cache, source = size / max_model_len * per, FROM_SIZE
        else:
            return None
        return cls(layout, fmt, skip, engine, cache, source)

    def concurrency(self, tokens: float) -> float:
        """Requests of ``tokens`` the cache holds at once."""
        return concurrency(
            self.layout, self.cache_bytes, math.ceil(tokens), self.fmt, self.skip, self.engine
        )

    def cache_tokens(self, max_model_len: int) -> float | None:
        """The ``kv_cache_size_tokens`` the layout predicts; None when the bytes were read from
        that figure (it would only be given back)."""
        if self.bytes_from == FROM_SIZE:
            return None
        return self.concurrency(max_model_len) * max_model_len
