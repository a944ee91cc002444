"""How much KV cache a request takes in a model whose layers attend differently.

A full-attention layer caches every token of a request; a sliding-window layer only the last
``window`` of them, so in a hybrid model (Gemma 3: 15 of 18 layers slide over 512 tokens) a
request's cache grows with its length in the full layers alone. Counting layers (or dividing
the cache's bytes by a per-token figure) is then wrong at every length: the cache's capacity,
and what keeping some layers in BF16 costs, depend on each layer's attention type and on the
context length.

This module holds that arithmetic, as vLLM 0.32 does it (``vllm/v1/kv_cache_interface.py``,
``kv_cache_utils.get_max_concurrency_for_kv_cache_config``): a request takes whole blocks of
``block_size`` tokens in each layer; a full layer ``ceil(tokens / block)``; a sliding layer at
most ``ceil(min(window - 1 + in_flight, tokens) / block) + 1`` (it holds the window and the
tokens scheduled but not yet settled, one batch of ``max_num_batched_tokens``, and a block
the window may straddle). The engine's ``kv_cache_size_tokens`` is its concurrency at
``max_model_len`` times ``max_model_len``, so :func:`cache_tokens` predicts the figure a
server reports, for any KV format and any set of layers kept in BF16 (``skip``).

No torch here: the layout is read off a model's ``config.json``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replay.serving.kv_formats import FORMATS, KVFormat

# vLLM's --kv-cache-dtype-skip-layers word for every sliding-window layer.
SLIDING_WINDOW = "sliding_window"
# vLLM CPU 0.32's defaults: 128-token blocks, 2,048 tokens scheduled a step.
CPU_BLOCK_SIZE = 128
CPU_IN_FLIGHT_TOKENS = 2048


@dataclass(frozen=True)
class Engine:
    """How the engine holds a request's KV: its block size and the tokens a step may
    schedule (``max_num_batched_tokens``), which a sliding layer keeps beside its window."""

    block_size: int = CPU_BLOCK_SIZE
    in_flight_tokens: int = CPU_IN_FLIGHT_TOKENS


@dataclass(frozen=True)
class KvLayout:
    """Each layer's attention (``None``: full; an int: a sliding window of that many
    tokens), and the KV heads and head size every layer shares."""

    windows: tuple[int | None, ...]
    kv_heads: int
    head_dim: int

    @property
    def layers(self) -> int:
        return len(self.windows)

    @property
    def sliding(self) -> tuple[int, ...]:
        """The sliding-window layers' indices."""
        return tuple(i for i, w in enumerate(self.windows) if w is not None)

    @property
    def hybrid(self) -> bool:
        return 0 < len(self.sliding) < self.layers

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> KvLayout | None:
        """The layout a ``config.json`` declares (a multimodal one's ``text_config``); None
        when it declares no attention shape. ``layer_types`` names each layer's attention
        (``sliding_attention`` / ``full_attention``); without it, a ``sliding_window`` applies
        to every layer (Mistral) unless ``use_sliding_window`` is false (Qwen 2)."""
        text = config.get("text_config") or config
        try:
            layers = int(text["num_hidden_layers"])
            heads = int(text["num_attention_heads"])
            kv_heads = int(text.get("num_key_value_heads") or heads)
            head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return None
        window = text.get("sliding_window")
        window = int(window) if isinstance(window, int) and window > 0 else None
        types = text.get("layer_types")
        if isinstance(types, list) and len(types) == layers:
            windows = tuple(window if t == "sliding_attention" else None for t in types)
        elif window is not None and text.get("use_sliding_window", True) is not False:
            windows = (window,) * layers
        else:
            windows = (None,) * layers
        return cls(windows, kv_heads, head_dim)

    @classmethod
    def of_model(cls, model_dir: str | Path | None) -> KvLayout | None:
        """The layout of a local model folder, if it has a readable ``config.json``."""
        if model_dir is None:
            return None
        try:
            config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return cls.from_config(config) if isinstance(config, dict) else None

    def skip_indices(self, words: Iterable[str]) -> tuple[int, ...]:
        """The layers ``--kv-cache-dtype-skip-layers`` words name: indices, and
        ``sliding_window`` for every sliding-window layer."""
        out: set[int] = set()
        for word in words:
            for part in str(word).replace(",", " ").split():
                if part == SLIDING_WINDOW:
                    out.update(self.sliding)
                elif part.isdigit():
                    out.add(int(part))
        return tuple(sorted(out))

    def layer_tokens(self, layer: int, tokens: int, engine: Engine = Engine()) -> int:
        """Cache slots (tokens, whole blocks) one request of ``tokens`` holds in ``layer``
        at most."""
        block, window = engine.block_size, self.windows[layer]
        if window is None:
            return math.ceil(tokens / block) * block
        held = min(window - 1 + engine.in_flight_tokens, tokens)
        return (math.ceil(held / block) + 1) * block

    def request_bytes(
        self,
        tokens: int,
        fmt: str = "auto",
        skip: Collection[int] = (),
        engine: Engine = Engine(),
    ) -> float:
        """Cache bytes one request of ``tokens`` holds at most, its layers in ``fmt`` but
        those in ``skip``, kept in BF16."""
        return sum(
            self.layer_tokens(i, tokens, engine) * self._per_token(fmt, i in skip)
            for i in range(self.layers)
        )

    def _per_token(self, fmt: str, bf16: bool) -> float:
        f: KVFormat = FORMATS["bfloat16" if bf16 else fmt]
        return f.bytes_per_token_head(self.head_dim) * self.kv_heads


def concurrency(
    layout: KvLayout,
    cache_bytes: float,
    tokens: int,
    fmt: str = "auto",
    skip: Collection[int] = (),
    engine: Engine = Engine(),
) -> float:
    """Requests of ``tokens`` that ``cache_bytes`` hold at once."""
    return cache_bytes / layout.request_bytes(tokens, fmt, skip, engine)


def cache_tokens(
    layout: KvLayout,
    cache_bytes: float,
    max_model_len: int,
    fmt: str = "auto",
    skip: Collection[int] = (),
    engine: Engine = Engine(),
) -> float:
    """The ``kv_cache_size_tokens`` vLLM reports for this cache: its concurrency at
    ``max_model_len``, times ``max_model_len``."""
    return concurrency(layout, cache_bytes, max_model_len, fmt, skip, engine) * max_model_len


def capacity_ratio(
    layout: KvLayout,
    tokens: int,
    fmt: str = "fp8",
    skip: Collection[int] = (),
    engine: Engine = Engine(),
) -> float:
    """Requests of ``tokens`` the same cache holds in ``fmt`` (``skip`` kept BF16) over
    those it holds in BF16: 2x for FP8 with nothing skipped, less the more of the cache the
    skipped layers hold at that length."""
    return layout.request_bytes(tokens, "auto", (), engine) / layout.request_bytes(
        tokens, fmt, skip, engine
    )
