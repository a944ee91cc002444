"""Streaming client for OpenAI-compatible servers (vLLM): one aiohttp session per target.

Every outcome becomes a ``Result``: HTTP errors keep their status and body, timeouts and
disconnects their kind. Only our own bugs raise. Tokens are counted from the usage the server
reports per chunk (``continuous_usage_stats``), never by counting chunks, unless the server
reports no usage (then marked ``tokens_estimated``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import orjson

from ._records import Result, ToolCall
from ._sse import DONE, ProtocolError, SSEDecoder
from ._trace import Request

Clock = Callable[[], float]
_JSON_HEADERS = {"Content-Type": "application/json"}


class Client:
    """Sends requests to one target and records what happened."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        seed: int = 0,
        clock: Clock = time.perf_counter,
        epoch: float = 0.0,
        max_connections: int = 0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.seed = seed
        self.timeout_s = timeout_s
        self._clock = clock
        self._epoch = epoch
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # ``sent`` is when the body was handed to the socket: aiohttp writes it from a task
        # of its own, which under load runs milliseconds after the POST call (measured in
        # bench/: most of the TTFT error at 64 streams was that wait, not the network).
        trace = aiohttp.TraceConfig()
        trace.on_request_chunk_sent.append(self._body_written)
        self._session = aiohttp.ClientSession(
            headers=headers,
            trace_configs=[trace],
            connector=aiohttp.TCPConnector(limit=max_connections, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
        )

    async def close(self) -> None:
        await self._session.close()

    def now(self) -> float:
        return self._clock() - self._epoch

    async def _body_written(self, _session: aiohttp.ClientSession, ctx: Any,
                            _params: aiohttp.TraceRequestChunkSentParams) -> None:
        if isinstance(ctx.trace_request_ctx, Result):
            ctx.trace_request_ctx.sent = self.now()

    def payload(self, req: Request, prompt_ids: Sequence[int] | None = None,
                cache_salt: str | None = None) -> tuple[str, dict[str, Any]]:
        """The endpoint and JSON body for a request (deterministic sampling by default).
        ``cache_salt`` isolates vLLM's prefix cache (requests share only within one salt)."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "seed": self.seed,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "return_token_ids": True,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        body.update(req.params)
        if req.api == "chat":
            body["messages"] = list(req.messages or ())
            if req.tools:
                body["tools"] = list(req.tools)
            if req.tool_choice is not None:
                body["tool_choice"] = req.tool_choice
            return "/v1/chat/completions", body
        if prompt_ids is not None:
            body["prompt"] = list(prompt_ids)
        elif isinstance(req.prompt, tuple):
            body["prompt"] = list(req.prompt)
        else:
            body["prompt"] = req.prompt
        return "/v1/completions", body

    async def send(self, req: Request, result: Result, prompt_ids: Sequence[int] | None = None,
                   cache_salt: str | None = None) -> Result:
        """Stream one request into ``result`` (its scheduled time already set)."""
        path, body = self.payload(req, prompt_ids, cache_salt)
        try:
            # asyncio.timeout, not wait_for: no extra task, so the request starts in this
            # loop iteration instead of queueing behind every ready callback (measured in
            # bench/: wait_for added ~2-4 ms to TTFT at 64 concurrent starts).
            async with asyncio.timeout(self.timeout_s):
                await self._stream(path, body, result)
        except TimeoutError:
            _fail(result, "timeout", f"no complete answer within {self.timeout_s:g} s")
        except aiohttp.ClientConnectorError as exc:
            _fail(result, "connect", f"cannot connect: {exc}")
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError,
                aiohttp.ClientOSError, ConnectionResetError) as exc:
            _fail(result, "disconnect", f"connection lost mid-answer: {exc!r}")
        except ProtocolError as exc:
            _fail(result, "protocol", str(exc))
        except aiohttp.ClientError as exc:  # anything else the HTTP layer rejects
            _fail(result, "protocol", f"bad HTTP response: {exc!r}")
        except asyncio.CancelledError:
            _fail(result, "cancelled", "cancelled before the answer completed")
            result.status = "cancelled"
            raise
        finally:
            if result.done is None:
                result.done = self.now()
        return result

    async def _stream(self, path: str, body: dict[str, Any], result: Result) -> None:
        data = orjson.dumps(body)
        result.sent = self.now()  # until the body is written (a failed connect keeps this)
        async with self._session.post(self.base_url + path, data=data, headers=_JSON_HEADERS,
                                      trace_request_ctx=result) as resp:
            if resp.status != 200:
                text = (await resp.text(errors="replace"))[:2000]
                retry = resp.headers.get("Retry-After")
                # No automatic retry: a 429 is a result (the server's capacity), with the
                # server's own hint kept.
                hint = f" (Retry-After: {retry})" if retry else ""
                _fail(result, "http", f"HTTP {resp.status}{hint}: {text}")
                result.http_status = resp.status
                return
            result.http_status = 200
            acc = _Accumulator(result, self.now)
            decoder = SSEDecoder()
            read = resp.content.readany  # what iter_any() calls, without its wrapper
            while chunk := await read():
                arrived = self.now()  # one stamp per read: every event in it arrived then
                for event in decoder.feed(chunk):
                    if event is DONE:
                        acc.finish()
                        return
                    acc.add(event, arrived)
            for event in decoder.close():
                if event is DONE:
                    acc.finish()
                    return
                acc.add(event)
            acc.finish()
            if result.status == "ok":
                _fail(result, "protocol", "stream ended without [DONE]")


class _Accumulator:
    """Folds streamed chunks into a Result."""

    __slots__ = ("_calls", "_prev_completion", "_text", "_usage_seen", "now", "r")

    def __init__(self, result: Result, now: Callable[[], float]) -> None:
        self.r = result
        self.now = now
        self._usage_seen = False
        self._prev_completion = 0
        self._text: list[str] = []
        self._calls: dict[int, ToolCall] = {}

    def add(self, ev: Any, t: float | None = None) -> None:
        # A well-formed JSON event of the wrong shape (a choice that is a number, a token
        # count that is a string) is the server's protocol error, recorded on the request;
        # it must not escape as a TypeError that stops the whole run.
        try:
            self._add(ev, t)
        except (AttributeError, TypeError, ValueError, KeyError) as exc:
            raise ProtocolError(f"malformed SSE event ({exc}): {str(ev)[:200]}") from None

    def _add(self, ev: Any, t: float | None) -> None:
        # Runs once per streamed chunk: lookups are done once and the usual keys checked
        # first (bench/: this was the client's largest own cost per token).
        r = self.r
        if not isinstance(ev, dict):
            raise ProtocolError(f"SSE event is not a JSON object: {str(ev)[:200]}")
        choices = ev.get("choices")
        if not choices and "error" in ev:
            err = ev["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            _fail(r, "server_error", str(msg)[:2000])
            return
        if r.prompt_ids is None and ev.get("prompt_token_ids"):
            r.prompt_ids = list(ev["prompt_token_ids"])
        usage = ev.get("usage")
        new_tokens = None
        if isinstance(usage, dict):
            if isinstance(usage.get("prompt_tokens"), int):
                r.prompt_tokens = usage["prompt_tokens"]
            ct = usage.get("completion_tokens")
            if isinstance(ct, int):
                self._usage_seen = True
                new_tokens = ct - self._prev_completion
                self._prev_completion = ct
        produced = False
        for choice in choices or ():
            ids = choice.get("token_ids")
            if ids:
                r.output_ids.extend(ids)
            if r.prompt_ids is None and choice.get("prompt_token_ids"):
                r.prompt_ids = list(choice["prompt_token_ids"])
            delta = choice.get("delta")
            if delta is not None or "delta" in choice:
                delta = delta or {}
                content = delta.get("content")
                if content and isinstance(content, str):
                    self._text.append(content)
                    produced = True
                for frag in delta.get("tool_calls") or ():
                    self._tool_fragment(frag)
                    produced = True
            else:
                text = choice.get("text")
                if text and isinstance(text, str):
                    self._text.append(text)
                    produced = True
            finish = choice.get("finish_reason")
            if finish:
                r.finish_reason = finish
        if new_tokens is None:
            new_tokens = 1 if produced else 0
        if new_tokens > 0 and (produced or r.chunk_times):
            if t is None:
                t = self.now()
            if r.first_token is None:
                r.first_token = t
            r.chunk_times.append(t)
            r.chunk_tokens.append(new_tokens)

    def _tool_fragment(self, frag: dict[str, Any]) -> None:
        idx = frag.get("index", 0)
        if not isinstance(idx, int):
            raise TypeError(f"tool call index {idx!r} is not an integer")
        call = self._calls.get(idx)
        if call is None:
            call = self._calls[idx] = ToolCall(index=idx)
        if frag.get("id"):
            call.id = frag["id"]
        fn = frag.get("function") or {}
        if fn.get("name"):
            call.name += fn["name"]
        if fn.get("arguments"):
            call.arguments += fn["arguments"]

    def finish(self) -> None:
        r = self.r
        r.done = self.now()
        r.output_text = "".join(self._text)
        r.tool_calls = [self._calls[i] for i in sorted(self._calls)]
        if self._usage_seen:
            r.output_tokens = self._prev_completion
        else:
            r.output_tokens = sum(r.chunk_tokens)
            r.tokens_estimated = True


def _fail(result: Result, kind: Any, message: str) -> None:
    result.status = "error"
    result.error_kind = kind
    result.error = message
