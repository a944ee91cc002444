"""Credentials with a shape of their own: ``user:password`` in a URL, JWTs (a header that decodes
to a JSON object with ``"alg"``), and API keys by their vendor prefix (also wrapped onto the next
lines), after ``Bearer`` or as ``Basic`` credentials."""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterator

from replay.tools.pii._random import word_share
from replay.tools.pii._reading import NL, Hit, at_cut


def _b64decode(part: str) -> bytes | None:
    """base64/base64url, padding optional; a cut-off last quantum is dropped."""
    part = part.rstrip("=")
    part = part[: len(part) - len(part) % 4 if len(part) % 4 == 1 else len(part)]
    try:
        return base64.urlsafe_b64decode(
            part.replace("+", "-").replace("/", "_") + "=" * (-len(part) % 4)
        )
    except (ValueError, binascii.Error):
        return None


_JWT_HEAD_START = re.compile(rb'\{\s*"(?:alg|typ|kid|enc|cty|x5t|x5c|jku|jwk|zip|crit)"')


def _jwt_ok(token: str) -> bool:
    head, dot, _ = token.partition(".")
    raw = _b64decode(head)
    if raw is None:
        return False
    try:
        header = json.loads(raw)
    except ValueError:  # cut inside the header: judge by how it starts
        return not dot and bool(_JWT_HEAD_START.match(raw))
    return isinstance(header, dict) and "alg" in header


# -- url credentials, jwt, api keys -------------------------------------------------------------

_URL_CREDS = re.compile(
    r"(?<![\w+.-])[A-Za-z][A-Za-z0-9+.-]{0,15}://"
    r"([^\s:/?#@\[\]\"'<>]*):([^\s/?#\[\]\"'<>]+)@(?=[\w\[])"
)


def url_credentials(text: str) -> Iterator[Hit]:
    for m in _URL_CREDS.finditer(text):
        yield Hit(m.start(1), m.end(2), "url_credentials", text[m.start(1) : m.end(2)])


_JWT = re.compile(r"(?<![\w.-])eyJ[A-Za-z0-9_-]{8,}(?:\.[A-Za-z0-9_-]*){0,2}(?![\w-])")


def jwt(text: str) -> Iterator[Hit]:
    for m in _JWT.finditer(text):
        if _jwt_ok(m.group(0)):
            yield Hit(m.start(), m.end(), "jwt", m.group(0))


_API_KEY = re.compile(
    r"""(?<![\w-])(?:
      sk-(?:proj|ant(?:-api\d\d)?|svcacct|admin)-[A-Za-z0-9_-]{6,}
    | sk-(?=[A-Za-z_-]*\d)[A-Za-z0-9_-]{20,}
    | (?:sk|pk|rk)_(?:live|test)_[A-Za-z0-9]{8,}
    | gh[pousr]_[A-Za-z0-9]{8,}
    | github_pat_[A-Za-z0-9_]{8,}
    | xox[abposr]-(?=[A-Za-z-]*\d)[A-Za-z0-9-]{6,}
    | xapp-\d-[A-Za-z0-9-]{10,}
    | (?:AKIA|ASIA)(?=[A-Z]*\d)[0-9A-Z]{8,16}
    | AIza[0-9A-Za-z_-]{8,}
    | hf_(?=[a-z]*[A-Z0-9])[A-Za-z0-9]{8,}
    | glpat-[A-Za-z0-9_-]{8,}
    | npm_[A-Za-z0-9]{8,}
    | ya29\.[0-9A-Za-z_-]{16,}
    | SG\.[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,}
    | whsec_[A-Za-z0-9]{16,}
    )(?![\w-])""",
    re.X,
)
# A key wrapped at a line break after its prefix (``sk-proj-abc\ndef456GHI…``), on up to
# ``_WRAPPED_LINES`` lines. A line goes on with the key only when it starts with key material,
# 8+ characters with a digit or both cases that do not read as words, and not a key of its own
# (a list of keys, one a line): ``sk-proj-abc123\nUse it``, ``…\nexport``, ``…\nPython3``,
# ``…\nx86_64`` end at the break. A break inside the prefix is not joined.
_KEY_PREFIX = (
    r"(?:sk-|(?:sk|pk|rk)_(?:live|test)_|gh[pousr]_|github_pat_|xox[abposr]-|xapp-"
    r"|AKIA|ASIA|AIza|hf_|glpat-|npm_|ya29\.|SG\.|whsec_)"
)
_KEY_BROKEN = re.compile(
    rf"(?<![\w-]){_KEY_PREFIX}[A-Za-z0-9_.-]{{0,256}}({NL})([A-Za-z0-9_-]{{1,256}})"
)
_KEY_HEAD = re.compile(_KEY_PREFIX)
_KEY_GOES_ON = re.compile(rf"{NL}([A-Za-z0-9_-]{{8,256}})(?![\w-])")
_WRAPPED_LINES = 8


def _key_material(part: str) -> bool:
    has_case = any(c.isupper() for c in part) and any(c.islower() for c in part)
    return (
        len(part) >= 8
        and not _KEY_HEAD.match(part)
        and any(c.isalpha() for c in part)
        and (has_case or any(c.isdigit() for c in part))
        and word_share(part) < 0.75
    )


def _wrapped_keys(text: str) -> Iterator[Hit]:
    for m in _KEY_BROKEN.finditer(text):
        cut, gap = m.start(1) - m.start(), m.end(1) - m.start(1)
        joined = text[m.start() : m.start(1)] + m.group(2)
        key = _API_KEY.match(joined)
        if not key or key.end() <= cut or not _key_material(joined[cut : key.end()]):
            continue
        end, value = m.start() + key.end() + gap, key.group(0)
        full = end == m.end()  # the key fills its second line: a third may go on with it
        for _ in range(_WRAPPED_LINES - 2):
            more = _KEY_GOES_ON.match(text, end) if full else None
            if not (more and _key_material(more.group(1))):
                break
            end, value = more.end(), value + more.group(1)
        yield Hit(m.start(), end, "api_key", value)


_SK_CUT = re.compile(r"(?<![\w-])sk-(?=[A-Za-z_-]*\d)[A-Za-z0-9_-]{6,}\Z")
_SLACK_HOOK = re.compile(
    r"hooks\.slack\.com/(?:services|workflows|triggers)/"
    r"(T[A-Z0-9]{6,}/[A-Z0-9]{6,}/[A-Za-z0-9]{8,})"
)
_BEARER_TOKEN = r"((?=[A-Za-z._~+/-]*\d)(?=[\d._~+/-]*[A-Za-z])[A-Za-z0-9._~+/-]{%s}=*)"
_BEARER = re.compile(r"(?<![\w-])[Bb]earer[ \t]+" + _BEARER_TOKEN % "16," + r"(?![\w.~+/=-])")
_BEARER_CUT = re.compile(r"(?<![\w-])[Bb]earer[ \t]+" + _BEARER_TOKEN % "6," + r"\Z")
_BASIC = re.compile(r"(?<![\w-])[Bb]asic[ \t]+([A-Za-z0-9+/]{8,}={0,2})(?![\w+/=-])")
_PRINTABLE_PAIR = re.compile(rb"[\x21-\x7e]{1,200}:[\x20-\x7e]{1,200}")


def api_key(text: str) -> Iterator[Hit]:
    if "\n" in text or "\\n" in text:
        yield from _wrapped_keys(text)
    for m in _API_KEY.finditer(text):
        yield Hit(m.start(), m.end(), "api_key", m.group(0))
    for m in _SLACK_HOOK.finditer(text):
        yield Hit(m.start(1), m.end(1), "api_key", m.group(1))
    for m in _BEARER.finditer(text):
        yield Hit(m.start(1), m.end(1), "api_key", m.group(1))
    for m in _BASIC.finditer(text):  # base64 of printable "user:password", not a word
        raw = _b64decode(m.group(1))
        if raw is not None and _PRINTABLE_PAIR.fullmatch(raw):
            yield Hit(m.start(1), m.end(1), "api_key", m.group(1))
    if cut := at_cut(text, _SK_CUT):
        yield Hit(cut.start(), cut.end(), "api_key", cut.group(0))
    if cut := at_cut(text, _BEARER_CUT):
        yield Hit(cut.start(1), cut.end(1), "api_key", cut.group(1))
