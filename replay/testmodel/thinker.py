"""The thinker: the embedded model made to open and close a ``<think>`` block, for testing
reasoning streams on real vLLM servers (``--reasoning-parser deepseek_r1``).

Two tokens are added, ``<think>`` and ``</think>`` (plain added tokens, not special: the
server must not skip them when it detokenizes, as a reasoning model's are not). Each takes
over one token of the model's retrieval answer, ``The value of KEY VALUE``: ``<think>`` the
first token, ``The``, and ``</think>`` the token `` of``. The new token gets the old one's
input embedding and output row, and the old one's output row is zeroed, so the greedy model
computes exactly what it did and writes ``<think> value</think> KEY VALUE``: one reasoning
token, then the answer. The prompt's tokens do not change (the old tokens still encode the
prompt's text; only the model's output uses the new ones), and no prompt holds either new
token, so a reasoning parser sees the block open and close in what the model generates, and
the server's own reasoning-token count covers it (``completion_tokens_details``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from replay.core.extras import require
from replay.testmodel.factory import (
    DEFAULT_NAME,
    cache_dir,
    checkpoint_digest,
    ensure_default_model,
)

THINKER_NAME = DEFAULT_NAME + "-thinker"
# What deriving it imports (replay.core.extras says what to install for each).
THINKER_NEEDS = ("torch", "safetensors")
# New token -> the token of the retrieval answer whose place it takes.
TAKES_OVER = {"<think>": "The", "</think>": "Ġof"}


def derive_thinker(src: Path, out: Path) -> Path:
    """Write the thinker of ``src`` (a Llama checkpoint with a tokenizer.json) into ``out``."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    size = int(config["vocab_size"])
    old = [vocab[name] for name in TAKES_OVER.values()]
    state = load_file(str(src / "model.safetensors"))
    embed, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    state["model.embed_tokens.weight"] = torch.cat([embed, embed[old]])
    grown = torch.cat([head, head[old]])
    grown[old] = 0  # the old tokens are never the model's output again
    state["lm_head.weight"] = grown
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix in (".json", ".jinja") and f.name != "kvcanary_model.json":
            (out / f.name).write_bytes(f.read_bytes())
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", {**config, "vocab_size": size + len(TAKES_OVER)})
    _add_tokens(out, size)
    _write_json(
        out / "kvcanary_model.json",
        {
            "name": THINKER_NAME,
            "derived_from": checkpoint_digest(src),
            "takes_over": {
                new: {"token": tok, "id": vocab[tok]} for new, tok in TAKES_OVER.items()
            },
            "digest": checkpoint_digest(out),
        },
    )
    return out


def _add_tokens(out: Path, first_id: int) -> None:
    """``<think>`` and ``</think>`` at ``first_id`` on, in tokenizer.json and in
    tokenizer_config.json's added_tokens_decoder (transformers reads both)."""
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    config = json.loads((out / "tokenizer_config.json").read_text())
    for i, content in enumerate(TAKES_OVER):
        entry: dict[str, Any] = {
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": False,
        }
        tokenizer["added_tokens"].append({"id": first_id + i, **entry})
        config.setdefault("added_tokens_decoder", {})[str(first_id + i)] = entry
    _write_json(out / "tokenizer.json", tokenizer)
    _write_json(out / "tokenizer_config.json", config)


def ensure_thinker_model(command: str = "replay model --thinker") -> Path:
    """The thinker of the embedded model, derived once into the cache folder."""
    out = cache_dir() / THINKER_NAME
    require(command, THINKER_NEEDS, " to derive the thinker")
    src = ensure_default_model(command)
    marker = out / "kvcanary_model.json"
    if marker.exists() and json.loads(marker.read_text())["derived_from"] == checkpoint_digest(src):
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    derive_thinker(src, tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
