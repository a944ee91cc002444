"""Server-sent events as OpenAI-compatible servers stream them.

Incremental: feed it bytes as they arrive (chunks may split a line anywhere) and it yields
the JSON payload of each complete ``data:`` event. ``[DONE]`` ends the stream. A payload that
is not JSON is a ``ProtocolError`` for that request, not a crash.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

DONE = object()


class ProtocolError(Exception):
    """The server sent something that is not the SSE it promised (recorded as a result)."""


class SSEDecoder:
    """Split a byte stream into events; multi-line ``data:`` fields are joined with newlines."""

    __slots__ = ("_buf", "_data")

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> Iterator[Any]:
        buf = self._buf + chunk if self._buf else chunk
        start = 0
        while True:
            end = buf.find(b"\n", start)
            if end < 0:
                break
            line = buf[start:end]
            start = end + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                yield from self._dispatch()
            elif line.startswith(b"data:"):
                self._data.append(line[6:] if line[5:6] == b" " else line[5:])
            # comments (":") and other fields (event, id, retry) carry nothing we use
        self._buf = buf[start:]

    def close(self) -> Iterator[Any]:
        """End of body: a last event without its blank line still counts."""
        if self._buf.strip():
            yield from self.feed(b"\n")
        yield from self._dispatch()

    def _dispatch(self) -> Iterator[Any]:
        if not self._data:
            return
        data = b"\n".join(self._data)
        self._data = []
        if data.strip() == b"[DONE]":
            yield DONE
            return
        try:
            yield orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ProtocolError(f"bad JSON in SSE event: {data[:200]!r} ({exc})") from None
