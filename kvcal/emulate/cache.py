"""A quantized KV cache emulated in transformers: each format's round trip at the cache write,
and the passes that run under it.

``EmulatingCache`` is a ``DynamicCache`` whose ``update()`` passes each layer's new keys and
values through the setting's format (:func:`kvcal._kv_formats.kv_roundtrip`: FP8 E4M3 or
E5M2 at the layer's scale, per-token-head INT8/FP8/INT4, NVFP4) before storing them, so
attention (over the prompt's own chunk as well as the past) reads K/V as that cache returns
them. That is the point kvcal observes (after RoPE) and where vLLM quantizes: its cache-write
op runs before attention, and attention reads the cache. A layer without a scale
(``--skip-layers``) stays BF16, as vLLM's ``--kv-cache-dtype-skip-layers`` keeps it.

A :class:`Setting` is one such cache (a format, a rounding, a scale per layer for K and V;
the per-token-head formats ignore the scale). Under it an answer is
scored teacher-forced (:func:`teacher_forced`) or generated greedily (:func:`greedy`). The
requests come from :mod:`kvcal.emulate.requests`, a calibrated overlay's scales from
:mod:`kvcal.emulate.overlay`; :mod:`kvcal.emulate.score` scores them per setting, and
:mod:`kvcal.emulate.report` turns the scores into per-bucket intervals, per-layer sensitivity
and the report.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import DynamicCache

from .._fp8 import hf_head_scale
from .._kv_formats import SCALED, kv_roundtrip

Scale = torch.Tensor  # 0-d, or [1, kv_heads, 1, 1] over transformers' cache layout


@dataclass(frozen=True)
class Setting:
    """One emulated cache: a format, its rounding, and a scale per layer for K and V (None:
    the layer stays BF16)."""

    name: str
    k: tuple[Scale | None, ...]
    v: tuple[Scale | None, ...]
    scales: str = "1.0"  # "1.0", the overlay's folder, or "per token and head"
    rounding: str = "cpu"
    fmt: str = "fp8"  # vLLM's --kv-cache-dtype

    @property
    def skip(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.k) if s is None)

    def skipping(self, layers: Iterable[int], name: str | None = None) -> Setting:
        drop = set(layers)
        return replace(
            self,
            name=name or self.name,
            k=tuple(None if i in drop else s for i, s in enumerate(self.k)),
            v=tuple(None if i in drop else s for i, s in enumerate(self.v)),
        )

    def only(self, layer: int, name: str | None = None) -> Setting:
        return self.skipping((i for i in range(len(self.k)) if i != layer), name)

    def to_json(self) -> dict[str, Any]:
        def show(s: Scale | None) -> float | list[float] | None:
            return None if s is None else (float(s) if s.dim() == 0 else s.flatten().tolist())

        return {
            "name": self.name,
            "format": self.fmt,
            "scales": self.scales,
            "rounding": self.rounding,
            "skip_layers": list(self.skip),
            "k_scale": [show(s) for s in self.k],
            "v_scale": [show(s) for s in self.v],
        }


def uniform(
    name: str, layers: int, scale: float = 1.0, rounding: str = "cpu", fmt: str = "fp8"
) -> Setting:
    s = hf_head_scale(scale)
    scales = f"{scale:g}" if fmt in SCALED else "per token and head"
    return Setting(name, (s,) * layers, (s,) * layers, scales, rounding, fmt)


class EmulatingCache(DynamicCache):
    """A DynamicCache that stores K and V as the setting's cache format would return them."""

    def __init__(self, setting: Setting, config: Any = None) -> None:
        super().__init__(config=config)
        self.setting = setting

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.setting.k[layer_idx], self.setting.v[layer_idx]
        fmt, rounding = self.setting.fmt, self.setting.rounding
        if k is not None:
            key_states = kv_roundtrip(fmt, key_states, k, rounding=rounding)
        if v is not None:
            value_states = kv_roundtrip(fmt, value_states, v, rounding=rounding)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def new_cache(model: Any, setting: Setting | None) -> DynamicCache:
    if setting is None:
        return DynamicCache(config=model.config)
    return EmulatingCache(setting, model.config)


# -- model passes ---------------------------------------------------------------------------


def _ids(model: Any, tokens: Sequence[int]) -> torch.Tensor:
    return torch.tensor([list(tokens)], dtype=torch.long, device=next(model.parameters()).device)


@torch.inference_mode()
def _prefill(model: Any, ids: torch.Tensor, cache: DynamicCache, chunk: int) -> None:
    """Run ``ids`` [1, n] through the model in chunks sharing ``cache`` (only the cache is
    kept: one position's logits are computed, none used)."""
    for start in range(0, ids.shape[1], chunk):
        model(
            input_ids=ids[:, start : start + chunk],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )


# Answer positions are scored this many logits at a time at most (16 Mi values, 64 MiB in
# float32): the model computes a logit per vocabulary entry at every position it is asked
# for, and a 262,144-token vocabulary (Gemma 3) makes that 1 GiB per 1,024 positions.
LOGITS_BUDGET = 1 << 24


def answer_step(model: Any, chunk: int) -> int:
    """Answer positions per forward pass in :func:`teacher_forced`: ``chunk``, fewer where
    the vocabulary would make their logits outgrow :data:`LOGITS_BUDGET`."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    vocab = int(getattr(text or model.config, "vocab_size", 0) or 0)
    return max(1, min(chunk, LOGITS_BUDGET // vocab if vocab else chunk))


@torch.inference_mode()
def teacher_forced(
    model: Any, prompt: Sequence[int], answer: Sequence[int], cache: DynamicCache, chunk: int
) -> tuple[list[float], list[int]]:
    """NLL of each answer token after the prompt and the answer before it, and the argmax
    there. The prompt but its last token is prefilled in chunks (only the cache kept); the
    answer positions go through in steps whose logits stay within :data:`LOGITS_BUDGET`."""
    if not prompt or not answer:
        raise ValueError("teacher_forced needs a prompt and an answer")
    _prefill(model, _ids(model, prompt[:-1]), cache, chunk)
    return _answer_scores(model, prompt, answer, cache, chunk)


def _answer_scores(
    model: Any, prompt: Sequence[int], answer: Sequence[int], cache: DynamicCache, chunk: int
) -> tuple[list[float], list[int]]:
    """:func:`teacher_forced`'s answer positions, on a cache that holds the prompt but its
    last token."""
    ids = _ids(model, [*prompt, *answer])
    head = len(prompt) - 1
    nll: list[float] = []
    top: list[int] = []
    tail = ids[:, head : head + len(answer)]  # positions whose next token is an answer token
    step = answer_step(model, chunk)
    for start in range(0, tail.shape[1], step):
        part = tail[:, start : start + step]
        logits = model(input_ids=part, past_key_values=cache, use_cache=True).logits[0].float()
        target = ids[0, head + start + 1 : head + start + 1 + part.shape[1]]
        logp = torch.log_softmax(logits, dim=-1)
        nll.extend((-logp.gather(1, target[:, None])[:, 0]).tolist())
        top.extend(logits.argmax(dim=-1).tolist())
        del logits, logp  # before the next step's: two steps' logits never live at once
    return nll, top


@torch.inference_mode()
def greedy(
    model: Any,
    prompt: Sequence[int],
    max_new: int,
    eos: frozenset[int],
    cache: DynamicCache,
    chunk: int,
) -> list[int]:
    """Greedy decoding, token by token after a chunked prefill of the prompt but its last
    token (as :func:`teacher_forced` prefills it); stops after an EOS token (kept, as vLLM
    keeps it in its output ids) or ``max_new`` tokens."""
    _prefill(model, _ids(model, prompt[:-1]), cache, chunk)
    return _decode(model, prompt[-1], max_new, eos, cache)


def _decode(
    model: Any, last: int, max_new: int, eos: frozenset[int], cache: DynamicCache
) -> list[int]:
    out: list[int] = []
    token = last
    while len(out) < max_new:
        logits = model(
            input_ids=_ids(model, [token]), past_key_values=cache, use_cache=True
        ).logits[0, -1]
        token = int(logits.argmax())
        out.append(token)
        if token in eos:
            break
    return out


@torch.inference_mode()
def greedy_scored(
    model: Any, prompt: Sequence[int], max_new: int, eos: frozenset[int], chunk: int
) -> tuple[list[int], list[float], list[int]]:
    """The BF16 greedy answer with its teacher-forced scores (:func:`teacher_forced`'s, bit
    for bit): both start from the prompt's prefill, so it is computed once and copied
    before decoding writes to it."""
    if not prompt:
        raise ValueError("greedy_scored needs a prompt")
    cache = new_cache(model, None)
    _prefill(model, _ids(model, prompt[:-1]), cache, chunk)
    prefilled = copy.deepcopy(cache)
    answer = _decode(model, prompt[-1], max_new, eos, cache)
    del cache
    if not answer:
        return answer, [], []
    return (answer, *_answer_scores(model, prompt, answer, prefilled, chunk))


def eos_ids(model: Any) -> frozenset[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = getattr(model.config, "eos_token_id", None)
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)
