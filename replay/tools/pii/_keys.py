"""Credentials with a shape of their own: ``user:password`` in a URL, JWTs (a header that decodes
to a JSON object with ``"alg"``), and API keys by their vendor prefix, after ``Bearer`` or as
``Basic`` credentials."""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterator

from replay.tools.pii._reading import Hit, at_cut


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
