"""Gemma 3 270M's attention layout and what vLLM CPU 0.32 served of it, as test data: the
fields of its config.json the layout reads (every sixth layer attends in full, the rest over
512 tokens) and the ``vllm:cache_config_info`` labels of three servers with 1 GiB of cache
each (BF16, FP8, FP8 with the sliding-window layers in BF16)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SLIDE, FULL = "sliding_attention", "full_attention"
GEMMA: dict[str, Any] = {
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "hidden_size": 640,
    "sliding_window": 512,
    "layer_types": [FULL if i % 6 == 5 else SLIDE for i in range(18)],
}
SLIDING = (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16)


def _labels(dtype: str, blocks: str, tokens: str, conc: str, skip: str) -> dict[str, str]:
    return {
        "cache_dtype": dtype,
        "block_size": "128",
        "num_gpu_blocks": blocks,
        "kv_cache_size_tokens": tokens,
        "kv_cache_max_concurrency": conc,
        "kv_cache_dtype_skip_layers": skip,
        "kv_cache_memory_bytes": "1073741824",
    }


SERVED = {
    "bf16": _labels("auto", "2730", "247802", "7.562326869806094", "[]"),
    "fp8": _labels("fp8", "5461", "495695", "15.12742382271468", "[]"),
    "fp8-swa": _labels("fp8", "2730", "383934", "11.716738197424892", "['sliding_window']"),
}


def gemma_folder(folder: Path) -> Path:
    """``folder`` with Gemma's config.json in it (a model folder as far as the layout goes)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(GEMMA), encoding="utf-8")
    return folder
