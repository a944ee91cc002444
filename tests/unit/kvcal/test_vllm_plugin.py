"""kvcal's vLLM plugin (``kvcal.vllm_plugin``), without a server: a no-op unless an emulated
target asks for it, and, asked, the cache write it patches rounds K and V through the format
it is given, at the layer's scale, except in skipped layers and a served FP8 cache. How an
emulated target asks for it is tests/unit/serving/test_fp8_emulation.py."""

from __future__ import annotations

from typing import Any

import pytest

from replay.serving.local_server import EMULATION_ENV, EMULATION_ROUNDING_ENV, EMULATION_SKIP_ENV


def test_plugin_is_a_no_op_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcal import vllm_plugin

    monkeypatch.delenv(EMULATION_ENV, raising=False)
    vllm_plugin.register()  # imports nothing from vLLM, patches nothing
    monkeypatch.setenv(EMULATION_ENV, "e5m2")
    with pytest.raises(ValueError, match="not an emulated KV format"):
        vllm_plugin.register()
    monkeypatch.setenv(EMULATION_ENV, "nvfp4")
    monkeypatch.setenv(EMULATION_ROUNDING_ENV, "nearest")
    with pytest.raises(ValueError, match="expected cpu or cuda"):
        vllm_plugin.register()
    assert vllm_plugin.parse_skip_layers(" 0, 3") == {0, 3}
    with pytest.raises(ValueError, match="layer indices"):
        vllm_plugin.parse_skip_layers("first")


class _Layer:
    def __init__(self, index: int, k_scale: Any = None) -> None:
        self.layer_name = f"model.layers.{index}.self_attn.attn"
        if k_scale is not None:  # as vLLM keeps them: a tensor, loaded or its default 1.0
            self._k_scale = k_scale


def test_plugin_rounds_k_and_v_at_the_cache_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """The patched write hands vLLM's own write the E4M3 round trip of K and V, at the
    checkpoint's scale (per head here) or 1.0, except in skipped layers and served FP8."""
    torch = pytest.importorskip("torch")
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    from kvcal import vllm_plugin
    from kvcal._fp8 import e4m3_roundtrip, vllm_head_scale

    seen: list[tuple[Any, Any]] = []

    def record(self: Any, layer: Any, key: Any, value: Any, kv_cache: Any, slots: Any) -> None:
        seen.append((key, value))

    monkeypatch.setattr(cpu_attn.CPUAttentionBackendImpl, "do_kv_cache_update", record)
    monkeypatch.setenv(EMULATION_ENV, "fp8")
    monkeypatch.setenv(EMULATION_SKIP_ENV, "2")
    vllm_plugin.register()
    write = cpu_attn.CPUAttentionBackendImpl.do_kv_cache_update
    gen = torch.Generator().manual_seed(0)
    key = (torch.randn(5, 2, 32, generator=gen) * 300).to(torch.bfloat16)
    value = torch.randn(5, 2, 32, generator=gen).to(torch.bfloat16)
    impl = type("Impl", (), {"kv_cache_dtype": "auto"})()
    per_head = torch.tensor([2.0, 0.5])

    write(impl, _Layer(0, per_head), key, value, None, None)
    assert torch.equal(seen[-1][0], e4m3_roundtrip(key, vllm_head_scale(per_head, 2)))
    assert torch.equal(seen[-1][1], e4m3_roundtrip(value, 1.0))
    assert not torch.equal(seen[-1][0], key)
    write(impl, _Layer(2), key, value, None, None)  # skipped layer: BF16 as it came
    assert seen[-1][0] is key and seen[-1][1] is value
    served = type("Impl", (), {"kv_cache_dtype": "fp8"})()
    write(served, _Layer(0), key, value, None, None)  # a real FP8 cache rounds itself
    assert seen[-1][0] is key


def test_plugin_rounds_through_the_format_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """A per-token-head format ignores the layer's scale; NVFP4 reads it (one, per tensor)."""
    torch = pytest.importorskip("torch")
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    from kvcal import vllm_plugin
    from kvcal._kv_formats import kv_roundtrip

    seen: list[tuple[Any, Any]] = []

    def record(self: Any, layer: Any, key: Any, value: Any, kv_cache: Any, slots: Any) -> None:
        seen.append((key, value))

    impl = type("Impl", (), {"kv_cache_dtype": "auto"})()
    key = (torch.randn(5, 2, 32) * 3).to(torch.bfloat16)
    for fmt, scale in (("int8_per_token_head", 1.0), ("nvfp4", 2.0)):
        monkeypatch.setattr(cpu_attn.CPUAttentionBackendImpl, "do_kv_cache_update", record)
        monkeypatch.setenv(EMULATION_ENV, fmt)
        monkeypatch.setenv(EMULATION_ROUNDING_ENV, "cuda")
        vllm_plugin.register()
        write = cpu_attn.CPUAttentionBackendImpl.do_kv_cache_update
        write(impl, _Layer(0, torch.tensor([2.0, 2.0])), key, key, None, None)
        assert torch.equal(seen[-1][0], kv_roundtrip(fmt, key, scale, rounding="cuda")), fmt
