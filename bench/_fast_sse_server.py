"""A fast fake OpenAI-compatible streaming server that stamps its own send times.

Run by ``client_overhead.py`` as a separate process (so its CPU never counts against the
client under test), on a listening socket the parent already bound to 127.0.0.1 and passes
down as a file descriptor (no port race). Minimal HTTP/1.1 with keep-alive and chunked
responses, the shape uvicorn gives vLLM's streams:

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` only): sends
  ``max_tokens`` one-token chunks, token k due ``ttft + (k-1) * itl`` after the request was
  read (``--ttft-ms``, ``--itl-ms``; read = when the kernel received its last bytes, from
  SO_TIMESTAMPNS, on perf_counter's clock) and sent as soon as the event loop's millisecond timers
  allow; the schedule is absolute, so timer rounding does not add up. Every chunk carries ``usage``
  with the cumulative ``completion_tokens`` (as vLLM does with ``continuous_usage_stats``)
  and ``server_t``, its send time; then a usage-only chunk (``include_usage``) and
  ``data: [DONE]``.
* ``--burst``: as cheap per token as it gets, for benchmarks where the client must be the
  bottleneck: no timers, the whole answer (its chunks pre-encoded once per request body) in
  one write as soon as the request is read, no ``server_t`` and no stamps kept, and uvloop's
  own transport (no kernel stamps: nothing is timed).
* ``GET /v1/models``: one model, ``bench``, ``max_model_len`` 4096.
* ``POST /tokenize`` (vLLM's shape): ``{"tokens": [...], "count": n}``, one token per
  whitespace-separated word of the prompt or the messages' contents (``memory.py`` replays
  through kvcanary's CLI, which counts prompt tokens before it sends).
* ``GET /bench/stamps?prefix=P``: pops and returns the stamps of every finished stream whose
  id starts with P: ``{"streams": {id: {"recv": t, "sends": [t, ...]}}, "cpu_s": ...}``.
  A stream's id is the body's ``user`` field, else the ``x-request-id`` header (what
  ``vllm bench serve`` sends), else ``anon-N``.

Times are ``time.perf_counter()``, which on Linux is CLOCK_MONOTONIC, one clock for every
process on the machine, so the client's arrival times compare directly with these stamps.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import resource
import signal
import socket
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

import orjson

from replay.serving import kernel_stamps

MAX_MODEL_LEN = 4096
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_KEPT_STREAMS = 200_000  # stamps kept until fetched; beyond this the server refuses work
MODELS = orjson.dumps(
    {
        "object": "list",
        "data": [
            {
                "id": "bench",
                "object": "model",
                "root": "bench",
                "owned_by": "kvcanary-bench",
                "max_model_len": MAX_MODEL_LEN,
            }
        ],
    }
)
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)
STAMPS: dict[str, tuple[float, list[float]]] = {}
# --burst: whole requests (head and body, as read) already answered, and their answers: a
# replay of the bench's trace sends the same bytes every time, so most are not parsed at all.
BURST_REPLIES: dict[bytes, bytes] = {}


def _chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _response(status: int, body: bytes, ctype: bytes = b"application/json") -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 503: b"Busy"}[status]
    return b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        reason,
        ctype,
        len(body),
        body,
    )


class _Stream:
    """One streamed answer: pre-rendered JSON around the two numbers that change per chunk."""

    __slots__ = (
        "due",
        "head",
        "k",
        "n",
        "prompt",
        "proto",
        "recv",
        "sends",
        "sid",
        "tail",
        "timer",
        "usage_only",
    )

    def __init__(self, proto: ServerProtocol, sid: str, body: dict[str, Any], chat: bool) -> None:
        self.proto, self.sid = proto, sid
        self.n = max(1, min(int(body.get("max_tokens") or 16), MAX_MODEL_LEN))
        self.k = 0
        self.prompt = _prompt_tokens(body)
        if chat:
            obj, choice = b"chat.completion.chunk", b'"delta":{"role":"assistant","content":" tok"}'
        else:
            obj, choice = b"text_completion", b'"text":" tok","logprobs":null'
        envelope = b'{"id":%s,"object":"%s","created":%d,"model":"bench","choices":[' % (
            orjson.dumps(f"cmpl-{sid}"),
            obj,
            int(time.time()),
        )
        self.head = envelope + b'{"index":0,%s,"finish_reason":' % choice
        self.tail = envelope + b"],"
        opts = body.get("stream_options") or {}
        self.usage_only = bool(opts.get("include_usage"))
        self.recv = proto.read_at
        self.due = self.recv + proto.ttft_s
        self.sends: list[float] = []
        self.timer: asyncio.TimerHandle | None = None

    def usage(self, k: int) -> bytes:
        return b'"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}' % (
            self.prompt,
            self.prompt + k,
            k,
        )

    def emit(self) -> None:
        """Send the next token (stamped), then schedule the one after or finish."""
        self.k += 1
        last = self.k == self.n
        t = time.perf_counter()
        event = b'data: %s%s,"stop_reason":null}],%s,"server_t":%s}\n\n' % (
            self.head,
            b'"length"' if last else b"null",
            self.usage(self.k),
            repr(t).encode(),
        )
        out = _chunked(event)
        if last:
            if self.usage_only:
                out += _chunked(b"data: %s%s}\n\n" % (self.tail, self.usage(self.k)))
            out += _chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        self.proto.transport.write(out)
        self.sends.append(t)
        if last:
            self.timer = None
            self.proto.stream_done(self)
        else:
            self.due += self.proto.itl_s
            self.timer = self.proto.loop.call_later(max(0.0, self.due - t), self.emit)


def _prompt_tokens(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    if isinstance(prompt, str):
        return max(1, len(prompt.split()))
    msgs = body.get("messages") or []
    return max(1, sum(len(str(m.get("content", "")).split()) for m in msgs))


@functools.lru_cache(maxsize=64)
def burst_answer(n: int, chat: bool, usage_only: bool) -> bytes:
    """The response head and all ``n`` chunks of an answer, encoded once per shape."""
    if chat:
        obj, choice = b"chat.completion.chunk", b'"delta":{"role":"assistant","content":" tok"}'
    else:
        obj, choice = b"text_completion", b'"text":" tok","logprobs":null'
    envelope = b'{"id":"cmpl-bench","object":"%s","created":0,"model":"bench","choices":[' % obj
    out = [SSE_HEAD]
    for k in range(1, n + 1):
        usage = b'"usage":{"prompt_tokens":1,"total_tokens":%d,"completion_tokens":%d}' % (1 + k, k)
        finish = b'"length"' if k == n else b"null"
        event = b'{"index":0,%s,"finish_reason":%s,"stop_reason":null}],%s}' % (
            choice,
            finish,
            usage,
        )
        out.append(_chunked(b"data: %s%s\n\n" % (envelope, event)))
    if usage_only:
        usage = b'"usage":{"prompt_tokens":1,"total_tokens":%d,"completion_tokens":%d}' % (1 + n, n)
        out.append(_chunked(b"data: %s],%s}\n\n" % (envelope, usage)))
    out.append(_chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    return b"".join(out)


@functools.lru_cache(maxsize=64)
def burst_answer_for(raw: bytes, chat: bool) -> bytes | None:
    """--burst's answer to a body seen before (a replay sends the same body for every
    request of a trace like the bench's): no JSON parse per request. None: not an answer."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict) or body.get("stream") is not True:
        return None
    n = max(1, min(int(body.get("max_tokens") or 16), MAX_MODEL_LEN))
    return burst_answer(n, chat, bool((body.get("stream_options") or {}).get("include_usage")))


class ServerProtocol(asyncio.Protocol):
    """HTTP/1.1, one request at a time per connection (aiohttp does not pipeline)."""

    ttft_s = 0.020
    itl_s = 0.005
    burst = False
    anon = 0

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport
        self.buf = b""
        self.stream: _Stream | None = None
        self.read_at = 0.0  # when the kernel received the last read's bytes
        self.burst_reply: bytes | None = None  # --burst: the answer the last request got

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket") if hasattr(transport, "get_extra_info") else None
        if sock is not None:  # uvloop's transport (--burst); the stamped socket sets its own
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.stream is not None and self.stream.timer is not None:
            self.stream.timer.cancel()
        self.stream = None

    # A kernel-stamped socket's reads (replay/serving/kernel_stamps.py): a request's arrival
    # is when the kernel received its bytes, not when this process's loop got round to it (at
    # 256 streams the loop is busy a third of the time writing chunks, and a request read
    # behind that work would count as the client's request leg).
    now = staticmethod(time.perf_counter)

    def received(self, data: bytes, arrived: float) -> None:
        self.data_received(data, arrived)

    def data_received(self, data: bytes, read_at: float | None = None) -> None:
        # read_at: the kernel's receive stamp; uvloop's transport, which --burst uses because
        # no time is measured there, gives none.
        self.read_at = time.perf_counter() if read_at is None else read_at
        if self.burst and not self.buf and (answer := BURST_REPLIES.get(data)) is not None:
            self.transport.write(answer)  # a request seen before, byte for byte
            return
        self.buf += data
        if len(self.buf) > MAX_HEADER_BYTES + MAX_BODY_BYTES:
            self.transport.close()
            return
        self._next_request()

    def stream_done(self, stream: _Stream) -> None:
        STAMPS[stream.sid] = (stream.recv, stream.sends)
        self.stream = None
        self._next_request()

    def _next_request(self) -> None:
        if self.stream is not None:
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_HEADER_BYTES:
                self.transport.close()
            return
        lines = self.buf[:end].decode("latin-1").split("\r\n")
        fields = (ln.partition(":") for ln in lines[1:])
        headers = {k.strip().lower(): v.strip() for k, _, v in fields}
        length = headers.get("content-length", "0")
        size = int(length) if length.isdigit() else MAX_BODY_BYTES + 1
        if "chunked" in headers.get("transfer-encoding", "") or size > MAX_BODY_BYTES:
            self.transport.write(_response(400, b'{"error":"unsupported request body"}'))
            self.transport.close()
            return
        if len(self.buf) < end + 4 + size:
            return
        whole = self.buf[: end + 4 + size]
        body, self.buf = self.buf[end + 4 : end + 4 + size], self.buf[end + 4 + size :]
        method, _, rest = lines[0].partition(" ")
        self.burst_reply = None
        self._route(method, rest.rpartition(" ")[0], headers, body)
        if self.burst_reply is not None and len(BURST_REPLIES) < 64:
            BURST_REPLIES[whole] = self.burst_reply

    def _route(self, method: str, target: str, headers: dict[str, str], body: bytes) -> None:
        url = urlsplit(target)
        if method == "GET" and url.path == "/v1/models":
            self.transport.write(_response(200, MODELS))
        elif method == "GET" and url.path == "/health":
            self.transport.write(_response(200, b"{}"))
        elif method == "GET" and url.path == "/bench/stamps":
            prefix = parse_qs(url.query).get("prefix", [""])[0]
            self.transport.write(_response(200, _pop_stamps(prefix)))
        elif method == "POST" and url.path in ("/v1/completions", "/v1/chat/completions"):
            self._start(headers, body, chat=url.path.endswith("chat/completions"))
        elif method == "POST" and url.path == "/tokenize":
            self._tokenize(body)
        else:
            self.transport.write(_response(404, b'{"error":"not found"}'))
        if self.stream is None and self.buf:
            self._next_request()

    def _tokenize(self, raw: bytes) -> None:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            self.transport.write(_response(400, b'{"error":"body is not JSON"}'))
            return
        n = _prompt_tokens(body) if isinstance(body, dict) else 0
        self.transport.write(
            _response(
                200,
                orjson.dumps(
                    {"tokens": list(range(n)), "count": n, "max_model_len": MAX_MODEL_LEN}
                ),
            )
        )

    def _start(self, headers: dict[str, str], raw: bytes, chat: bool) -> None:
        if self.burst and (answer := burst_answer_for(raw, chat)) is not None:
            self.transport.write(answer)
            self.burst_reply = answer
            return
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            self.transport.write(_response(400, b'{"error":"body is not JSON"}'))
            return
        if not isinstance(body, dict) or body.get("stream") is not True:
            self.transport.write(_response(400, b'{"error":"only stream=true is served"}'))
            return
        if self.burst:
            n = max(1, min(int(body.get("max_tokens") or 16), MAX_MODEL_LEN))
            usage_only = bool((body.get("stream_options") or {}).get("include_usage"))
            self.transport.write(burst_answer(n, chat, usage_only))
            return
        if len(STAMPS) >= MAX_KEPT_STREAMS:
            self.transport.write(_response(503, b'{"error":"stamps not fetched"}'))
            return
        sid = body.get("user") or headers.get("x-request-id")
        if not isinstance(sid, str) or not sid:
            ServerProtocol.anon += 1
            sid = f"anon-{ServerProtocol.anon}"
        self.stream = _Stream(self, sid, body, chat)
        self.transport.write(SSE_HEAD)
        wait = self.stream.due - time.perf_counter()
        self.stream.timer = self.loop.call_later(max(0.0, wait), self.stream.emit)


def _pop_stamps(prefix: str) -> bytes:
    keys = [k for k in STAMPS if k.startswith(prefix)]
    streams = {k: {"recv": STAMPS[k][0], "sends": STAMPS.pop(k)[1]} for k in keys}
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return orjson.dumps({"streams": streams, "cpu_s": ru.ru_utime + ru.ru_stime})


async def _serve(fd: int) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    listener = socket.socket(fileno=fd)
    if ServerProtocol.burst:
        server = await loop.create_server(ServerProtocol, sock=listener, backlog=1024)
        try:
            await stop.wait()
        finally:
            server.close()
        return
    listener.setblocking(False)
    # On the listener, so that accepted sockets have it before their first bytes arrive.
    listener.setsockopt(socket.SOL_SOCKET, kernel_stamps.SO_TIMESTAMPNS, 1)
    listener.listen(1024)

    def accept() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            proto = ServerProtocol()
            proto.connection_made(kernel_stamps.StampedSocket(sock, proto))  # type: ignore[arg-type]

    loop.add_reader(listener.fileno(), accept)
    try:
        await stop.wait()
    finally:
        loop.remove_reader(listener.fileno())
        listener.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fd", type=int, required=True, help="listening socket, already bound")
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--itl-ms", type=float, default=5.0)
    ap.add_argument("--burst", action="store_true", help="whole answer at once, pre-encoded")
    args = ap.parse_args()
    ServerProtocol.burst = args.burst
    ServerProtocol.ttft_s, ServerProtocol.itl_s = args.ttft_ms / 1e3, args.itl_ms / 1e3
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(args.fd))
    else:
        uvloop.run(_serve(args.fd))


if __name__ == "__main__":
    main()
