"""Streaming client for OpenAI-compatible servers (vLLM): one aiohttp session per target.

Builds each request's body, sends it, and reads the event stream into a ``Result``
(``accumulator.StreamAccumulator`` folds the events). Every outcome becomes a ``Result``: HTTP
errors keep their status, content type and the server's own message (``error_answers``),
timeouts and disconnects their kind, a refused connection its OS error. Only our own bugs
raise. Redirects are not followed: an answer must come from the target.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import orjson

from replay.core.records import Result
from replay.core.trace import Request
from replay.serving.accumulator import MAX_ANSWER_CHARS, StreamAccumulator
from replay.serving.error_answers import fail, http_error, not_a_stream
from replay.serving.introspect import connect_reason
from replay.serving.sse import DONE, MAX_EVENT_BYTES, NOT_ONE, ProtocolError, SSEDecoder
from replay.serving.stamping import StampingConnector, arrival_clock

Clock = Callable[[], float]
_JSON_HEADERS = {"Content-Type": "application/json"}
_CONNECT_TIMEOUT_S = 30.0


class Client:
    """Sends requests to one target and records what happened.

    ``max_event_bytes`` bounds one SSE line or event (a larger one is that request's
    ``protocol`` error); ``max_answer_chars`` bounds the answer text a result keeps.
    """

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
        max_event_bytes: int = MAX_EVENT_BYTES,
        max_answer_chars: int = MAX_ANSWER_CHARS,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_event_bytes = max_event_bytes
        self.max_answer_chars = max_answer_chars
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
            connector=StampingConnector(self.now, limit=max_connections, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=_CONNECT_TIMEOUT_S),
        )

    async def close(self) -> None:
        await self._session.close()

    def now(self) -> float:
        return self._clock() - self._epoch

    async def _body_written(
        self,
        _session: aiohttp.ClientSession,
        ctx: Any,
        _params: aiohttp.TraceRequestChunkSentParams,
    ) -> None:
        if isinstance(ctx.trace_request_ctx, Result):
            ctx.trace_request_ctx.sent = self.now()

    def payload(
        self, req: Request, prompt_ids: Sequence[int] | None = None, cache_salt: str | None = None
    ) -> tuple[str, dict[str, Any]]:
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

    async def send(
        self,
        req: Request,
        result: Result,
        prompt_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> Result:
        """Stream one request into ``result`` (its scheduled time already set)."""
        path, body = self.payload(req, prompt_ids, cache_salt)
        try:
            # asyncio.timeout, not wait_for: no extra task, so the request starts in this
            # loop iteration instead of queueing behind every ready callback (measured in
            # bench/: wait_for added ~2-4 ms to TTFT at 64 concurrent starts).
            async with asyncio.timeout(self.timeout_s):
                await self._stream(path, body, result)
        except aiohttp.ConnectionTimeoutError as exc:  # before TimeoutError: it is one
            fail(
                result,
                "connect",
                f"cannot connect to {self.base_url}: no answer to the "
                f"TCP connect within {_CONNECT_TIMEOUT_S:g} s ({exc!r})",
            )
        except TimeoutError:
            fail(result, "timeout", f"no complete answer within {self.timeout_s:g} s")
        except aiohttp.ClientConnectorError as exc:
            fail(result, "connect", connect_reason(exc))
        except (
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientPayloadError,
            aiohttp.ClientOSError,
            ConnectionResetError,
        ) as exc:
            fail(result, "disconnect", f"connection lost mid-answer: {exc!r}")
        except ProtocolError as exc:
            fail(result, "protocol", str(exc))
        except aiohttp.ClientError as exc:  # anything else the HTTP layer rejects
            fail(result, "protocol", f"bad HTTP response: {exc!r}")
        except asyncio.CancelledError:
            fail(result, "cancelled", "cancelled before the answer completed")
            result.status = "cancelled"
            raise
        finally:
            if result.done is None:
                result.done = self.now()
        return result

    async def _stream(self, path: str, body: dict[str, Any], result: Result) -> None:
        data = orjson.dumps(body)
        result.sent = self.now()  # until the body is written (a failed connect keeps this)
        async with self._session.post(
            self.base_url + path,
            data=data,
            headers=_JSON_HEADERS,
            allow_redirects=False,
            trace_request_ctx=result,
        ) as resp:
            result.http_status = resp.status
            if resp.status != 200:
                await http_error(resp, result)
                return
            if resp.content_type != "text/event-stream":
                await not_a_stream(resp, result)
                return
            acc = StreamAccumulator(result, self.now, self.max_answer_chars)
            decoder = SSEDecoder(self.max_event_bytes)
            read = resp.content.readany  # what iter_any() calls, without its wrapper
            stamps = arrival_clock(resp)
            first = chunk = await read()  # kept to quote when the stream has no content
            while chunk:
                # One stamp per read, every event in it arrived then: when its last bytes
                # came off the socket (the read itself runs later, after other tasks).
                arrived = stamps.received_at if stamps is not None else self.now()
                event = decoder.feed_one(chunk)
                if event is not NOT_ONE:
                    acc.add(event, arrived)
                else:
                    for event in decoder.feed_rest(chunk):
                        if event is DONE:
                            acc.finish(head=first)
                            return
                        acc.add(event, arrived)
                chunk = await read()
            for event in decoder.close():
                if event is DONE:
                    acc.finish(head=first)
                    return
                acc.add(event)
            acc.finish(done=False, head=first)
