"""Server-sent events as OpenAI-compatible servers stream them.

Incremental: feed it bytes as they arrive (chunks may split a line anywhere) and it yields
the JSON payload of each complete ``data:`` event. Lines end as the SSE spec allows: CRLF,
LF, or a bare CR (a CRLF split between two reads is still one line end). ``[DONE]`` ends the
stream. A UTF-8 byte order mark that opens the stream is dropped, as the SSE spec says (read
as part of the first line, it hid that line's ``data:`` and lost the answer's first event). A
payload that is not JSON, or a line or event over ``max_event_bytes``, is a ``ProtocolError``
for that request, not a crash and not memory that grows with whatever the server sends.

Time and memory are linear in the stream: a line that outlasts a read is kept in a bytearray
that each read extends in place, and is finished when its newline arrives (joining the held
bytes to every read made a line that never ends quadratic: 5, 10, 20 MB took 0.15, 0.67,
3.36 s).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

DONE = object()
NOT_ONE = object()  # feed_one: this read is not exactly one whole event

# Generous on purpose: with ``return_token_ids`` vLLM's first chunk carries the whole prompt's
# token ids, about 7 bytes a token, so a 2M-token prompt still fits. What it bounds is a
# server that never ends a line or an event.
MAX_EVENT_BYTES = 16 << 20
# More data lines than this in one event is no OpenAI-style stream; each line costs a list
# entry, so their count is bounded as well as their bytes.
MAX_DATA_LINES = 1 << 16
BOM = b"\xef\xbb\xbf"


class ProtocolError(Exception):
    """The server sent something that is not the SSE it promised (recorded as a result)."""


def _parse(payload: bytes | bytearray) -> Any:
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"bad JSON in SSE event: {bytes(payload[:200])!r} ({exc})") from None


class SSEDecoder:
    """Split a byte stream into events; multi-line ``data:`` fields are joined with newlines.

    The outcome does not depend on how the stream is cut into reads: the same events, and the
    same error at the same place, for a line (its bytes before the newline) or an event's
    data (as joined) over ``max_event_bytes``.
    """

    __slots__ = ("_after_cr", "_data", "_held", "_start", "_tail", "max_event_bytes")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        # The unfinished last line: bytes, or a bytearray grown in place once a line has
        # outlasted a whole read.
        self._tail: bytes | bytearray = b""
        self._data: list[bytes | bytearray] = []  # data fields of the event not yet dispatched
        self._held = 0  # their joined size plus one, for the fields counted so far
        # The last read ended in a CR: an LF that starts the next one is its CRLF, not a
        # blank line. (Left set by a read that ``feed_one`` takes: such a read ends a line
        # and leaves nothing pending, so the LF it would drop is a blank line with nothing to
        # dispatch.)
        self._after_cr = False
        # The stream's first bytes while they may still be a BOM (b"" before any); None once
        # the stream is past its start.
        self._start: bytes | None = b""

    def feed_one(self, chunk: bytes) -> Any:
        """The usual read, exactly one whole ``data: {...}`` event and nothing held: its
        payload, parsed. Any other read is ``NOT_ONE`` and is left for ``feed``.

        Called for every token, so it is a plain call (no generator per read, bench/)."""
        if (
            self._tail
            or self._data
            or self._start is not None
            or chunk[:6] != b"data: "
            or chunk.find(b"\n") != (n := len(chunk)) - 2
            or chunk[-1:] != b"\n"
            or n > self.max_event_bytes
        ):
            return NOT_ONE
        payload = chunk[6:-2]
        if payload[:1] != b"{" or payload[-1:] == b"\r":
            return NOT_ONE
        return _parse(payload)

    def feed(self, chunk: bytes) -> Iterator[Any]:
        # One split per read and no helper generator per event: this runs for every token
        # (bench/: the decoder was most of the client's CPU above a bare line-counting loop).
        event = self.feed_one(chunk)
        if event is not NOT_ONE:
            yield event
            return
        yield from self.feed_rest(chunk)

    def feed_rest(self, chunk: bytes) -> Iterator[Any]:
        """``feed`` for a read ``feed_one`` already found ``NOT_ONE`` (not tried again)."""
        if self._start is not None:
            chunk = self._past_bom(chunk)
            if not chunk:
                return
        if self._after_cr:
            self._after_cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        if b"\r" in chunk:  # CRLF and bare CR become LF, the one line end split on below
            self._after_cr = chunk[-1:] == b"\r"
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        tail = self._tail
        lines: list[bytes] | list[bytes | bytearray]
        if not tail:
            lines = chunk.split(b"\n")
            size = len(chunk)
        elif isinstance(tail, bytearray):  # a long line: the rare read, its own method
            grown = self._grow_long_line(tail, chunk)
            if grown is None:
                return
            lines, size = grown
        else:  # the usual cut: a line split between two reads
            buf = tail + chunk
            lines = buf.split(b"\n")
            size = len(buf)
        last = lines.pop()  # the unfinished last line, empty when the read ended a line
        if not lines:  # no newline: from now on the line grows in place
            self._tail = bytearray(last)
            if size > self.max_event_bytes + 1:
                raise self._too_big()
            return
        self._tail = last
        data = self._data
        held = self._held
        counted = len(data)
        # Only a read that, with what is held, passes the limit can hold a line or an event
        # over it: the common read skips the per-line checks.
        check = held + size > self.max_event_bytes
        for line in lines:
            if line:
                if check and len(line) > self.max_event_bytes:
                    raise self._too_big()
                if line[:5] == b"data:":
                    if data and len(data) >= MAX_DATA_LINES:
                        raise self._too_big(f"SSE event of over {MAX_DATA_LINES} data lines")
                    data.append(line[6:] if line[5:6] == b" " else line[5:])
                continue
            if not data:
                continue
            payload = data[0] if len(data) == 1 else b"\n".join(data)
            data.clear()
            held = counted = 0
            if check and len(payload) > self.max_event_bytes:
                raise self._too_big()
            if payload[:1] != b"{" and payload.strip() == b"[DONE]":
                yield DONE
                continue
            yield _parse(payload)
        if data:  # an event still open: bound what it holds across reads
            for i in range(counted, len(data)):
                held += len(data[i]) + 1
            if held - 1 > self.max_event_bytes:
                raise self._too_big()
        self._held = held
        if check and len(self._tail) > self.max_event_bytes + 1:
            raise self._too_big()

    def _past_bom(self, chunk: bytes) -> bytes:
        """The stream's opening bytes without a BOM; b"" while they could still be one (a
        server may write it alone, and a read may end inside it)."""
        seen = self._start + chunk if self._start else chunk
        if len(seen) < len(BOM) and BOM.startswith(seen):
            self._start = seen
            return b""
        self._start = None
        return seen[len(BOM) :] if seen.startswith(BOM) else seen

    def _grow_long_line(
        self, tail: bytearray, chunk: bytes
    ) -> tuple[list[bytes | bytearray], int] | None:
        """A line held over whole reads: the read's lines with it finished, and their size;
        None while it has not ended.

        It grows in place, and when it ends it is finished in place rather than split again
        (that copy made a 20 MB line cost 7x a 5 MB one, beside 4x).
        """
        end = chunk.find(b"\n")
        if end < 0:
            tail += chunk
            if (
                len(tail) > self.max_event_bytes + 1
            ):  # loose by one, as feed_rest's: exact at its end
                raise self._too_big()
            return None
        tail += chunk[:end]
        lines: list[bytes | bytearray] = [tail]
        lines += chunk[end + 1 :].split(b"\n")
        return lines, len(tail) + len(chunk) - end

    def _too_big(self, reason: str = "") -> ProtocolError:
        self._tail = b""  # what was held goes now, not when the request's result does
        self._data.clear()
        self._held = 0
        return ProtocolError(
            reason
            or (
                f"SSE event over {self.max_event_bytes} bytes (a line or an event's data that "
                "long; the limit is the client's max_event_bytes)"
            )
        )

    def close(self) -> Iterator[Any]:
        """End of body: a last event without its blank line still counts."""
        if self._tail:
            yield from self.feed(b"\n")
        yield from self.feed(b"\n")  # the blank line that dispatches a pending event
