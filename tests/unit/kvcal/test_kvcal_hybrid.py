"""kvcal on a hybrid-attention model (Gemma 3: sliding-window and full-attention layers) without
a server: every layer's K/V write is observed and emulated, chunked prefill across window
boundaries gives the unchunked pass's scores, answer logits stay bounded, capacity is counted
per layer type, and ``kvcal advise`` weighs the sliding-window layers as a candidate.

A tiny random Gemma 3 built here (4 layers: sliding, sliding, full, sliding, window 8) stands
in for the real one: the same transformers classes, in milliseconds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

import kvcal.emulate.cache as emulate_mod  # noqa: E402
from kvcal._advise import AdviseArgs, keep_floor, next_step  # noqa: E402
from kvcal._capacity import Capacity, model_capacity  # noqa: E402
from kvcal._observe import KVStats, ObservingCache, kv_shape, prefill  # noqa: E402
from kvcal.emulate.cache import _ids, _prefill, answer_step, new_cache, teacher_forced, uniform  # noqa: E402
from replay.serving.kv_layout import KvLayout, capacity_ratio  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
SLIDING = (0, 1, 3)
WINDOW = 8
TEST_MODEL = ROOT / "replay" / "testmodel" / "models" / "kvcanary-tiny-llama"
TRACE = ROOT / "traces" / "testmodel_heldout.jsonl"


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """Ops this small gain nothing from threads, and shared cores make waiting ones slow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_gemma(dtype: Any = torch.float32, vocab: int = 256, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,  # as Gemma 3: head_dim is not hidden_size / heads
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=WINDOW,
        layer_types=TYPES,
        max_position_embeddings=32768,
    )
    return transformers.Gemma3ForCausalLM(config).eval().to(dtype)


def _tokens(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()  # type: ignore[no-any-return]


# -- the cache: every layer, full and sliding -----------------------------------------------


def test_sliding_layers_get_window_caches_and_every_write_is_observed() -> None:
    model = tiny_gemma()
    layers, kv_heads, head_dim = kv_shape(model.config)
    assert (layers, kv_heads, head_dim) == (4, 1, 32)  # 64 / 4 would be 16
    stats = KVStats.empty(layers, kv_heads)
    cache = ObservingCache(stats, model.config)
    prefill(model, _tokens(40), cache, chunk_tokens=16)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["DynamicSlidingWindowLayer"] * 2 + [
        "DynamicLayer",
        "DynamicSlidingWindowLayer",
    ]
    # each layer saw all 40 tokens written, though a sliding one keeps only its window
    assert stats.count.tolist() == [[40 * kv_heads * head_dim] * layers] * 2
    assert (stats.amax > 0).all()
    held = [getattr(layer, "keys").shape[-2] for layer in cache.layers]  # noqa: B009
    assert held == [WINDOW - 1, WINDOW - 1, 40, WINDOW - 1]


def test_the_emulating_cache_rounds_every_layers_write() -> None:
    model = tiny_gemma()
    seen: dict[int, int] = {}

    class Counting(emulate_mod.EmulatingCache):
        def update(
            self,
            key_states: Any,
            value_states: Any,
            layer_idx: int,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            seen[layer_idx] = seen.get(layer_idx, 0) + key_states.shape[-2]
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    cache = Counting(uniform("fp8@1.0", 4), model.config)
    _prefill(model, _ids(model, _tokens(30)), cache, 7)
    assert seen == dict.fromkeys(range(4), 30)


# -- chunked prefill across window boundaries -----------------------------------------------


@pytest.mark.parametrize("chunk", [5, 8, 13])
def test_chunked_prefill_scores_as_the_unchunked_pass(chunk: int) -> None:
    """Chunks shorter than, equal to and longer than the window: the sliding masks across a
    chunk boundary see what one pass sees (float32: equal to rounding)."""
    model = tiny_gemma()
    ids = _tokens(60)
    prompt, answer = ids[:52], ids[52:]
    whole = teacher_forced(model, prompt, answer, new_cache(model, None), 4096)
    parts = teacher_forced(model, prompt, answer, new_cache(model, None), chunk)
    assert parts[1] == whole[1]
    assert parts[0] == pytest.approx(whole[0], abs=1e-5)


def test_chunked_fp8_emulation_is_the_unchunked_one_exactly_in_float64() -> None:
    """Under FP8 a rounding difference of the compute dtype can flip a value to the next
    E4M3 step and grow through the layers, so chunked and unchunked FP8 scores differ by
    more than float32 noise; computed in float64 (no flips) they are equal: the chunking
    itself changes nothing."""
    model = tiny_gemma(torch.float64)
    ids = _tokens(60)
    fp8 = uniform("fp8@1.0", 4)
    whole = teacher_forced(model, ids[:52], ids[52:], new_cache(model, fp8), 4096)
    parts = teacher_forced(model, ids[:52], ids[52:], new_cache(model, fp8), 5)
    assert parts == whole


def test_answer_logits_stay_within_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_gemma()
    assert answer_step(model, 2048) == min(2048, emulate_mod.LOGITS_BUDGET // 256)
    ids = _tokens(40)
    before = teacher_forced(model, ids[:20], ids[20:], new_cache(model, None), 64)
    monkeypatch.setattr(emulate_mod, "LOGITS_BUDGET", 3 * 256)  # 3 positions a step
    assert answer_step(model, 64) == 3
    after = teacher_forced(model, ids[:20], ids[20:], new_cache(model, None), 64)
    assert after[1] == before[1] and after[0] == pytest.approx(before[0], abs=1e-5)


def test_a_262k_vocabulary_is_scored_64_positions_a_step() -> None:
    class Config:
        vocab_size = 262144

    class Model:
        config = Config()

    assert answer_step(Model(), 2048) == 64  # 64 x 262,144 float32 logits: 64 MiB


# -- capacity per layer type ----------------------------------------------------------------


def test_capacity_is_counted_per_layer_type_at_the_stated_context(tmp_path: Path) -> None:
    model = tiny_gemma(torch.bfloat16)
    model.save_pretrained(tmp_path)
    cap = model_capacity(tmp_path, model.config, kv_shape(model.config))
    assert cap.hybrid and cap.context == 32768 and cap.layout.sliding == SLIDING
    layout = KvLayout.of_model(tmp_path)
    assert layout is not None
    assert cap.ratio("fp8", SLIDING) == capacity_ratio(layout, 32768, "fp8", SLIDING)
    assert cap.ratio("fp8") == 2.0
    # at 32K a sliding layer holds its window and one step's tokens (18 blocks of 128): the
    # 3 of them in BF16 cost far less than counting 3 of 4 layers says (2 x 4 / 7 = 1.14x),
    # the one full layer more than all 3
    assert cap.ratio("fp8", SLIDING) == (32768 + 3 * 2304) / (32768 / 2 + 3 * 2304)
    assert cap.ratio("fp8", [2]) == (32768 + 3 * 2304) / (32768 + 3 * 2304 / 2)
    assert "at 32,768 tokens" in cap.at()


@pytest.mark.parametrize("layers,kept", [(30, 6), (30, 0), (32, 2), (4, 3), (24, 1)])
def test_a_uniform_models_figures_are_what_counting_layers_gave(layers: int, kept: int) -> None:
    """Every layer in full: the context cancels out, the figures are exactly the old ones
    (SmolLM2: 6 of 30 layers in BF16 is 1.67x)."""
    cap = Capacity(KvLayout((None,) * layers, 3, 64), 8192)
    assert cap.ratio("fp8", range(kept)) == 2 * layers / (layers + kept)
    assert not cap.hybrid and cap.at() == ""
    per_layer = {"fp8": 384, "bfloat16": 768, "int8_per_token_head": 408}  # 3 heads x K+V
    for fmt, size in per_layer.items():
        assert cap.bytes_per_token(fmt) == size * layers
    assert cap.bytes_per_token("fp8", range(kept)) == 384 * (layers - kept) + 768 * kept


def test_the_keep_floor_is_counting_layers_on_a_uniform_model() -> None:
    for share in (0.25, 0.5, 0.75, 1.0):
        for layers in range(1, 41):
            for kept in range(layers + 1):
                by_count = kept <= share * layers
                by_capacity = 2 * layers / (layers + kept) >= keep_floor(share) - 1e-9
                assert by_count == by_capacity, (share, layers, kept)


# -- the advice: the sliding-window layers beside the confirmed set -------------------------


def _rows(loss: float) -> dict[str, dict[str, Any]]:
    summary = {"nll_delta_mean": loss, "nll_delta_lo": loss / 2, "nll_delta_hi": loss * 2}
    return {"fp8@1.0": {"setting": "fp8@1.0", "rounding": "cpu", "all": summary}}


def _candidate(skip: list[int], recovered: float, ratio: float, sliding: bool) -> dict[str, Any]:
    flag = "--kv-cache-dtype-skip-layers " + (
        "sliding_window" if sliding else " ".join(map(str, skip))
    )
    return {
        "skip_layers": skip,
        "recovered_share": recovered,
        "reached": recovered >= 0.8,
        "capacity_ratio": ratio,
        "flag": flag,
    }


AT = " at 32,768 tokens"


def test_the_candidate_that_recovers_enough_and_keeps_more_capacity_is_advised() -> None:
    args = AdviseArgs(Path("m"))
    per_layer = _candidate([0, 3, 7], 0.85, 1.82, False)
    sliding = _candidate(list(range(1, 18)), 0.97, 1.55, True)
    step = next_step(_rows(0.05), per_layer, args, sliding, AT)
    assert step["action"] == "skip_layers" and step["skip_layers"] == [0, 3, 7]
    text = "\n".join(step["reasons"])
    assert (
        "layers [0, 3, 7] in BF16 recover 85% of the loss (confirmed; capacity 1.82x BF16" in text
    )
    assert "sliding-window layers in BF16 (--kv-cache-dtype-skip-layers sliding_window)" in text
    assert "recover 97% of the loss (capacity 1.55x BF16 at 32,768 tokens instead of 2x)" in text
    assert "layers [0, 3, 7] keep more capacity (1.82x against 1.55x BF16 at 32,768" in text


def test_the_sliding_window_layers_are_advised_when_the_search_falls_short() -> None:
    args = AdviseArgs(Path("m"))
    per_layer = _candidate([0, 3, 7, 9], 0.6, 1.8, False)
    sliding = _candidate(list(range(15)), 0.9, 1.55, True)
    step = next_step(_rows(0.05), per_layer, args, sliding, AT)
    assert step["action"] == "skip_layers" and step["skip_layers"] == list(range(15))
    assert step["flag"] == "--kv-cache-dtype-skip-layers sliding_window"
    assert step["capacity_ratio"] == 1.55


def test_a_set_that_keeps_too_little_capacity_is_not_advised() -> None:
    """Half the layers by count, but the full-attention ones: at 32K nearly all the cache."""
    args = AdviseArgs(Path("m"))
    per_layer = _candidate([2, 5, 8], 0.9, 1.1, False)
    step = next_step(_rows(0.05), per_layer, args, None, AT)
    assert step["action"] == "reject"
    assert any("keep 1.10x BF16 at 32,768 tokens, less than 1.33x" in r for r in step["reasons"])


def test_a_uniform_models_reason_is_worded_as_before() -> None:
    args = AdviseArgs(Path("m"))
    cap = Capacity(KvLayout((None,) * 30, 3, 64), 8192)
    skip = _candidate([1, 3, 4, 12, 16, 19], 0.43, cap.ratio("fp8", [1, 3, 4, 12, 16, 19]), False)
    step = next_step(_rows(0.05), skip, args, None, cap.at())
    assert (
        "layers [1, 3, 4, 12, 16, 19] in BF16 recover 43% of the loss (confirmed; capacity "
        "1.67x BF16 instead of 2x)"
    ) in step["reasons"]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma with the test model's tokenizer, its sliding layers' values far past
    E4M3's 448: FP8 at scale 1.0 clips them, and keeping those layers in BF16 undoes it."""
    out = tmp_path_factory.mktemp("gemma") / "tiny-gemma3"
    model = tiny_gemma(torch.bfloat16, vocab=2865)
    with torch.no_grad():
        for i in SLIDING:
            model.model.layers[i].self_attn.v_proj.weight.mul_(30000)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (TEST_MODEL / name).exists():
            shutil.copy(TEST_MODEL / name, out / name)
    return out


def test_advise_scores_the_sliding_window_layers_with_their_capacity(
    gemma_dir: Path, tmp_path: Path
) -> None:
    from kvcal.cli import main

    out = tmp_path / "advice.json"
    args = ["advise", str(gemma_dir), "--trace", str(TRACE), "--buckets", "128,512"]
    args += ["--per-bucket", "2", "--max-new-tokens", "8", "--chunk-tokens", "64"]
    res = CliRunner().invoke(main, [*args, "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["capacity"]["hybrid"] and doc["capacity"]["sliding_layers"] == list(SLIDING)
    name = "fp8@1.0, sliding-window layers in BF16"
    row = next(r for r in doc["settings"] if r["setting"] == name)
    assert row["skip_layers"] == list(SLIDING)
    layout = KvLayout.of_model(gemma_dir)
    assert layout is not None
    want = capacity_ratio(layout, 32768, "fp8", SLIDING)
    assert doc["sliding_window"]["capacity_ratio"] == want
    assert doc["sliding_window"]["flag"] == "--kv-cache-dtype-skip-layers sliding_window"
    assert any("capacity per request of 32,768 tokens" in n for n in doc["notes"])
    # the clipped values lose; the sliding layers in BF16 take the loss back
    assert row["all"]["nll_delta_mean"] < 0.2 * doc["settings"][0]["all"]["nll_delta_mean"]
    step = doc["next_step"]
    assert step["action"] == "skip_layers"
    text = " ".join(step["reasons"])
    assert f"(capacity {want:.2f}x BF16 at 32,768 tokens instead of 2x)" in text
    chosen = [c for c in (doc["skip"], doc["sliding_window"]) if c["reached"]]
    assert step["capacity_ratio"] == max(c["capacity_ratio"] for c in chosen)


def test_emulate_takes_sliding_window_for_every_sliding_layer(
    gemma_dir: Path, tmp_path: Path
) -> None:
    from kvcal.cli.emulate import _parse_layers
    from replay.core.errors import InputError

    assert _parse_layers("sliding_window", gemma_dir) == SLIDING
    assert _parse_layers("2,sliding_window", gemma_dir) == (0, 1, 2, 3)
    (tmp_path / "config.json").write_text(json.dumps({**_uniform_config(), "sliding_window": None}))
    with pytest.raises(InputError, match="has no sliding-window layer"):
        _parse_layers("sliding_window", tmp_path)


def _uniform_config() -> dict[str, Any]:
    return {
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_size": 64,
    }
