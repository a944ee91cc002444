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


def _parse(payload: bytes) -> Any:
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"bad JSON in SSE event: {payload[:200]!r} ({exc})") from None


class SSEDecoder:
    """Split a byte stream into events; multi-line ``data:`` fields are joined with newlines."""

    __slots__ = ("_buf", "_data")

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> Iterator[Any]:
        # One split per read and no helper generator per event: this runs for every token
        # (bench/: the decoder was most of the client's CPU above a bare line-counting loop).
        if (not self._buf and not self._data and chunk[:6] == b"data: "
                and chunk.find(b"\n") == len(chunk) - 2 and chunk[-1:] == b"\n"):
            # The usual read: exactly one whole ``data: {...}\n\n`` event.
            payload = chunk[6:-2]
            if payload[:1] == b"{" and payload[-1:] != b"\r":
                yield _parse(payload)
                return
        buf = self._buf + chunk if self._buf else chunk
        lines = buf.split(b"\n")
        self._buf = lines.pop()  # the unfinished last line, b"" when the read ended a line
        data = self._data
        for line in lines:
            if line[-1:] == b"\r":
                line = line[:-1]
            if line:
                if line[:5] == b"data:":
                    data.append(line[6:] if line[5:6] == b" " else line[5:])
                continue
            if not data:
                continue
            payload = data[0] if len(data) == 1 else b"\n".join(data)
            data.clear()
            if payload[:1] != b"{" and payload.strip() == b"[DONE]":
                yield DONE
                continue
            yield _parse(payload)

    def close(self) -> Iterator[Any]:
        """End of body: a last event without its blank line still counts."""
        if self._buf.strip():
            yield from self.feed(b"\n")
        self._buf = b""
        yield from self.feed(b"\n")  # the blank line that dispatches a pending event
