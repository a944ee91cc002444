"""The server's /metrics: parsed (vLLM's cache config labels, the scalar series kept and the
latency histograms) and scraped over a run into a sink, a failed scrape a gap in the series."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from replay.core.errors import EndpointError
from replay.serving.endpoints import fetch

CACHE_INFO_LABELS = (
    "cache_dtype",
    "block_size",
    "num_gpu_blocks",
    "kv_cache_size_tokens",
    "kv_cache_max_concurrency",
    "kv_cache_dtype_skip_layers",
    "kv_cache_memory_bytes",
    "enable_prefix_caching",
)

# Scalar series we keep in the time series (counters without their _total suffix, as the
# parser names them).
SCALARS = {
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions": "preemptions",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
}
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "ttft",
    "vllm:inter_token_latency_seconds": "itl",
    "vllm:e2e_request_latency_seconds": "e2e",
}


@dataclass
class MetricsSnapshot:
    """One scrape: scalar values and histogram (sum, count, buckets)."""

    t: float
    values: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, dict[str, Any]] = field(default_factory=dict)
    cache_info: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"t": self.t, **self.values, **{f"{k}_hist": v for k, v in self.histograms.items()}}


def parse_metrics(text: str, t: float = 0.0) -> MetricsSnapshot:
    """Parse a /metrics page; values summed over label sets (one engine per server)."""
    snap = MetricsSnapshot(t=t)
    for fam in text_string_to_metric_families(text):
        if fam.name == "vllm:cache_config_info":
            for s in fam.samples:
                snap.cache_info = {k: v for k, v in s.labels.items() if k in CACHE_INFO_LABELS}
        elif fam.name in SCALARS:
            key = SCALARS[fam.name]
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                snap.values[key] = snap.values.get(key, 0.0) + float(s.value)
        elif fam.name in HISTOGRAMS:
            h: dict[str, Any] = {"sum": 0.0, "count": 0.0, "buckets": {}}
            for s in fam.samples:
                if s.name.endswith("_sum"):
                    h["sum"] += s.value
                elif s.name.endswith("_count"):
                    h["count"] += s.value
                elif s.name.endswith("_bucket"):
                    le = s.labels.get("le", "+Inf")
                    h["buckets"][le] = h["buckets"].get(le, 0.0) + s.value
            snap.histograms[HISTOGRAMS[fam.name]] = h
    return snap


async def fetch_metrics(session: aiohttp.ClientSession, base_url: str) -> str:
    ans = await fetch(session, "GET", base_url, "/metrics", timeout_s=10.0)
    try:
        return ans.body.decode("utf-8")
    except UnicodeDecodeError:
        raise ans.wrong("UTF-8 Prometheus text") from None


class Scraper:
    """Scrapes /metrics every ``interval_s`` into ``sink`` until stopped. A failed scrape is
    a gap in the series (counted, the first reason kept), never an error of the run.
    Snapshots go to ``sink`` (and ``scrape_once`` returns its own); none are held here, so a
    long run's memory does not grow with its scrapes."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        now: Callable[[], float],
        sink: Callable[[MetricsSnapshot], None],
        interval_s: float = 1.0,
    ) -> None:
        self.session, self.base_url, self.now, self.sink = session, base_url, now, sink
        self.interval_s = interval_s
        self.failures = 0
        self.first_failure: str | None = None
        self._task: asyncio.Task[None] | None = None

    async def scrape_once(self) -> MetricsSnapshot | None:
        t = self.now()
        try:
            snap = parse_metrics(await fetch_metrics(self.session, self.base_url), t)
        except (EndpointError, ValueError) as exc:
            self.failures += 1
            if self.first_failure is None:
                self.first_failure = (
                    str(exc)
                    if isinstance(exc, EndpointError)
                    else f"GET /metrics: not Prometheus text: {exc}"
                )
            return None
        self.sink(snap)
        return snap

    async def _loop(self) -> None:
        while True:
            await self.scrape_once()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await self.scrape_once()  # one last point, so the series covers the whole phase
