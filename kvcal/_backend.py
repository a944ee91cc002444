"""What the vLLM attention backend on this machine supports, asked of vLLM itself.

Imports torch and vLLM only when asked, and answers "unknown" where they are not installed:
``kvcal verify`` against servers reached by URL needs neither here.
"""

from __future__ import annotations


def per_head_backend_support() -> tuple[bool, str]:
    """Whether the attention backend vLLM uses here accepts per-head scales, in vLLM's own
    words (``supports_per_head_quant_scales``): only FlashAttention 3 does."""
    try:
        import torch

        if torch.cuda.is_available():
            from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

            ok = bool(FlashAttentionBackend.supports_per_head_quant_scales())
            return ok, (
                "FlashAttention "
                + ("3 supports" if ok else "< 3 does not support")
                + " per-head scales"
            )
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        ok = bool(CPUAttentionBackend.supports_per_head_quant_scales())
        return ok, (
            "the CPU attention backend "
            + ("supports" if ok else "does not support")
            + " per-head scales (only FlashAttention 3 does)"
        )
    except ImportError as exc:
        return False, f"unknown: vLLM is not importable here ({exc})"
