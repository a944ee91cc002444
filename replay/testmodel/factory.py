"""The tiny test model kvcanary builds itself: no hub download, same bytes every time.

A Llama-architecture checkpoint (head size 64, which vLLM's CPU attention and its FP8 KV
path support), a byte-level BPE tokenizer trained on a generated corpus, and a ChatML chat
template that renders tools the hermes way (``<tool_call>{...}</tool_call>``), so a server
started with ``--tool-call-parser hermes`` streams real ``tool_calls``.

``build()`` writes random weights; ``replay.testmodel.train`` passes trained ones
(``weights=``, ``tokenizer=``). The default model is a trained checkpoint committed under
``replay/testmodel/models/`` when there is one, else the random one built once into a cache
folder; its digest is part of every run manifest. ``derive_twin()`` writes the outlier twin: the
same function in BF16, with keys past the FP8 range.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from replay.core.extras import require

DEFAULT_NAME = "kvcanary-tiny-llama"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

# Sized so that a CPU server starts fast and the KV cache per token is small enough to make
# capacity visible: 4 layers x 2 KV heads x 64 dims x 2 (K and V) = 1,024 values a token.
DEFAULT_ARCH: dict[str, Any] = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
}

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "You may call tools. Answer with "
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.\n'
    "<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% for call in message.tool_calls %}<tool_call>"
    '{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments if call.function.arguments is string "
    "else call.function.arguments | tojson }}}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "alpha beta gamma delta kappa sigma omega river stone cloud ember forest harbor lantern "
    "meadow orbit pepper quartz saddle timber velvet willow yarrow zephyr anchor bridge cobalt "
    "dune falcon garnet hollow island jasper kernel ledger marble nectar oyster prism quiver "
    "ridge summit tundra umber vector walnut xenon yonder zenith the a of to and in is that "
    "for on with as by at from this be are was record passage value key answer question "
    "function return def if else while import print call tool name arguments result city "
    "date time number list string true false null weather search order price count total"
).split()


def corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """A deterministic text corpus for training the tokenizer: words, digits, code, JSON."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16)))
        n = rng.randint(0, 99999)
        kind = i % 4
        if kind == 0:
            out.append(f"{words.capitalize()}. Value {n}, id P{rng.randint(0, 999)}.")
        elif kind == 1:
            out.append(f"def f_{rng.choice(_WORDS)}(x):\n    return x * {n % 97} + {n % 13}\n")
        elif kind == 2:
            arg = json.dumps({"city": rng.choice(_WORDS), "days": n % 9})
            out.append(f'<tool_call>{{"name": "get_{rng.choice(_WORDS)}", "arguments": {arg}}}')
        else:
            out.append(f"{words}? {words.upper()}! ({n}) [{n % 7}] {{x: {n % 3}}}")
    return out


def build_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """Byte-level BPE (every string encodes; no unknown token) with the chat specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def random_weights(arch: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    """A seeded Llama state dict in bfloat16 (std 0.02, norms at 1)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, inter, v = arch["hidden_size"], arch["intermediate_size"], arch["vocab_size"]
    d = arch["head_dim"]
    q_out, kv_out = arch["num_attention_heads"] * d, arch["num_key_value_heads"] * d

    def normal(*shape: int) -> Any:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    sd: dict[str, Any] = {"model.embed_tokens.weight": normal(v, h)}
    for i in range(arch["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = normal(q_out, h)
        sd[p + "self_attn.k_proj.weight"] = normal(kv_out, h)
        sd[p + "self_attn.v_proj.weight"] = normal(kv_out, h)
        sd[p + "self_attn.o_proj.weight"] = normal(h, q_out)
        if arch.get("attention_bias"):
            for name, n in (("q", q_out), ("k", kv_out), ("v", kv_out), ("o", h)):
                sd[p + f"self_attn.{name}_proj.bias"] = torch.zeros(n, dtype=torch.bfloat16)
        sd[p + "mlp.gate_proj.weight"] = normal(inter, h)
        sd[p + "mlp.up_proj.weight"] = normal(inter, h)
        sd[p + "mlp.down_proj.weight"] = normal(h, inter)
        sd[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    sd["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    if not arch.get("tie_word_embeddings", False):
        sd["lm_head.weight"] = normal(v, h)
    return sd


def llama_config(arch: Mapping[str, Any], tok: Any) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        **arch,
        "vocab_size": tok.get_vocab_size(),
        "bos_token_id": tok.token_to_id("<|im_start|>"),
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "pad_token_id": tok.token_to_id("<|endoftext|>"),
        "torch_dtype": "bfloat16",
    }


def build(
    out_dir: Path,
    *,
    arch: Mapping[str, Any] | None = None,
    texts: Iterable[str] | None = None,
    weights: Mapping[str, Any] | None = None,
    tokenizer: Any = None,
    seed: int = 0,
) -> Path:
    """Write a complete HF checkpoint folder (config, weights, tokenizer, chat template)."""
    from safetensors.torch import save_file

    arch = dict(DEFAULT_ARCH if arch is None else arch)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or build_tokenizer(
        corpus(seed=seed) if texts is None else texts, arch["vocab_size"]
    )
    tok.save(str(out_dir / "tokenizer.json"))
    config = llama_config(arch, tok)
    arch["vocab_size"] = config["vocab_size"]
    state = dict(random_weights(arch, seed) if weights is None else weights)
    save_file(
        {k: t.contiguous() for k, t in sorted(state.items())},
        str(out_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"],
        },
    )
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "model_max_length": arch["max_position_embeddings"],
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        out_dir / "special_tokens_map.json",
        {
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "additional_special_tokens": SPECIAL_TOKENS[1:],
        },
    )
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    _write_json(
        out_dir / "kvcanary_model.json",
        {
            "name": DEFAULT_NAME,
            "seed": seed,
            "trained": weights is not None,
            "digest": checkpoint_digest(out_dir),
        },
    )
    return out_dir


def checkpoint_digest(model_dir: Path) -> str:
    """sha256 over the files that define what a server computes (not our own manifest)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(model_dir)):
        if name == "kvcanary_model.json" or not (model_dir / name).is_file():
            continue
        h.update(name.encode())
        h.update(hashlib.sha256((model_dir / name).read_bytes()).digest())
    return h.hexdigest()


# The optional modules (the ``model`` extra and torch) that building the random model and
# deriving the twin import; replay.core.extras says what to install for each.
BUILD_NEEDS = ("torch", "tokenizers", "safetensors")
TWIN_NEEDS = ("torch", "transformers", "tokenizers", "safetensors")

# The trained checkpoint ships inside the package (``python -m replay.testmodel.train``
# regenerates it); the random builder remains for tests of the factory itself.
EMBEDDED_DIR = Path(__file__).parent / "models" / DEFAULT_NAME
TWIN_NAME = DEFAULT_NAME + "-outlier-twin"
# The twin's smallest per-layer key amax is at least this many times E4M3's 448, so that a
# large share of keys clips at scale 1.0 (a trained model's keys, amax 8-16, times 256 clip
# 18-30% of elements and break answers; times 64 clipped under 1% and changed nothing).
TWIN_CLIP_MARGIN = 4


def cache_dir() -> Path:
    root = os.environ.get("KVCANARY_CACHE") or Path.home() / ".cache" / "kvcanary"
    return Path(root) / "models"


def default_model_dir() -> Path:
    """The embedded default model: the trained checkpoint shipped with the package, or, in a
    tree without one, the random factory model built into the cache."""
    if (EMBEDDED_DIR / "kvcanary_model.json").exists():
        return EMBEDDED_DIR
    return cache_dir() / DEFAULT_NAME


def ensure_default_model(command: str = "replay") -> Path:
    """The embedded default model, ready to serve (the random one is built on first use;
    ``command`` is what the message names when building it needs a module not installed)."""
    out = default_model_dir()
    if not (out / "kvcanary_model.json").exists():
        require(command, BUILD_NEEDS, " to build the test model")
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        build(tmp)
        if out.exists():
            import shutil

            shutil.rmtree(out)
        tmp.rename(out)
    return out


def key_amax_per_layer(model_dir: Path) -> list[float]:
    """Largest |K| per layer as it enters the cache (after RoPE), on held-out prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from replay.testmodel import tasks

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    amax: list[float] = []
    for ex in tasks.heldout_set(1, offset=700_000):
        ids = tok.apply_chat_template(
            ex.messages,
            tools=ex.tools,  # type: ignore[arg-type]
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        with torch.no_grad():
            cache = model(torch.tensor([list(ids)]), use_cache=True).past_key_values
        layer_amax = [float(layer.keys.abs().max()) for layer in cache.layers]
        amax = [max(a, b) for a, b in zip(amax, layer_amax, strict=True)] if amax else layer_amax
    return amax


def twin_factor(model_dir: Path) -> int:
    """The power of two that puts every layer's keys well past the FP8 range."""
    need = TWIN_CLIP_MARGIN * 448 / min(key_amax_per_layer(model_dir))
    return int(max(2, 2 ** math.ceil(math.log2(need))))


def derive_twin(src: Path, out: Path, factor: int) -> Path:
    """An exact reparameterization of ``src`` whose keys exceed the FP8 range.

    ``k_proj`` (weight and bias) is multiplied and ``q_proj`` divided by the same power of
    two, so every BF16 product, RoPE rotation and attention score is scaled exactly and the
    model computes the same bits; only the cached keys are ``factor`` times larger.
    """
    import torch
    from safetensors.torch import load_file, save_file

    if factor < 2 or factor & (factor - 1):
        raise ValueError(f"factor must be a power of two >= 2, not {factor}")
    state = load_file(str(src / "model.safetensors"))
    for name, tensor in state.items():
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            state[name] = (tensor.to(torch.float32) * factor).to(tensor.dtype)
        elif name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            state[name] = (tensor.to(torch.float32) / factor).to(tensor.dtype)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in ("model.safetensors", "kvcanary_model.json"):
            (out / f.name).write_bytes(f.read_bytes())
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(
        out / "kvcanary_model.json",
        {
            "name": TWIN_NAME,
            "derived_from": checkpoint_digest(src),
            "k_proj_factor": factor,
            "q_proj_factor": 1 / factor,
            "digest": checkpoint_digest(out),
        },
    )
    return out


def ensure_twin_model(command: str = "replay model --twin") -> Path:
    """The outlier twin of the embedded model, derived once into the cache folder."""
    src, out = default_model_dir(), cache_dir() / TWIN_NAME
    if _is_twin_of(out, src):
        return out
    # Checked before the default model is built: deriving needs all that building does.
    require(command, TWIN_NEEDS, " to derive the outlier twin")
    src = ensure_default_model(command)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    derive_twin(src, tmp, twin_factor(src))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _is_twin_of(twin: Path, src: Path) -> bool:
    """Whether ``twin`` holds a twin derived from ``src`` as it is now."""
    marker, src_marker = twin / "kvcanary_model.json", src / "kvcanary_model.json"
    if not (marker.exists() and src_marker.exists()):
        return False
    return bool(json.loads(marker.read_text())["derived_from"] == checkpoint_digest(src))


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
