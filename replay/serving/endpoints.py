"""The server's own API endpoints, fetched: a session for them, a bounded read of an answer, and
what a failure says (the OS's own words for a refused connection, the start of a body that was
not what the endpoint is for). The streaming client uses the same connect-error words."""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import orjson

from replay.core.credentials import redact, request_secrets
from replay.core.errors import EndpointError
from replay.serving.http1 import KEEP_IDLE_S, ConnectError

# Non-streaming answers are read whole; past these a server is sending something other than
# what the endpoint is for, and it must not fill our memory doing so.
MAX_BODY = 16 * 1024 * 1024
QUOTE_BYTES = 200


def quote(body: bytes) -> str:
    """The start of a body, enough to recognise what the server sent."""
    head = body[:QUOTE_BYTES].decode("utf-8", "replace")
    return repr(head) + (f"... ({len(body)} bytes)" if len(body) > QUOTE_BYTES else "")


def os_error_text(err: OSError) -> str:
    """The OS's own words: asyncio words a refused connection as "Connect call failed",
    which hides that it was refused."""
    code = err.errno
    if code is not None and code > 0 and code in errno.errorcode:
        return f"{os.strerror(code)} ({errno.errorcode[code]})"
    return str(err) or type(err).__name__


def api_session(headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    """A session for the server's own API (introspection, /metrics, /tokenize, scoring) that
    gives up idle connections before the server would (``http1.KEEP_IDLE_S``): reusing one the
    server is closing lost requests as "Server disconnected"."""
    return aiohttp.ClientSession(
        headers=headers, connector=aiohttp.TCPConnector(keepalive_timeout=KEEP_IDLE_S)
    )


def connect_reason(exc: aiohttp.ClientConnectorError | ConnectError) -> str:
    """Why a connection could not be made, in the OS's words (shared with the client)."""
    err = exc.os_error
    why = (
        f"name lookup failed: {err.strerror}"
        if isinstance(err, socket.gaierror)
        else os_error_text(err)
    )
    return f"cannot connect to {exc.host}:{exc.port}: {why}"


def transport_problem(exc: BaseException, timeout_s: float) -> tuple[str, bool]:
    """(what went wrong on the way to the server, whether it was never reached)."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return connect_reason(exc), True
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s", False
    if isinstance(exc, OSError):
        return os_error_text(exc), False
    return f"{type(exc).__name__}: {exc}", False


@dataclass(frozen=True, slots=True)
class Answer:
    """A 200 answer from one endpoint: its raw body and, for JSON endpoints, the value."""

    label: str  # "GET /v1/models"
    body: bytes
    value: Any = None

    def wrong(self, expected: str) -> EndpointError:
        return EndpointError(f"{self.label}: expected {expected}, got {quote(self.body)}")


def endpoint_url(base_url: str, path: str) -> str:
    """``path`` (``/v1/models``) after the base URL's own path, the base URL's query after
    both: a server behind a gateway that wants ``?api_key=...`` gets it on every endpoint."""
    parts = urlsplit(base_url)
    return urlunsplit(parts._replace(path=parts.path.rstrip("/") + path))


async def fetch(
    session: aiohttp.ClientSession,
    method: str,
    base_url: str,
    path: str,
    *,
    json_body: Any = None,
    timeout_s: float = 30.0,
    max_bytes: int = MAX_BODY,
) -> Answer:
    """One non-streaming call; anything but a 200 raises EndpointError naming the call.
    Redirects are not followed: an answer from elsewhere is not the target's answer, and the
    session's credentials are the target's alone. The error never holds a credential, not
    even one the server echoes."""
    label = f"{method} {path}"
    secrets = request_secrets(base_url, session.headers)
    try:
        async with session.request(
            method,
            endpoint_url(base_url, path),
            json=json_body,
            allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as r:
            if 300 <= r.status < 400:
                where = quote(r.headers.get("Location", "(none)").encode())
                raise EndpointError(
                    f"{label}: HTTP {r.status} redirect to {where}: not "
                    "followed (give the URL of the server itself)"
                )
            body = await _read_capped(r, label, max_bytes)
            if r.status != 200:
                # Redacted before it is cut to a quote, which could cut a secret in two.
                said = redact(body.decode("utf-8", "replace"), secrets).encode()
                raise EndpointError(f"{label}: HTTP {r.status} ({r.content_type}): {quote(said)}")
            return Answer(label, body)
    except EndpointError as exc:
        raise EndpointError(redact(str(exc), secrets)) from None
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        why, unreachable = transport_problem(exc, timeout_s)
        raise EndpointError(redact(f"{label}: {why}", secrets), unreachable=unreachable) from exc


async def _read_capped(r: aiohttp.ClientResponse, label: str, max_bytes: int) -> bytes:
    if r.content_length is not None and r.content_length > max_bytes:
        raise EndpointError(
            f"{label}: answer of {r.content_length} bytes, over the "
            f"{max_bytes}-byte limit for this endpoint"
        )
    buf = bytearray()
    async for chunk in r.content.iter_chunked(65536):
        buf += chunk
        if len(buf) > max_bytes:
            raise EndpointError(
                f"{label}: answer over the {max_bytes}-byte limit for this "
                f"endpoint: {quote(bytes(buf))}"
            )
    return bytes(buf)


async def fetch_json(
    session: aiohttp.ClientSession, method: str, base_url: str, path: str, **kw: Any
) -> Answer:
    """``fetch``, and the body parsed as JSON (any content type that parses is accepted)."""
    ans = await fetch(session, method, base_url, path, **kw)
    try:
        return Answer(ans.label, ans.body, orjson.loads(ans.body))
    except orjson.JSONDecodeError:
        raise ans.wrong("JSON") from None
