"""A target's served cache read per layer type, for the summary (``schemas.layers``).

The summary's target entries (``pipeline.target_facts``) name the folders that may
hold the target's model (its spec's, then the one its server reports) and its
``max_model_len``; where one of them is a model folder here, each bucket's capacity is counted
per layer type (``serving.kv_served``) instead of as ``kv_cache_size_tokens / context``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replay.analysis.schemas.layers import LayerCapacity
from replay.serving.kv_served import ServedCache, layout_of


def served_cache(info: Mapping[str, Any]) -> tuple[ServedCache, LayerCapacity] | None:
    """The target's served cache in its model's terms, and the record of what was read; None
    where no model folder is here or the server's labels do not say enough."""
    dirs = info.get("model_dirs") or ()
    found = layout_of(*(d for d in dirs if isinstance(d, str)))
    if found is None:
        return None
    layout, folder = found
    max_len = info.get("max_model_len")
    max_len = max_len if isinstance(max_len, int) and max_len > 0 else None
    served = ServedCache.of(layout, info.get("cache_config") or {}, max_len)
    if served is None:
        return None
    windows = [w for w in layout.windows if w is not None]
    return served, LayerCapacity(
        model=folder,
        layers=layout.layers,
        sliding_layers=len(windows),
        sliding_window=max(windows, default=None),
        skip_layers=served.skip,
        cache_bytes=served.cache_bytes,
        cache_bytes_from=served.bytes_from,
        predicted_kv_cache_size_tokens=served.cache_tokens(max_len) if max_len else None,
    )
