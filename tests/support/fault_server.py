"""An in-process OpenAI-compatible server that misbehaves on demand.

Only for faults a real vLLM server cannot be made to produce when a test wants them (a 500, a
429, malformed SSE, a stall, a reset, a trickle), and for what other OpenAI-compatible servers
and gateways do that vLLM does not (usage only at the end or never, redirects, error pages, an
event or a line without end). It is never the evidence that the real path works: that is what
the tests against real vLLM servers are for.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web

METRICS = (
    'vllm:cache_config_info{cache_dtype="fp8",block_size="16",'
    'kv_cache_size_tokens="2048",num_gpu_blocks="128"} 1.0\n'
    "vllm:kv_cache_usage_perc 0.0\nvllm:num_requests_running 0.0\n"
)


def _event(ev: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(ev)}\n\n".encode()


def _chunk(text: str, n: int) -> bytes:
    return _event(
        {
            "choices": [{"index": 0, "delta": {"content": text}, "token_ids": [5]}],
            "usage": {"prompt_tokens": 3, "completion_tokens": n},
        }
    )


PIECE = 1 << 16  # what the endless modes write at a time (nothing bigger is ever held)


class LoopbackServer:
    """An aiohttp app served from a thread of its own on a free loopback port: ``url`` once
    ``start()`` returns, and ``stop()`` always. Subclasses give ``_app()``."""

    url = ""

    def _app(self) -> web.Application:
        raise NotImplementedError

    def start(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        ready = threading.Event()

        async def boot() -> None:
            self._runner = web.AppRunner(
                self._app(), handler_cancellation=True, shutdown_timeout=1.0
            )
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", 0).start()
            self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
            ready.set()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(boot())
            self._loop.run_forever()

        threading.Thread(target=serve, daemon=True).start()
        if not ready.wait(10):
            raise RuntimeError(f"{type(self).__name__} did not start")

    def stop(self) -> None:
        async def down() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(down(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


class FaultServer(LoopbackServer):
    """``mode`` picks the fault; ``requests`` counts what reached the server.

    The usage modes (``usage_every``, ``usage_end``, ``usage_none``) stream ``chunks`` content
    chunks of ``per_chunk`` tokens, ``gap_s`` apart, as vLLM does (a role chunk first, then a
    content-less finish chunk with the EOS token, then a usage-only chunk), and keep the time
    each content chunk was written in ``stamps`` (``time.perf_counter``, the client's default
    clock), so a test compares the client's ITL with the server's own.

    The reasoning modes (``reasoning_every``, ``reasoning_end``, ``reasoning_none``: usage as
    above) stream as a reasoning model served with a reasoning parser does: ``thinking``
    chunks of reasoning (in ``delta.<field>``, ``reasoning`` as vLLM 0.32 names it or the
    older ``reasoning_content``), then ``chunks`` chunks of answer, every one ``gap_s``
    apart; with ``details`` the usage carries ``completion_tokens_details.reasoning_tokens``.
    ``thinking_only`` ends with ``finish_reason: length`` before any answer (a chain of
    thought cut by max_tokens). ``stamps`` as above, for every chunk of either kind.
    """

    def __init__(self, mode: str, **options: Any) -> None:
        self.mode = mode
        self.requests = 0
        self.thinking = int(options.pop("thinking", 10))
        self.field = str(options.pop("field", "reasoning"))
        self.details = bool(options.pop("details", True))
        self.thinking_only = bool(options.pop("thinking_only", False))
        self.chunks = int(options.pop("chunks", 40))
        self.per_chunk = int(options.pop("per_chunk", 1))
        self.gap_s = float(options.pop("gap_s", 0.005))
        # Timing for the systems rule's tests: the first chunk waits ``first_s``, and every
        # wait is scaled by exp(``jitter`` x a standard normal draw, from ``seed``) and by
        # ``load()``, the machine's load now (servers of one machine share it).
        self.first_s = float(options.pop("first_s", 0.0))
        self.jitter = float(options.pop("jitter", 0.0))
        self.load: Callable[[], float] | None = options.pop("load", None)
        self._rng = random.Random(int(options.pop("seed", 0)))
        self.size = int(options.pop("size", 50 << 20))
        if options:
            raise TypeError(f"unknown fault server options {sorted(options)}")
        self.stamps: list[float] = []
        self.elsewhere = 0  # requests that followed a redirect

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        raw = await request.read()
        mode = self.mode
        special = getattr(self, f"_mode_{mode}", None)
        if special is not None:
            response: web.StreamResponse = await special(request)
            return response
        if mode == "http500":
            return web.json_response({"error": {"message": "engine exploded"}}, status=500)
        if mode == "http429":
            return web.json_response(
                {"error": {"message": "slow down"}}, status=429, headers={"Retry-After": "7"}
            )
        if mode == "http400":
            return web.json_response(
                {"error": {"message": "maximum context length is 16"}}, status=400
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if mode == "reset":
            await resp.write(_chunk("a", 1))
            assert request.transport is not None
            request.transport.abort()  # connection reset mid-answer
            return resp
        if mode == "bad_json":
            await resp.write(_chunk("a", 1) + b"data: {not json\n\n")
        elif mode == "no_done":
            await resp.write(_chunk("a", 1) + _chunk("b", 2))
        elif mode == "split":
            body = _chunk("a", 1) + _chunk("bc", 3) + b"data: [DONE]\n\n"
            for i in range(0, len(body), 7):  # chunks split mid-line, still valid SSE
                await resp.write(body[i : i + 7])
                await asyncio.sleep(0.001)
        elif mode == "stall":
            await resp.write(_chunk("a", 1))
            await asyncio.sleep(30)
        elif mode == "trickle":
            # Slower than any client waits, within the tokens the request allows (a count past
            # its max_tokens is a protocol error of its own): then silence.
            allowed = json.loads(raw).get("max_tokens") or 200
            for n in range(1, allowed):
                await resp.write(_chunk("x", n))
                await asyncio.sleep(0.1)
            await asyncio.sleep(30)
        await resp.write_eof()
        return resp

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        return resp

    async def _usage_stream(self, request: web.Request, usage: str) -> web.StreamResponse:
        """``usage``: ``every`` chunk (continuous_usage_stats), only at the ``end``
        (include_usage alone), or ``none``."""
        resp = await self._sse(request)

        def ev(delta: dict[str, Any], done: int, finish: str | None = None) -> bytes:
            out: dict[str, Any] = {
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]
            }
            if usage == "every":
                out["usage"] = {"prompt_tokens": 3, "completion_tokens": done}
            return _event(out)

        await resp.write(ev({"role": "assistant", "content": ""}, 0))
        if self.first_s:
            await asyncio.sleep(self._wait(self.first_s))
        k = self.per_chunk
        for i in range(1, self.chunks + 1):
            await asyncio.sleep(self._wait(self.gap_s))
            self.stamps.append(time.perf_counter())
            await resp.write(ev({"content": "ab"[i % 2] * k}, i * k))
        total = self.chunks * k + 1  # and the EOS token, which has no text
        await resp.write(ev({"content": ""}, total, "stop"))
        if usage != "none":
            await resp.write(
                _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": total}})
            )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _wait(self, seconds: float) -> float:
        load = 1.0 if self.load is None else self.load()
        return seconds * math.exp(self.jitter * self._rng.gauss(0.0, 1.0)) * load

    async def _mode_usage_every(self, request: web.Request) -> web.StreamResponse:
        return await self._usage_stream(request, "every")

    async def _mode_usage_end(self, request: web.Request) -> web.StreamResponse:
        return await self._usage_stream(request, "end")

    async def _mode_usage_none(self, request: web.Request) -> web.StreamResponse:
        return await self._usage_stream(request, "none")

    async def _reasoning_stream(self, request: web.Request, usage: str) -> web.StreamResponse:
        resp = await self._sse(request)
        thinking = self.thinking

        def ev(delta: dict[str, Any], done: int, finish: str | None = None) -> bytes:
            out: dict[str, Any] = {
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]
            }
            if usage == "every":
                out["usage"] = self._reasoning_usage(done, min(done, thinking))
            return _event(out)

        await resp.write(ev({"role": "assistant", "content": ""}, 0))
        answer = 0 if self.thinking_only else self.chunks
        for i in range(1, thinking + answer + 1):
            await asyncio.sleep(self.gap_s)
            self.stamps.append(time.perf_counter())
            delta = {self.field: f"t{i} "} if i <= thinking else {"content": "ab"[i % 2]}
            last = self.thinking_only and i == thinking
            await resp.write(ev(delta, i, "length" if last else None))
        total = thinking + answer
        if not self.thinking_only:
            total += 1  # the EOS token
            await resp.write(ev({"content": ""}, total, "stop"))
        if usage != "none":
            last_usage = self._reasoning_usage(total, thinking)
            await resp.write(_event({"choices": [], "usage": last_usage}))
        return await self._written(resp, b"data: [DONE]\n\n")

    def _reasoning_usage(self, done: int, thinking: int) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_tokens": 3, "completion_tokens": done}
        if self.details:
            out["completion_tokens_details"] = {"reasoning_tokens": thinking}
        return out

    async def _mode_reasoning_every(self, request: web.Request) -> web.StreamResponse:
        return await self._reasoning_stream(request, "every")

    async def _mode_reasoning_end(self, request: web.Request) -> web.StreamResponse:
        return await self._reasoning_stream(request, "end")

    async def _mode_reasoning_none(self, request: web.Request) -> web.StreamResponse:
        return await self._reasoning_stream(request, "none")

    async def _written(self, resp: web.StreamResponse, body: bytes) -> web.StreamResponse:
        await resp.write(body)
        await resp.write_eof()
        return resp

    async def _mode_done_first(self, request: web.Request) -> web.StreamResponse:
        return await self._written(await self._sse(request), b"data: [DONE]\n\n")

    async def _mode_eos_first(self, request: web.Request) -> web.StreamResponse:
        """A real empty answer: the model's first token was EOS (vLLM streams it so)."""
        role = {
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 0},
        }
        stop = {
            "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
        }
        last = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
        return await self._written(
            await self._sse(request),
            _event(role) + _event(stop) + _event(last) + b"data: [DONE]\n\n",
        )

    async def _mode_negative_usage(self, request: web.Request) -> web.StreamResponse:
        return await self._written(await self._sse(request), _chunk("a", -25) + b"data: [DONE]\n\n")

    async def _mode_decreasing_usage(self, request: web.Request) -> web.StreamResponse:
        return await self._written(
            await self._sse(request),
            _chunk("a", 1) + _chunk("b", 3) + _chunk("c", 2) + b"data: [DONE]\n\n",
        )

    async def _mode_negative_prompt(self, request: web.Request) -> web.StreamResponse:
        ev = {
            "choices": [{"index": 0, "delta": {"content": "a"}}],
            "usage": {"prompt_tokens": -3, "completion_tokens": 1},
        }
        return await self._written(await self._sse(request), _event(ev) + b"data: [DONE]\n\n")

    async def _mode_huge_event(self, request: web.Request) -> web.StreamResponse:
        """One ``size``-byte event, sent a piece at a time."""
        resp = await self._sse(request)
        piece = b"a" * PIECE
        try:
            await resp.write(b'data: {"choices": [{"index": 0, "delta": {"content": "')
            for _ in range(self.size // PIECE):
                await resp.write(piece)
            await resp.write(b'"}}]}\n\ndata: [DONE]\n\n')
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client gave up on it: what the test wants
        return resp

    async def _mode_endless_line(self, request: web.Request) -> web.StreamResponse:
        resp = await self._sse(request)
        piece = b"a" * PIECE
        try:
            await resp.write(b'data: {"x": "')
            while True:
                await resp.write(piece)
        except (ConnectionError, RuntimeError):
            pass
        return resp

    async def _mode_big_answer(self, request: web.Request) -> web.StreamResponse:
        """``size`` characters of answer in 64 KiB content chunks, each event well-formed."""
        resp = await self._sse(request)
        text = "z" * PIECE
        n = max(self.size // PIECE, 1)
        for i in range(1, n + 1):
            await resp.write(_chunk(text, i))
        return await self._written(resp, b"data: [DONE]\n\n")

    async def _mode_redirect(self, request: web.Request) -> web.StreamResponse:
        # 307 keeps the method and body: a client that followed it would get a good answer
        # from somewhere that is not the target.
        raise web.HTTPTemporaryRedirect(location=f"{self.url}/elsewhere{request.path}")

    async def _elsewhere(self, request: web.Request) -> web.StreamResponse:
        self.elsewhere += 1
        await request.read()
        return await self._written(await self._sse(request), _chunk("a", 1) + b"data: [DONE]\n\n")

    async def _mode_html500(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            status=502,
            content_type="text/html",
            text="<html><body><h1>502 Bad Gateway</h1>nginx</body></html>",
        )

    async def _mode_detail404(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"detail": "Not Found"}, status=404)

    async def _mode_html200(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            content_type="text/html", text="<html><body>Please log in to the proxy</body></html>"
        )

    async def _mode_error200(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"error": {"message": "The model is overloaded", "type": "server_error"}}
        )

    async def _mode_vllm_error200(self, request: web.Request) -> web.StreamResponse:
        """The error object older vLLM versions send."""
        return web.json_response(
            {
                "object": "error",
                "message": "KV cache is full",
                "type": "InternalServerError",
                "code": 500,
            }
        )

    async def _mode_whole_json(self, request: web.Request) -> web.StreamResponse:
        """A server that ignored ``stream`` and sent the whole completion."""
        return web.json_response(
            {
                "choices": [{"index": 0, "text": "hello"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1},
            }
        )

    async def _get(self, request: web.Request) -> web.Response:
        path = request.path
        if path == "/v1/models":
            return web.json_response(
                {"data": [{"id": "fault", "root": "fault", "max_model_len": 4096}]}
            )
        if path == "/version":
            return web.json_response({"version": "fault-0"})
        return web.Response(text=METRICS)

    async def _tokenize(self, request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"tokens": list(range(10, 30)), "count": 20})

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_route("*", "/elsewhere/{tail:.*}", self._elsewhere)
        for path in ("/v1/models", "/version", "/metrics", "/health"):
            app.router.add_get(path, self._get)
        return app


# What the server does for the n-th request (0-based) on a connection: pieces to write, each
# after a pause in seconds, then whether to close the connection.
Script = Callable[[int], tuple[list[tuple[float, bytes]], bool]]


class ScriptedServer:
    """A loopback server of raw bytes in a thread of its own, for what an HTTP server library
    will not send (interim responses, bad heads, any framing): ``connections`` accepted,
    ``paths`` and ``bodies`` asked for, and when (perf_counter) each piece was written."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.paths: list[str] = []
        self.bodies: list[bytes] = []
        self.written: list[float] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.handlers: list[asyncio.Task[None]] = []
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        self.handlers.append(task)
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                self.paths.append(lines[0].split(" ")[1])
                length = next(
                    int(v)
                    for k, _, v in (ln.partition(":") for ln in lines[1:])
                    if k.lower() == "content-length"
                )
                self.bodies.append(await reader.readexactly(length))
                pieces, close = self.script(n)
                n += 1
                for pause, data in pieces:
                    if pause:
                        await asyncio.sleep(pause)
                    writer.write(data)
                    self.written.append(time.perf_counter())
                    await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @contextmanager
    def running(self) -> Iterator[ScriptedServer]:
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        holder: list[asyncio.Server] = []

        async def boot() -> None:
            server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            holder.append(server)
            self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            ready.set()

        thread = threading.Thread(
            target=lambda: (loop.run_until_complete(boot()), loop.run_forever()), daemon=True
        )
        thread.start()
        assert ready.wait(10)
        try:
            yield self
        finally:

            async def down() -> None:
                holder[0].close()
                for writer in self.writers:
                    writer.transport.abort()
                await asyncio.wait_for(asyncio.gather(*self.handlers), 5)

            asyncio.run_coroutine_threadsafe(down(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)


@contextmanager
def fault_server(mode: str, **options: Any) -> Iterator[FaultServer]:
    server = FaultServer(mode, **options)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def describe(summary: dict[str, Any], target: str) -> dict[str, int]:
    """errors_by_kind over every phase and bucket of a target."""
    out: dict[str, int] = {}
    for ph in summary["targets"][target]["phases"].values():
        for kind, n in ph["all"]["errors_by_kind"].items():
            out[kind] = out.get(kind, 0) + n
    return out
