"""Run vLLM's own per-token-head cache-write kernels on CPU tensors, in Triton's interpreter.

vLLM CPU replaces ``triton`` with a placeholder (no CPU backend), so its Triton kernels do not
exist as kernels there. With ``TRITON_INTERPRET=1`` and the real ``triton`` handed to
``vllm.triton_utils`` before the kernel module is imported, ``@triton.jit`` builds
interpreted kernels that run on CPU tensors: the engine's own code, not a copy of it. This
changes process-wide state, so it runs as a subprocess:

    python tests/support/vllm_triton_kernels.py IN.pt OUT.pt

IN.pt holds ``key`` and ``value`` ``[tokens, kv_heads, head_dim]``; OUT.pt gets, per kind
(int8, fp8, int4), the caches and scale caches the kernel wrote for slots 0..tokens-1.

The interpreter's own fp32 -> fp8e4nv cast is not the GPU's ``cvt.rn.satfinite`` (seen here:
31.9 stored as 16, a tie at 168 as 176), so for FP8 the same kernel writes a float32 cache
instead ("fp8_prestore"): the clamped values the GPU's store then rounds to nearest even.
"""

from __future__ import annotations

import os
import sys
from typing import Any

BLOCK = 16


def _install_interpreted_triton() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import triton
    import triton.language
    import vllm.triton_utils as tu

    tu.triton = triton  # type: ignore[attr-defined]
    tu.tl = triton.language  # type: ignore[attr-defined]


def main(src: str, dst: str) -> None:
    _install_interpreted_triton()
    import torch
    from vllm.v1.attention.ops import triton_reshape_and_cache_flash as ops
    from vllm.v1.kv_cache_interface import KVQuantMode

    data = torch.load(src)
    key, value = data["key"], data["value"]
    tokens, heads, dim = key.shape
    blocks = -(-tokens // BLOCK)
    slots = torch.arange(tokens)
    modes = {
        "int8": (KVQuantMode.INT8_PER_TOKEN_HEAD, torch.int8, dim),
        "fp8": (KVQuantMode.FP8_PER_TOKEN_HEAD, torch.float8_e4m3fn, dim),
        "int4": (KVQuantMode.INT4_PER_TOKEN_HEAD, torch.uint8, dim // 2),
    }
    out = {}
    for kind, (mode, dtype, width) in modes.items():
        kc = torch.zeros(blocks, BLOCK, heads, width, dtype=dtype)
        vc = torch.zeros_like(kc)
        ks = torch.zeros(blocks, BLOCK, heads, dtype=torch.float32)
        vs = torch.zeros_like(ks)
        ops.triton_reshape_and_cache_flash_per_token_head_quant(
            key, value, kc, vc, ks, vs, slots, mode
        )
        rows = (slots // BLOCK, slots % BLOCK)
        out[kind] = {
            "key": kc[rows],
            "value": vc[rows],
            "key_scale": ks[rows],
            "value_scale": vs[rows],
        }
    out["fp8_prestore"] = _fp8_prestore(ops, key, value, slots)
    torch.save(out, dst)


def _fp8_prestore(ops: Any, key: Any, value: Any, slots: Any) -> dict[str, Any]:
    """The per-token-head kernel with FP8's range, writing float32 caches (what its launcher
    passes for an fp8 cache, but the cache dtype)."""
    import torch

    tokens, heads, dim = key.shape
    blocks = -(-tokens // BLOCK)
    kc = torch.zeros(blocks, BLOCK, heads, dim, dtype=torch.float32)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(blocks, BLOCK, heads, dtype=torch.float32)
    vs = torch.zeros_like(ks)
    strides = {}
    for name, t in (("kc", kc), ("vc", vc), ("ks", ks), ("vs", vs)):
        for axis, label in enumerate(("blk", "slot", "head")):
            strides[f"stride_{name}_{label}"] = t.stride(axis)
    ops._reshape_cache_per_token_head[(tokens, heads)](
        key_ptr=key,
        value_ptr=value,
        key_cache_ptr=kc,
        value_cache_ptr=vc,
        k_scale_cache_ptr=ks,
        v_scale_cache_ptr=vs,
        slot_mapping_ptr=slots,
        stride_key_tok=key.stride(0),
        stride_key_head=key.stride(1),
        stride_val_tok=value.stride(0),
        stride_val_head=value.stride(1),
        block_size=BLOCK,
        head_size=dim,
        head_size_v=dim,
        HEAD_SIZE_PADDED=1 << (dim - 1).bit_length(),
        QUANT_MAX=448.0,
        QUANT_MIN=-448.0,
        IS_INT_QUANT=False,
        **strides,
    )
    rows = (slots // BLOCK, slots % BLOCK)
    return {"key": kc[rows], "value": vc[rows], "key_scale": ks[rows], "value_scale": vs[rows]}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
