"""Answers that are not the event stream asked for, each made a failed Result.

An HTTP error keeps its status, content type, ``Retry-After`` and the server's own message; a
redirect is not followed and says where it pointed; a 200 that is not ``text/event-stream``
is an error body, an error page, or a whole answer from a server that ignored ``stream``.
Only the start of such a body is read (``_ERROR_BODY_BYTES``), whatever the server sends.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from replay.core.records import Result

# How much of an error body is read: enough for any server's message, bounded for any body.
_ERROR_BODY_BYTES = 1 << 16
_QUOTE_CHARS = 300


def fail(result: Result, kind: Any, message: str) -> None:
    """Record on ``result`` that the request failed, of what kind, in what words."""
    result.status = "error"
    result.error_kind = kind
    result.error = message


async def _body_head(resp: aiohttp.ClientResponse) -> str:
    """The start of a body that is not the stream, decoded as the server says it is."""
    parts: list[bytes] = []
    size = 0
    while size < _ERROR_BODY_BYTES:
        piece = await resp.content.read(_ERROR_BODY_BYTES - size)
        if not piece:
            break
        parts.append(piece)
        size += len(piece)
    raw = b"".join(parts)
    try:
        return raw.decode(resp.charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        return raw.decode("utf-8", errors="replace")


def _content_type(resp: aiohttp.ClientResponse) -> str:
    raw = resp.headers.get("Content-Type")
    return f"Content-Type {raw[:100]!r}" if raw else "no Content-Type"


def _server_message(text: str) -> tuple[str | None, bool]:
    """The message of a JSON error body (OpenAI's ``{"error": {"message": ...}}``, older
    vLLM's ``{"object": "error", "message": ...}``, FastAPI's ``{"detail": ...}``) and whether
    the body says it is an error."""
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None, False
    if not isinstance(doc, dict):
        return None, False
    err = doc.get("error")
    if isinstance(err, dict):
        msg = err.get("message")
        return str(err if msg is None else msg)[:2000], True
    if isinstance(err, str):
        return err[:2000], True
    said_error = doc.get("object") == "error"
    for key in ("message", "detail"):
        if doc.get(key) is not None:
            return str(doc[key])[:2000], said_error
    return None, False


def _quote(text: str) -> str:
    text = text.strip()
    return repr(text[:_QUOTE_CHARS]) + (" ..." if len(text) > _QUOTE_CHARS else "")


async def http_error(resp: aiohttp.ClientResponse, result: Result) -> None:
    """A status other than 200: a redirect (not followed) or an error in the server's words."""
    status = resp.status
    if 300 <= status < 400:
        where = resp.headers.get("Location")
        to = f"to {where[:500]!r}" if where else "with no Location"
        fail(
            result,
            "http",
            f"HTTP {status} redirect {to}, not followed: the answer must "
            "come from the target's own URL (point the target at where it redirects)",
        )
        return
    text = await _body_head(resp)
    message, _ = _server_message(text)
    retry = resp.headers.get("Retry-After")
    # No automatic retry: a 429 is a result (the server's capacity), with the server's own
    # hint kept.
    hint = f", Retry-After: {retry[:50]}" if retry else ""
    said = message if message is not None else (_quote(text) if text.strip() else "empty body")
    fail(result, "http", f"HTTP {status} ({_content_type(resp)}{hint}): {said}")


async def not_a_stream(resp: aiohttp.ClientResponse, result: Result) -> None:
    """A 200 that is not an event stream: an error page, an error object, or a whole answer
    from a server that ignored ``stream``."""
    text = await _body_head(resp)
    message, is_error = _server_message(text)
    ctype = _content_type(resp)
    if is_error:
        fail(
            result,
            "server_error",
            f"HTTP 200 with an error body ({ctype}) instead of an event stream: {message}",
        )
        return
    hint = " (did it ignore stream=true?)" if resp.content_type == "application/json" else ""
    fail(
        result,
        "protocol",
        f"HTTP 200 with {ctype}, not text/event-stream{hint}; the body "
        f"starts: {_quote(text) if text.strip() else 'empty body'}",
    )
