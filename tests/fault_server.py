"""An in-process OpenAI-compatible server that misbehaves on demand.

Only for faults a real vLLM server cannot be made to produce when a test wants them (a 500, a
429, malformed SSE, a stall, a reset, a trickle). It is never the evidence that the real path
works: that is what the tests against real vLLM servers are for.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web

METRICS = ('vllm:cache_config_info{cache_dtype="fp8",block_size="16",'
           'kv_cache_size_tokens="2048",num_gpu_blocks="128"} 1.0\n'
           "vllm:kv_cache_usage_perc 0.0\nvllm:num_requests_running 0.0\n")


def _chunk(text: str, n: int) -> bytes:
    ev = {"choices": [{"index": 0, "delta": {"content": text}, "token_ids": [5]}],
          "usage": {"prompt_tokens": 3, "completion_tokens": n}}
    return f"data: {json.dumps(ev)}\n\n".encode()


class FaultServer:
    """``mode`` picks the fault; ``requests`` counts what reached the server."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.requests = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        await request.read()
        mode = self.mode
        if mode == "http500":
            return web.json_response({"error": {"message": "engine exploded"}}, status=500)
        if mode == "http429":
            return web.json_response({"error": {"message": "slow down"}}, status=429,
                                     headers={"Retry-After": "7"})
        if mode == "http400":
            return web.json_response({"error": {"message": "maximum context length is 16"}},
                                     status=400)
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
                await resp.write(body[i:i + 7])
                await asyncio.sleep(0.001)
        elif mode == "stall":
            await resp.write(_chunk("a", 1))
            await asyncio.sleep(30)
        elif mode == "trickle":
            for n in range(1, 200):
                await resp.write(_chunk("x", n))
                await asyncio.sleep(0.1)
        await resp.write_eof()
        return resp

    async def _get(self, request: web.Request) -> web.Response:
        path = request.path
        if path == "/v1/models":
            return web.json_response({"data": [{"id": "fault", "root": "fault",
                                                "max_model_len": 4096}]})
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
        for path in ("/v1/models", "/version", "/metrics", "/health"):
            app.router.add_get(path, self._get)
        return app

    def start(self) -> None:
        ready = threading.Event()

        async def boot() -> None:
            self._runner = web.AppRunner(self._app(), handler_cancellation=True,
                                         shutdown_timeout=1.0)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            port = self._runner.addresses[0][1]
            self.url = f"http://127.0.0.1:{port}"
            ready.set()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(boot())
            self._loop.run_forever()

        threading.Thread(target=serve, daemon=True).start()
        if not ready.wait(10):
            raise RuntimeError("fault server did not start")

    def stop(self) -> None:
        async def down() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(down(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


@contextmanager
def fault_server(mode: str) -> Iterator[FaultServer]:
    server = FaultServer(mode)
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
