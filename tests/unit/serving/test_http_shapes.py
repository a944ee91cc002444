"""Every shape of response RFC 9110/9112 and the SSE spec allow, and the malformed ones, each
named by what the server sends; and a property: however they follow one another on one
connection, no request is ever given another request's answer.

The server (``fault_server.ScriptedServer``) writes raw bytes, so it can send what an HTTP
server library will not: interim responses, heads without end, any framing. Each answer
echoes its own request's prompt, so an answer given to the wrong request shows.
"""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay.core.records import Result
from replay.serving import http1
from replay.serving.client import Client
from replay.traces.trace import Request
from tests.support.fault_server import ScriptedServer

SSE = b"content-type: text/event-stream\r\n"


def event(delta: dict[str, object], n: int, finish: str | None = None) -> bytes:
    ev = {
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        "usage": {"prompt_tokens": 2, "completion_tokens": n},
    }
    return b"data: " + orjson.dumps(ev) + b"\n\n"


def events(text: str) -> bytes:
    """An answer of ``text`` in two chunks, its finish, and [DONE]."""
    half = len(text) // 2
    return (
        event({"content": text[:half]}, 1)
        + event({"content": text[half:]}, 2)
        + event({"content": ""}, 3, "stop")
        + b"data: [DONE]\n\n"
    )


def _chunks(body: bytes, size: int = 15) -> bytes:
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def response(body: bytes, *, head: bytes = b"", version: bytes = b"1.1", framing: str) -> bytes:
    """A 200 event stream framed by ``length``, ``chunks`` or ``close``."""
    start = b"HTTP/%s 200 OK\r\n%s%s" % (version, SSE, head)
    if framing == "length":
        return start + b"content-length: %d\r\n\r\n%s" % (len(body), body)
    if framing == "chunks":
        return start + b"transfer-encoding: chunked\r\n\r\n" + _chunks(body)
    return start + b"\r\n" + body


@dataclass(frozen=True)
class Shape:
    """What the server sends for one request whose prompt is ``text``: the bytes (``send``),
    whether it closes the connection after them, and what the client must make of it: ``ok``
    (the answer is ``text``) or the error kind and words of its reason. ``cut`` splits the
    bytes into writes ``PAUSE_S`` apart (so into reads of their own) at these markers."""

    send: Callable[[str], bytes]
    close: bool = False
    kind: str = "ok"
    words: tuple[str, ...] = ()
    cut: tuple[bytes, ...] = (b"data: ",)

    def pieces(self, text: str) -> list[bytes]:
        """The writes: the bytes cut before every marker's first occurrence after the head."""
        data = self.send(text)
        out, start = [], 0
        for marker in self.cut:
            at = data.find(marker, start + 1)
            if at > 0:
                out.append(data[start:at])
                start = at
        return [*out, data[start:]]


PAUSE_S = 0.005


def _gzip(text: str) -> bytes:
    body = gzip.compress(events(text))
    return response(body, head=b"content-encoding: gzip\r\n", framing="chunks")


def _deflate(text: str) -> bytes:
    body = zlib.compress(events(text))
    return response(body, head=b"content-encoding: deflate\r\n", framing="length")


def _sse_line_ends(end: bytes) -> Callable[[str], bytes]:
    return lambda text: response(events(text).replace(b"\n", end), framing="chunks")


def _no_done(text: str) -> bytes:
    body = event({"content": text}, 1) + event({"content": ""}, 2, "length")
    return response(body, framing="chunks")


def _parts(text: str) -> bytes:
    parts = [
        {"type": "text", "text": text[:2]},
        {"type": "image_url"},
        {"type": "text", "text": text[2:]},
    ]
    body = event({"content": parts}, 1) + event({}, 2, "stop") + b"data: [DONE]\n\n"
    return response(body, framing="chunks")


SHAPES: dict[str, Shape] = {
    # Good answers, every framing and version.
    "a body of Content-Length": Shape(lambda t: response(events(t), framing="length")),
    "a chunked body": Shape(lambda t: response(events(t), framing="chunks")),
    "an HTTP/1.0 body that ends with the connection": Shape(
        lambda t: response(events(t), version=b"1.0", framing="close"), close=True
    ),
    "an HTTP/1.1 body without length that ends with the connection": Shape(
        lambda t: response(events(t), head=b"connection: close\r\n", framing="close"),
        close=True,
    ),
    "HTTP/1.0 keep-alive with a Content-Length": Shape(
        lambda t: response(
            events(t), version=b"1.0", head=b"connection: keep-alive\r\n", framing="length"
        )
    ),
    # Interim responses before the answer.
    "103 Early Hints, then the answer": Shape(
        lambda t: (
            b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n"
            + response(events(t), framing="chunks")
        ),
        cut=(b"HTTP/1.1 200", b"data: "),
    ),
    "100 Continue twice, then the answer": Shape(
        lambda t: b"HTTP/1.1 100 Continue\r\n\r\n" * 2 + response(events(t), framing="length"),
        cut=(b"HTTP/1.1 100", b"HTTP/1.1 200"),
    ),
    "a head split inside a header line": Shape(
        lambda t: response(events(t), head=b"x-trace: abcdef\r\n", framing="chunks"),
        cut=(b"cdef",),
    ),
    # Encodings.
    "a gzip body (Content-Encoding: gzip)": Shape(_gzip),
    "a deflate body (Content-Encoding: deflate)": Shape(_deflate),
    "a brotli body (Content-Encoding: br)": Shape(
        lambda t: response(b"\x1b\x03", head=b"content-encoding: br\r\n", framing="length"),
        kind="protocol",
        words=("Content-Encoding 'br' is not decoded",),
    ),
    # SSE line ends and stream shapes.
    "SSE lines ended by a bare CR": Shape(_sse_line_ends(b"\r")),
    "SSE lines ended by CRLF": Shape(_sse_line_ends(b"\r\n")),
    "a finish_reason and no [DONE]": Shape(_no_done),
    "delta.content as a list of content parts": Shape(_parts),
    # Malformed or failed.
    "an HTTP 500 with a JSON error": Shape(
        lambda t: (
            b"HTTP/1.1 500 Oops\r\ncontent-type: application/json\r\ncontent-length: 28"
            b'\r\n\r\n{"error": {"message": "no"}}'
        ),
        kind="http",
        words=("HTTP 500", "no"),
    ),
    "a 101 Switching Protocols nobody asked for": Shape(
        lambda t: b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n",
        close=True,
        kind="protocol",
        words=("101",),
    ),
    "a header line without end": Shape(
        lambda t: b"HTTP/1.1 200 OK\r\nx-long: " + b"a" * (3 * http1.MAX_LINE_BYTES),
        close=True,
        kind="protocol",
        words=(f"head line over {http1.MAX_LINE_BYTES} bytes",),
    ),
    "a head of endless short headers": Shape(
        lambda t: b"HTTP/1.1 200 OK\r\n" + b"x-a: b\r\n" * (http1.MAX_HEAD_BYTES // 4),
        close=True,
        kind="protocol",
        words=(f"head over {http1.MAX_HEAD_BYTES} bytes",),
    ),
    "an SSE event of bad JSON": Shape(
        lambda t: response(b"data: {not json\n\n", framing="chunks"),
        kind="protocol",
        words=("bad JSON",),
    ),
    "a stream cut off by the close, no finish_reason": Shape(
        lambda t: response(event({"content": t}, 1), framing="close"),
        close=True,
        kind="protocol",
        words=("without [DONE] and without a finish_reason",),
    ),
    "a chunked body cut off by the close": Shape(
        lambda t: response(events(t), framing="chunks")[:-40], close=True, kind="disconnect"
    ),
    "bytes that are not HTTP": Shape(
        lambda t: b"SSH-2.0-OpenSSH_9.2\r\n\r\n", close=True, kind="protocol", words=("bad HTTP",)
    ),
    "a second choice (index 1)": Shape(
        lambda t: response(
            b'data: {"choices": [{"index": 1, "delta": {"content": "x"}}]}\n\n', framing="chunks"
        ),
        kind="protocol",
        words=("index 1",),
    ),
    # An answer followed, in the same read, by bytes that are not part of it: the answer is
    # kept, and nothing after it may reach the next request. (Bytes that come in a later
    # read, after the next request was written, cannot be told from its answer: HTTP/1.1
    # says nothing of which request a response answers.)
    "the answer, then another whole response in the same write": Shape(
        lambda t: (
            response(events(t), framing="length") + response(events("stale " + t), framing="length")
        ),
        cut=(),
    ),
    "the answer, then bytes past its Content-Length": Shape(
        lambda t: response(events(t), framing="length") + b"HTTP/1.1 200 OK\r\n", cut=()
    ),
}


class Plan:
    """The server's answers: each request's prompt names its shape; the server sends it."""

    def __init__(self) -> None:
        self.server = ScriptedServer(self._script)

    def _script(self, _n: int) -> tuple[list[tuple[float, bytes]], bool]:
        prompt = orjson.loads(self.server.bodies[-1])["prompt"]
        shape = SHAPES[prompt.split("|")[0]]
        return [(PAUSE_S if i else 0.0, p) for i, p in enumerate(shape.pieces(prompt))], shape.close


@pytest.fixture(scope="module")
def plan() -> Iterator[Plan]:
    p = Plan()
    with p.server.running():
        yield p


def replay(url: str, names: list[str], tag: str) -> list[tuple[str, Result]]:
    """One request per shape, in order, through one client (one connection when the
    shapes allow it); each request's prompt is what its answer must echo."""

    async def go() -> list[tuple[str, Result]]:
        client = Client(url, "m", timeout_s=5.0)
        try:
            out = []
            for i, name in enumerate(names):
                prompt = f"{name}|{tag}-{i}"
                req = Request(id=f"r{i}", api="completions", prompt=prompt, max_tokens=8)
                out.append((prompt, await client.send(req, Result(f"r{i}", "t", "p", "b", 0.0))))
            return out
        finally:
            await client.close()

    return asyncio.run(go())


def check(prompt: str, result: Result) -> None:
    """The result is what its own shape must give, and never another request's answer."""
    shape = SHAPES[prompt.split("|")[0]]
    if shape.kind == "ok":
        assert result.status == "ok", (prompt, result.error)
        assert result.output_text == prompt
    else:
        assert (result.status, result.error_kind) == ("error", shape.kind), (prompt, result.error)
        for word in shape.words:
            assert word in (result.error or ""), (prompt, word, result.error)
        assert result.output_text in ("", prompt)


@pytest.mark.parametrize("name", list(SHAPES))
def test_each_shape_gives_its_outcome_and_leaves_the_connection_in_step(
    plan: Plan, name: str
) -> None:
    """The shape between two good answers on the same client: its own outcome, and the
    answer after it is the next request's own."""
    names = ["a chunked body", name, "a chunked body", name, "a body of Content-Length"]
    for prompt, result in replay(plan.server.url, names, f"each-{name}"):
        check(prompt, result)


def test_a_103_no_longer_shifts_every_later_answer_by_one(plan: Plan) -> None:
    """The old client took the 103 for the answer, then the real answer for the next
    request's: every request on that connection got the previous one's answer."""
    before = plan.server.connections
    names = ["103 Early Hints, then the answer"] * 4
    results = replay(plan.server.url, names, "early-hints")
    for prompt, result in results:
        check(prompt, result)
    assert plan.server.connections - before == 1  # all four on one connection


def test_a_deflate_body_may_be_raw_or_zlib_wrapped_only_as_zlib(plan: Plan) -> None:
    """RFC 9110's deflate is the zlib format; a raw deflate stream is refused, named."""
    raw = zlib.compressobj(wbits=-15)
    body = raw.compress(events("x")) + raw.flush()
    SHAPES["raw deflate"] = Shape(
        lambda t: response(body, head=b"content-encoding: deflate\r\n", framing="length"),
        kind="protocol",
        words=("does not decode",),
    )
    try:
        ((prompt, result),) = replay(plan.server.url, ["raw deflate"], "raw")
        check(prompt, result)
    finally:
        del SHAPES["raw deflate"]


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(st.sampled_from(sorted(SHAPES)), min_size=2, max_size=8), st.integers(0, 1 << 30))
def test_no_answer_is_ever_given_to_another_request(plan: Plan, names: list[str], tag: int) -> None:
    """Any sequence of shapes, good, interim, malformed or failed, on one client: each
    request's result is what its own shape gives, and an answer is only ever its own."""
    for prompt, result in replay(plan.server.url, names, f"p{tag}"):
        check(prompt, result)
