"""The hand-built induction circuit the test model's training starts from.

Every task the model learns is a copy (the value after a key, the arguments in the question,
the constants in the spec), and gradient descent on two CPU cores finds the two-head
induction circuit only after thousands of steps; so :func:`build_induction_circuit` writes it
into fresh weights, with the architecture (``ARCH``) chosen for it, and
:func:`pin_previous_token_head` holds its first head in place while training moves the rest.
"""

from __future__ import annotations

import math
from typing import Any

from replay.testmodel import factory

# of 1e8 leaves 17 of 32 frequency pairs nearly unrotated across 2K tokens, so a later head
# can match content at any distance, and 6 fast enough to single out the previous position.
ARCH = {**factory.DEFAULT_ARCH, "intermediate_size": 512, "attention_bias": True, "rope_theta": 1e8}
# The previous-token head's query and key biases: the query carries the scale, because
# keys are what an FP8 cache stores, and small keys keep their relative precision there.
PREV_QUERY, PREV_KEY = 100.0, 2.0
# Residual-stream slots of the built-in induction circuit: token code, the previous
# token's code, and the code of the token to copy (read by the output projection).
CODE, PREV, COPY = slice(0, 64), slice(128, 192), slice(192, 256)
MATCH_SHARPNESS, COPY_LOGIT_SCALE = 15.0, 0.5


def rope_pairs(config: Any, reach: int = 2048) -> tuple[Any, list[int], list[int]]:
    """RoPE frequencies, the pairs fast enough to single out the previous position, and
    the pairs slow enough (under half a radian across ``reach`` tokens) to match content."""
    import torch

    d = config.head_dim
    theta = config.rope_parameters["rope_theta"]
    freqs = theta ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    fast = [i for i in range(d // 2) if freqs[i] > 0.05]
    slow = [i for i in range(d // 2) if freqs[i] * reach < 0.5]
    return freqs, fast, slow


def pin_previous_token_head(model: Any) -> None:
    """Layer 0, head 0 attends to the previous position, whatever the tokens.

    Its query and key are constant biases (the projections' weights are zero), so after
    RoPE their product depends only on the distance: with the key bias rotated one step
    ahead of the query bias in every fast pair, the score peaks at distance one. Called
    after every optimizer step, so that training never moves it.
    """
    import torch

    att = model.model.layers[0].self_attn
    d = model.config.head_dim
    freqs, fast, _ = rope_pairs(model.config)
    bq, bk = torch.zeros(d), torch.zeros(d)
    for i in fast:
        bq[i] = PREV_QUERY
        bk[i], bk[i + d // 2] = PREV_KEY * torch.cos(freqs[i]), PREV_KEY * torch.sin(freqs[i])
    with torch.no_grad():
        att.q_proj.weight[:d].zero_()
        att.q_proj.bias[:d] = bq
        att.k_proj.weight[:d].zero_()
        att.k_proj.bias[:d] = bk


def build_induction_circuit(model: Any, vocab: dict[str, int] | None = None) -> None:
    """Start training from a model that already copies what followed a token before.

    Every task here is a copy: the value after a key, the arguments in the question, the
    constants in the spec. Gradient descent finds the two-head induction circuit on two
    CPU cores only after thousands of steps (measured: loss still falling at 1,500 steps on
    pure copying), so it is built by hand and trained from there:
    layer 0 head 0 writes the previous token's code to the PREV slot; layer 1 head 0
    matches the current token's code against PREV (on the slow RoPE pairs) and writes the
    matched position's code to the COPY slot; the output projection reads COPY as logits.
    With ``vocab``, a word and its leading-space form (``Ġ`` in byte-level BPE) share one
    code: a question says `` Boston``, the tool call's JSON ``"Boston"``, and a copy is
    then a copy; which form to write is one feature the model learns for all words.
    Measured: greedy copies of a 200-token span 1,300 tokens back are 99-100% right before
    any training, and after 900 steps on the tasks every retrieved value is right in all
    three length bands, teacher-forced.
    """
    import torch

    vocab = vocab or {}
    m, d = model.model, model.config.head_dim
    _, _, slow = rope_pairs(model.config)
    content = slow + [i + d // 2 for i in slow]
    a0, a1 = m.layers[0].self_attn, m.layers[1].self_attn
    eye = torch.eye(d)
    with torch.no_grad():
        emb = m.embed_tokens.weight
        emb.normal_(0.0, 1.0)
        emb[:, CODE.stop :].zero_()  # PREV and COPY slots start empty
        for word, idx in vocab.items():
            if word.startswith("Ġ") and word[1:] in vocab:
                emb[vocab[word[1:]], CODE] = emb[idx, CODE]
        a0.v_proj.weight[:d].zero_()
        a0.v_proj.weight[:d, CODE] = eye / math.sqrt(2)
        a0.o_proj.weight[:, :d].zero_()
        a0.o_proj.weight[PREV, :d] = eye
        a1.q_proj.weight[:d].zero_()
        a1.k_proj.weight[:d].zero_()
        for j, dim in enumerate(content):
            a1.q_proj.weight[dim, CODE.start + j] = MATCH_SHARPNESS
            a1.k_proj.weight[dim, PREV.start + j] = 1.0
        a1.v_proj.weight[:d].zero_()
        a1.v_proj.weight[:d, CODE] = eye
        a1.o_proj.weight[:, :d].zero_()
        a1.o_proj.weight[COPY, :d] = eye
        # Later layers get the same copy output in the heads on their first KV head, and
        # learn where to attend: copying a tool argument or a key from the question needs
        # attention by content class ("a city"), which no fixed circuit gives.
        for layer in m.layers[2:]:
            layer.self_attn.v_proj.weight[:d].zero_()
            layer.self_attn.v_proj.weight[:d, CODE] = eye
            layer.self_attn.o_proj.weight[:, : 2 * d].zero_()
            layer.self_attn.o_proj.weight[COPY, :d] = eye
            layer.self_attn.o_proj.weight[COPY, d : 2 * d] = eye
        model.lm_head.weight[:, COPY] = COPY_LOGIT_SCALE * emb[:, CODE]
    pin_previous_token_head(model)
