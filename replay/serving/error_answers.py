"""Answers that are not the event stream asked for, each made a failed Result.

An HTTP error keeps its status, content type, ``Retry-After`` and the server's own message; a
redirect is not followed and says where it pointed; a 200 that is not ``text/event-stream``
is an error body, an error page, or a whole answer from a server that ignored ``stream``.
Only the start of such a body is kept (``ERROR_BODY_BYTES``), whatever the server sends.
"""

from __future__ import annotations

from typing import Any

import orjson

from replay.core.records import Result

# How much of an error body is read: enough for any server's message, bounded for any body.
ERROR_BODY_BYTES = 1 << 16
_QUOTE_CHARS = 300


def fail(result: Result, kind: Any, message: str) -> None:
    """Record on ``result`` that the request failed, of what kind, in what words."""
    result.status = "error"
    result.error_kind = kind
    result.error = message


def content_type(headers: dict[str, str]) -> str:
    """The media type of a response, lower case, without its parameters."""
    return headers.get("content-type", "").split(";", 1)[0].strip().lower()


def _text(body: bytes, headers: dict[str, str]) -> str:
    """The start of a body that is not the stream, decoded as the server says it is."""
    charset = "utf-8"
    for param in headers.get("content-type", "").split(";")[1:]:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip():
            charset = value.strip().strip('"')
    try:
        return body.decode(charset, errors="replace")
    except LookupError:  # a charset Python does not know
        return body.decode("utf-8", errors="replace")


def _content_type(headers: dict[str, str]) -> str:
    raw = headers.get("content-type")
    return f"Content-Type {raw[:100]!r}" if raw else "no Content-Type"


def _server_message(text: str) -> tuple[str | None, bool]:
    """The message of a JSON error body and whether the body says it is an error."""
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None, False
    if not isinstance(doc, dict):
        return None, False
    return _message_of(doc)


def _message_of(doc: dict[str, Any]) -> tuple[str | None, bool]:
    """The message of an error object (vLLM's and OpenAI's ``{"error": {"message": ...}}``,
    older vLLM's ``{"object": "error", "message": ...}``, the ``{"type": "error", ...}`` of
    Anthropic-style and Responses-style streams, a gateway's ``{"error": "..."}``, FastAPI's
    ``{"detail": ...}``) and whether it says it is an error."""
    err = doc.get("error")
    if isinstance(err, dict):
        msg = err.get("message")
        return str(err if msg is None else msg)[:2000], True
    if isinstance(err, str):
        return err[:2000], True
    said_error = doc.get("object") == "error" or doc.get("type") == "error"
    for key in ("message", "detail"):
        if doc.get(key) is not None:
            return str(doc[key])[:2000], said_error
    return None, False


def stream_error(event: dict[str, Any]) -> str | None:
    """The server's message when an event of the stream says it is an error (any shape
    ``_message_of`` reads, with an ``error`` of any type), else None: such an event is the
    server's word that the answer failed, never a part of it."""
    if (
        event.get("error") is None
        and event.get("object") != "error"
        and event.get("type") != "error"
    ):
        return None
    message, _ = _message_of(event)
    return message if message is not None else str(event)[:2000]


def _quote(text: str) -> str:
    text = text.strip()
    return repr(text[:_QUOTE_CHARS]) + (" ..." if len(text) > _QUOTE_CHARS else "")


def http_error(status: int, headers: dict[str, str], body: bytes, result: Result) -> None:
    """A status other than 200: a redirect (not followed) or an error in the server's words.
    ``headers`` by lower-case name; ``body`` its first ``ERROR_BODY_BYTES`` at most."""
    if 300 <= status < 400:
        where = headers.get("location")
        to = f"to {where[:500]!r}" if where else "with no Location"
        fail(
            result,
            "http",
            f"HTTP {status} redirect {to}, not followed: the answer must "
            "come from the target's own URL (point the target at where it redirects)",
        )
        return
    text = _text(body, headers)
    message, _ = _server_message(text)
    retry = headers.get("retry-after")
    # No automatic retry: a 429 is a result (the server's capacity), with the server's own
    # hint kept.
    hint = f", Retry-After: {retry[:50]}" if retry else ""
    said = message if message is not None else (_quote(text) if text.strip() else "empty body")
    fail(result, "http", f"HTTP {status} ({_content_type(headers)}{hint}): {said}")


def not_a_stream(headers: dict[str, str], body: bytes, result: Result) -> None:
    """A 200 that is not an event stream: an error page, an error object, or a whole answer
    from a server that ignored ``stream``."""
    text = _text(body, headers)
    message, is_error = _server_message(text)
    ctype = _content_type(headers)
    if is_error:
        fail(
            result,
            "server_error",
            f"HTTP 200 with an error body ({ctype}) instead of an event stream: {message}",
        )
        return
    hint = " (did it ignore stream=true?)" if content_type(headers) == "application/json" else ""
    fail(
        result,
        "protocol",
        f"HTTP 200 with {ctype}, not text/event-stream{hint}; the body "
        f"starts: {_quote(text) if text.strip() else 'empty body'}",
    )
