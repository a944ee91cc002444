"""The KV-cache formats vLLM offers, and what kvcanary needs to know of each.

Every value vLLM 0.32 takes as ``--kv-cache-dtype`` (``vllm/config/cache.py``, ``CacheDType``)
is a format here, with:

* its **bytes per token and KV head** at a head size, K and V together, as vLLM lays out a
  cache page: 2 per value unquantized, 1 for FP8; the per-token-head formats add one fp32
  scale per token, head and side (``TritonAttentionBackend.customize_spec``: "(data + one
  scale) per K/V side"), INT4 packs two values a byte; NVFP4 stores ``head_size // 2`` bytes
  of E2M1 pairs and ``head_size // 16`` E4M3 block scales per side
  (``utils/torch_utils.nvfp4_kv_cache_full_dim``, ``FlashInferBackend.customize_spec``);
* whether it **reads checkpoint scales**: the per-tensor FP8 formats and NVFP4 (its k/v
  scale is the per-tensor level above the block scales) do; the per-token-head ones compute
  a scale per token and head when the cache is written and reset the checkpoint's to 1.0
  (``quantization/kv_cache.py``, ``process_weights_after_loading``);
* whether **vLLM CPU serves it** (``CPUAttentionBackend.supported_kv_cache_dtypes``: auto,
  fp8, fp8_e4m3, fp8_e5m2; FP8 needs AVX-512 or AMX) and whether **kvcanary emulates it**
  (kvcal's round trips; the rest, MLA-only and Hadamard-codebook formats, are listed so that
  a target may name them but cannot be emulated).

No torch here: targets, the serving-path check and the reports read these facts; the
numerics are kvcal's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EMULATED_SUFFIX = "-emulated"


@dataclass(frozen=True)
class KVFormat:
    name: str  # vLLM's --kv-cache-dtype value
    family: str  # unquantized | fp8 | per_token_head | nvfp4 | other
    bits: float  # bits per stored value, scales not counted
    reads_checkpoint_scales: bool
    cpu_serves: bool = False
    emulable: bool = False
    scale_bytes_per_side: int = 0  # fp32 scales per token and head (per-token-head)
    block: int = 0  # values per block scale (NVFP4)

    @property
    def quantized(self) -> bool:
        return self.family != "unquantized"

    def bytes_per_token_head(self, head_size: int) -> float:
        """Cache bytes one token takes in one KV head of one layer, K and V together."""
        side = head_size * self.bits / 8 + self.scale_bytes_per_side
        if self.block:
            side += head_size // self.block  # one E4M3 byte per block
        return 2 * side

    def capacity_ratio(self, head_size: int) -> float:
        """Tokens this format holds in the cache that holds one BF16 token."""
        return FORMATS["bfloat16"].bytes_per_token_head(head_size) / self.bytes_per_token_head(
            head_size
        )


def _formats() -> dict[str, KVFormat]:
    dynamic: dict[str, Any] = {"emulable": True, "scale_bytes_per_side": 4}
    out = [
        KVFormat("auto", "unquantized", 16, False, cpu_serves=True),
        KVFormat("bfloat16", "unquantized", 16, False, cpu_serves=True),
        KVFormat("float16", "unquantized", 16, False, cpu_serves=True),
        KVFormat("fp8", "fp8", 8, True, cpu_serves=True, emulable=True),
        KVFormat("fp8_e4m3", "fp8", 8, True, cpu_serves=True, emulable=True),
        KVFormat("fp8_e5m2", "fp8", 8, True, cpu_serves=True, emulable=True),
        KVFormat("int8_per_token_head", "per_token_head", 8, False, **dynamic),
        KVFormat("fp8_per_token_head", "per_token_head", 8, False, **dynamic),
        KVFormat("int4_per_token_head", "per_token_head", 4, False, **dynamic),
        KVFormat("nvfp4", "nvfp4", 4, True, emulable=True, block=16),
        KVFormat("nvfp4_4over6", "nvfp4", 4, True, emulable=True, block=16),
        # Served by vLLM on some GPUs, not emulated here: MLA latent caches, Intel Gaudi's
        # FP8 and the Hadamard-codebook formats. Their bits are nominal: their page layouts
        # (packed K+V, codebooks) are not modelled, so no capacity is implied for them.
        KVFormat("fp8_inc", "other", 8, True),
        KVFormat("fp8_ds_mla", "other", 8, True),
        KVFormat("nvfp4_ds_mla", "other", 4, True),
        KVFormat("turboquant_k8v4", "other", 6, False),
        KVFormat("turboquant_4bit_nc", "other", 4, False),
        KVFormat("turboquant_k3v4_nc", "other", 3.5, False),
        KVFormat("turboquant_3bit_nc", "other", 3, False),
        KVFormat("ultraquant_4bit", "other", 4, False),
    ]
    return {f.name: f for f in out}


FORMATS: dict[str, KVFormat] = _formats()
EMULABLE = tuple(name for name, f in FORMATS.items() if f.emulable)
UNQUANTIZED = frozenset(name for name, f in FORMATS.items() if not f.quantized)


def get(name: str) -> KVFormat | None:
    """The format a --kv-cache-dtype value names (an emulated one's too), if vLLM knows it."""
    return FORMATS.get(emulated_format(name) or name)


def emulated_format(dtype: str | None) -> str | None:
    """``int8_per_token_head-emulated`` -> ``int8_per_token_head``; None if not emulated."""
    if dtype is None or not dtype.endswith(EMULATED_SUFFIX):
        return None
    return dtype.removesuffix(EMULATED_SUFFIX)


def emulated(name: str) -> str:
    """The kv_cache_dtype of a target that emulates ``name`` in a BF16 server."""
    fmt = FORMATS.get(name)
    if fmt is None or not fmt.emulable:
        raise ValueError(f"'{name}' cannot be emulated; emulated formats: {', '.join(EMULABLE)}")
    return name + EMULATED_SUFFIX


def format_of_name(name: str) -> str | None:
    """The format a target's name starts with: the longest format name followed by the end
    or a separator (``fp8_e5m2-cal`` -> fp8_e5m2, ``fp8_kvcal`` -> fp8); ``bf16`` -> auto."""
    low = name.lower()
    if low == "bf16" or low.startswith(("bf16-", "bf16_", "bf16.")):
        return "auto"
    for fmt in sorted(FORMATS, key=len, reverse=True):
        if low == fmt or (low.startswith(fmt) and low[len(fmt)] in "-_."):
            return fmt
    return None


def same_format(expected: str, served: str) -> bool:
    """Whether a server reporting ``served`` runs the cache ``expected`` names: vLLM reports
    'auto' for the model's own dtype, and fp8 is fp8_e4m3 (``cache.py``: "fp8 (=fp8_e4m3)")."""
    e, s = expected.lower(), served.lower()
    bf16_like = UNQUANTIZED | {"bf16", "half"}
    if e in bf16_like or emulated_format(e) is not None:
        return s in bf16_like  # an emulated cache stores BF16; the plugin's log says the rest
    e4m3 = {"fp8", "fp8_e4m3"}
    return (e in e4m3 and s in e4m3) or e == s


def label(name: str) -> str:
    """How a report names a format: FP8 E4M3 as FP8 (vLLM's ``fp8``), the rest by name."""
    return "FP8" if name in ("fp8", "fp8_e4m3") else name


def head_size_of(model: object) -> int | None:
    """The head size a local model folder's config.json declares (None if it says none)."""
    if not isinstance(model, str):
        return None
    try:
        config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
        text = config.get("text_config") or config
        heads = int(text["num_attention_heads"])
        return int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError):
        return None
