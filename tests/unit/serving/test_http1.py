"""The client's HTTP/1.1 connections (replay/serving/http1.py) against a server that writes
exactly the bytes each test scripts: when a connection is reused and when it is not, bodies
framed every way HTTP/1.1 allows, and what arrives where nothing was asked.

Real vLLM servers are the evidence that the streaming path works (tests/test_vllm_*.py); this
server is for the framings and timings a real one cannot be made to produce on demand.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

import pytest

from replay.core.records import Result
from replay.serving import http1, kernel_stamps
from replay.serving.client import Client
from replay.traces.trace import Request
from tests.support.fault_server import Script, ScriptedServer

REQ = Request(id="r", api="completions", prompt="hello", max_tokens=4)
EVENT = (
    b'data: {"choices":[{"index":0,"text":"hi","finish_reason":null}],'
    b'"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}\n\n'
)
DONE = b"data: [DONE]\n\n"
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def send_all(url: str, n: int, timeout_s: float = 10.0, pause_s: float = 0.0) -> list[Result]:
    """``n`` requests one after another through one client."""

    async def go() -> list[Result]:
        client = Client(url, "m", timeout_s=timeout_s)
        try:
            out = []
            for i in range(n):
                out.append(await client.send(REQ, Result(f"r{i}", "t", "p", "b", 0.0)))
                await asyncio.sleep(pause_s)
            return out
        finally:
            await client.close()

    return asyncio.run(go())


def fixed(pieces: list[tuple[float, bytes]], close: bool) -> Script:
    """The same answer to every request."""
    return lambda _n: (pieces, close)


def stream(*, done_apart: float = 0.0, after_done: bytes = b"") -> Script:
    """A chunked event stream; the last chunk ``done_apart`` seconds after [DONE]."""
    head = SSE_HEAD + b"transfer-encoding: chunked\r\n\r\n"
    return lambda _n: (
        [(0, head + chunk(EVENT) + chunk(DONE) + after_done), (done_apart, b"0\r\n\r\n")],
        False,
    )


def test_a_connection_is_reused_when_the_last_chunk_comes_after_done() -> None:
    """uvicorn writes [DONE] and the body's last chunk apart: the answer is complete at
    [DONE] (its ``done`` stamped then), and once the last chunk is read the connection serves
    the next request."""
    with ScriptedServer(stream(done_apart=0.05)).running() as server:
        results = send_all(server.url, 3, pause_s=0.15)
    assert [r.status for r in results] == ["ok"] * 3, [r.error for r in results]
    assert server.connections == 1
    assert all(r.done is not None and r.first_token is not None for r in results)
    assert all(r.done - r.first_token < 0.04 for r in results)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("connection", "close", "opened"), [(b"", False, 1), (b"connection: close\r\n", True, 3)]
)
def test_a_whole_answer_in_one_read_reuses_its_connection_unless_told_not_to(
    connection: bytes, close: bool, opened: int
) -> None:
    """The usual case: the last token, [DONE] and the body's end in one write; the
    connection serves the next request, unless the answer said ``Connection: close``."""
    head = SSE_HEAD + connection + b"transfer-encoding: chunked\r\n\r\n"
    script = fixed([(0, head + chunk(EVENT) + chunk(DONE) + b"0\r\n\r\n")], close)
    with ScriptedServer(script).running() as server:
        results = send_all(server.url, 3)
    assert [r.status for r in results] == ["ok"] * 3, [r.error for r in results]
    assert server.connections == opened


def test_a_server_that_keeps_writing_after_done_loses_the_connection() -> None:
    """What follows [DONE] is read but bounded: past 64 KiB the connection is closed and the
    next request opens another."""
    junk = chunk(b": " + b"x" * (1 << 17) + b"\n\n")
    with ScriptedServer(stream(done_apart=0.2, after_done=junk)).running() as server:
        results = send_all(server.url, 2)
    assert [r.status for r in results] == ["ok", "ok"], [r.error for r in results]
    assert server.connections == 2


@pytest.mark.parametrize(("events", "status"), [(EVENT + DONE, "ok"), (EVENT, "error")])
def test_a_body_that_ends_with_the_connection(events: bytes, status: str) -> None:
    """No length and no chunks: the body is whatever comes until the server closes."""
    head = SSE_HEAD + b"connection: close\r\n\r\n"
    script = fixed([(0, head), (0.01, events)], True)
    with ScriptedServer(script).running() as server:
        (result,) = send_all(server.url, 1)
    assert result.status == status, result.error
    if status == "error":
        assert result.error_kind == "protocol"
        assert "stream ended without [DONE]" in (result.error or "")


def test_an_idle_connection_the_server_closed_is_not_used() -> None:
    """Servers close idle keep-alive connections (uvicorn after 5 s): the next request opens
    a new one instead of failing on the old."""
    head = SSE_HEAD + b"transfer-encoding: chunked\r\n\r\n"
    script = fixed([(0, head + chunk(EVENT) + chunk(DONE) + b"0\r\n\r\n")], True)
    with ScriptedServer(script).running() as server:
        results = send_all(server.url, 3, pause_s=0.05)
    assert [r.status for r in results] == ["ok"] * 3, [r.error for r in results]
    assert server.connections == 3


def test_bytes_on_an_idle_connection_close_it() -> None:
    """An answer longer than its Content-Length: the extra bytes arrive when nothing was
    asked, and the connection is dropped rather than read as the next answer."""
    body = b'{"error": {"message": "nope"}}'
    extra = b"HTTP/1.1 200 OK\r\n"
    head = b"HTTP/1.1 500 Oops\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    script = fixed([(0, head % len(body) + body), (0.02, extra)], False)
    with ScriptedServer(script).running() as server:
        results = send_all(server.url, 2, pause_s=0.1)
    assert [r.error_kind for r in results] == ["http", "http"], [r.error for r in results]
    assert all("nope" in (r.error or "") for r in results)
    assert server.connections == 2


def test_the_base_url_path_prefixes_every_request() -> None:
    with ScriptedServer(stream()).running() as server:
        (result,) = send_all(server.url + "/gateway/", 1)
    assert result.status == "ok", result.error
    assert server.paths == ["/gateway/v1/completions"]


def test_bytes_that_are_not_http_are_a_protocol_error() -> None:
    script = fixed([(0, b"SSH-2.0-OpenSSH_9.2\r\n\r\n")], True)
    with ScriptedServer(script).running() as server:
        (result,) = send_all(server.url, 1)
    assert (result.status, result.error_kind) == ("error", "protocol"), result.error
    assert "bad HTTP response" in (result.error or "")


def test_a_server_that_closes_before_answering_is_a_disconnect() -> None:
    script = fixed([], True)
    with ScriptedServer(script).running() as server:
        start = time.perf_counter()
        (result,) = send_all(server.url, 1)
    assert (result.status, result.error_kind) == ("error", "disconnect"), result.error
    assert "closed by the server" in (result.error or "")
    assert time.perf_counter() - start < 5


def test_a_connection_idle_longer_than_servers_keep_it_is_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """uvicorn closes a connection idle for 5 s; one reused just then would lose its request,
    so the pool gives up a connection idle over KEEP_IDLE_S and opens another."""
    monkeypatch.setattr(http1, "KEEP_IDLE_S", 0.05)
    with ScriptedServer(stream()).running() as server:
        quick = send_all(server.url, 2, pause_s=0.01)
        assert server.connections == 1
        slow = send_all(server.url, 2, pause_s=0.2)
    assert [r.status for r in quick + slow] == ["ok"] * 4
    assert server.connections == 3  # one for the quick pair, two for the slow one


def test_sent_is_stamped_before_the_kernel_has_the_request() -> None:
    """The write wakes the server, and on busy cores the scheduler may run it (and the whole
    answer) before the writer again; ``sent`` is therefore stamped before the write, so it
    can never fall after the server got the request. The kernel's receive time of each
    request (SO_TIMESTAMPNS, the wall clock, which the client is given too) is the judge."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setsockopt(
        socket.SOL_SOCKET, kernel_stamps.SO_TIMESTAMPNS, 1
    )  # accepted sockets inherit it
    listener.settimeout(10)
    arrivals: list[float] = []
    answer = SSE_HEAD + b"content-length: %d\r\n\r\n%s" % (len(EVENT + DONE), EVENT + DONE)

    failed: list[BaseException] = []

    def serve() -> None:
        try:
            conn, _ = listener.accept()
            conn.settimeout(10)
            with conn:
                for _ in range(20):
                    data, anc, _, _ = conn.recvmsg(1 << 16, 256)
                    sec, nsec = next(
                        struct.unpack("qq", raw[:16])
                        for level, kind, raw in anc
                        if level == socket.SOL_SOCKET and kind == kernel_stamps.SO_TIMESTAMPNS
                    )
                    arrivals.append(sec + nsec * 1e-9)
                    assert data.startswith(b"POST ") and data.endswith(b"}"), data  # one read
                    conn.sendall(answer)
        except BaseException as exc:  # the client then times out: say why
            failed.append(exc)
            raise

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    port = listener.getsockname()[1]

    async def go() -> list[Result]:
        client = Client(f"http://127.0.0.1:{port}", "m", clock=time.time, timeout_s=2)
        try:
            return [await client.send(REQ, Result(f"r{i}", "t", "p", "b", 0.0)) for i in range(20)]
        finally:
            await client.close()

    try:
        results = asyncio.run(go())
        thread.join(10)
    finally:
        listener.close()
    assert not failed and [r.status for r in results] == ["ok"] * 20, failed
    assert all(r.sent is not None and r.sent <= t for r, t in zip(results, arrivals, strict=True))


@pytest.mark.skipif(not kernel_stamps.AVAILABLE, reason="kernel receive stamps are Linux's")
def test_a_read_is_stamped_when_its_bytes_arrived_not_when_the_loop_got_to_it() -> None:
    """The client's loop is held for 300 ms while the first token arrives; its stamp is still
    when the server wrote it (the kernel's receive time), not when the loop read it."""
    head = SSE_HEAD + b"transfer-encoding: chunked\r\n\r\n"
    script = fixed([(0.05, head + chunk(EVENT)), (0.0, chunk(DONE) + b"0\r\n\r\n")], False)

    async def go() -> tuple[Result, float]:
        client = Client(server.url, "m", timeout_s=10)  # clock: perf_counter, as the server's
        try:
            task = asyncio.create_task(client.send(REQ, Result("r", "t", "p", "b", 0.0)))
            await asyncio.sleep(0.01)  # the request is written; its answer is 40 ms away
            held_until = time.perf_counter() + 0.3
            while time.perf_counter() < held_until:
                pass
            return await task, held_until
        finally:
            await client.close()

    with ScriptedServer(script).running() as server:
        result, held_until = asyncio.run(go())
    assert result.status == "ok" and result.first_token is not None
    assert server.written[0] < held_until - 0.2  # it arrived while the loop was held
    # The server stamps after its write returns; the kernel received the bytes inside it.
    assert server.written[0] - 0.005 <= result.first_token < server.written[0] + 0.02


@pytest.mark.skipif(not kernel_stamps.AVAILABLE, reason="kernel receive stamps are Linux's")
def test_a_kernel_without_receive_stamps_still_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where SO_TIMESTAMPNS is refused (an unknown option number here), reads carry no
    kernel stamp and are stamped as they run; nothing else changes."""
    monkeypatch.setattr(kernel_stamps, "SO_TIMESTAMPNS", 0x7FFF)
    with ScriptedServer(stream()).running() as server:
        results = send_all(server.url, 2)
    assert [r.status for r in results] == ["ok", "ok"]
    assert all(r.sent is not None and r.first_token is not None for r in results)
    assert all(r.first_token >= r.sent for r in results)  # type: ignore[operator]
