"""The embedded test model: a deterministic factory, a trained checkpoint that ships with the
package, task generators with a real held-out split, and an outlier twin that is exact in BF16."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the test model needs torch and transformers (model extra)")
pytest.importorskip("transformers", reason="the test model needs the model extra")

from replay.checkers import parse_check
from replay.testmodel import tasks
from replay.testmodel.factory import (
    SPECIAL_TOKENS,
    build,
    checkpoint_digest,
    derive_twin,
    twin_factor,
)


def test_random_build_is_deterministic_and_complete(tmp_path: Path) -> None:
    a, b = build(tmp_path / "a"), build(tmp_path / "b")
    assert checkpoint_digest(a) == checkpoint_digest(b)
    config = json.loads((a / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    # vLLM's CPU attention (and its FP8 KV path) needs a head size divisible by 32.
    assert config["head_dim"] % 32 == 0
    assert config["hidden_size"] == config["num_attention_heads"] * config["head_dim"]


@pytest.fixture(scope="module")
def training_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tokenizer the trainer builds, wrapped with the chat template (no weights needed)."""
    from transformers import PreTrainedTokenizerFast

    from replay.testmodel.curriculum import VOCAB_SIZE, tokenizer_corpus
    from replay.testmodel.factory import CHAT_TEMPLATE, build_tokenizer

    tok = build_tokenizer(tokenizer_corpus(), VOCAB_SIZE)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.raw = tok
    return fast


def test_training_tokenizer_makes_every_key_and_value_one_token(
    training_tokenizer: Any,
) -> None:
    from replay.testmodel.curriculum import check_single_tokens

    tok = training_tokenizer.raw
    check_single_tokens(tok)  # a lookup is then one copied token
    for special in SPECIAL_TOKENS:
        assert tok.encode(special).ids == [tok.token_to_id(special)]


def test_built_induction_circuit_copies_before_any_training() -> None:
    """The hand-built circuit the training starts from: layer 0 head 0 attends to the
    previous position whatever the tokens, and the untrained model already predicts the
    second copy of a random span 1,500 tokens after the first."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from replay.testmodel.circuit import ARCH, build_induction_circuit

    torch.manual_seed(0)
    config = LlamaConfig(
        **{**ARCH, "vocab_size": 3000}, tie_word_embeddings=False, attn_implementation="eager"
    )
    model = LlamaForCausalLM(config).eval()  # type: ignore[no-untyped-call]
    build_induction_circuit(model)
    # Distinct tokens: a token seen twice before is a genuinely ambiguous lookup.
    perm = torch.randperm(2990)[None] + 10
    span, gap = perm[:, :200], perm[:, 200:1500]
    ids = torch.cat([span, gap, span], dim=1)
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True)
    prev = out.attentions[0][0, 0]  # layer 0, head 0: (query, key)
    pos = torch.arange(1, ids.shape[1])
    assert float(prev[pos, pos - 1].min()) > 0.99
    guess = out.logits[0, -201:-1].argmax(-1)
    assert float((guess[1:] == span[0, 1:]).float().mean()) > 0.95
    # Without the circuit the same model copies nothing.
    fresh = LlamaForCausalLM(config).eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        guess = fresh(input_ids=ids).logits[0, -201:-1].argmax(-1)
    assert float((guess[1:] == span[0, 1:]).float().mean()) < 0.05


def test_tokenizer_and_chat_template(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    for special in SPECIAL_TOKENS:
        assert len(tok(special, add_special_tokens=False).input_ids) == 1, special
    tools = [tasks.tool_schema("get_weather")]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "weather in Oslo?"}],
        tools=tools,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok("river 123 {x}").input_ids) == "river 123 {x}"


def test_examples_are_deterministic_and_graded_by_their_own_answer() -> None:
    from replay.checkers import Answer
    from replay.core.records import ToolCall

    for ex in tasks.heldout_set(3):
        again = tasks.example(
            "heldout", ex.family, int(ex.id.rsplit("-", 1)[1]), shape=ex.meta.get("band") or None
        )
        assert again == ex
        check = parse_check(ex.check)
        if ex.family == "tool":
            fn = ex.answer["tool_calls"][0]["function"]
            answer = Answer("", (ToolCall(0, None, fn["name"], json.dumps(fn["arguments"])),))
        else:
            answer = Answer(ex.answer["content"])
        assert check.grade(answer).passed, ex.id
        assert not check.grade(Answer("I do not know.")).passed, ex.id


def test_code_answers_pass_their_tests_and_heldout_combinations_are_never_trained() -> None:
    from replay.checkers import Answer

    trained = {tuple(tasks.example("train", "code", i).meta["combo"]) for i in range(3000)}
    heldout = {tuple(ex.meta["combo"]) for ex in tasks.heldout_set(40) if ex.family == "code"}
    assert heldout and not trained & heldout
    assert all(tasks.heldout_code_combo(*c) for c in heldout)
    ex = tasks.heldout_set(1)[-1]
    assert parse_check(ex.check).grade(Answer(ex.answer["content"])).passed


def test_train_and_heldout_never_share_a_retrieval_context() -> None:
    def context(ex: tasks.Example) -> str:
        return str(ex.messages[0]["content"])

    train = {context(tasks.example("train", "retrieval", i, shape="short")) for i in range(500)}
    assert not train & {context(ex) for ex in tasks.heldout_set(30)}
    with pytest.raises(ValueError, match="split"):
        tasks.rng_for("test", "code", 0)


def test_retrieval_bands_match_the_sample_buckets(training_tokenizer: Any) -> None:
    tok = training_tokenizer
    bounds = {"short": (0, 256), "medium": (256, 1024), "long": (1024, 1600)}
    for ex in tasks.heldout_set(8):
        if ex.family != "retrieval":
            continue
        n = len(
            tok.apply_chat_template(
                ex.messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        lo, hi = bounds[ex.meta["band"]]
        assert lo <= n < hi, (ex.id, n)


def test_twin_computes_the_same_bits_with_keys_past_the_fp8_range(
    model_dir: Path, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    factor = twin_factor(model_dir)
    twin = derive_twin(model_dir, tmp_path / "twin", factor)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ex = tasks.heldout_set(1)[1]  # a 256-1K token retrieval prompt
    ids = torch.tensor(
        [
            tok.apply_chat_template(
                ex.messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        ]
    )
    outs = []
    for path in (model_dir, twin):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
        with torch.no_grad():
            outs.append(model(ids, use_cache=True))
    assert torch.equal(outs[0].logits, outs[1].logits)
    for layer_a, layer_b in zip(
        outs[0].past_key_values.layers, outs[1].past_key_values.layers, strict=True
    ):
        assert torch.equal(layer_a.keys.float() * factor, layer_b.keys.float())
        assert torch.equal(layer_a.values, layer_b.values)
    k_amax = [float(layer.keys.abs().max()) for layer in outs[1].past_key_values.layers]
    clipped = [
        float((layer.keys.abs() > 448).float().mean()) for layer in outs[1].past_key_values.layers
    ]
    assert min(k_amax) > 448, k_amax  # every layer's keys clip in E4M3 at scale 1.0
    assert max(clipped) > 0.05, clipped
    with pytest.raises(ValueError, match="power of two"):
        derive_twin(model_dir, tmp_path / "bad", factor=100)


def test_the_thinker_writes_a_think_block_and_then_the_same_answer(
    model_dir: Path, tmp_path: Path
) -> None:
    """The thinker's prompt tokens are the model's; greedy, it writes what the model writes
    with ``The`` and `` of`` replaced by ``<think>`` and ``</think>``: one reasoning token, the
    answer after it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from replay.testmodel.thinker import derive_thinker

    thinker = derive_thinker(model_dir, tmp_path / "thinker")
    toks = [AutoTokenizer.from_pretrained(str(p)) for p in (model_dir, thinker)]
    models = [
        AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.bfloat16)
        for p in (model_dir, thinker)
    ]
    for ex in [e for e in tasks.heldout_set(1) if e.family == "retrieval"][:3]:
        ids = [
            t.apply_chat_template(
                ex.messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for t in toks
        ]
        assert ids[0] == ids[1]  # the prompt is unchanged
        prompt = torch.tensor([ids[0]])
        texts = [
            tok.decode(m.generate(prompt, max_new_tokens=12, do_sample=False)[0][len(ids[0]) :])
            for tok, m in zip(toks, models, strict=True)
        ]
        assert texts[0].startswith("The value of ")
        assert texts[1] == texts[0].replace("The", "<think>", 1).replace(" of", "</think>", 1)
