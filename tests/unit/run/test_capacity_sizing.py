"""The capacity phase's cache (``run.capacity_plan.size``): the loop's demand at the workload's
median length must be ``PRESSURE`` times what the reference's cache holds, and the served cache
is checked once its server is up (``Plan.check``). For a hybrid model that is counted per layer
type: Gemma 3 270M's 1 GiB BF16 cache reports 247,802 tokens at 32,768 (4,333 bytes a token),
yet one request of 2,000 tokens takes 37.9 MiB, not 8.3."""

from __future__ import annotations

from typing import Any

import pytest

from replay.analysis.run_spec import CapacitySpec
from replay.core.records import Result
from replay.run.capacity_plan import (
    MARGIN_TOKENS,
    MIB,
    MIN_PRESSURE,
    PRESSURE,
    Plan,
    RefLayers,
    kv_bytes_per_token,
    ref_layers,
    size,
)
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
OPTS = CapacitySpec(mode="on", concurrency=8)


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
    # The loop's 8 requests of the median 2,000 tokens are twice what the cache holds: 4, to
    # the MiB it rounds up.
    assert OPTS.concurrency / PRESSURE <= held < OPTS.concurrency / PRESSURE + 0.1
    assert p.cache_bytes - MIB < 4 * layers.request_bytes(2000) <= p.cache_bytes
    assert layers.request_bytes(2000) == pytest.approx(GIB / 27.04, rel=2e-3)
    assert "per layer type (15 of 18 layers slide over 512 tokens)" in p.sizing
    assert "hold 4 of the 8 requests in flight" in p.sizing
    assert "median 2000 tokens (37.9 MiB each)" in p.sizing
    # Bytes per token would have sized a cache that holds one such request, not 4.
    old = plan(size(work, {}, per_token, 32768, OPTS))
    assert concurrency(gemma(), old.cache_bytes, 2000) < 1.1
    assert "4333 bytes a token" in old.sizing


def test_the_median_is_of_the_answers_as_served_prompt_and_output() -> None:
    """Three length bands as traces/first_run.jsonl has them: the median request is the middle
    band's, counted with its output, and the cache is twice smaller than the loop's demand."""
    work = results(*([60] * 7 + [514] * 7 + [1400] * 7))
    p = plan(size(work, {}, 2048.0, 8192, CapacitySpec(mode="on", concurrency=12)))
    assert p.median_tokens == 514 and p.max_model_len == 1400
    tokens = p.cache_bytes / 2048.0
    assert 12 * 514 / PRESSURE <= tokens < 12 * 514 / PRESSURE + MIB / 2048.0
    assert p.longest_over_median == pytest.approx(1400 / 514)


def test_the_served_cache_is_checked_once_its_server_is_up() -> None:
    """vLLM's own count at the model length (per layer type), scaled to the median request:
    a server that holds more than planned leaves too little pressure, and the phase says so."""
    p = plan(size(results(*([600] * 5)), {}, 2048.0, None, CapacitySpec(mode="on", concurrency=12)))
    assert p.max_model_len == p.median_tokens == 600  # every request of one length
    pressure, problem = p.check({"kv_cache_max_concurrency": "6.0"})
    assert pressure == pytest.approx(2.0) and problem is None
    pressure, problem = p.check({"kv_cache_max_concurrency": "10"})
    assert pressure is not None and pressure < MIN_PRESSURE
    assert pressure == pytest.approx(1.2)
    assert problem is not None and "holds 10.0 requests of the median 600 tokens" in problem
    assert "--capacity-concurrency" in problem
    assert p.check({}) == (None, None)  # a server that does not say: nothing to check
    assert p.check({"kv_cache_max_concurrency": "n/a"}) == (None, None)


def test_the_cache_holds_the_longest_request_and_a_margin() -> None:
    """A loop of 1 at the median would not fit a 32K request: vLLM would refuse to start."""
    layers = RefLayers(gemma(), "fp8", gemma().sliding)
    work = results(600, 600, 30000)
    p = plan(size(work, {}, None, 32768, CapacitySpec(mode="on", concurrency=1), layers))
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
    p = plan(
        size(
            results(2000),
            {},
            None,
            None,
            CapacitySpec(mode="on", concurrency=8, cache_mib=256),
            RefLayers(gemma()),
        )
    )
    assert p.cache_bytes == 256 * MIB and p.sizing == "--capacity-cache-mib 256"
