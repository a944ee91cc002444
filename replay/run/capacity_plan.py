"""How large the capacity phase's caches are (``run.capacity_phase`` runs the phase).

The reference and the candidate are started again with the same KV-cache memory
(``--kv-cache-memory-bytes``), sized from the reference's workload answers (their prompt and
output tokens as served) and the cache its workload server reported for its memory, so that
the closed loop's demand is ``PRESSURE`` times what the reference's cache holds: ``concurrency``
requests of the workload's median length against a cache that holds half as many, and at least
its longest request (with ``MARGIN_TOKENS``), which vLLM must be able to hold to start. Each
layer is counted by its attention type where the model's config.json says (``RefLayers``: a
sliding-window layer holds its window whatever the length).

Why twice: vLLM admits a waiting request only once its whole prompt fits, and its cache comes
in blocks of 128 tokens on CPU, so a cache that barely holds the loop's requests binds only now
and then, while at twice the loop's demand the candidate's cache (twice the tokens at the same
bytes) holds what the reference's cannot. The median is the length sized for: with the three
length bands of traces/first_run.jsonl, a shorter quantile would ask for a cache smaller than
its longest request, which vLLM refuses. Once the servers are up, :meth:`Plan.check` reads what
the reference's server reports it holds and refuses a phase whose cache would not run full
(a server that made more of the memory than planned, or a longest request that sets the size).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from replay.analysis.run_spec import CapacitySpec
from replay.core.records import Result
from replay.serving import kv_formats
from replay.serving.kv_layout import Engine, KvLayout
from replay.serving.kv_served import skip_words
from replay.serving.local_server import DEFAULT_KV_CACHE_GIB, KV_CACHE_BYTES_FLAG
from replay.serving.targets import TargetSpec

MIB, GIB = 1 << 20, 1 << 30
# The loop's demand (``concurrency`` requests of the median length) over what the reference's
# cache holds, as sized; the phase is refused when the served cache leaves less than
# ``MIN_PRESSURE`` (sizing rounds up to the MiB, and a server may hold a little more).
PRESSURE = 2.0
MIN_PRESSURE = 1.5
MARGIN_TOKENS = 512  # the cache holds the longest request and this much more


@dataclass(frozen=True)
class RefLayers:
    """The reference's cache per layer type: its model's layout, its served format, the
    layers it keeps in BF16 and its engine's block size (``serving.kv_layout``)."""

    layout: KvLayout
    fmt: str = "auto"
    skip: tuple[int, ...] = ()
    engine: Engine = field(default_factory=Engine)

    def request_bytes(self, tokens: int) -> float:
        return self.layout.request_bytes(tokens, self.fmt, self.skip, self.engine)

    def describe(self) -> str:
        windows = [w for w in self.layout.windows if w is not None]
        if not windows:
            return f"all {self.layout.layers} layers attend in full"
        return f"{len(windows)} of {self.layout.layers} layers slide over {max(windows)} tokens"


@dataclass(frozen=True)
class Plan:
    """The capacity servers' cache and model length, how they were sized (in words), and
    what the check after start-up needs: the loop's median request and how much larger a
    request of the model length is (per layer type where known)."""

    concurrency: int
    cache_bytes: int
    max_model_len: int
    sizing: str
    median_tokens: int = 0
    longest_over_median: float = 1.0  # a request of max_model_len over one of the median

    def args(self) -> tuple[str, ...]:
        return (
            KV_CACHE_BYTES_FLAG,
            str(self.cache_bytes),
            "--max-model-len",
            str(self.max_model_len),
        )

    def held(self, cache_config: Mapping[str, Any]) -> float | None:
        """Requests of the median length the served cache holds at once: vLLM's own count at
        the model length (``kv_cache_max_concurrency``, per layer type), scaled to the median;
        None where the server does not say."""
        try:
            at_max = float(cache_config.get("kv_cache_max_concurrency") or 0)
        except (TypeError, ValueError):
            return None
        return at_max * self.longest_over_median if at_max > 0 else None

    def check(self, cache_config: Mapping[str, Any]) -> tuple[float | None, str | None]:
        """(The loop's demand over what the reference's served cache holds, why the phase
        cannot measure what it is for: None when it can, or when the server does not say.)"""
        held = self.held(cache_config)
        if held is None or self.median_tokens <= 0:
            return None, None
        pressure = self.concurrency / held
        if pressure >= MIN_PRESSURE:
            return pressure, None
        return pressure, (
            f"the reference's capacity server holds {held:.1f} requests of the median "
            f"{self.median_tokens} tokens, so {self.concurrency} in flight are only "
            f"{pressure:.2f}x its cache (at least {MIN_PRESSURE:g}x is needed for it to run full "
            "every time): raise --capacity-concurrency or lower --capacity-cache-mib"
        )


def kv_bytes_per_token(spec: TargetSpec, cache_config: Mapping[str, Any]) -> float | None:
    """The reference's cache bytes over its tokens: from the memory its server was given
    (``--kv-cache-memory-bytes``, else VLLM_CPU_KVCACHE_SPACE as kvcanary starts it)."""
    try:
        tokens = float(cache_config.get("kv_cache_size_tokens") or 0)
    except (TypeError, ValueError):
        return None
    args = list(spec.args)
    if tokens <= 0:
        return None
    if KV_CACHE_BYTES_FLAG in args[:-1]:
        return float(args[args.index(KV_CACHE_BYTES_FLAG) + 1]) / tokens
    gib = spec.env.get("VLLM_CPU_KVCACHE_SPACE") or os.environ.get(
        "VLLM_CPU_KVCACHE_SPACE", DEFAULT_KV_CACHE_GIB
    )
    return float(gib) * GIB / tokens if gib.strip().isdigit() else None


def ref_layers(spec: TargetSpec, cache_config: Mapping[str, Any]) -> RefLayers | None:
    """The reference's layers, where its model folder has a config.json and its served
    format's layout is modelled; None: size from bytes per token."""
    layout = KvLayout.of_model(spec.model)
    fmt = str(cache_config.get("cache_dtype") or spec.kv_cache_dtype or "auto")
    known = kv_formats.FORMATS.get(fmt)
    if layout is None or known is None or known.family == "other":
        return None
    skip = layout.skip_indices(skip_words(cache_config.get("kv_cache_dtype_skip_layers")))
    try:
        block = int(cache_config.get("block_size") or 0)
    except (TypeError, ValueError):
        block = 0
    return RefLayers(layout, fmt, skip, Engine(block_size=block) if block > 0 else Engine())


def size(
    results: Sequence[Result],
    max_tokens: Mapping[str, int],
    per_token: float | None,
    served_max_len: int | None,
    opts: CapacitySpec,
    layers: RefLayers | None = None,
) -> Plan | str:
    """The capacity servers' plan from the reference's workload answers, or why none. With
    the reference's ``layers``, a request's cache is counted per layer type: bytes per token
    (cache over kv_cache_size_tokens, a figure taken at max_model_len) undercount a hybrid
    model's request at any shorter length, its sliding-window layers holding their window
    (and whole blocks) whatever the length: 4.6x at 2,000 tokens for Gemma 3 270M."""
    ok = [r for r in results if r.status == "ok" and r.prompt_tokens is not None]
    if not ok:
        return "the reference answered no request to size the cache from"
    median = math.ceil(np.median([float(r.prompt_tokens or 0) + r.output_tokens for r in ok]))
    longest = max(
        int(r.prompt_tokens or 0) + max_tokens.get(r.request_id, r.output_tokens) for r in ok
    )
    length = min(longest, served_max_len or longest)
    holds = opts.concurrency / PRESSURE
    aim = (
        f"for the reference to hold {holds:g} of the {opts.concurrency} requests in flight "
        f"(the loop's demand {PRESSURE:g}x its cache) at the workload's median {median} tokens"
    )
    if layers is not None:
        each = layers.request_bytes(median)
        longer = layers.request_bytes(length) / each
    else:
        each, longer = float(median), length / median
    if opts.cache_mib > 0:
        cache, how = opts.cache_mib * MIB, f"--capacity-cache-mib {opts.cache_mib}"
    elif layers is not None:
        need = max(holds * each, layers.request_bytes(longest + MARGIN_TOKENS))
        cache = math.ceil(need / MIB) * MIB
        how = (
            f"sized per layer type ({layers.describe()}) {aim} ({each / MIB:.1f} MiB each) "
            f"and its longest, {longest}"
        )
    elif per_token is None:
        return (
            "the reference's bytes per cached token are unknown (not a CPU server kvcanary "
            "started); give --capacity-cache-mib"
        )
    else:
        tokens = max(math.ceil(holds * median), longest + MARGIN_TOKENS)
        cache = math.ceil(tokens * per_token / MIB) * MIB
        how = f"sized {aim} (and its longest, {longest}) at {per_token:.0f} bytes a token"
    return Plan(opts.concurrency, cache, length, how, median, longer)
