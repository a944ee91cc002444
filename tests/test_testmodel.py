"""The embedded test model is deterministic and speaks the chat/tool format vLLM needs."""

from __future__ import annotations

import json
from pathlib import Path

from replay.testmodel import SPECIAL_TOKENS, build, checkpoint_digest


def test_build_is_deterministic_and_complete(tmp_path: Path, model_dir: Path) -> None:
    fresh = build(tmp_path / "m")
    assert checkpoint_digest(fresh) == checkpoint_digest(model_dir)
    config = json.loads((fresh / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    # vLLM's CPU attention (and its FP8 KV path) needs a head size divisible by 32.
    assert config["head_dim"] % 32 == 0
    assert config["hidden_size"] == config["num_attention_heads"] * config["head_dim"]


def test_tokenizer_and_chat_template(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    for special in SPECIAL_TOKENS:
        assert len(tok(special, add_special_tokens=False).input_ids) == 1, special
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text = tok.apply_chat_template([{"role": "user", "content": "weather in Oslo?"}],
                                   tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok("river 123 {x}").input_ids) == "river 123 {x}"
