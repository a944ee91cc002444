"""What actually ran: engine version, model, cache config, and server metrics over time."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from replay.core.errors import EndpointError, TargetError
from replay.core.strict import integer
from replay.serving.http1 import KEEP_IDLE_S, ConnectError

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


_ENGINE_FIELDS = re.compile(r"\b(kv_cache_dtype|quantization|dtype|max_seq_len)=([^,\s]+)")


def engine_config_from_log(log_text: str) -> dict[str, str]:
    """The engine's own statement of what it runs (its 'Initializing ... engine' line)."""
    for line in log_text.splitlines():
        if "Initializing a V1 LLM engine" in line or "Initializing an LLM engine" in line:
            return {k: v.strip("'") for k, v in _ENGINE_FIELDS.findall(line)}
    return {}


# Non-streaming answers are read whole; past these a server is sending something other than
# what the endpoint is for, and it must not fill our memory doing so.
MAX_BODY = 16 * 1024 * 1024
QUOTE_BYTES = 200


def quote(body: bytes) -> str:
    """The start of a body, enough to recognise what the server sent."""
    head = body[:QUOTE_BYTES].decode("utf-8", "replace")
    return repr(head) + (f"... ({len(body)} bytes)" if len(body) > QUOTE_BYTES else "")


def os_error_text(err: OSError) -> str:
    """The OS's own words: asyncio words a refused connection as "Connect call failed",
    which hides that it was refused."""
    code = err.errno
    if code is not None and code > 0 and code in errno.errorcode:
        return f"{os.strerror(code)} ({errno.errorcode[code]})"
    return str(err) or type(err).__name__


def api_session(headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    """A session for the server's own API (introspection, /metrics, /tokenize, scoring) that
    gives up idle connections before the server would (``http1.KEEP_IDLE_S``): reusing one the
    server is closing lost requests as "Server disconnected"."""
    return aiohttp.ClientSession(
        headers=headers, connector=aiohttp.TCPConnector(keepalive_timeout=KEEP_IDLE_S)
    )


def connect_reason(exc: aiohttp.ClientConnectorError | ConnectError) -> str:
    """Why a connection could not be made, in the OS's words (shared with the client)."""
    err = exc.os_error
    why = (
        f"name lookup failed: {err.strerror}"
        if isinstance(err, socket.gaierror)
        else os_error_text(err)
    )
    return f"cannot connect to {exc.host}:{exc.port}: {why}"


def transport_problem(exc: BaseException, timeout_s: float) -> tuple[str, bool]:
    """(what went wrong on the way to the server, whether it was never reached)."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return connect_reason(exc), True
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s", False
    if isinstance(exc, OSError):
        return os_error_text(exc), False
    return f"{type(exc).__name__}: {exc}", False


@dataclass(frozen=True, slots=True)
class Answer:
    """A 200 answer from one endpoint: its raw body and, for JSON endpoints, the value."""

    label: str  # "GET /v1/models"
    body: bytes
    value: Any = None

    def wrong(self, expected: str) -> EndpointError:
        return EndpointError(f"{self.label}: expected {expected}, got {quote(self.body)}")


async def fetch(
    session: aiohttp.ClientSession,
    method: str,
    base_url: str,
    path: str,
    *,
    json_body: Any = None,
    timeout_s: float = 30.0,
    max_bytes: int = MAX_BODY,
) -> Answer:
    """One non-streaming call; anything but a 200 raises EndpointError naming the call.
    Redirects are not followed: an answer from elsewhere is not the target's answer, and the
    session's credentials are the target's alone."""
    label = f"{method} {path}"
    try:
        async with session.request(
            method,
            base_url + path,
            json=json_body,
            allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as r:
            if 300 <= r.status < 400:
                where = quote(r.headers.get("Location", "(none)").encode())
                raise _scrubbed(
                    session,
                    f"{label}: HTTP {r.status} redirect to {where}: not "
                    "followed (give the URL of the server itself)",
                )
            body = await _read_capped(r, label, max_bytes)
            if r.status != 200:
                raise _scrubbed(
                    session, f"{label}: HTTP {r.status} ({r.content_type}): {quote(body)}"
                )
            return Answer(label, body)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        why, unreachable = transport_problem(exc, timeout_s)
        raise EndpointError(f"{label}: {why}", unreachable=unreachable) from exc


def _scrubbed(session: aiohttp.ClientSession, message: str) -> EndpointError:
    """A server that echoes the request's key in its error must not put the key into the run
    directory, where the problem is written."""
    key = session.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    return EndpointError(message.replace(key, "[api key]") if key else message)


async def _read_capped(r: aiohttp.ClientResponse, label: str, max_bytes: int) -> bytes:
    if r.content_length is not None and r.content_length > max_bytes:
        raise EndpointError(
            f"{label}: answer of {r.content_length} bytes, over the "
            f"{max_bytes}-byte limit for this endpoint"
        )
    buf = bytearray()
    async for chunk in r.content.iter_chunked(65536):
        buf += chunk
        if len(buf) > max_bytes:
            raise EndpointError(
                f"{label}: answer over the {max_bytes}-byte limit for this "
                f"endpoint: {quote(bytes(buf))}"
            )
    return bytes(buf)


async def fetch_json(
    session: aiohttp.ClientSession, method: str, base_url: str, path: str, **kw: Any
) -> Answer:
    """``fetch``, and the body parsed as JSON (any content type that parses is accepted)."""
    ans = await fetch(session, method, base_url, path, **kw)
    try:
        return Answer(ans.label, ans.body, orjson.loads(ans.body))
    except orjson.JSONDecodeError:
        raise ans.wrong("JSON") from None


def model_fields(ans: Answer) -> tuple[dict[str, Any], list[str]]:
    """model_id, model_root and max_model_len of the first model a /v1/models answer lists,
    and notes on fields of the wrong type (dropped, not trusted)."""
    v = ans.value
    data = v.get("data") if isinstance(v, dict) else None
    if not isinstance(data, list):
        raise ans.wrong('an object with a "data" list')
    if not data:
        raise ans.wrong("at least one model listed")
    first = data[0]
    if not isinstance(first, dict) or not isinstance(first.get("id"), str) or not first["id"]:
        raise ans.wrong('data[0] to be an object with a non-empty string "id"')
    out: dict[str, Any] = {"model_id": first["id"], "model_root": None, "max_model_len": None}
    notes = []
    root, mml = first.get("root"), first.get("max_model_len")
    if isinstance(root, str):
        out["model_root"] = root
    elif root is not None:
        notes.append(f"{ans.label}: data[0].root is not a string: {quote(orjson.dumps(root))}")
    if (n := integer(mml)) is not None and n > 0:
        out["max_model_len"] = n
    elif mml is not None:
        notes.append(
            f"{ans.label}: data[0].max_model_len is not a positive integer: "
            f"{quote(orjson.dumps(mml))}"
        )
    return out, notes


def engine_version(ans: Answer) -> str:
    v = ans.value
    if not isinstance(v, dict) or not isinstance(v.get("version"), str):
        raise ans.wrong('an object with a string "version"')
    return str(v["version"])


async def introspect(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    """/v1/models, /version and the cache config labels. What an endpoint could not tell is
    a line in ``problems`` naming it; ``unreachable`` is set when the server could not be
    connected to at all (the rest is then not asked)."""
    out: dict[str, Any] = {
        "url": base_url,
        "problems": [],
        "model_id": None,
        "model_root": None,
        "max_model_len": None,
        "engine_version": None,
        "cache_config": {},
    }
    problems: list[str] = out["problems"]
    try:
        models = await fetch_json(session, "GET", base_url, "/v1/models")
        fields, notes = model_fields(models)
        out.update(fields, models=models.value)
        problems.extend(notes)
    except EndpointError as exc:
        problems.append(str(exc))
        if exc.unreachable:
            out["unreachable"] = True
            return out
    try:
        version = await fetch_json(session, "GET", base_url, "/version")
        out["engine_version"] = engine_version(version)
        out["version"] = version.value
    except EndpointError as exc:
        problems.append(str(exc))
    try:
        out["cache_config"] = parse_metrics(await fetch_metrics(session, base_url)).cache_info
    except EndpointError as exc:
        problems.append(str(exc))
    except ValueError as exc:
        problems.append(f"GET /metrics: not Prometheus text: {exc}")
    return out


def served_model(info: dict[str, Any]) -> str:
    """The model an introspected target serves; a target without one cannot be used, and the
    TargetError says why in the endpoint's own terms."""
    model = info.get("model_id")
    if isinstance(model, str) and model:
        return model
    url = info.get("url")
    why = next(
        (p for p in info.get("problems", []) if p.startswith("GET /v1/models")),
        "GET /v1/models: no model listed",
    )
    if info.get("unreachable"):
        raise TargetError(f"target unreachable at {url}: {why}")
    raise TargetError(f"no model served by {url}: {why}")


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
