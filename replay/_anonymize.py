"""Anonymization: scrub personal data and secrets from production logs before they become traces.

``replay trace anonymize`` rewrites every string of every record (messages, prompt text, tools,
tool-call arguments, checker specs, ``meta``); ``replay trace scan`` reports what remains.

What is detected (``Finding.kind``), in priority order (an earlier kind wins an overlap):

``url_credentials``  ``scheme://user:password@host``: the ``user:password`` part.
``jwt``              ``eyJ…`` header ``.`` payload ``.`` signature whose header decodes to a JSON
                     object with ``"alg"``.
``api_key``          known prefixes: ``sk-`` (with a digit), ``sk_/pk_/rk_live_|test_``,
                     ``ghp_ gho_ ghu_ ghs_ ghr_``, ``github_pat_``, ``xox[abposr]-``,
                     ``AKIA``/``ASIA`` + 16, ``AIza`` + 35, ``hf_``, ``glpat-``, ``npm_``, and the
                     token after ``Bearer`` (16+ chars with a letter and a digit).
``email``            RFC-ish ``local@domain.tld``; not ``git@host`` (an SSH remote) nor
                     ``name@2x.png`` (an image-density suffix).
``iban``             country code + check digits + BBAN, compact or in groups of four, with the
                     country's registered length and a valid mod-97 checksum.
``credit_card``      13-19 digits, contiguous or grouped 4-4-4-4(-3) / 4-6-5 / 4-6-4 with one kind
                     of separator (space or dash), a card network's prefix (Visa 4, Mastercard
                     51-55/2221-2720, Amex 34/37, Discover/UnionPay/Maestro 6, 50/56-58, Diners
                     300-305/36/38/39, JCB 3528-3589) and Luhn-valid. Not after ``-`` (negative).
``ipv6``             ``ipaddress``-valid, at least three groups; not ``::1``/``::``.
``ipv4``             valid octets; not loopback, ``0.0.0.0``, ``255.*`` (netmasks) nor all
                     one-digit octets (``2.6.0.1`` is a version or a section number).
``phone``            9-15 digits: ``+CC`` then groups, ``(area) 555-0132``, dashed groups
                     ``415-555-0132``, dotted ``415.555.0132``, or a trunk ``0`` then groups
                     separated consistently by spaces or dots (``020 7946 0958``). A bare run of
                     digits, a year, a price, a date or ``415 555 0132`` (spaces, no ``+``/``0``)
                     is not a phone number.
``high_entropy``     a run of 20+ base64/base64url characters that mixes upper case, lower case
                     and digits, has Shannon entropy >= min(0.84 * log2(len), 4.4) bits a char,
                     splits into many short pieces (>= 0.3 pieces a char; pieces are camelCase
                     words, upper-case runs and digit runs) and does not read as words (< 75% of
                     its letters in ``[A-Z]?[a-z]{2,}`` words). Runs are tried per ``/`` segment
                     first, then whole. Or a hex run of 32+ chars with letters and digits and
                     entropy >= 3 (hex API keys; also unlabelled hex digests: a digest right
                     after ``sha256:``, ``md5``, ``hash``, ``commit ``, ``/blob/``, ``etag``...
                     is kept). Calibrated on random keys (a random base64 key is caught ~98% of
                     the time at 32 chars, ~92% at 20) and on the identifiers in ~40 MB of
                     Python (camelCase model/class names with digits and acronyms such as
                     ``DINOv3ViTBackboneOutput`` are the residual false positives). Not flagged:
                     English words, snake/camel/kebab identifiers, file paths, model names,
                     UUIDs (identifiers, not secrets: lower-case hex with dashes), tool-call ids
                     (``call_``, ``toolu_``, ``chatcmpl-``...) and ``data:…;base64,`` payloads.

Placeholders are ``<PREFIX>_<hash8>``: ``EMAIL``, ``PHONE``, ``IP`` (v4 and v6), ``CARD``,
``IBAN``, ``SECRET`` (api_key, jwt, high_entropy) and, for URL credentials, ``USER`` (so
``postgres://admin:pw@db/x`` becomes ``postgres://USER_1a2b3c4d@db/x``). ``hash8`` is the first 8
hex digits of HMAC-SHA256(secret, prefix + NUL + canonical value); the canonical value folds
formats that mean the same thing (emails lower-cased, phone and card numbers to their digits,
IBANs compact upper-case, IPs in ``ipaddress`` form). So one value gets one placeholder in the
message, the tool arguments and the check alike (retrieval, contains, exact and tool-call checks
still pass for an answer that copies the placeholder), across traces scrubbed with one secret,
and not across secrets. Placeholders are word characters only: never detected again, safe in
JSON, regular expressions and code. A scrubbed string is re-scanned until nothing is found, so
``scrub_text`` is idempotent and a scan of its output is clean.

Records: every string is scrubbed, dict keys only where a key itself is detected (ordinary keys
never are); a string that holds a JSON object or array (tool-call ``arguments``) is parsed, its
values scrubbed and re-serialized (``#`` in a ``Finding.field`` marks the step into it); the
pattern of a ``regex`` check is matched with its escapes (``\\.``) undone; integers of 13-19
digits that are card numbers become the card placeholder (not in ``prompt``/``synth`` token
ids, nor in a ``number`` check). ``anonymize_file`` marks each record with
``meta.anonymized = {"by": "kvcanary", "version": 1}``; ``is_scanned`` checks that mark.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import hashlib
import hmac
import ipaddress
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from ._errors import TraceError

KINDS = ("url_credentials", "jwt", "api_key", "email", "iban", "credit_card", "ipv6", "ipv4",
         "phone", "high_entropy")
PREFIX = {"url_credentials": "USER", "jwt": "SECRET", "api_key": "SECRET", "email": "EMAIL",
          "iban": "IBAN", "credit_card": "CARD", "ipv6": "IP", "ipv4": "IP", "phone": "PHONE",
          "high_entropy": "SECRET"}
PLACEHOLDER = re.compile(r"(?:USER|SECRET|EMAIL|IBAN|CARD|IP|PHONE)_[0-9a-f]{8}")
MARKER = {"by": "kvcanary", "version": 1}
_MAX_PASSES = 8


@dataclass(frozen=True, slots=True)
class Finding:
    """One detected item: its kind, where (JSON path and span in that string) and a masked
    excerpt (two characters and the length, never the value)."""

    kind: str
    field: str
    start: int
    end: int
    excerpt: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "field": self.field, "start": self.start, "end": self.end,
                "excerpt": self.excerpt}


class _Hit(NamedTuple):
    start: int
    end: int
    kind: str
    key: str  # canonical value, what the pseudonym is keyed on


# -- validators -----------------------------------------------------------------------------


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


_IBAN_LENGTHS = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22, "BH": 22,
    "BR": 29, "BY": 28, "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22, "DK": 18, "DO": 28,
    "EE": 20, "EG": 29, "ES": 24, "FI": 18, "FO": 18, "FR": 27, "GB": 22, "GE": 22, "GI": 23,
    "GL": 18, "GR": 27, "GT": 28, "HR": 21, "HU": 28, "IE": 22, "IL": 23, "IQ": 23, "IS": 26,
    "IT": 27, "JO": 30, "KW": 30, "KZ": 20, "LB": 28, "LC": 32, "LI": 21, "LT": 20, "LU": 20,
    "LV": 21, "MC": 27, "MD": 24, "ME": 22, "MK": 19, "MR": 27, "MT": 31, "MU": 30, "NL": 18,
    "NO": 15, "PK": 24, "PL": 28, "PS": 29, "PT": 25, "QA": 29, "RO": 24, "RS": 22, "SA": 24,
    "SC": 31, "SE": 24, "SI": 19, "SK": 24, "SM": 27, "ST": 25, "SV": 28, "TL": 23, "TN": 24,
    "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20,
}


def _card_network(digits: str) -> bool:
    """The number starts like a card of a network (Visa, Mastercard, Amex, Discover, Diners,
    JCB, UnionPay, Maestro): a timestamp or an id of 13-19 digits mostly does not."""
    two, four = int(digits[:2]), int(digits[:4])
    return (digits[0] in "46" or 50 <= two <= 58 or 2221 <= four <= 2720
            or two in (34, 36, 37, 38, 39) or 300 <= int(digits[:3]) <= 305
            or 3528 <= four <= 3589)


def _iban_ok(compact: str) -> bool:
    if _IBAN_LENGTHS.get(compact[:2]) != len(compact):
        return False
    rearranged = compact[4:] + compact[:4]
    return int("".join(str(int(ch, 36)) for ch in rearranged)) % 97 == 1


def _jwt_ok(token: str) -> bool:
    head = token.split(".", 1)[0]
    try:
        header = json.loads(base64.urlsafe_b64decode(head + "=" * (-len(head) % 4)))
    except (ValueError, binascii.Error):
        return False
    return isinstance(header, dict) and "alg" in header


def _entropy(s: str) -> float:
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values())


_PIECE = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")
_WORD = re.compile(r"[A-Z]?[a-z]{2,}")
_ID_PREFIXES = ("call_", "toolu_", "chatcmpl-", "cmpl-", "msg_", "resp_", "run_", "thread_",
                "asst_", "req_", "batch_", "file-")


def _looks_random(s: str) -> bool:
    """A base64-alphabet token that reads as random, not as words (see the module docstring)."""
    n = len(s)
    if n < 20 or s.startswith(_ID_PREFIXES):
        return False
    if not (any(c.isupper() for c in s) and any(c.islower() for c in s)
            and any(c.isdigit() for c in s)):
        return False
    if _entropy(s) < min(0.84 * math.log2(n), 4.4):
        return False
    if len(_PIECE.findall(s)) / n < 0.3:
        return False
    letters = sum(c.isalpha() for c in s)
    return sum(len(w) for w in _WORD.findall(s)) / letters < 0.75


_HEX = re.compile(r"[0-9a-f]{32,}|[0-9A-F]{32,}")
_DIGEST_LABEL = re.compile(r"(?:sha\d*|md5|blake2[bs]?|digest|checksum|hash|commits?|blob|tree"
                           r"|rev(?:ision)?|etag|oid)(?:_?ids?)?[^A-Za-z0-9]{0,4}$", re.I)


def _looks_hex_secret(text: str, a: int, b: int) -> bool:
    s = text[a:b]
    if not _HEX.fullmatch(s) or s.isdigit() or not any(c.isdigit() for c in s):
        return False
    return _entropy(s) >= 3.0 and not _DIGEST_LABEL.search(text[max(0, a - 20):a])


# -- detectors: each yields candidate hits; _detect resolves overlaps ---------------------------

_URL_CREDS = re.compile(r"(?<![\w+.-])[A-Za-z][A-Za-z0-9+.-]{0,15}://"
                        r"([^\s:/?#@\[\]\"'<>]*):([^\s/?#\[\]\"'<>]+)@(?=[\w\[])")


def _url_credentials(text: str) -> Iterator[_Hit]:
    for m in _URL_CREDS.finditer(text):
        yield _Hit(m.start(1), m.end(2), "url_credentials", text[m.start(1):m.end(2)])


_JWT = re.compile(r"(?<![\w.-])eyJ[A-Za-z0-9_-]{6,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*(?![\w.-])")


def _jwt(text: str) -> Iterator[_Hit]:
    for m in _JWT.finditer(text):
        if _jwt_ok(m.group(0)):
            yield _Hit(m.start(), m.end(), "jwt", m.group(0))


_API_KEY = re.compile(r"""(?<![\w-])(?:
      sk-(?:proj-|ant-(?:api\d\d-)?|svcacct-|admin-)?(?=[A-Za-z_-]*\d)[A-Za-z0-9_-]{20,}
    | (?:sk|pk|rk)_(?:live|test)_[A-Za-z0-9]{16,}
    | gh[pousr]_[A-Za-z0-9]{36,}
    | github_pat_[A-Za-z0-9_]{22,}
    | xox[abposr]-[A-Za-z0-9-]{10,}
    | (?:AKIA|ASIA)[0-9A-Z]{16}
    | AIza[0-9A-Za-z_-]{35}
    | hf_[A-Za-z0-9]{30,}
    | glpat-[A-Za-z0-9_-]{20,}
    | npm_[A-Za-z0-9]{36}
    )(?![\w-])""", re.X)
_BEARER = re.compile(r"(?<![\w-])[Bb]earer\s+"
                     r"((?=[A-Za-z._~+/-]*\d)(?=[\d._~+/-]*[A-Za-z])[A-Za-z0-9._~+/-]{16,}=*)"
                     r"(?![\w.~+/=-])")


def _api_key(text: str) -> Iterator[_Hit]:
    for m in _API_KEY.finditer(text):
        yield _Hit(m.start(), m.end(), "api_key", m.group(0))
    for m in _BEARER.finditer(text):
        yield _Hit(m.start(1), m.end(1), "api_key", m.group(1))


_EMAIL = re.compile(r"(?<![\w.%+-])([A-Za-z0-9][A-Za-z0-9._%+-]*)@"
                    r"((?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,24})(?![\w-])")
_DENSITY_SUFFIX = re.compile(r"\d+(?:\.\d+)?x\.")


def _email(text: str) -> Iterator[_Hit]:
    for m in _EMAIL.finditer(text):
        local, domain = m.group(1), m.group(2)
        if local == "git" or PLACEHOLDER.fullmatch(local) or _DENSITY_SUFFIX.match(domain):
            continue
        yield _Hit(m.start(), m.end(), "email", m.group(0).lower())


_IBAN = re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}\d{2}"
                   r"(?:[A-Z0-9]{11,30}|(?: [A-Z0-9]{4}){2,7}(?: [A-Z0-9]{1,3})?)(?![A-Za-z0-9])")


def _iban(text: str) -> Iterator[_Hit]:
    for m in _IBAN.finditer(text):
        compact = m.group(0).replace(" ", "")
        if _iban_ok(compact):
            yield _Hit(m.start(), m.end(), "iban", compact)


_CARD = re.compile(r"""(?<![\w.+-])(?:
      \d{13,19}
    | \d{4}([ -])\d{4}\1\d{4}\1\d{1,4}(?:\1\d{1,3})?
    | \d{4}([ -])\d{6}\2\d{4,5}
    )(?!\w|[.,]\d)""", re.X)


def _credit_card(text: str) -> Iterator[_Hit]:
    for m in _CARD.finditer(text):
        digits = re.sub(r"\D", "", m.group(0))
        if 13 <= len(digits) <= 19 and _card_network(digits) and _luhn(digits):
            yield _Hit(m.start(), m.end(), "credit_card", digits)


_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}"
                   r"(?:(?:\d{1,3}\.){3}\d{1,3}|[0-9A-Fa-f]{0,4})(?![\w:]|\.\d)")


def _ipv6(text: str) -> Iterator[_Hit]:
    for m in _IPV6.finditer(text):
        s = m.group(0)
        try:
            addr = ipaddress.IPv6Address(s)
        except ValueError:
            continue
        groups = len([g for g in s.split(":") if g]) + ("." in s)
        if groups >= 3 and not (addr.is_loopback or addr.is_unspecified):
            yield _Hit(m.start(), m.end(), "ipv6", str(addr))


_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\w.])(?:{_OCTET}\.){{3}}{_OCTET}(?![\w]|\.\d)")


def _ipv4(text: str) -> Iterator[_Hit]:
    for m in _IPV4.finditer(text):
        addr = ipaddress.IPv4Address(m.group(0))
        if addr.is_loopback or addr.is_unspecified or m.group(0).startswith("255."):
            continue
        if max(len(octet) for octet in m.group(0).split(".")) > 1:  # not 2.6.0.1 (a version)
            yield _Hit(m.start(), m.end(), "ipv4", str(addr))


_PHONE = re.compile(r"""(?<![\w+.-])(?<!\d\s)(?:
      (?P<intl>\+\d{1,3}(?:[ .-]?(?:\(\d{1,4}\)|\d{1,4})){2,6})
    | (?P<area>\(\d{2,4}\)[ .-]?\d{2,4}(?:[ .-]\d{2,4}){1,3})
    | (?P<dashed>(?:1-)?\d{2,4}(?:-\d{2,4}){2,3})
    | (?P<dotted>\d{3}\.\d{3}\.\d{4})
    | (?P<trunk>0\d{1,4}(?:[ .]\d{2,4}){2,4})
    )(?![\w]|[.-]\d)""", re.X)
_DATE_START = re.compile(r"(?:19|20)\d\d-(?:0[1-9]|1[0-2])-")


def _phone(text: str) -> Iterator[_Hit]:
    for m in _PHONE.finditer(text):
        s = m.group(0)
        digits = re.sub(r"\D", "", s)
        if not 9 <= len(digits) <= 15:
            continue
        if m.group("dashed") and _DATE_START.match(s):
            continue
        if m.group("trunk") and len(set(re.findall(r"[ .]", s))) > 1:
            continue
        yield _Hit(m.start(), m.end(), "phone", ("+" if s[0] == "+" else "") + digits)


_RUN = re.compile(r"(?<![A-Za-z0-9+/_-])[A-Za-z0-9+/_-]{20,}={0,2}(?![A-Za-z0-9+/_-])")
_SEGMENT = re.compile(r"[^/]+")
_HEX_PART = re.compile(r"[^/_+=-]+")


def _pieces(text: str, start: int, end: int) -> Iterator[tuple[int, int]]:
    """The parts of text[start:end] between placeholders (a placeholder is never a secret)."""
    pos = start
    for m in PLACEHOLDER.finditer(text, start, end):
        yield pos, m.start()
        pos = m.end()
    yield pos, end


def _random_parts(text: str, a: int, b: int) -> Iterator[tuple[int, int]]:
    """Secret-looking spans in one run: per '/' segment first, then the whole run."""
    found = False
    for seg in _SEGMENT.finditer(text, a, b):
        if _looks_random(seg.group(0)):
            found = True
            yield seg.span()
            continue
        for part in _HEX_PART.finditer(text, seg.start(), seg.end()):
            if _looks_hex_secret(text, *part.span()):
                found = True
                yield part.span()
    if not found and "/" in text[a:b] and _looks_random(text[a:b]):
        yield a, b


def _high_entropy(text: str) -> Iterator[_Hit]:
    for m in _RUN.finditer(text):
        if text[max(0, m.start() - 7):m.start()].lower() == "base64,":
            continue  # a data: URI payload (an image), not a secret
        for a, b in _pieces(text, m.start(), m.end()):
            if b - a >= 20:
                for s, e in _random_parts(text, a, b):
                    yield _Hit(s, e, "high_entropy", text[s:e])


_DETECTORS: tuple[tuple[Callable[[str], Iterator[_Hit]], tuple[str, ...]], ...] = (
    # (detector, substrings one of which a match needs: a cheap test that skips the regex)
    (_url_credentials, ("://",)),
    (_jwt, ("eyJ",)),
    (_api_key, ("sk-", "_live_", "_test_", "gh", "xox", "AKIA", "ASIA", "AIza", "hf_", "glpat-",
                "npm_", "earer")),
    (_email, ("@",)),
    (_iban, ()),
    (_credit_card, ()),
    (_ipv6, (":",)),
    (_ipv4, (".",)),
    (_phone, ()),
    (_high_entropy, ()),
)


def _detect(text: str) -> list[_Hit]:
    """Non-overlapping hits, in text order; an earlier detector wins an overlap."""
    starts: list[int] = []
    ends: list[int] = []
    hits: list[_Hit] = []
    for find, needles in _DETECTORS:
        if needles and not any(n in text for n in needles):
            continue
        for h in find(text):
            if not re.search(r"[A-Za-z0-9]", PLACEHOLDER.sub("", text[h.start:h.end])):
                continue
            i = bisect.bisect_right(starts, h.start)
            if (i and ends[i - 1] > h.start) or (i < len(starts) and starts[i] < h.end):
                continue
            starts.insert(i, h.start)
            ends.insert(i, h.end)
            hits.insert(i, h)
    return hits


# -- span bookkeeping ---------------------------------------------------------------------------

Edits = list[tuple[int, int, int]]  # (start, end, replacement length), in the text before


def _back(pos: int, edits: Edits, is_end: bool) -> int:
    """Map a position in the text after ``edits`` to the text before them."""
    shift = 0
    for s, e, n in edits:
        new_s = s + shift
        if pos < new_s or (is_end and pos == new_s):
            break
        if pos < new_s + n or (is_end and pos == new_s + n):
            return e if is_end else s
        shift += n - (e - s)
    return pos - shift


def _mask(value: str) -> str:
    return f"{value[:2]}…({len(value)})"


View = Callable[[str], tuple[str, list[int] | None]]


def _plain(text: str) -> tuple[str, list[int] | None]:
    return text, None


def _regex_view(pattern: str) -> tuple[str, list[int] | None]:
    """A regex pattern with escaped punctuation undone (``a\\.b`` reads ``a.b``); the list maps
    each shown character (and the end) to where its escape sequence starts in the pattern."""
    shown: list[str] = []
    where: list[int] = []
    i = 0
    while i < len(pattern):
        where.append(i)
        if pattern[i] == "\\" and i + 1 < len(pattern) and not pattern[i + 1].isalnum():
            shown.append(pattern[i + 1])
            i += 2
        else:
            shown.append(pattern[i])
            i += 1
    where.append(len(pattern))
    return "".join(shown), where


# -- the anonymizer -----------------------------------------------------------------------------


@dataclass
class _Walk:
    findings: list[Finding] = field(default_factory=list)
    numbers: bool = True
    regex_field: str | None = None


def _join(path: str, key: str) -> str:
    if not path:
        return key
    return path + key if path.endswith("#") else f"{path}.{key}"


_JSONISH = re.compile(r"\s*[\[{]")


class Anonymizer:
    """Consistent pseudonyms keyed by a secret: one value, one placeholder."""

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("the anonymization secret must not be empty")
        self._secret = bytes(secret)

    def placeholder(self, kind: str, key: str) -> str:
        prefix = PREFIX[kind]
        mac = hmac.new(self._secret, f"{prefix}\0{key}".encode(), hashlib.sha256)
        return f"{prefix}_{mac.hexdigest()[:8]}"

    def scrub_text(self, text: str, field: str = "") -> tuple[str, list[Finding]]:
        """The text with every detected item replaced; findings have spans in ``text``."""
        return self._scrub(text, field, _plain)

    def _scrub(self, text: str, field: str, view: View) -> tuple[str, list[Finding]]:
        findings: list[Finding] = []
        history: list[Edits] = []
        for _ in range(_MAX_PASSES):
            shown, where = view(text)
            hits = _detect(shown)
            if not hits:
                break
            parts: list[str] = []
            edits: Edits = []
            pos = 0
            for h in hits:
                s, e = (where[h.start], where[h.end]) if where else (h.start, h.end)
                ph = self.placeholder(h.kind, h.key)
                parts += [text[pos:s], ph]
                pos = e
                edits.append((s, e, len(ph)))
                a, b = s, e
                for old in reversed(history):
                    a, b = _back(a, old, False), _back(b, old, True)
                findings.append(Finding(h.kind, field, a, b, _mask(shown[h.start:h.end])))
            parts.append(text[pos:])
            text = "".join(parts)
            history.append(edits)
        return text, findings

    def scrub_record(self, obj: dict[str, Any]) -> tuple[dict[str, Any], list[Finding]]:
        """A scrubbed copy of one trace record (same keys, same shape) and what was found."""
        out: dict[str, Any] = {}
        findings: list[Finding] = []
        check = obj.get("check")
        kind = check.get("type") if isinstance(check, dict) else None
        for key, value in obj.items():
            if key == "synth" or (key == "prompt" and isinstance(value, list)) or not isinstance(
                    value, str | list | dict):
                out[key] = value  # token ids, hash ids and top-level numbers are not text
                continue
            ctx = _Walk(findings, numbers=not (key == "check" and kind == "number"),
                        regex_field="check.pattern" if kind == "regex" else None)
            out[key] = self._walk(value, key, ctx)
        return out, findings

    def _walk(self, value: Any, path: str, ctx: _Walk) -> Any:
        if isinstance(value, str):
            return self._walk_str(value, path, ctx)
        if isinstance(value, dict):
            return self._walk_dict(value, path, ctx)
        if isinstance(value, list):
            return [self._walk(v, _join(path, str(i)), ctx) for i, v in enumerate(value)]
        if (ctx.numbers and isinstance(value, int) and not isinstance(value, bool)
                and 10**12 <= abs(value) < 10**19):
            new, found = self._scrub(str(value), path, _plain)
            ctx.findings += found
            return new if found else value
        return value

    def _walk_dict(self, value: dict[str, Any], path: str, ctx: _Walk) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, v in value.items():
            new_key, found = self._scrub(key, "", _plain) if isinstance(key, str) else (key, [])
            child = _join(path, str(new_key))
            ctx.findings += [Finding(f.kind, f"{child}(key)", f.start, f.end, f.excerpt)
                             for f in found]
            out[new_key] = self._walk(v, child, ctx)
        return out

    def _walk_str(self, value: str, path: str, ctx: _Walk) -> str:
        if _JSONISH.match(value):
            inner = self._walk_json(value, path, ctx)
            if inner is not None:
                return inner
        view = _regex_view if path == ctx.regex_field else _plain
        new, found = self._scrub(value, path, view)
        ctx.findings += found
        return new

    def _walk_json(self, value: str, path: str, ctx: _Walk) -> str | None:
        """A string holding a JSON object/array: scrub its values, re-serialize if changed."""
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            return None
        if not isinstance(parsed, dict | list):
            return None
        before = len(ctx.findings)
        new = self._walk(parsed, path + "#", ctx)
        return value if len(ctx.findings) == before else json.dumps(new, ensure_ascii=False)


_SCANNER = Anonymizer(b"kvcanary-scan")


def scan_text(text: str) -> list[Finding]:
    """What ``scrub_text`` would replace (findings only; nothing is changed)."""
    return _SCANNER.scrub_text(text)[1]


def scan_record(obj: dict[str, Any]) -> list[Finding]:
    return _SCANNER.scrub_record(obj)[1]


# -- files --------------------------------------------------------------------------------------


def _records(path: Path) -> Iterator[tuple[int, bytes]]:
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if raw.strip():
                yield lineno, raw


def _load_record(raw: bytes, path: Path, lineno: int) -> dict[str, Any]:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise TraceError(str(path), lineno, "(line)", f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise TraceError(str(path), lineno, "(line)", "a trace line must be a JSON object")
    return obj


def anonymize_file(src: Path, dst: Path, secret: bytes) -> dict[str, int]:
    """Scrub a JSONL trace line by line into ``dst`` (written whole or not at all), marking each
    record ``meta.anonymized``. Returns how many items of each kind were replaced."""
    anon = Anonymizer(secret)
    counts = dict.fromkeys(KINDS, 0)
    tmp = dst.with_name(f".{dst.name}.partial")
    try:
        with tmp.open("wb") as out:
            for lineno, raw in _records(src):
                record, found = anon.scrub_record(_load_record(raw, src, lineno))
                meta = record.get("meta", {})
                if not isinstance(meta, dict):
                    raise TraceError(str(src), lineno, "meta", "must be an object")
                record["meta"] = {**meta, "anonymized": dict(MARKER)}
                out.write(orjson.dumps(record) + b"\n")
                for f in found:
                    counts[f.kind] += 1
        tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)
    return counts


def scan_file(path: Path) -> tuple[int, list[tuple[int, Finding]]]:
    """(lines scanned, findings with their line numbers); a line that is not a JSON object is
    scanned as text (field ``(line)``)."""
    lines = 0
    out: list[tuple[int, Finding]] = []
    for lineno, raw in _records(path):
        lines += 1
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            found = scan_record(obj)
        else:
            found = [Finding(f.kind, "(line)", f.start, f.end, f.excerpt)
                     for f in scan_text(raw.decode("utf-8", "replace"))]
        out += [(lineno, f) for f in found]
    return lines, out


def _marked(raw: bytes) -> bool:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    meta = obj.get("meta") if isinstance(obj, dict) else None
    mark = meta.get("anonymized") if isinstance(meta, dict) else None
    return (isinstance(mark, dict) and mark.get("by") == MARKER["by"]
            and isinstance(mark.get("version"), int) and mark["version"] >= 1)


def is_scanned(path: Path) -> bool:
    """True when the trace has records and every one carries the anonymized mark (streams;
    stops at the first unmarked record)."""
    seen = False
    for _, raw in _records(path):
        if not _marked(raw):
            return False
        seen = True
    return seen
