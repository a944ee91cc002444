"""A request's KV cache per layer type (``serving.kv_layout``) and a served cache read through
it (``serving.kv_served``), against what vLLM CPU 0.32 reported for Gemma 3 270M (15 of 18
layers sliding over 512 tokens) with a 1 GiB cache: 247,802 tokens in BF16, 495,695 in FP8 and
383,934 in FP8 with the sliding-window layers kept BF16, at max_model_len 32,768."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.core.errors import ConfigError
from replay.serving.kv_layout import (
    SLIDING_WINDOW,
    KvLayout,
    cache_tokens,
    capacity_ratio,
    concurrency,
)
from replay.serving.kv_served import (
    FROM_BLOCKS,
    FROM_MEMORY,
    FROM_SIZE,
    ServedCache,
    layout_of,
    skip_words,
)
from replay.serving.local_server import EMULATION_SKIP_ENV, LocalServer
from replay.serving.targets import TargetSpec
from tests.support.gemma_layout import GEMMA, SERVED

GIB = 1 << 30
MAX_LEN = 32768
# What the three servers' vllm:cache_config_info said (the labels the analysis reads).


def gemma() -> KvLayout:
    layout = KvLayout.from_config(GEMMA)
    assert layout is not None
    return layout


def test_gemma_layout_reads_its_sliding_layers() -> None:
    g = gemma()
    assert (g.layers, g.kv_heads, g.head_dim, g.hybrid) == (18, 1, 256, True)
    assert g.sliding == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16)
    assert [i for i, w in enumerate(g.windows) if w is None] == [5, 11, 17]


@pytest.mark.parametrize(
    ("fmt", "skip", "served"),
    [("auto", "", 247_802), ("fp8", "", 495_695), ("fp8", SLIDING_WINDOW, 383_934)],
)
def test_cache_tokens_predict_what_vllm_served(fmt: str, skip: str, served: int) -> None:
    g = gemma()
    predicted = cache_tokens(g, GIB, MAX_LEN, fmt, g.skip_indices([skip]))
    assert predicted == pytest.approx(served, rel=1e-3)


def test_keeping_the_sliding_layers_bf16_costs_by_their_window_not_their_count() -> None:
    """1.55x BF16 at 32K, where counting layers (3 of 18 in FP8) would say 1.09x."""
    g = gemma()
    ratio = capacity_ratio(g, MAX_LEN, "fp8", g.skip_indices([SLIDING_WINDOW]))
    assert ratio == pytest.approx(383_934 / 247_802, rel=1e-3)
    assert capacity_ratio(g, MAX_LEN, "fp8") == pytest.approx(2.0)
    by_count = 18 / (15 + 3 / 2)
    assert ratio > by_count + 0.4


def test_a_hybrid_models_concurrency_is_not_tokens_over_context() -> None:
    """At 2,000 tokens a BF16 request holds 2,048 slots in each full layer and 17 blocks'
    worth in each sliding one (its window, a step's tokens, a straddled block): 27 requests,
    where 247,802 / 2,000 says 124."""
    g = gemma()
    held = concurrency(g, GIB, 2000)
    assert held == pytest.approx(GIB / ((15 * 17 * 128 + 3 * 2048) * 1024))
    assert 26 < held < 28
    assert 4 * held < 247_802 / 2000


def test_an_all_sliding_model_holds_a_window_whatever_the_length() -> None:
    """Mistral 7B v0.1: every layer slides over 4,096 tokens (no layer_types)."""
    mistral = KvLayout.from_config(
        {
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_size": 4096,
            "sliding_window": 4096,
        }
    )
    assert mistral is not None and mistral.sliding == tuple(range(32)) and not mistral.hybrid
    assert mistral.head_dim == 128
    # min(window - 1 + 2,048 in flight, tokens): bounded from 6,143 tokens on.
    assert mistral.request_bytes(8192) == mistral.request_bytes(32768)
    assert mistral.request_bytes(4096) < mistral.request_bytes(8192)
    assert mistral.skip_indices([SLIDING_WINDOW]) == tuple(range(32))


def test_a_plain_llama_is_tokens_over_context_in_whole_blocks() -> None:
    """Every layer attends in full (Qwen 2's use_sliding_window false counts as none)."""
    llama = KvLayout.from_config(
        {
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_size": 2048,
            "sliding_window": 4096,
            "use_sliding_window": False,
        }
    )
    assert llama is not None and llama.sliding == () and not llama.hybrid
    per_token = 16 * 8 * 64 * 2 * 2  # layers x KV heads x head size x (K, V) x BF16 bytes
    assert llama.request_bytes(1280) == 1280 * per_token
    assert llama.request_bytes(1281) == 1408 * per_token  # one more block
    cache = 100_000 * per_token
    assert cache_tokens(llama, cache, 4096) == pytest.approx(100_000)
    assert llama.skip_indices([SLIDING_WINDOW]) == ()
    # 16 BF16 layers over 14 in FP8 (half the bytes) and 2 kept BF16.
    assert capacity_ratio(llama, 4096, "fp8", (0, 15)) == pytest.approx(32 / 18)


def test_skip_indices_read_the_keyword_and_indices_as_vllm_takes_them() -> None:
    g = gemma()
    assert g.skip_indices(["5", "11"]) == (5, 11)
    assert g.skip_indices(["0,3", "3"]) == (0, 3)
    assert g.skip_indices([SLIDING_WINDOW, "5"]) == tuple(sorted((*g.sliding, 5)))
    assert g.skip_indices(["full"]) == ()


def test_skip_words_read_the_label_and_the_flag() -> None:
    assert skip_words("['sliding_window']") == (SLIDING_WINDOW,)
    assert skip_words("['5', '11']") == ("5", "11")
    assert skip_words(["0,29"]) == ("0", "29")
    assert skip_words("[]") == skip_words(None) == ()


@pytest.mark.parametrize("arm", ["bf16", "fp8", "fp8-swa"])
def test_a_served_cache_is_read_through_its_layout(arm: str) -> None:
    served = ServedCache.of(gemma(), SERVED[arm], MAX_LEN)
    assert served is not None and served.bytes_from == FROM_MEMORY
    assert served.skip == (gemma().sliding if arm == "fp8-swa" else ())
    predicted = served.cache_tokens(MAX_LEN)
    assert predicted == pytest.approx(float(SERVED[arm]["kv_cache_size_tokens"]), rel=1e-3)
    # At max_model_len the engine's own concurrency; shorter, many fewer than tokens / context.
    engine = float(SERVED[arm]["kv_cache_max_concurrency"])
    assert served.concurrency(MAX_LEN) == pytest.approx(engine, rel=1e-3)
    size = float(SERVED[arm]["kv_cache_size_tokens"])
    assert served.concurrency(500) < size / 500 / 3


def test_without_the_memory_label_a_hybrid_cache_is_read_back_from_its_size() -> None:
    labels = {k: v for k, v in SERVED["fp8-swa"].items() if k != "kv_cache_memory_bytes"}
    served = ServedCache.of(gemma(), labels, MAX_LEN)
    assert served is not None and served.bytes_from == FROM_SIZE
    assert served.cache_bytes == pytest.approx(GIB, rel=1e-3)
    assert served.cache_tokens(MAX_LEN) is None  # nothing to check it against
    assert ServedCache.of(gemma(), labels, None) is None


def test_a_uniform_cache_is_its_blocks_times_a_blocks_bytes() -> None:
    llama = KvLayout((None,) * 4, kv_heads=2, head_dim=64)
    labels = {"cache_dtype": "fp8", "block_size": "16", "num_gpu_blocks": "1000"}
    served = ServedCache.of(llama, labels, 2048)
    assert served is not None and served.bytes_from == FROM_BLOCKS
    assert served.cache_bytes == 1000 * 16 * 4 * 2 * 64 * 2  # FP8: a byte a value
    assert served.cache_tokens(2048) == pytest.approx(16_000)


def test_a_format_whose_layout_is_not_modelled_gives_no_served_cache() -> None:
    assert ServedCache.of(gemma(), {**SERVED["fp8"], "cache_dtype": "fp8_ds_mla"}) is None
    assert ServedCache.of(gemma(), {"cache_dtype": "auto"}, MAX_LEN) is None


def _gemma_dir(tmp_path: Path) -> Path:
    import json

    (tmp_path / "config.json").write_text(json.dumps(GEMMA), encoding="utf-8")
    return tmp_path


def test_layout_of_takes_the_first_model_folder_here(tmp_path: Path) -> None:
    folder = _gemma_dir(tmp_path)
    found = layout_of(None, str(tmp_path / "nowhere"), str(folder))
    assert found is not None and found == (gemma(), str(folder))
    assert layout_of(None, "/no/such/model") is None


def test_an_emulated_arm_gives_the_plugin_sliding_window_as_indices(tmp_path: Path) -> None:
    """kvcal's plugin reads KVCANARY_KV_EMULATION_SKIP_LAYERS as indices (0,3)."""
    spec = TargetSpec(
        "fp8-swa",
        model=str(_gemma_dir(tmp_path)),
        kv_cache_dtype="fp8-emulated",
        args=("--kv-cache-dtype-skip-layers", "5", SLIDING_WINDOW, "--x"),
    )
    server = LocalServer(spec, tmp_path / "log")
    env = server.environment()
    assert env[EMULATION_SKIP_ENV] == ",".join(map(str, sorted((*gemma().sliding, 5))))
    assert "--kv-cache-dtype-skip-layers" not in server.command()
    assert SLIDING_WINDOW not in server.command() and "--x" in server.command()


def test_an_emulated_arm_without_a_layout_refuses_the_keyword(tmp_path: Path) -> None:
    spec = TargetSpec(
        "fp8-swa",
        model=str(tmp_path),
        kv_cache_dtype="fp8-emulated",
        args=("--kv-cache-dtype-skip-layers", SLIDING_WINDOW),
    )
    with pytest.raises(ConfigError, match="sliding_window needs the model's layer types"):
        LocalServer(spec, tmp_path / "log").environment()
    indices = TargetSpec(
        "fp8-skip",
        model=str(tmp_path),
        kv_cache_dtype="fp8-emulated",
        args=("--kv-cache-dtype-skip-layers", "0,3", "7"),
    )
    assert LocalServer(indices, tmp_path / "log").environment()[EMULATION_SKIP_ENV] == "0,3,7"
