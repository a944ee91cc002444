"""Streaming client for OpenAI-compatible servers (vLLM): one aiohttp session per target.

Every outcome becomes a ``Result``: HTTP errors keep their status, content type and the
server's own message, timeouts and disconnects their kind, a refused connection its OS error.
Only our own bugs raise. Redirects are not followed: an answer must come from the target.

Tokens, by how the server reports usage (a chunk with no content and no tool call is never a
token arrival; its tokens go to the next content chunk, or only to ``output_tokens`` when
none follows, as vLLM's EOS does):

* on every chunk (``continuous_usage_stats``, what we ask for): a content chunk carries the
  growth of ``completion_tokens`` since the tokens already given to earlier arrivals, so a
  chunk of several tokens spreads its gap over them;
* only at the end (``include_usage`` alone, as many gateways send it): every content chunk is
  one arrival of one token, so ITL is the gap between content chunks, ``output_tokens`` is
  the final usage and ``chunk_tokens_estimated`` says the split was not reported;
* not at all: the same per chunk, and ``output_tokens`` counts content chunks
  (``tokens_estimated``).

What a result stores is capped (``MAX_ANSWER_CHARS``, ``MAX_STORED_TOKENS``,
``MAX_TOOL_CALLS``, flagged ``output_truncated``) so that an endless answer neither fills
memory nor goes whole into ``results.jsonl``; timing and token counts still run to the end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import orjson

from replay.core.records import Result, ToolCall
from replay.core.trace import Request
from replay.serving.introspect import connect_reason
from replay.serving.sse import DONE, MAX_EVENT_BYTES, ProtocolError, SSEDecoder

Clock = Callable[[], float]
_JSON_HEADERS = {"Content-Type": "application/json"}
# Answer text kept per result (text and tool-call names and arguments together): about 250k
# tokens, past any max_tokens a trace asks for; the rest is counted, not kept.
MAX_ANSWER_CHARS = 1 << 20
# Arrival times and output token ids kept per result (memory and results.jsonl line size).
MAX_STORED_TOKENS = 1 << 18
MAX_TOOL_CALLS = 128
# A token count past this is no count a server made (and past 2**64 none that orjson could
# write to results.jsonl).
_MAX_COUNT = 1 << 40
_CONNECT_TIMEOUT_S = 30.0
# How much of an error body is read: enough for any server's message, bounded for any body.
_ERROR_BODY_BYTES = 1 << 16
_QUOTE_CHARS = 300


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
            connector=aiohttp.TCPConnector(limit=max_connections, force_close=False),
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
            _fail(
                result,
                "connect",
                f"cannot connect to {self.base_url}: no answer to the "
                f"TCP connect within {_CONNECT_TIMEOUT_S:g} s ({exc!r})",
            )
        except TimeoutError:
            _fail(result, "timeout", f"no complete answer within {self.timeout_s:g} s")
        except aiohttp.ClientConnectorError as exc:
            _fail(result, "connect", connect_reason(exc))
        except (
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientPayloadError,
            aiohttp.ClientOSError,
            ConnectionResetError,
        ) as exc:
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
        async with self._session.post(
            self.base_url + path,
            data=data,
            headers=_JSON_HEADERS,
            allow_redirects=False,
            trace_request_ctx=result,
        ) as resp:
            result.http_status = resp.status
            if resp.status != 200:
                await _http_error(resp, result)
                return
            if resp.content_type != "text/event-stream":
                await _not_a_stream(resp, result)
                return
            acc = _Accumulator(result, self.now, self.max_answer_chars)
            decoder = SSEDecoder(self.max_event_bytes)
            read = resp.content.readany  # what iter_any() calls, without its wrapper
            first = chunk = await read()  # kept to quote when the stream has no content
            while chunk:
                arrived = self.now()  # one stamp per read: every event in it arrived then
                for event in decoder.feed(chunk):
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


async def _body_head(resp: aiohttp.ClientResponse) -> str:
    """The start of a body that is not the stream, decoded as the server says it is."""
    parts: list[bytes] = []
    size = 0
    while size < _ERROR_BODY_BYTES:
        piece = await resp.content.read(_ERROR_BODY_BYTES - size)
        if not piece:
            break
        parts.append(piece)
        size += len(piece)
    raw = b"".join(parts)
    try:
        return raw.decode(resp.charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        return raw.decode("utf-8", errors="replace")


def _content_type(resp: aiohttp.ClientResponse) -> str:
    raw = resp.headers.get("Content-Type")
    return f"Content-Type {raw[:100]!r}" if raw else "no Content-Type"


def _server_message(text: str) -> tuple[str | None, bool]:
    """The message of a JSON error body (OpenAI's ``{"error": {"message": ...}}``, older
    vLLM's ``{"object": "error", "message": ...}``, FastAPI's ``{"detail": ...}``) and whether
    the body says it is an error."""
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None, False
    if not isinstance(doc, dict):
        return None, False
    err = doc.get("error")
    if isinstance(err, dict):
        msg = err.get("message")
        return str(err if msg is None else msg)[:2000], True
    if isinstance(err, str):
        return err[:2000], True
    said_error = doc.get("object") == "error"
    for key in ("message", "detail"):
        if doc.get(key) is not None:
            return str(doc[key])[:2000], said_error
    return None, False


def _quote(text: str) -> str:
    text = text.strip()
    return repr(text[:_QUOTE_CHARS]) + (" ..." if len(text) > _QUOTE_CHARS else "")


async def _http_error(resp: aiohttp.ClientResponse, result: Result) -> None:
    status = resp.status
    if 300 <= status < 400:
        where = resp.headers.get("Location")
        to = f"to {where[:500]!r}" if where else "with no Location"
        _fail(
            result,
            "http",
            f"HTTP {status} redirect {to}, not followed: the answer must "
            "come from the target's own URL (point the target at where it redirects)",
        )
        return
    text = await _body_head(resp)
    message, _ = _server_message(text)
    retry = resp.headers.get("Retry-After")
    # No automatic retry: a 429 is a result (the server's capacity), with the server's own
    # hint kept.
    hint = f", Retry-After: {retry[:50]}" if retry else ""
    said = message if message is not None else (_quote(text) if text.strip() else "empty body")
    _fail(result, "http", f"HTTP {status} ({_content_type(resp)}{hint}): {said}")


async def _not_a_stream(resp: aiohttp.ClientResponse, result: Result) -> None:
    """A 200 that is not an event stream: an error page, an error object, or a whole answer
    from a server that ignored ``stream``."""
    text = await _body_head(resp)
    message, is_error = _server_message(text)
    ctype = _content_type(resp)
    if is_error:
        _fail(
            result,
            "server_error",
            f"HTTP 200 with an error body ({ctype}) instead of an event stream: {message}",
        )
        return
    hint = " (did it ignore stream=true?)" if resp.content_type == "application/json" else ""
    _fail(
        result,
        "protocol",
        f"HTTP 200 with {ctype}, not text/event-stream{hint}; the body "
        f"starts: {_quote(text) if text.strip() else 'empty body'}",
    )


class _Accumulator:
    """Folds streamed chunks into a Result."""

    __slots__ = (
        "_arrivals",
        "_attributed",
        "_calls",
        "_estimated",
        "_id_room",
        "_reported",
        "_room",
        "_stamps_left",
        "_text",
        "_usage_seen",
        "now",
        "r",
    )

    def __init__(
        self, result: Result, now: Callable[[], float], max_chars: int = MAX_ANSWER_CHARS
    ) -> None:
        self.r = result
        self.now = now
        self._usage_seen = False
        self._reported = 0  # the server's last completion_tokens
        self._attributed = 0  # completion_tokens given to arrivals so far (usage per chunk)
        self._arrivals = 0  # content chunks counted as one token each (usage not per chunk)
        self._estimated = False  # an arrival's token count was not reported
        self._room = max_chars  # answer characters that may still be kept
        self._id_room = MAX_STORED_TOKENS
        self._stamps_left = MAX_STORED_TOKENS
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
        ct = None
        if isinstance(usage, dict):
            pt = usage.get("prompt_tokens")
            if pt != r.prompt_tokens and isinstance(pt, int):  # checked when it changes
                if not 0 <= pt <= _MAX_COUNT:
                    raise ProtocolError(f"impossible usage: prompt_tokens {pt}")
                r.prompt_tokens = pt
            ct = usage.get("completion_tokens")
            if isinstance(ct, int):
                if ct < self._reported:  # below 0 too; too large is checked at the end
                    after = f" after {self._reported}" if ct >= 0 else ""
                    raise ProtocolError(f"impossible usage: completion_tokens {ct}{after}")
                self._reported = ct
                self._usage_seen = True
            else:
                ct = None
        produced = False
        for choice in choices or ():
            ids = choice.get("token_ids")
            if ids:
                room = self._id_room - len(ids)
                self._id_room = room
                if room >= 0:
                    r.output_ids.extend(ids)
                else:
                    r.output_truncated = True
            if r.prompt_ids is None and choice.get("prompt_token_ids"):
                r.prompt_ids = list(choice["prompt_token_ids"])
            delta = choice.get("delta")
            if delta is not None or "delta" in choice:
                delta = delta or {}
                content = delta.get("content")
                if content and isinstance(content, str):
                    room = self._room - len(content)
                    if room >= 0:
                        self._room = room
                        self._text.append(content)
                    else:
                        self._cut(content)
                    produced = True
                for frag in delta.get("tool_calls") or ():
                    if self._tool_fragment(frag):
                        produced = True
            else:
                text = choice.get("text")
                if text and isinstance(text, str):
                    room = self._room - len(text)
                    if room >= 0:
                        self._room = room
                        self._text.append(text)
                    else:
                        self._cut(text)
                    produced = True
            finish = choice.get("finish_reason")
            if finish:
                if not isinstance(finish, str):
                    raise TypeError(f"finish_reason {str(finish)[:50]} is not a string")
                r.finish_reason = finish[:100]
        if not produced:
            return  # no content: never a token arrival (its tokens go to the next one)
        if ct is None or self._estimated:
            # Usage only at the end, or none: one token per content chunk, so ITL is the
            # gap between content chunks.
            self._estimated = True
            self._arrivals += 1
            n = 1
        else:
            n = ct - self._attributed
            if n <= 0 and r.first_token is not None:
                return  # content without a new token belongs to the last arrival
            self._attributed = ct
        if t is None:
            t = self.now()
        if r.first_token is None:
            r.first_token = t
        if self._stamps_left:
            self._stamps_left -= 1
            r.chunk_times.append(t)
            r.chunk_tokens.append(n)
        else:
            r.output_truncated = True

    def _cut(self, text: str) -> None:
        """Keep what of ``text`` still fits under the answer cap."""
        part = self._fit(text)
        if part:
            self._text.append(part)

    def _fit(self, text: str) -> str:
        """What of ``text`` fits under the answer cap; a cut is recorded on the result."""
        room = self._room - len(text)
        if room >= 0:
            self._room = room
            return text
        self.r.output_truncated = True
        room, self._room = self._room, 0
        return text[:room]

    def _tool_fragment(self, frag: dict[str, Any]) -> bool:
        """Join one streamed tool-call fragment; whether it carried anything."""
        idx = frag.get("index", 0)
        if type(idx) is not int:
            raise TypeError(f"tool call index {idx!r} is not an integer")
        call = self._calls.get(idx)
        if call is None:
            if len(self._calls) >= MAX_TOOL_CALLS:
                self.r.output_truncated = True
                return False
            call = self._calls[idx] = ToolCall(index=idx)
        carried = False
        if frag.get("id"):
            call.id = str(frag["id"])[:200]
            carried = True
        fn = frag.get("function") or {}
        name, args = fn.get("name"), fn.get("arguments")
        if name:
            call.name += self._fit(name)
            carried = True
        if args:
            call.arguments += self._fit(args)
            carried = True
        return carried

    def finish(self, *, done: bool = True, head: bytes = b"") -> None:
        """Fill in the result; a stream that ended without ``[DONE]``, without content, or
        with usage no answer can have is the server's protocol error."""
        r = self.r
        r.done = self.now()
        r.output_text = "".join(self._text)
        r.tool_calls = [self._calls[i] for i in sorted(self._calls)]
        too_many = self._reported > _MAX_COUNT  # kept out of the result: no JSON integer
        if self._usage_seen:
            r.output_tokens = 0 if too_many else self._reported
        else:
            r.output_tokens = self._arrivals
            r.tokens_estimated = True
        r.chunk_tokens_estimated = self._estimated
        if r.status != "ok":  # the server already said what went wrong
            return
        if too_many:
            raise ProtocolError(f"impossible usage: completion_tokens {self._reported}")
        # An answer of no text is real when the server says it generated tokens and why it
        # stopped (a first token that was EOS); anything else without content is not one.
        empty = r.first_token is None and not (r.finish_reason and self._reported > 0)
        quoted = f"; the body starts: {head[:200]!r}" if empty and head else ""
        if not done:
            raise ProtocolError(
                "stream ended without [DONE]"
                + (" and without any content" if empty else "")
                + quoted
            )
        if empty:
            raise ProtocolError("stream ended without any content (no text, no tool call)" + quoted)
        if self._usage_seen and self._reported == 0 and r.first_token is not None:
            raise ProtocolError("impossible usage: completion_tokens 0 for an answer with content")


def _fail(result: Result, kind: Any, message: str) -> None:
    result.status = "error"
    result.error_kind = kind
    result.error = message
