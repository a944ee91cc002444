"""K and V exactly as they enter the KV cache, observed with transformers.

The hook is the cache write: a ``DynamicCache`` whose ``update()`` records each layer's new
keys and values before storing them. That is after the projection, the optional q/k norm
and RoPE, which is what vLLM quantizes into its FP8 cache; observing ``k_proj`` instead
would miss RoPE, which moves the range of K.

Long samples are prefilled in chunks that share the cache, so activations stay bounded by
the chunk size (the cache of one sample stays, as attention needs it). Statistics are running
over all samples: amax per layer and KV head, and a histogram of |x| per layer whose bins are
bfloat16's exponent and top 4 mantissa bits (16 bins per power of two). Reading the bins off
the bit pattern keeps the observer to a few integer ops per value, and from the histogram the
clipping and underflow at any scale, and the reconstruction error of any scale, are estimated
afterwards without a second pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from replay.core.errors import InputError

from ._preflight import check_weights

# |x| as bfloat16 bits, shifted right by 3: 8 exponent bits and the top 4 mantissa bits.
MANTISSA_BINS = 16
NUM_BINS = 256 * MANTISSA_BINS
TINY_BINS = MANTISSA_BINS  # exponent 0: zeros and values below 2**-126, underflow at any scale


def bin_edges() -> torch.Tensor:
    """float64 [NUM_BINS + 1]: bin i holds |x| in [edges[i], edges[i + 1])."""
    i = torch.arange(NUM_BINS + 1, dtype=torch.float64)
    exp, mant = torch.div(i, MANTISSA_BINS, rounding_mode="floor"), i % MANTISSA_BINS
    normal = torch.exp2(exp - 127) * (1 + mant / MANTISSA_BINS)
    return torch.where(exp == 0, mant / MANTISSA_BINS * 2.0**-126, normal)


@dataclass
class KVStats:
    """Running statistics of one model's K and V (index 0 = K, 1 = V)."""

    amax: torch.Tensor  # [2, layers, kv_heads] float32
    hist: torch.Tensor  # [2, layers, NUM_BINS] int64: |x| by bfloat16 bin
    count: torch.Tensor  # [2, layers] int64: values seen
    tokens: int = 0
    samples: int = 0

    @classmethod
    def empty(cls, layers: int, kv_heads: int, device: Any = "cpu") -> KVStats:
        # on the model's device: no transfer or sync per cache write on a GPU
        return cls(
            torch.zeros(2, layers, kv_heads, device=device),
            torch.zeros(2, layers, NUM_BINS, dtype=torch.int64, device=device),
            torch.zeros(2, layers, dtype=torch.int64, device=device),
        )

    def cpu(self) -> KVStats:
        return KVStats(
            self.amax.cpu(), self.hist.cpu(), self.count.cpu(), self.tokens, self.samples
        )

    def observe(self, which: int, layer: int, states: torch.Tensor) -> None:
        """``states``: [batch, kv_heads, tokens, head_dim], as the cache receives them."""
        s = states.detach()
        if s.dtype == torch.bfloat16:
            bits = s.view(torch.int16) & 0x7FFF  # sign cleared: |x|, ordered like its value
            head_max = bits.amax(dim=(0, 2, 3)).view(torch.bfloat16).float()
        else:  # exact amax in the compute dtype; bins from the bfloat16 rounding
            head_max = torch.maximum(s.amax(dim=(0, 2, 3)), -s.amin(dim=(0, 2, 3))).float()
            bits = s.to(torch.bfloat16).view(torch.int16) & 0x7FFF
        self.amax[which, layer] = torch.maximum(self.amax[which, layer], head_max)
        self.count[which, layer] += bits.numel()
        self.hist[which, layer] += torch.bincount((bits >> 3).flatten(), minlength=NUM_BINS)


class ObservingCache(DynamicCache):
    """A DynamicCache that shows every K/V write to ``KVStats`` before storing it."""

    def __init__(self, stats: KVStats, config: Any = None) -> None:
        super().__init__(config=config)
        self.stats = stats

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.stats.observe(0, layer_idx, key_states)
        self.stats.observe(1, layer_idx, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a Llama-family config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return int(text.num_hidden_layers), kv_heads, head_dim


def load_model(model_dir: str, dtype: str = "auto", device: str = "auto") -> Any:
    """The checkpoint in the dtype it declares (what vLLM computes in), in eval mode, on the
    GPU when torch has one (``device="auto"``), else on the CPU. A broken folder, or weights
    that lack what the config declares, is refused (:mod:`kvcal._preflight`)."""
    from transformers import AutoModelForCausalLM

    if Path(model_dir).is_dir():
        check_weights(Path(model_dir))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_dtype: Any = "auto" if dtype == "auto" else getattr(torch, dtype)
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch_dtype, output_loading_info=True
    )
    model, loading = loaded  # with output_loading_info, (model, what loading found)
    # transformers fills what the weights lack with random values and only logs it; K/V
    # observed through those would be noise, calibrated and reported as the model's.
    missing = sorted(loading["missing_keys"])
    if missing:
        raise InputError(
            f"{model_dir}: the weights lack {len(missing)} tensor(s) its config.json asks for "
            f"({missing[0]}, ...), which transformers filled with random values; give the "
            "folder all of the model's shards, or the config that matches them"
        )
    return model.to(device).eval()


@torch.inference_mode()
def prefill(model: Any, input_ids: Sequence[int], cache: DynamicCache, chunk_tokens: int) -> None:
    """Run the prompt through the model in chunks that share ``cache``; only the last
    position's logits are computed (the cache is all we want)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=device)
    for start in range(0, ids.shape[1], chunk_tokens):
        model(
            input_ids=ids[:, start : start + chunk_tokens],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )


def observe(
    model: Any,
    samples: Sequence[Sequence[int]],
    chunk_tokens: int = 2048,
    on_sample: Callable[[int], None] | None = None,
) -> KVStats:
    """Running K/V statistics over every sample (each with a fresh cache)."""
    layers, kv_heads, _ = kv_shape(model.config)
    stats = KVStats.empty(layers, kv_heads, next(model.parameters()).device)
    for ids in samples:
        prefill(model, ids, ObservingCache(stats, model.config), chunk_tokens)
        stats.tokens += len(ids)
        stats.samples += 1
        if on_sample is not None:
            on_sample(len(ids))
    seen = stats.count.amin().item()
    if stats.samples and seen == 0:
        raise RuntimeError(
            "the model never wrote its KV cache through past_key_values.update(); "
            "this architecture is not supported by kvcal's observer"
        )
    return stats.cpu()
