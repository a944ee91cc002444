"""Credentials in what a user gives, and the one redaction every writer applies.

A target's credentials come three ways: user-info in its URL (``http://user:pass@host``, sent as
HTTP Basic auth, never on the request line), a query (``http://host/?api_key=...``, which the
server needs on every request, so it stays on the URL requests are sent to) and an API key in
an environment variable (``api_key_env``, sent as a Bearer token). None of them may reach a file
of the run directory or the terminal, so whatever is written that holds a URL, or words a server
sent back (which may echo the request), goes through ``redact`` first: every http(s) URL in the
text loses its user-info and query values, and each known secret is replaced.

A key that goes into a header must be one header line's worth of printable ASCII:
``header_value_problem`` says what is wrong with one that is not (never the key itself).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from urllib.parse import unquote, urlsplit, urlunsplit

REDACTED = "***"
# A secret shorter than this is too likely to be ordinary text ("1", "yes") to replace in what a
# server says; URLs are redacted by shape, whatever their values' length.
MIN_SECRET_CHARS = 4
# The start of a longer secret that is hidden too, wherever it is: a quote cut at a fixed length
# may end inside a secret that a server echoed.
CUT_SECRET_CHARS = 8
# An http(s) URL inside text: up to the first character no URL holds unescaped, or a comma
# (``--targets`` separates its URLs with one; ``check_url`` refuses a target URL holding one),
# and not ending in the punctuation of the sentence around it ("served by URL: ...").
_URL_IN_TEXT = re.compile(r"https?://[^\s'\"<>`,]*[^\s'\"<>`,.:;!?)\]}]", re.IGNORECASE)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` fit to write: each http(s) URL in it with its user-info, query values and
    fragment shown as ``***``, and each of ``secrets`` (what a server may echo: a key, a query
    value) replaced by ``***``."""
    out = _URL_IN_TEXT.sub(lambda m: _redact_url(m.group()), text)
    for secret in sorted(set(secrets), key=len, reverse=True):
        if len(secret) >= MIN_SECRET_CHARS:
            out = _without_start_of(secret, out.replace(secret, REDACTED))
    return out


def _without_start_of(secret: str, text: str) -> str:
    """``text`` with each run of ``secret``'s first ``CUT_SECRET_CHARS`` or more characters
    hidden: what a server echoed may have been cut to a quote before it came here, and the start
    of a key is still part of it."""
    if len(secret) <= CUT_SECRET_CHARS:
        return text
    head, out, at = secret[:CUT_SECRET_CHARS], [], 0
    while (i := text.find(head, at)) >= 0:
        n = CUT_SECRET_CHARS
        while n < len(secret) and i + n < len(text) and text[i + n] == secret[n]:
            n += 1
        out += [text[at:i], REDACTED]
        at = i + n
    return "".join(out) + text[at:]


def _redact_url(url: str) -> str:
    """One URL, taken apart by hand: a URL cut out of text need not parse (a trailing ':').
    Everything up to the last '@' before the query is user-info, also where the password
    holds an unescaped '/' (a parser would take the rest for the path)."""
    scheme, _, rest = url.partition("://")
    tail, hash_, fragment = rest.partition("#")
    where, q, query = tail.partition("?")
    if "@" in where:
        where = f"{REDACTED}@{where.rpartition('@')[2]}"
    if q:
        where += "?" + "&".join(_redact_pair(p) for p in query.split("&"))
    if hash_:
        where += "#" + (REDACTED if fragment else "")
    return f"{scheme}://{where}"


def _redact_pair(pair: str) -> str:
    """``key=value`` keeps its key (it says which parameter it was); a bare value is hidden."""
    key, eq, value = pair.partition("=")
    if eq:
        return f"{key}={REDACTED}" if value else pair
    return REDACTED if pair else pair


def request_secrets(url: str, headers: Mapping[str, str]) -> list[str]:
    """What a server might echo of a request's credentials: the credential of its
    Authorization header (``Bearer KEY``: the key), the URL's user name and password and
    each of its query values, as written and decoded."""
    parts = urlsplit(url)
    auth = headers.get("Authorization", "").partition(" ")[2].strip()
    raw: list[str] = [auth, parts.username or "", parts.password or ""]
    for pair in parts.query.split("&"):
        key, eq, value = pair.partition("=")
        raw.append(value if eq else key)
    return [s for r in raw for s in {r, unquote(r)} if s]


def without_user_info(url: str) -> tuple[str, tuple[str, str] | None]:
    """``url`` without its user-info (what requests are sent to), and the (user, password) it
    held, decoded; None when it held none."""
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        return url, None
    user, _, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=host)), (unquote(user), unquote(password))


def header_value_problem(value: str) -> str | None:
    """What makes ``value`` unfit for an HTTP header line (sent as it is, a CR or LF would end
    the line and start another header); None when it fits. Never quotes the value."""
    if "\r" in value or "\n" in value:
        return "a line break (CR or LF)"
    for ch in value:
        if ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0:
            return f"a control character (U+{ord(ch):04X})"
        if ord(ch) > 0x7F:
            return f"a non-ASCII character (U+{ord(ch):04X})"
    return None


# Environment variables a server is given whose values are credentials by their name
# (``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ``..._PASSWORD``): recorded by name only.
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL|AUTH|COOKIE", re.I)


def env_for_record(env: Mapping[str, str]) -> dict[str, str]:
    """A server's environment as the manifest keeps it: a variable named as a credential keeps
    its name, its value shown as ``***``; every value also loses any URL's secrets."""
    return {k: REDACTED if _SECRET_NAME.search(k) else redact(v) for k, v in env.items()}
