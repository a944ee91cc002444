"""Streaming client for OpenAI-compatible servers (vLLM): one connection pool per target.

Builds each request's body, sends it over ``http1.ConnectionPool`` and folds the event stream
into a ``Result`` as it comes off the socket (``_Answer``: the SSE decoder and
``accumulator.StreamAccumulator``, run inside the connection's ``data_received``, so every
read is stamped when it arrived, not when a task got round to it). Every outcome becomes a
``Result``: HTTP errors keep their status, content type and the server's own message
(``error_answers``), timeouts and disconnects their kind, a refused connection its OS error.
Only our own bugs raise. Redirects are not followed: an answer must come from the target.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from replay.core.credentials import redact, request_secrets
from replay.core.records import Result
from replay.serving.accumulator import MAX_ANSWER_CHARS, StreamAccumulator
from replay.serving.endpoints import connect_reason
from replay.serving.error_answers import (
    ERROR_BODY_BYTES,
    content_type,
    fail,
    http_error,
    not_a_stream,
)
from replay.serving.http1 import (
    BadResponse,
    ConnectError,
    ConnectionPool,
    ConnectTimeout,
    Disconnected,
)
from replay.serving.sse import DONE, MAX_EVENT_BYTES, NOT_ONE, ProtocolError, SSEDecoder
from replay.traces.trace import Request

# Monotonic seconds that stamp a result: ``time.perf_counter`` (less ``epoch``), or the run's
# clock's bound ``now`` (``replay.core.schedule.Clock``).
TimeSource = Callable[[], float]
_CONNECT_TIMEOUT_S = 30.0


class _Answer:
    """One response, folded as it arrives (an ``http1.Sink``): an event stream into the
    result, anything else kept (its start) to say what the server sent instead."""

    __slots__ = (
        "acc",
        "decoder",
        "done_at",
        "first",
        "headers",
        "kept",
        "kept_bytes",
        "status",
        "streaming",
    )

    def __init__(self, acc: StreamAccumulator, decoder: SSEDecoder) -> None:
        self.acc, self.decoder = acc, decoder
        self.status = 0
        self.headers: dict[str, str] = {}
        self.streaming = False
        self.first: bytes | None = None  # kept to quote when the stream has no content
        self.kept: list[bytes] = []  # the start of a body that is not the stream
        self.kept_bytes = 0
        self.done_at: float | None = None  # when [DONE] arrived

    def head(self, status: int, headers: dict[str, str]) -> None:
        self.status, self.headers = status, headers
        self.acc.r.http_status = status
        self.streaming = status == 200 and content_type(headers) == "text/event-stream"

    def body(self, data: bytes, arrived: float) -> bool:
        if not self.streaming:
            room = ERROR_BODY_BYTES - self.kept_bytes
            self.kept.append(data[:room])
            self.kept_bytes += min(len(data), room)
            return len(data) >= room
        if self.first is None:
            self.first = data
        event = self.decoder.feed_one(data)  # the usual read: one whole event
        if event is not NOT_ONE:
            self.acc.add(event, arrived)
            return False
        for event in self.decoder.feed_rest(data):
            if event is DONE:
                self.done_at = arrived
                return True
            self.acc.add(event, arrived)
        return False

    def conclude(self, result: Result) -> None:
        """Once the exchange is over: the result of what came."""
        if self.status != 200:
            http_error(self.status, self.headers, b"".join(self.kept), result)
        elif not self.streaming:
            not_a_stream(self.headers, b"".join(self.kept), result)
        elif self.done_at is not None:
            self.acc.finish(head=self.first or b"", at=self.done_at)
        else:
            for event in self.decoder.close():
                if event is DONE:
                    self.acc.finish(head=self.first or b"")
                    return
                self.acc.add(event)
            self.acc.finish(done=False, head=self.first or b"")

    def lost(self) -> bool:
        """The exchange ended early (a lost connection, the time limit): whether the answer was
        over already (its finish reason, or the server's error, had come), and if so its
        result is made. What the decoder holds came after that end, cut anywhere: it is not
        read."""
        if not (self.streaming and self.acc.ended):
            return False
        self.acc.finish(done=False, head=self.first or b"")
        return True


class Client:
    """Sends requests to one target and records what happened.

    ``headers``: the target's credentials (``TargetSpec.auth_headers``), on every request;
    an error recorded never holds them, nor the URL's query values.

    ``max_event_bytes`` bounds one SSE line or event (a larger one is that request's
    ``protocol`` error); ``max_answer_chars`` bounds the answer text a result keeps.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 600.0,
        seed: int = 0,
        clock: TimeSource = time.perf_counter,
        epoch: float = 0.0,
        max_event_bytes: int = MAX_EVENT_BYTES,
        max_answer_chars: int = MAX_ANSWER_CHARS,
        token_logprobs: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_event_bytes = max_event_bytes
        self.max_answer_chars = max_answer_chars
        # Ask for each output token's log-probability (teacher-forced scoring reads them).
        self.token_logprobs = token_logprobs
        self.model = model
        self.seed = seed
        self.timeout_s = timeout_s
        self._clock = clock
        self._epoch = epoch
        # What a server echoing the request could put into an error (written to results).
        self._secrets = request_secrets(self.base_url, headers or {})
        self._pool = ConnectionPool(
            self.base_url,
            self.now,
            headers=dict(headers or {}),
            connect_timeout_s=_CONNECT_TIMEOUT_S,
        )

    async def close(self) -> None:
        self._pool.close()

    def now(self) -> float:
        return self._clock() - self._epoch

    def payload(
        self, req: Request, prompt_ids: Sequence[int] | None = None, cache_salt: str | None = None
    ) -> tuple[str, dict[str, Any]]:
        """The endpoint and JSON body for a request (deterministic sampling by default).
        ``cache_salt`` isolates vLLM's prefix cache (requests share only within one salt)."""
        # The record's params replace the sampling defaults (a logged temperature); what the
        # record and the replay set themselves comes after them, so no param overrides it
        # (the trace refuses one that tries: ``replay.traces.trace.FIRST_CLASS``).
        body: dict[str, Any] = {
            "temperature": 0.0,
            "seed": self.seed,
            **req.params,
            "model": self.model,
            "max_tokens": req.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "return_token_ids": True,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        chat = req.api == "chat"
        if self.token_logprobs:
            # The sampled token's own log-probability only: no alternatives, little to send.
            body.update({"logprobs": True, "top_logprobs": 0} if chat else {"logprobs": 0})
        if chat:
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
        answer = _Answer(
            StreamAccumulator(
                result, self.now, self.max_answer_chars, max_tokens=body.get("max_tokens")
            ),
            SSEDecoder(self.max_event_bytes),
        )
        try:
            # asyncio.timeout, not wait_for: no extra task, so the request starts in this
            # loop iteration instead of queueing behind every ready callback (measured in
            # bench/: wait_for added ~2-4 ms to TTFT at 64 concurrent starts).
            async with asyncio.timeout(self.timeout_s):
                await self._stream(path, body, result, answer)
        except ConnectTimeout as exc:  # before TimeoutError: it is one
            fail(result, "connect", f"cannot connect to {self.base_url}: {exc}")
        except TimeoutError:
            # A server that sent its finish reason and then held the connection open (no
            # [DONE], no close) answered in full: the answer is kept, as after a reset.
            if not answer.lost():
                fail(result, "timeout", f"no complete answer within {self.timeout_s:g} s")
        except ConnectError as exc:
            fail(result, "connect", connect_reason(exc))
        except (Disconnected, OSError) as exc:
            fail(result, "disconnect", f"connection lost mid-answer: {exc}")
        except (ProtocolError, BadResponse) as exc:
            fail(result, "protocol", str(exc))
        except asyncio.CancelledError:
            fail(result, "cancelled", "cancelled before the answer completed")
            result.status = "cancelled"
            raise
        finally:
            if result.done is None:
                result.done = self.now()
            if result.error is not None:
                result.error = redact(result.error, self._secrets)
        return result

    async def _stream(
        self, path: str, body: dict[str, Any], result: Result, answer: _Answer
    ) -> None:
        data = orjson.dumps(body)
        result.sent = self.now()  # until the request is written (a failed connect keeps this)

        def writing() -> None:
            result.sent = self.now()

        try:
            await self._pool.post(path, data, answer, writing)
        except (Disconnected, OSError):
            # A finish reason is the model's word that its answer is complete: a connection
            # lost after it (a reset where [DONE] or a clean close belonged) is no error of
            # the answer, which keeps its text.
            if not answer.lost():
                raise
            return
        answer.conclude(result)
