"""The target of a Locust test, through the core's async client: resolve it from the options,
introspect and check it, count prompts on its tokenizer, send one request, and tap its
/metrics."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from replay.core.buckets import Buckets
from replay.core.errors import ConfigError
from replay.core.records import Result
from replay.serving.client import Client
from replay.serving.endpoints import api_session
from replay.serving.introspect import introspect, served_model
from replay.serving.metrics import Scraper
from replay.serving.prompt_tokens import count_tokens, token_pool
from replay.serving.targets import (
    TargetSpec,
    check_served_dtype,
    load_targets_config,
    parse_targets,
)
from replay.traces.synth import TokenPool, synthesize
from replay.traces.trace import Request


def resolve_target(text: str, host: str | None, targets_file: str | None) -> TargetSpec:
    """``--kvc-target``: ``http://...`` (named ``target``), ``NAME=URL`` (bf16/fp8 names set the
    expected cache dtype, as in ``replay --targets``), a name from ``--kvc-targets-file``, or
    empty for Locust's host. Locust drives servers that already run; it starts none."""
    text = (text or "").strip() or (host or "").strip()
    if not text:
        raise ConfigError(
            "no target: give --kvc-target (URL, NAME=URL or a name from "
            "--kvc-targets-file) or Locust's --host"
        )
    if re.match(r"https?://", text):
        return TargetSpec(name="target", url=text.rstrip("/"))
    config = load_targets_config(Path(targets_file)) if targets_file else None
    if "=" not in text and (config is None or text not in config):
        raise ConfigError(
            f"--kvc-target: '{text}' names no server: give a URL, NAME=URL, or a "
            "name from --kvc-targets-file"
        )
    specs = parse_targets(text, None, config)
    if len(specs) != 1:
        raise ConfigError(
            f"--kvc-target: one target per Locust run (got {len(specs)}); run "
            "Locust once per target and compare the run directories"
        )
    spec = specs[0]
    if spec.url is None:
        raise ConfigError(
            f"--kvc-target: '{spec.name}' is a local model; start it (vllm serve "
            "or replay) and give its URL: Locust starts no servers"
        )
    return spec


@dataclass
class Prepared:
    """What sending a shard needs to know about the target."""

    info: dict[str, Any]
    model: str
    counts: dict[str, int | None]
    buckets: dict[str, str]
    pool: TokenPool | None

    def new_result(self, req: Request, target: str, phase: str, scheduled: float) -> Result:
        return Result(
            request_id=req.id,
            target=target,
            phase=phase,
            bucket=self.buckets.get(req.id, "unknown"),
            scheduled=scheduled,
            prompt_tokens=self.counts.get(req.id),
        )


async def prepare(spec: TargetSpec, reqs: Sequence[Request], buckets: Buckets) -> Prepared:
    """Introspect the target, check it serves what its spec expects, count each prompt on its
    tokenizer (the bucket) and build the synthetic-prompt pool, as the runner does. A target
    that cannot be used raises TargetError with the reason."""
    url = spec.connect_url
    assert url is not None
    # The target's key goes with every call on this session, and only to the target's URL.
    async with api_session(spec.auth_headers()) as session:
        info = await introspect(session, url)
        model = served_model(info)
        check_served_dtype(spec, info["cache_config"].get("cache_dtype"), None, info["problems"])
        pool = await token_pool(session, url, model) if any(r.synth for r in reqs) else None
        counts = await count_tokens(session, url, model, reqs, problems=info["problems"])
    labels = {rid: (buckets.label(n) if n is not None else "unknown") for rid, n in counts.items()}
    info["tokens_counted"] = sum(c is not None for c in counts.values())
    return Prepared(info, model, counts, labels, pool)


async def prepare_more(
    spec: TargetSpec, prepared: Prepared, reqs: Sequence[Request], buckets: Buckets
) -> None:
    """Count the prompts of requests this worker takes over from a lost one, as ``prepare``
    counted its own (and build the synthetic-prompt pool if they are the first to need it)."""
    url = spec.connect_url
    assert url is not None
    async with api_session(spec.auth_headers()) as session:
        if prepared.pool is None and any(r.synth for r in reqs):
            prepared.pool = await token_pool(session, url, prepared.model)
        problems = prepared.info.setdefault("problems", [])
        counts = await count_tokens(session, url, prepared.model, reqs, problems=problems)
    prepared.counts.update(counts)
    prepared.buckets.update(
        {rid: (buckets.label(n) if n is not None else "unknown") for rid, n in counts.items()}
    )


async def send_one(
    client: Client, req: Request, res: Result, prepared: Prepared, salt: str | None
) -> Result:
    """Send one request through the core client into ``res``. Also when the send is cancelled
    (the test stopped) the Result comes back, marked cancelled by the client."""
    ids = synthesize(req, prepared.pool) if req.synth is not None and prepared.pool else None
    try:
        await client.send(req, res, ids, salt)
    except asyncio.CancelledError:
        pass  # the client has recorded it; the caller keeps the Result
    return res


class MetricsTap:
    """The target's introspection and its /metrics scraped about once a second (the core's
    Scraper), for the manifest and the server-side figures of the summary."""

    def __init__(
        self, spec: TargetSpec, now: Callable[[], float], sink: Callable[[dict[str, Any]], None]
    ) -> None:
        self.spec, self.now, self.sink = spec, now, sink
        self._session: aiohttp.ClientSession | None = None
        self._scraper: Scraper | None = None

    async def start(self) -> dict[str, Any]:
        url = self.spec.connect_url
        assert url is not None
        self._session = api_session(self.spec.auth_headers())
        info = await introspect(self._session, url)
        self._scraper = Scraper(
            self._session, url, self.now, lambda snap: self.sink(snap.to_json())
        )
        self._scraper.start()
        return info

    async def scrape_once(self) -> None:
        if self._scraper is not None:
            await self._scraper.scrape_once()

    async def stop(self) -> int:
        failures = 0
        if self._scraper is not None:
            await self._scraper.stop()
            failures = self._scraper.failures
            self._scraper = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        return failures
