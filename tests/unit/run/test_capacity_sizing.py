"""The capacity phase's cache (``run.capacity.size``): the reference must hold ``HOLDS`` of the
loop's requests of the workload's median length. For a hybrid model that is counted per layer
type: Gemma 3 270M's 1 GiB BF16 cache reports 247,802 tokens at 32,768 (4,333 bytes a token),
yet one request of 2,000 tokens takes 37.9 MiB, not 8.3."""

from __future__ import annotations

from typing import Any

import pytest

from replay.core.records import Result
from replay.run.capacity import (
    HOLDS,
    MARGIN_TOKENS,
    MIB,
    Plan,
    RefLayers,
    kv_bytes_per_token,
    ref_layers,
    size,
)
from replay.run.config import CapacityOptions
from replay.serving.kv_layout import Engine, KvLayout, concurrency
from replay.serving.targets import TargetSpec
from tests.support.gemma_layout import GEMMA

GIB = 1 << 30
BF16_LABELS = {
    "cache_dtype": "auto",
    "block_size": "128",
    "kv_cache_size_tokens": "247802",
    "kv_cache_dtype_skip_layers": "[]",
}
OPTS = CapacityOptions(mode="on", concurrency=8)


def gemma() -> KvLayout:
    layout = KvLayout.from_config(GEMMA)
    assert layout is not None
    return layout


def results(*tokens: int) -> list[Result]:
    return [
        Result(
            request_id=f"r{i}",
            target="bf16",
            phase="c1",
            bucket="b",
            status="ok",
            scheduled=0.0,
            prompt_tokens=n - 10,
            output_tokens=10,
        )
        for i, n in enumerate(tokens)
    ]


def plan(out: Plan | str) -> Plan:
    assert isinstance(out, Plan), out
    return out


def test_a_hybrid_reference_is_sized_per_layer_type() -> None:
    per_token = kv_bytes_per_token(
        TargetSpec("bf16", model="/m", args=("--kv-cache-memory-bytes", str(GIB))), BF16_LABELS
    )
    assert per_token == pytest.approx(GIB / 247_802)
    work = results(2000, 2000, 2000, 6000)
    layers = RefLayers(gemma())
    p = plan(size(work, {}, per_token, 32768, OPTS, layers))
    held = concurrency(gemma(), p.cache_bytes, 2000)
    # HOLDS of the loop's 8 requests of the median 2,000 tokens: 4.8, to the MiB it rounds up.
    assert HOLDS * OPTS.concurrency <= held < HOLDS * OPTS.concurrency + 0.1
    assert p.cache_bytes == pytest.approx(4.8 * GIB / 27.04, rel=2e-3)
    assert "per layer type (15 of 18 layers slide over 512 tokens)" in p.sizing
    assert "4.8 requests of the workload's median 2000 tokens (37.9 MiB each)" in p.sizing
    # Bytes per token would have sized a cache that holds one such request, not 4.8.
    old = plan(size(work, {}, per_token, 32768, OPTS))
    assert concurrency(gemma(), old.cache_bytes, 2000) < 1.1
    assert "4333 bytes a token" in old.sizing


def test_the_cache_holds_the_longest_request_and_a_margin() -> None:
    """A loop of 1 at the median would not fit a 32K request: vLLM would refuse to start."""
    layers = RefLayers(gemma(), "fp8", gemma().sliding)
    work = results(600, 600, 30000)
    p = plan(size(work, {}, None, 32768, CapacityOptions(mode="on", concurrency=1), layers))
    need = layers.request_bytes(30000 + MARGIN_TOKENS)
    assert need <= p.cache_bytes < need + MIB
    assert p.max_model_len == 30000


def test_ref_layers_read_the_served_format_skip_layers_and_block_size(tmp_path: Any) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps(GEMMA), encoding="utf-8")
    spec = TargetSpec("fp8-swa", model=str(tmp_path), kv_cache_dtype="fp8")
    labels = {"cache_dtype": "fp8", "block_size": "16", "kv_cache_dtype_skip_layers": "['5']"}
    assert ref_layers(spec, labels) == RefLayers(gemma(), "fp8", (5,), Engine(block_size=16))
    swa = {"cache_dtype": "fp8", "kv_cache_dtype_skip_layers": "['sliding_window']"}
    assert ref_layers(spec, swa) == RefLayers(gemma(), "fp8", gemma().sliding)
    assert ref_layers(TargetSpec("bf16", model=str(tmp_path / "none")), {}) is None
    assert ref_layers(spec, {"cache_dtype": "fp8_ds_mla"}) is None  # layout not modelled


def test_an_explicit_cache_size_wins() -> None:
    p = plan(size(results(2000), {}, None, None, CapacityOptions("on", 8, 256), RefLayers(gemma())))
    assert p.cache_bytes == 256 * MIB and p.sizing == "--capacity-cache-mib 256"
