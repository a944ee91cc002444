"""What actually ran: engine version, model, cache config, and server metrics over time."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

CACHE_INFO_LABELS = ("cache_dtype", "block_size", "num_gpu_blocks", "kv_cache_size_tokens",
                     "kv_cache_max_concurrency", "kv_cache_dtype_skip_layers",
                     "kv_cache_memory_bytes", "enable_prefix_caching")

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
        return {"t": self.t, **self.values,
                **{f"{k}_hist": v for k, v in self.histograms.items()}}


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


_ENGINE_FIELDS = re.compile(r"\b(kv_cache_dtype|quantization|dtype|max_seq_len)=([^,\s]+)")


def engine_config_from_log(log_text: str) -> dict[str, str]:
    """The engine's own statement of what it runs (its 'Initializing ... engine' line)."""
    for line in log_text.splitlines():
        if "Initializing a V1 LLM engine" in line or "Initializing an LLM engine" in line:
            return {k: v.strip("'") for k, v in _ENGINE_FIELDS.findall(line)}
    return {}


async def introspect(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    """/version, /v1/models and the cache config labels; missing endpoints are noted."""
    out: dict[str, Any] = {"url": base_url, "problems": []}
    for path, key in (("/version", "version"), ("/v1/models", "models")):
        try:
            async with session.get(base_url + path, timeout=aiohttp.ClientTimeout(total=30)) as r:
                if r.status == 200:
                    out[key] = orjson.loads(await r.read())
                else:
                    out["problems"].append(f"GET {path}: HTTP {r.status}")
        except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as exc:
            out["problems"].append(f"GET {path}: {exc!r}")
    models = (out.get("models") or {}).get("data") or []
    if models:
        out["model_id"] = models[0].get("id")
        out["model_root"] = models[0].get("root")
        out["max_model_len"] = models[0].get("max_model_len")
    else:
        out["problems"].append("GET /v1/models: no model listed")
    out["engine_version"] = (out.get("version") or {}).get("version")
    try:
        text = await fetch_metrics(session, base_url)
        out["cache_config"] = parse_metrics(text).cache_info
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        out["cache_config"] = {}
        out["problems"].append(f"GET /metrics: {exc!r}")
    return out


async def fetch_metrics(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
        if r.status != 200:
            raise ValueError(f"HTTP {r.status}")
        return await r.text()


class Scraper:
    """Scrapes /metrics every ``interval_s`` into ``sink`` until stopped. A failed scrape is
    a gap in the series (counted), never an error of the run."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str,
                 now: Callable[[], float], sink: Callable[[MetricsSnapshot], None],
                 interval_s: float = 1.0) -> None:
        self.session, self.base_url, self.now, self.sink = session, base_url, now, sink
        self.interval_s = interval_s
        self.failures = 0
        self.snapshots: list[MetricsSnapshot] = []
        self._task: asyncio.Task[None] | None = None

    async def scrape_once(self) -> MetricsSnapshot | None:
        t = self.now()
        try:
            snap = parse_metrics(await fetch_metrics(self.session, self.base_url), t)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            self.failures += 1
            return None
        self.snapshots.append(snap)
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
