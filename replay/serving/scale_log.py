"""Which K/V scales a vLLM server runs with, read from its own start-up log.

vLLM 0.32 says it in two ways, and only one of them is a warning:

* A checkpoint with a quantization config (``quantization=compressed-tensors`` in the engine's
  "Initializing a V1 LLM engine" line) goes through the quantization method's KV-cache
  handling, which loads ``k_scale``/``v_scale`` and, when the checkpoint has none, logs
  "Using KV cache scaling factor 1.0 for fp8_e4m3" (``quantization/kv_cache.py``).
* A checkpoint without one (``quantization=None``) never reaches that code: the attention
  layer keeps the defaults of ``set_default_quant_scales`` (``layers/attention/attention.py``),
  every scale 1.0, and nothing about scales is logged. Seen on vLLM CPU 0.32 with
  ``--kv-cache-dtype fp8``: the only difference between the logs of a scale-1.0 original and
  its calibrated overlay is that field of the engine line.

So "runs at scale 1.0" is the warning, or an FP8 engine line with no quantization method.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from replay.serving.introspect import engine_config_from_log

SCALE_ONE_WARNING = "Using KV cache scaling factor 1.0"
# An FP8 E4M3 cache emulated in a BF16 server by kvcal's vLLM plugin (kvcal/vllm_plugin.py):
# the kv_cache_dtype of such a target's spec (any format's: FORMAT-emulated). Its quality is
# the format's; its capacity and speed are BF16's, so the verdict and the report never
# present them as the format's.
EMULATED_FP8 = "fp8-emulated"

CHECKPOINT = "checkpoint"  # a quantization method loaded the checkpoint's scales
DEFAULT_WARNED = "default-1.0-warned"  # it found none and said so
DEFAULT_UNQUANTIZED = "default-1.0-no-quantization-config"  # no method: 1.0, silently
UNKNOWN = "unknown"  # no engine line (a server we did not start, or a log cut short)


@dataclass(frozen=True)
class ScaleEvidence:
    source: str
    quantization: str | None
    kv_cache_dtype: str | None
    warning: bool

    @property
    def runs_at_scale_one(self) -> bool | None:
        if self.source == UNKNOWN:
            return None
        return self.source != CHECKPOINT

    def explain(self) -> str:
        if self.source == DEFAULT_WARNED:
            return f"the server log says '{SCALE_ONE_WARNING}': no scales were loaded"
        if self.source == DEFAULT_UNQUANTIZED:
            return (
                "the engine runs with quantization=None, so vLLM keeps its default k/v "
                "scales of 1.0 (it logs nothing about scales in that case)"
            )
        if self.source == CHECKPOINT:
            return (
                f"the engine loaded the checkpoint through quantization={self.quantization}"
                f" and logged no scale-1.0 warning"
            )
        return "the server log has no engine line: which scales it runs is not known"

    def to_json(self) -> dict[str, object]:
        return {
            "source": self.source,
            "quantization": self.quantization,
            "kv_cache_dtype": self.kv_cache_dtype,
            "warning": self.warning,
            "runs_at_scale_one": self.runs_at_scale_one,
        }


def scale_evidence(log_text: str) -> ScaleEvidence:
    return from_engine_config(engine_config_from_log(log_text), SCALE_ONE_WARNING in log_text)


def from_engine_config(engine: Mapping[str, str], warning: bool) -> ScaleEvidence:
    """The same judgement from what a run directory keeps of the log (its engine line's
    fields and whether the warning was among its scale lines)."""
    quant = engine.get("quantization")
    quant = None if quant in (None, "None") else quant
    kv = engine.get("kv_cache_dtype")
    if warning:
        source = DEFAULT_WARNED
    elif not engine:
        source = UNKNOWN
    elif quant is None:
        source = DEFAULT_UNQUANTIZED
    else:
        source = CHECKPOINT
    return ScaleEvidence(source, quant, kv, warning)


def scale_lines(log_text: str) -> list[str]:
    """Server-log lines about KV-cache dtype, scales and quantization (what actually ran)."""
    keys = (
        "scaling factor",
        "k_scale",
        "v_scale",
        "kv_cache_scheme",
        "quantization=",
        "fp8 data type",
        "kv cache dtype",
        "compressed-tensors",
        "kvcanary fp8 emulation",  # run directories of versions before every format
        "kvcanary kv emulation",
        "per-token-head scales",
    )
    out = []
    for line in log_text.splitlines():
        low = line.lower()
        if any(k in low for k in keys) and "non-default args" not in low:
            out.append(line.strip()[:500])
    return out[:50]
