"""HTTP/1.1 for the streaming POST: a pool of keep-alive connections, each an asyncio protocol
whose responses httptools parses (llhttp, the parser uvicorn runs) inside ``data_received``.

Why not aiohttp for this one request: at 256 streams its per-request machinery (URL, headers,
tracing, the response object) and its per-read path (the payload stream and the task that
reads it) were about half of the client's CPU (bench/README.md, "Where the time goes"), and a
burst of 256 sends held the loop long enough that the first tokens of the early requests
waited to be stamped. Here a request is one prebuilt head and one write, and each read is
stamped and handed to the response's ``Sink`` as it comes off the socket, before any task
runs. aiohttp still makes every other call (introspection, /metrics, /tokenize). Over plain
http on Linux a connection is a kernel-stamped socket (kernel_stamps.py): a read is stamped
with when its bytes arrived, not when this process got to read them.

What a response may hold, as RFC 9110/9112 allow it: interim 1xx responses (103 Early Hints,
100 Continue) before the final one are read and skipped; a body framed by Content-Length, by
chunks, or by the close of the connection (HTTP/1.0, or HTTP/1.1 without either); a
Content-Encoding of gzip or deflate, decoded (no Accept-Encoding is sent, but a proxy may
compress anyway), any other refused by name. The head is bounded (each line
``MAX_LINE_BYTES``, the whole ``MAX_HEAD_BYTES``, interim heads included). A connection never
gets out of step with its requests: bytes that arrive when no request waits, or a second
message after the answer's in the same read, close it, so no later request can be answered
with them.

Not done, on purpose: redirects (an answer must come from the target), proxies, HTTP/2,
retries (a POST is sent once).
"""

from __future__ import annotations

import asyncio
import ssl
import zlib
from collections.abc import Callable
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

from replay.core.credentials import redact
from replay.serving import kernel_stamps

# After an answer's [DONE], the rest of its HTTP message (the last chunk, often a read of its
# own) is read before the connection is reused; a server that keeps sending has this long and
# this many bytes, then the connection closes.
DRAIN_S = 5.0
DRAIN_BYTES = 1 << 16
# Servers close a keep-alive connection that sat idle (uvicorn, so vLLM, after 5 s). A request
# written on one just as the server closes it fails ("closed by the server") although the
# server never read it; so a connection idle longer than this is closed, not reused.
KEEP_IDLE_S = 2.0
# A response's head: each line (the status line, a header field) at most aiohttp's
# max_line_size and max_field_size, the whole head (interim responses' heads included) at
# most this; a server past either is refused, so an endless head costs neither memory nor CPU.
MAX_LINE_BYTES = 8190
MAX_HEAD_BYTES = 1 << 16
# A compressed body is inflated this much at a time, so one small read cannot become a
# large allocation (what it inflates to is bounded by the SSE decoder's own limits).
INFLATE_PIECE = 1 << 20


class Sink(Protocol):
    """Where one response goes, as it arrives. A method that raises ends the exchange with
    that error (the connection is closed)."""

    def head(self, status: int, headers: dict[str, str]) -> None: ...

    def body(self, data: bytes, arrived: float) -> bool:
        """One piece of the body; True once the answer is complete (no need to wait for the
        end of the message, which otherwise ends the exchange)."""
        ...


class ConnectError(OSError):
    """No connection to the target: ``os_error`` says why (refused, name lookup, ...)."""

    def __init__(self, host: str, port: int, os_error: OSError) -> None:
        super().__init__(os_error.errno, os_error.strerror)
        self.host, self.port, self.os_error = host, port, os_error


class ConnectTimeout(TimeoutError):
    """The TCP connect (and TLS handshake) got no answer in time."""


class Disconnected(ConnectionError):
    """The connection closed before the response's message ended."""


class BadResponse(Exception):
    """Bytes that are not an HTTP/1.1 response."""


class _Wire(Protocol):
    """What a connection writes to: the event loop's transport, or a kernel-stamped socket."""

    def write(self, data: bytes) -> None: ...

    def abort(self) -> None: ...

    def is_closing(self) -> bool: ...


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one exchange at a time."""

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool
        self.now = pool.now
        self.transport: _Wire | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.sink: Sink | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.names: list[bytes] = []
        self.values: list[bytes] = []
        self.arrived = 0.0
        self.until_eof = False  # the body ends when the connection does (no length, no chunks)
        self.in_message = False
        self.keep_alive = False  # the response's HTTP version and Connection header allow reuse
        self.drain: asyncio.TimerHandle | None = None
        self.drained = 0
        self.idle_since = 0.0  # the loop's time when it was last put back in the pool
        self.in_head = False  # the final response's head is not complete yet
        self.head_bytes = 0  # the heads' bytes in reads that ended inside a head
        self.line_bytes = 0  # the unfinished head line's bytes so far
        self.interim = False  # the message being parsed is a 1xx interim response
        self.inflate: zlib._Decompress | None = None  # a gzip or deflate body's decoder

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(_Wire, transport)

    def data_received(self, data: bytes) -> None:  # the transport's reads: stamped as they run
        self.received(data, self.now())

    def received(self, data: bytes, arrived: float) -> None:
        self.arrived = arrived
        if not self.in_message:  # bytes nobody asked for, on an idle connection
            self._close()
            return
        if self.drain is not None:
            self.drained += len(data)
            if self.drained > DRAIN_BYTES:
                self._close()
                return
        in_head = self.in_head
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            self._fail(exc.__context__ or exc)
            return
        except httptools.HttpParserError as exc:
            self._fail(BadResponse(f"bad HTTP response: {exc}"))
            return
        if in_head and self.in_head:  # the whole read was head: bound what it holds
            self._count_head(data)

    def _count_head(self, data: bytes) -> None:
        self.head_bytes += len(data)
        end = data.rfind(b"\n")
        self.line_bytes = len(data) - end - 1 if end >= 0 else self.line_bytes + len(data)
        if self.line_bytes > MAX_LINE_BYTES:
            self._fail(BadResponse(f"a response head line over {MAX_LINE_BYTES} bytes"))
        elif self.head_bytes > MAX_HEAD_BYTES:
            self._fail(BadResponse(f"a response head over {MAX_HEAD_BYTES} bytes"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.forget(self)
        if self.drain is not None:
            self.drain.cancel()
        if self.in_message and self.until_eof and exc is None and not self.in_head:
            try:
                self.on_message_complete()  # the close is the end of this body
            except BadResponse as bad:
                self._fail(bad)
        if self.in_message:
            self._fail(Disconnected(repr(exc) if exc is not None else "closed by the server"))

    # --- httptools callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        if not self.in_message:  # after the answer's message, in the same read: not ours
            raise BadResponse("bytes after the end of the response (a second response?)")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > MAX_LINE_BYTES:
            raise BadResponse(f"a response header line over {MAX_LINE_BYTES} bytes")
        self.names.append(name)
        self.values.append(value)

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            if status == 101:
                raise BadResponse("HTTP 101 Switching Protocols, but no upgrade was asked for")
            self.interim = True  # 100 Continue, 103 Early Hints: the answer is still to come
            self.names, self.values = [], []
            return
        self.in_head = False
        headers: dict[str, str] = {}
        for name, value in zip(self.names, self.values, strict=True):
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        codings = _codings(headers.get("transfer-encoding", ""))
        self.until_eof = "content-length" not in headers and "chunked" not in codings
        self.inflate = _inflater(headers.get("content-encoding", ""), codings)
        # Read now: once the message is complete the parser has moved on to the next one.
        self.keep_alive = self.parser.should_keep_alive()
        if self.sink is not None:
            self.sink.head(status, headers)

    def on_body(self, body: bytes) -> None:
        sink = self.sink
        if sink is None:
            return
        if self.inflate is not None:
            self._inflated(sink, body)
        elif sink.body(body, self.arrived):
            self._answered()

    def _inflated(self, sink: Sink, body: bytes) -> None:
        """Give the sink what a compressed piece of the body inflates to, a piece at a time."""
        inflate = self.inflate
        assert inflate is not None
        try:
            while body:
                out = inflate.decompress(body, INFLATE_PIECE)
                body = inflate.unconsumed_tail
                if out and sink.body(out, self.arrived):
                    self._answered()
                    return
        except zlib.error as exc:
            raise BadResponse(f"a Content-Encoding body that does not decode: {exc}") from None

    def _answered(self) -> None:
        self.sink = None  # what follows the complete answer is read, not kept
        self._settle(None)

    def on_message_complete(self) -> None:
        if self.interim:  # an interim response ends: its final response follows
            self.interim = False
            return
        self.in_message = False
        sink = self.sink
        if sink is not None:
            rest = self.inflate.flush() if self.inflate is not None else b""
            if not (rest and sink.body(rest, self.arrived)):
                self._settle(None)
            else:
                self._answered()
        if self.drain is not None:  # the answer was already complete: reuse the connection
            self.drain.cancel()
            self.drain = None
            self.pool.put_back(self)

    # --- the pool's side ------------------------------------------------------------------

    def start(self, sink: Sink) -> asyncio.Future[None]:
        self.sink = sink
        self.names, self.values = [], []
        self.in_message, self.keep_alive = True, False
        self.in_head, self.head_bytes, self.line_bytes = True, 0, 0
        self.interim, self.inflate = False, None
        self.waiter = asyncio.get_running_loop().create_future()
        return self.waiter

    def release(self) -> None:
        """The exchange is over for its sender: reuse the connection, let it read the rest of
        a message whose answer is complete, or close it."""
        waiter, self.waiter, self.sink = self.waiter, None, None
        answered = (
            waiter is not None
            and waiter.done()
            and not waiter.cancelled()
            and waiter.exception() is None
        )
        if not answered or not self.keep_alive:
            self._close()
        elif not self.in_message:
            self.pool.put_back(self)
        else:
            self.drained = 0
            self.drain = asyncio.get_running_loop().call_later(DRAIN_S, self._close)

    def _settle(self, exc: BaseException | None) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        if exc is None:
            waiter.set_result(None)
        else:
            waiter.set_exception(exc)

    def _fail(self, exc: BaseException) -> None:
        self.sink = None
        self._settle(exc)
        self._close()

    def _close(self) -> None:
        self.in_message = False
        self.pool.forget(self)  # now: never handed out again, even before connection_lost
        if self.transport is not None:
            self.transport.abort()


def _codings(transfer_encoding: str) -> list[str]:
    return [c.strip().lower() for c in transfer_encoding.split(",") if c.strip()]


def _inflater(content_encoding: str, transfer_codings: list[str]) -> zlib._Decompress | None:
    """A decoder for the body's Content-Encoding (gzip or deflate; None for none or identity);
    any other coding, of the content or of the transfer, is refused by name."""
    other = [c for c in transfer_codings if c not in ("chunked", "identity")]
    if other:
        raise BadResponse(
            f"Transfer-Encoding {', '.join(other)!r} is not decoded (only chunked is): the "
            "server or a proxy between sent a coding this client did not ask for"
        )
    codings = [c for c in _codings(content_encoding) if c != "identity"]
    if not codings:
        return None
    if len(codings) == 1 and codings[0] in ("gzip", "x-gzip", "deflate"):
        return zlib.decompressobj(32 + zlib.MAX_WBITS)  # a zlib or gzip header, either
    raise BadResponse(
        f"Content-Encoding {', '.join(codings)!r} is not decoded (gzip and deflate are): no "
        "Accept-Encoding was sent, so the server or a proxy between compressed on its own; "
        "turn compression off there"
    )


class ConnectionPool:
    """Keep-alive connections to one base URL (``http://`` or ``https://``); its path, if any,
    prefixes every request's, and its query follows it (a gateway's ``?api_key=...``).
    ``headers`` go on every request; credentials go there, not in user-info, which is
    refused."""

    def __init__(
        self,
        base_url: str,
        now: Callable[[], float],
        *,
        headers: dict[str, str],
        connect_timeout_s: float,
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"{redact(base_url)!r}: give an http:// or https:// URL with a host")
        if "@" in url.netloc:
            raise ValueError(
                f"{redact(base_url)!r}: user-info is not sent from the URL; pass it as an "
                "Authorization header (TargetSpec.auth_headers)"
            )
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self.prefix = url.path.rstrip("/")
        self.query = f"?{url.query}" if url.query else ""
        self.now = now
        self.connect_timeout_s = connect_timeout_s
        host = f"[{self.host}]" if ":" in self.host else self.host
        if url.port is not None:
            host = f"{host}:{url.port}"
        lines = {"Host": host, "User-Agent": "kvcanary", "Accept": "text/event-stream"}
        lines.update(headers)
        self._head = "".join(f"{k}: {v}\r\n" for k, v in lines.items()).encode("latin-1")
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()

    async def post(self, path: str, body: bytes, sink: Sink, sent: Callable[[], None]) -> None:
        """POST ``body`` (JSON) to ``path``, feed the response to ``sink`` until its answer is
        complete; ``sent()`` is called as the request is handed to the socket: after any wait
        for a connection, just before the write. Not after it: the write wakes the server, and
        on busy cores the scheduler may then run the server instead of us for the whole answer
        (measured: 50 ms on 2 cores serving vLLM), so a stamp taken after the write could
        fall after the answer's first token, even after its last."""
        conn = self._reusable() or await self._connect()
        waiter = conn.start(sink)
        assert conn.transport is not None
        request = (
            b"POST %s HTTP/1.1\r\n%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (
                (self.prefix + path + self.query).encode("latin-1"),
                self._head,
                len(body),
                body,
            )
        )
        sent()
        conn.transport.write(request)
        try:
            await waiter
        finally:
            conn.release()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                if self.ssl is None and kernel_stamps.AVAILABLE:
                    conn = _Connection(self)
                    sock = await kernel_stamps.connect(self.host, self.port)
                    conn.transport = kernel_stamps.StampedSocket(sock, conn)
                else:
                    _, conn = await loop.create_connection(
                        lambda: _Connection(self), self.host, self.port, ssl=self.ssl
                    )
        except TimeoutError:
            raise ConnectTimeout(
                f"no answer to the TCP connect to {self.host}:{self.port} within "
                f"{self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise ConnectError(self.host, self.port, exc) from exc
        self._open.add(conn)
        return conn

    def _reusable(self) -> _Connection | None:
        """The most recently used idle connection that is fresh enough (KEEP_IDLE_S) and
        still open."""
        now = asyncio.get_running_loop().time()
        while self._idle:
            conn = self._idle.pop()
            if (
                now - conn.idle_since <= KEEP_IDLE_S
                and conn.transport is not None
                and not conn.transport.is_closing()
            ):
                return conn
            conn._close()
        return None

    def put_back(self, conn: _Connection) -> None:
        if conn in self._open and conn.transport is not None and not conn.transport.is_closing():
            conn.idle_since = asyncio.get_running_loop().time()
            self._idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)

    def close(self) -> None:
        for conn in list(self._open):
            conn._close()
        self._idle.clear()
