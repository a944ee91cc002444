"""What ``replay trace anonymize`` replaces and ``replay trace scan`` reports: one table of
detectors, used by both, so the two cannot drift.

Detection runs on a folded view of the text (``fold``): characters that NFKC maps to one ASCII
character (full-width ``ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ``, mathematical letters, no-break spaces),
Cyrillic and Greek letters that look like Latin ones, and dash variants are read as their ASCII
look-alike, and zero-width characters are skipped; spans are mapped back, so the original
characters are what gets replaced, and one value written two ways gets one placeholder.

Kinds (``Finding.kind``), in priority order (an earlier kind wins an overlap):

``pem``              a PEM or PGP armoured block (private keys of any type, certificates):
                     ``-----BEGIN …`` through ``-----END …-----`` when a base64 body (after
                     optional ``Proc-Type:``-style headers) follows the BEGIN line; with no END
                     line (a truncated field), through the end of the text, as when the text
                     ends in the BEGIN line itself (``-----BEGIN RSA PRIV``); an END line with the
                     body lines before it (and the tail of a cut BEGIN line, ``IVATE KEY-----``);
                     and body lines alone: a base64 run starting like DER or OpenSSH key data
                     (``MII``/``MIG``/``MHc``/``MC4C``, ``b3BlbnNzaC1rZXkt``) of 40+ characters, or
                     two or more lines of 60-76 base64 characters (the armour's line width).
                     Line breaks may be escaped (``\\n``). Not a block: a marker quoted in code
                     or prose with no body (``b"-----BEGIN OPENSSH PRIVATE KEY-----"``).
``url_credentials``  ``scheme://user:password@host``: the ``user:password`` part.
``jwt``              ``eyJ…`` header, then optionally ``.`` payload and ``.`` signature (a token
                     cut short still counts), whose header decodes to a JSON object with
                     ``"alg"``, or, when the header itself is cut, whose decoded start is
                     ``{"alg"``/``{"typ"``/``{"kid"``… (a pagination cursor is not a JWT).
``api_key``          known prefixes: ``sk-`` (with a digit; 20+ characters, or 6+ at the end of a
                     truncated text), ``sk-proj-``/``sk-ant-`` (6+), ``sk_/pk_/rk_live_|test_``,
                     ``ghp_ gho_ ghu_ ghs_ ghr_``, ``github_pat_``, ``xox[abposr]-``, ``xapp-``,
                     ``AKIA``/``ASIA`` (with a digit), ``AIza``, ``hf_``, ``glpat-``, ``npm_``,
                     ``ya29.``, ``SG.``…``.``…, ``whsec_`` (8+ after most prefixes, so a key cut
                     short is still caught), a Slack webhook path, the token after ``Bearer``
                     (16+ characters with a letter and a digit; 6+ at the end of a truncated
                     text) and the credentials after ``Basic`` (base64 that decodes to printable
                     ``user:password``).
``credential``       a value labelled as a secret: ``?token=…``, ``&sig=…``, ``password=…``,
                     ``pwd: …``, ``"client_secret": "…"``, ``DB_PASSWORD=…``, ``X-Api-Key: …``,
                     ``Authorization: Token …``, ``password := "…"``, and a string under such a key
                     in a JSON object (the value is replaced, the label kept). Labels end in a
                     secret word (``password passwd passphrase pwd secret credentials
                     authorization``…, always; ``token key auth sig signature session sid``: after
                     ``?``/``&``/``;``/``#`` in a URL or a connection string, or after a secret
                     prefix such as ``access_ refresh_ client_ api_ x-amz-``; else only for a
                     value that looks like a key); ``eos_token``, ``max_tokens``, ``sort_key``,
                     ``id_key``, ``monkey`` are not secret labels. Not a value: templates and
                     references (``${X}``, ``<your-key>``, ``%(pw)s``, ``YOUR_API_KEY``,
                     ``$TOKEN``), paths (``pwd: /home/x``), examples (``sk-...``, ``hf_***``,
                     ``my-secret``, ``FOOBAR``, ``123``), names (``"refresh_token"``,
                     ``"X-Access-Token"``), code (``key=lambda…``, ``password=password``,
                     ``token=self.token``, ``key=str.lower``, ``creds = in_memory``,
                     ``private_key: PKCS7PrivateKeyTypes``, ``password: str``), ``None``/
                     ``null``/``redacted``…, and in ``label: value`` form a lone word that is not
                     a whole config line's value (``Password: see the guide``). On ~1.3 M lines
                     of vLLM, transformers, Hugging Face, OpenAI and Anthropic client code, what
                     is left are literal values in examples (``password='IAmSensitive'``).
``email``            ``local@domain.tld`` (Unicode letters allowed); ``john [at] example [dot]
                     com``, ``jane(at)corp(dot)org``, ``bob@example[.]com``; and at the end of a
                     truncated text ``local@`` with a cut domain. Not ``git@host`` (an SSH
                     remote) nor ``name@2x.png`` (an image-density suffix).
``iban``             country code + check digits + BBAN, compact or in groups of four, with the
                     country's registered length and a valid mod-97 checksum; at the end of a
                     truncated text, a grouped IBAN start shorter than its country's length.
``credit_card``      13-19 digits, contiguous or grouped 4-4-4-4(-3) / 4-6-5 / 4-6-4 with one kind
                     of separator (space, dash or dot), a card network's prefix (Visa 4,
                     Mastercard 51-55/2221-2720, Amex 34/37, Discover/UnionPay/Maestro 6,
                     50/56-58, Diners 300-305/36/38/39, JCB 3528-3589) and Luhn-valid; also split
                     across one line break (a wrapped line or a group moved to the next line,
                     not a column of numbers); at the end of a truncated text, 4-4-4(-n) groups
                     with a network prefix. Not after ``-`` (negative).
``ipv6``             ``ipaddress``-valid, at least three groups; not ``::1``/``::``.
``ipv4``             valid octets; not loopback, ``0.0.0.0``, ``255.*`` (netmasks) nor all
                     one-digit octets (``2.6.0.1`` is a version or a section number).
``phone``            9-15 digits: ``+CC`` then groups, ``(area) 555-0132``, dashed groups
                     ``415-555-0132``, dotted ``415.555.0132``, or a trunk ``0`` then groups
                     separated consistently by spaces or dots (``020 7946 0958``). A bare run of
                     digits, a year, a price, a date or ``415 555 0132`` (spaces, no ``+``/``0``)
                     is not a phone number.
``high_entropy``     a run of 20+ base64/base64url characters (12+ at the end of a truncated
                     text) that mixes upper case, lower case and digits, has Shannon entropy >=
                     min(0.84 * log2(len), 4.4) bits a char, splits into many short pieces (>= 0.3
                     pieces a char; pieces are camelCase words, upper-case runs and digit runs)
                     and does not read as words (< 75% of its letters in ``[A-Z]?[a-z]{2,}``
                     words). Runs are tried per ``/`` segment first, then whole. Or a hex run of
                     32+ chars with letters and digits and entropy >= 3 (hex API keys; also
                     unlabelled hex digests: a digest right after ``sha256:``, ``md5``,
                     ``hash``, ``commit ``, ``/blob/``, ``etag``... is kept). Calibrated on random
                     keys (a random base64 key is caught ~98% of the time at 32 chars, ~92% at
                     20) and on the identifiers in ~40 MB of Python (camelCase model/class names
                     with digits and acronyms such as ``DINOv3ViTBackboneOutput`` are the
                     residual false positives). Not flagged: English words, snake/camel/kebab
                     identifiers, file paths, model names, UUIDs (identifiers, not secrets:
                     lower-case hex with dashes), tool-call ids (``call_``, ``toolu_``,
                     ``chatcmpl-``...) and ``data:…;base64,`` payloads.

"The end of a truncated text" is the end of the string, or just before a trailing truncation
mark (``…``, ``...``, ``[truncated]``, ``(+120 chars)``…): what a field cut in the middle of a
secret leaves. Shorter shapes are accepted only there, so ordinary words mid-text are not.

Every regular expression here is linear in its input (bounded repetitions, no nested unbounded
quantifiers over overlapping classes); anything that looks backwards or at the end of the text
works on a bounded window.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import functools
import itertools
import json
import math
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NamedTuple

KINDS = (
    "pem",
    "url_credentials",
    "jwt",
    "api_key",
    "credential",
    "email",
    "iban",
    "credit_card",
    "ipv6",
    "ipv4",
    "phone",
    "high_entropy",
)
PREFIX = {
    "pem": "SECRET",
    "url_credentials": "USER",
    "jwt": "SECRET",
    "api_key": "SECRET",
    "credential": "SECRET",
    "email": "EMAIL",
    "iban": "IBAN",
    "credit_card": "CARD",
    "ipv6": "IP",
    "ipv4": "IP",
    "phone": "PHONE",
    "high_entropy": "SECRET",
}
PLACEHOLDER = re.compile(r"(?:USER|SECRET|EMAIL|IBAN|CARD|IP|PHONE)_[0-9a-f]{8}")


class Hit(NamedTuple):
    start: int
    end: int
    kind: str
    key: str  # canonical value, what the pseudonym is keyed on


# -- the folded view ----------------------------------------------------------------------------

# Letters of other scripts drawn like ASCII ones (the confusables an address or a label is
# disguised with); NFKC does not fold these.
_LOOKALIKE = dict(
    zip(
        "аеорсухѕіјԁԛԝһӏАВЕКМНОРСТУХІЈЅԚԜҮοανρικυΑΒΕΖΗΙΚΜΝΟΡΤΥΧɑɡıȷ‐‑‒–—―−",
        "aeopcyxsijdqwhlABEKMHOPCTYXIJSQWYoavpikuABEZHIKMNOPTYXagij-------",
        strict=True,
    )
)
_INVISIBLE = "\u200b\u200c\u200d\u2060\ufeff\u00ad"
_INVISIBLE_RE = re.compile(f"[{_INVISIBLE}]")


class _FoldTable(dict[int, int | None]):
    """str.translate table filled on first sight of each code point."""

    def __missing__(self, cp: int) -> int | None:
        ch = chr(cp)
        if ch in _INVISIBLE:
            out: int | None = None
        elif ch in _LOOKALIKE:
            out = ord(_LOOKALIKE[ch])
        else:
            norm = unicodedata.normalize("NFKC", ch)
            out = ord(norm) if len(norm) == 1 and norm.isascii() else cp
        self[cp] = out
        return out


_FOLD = _FoldTable()


def fold(text: str) -> tuple[str, list[int] | None]:
    """The text as detectors read it and, when characters were skipped, where each of its
    characters (and its end) is in ``text``; ``None`` when positions are unchanged."""
    if text.isascii():
        return text, None
    shown = text.translate(_FOLD)
    if len(shown) == len(text):
        return shown, None
    where: list[int] = []
    prev = 0
    for m in _INVISIBLE_RE.finditer(text):
        where.extend(range(prev, m.start()))
        prev = m.end()
    where.extend(range(prev, len(text) + 1))
    return shown, where


# -- truncation ---------------------------------------------------------------------------------

_TRUNC_MARK = re.compile(
    r"(?:[ \t]*(?:…|\.{2,}(?!\.)|[\[(<][ \t]*(?:…|\.{3}|[^\])>\n]{0,30}"
    r"(?:truncat|trimm|omitted|more|chars|characters|bytes|cut)[^\])>\n]{0,30})[\])>]))+\s*\Z",
    re.I,
)
_TAIL = 600  # how far before the end a cut item may start


def _cut_end(text: str) -> int:
    """Where a truncated text's content ends: before a trailing truncation mark, if any."""
    base = max(0, len(text) - 160)
    m = _TRUNC_MARK.search(text, base)
    end = m.start() if m else len(text)
    base = max(0, end - _TAIL)
    return base + len(text[base:end].rstrip())


def _at_cut(text: str, pattern: re.Pattern[str]) -> re.Match[str] | None:
    """``pattern`` (ending in ``\\Z``) matched at the end of the truncated text's content."""
    end = _cut_end(text)
    return pattern.search(text, max(0, end - _TAIL), end)


# -- validators ---------------------------------------------------------------------------------


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


_IBAN_LENGTHS = {
    "AD": 24,
    "AE": 23,
    "AL": 28,
    "AT": 20,
    "AZ": 28,
    "BA": 20,
    "BE": 16,
    "BG": 22,
    "BH": 22,
    "BR": 29,
    "BY": 28,
    "CH": 21,
    "CR": 22,
    "CY": 28,
    "CZ": 24,
    "DE": 22,
    "DK": 18,
    "DO": 28,
    "EE": 20,
    "EG": 29,
    "ES": 24,
    "FI": 18,
    "FO": 18,
    "FR": 27,
    "GB": 22,
    "GE": 22,
    "GI": 23,
    "GL": 18,
    "GR": 27,
    "GT": 28,
    "HR": 21,
    "HU": 28,
    "IE": 22,
    "IL": 23,
    "IQ": 23,
    "IS": 26,
    "IT": 27,
    "JO": 30,
    "KW": 30,
    "KZ": 20,
    "LB": 28,
    "LC": 32,
    "LI": 21,
    "LT": 20,
    "LU": 20,
    "LV": 21,
    "MC": 27,
    "MD": 24,
    "ME": 22,
    "MK": 19,
    "MR": 27,
    "MT": 31,
    "MU": 30,
    "NL": 18,
    "NO": 15,
    "PK": 24,
    "PL": 28,
    "PS": 29,
    "PT": 25,
    "QA": 29,
    "RO": 24,
    "RS": 22,
    "SA": 24,
    "SC": 31,
    "SE": 24,
    "SI": 19,
    "SK": 24,
    "SM": 27,
    "ST": 25,
    "SV": 28,
    "TL": 23,
    "TN": 24,
    "TR": 26,
    "UA": 29,
    "VA": 22,
    "VG": 24,
    "XK": 20,
}


def _card_network(digits: str) -> bool:
    """The number starts like a card of a network (Visa, Mastercard, Amex, Discover, Diners,
    JCB, UnionPay, Maestro): a timestamp or an id of 13-19 digits mostly does not."""
    two, four = int(digits[:2]), int(digits[:4])
    return (
        digits[0] in "46"
        or 50 <= two <= 58
        or 2221 <= four <= 2720
        or two in (34, 36, 37, 38, 39)
        or 300 <= int(digits[:3]) <= 305
        or 3528 <= four <= 3589
    )


def _iban_ok(compact: str) -> bool:
    if _IBAN_LENGTHS.get(compact[:2]) != len(compact):
        return False
    rearranged = compact[4:] + compact[:4]
    return int("".join(str(int(ch, 36)) for ch in rearranged)) % 97 == 1


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


def _entropy(s: str) -> float:
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values())


_PIECE = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")
_WORD = re.compile(r"[A-Z]?[a-z]{2,}")
_ID_PREFIXES = (
    "call_",
    "toolu_",
    "chatcmpl-",
    "cmpl-",
    "msg_",
    "resp_",
    "run_",
    "thread_",
    "asst_",
    "req_",
    "batch_",
    "file-",
)


def _word_share(s: str) -> float:
    letters = sum(c.isalpha() for c in s)
    return sum(len(w) for w in _WORD.findall(s)) / letters if letters else 0.0


def _looks_random(s: str, min_len: int = 20) -> bool:
    """A base64-alphabet token that reads as random, not as words (see the module docstring)."""
    n = len(s)
    if n < min_len or s.startswith(_ID_PREFIXES):
        return False
    if not (
        any(c.isupper() for c in s) and any(c.islower() for c in s) and any(c.isdigit() for c in s)
    ):
        return False
    if _entropy(s) < min(0.84 * math.log2(n), 4.4):
        return False
    if len(_PIECE.findall(s)) / n < 0.3:
        return False
    return _word_share(s) < 0.75


_HEX = re.compile(r"[0-9a-f]{32,}|[0-9A-F]{32,}")
_DIGEST_LABEL = re.compile(
    r"(?:sha\d*|md5|blake2[bs]?|digest|checksum|hash|commits?|blob|tree"
    r"|rev(?:ision)?|etag|oid)(?:_?ids?)?[^A-Za-z0-9]{0,4}$",
    re.I,
)


def _looks_hex_secret(text: str, a: int, b: int) -> bool:
    s = text[a:b]
    if not _HEX.fullmatch(s) or s.isdigit() or not any(c.isdigit() for c in s):
        return False
    return _entropy(s) >= 3.0 and not _DIGEST_LABEL.search(text[max(0, a - 20) : a])


# -- pem ----------------------------------------------------------------------------------------

# (?<!-) before a run of dashes: a long run is tried once, from its first dash, not from each.
# A type follows BEGIN/END ("RSA PRIVATE KEY"), unless the text was cut right there.
_PEM_BEGIN = re.compile(r"(?<!-)-{2,}[ \t]?BEGIN(?: [A-Z0-9][A-Z0-9 ]{0,59}-{0,5}|[ \t]*\Z)")
_PEM_END = re.compile(r"(?<!-)-{2,}[ \t]?END(?: [A-Z0-9][A-Z0-9 ]{0,59}-{0,5}|[ \t]*\Z)")
_NL = r"(?:\r?\n|(?:\\r)?\\n)"  # a line break, or its escape in text that was JSON once
_PEM_HEADER = r"[A-Z][A-Za-z-]{2,30}: [^\r\n\\]*"  # Proc-Type, DEK-Info, Comment...
_BODY_LINE = re.compile(r"[ \t]*=?[A-Za-z0-9+/]{4,}={0,2}[ \t]*")
_PEM_LINE = re.compile(rf"[ \t]*(?:=?[A-Za-z0-9+/]{{4,}}={{0,2}}|{_PEM_HEADER})?[ \t]*{_NL}")
_PEM_BODY_AHEAD = re.compile(rf"(?:[ \t]*{_PEM_HEADER}{_NL}|[ \t]*{_NL})*[ \t]*[A-Za-z0-9+/]{{16}}")
_B64_TAIL = re.compile(r"[ \t]*[A-Za-z0-9+/]+={0,2}")
_B64_LINE_END = re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{8,}={0,2}[ \t]*\Z")
# The end of an armour line whose start was cut off: "IVATE KEY-----".
_ARMOUR_TAIL = re.compile(r"(?<![A-Za-z0-9])(?:[A-Z0-9]+ )*[A-Z0-9]{2,}-{2,5}[ \t]*\Z")
_DER_START = re.compile(
    r"(?<![A-Za-z0-9+/])(?:MII|MIG|MHc|MC4C|b3BlbnNzaC1rZXkt)"
    r"[A-Za-z0-9+/]{37,}"
)
_B64_LINES = re.compile(rf"(?<![A-Za-z0-9+/])(?:[A-Za-z0-9+/]{{60,76}}={{0,2}}{_NL}){{2,}}")


def _pem_forward(text: str, pos: int) -> int:
    """The end of the armour lines that start at ``pos`` (and of a last, unterminated one)."""
    while (m := _PEM_LINE.match(text, pos)) and m.end() > pos:
        pos = m.end()
    tail = _B64_TAIL.match(text, pos)
    return tail.end() if tail else pos


def _line_start(text: str, floor: int, end: int) -> tuple[int, int]:
    """(start of the line that ends at ``end``, end of the break before it or -1)."""
    nl, esc = text.rfind("\n", floor, end), text.rfind("\\n", floor, end)
    if nl < 0 and esc < 0:
        return floor, -1
    brk = nl if nl > esc else esc
    return brk + (1 if nl > esc else 2), brk


def _pem_backward(text: str, pos: int) -> int:
    """The start of the base64 lines that end at ``pos``, with the end of the line before them
    when it is base64 or an armour line's tail (a body or a BEGIN line whose start was cut)."""
    floor = max(0, pos - 20000)
    start = line_end = pos
    while True:
        line_start, brk = _line_start(text, floor, line_end)
        end = line_end - (
            2 if text.endswith("\\r", 0, line_end) else 1 if text.endswith("\r", 0, line_end) else 0
        )
        line = text[line_start : max(line_start, end)]
        if not (_BODY_LINE.fullmatch(line) or (line_end == pos and not line.strip())):
            w = max(line_start, end - 128)  # bounded: a search anchored at the end is quadratic
            m = _ARMOUR_TAIL.search(text, w, end) or _B64_LINE_END.search(text, w, end)
            return m.start() if m else start
        start = line_start
        if brk < 0:
            return start
        line_end = brk


def _pem(text: str) -> Iterator[Hit]:
    def hit(a: int, b: int) -> Hit:
        return Hit(a, b, "pem", re.sub(r"\s|\\[rn]", "", text[a:b]))

    pos = 0
    starts: list[int] = []
    stops: list[int] = []
    end: re.Match[str] | None = None
    ends_left = True  # searched once to the end of the text, not once per BEGIN
    while m := _PEM_BEGIN.search(text, pos):
        if ends_left and (end is None or end.start() < m.end()):
            end = _PEM_END.search(text, m.end())
            ends_left = end is not None
        if not (_PEM_BODY_AHEAD.match(text, m.end()) or not text[m.end() :].strip()):
            pos = m.end()  # a BEGIN line quoted in code or prose, no key after it
            continue
        # to the END line, or, cut off inside the block, to the end: the rest is key material
        stop = end.end() if end and ends_left else len(text)
        starts.append(m.start())
        stops.append(stop)
        yield hit(m.start(), stop)
        pos = stop
    done = 0
    for m in _PEM_END.finditer(text):
        i = bisect.bisect_right(starts, m.start())
        if m.start() < done or (i and stops[i - 1] > m.start()):
            continue
        a = _pem_backward(text, m.start())
        if a < m.start() or (a <= 16 and not text[:a].strip(" \t\r\n….\"'")):  # body, or cut
            done = m.end()
            yield hit(a, done)
    for rx in (_DER_START, _B64_LINES):
        done = 0
        for m in rx.finditer(text):
            if m.start() >= done:  # a block's later lines are in it already
                done = _pem_forward(text, m.start())
                yield hit(_pem_backward(text, m.start()), done)


# -- url credentials, jwt, api keys -------------------------------------------------------------

_URL_CREDS = re.compile(
    r"(?<![\w+.-])[A-Za-z][A-Za-z0-9+.-]{0,15}://"
    r"([^\s:/?#@\[\]\"'<>]*):([^\s/?#\[\]\"'<>]+)@(?=[\w\[])"
)


def _url_credentials(text: str) -> Iterator[Hit]:
    for m in _URL_CREDS.finditer(text):
        yield Hit(m.start(1), m.end(2), "url_credentials", text[m.start(1) : m.end(2)])


_JWT = re.compile(r"(?<![\w.-])eyJ[A-Za-z0-9_-]{8,}(?:\.[A-Za-z0-9_-]*){0,2}(?![\w-])")


def _jwt(text: str) -> Iterator[Hit]:
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


def _api_key(text: str) -> Iterator[Hit]:
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
    if cut := _at_cut(text, _SK_CUT):
        yield Hit(cut.start(), cut.end(), "api_key", cut.group(0))
    if cut := _at_cut(text, _BEARER_CUT):
        yield Hit(cut.start(1), cut.end(1), "api_key", cut.group(1))


# -- labelled values ----------------------------------------------------------------------------

_LABEL = re.compile(
    r"(?:pass(?:word|wd|phrase|code)?|pwd|secrets?|token|key|auth(?:orization)?"
    r"|sig(?:nature)?|credentials?|creds|session(?:_?id)?|sid)"
    r"(?P<q>\\?[\"'])?[ \t]{0,3}(?P<sep>:=|=>|[:=](?![=:]))[ \t]{0,3}",
    re.I,
)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_ALWAYS = frozenset(
    {
        "password",
        "passwd",
        "passphrase",
        "passcode",
        "pwd",
        "secret",
        "secrets",
        "credential",
        "credentials",
        "creds",
        "authorization",
    }
)
_SOMETIMES = frozenset(
    {"token", "key", "auth", "sig", "signature", "session", "sessionid", "sid", "pass"}
)
# A label glued into one word (apikey, clientsecret, csrftoken): its secret word is split off.
_GLUED = ("password", "passwd", "signature", "secret", "token", "key", "auth", "sig")
_SECRET_PREFIX = frozenset(
    {
        "access",
        "refresh",
        "auth",
        "session",
        "bearer",
        "api",
        "oauth",
        "oauth2",
        "csrf",
        "xsrf",
        "client",
        "app",
        "private",
        "secret",
        "master",
        "signing",
        "encryption",
        "license",
        "subscription",
        "account",
        "service",
        "personal",
        "admin",
        "user",
        "db",
        "database",
        "basic",
        "http",
        "proxy",
        "webhook",
        "jwt",
        "amz",
        "goog",
        "aws",
        "azure",
        "gcp",
        "github",
        "gitlab",
        "slack",
        "hf",
        "openai",
        "anthropic",
        "stripe",
        "twilio",
        "sendgrid",
        "deploy",
        "upload",
        "reset",
        "verify",
        "verification",
        "invite",
        "magic",
        "login",
        "sas",
        "storage",
        "consumer",
        "bot",
        "vault",
        "hmac",
        "shared",
        "smtp",
        "mail",
        "ftp",
        "ssh",
        "redis",
        "postgres",
        "mysql",
        "mongo",
        "ldap",
        "wifi",
    }
)
_SCHEME = re.compile(r"(?:bearer|basic|token|digest|apikey|key|bot|oauth|ssws|jwt)[ \t]+", re.I)
# An unquoted value ends at a separator; "=" only as base64 padding (key=key=... is no value).
_UNQUOTED = re.compile(r"[^\s\"'`<>&;,()\[\]{}\\=]{1,256}={0,2}")
_DUMMY = frozenset(
    {
        "none",
        "null",
        "nil",
        "true",
        "false",
        "undefined",
        "lambda",
        "self",
        "cls",
        "len",
        "str",
        "int",
        "bytes",
        "string",
        "object",
        "any",
        "optional",
        "required",
        "redacted",
        "hidden",
        "masked",
        "removed",
        "omitted",
        "censored",
        "value",
        "example",
        "placeholder",
        "your",
        "here",
        "env",
        "default",
        "empty",
        "unset",
        "not",
        "set",
        "n/a",
        "tbd",
        "todo",
        "foo",
        "bar",
        "baz",
        "test",
        "dummy",
        "secret",
        "password",
        "token",
        "key",
        "name",
        "bool",
        "dict",
        "list",
        "text",
        "char",
        "varchar",
        "yes",
        "no",
        "on",
        "off",
        "enabled",
        "disabled",
        "auto",
        "see",
        "xxx",
        "include",
        "omit",
        "same-origin",
        "bearer",
        "basic",
        "digest",
        "await",
        "yield",
        "async",
        "return",
        "if",
        "else",
        "in",
        "is",
        "and",
        "or",
        "new",
        "this",
    }
)
_TEMPLATE = re.compile(r"[$%{<*!]|.*?(?:\{\{|\$\{|%\()")
_PATH = re.compile(r"(?:/|~/|\.\.?/|[A-Za-z]:\\)")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_NAME_VALUE = re.compile(r"[A-Za-z_][\w-]*")
_ELIDED = re.compile(r".*?(?:\.\.\.|…|\*\*\*)")  # sk-..., hf_***: an example, not a key
# Words that make a value without digits describe itself: my-secret, your-api-key, FOOBAR.
_EXAMPLE_WORDS = frozenset(
    {
        "secret",
        "secrets",
        "password",
        "passwd",
        "pass",
        "pwd",
        "key",
        "token",
        "apikey",
        "api",
        "example",
        "sample",
        "dummy",
        "fake",
        "test",
        "your",
        "my",
        "placeholder",
        "here",
        "value",
        "demo",
        "changeme",
        "foo",
        "bar",
        "xxx",
    }
)
_CAPS_WORD = re.compile(r"[A-Z]{2,12}")
_SNAKE = re.compile(r"_?[a-z]+(?:_[a-z0-9]+)+|[a-z]+(?:[A-Z][a-z]+)+")  # creds_file, inMemory
# A type in an annotation: private_key: PKCS7PrivateKeyTypes, password: SecretStr.
_TYPE_NAME = re.compile(r"_?(?:[A-Z][A-Z0-9]*[a-z0-9]*){2,}")
_LINE_HEAD = re.compile(r"(?:^|[\n{,])[ \t]*(?:- )?[\"']?\Z")
_ENV_NAME = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")
_KEYLIKE = re.compile(r"[A-Za-z0-9+/=_.~%-]{8,}")
_LETTERS = re.compile(r"[^\W\d_]+")
_MORE_WORDS = re.compile(r"[ \t]+[^\s,;}\]]")  # the line goes on: prose, not a config value
_ALWAYS_SECRET, _SOMETIMES_SECRET = 2, 1


@functools.lru_cache(maxsize=4096)
def _label_words(name: str) -> tuple[str, ...]:
    words = [w for w in re.split(r"[_.\-]+", _CAMEL.sub("_", name).lower()) if w]
    if len(words) >= 2 and words[-2:] == ["session", "id"]:
        words[-2:] = ["sessionid"]
    if words and words[-1] not in _ALWAYS | _SOMETIMES:
        glued = next((g for g in _GLUED if words[-1].endswith(g)), None)
        head = words[-1][: -len(glued)] if glued else ""
        if glued and (glued in _ALWAYS or head in _SECRET_PREFIX):  # not monkey, oauth
            words[-1:] = [head, glued]
    return tuple(words)


@functools.lru_cache(maxsize=4096)
def _label_strength(name: str, in_query: bool = False) -> int:
    """How surely a value under this name is a secret: always (``password``, ``client_secret``,
    ``?token=``), sometimes (``token``, ``eos_token``: only a key-like value) or not (0)."""
    words = _label_words(name)
    if not words:
        return 0
    last, prefix = words[-1], words[:-1]
    if last in _ALWAYS:
        return _ALWAYS_SECRET
    if last not in _SOMETIMES:
        return 0
    if prefix:
        return _ALWAYS_SECRET if _SECRET_PREFIX.intersection(prefix) else _SOMETIMES_SECRET
    return _ALWAYS_SECRET if in_query else _SOMETIMES_SECRET


def _keylike(v: str) -> bool:
    return (
        bool(_KEYLIKE.fullmatch(v))
        and any(c.isdigit() for c in v)
        and any(c.isalpha() for c in v)
        and _word_share(v) < 0.6
    )


def _value_is_secret(value: str, strength: int, code_like: bool = False) -> bool:
    """A labelled value that is a secret, not a template, a reference, a path or a word;
    ``code_like``: unquoted outside a URL, so it may be an expression (a variable passed on)."""
    v = value.strip()
    if len(v) < 3 or PLACEHOLDER.fullmatch(v) or len(set(v)) == 1:
        return False
    if _TEMPLATE.match(v) or _PATH.match(v) or v.lower() in _DUMMY or _ENV_NAME.fullmatch(v):
        return False
    if _ELIDED.match(v) or (v.isdigit() and len(v) < 6) or v.startswith("__"):
        return False
    if not any(c.isdigit() for c in v) and (
        _CAPS_WORD.fullmatch(v)
        or _EXAMPLE_WORDS.intersection(_label_words(v))
        or (_NAME_VALUE.fullmatch(v) and _label_strength(v))
    ):
        return False  # FOOBAR, my-secret, GRANT_TYPE = "refresh_token": a name, not a value
    if strength < _ALWAYS_SECRET:
        return _keylike(v)
    # key=str.lower, password=auth_from_netrc, creds=in_memory: an expression or a variable
    return not (code_like and (_DOTTED.fullmatch(v) or _SNAKE.fullmatch(v)))


def _value_start(text: str, pos: int, name: str) -> int:
    """Past an authorization scheme (``Bearer``, ``Basic``, ``Token``...), which is no secret."""
    m = _SCHEME.match(text, pos)
    return m.end() if m and _label_words(name)[-1:] in (("authorization",), ("auth",)) else pos


def _label_hit(text: str, label: str) -> Iterator[Hit]:
    """The whole string, when it is the value of a secret-labelled key of a JSON object."""
    strength = _label_strength(label)
    a = _value_start(text, len(text) - len(text.lstrip()), label)
    b = len(text.rstrip())
    if strength and a < b and _value_is_secret(text[a:b], strength):
        yield Hit(a, b, "credential", text[a:b])


def _quoted_end(text: str, pos: int, quote: str) -> int | None:
    """The closing quote of a value, or the end of a text cut off inside it; not past a line."""
    close = text.find(quote, pos, pos + 513)
    stop = close if close >= 0 else min(len(text), pos + 513)
    if "\n" in text[pos:stop]:
        return None
    if close < 0:
        return len(text) if len(text) - pos <= 512 else None
    return close


def _labelled_value(text: str, m: re.Match[str]) -> tuple[int, int] | None:
    word_end = m.start("q") if m.group("q") else m.start("sep")
    while word_end > m.start() and text[word_end - 1] in " \t":
        word_end -= 1
    nm = _NAME.search(text, max(0, word_end - 64), word_end)
    if nm is None:
        return None
    name = nm.group(0).lstrip(".-_")
    start = word_end - len(name)
    in_query = start > 0 and text[start - 1] in "?&;#" and m.group("sep") == "="
    strength = _label_strength(name, in_query)
    if not strength:
        return None
    pos = _value_start(text, m.end(), name)
    quote = next((q for q in ('\\"', "\\'", '"', "'", "`") if text.startswith(q, pos)), None)
    if quote:
        pos += len(quote)
        end = _quoted_end(text, pos, quote)
        if end is None:
            return None
        code_like = False
    else:
        um = _UNQUOTED.match(text, pos)
        if um is None:
            return None
        end = um.end()
        if _ELIDED.match(text, pos, end):
            return None  # OPENAI_API_KEY=sk-...: an example
        while end > pos and text[end - 1] in ".:":
            end -= 1
        if text[end : end + 1] in ("(", "[") and not in_query:
            return None  # a call or a subscript
        code_like = not in_query
        if m.group("sep") == ":" and not in_query and _colon_prose(text, start, pos, end):
            return None
        spaced = m.group(0)[-1:] in " \t" or text[m.start("sep") - 1 : m.start("sep")] in " \t"
        if (
            code_like
            and spaced
            and m.group("sep") != ":"
            and _IDENT.fullmatch(text, pos, end)
            and not any(c.isdigit() for c in text[pos:end])
        ):
            return None  # credential = configuration: an assignment from a variable
    if not _value_is_secret(text[pos:end], strength, code_like):
        return None
    return pos, end


def _colon_prose(text: str, start: int, pos: int, end: int) -> bool:
    """``label: value`` that is prose or a type, not a config line: a lone word that is not a
    whole line's value ("Password: see the guide", "standing credential: polling"), or a
    type name (``private_key: PKCS7PrivateKeyTypes``)."""
    v = text[pos:end]
    if _TYPE_NAME.fullmatch(v) and _word_share(v) >= 0.75:
        return True
    if not _LETTERS.fullmatch(v):
        return False
    return bool(_MORE_WORDS.match(text, end)) or not _LINE_HEAD.search(
        text, max(0, start - 8), start
    )


def _credential(text: str) -> Iterator[Hit]:
    for m in _LABEL.finditer(text):
        span = _labelled_value(text, m)
        if span:
            yield Hit(span[0], span[1], "credential", text[span[0] : span[1]])


# -- emails -------------------------------------------------------------------------------------

_EMAIL = re.compile(r"(?<![\w.%+-])([^\W_][\w.%+-]*)@((?:[\w-]+\.)+([^\W\d_]{2,24}))(?![\w-])")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")
_CJK_TLDS = frozenset(
    {
        "中国",
        "中國",
        "公司",
        "网络",
        "網絡",
        "香港",
        "台灣",
        "台湾",
        "新加坡",
        "みんな",
        "コム",
        "닷컴",
        "한국",
    }
)
_DENSITY_SUFFIX = re.compile(r"\d+(?:\.\d+)?x\.")
_AT = r"(?:[ \t]{0,2}[\[({][ \t]{0,2}(?:[Aa][Tt]|@)[ \t]{0,2}[\])}][ \t]{0,2}|@)"
_DOT = r"(?:[ \t]{0,2}[\[({][ \t]{0,2}(?:[Dd][Oo][Tt]|\.)[ \t]{0,2}[\])}][ \t]{0,2}|\.)"
_EMAIL_OBF = re.compile(
    rf"(?<![\w.%+-])([A-Za-z0-9][\w.%+-]*){_AT}"
    rf"((?:[A-Za-z0-9-]+{_DOT})+[A-Za-z]{{2,24}})(?![\w-])"
)
_DOT_RE = re.compile(_DOT)
_EMAIL_CUT = re.compile(r"(?<![\w.%+-])([^\W_][\w.%+-]{1,63})@([^\W_][\w-]*(?:\.[\w-]*)*)?\Z")


def _email_ok(local: str, domain: str, tld: str) -> bool:
    if local == "git" or PLACEHOLDER.search(local) or _DENSITY_SUFFIX.match(domain):
        return False
    return "_" not in domain and (tld in _CJK_TLDS or not _CJK.search(tld))


def _email(text: str) -> Iterator[Hit]:
    for m in _EMAIL.finditer(text):
        if _email_ok(m.group(1), m.group(2), m.group(3)):
            yield Hit(m.start(), m.end(), "email", m.group(0).lower())
    if "[" in text or "(" in text or "{" in text:
        for m in _EMAIL_OBF.finditer(text):
            domain = _DOT_RE.sub(".", m.group(2))
            if _email_ok(m.group(1), domain, domain.rsplit(".", 1)[-1]):
                yield Hit(m.start(), m.end(), "email", f"{m.group(1)}@{domain}".lower())
    cut = _at_cut(text, _EMAIL_CUT)
    if (
        cut
        and _email_ok(cut.group(1), cut.group(2) or "", "")
        and not (cut.group(2) or "a")[0].isdigit()
        and not PLACEHOLDER.search(cut.group(0))
    ):
        yield Hit(cut.start(), cut.end(), "email", cut.group(0).lower())


# -- iban, cards --------------------------------------------------------------------------------

_IBAN = re.compile(
    r"(?<![A-Za-z0-9])[A-Z]{2}\d{2}"
    r"(?:[A-Z0-9]{11,30}|(?: [A-Z0-9]{4}){2,7}(?: [A-Z0-9]{1,3})?)(?![A-Za-z0-9])"
)
_IBAN_CUT = re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}\d{2}(?: [A-Z0-9]{4}){2,7}(?: [A-Z0-9]{1,3})?\Z")


def _iban(text: str) -> Iterator[Hit]:
    for m in _IBAN.finditer(text):
        compact = m.group(0).replace(" ", "")
        if _iban_ok(compact):
            yield Hit(m.start(), m.end(), "iban", compact)
    if cut := _at_cut(text, _IBAN_CUT):
        compact = cut.group(0).replace(" ", "")
        if len(compact) < _IBAN_LENGTHS.get(compact[:2], 0):
            yield Hit(cut.start(), cut.end(), "iban", compact)


_CARD_SHAPE = r"""(?:
      \d{13,19}
    | \d{4}([ .-])\d{4}\1\d{4}\1\d{1,4}(?:\1\d{1,3})?
    | \d{4}([ .-])\d{6}\2\d{4,5}
    )"""
_CARD = re.compile(rf"(?<![\w.+-]){_CARD_SHAPE}(?!\w|[.,]\d)", re.X)
_CARD_FULL = re.compile(_CARD_SHAPE, re.X)
# Digits around one line break (a wrapped line, or a group moved to the next line), with a
# separator before the break, if any; which of them form the number is _split_card's work.
_BREAK = rf"[ \t]{{0,2}}[.-]?[ \t]{{0,2}}{_NL}[ \t]{{0,2}}"
_CARD_SPLIT = re.compile(
    rf"(?<![\w.+-])\d(?:[ .-]?\d){{0,18}}(?P<br>{_BREAK})"
    r"\d(?:[ .-]?\d){0,18}"
)
_CARD_CUT = re.compile(r"(?<![\w.+-])\d{4}([ .-])\d{4}\1\d{4}(?:\1\d{1,3})?\Z")
_GROUP = re.compile(r"\d+")
_COLUMN_ABOVE = re.compile(rf"\d[ \t]*{_NL}[ \t]*\Z")
_COLUMN_BELOW = re.compile(rf"[ \t]*{_NL}[ \t]*\d")
_NOT_AFTER = re.compile(r"\w|[.,]\d")
_NOT_DIGITS = str.maketrans("", "", " .-\t\r\n\\rn")


def _card_digits(s: str) -> str | None:
    digits = re.sub(r"\D", "", s)
    ok = 13 <= len(digits) <= 19 and _card_network(digits) and _luhn(digits)
    return digits if ok else None


def _split_card(text: str, m: re.Match[str]) -> tuple[int, int, str] | None:
    """The card number across the line break of a _CARD_SPLIT match: up to five digit groups
    each side, the break read as the separator it carries, as the number's separator, or as
    nothing (a wrapped line; then not when a number ends the line above or starts the line
    below: that is a column of numbers)."""
    a, b = m.span("br")
    left = [g.span() for g in _GROUP.finditer(text, m.start(), a)][-5:]
    right = [g.span() for g in _GROUP.finditer(text, b, m.end())][:5]
    mark = text[a:b].strip(" \t\r\n\\rn")
    used = set(re.findall(r"[ .-]", text[left[0][0] : a] + text[b : right[-1][1]]))
    if len(used) > 1:
        return None
    seps = [mark] if mark else ["", *used]
    for i, (s, _) in enumerate(left):
        if s and (text[s - 1].isalnum() or text[s - 1] in "_.+-"):
            continue
        head = "".join(text[x:y] for x, y in left[i:])
        for j in range(len(right), 0, -1):
            e = right[j - 1][1]
            digits = head + "".join(text[x:y] for x, y in right[:j])
            if not (13 <= len(digits) <= 19 and _card_network(digits) and _luhn(digits)):
                continue
            if _NOT_AFTER.match(text, e):
                continue
            for sep in seps:
                if not _CARD_FULL.fullmatch(text[s:a] + sep + text[b:e]):
                    continue
                if not (sep or used or mark) and (
                    _COLUMN_ABOVE.search(text, max(0, s - 40), s) or _COLUMN_BELOW.match(text, e)
                ):
                    continue
                return s, e, digits
    return None


def _credit_card(text: str) -> Iterator[Hit]:
    for m in _CARD.finditer(text):
        if digits := _card_digits(m.group(0)):
            yield Hit(m.start(), m.end(), "credit_card", digits)
    if "\n" in text or "\\n" in text:
        for m in _CARD_SPLIT.finditer(text):
            # at least 13 digits: counted in C before any parsing in Python
            if len(m.group().translate(_NOT_DIGITS)) >= 13 and (found := _split_card(text, m)):
                yield Hit(*found[:2], "credit_card", found[2])
    if cut := _at_cut(text, _CARD_CUT):
        digits = re.sub(r"\D", "", cut.group(0))
        if _card_network(digits):
            yield Hit(cut.start(), cut.end(), "credit_card", digits)


# -- ip addresses, phones -----------------------------------------------------------------------

_IPV6 = re.compile(
    r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}"
    r"(?:(?:\d{1,3}\.){3}\d{1,3}|[0-9A-Fa-f]{0,4})(?![\w:]|\.\d)"
)


def _ipv6(text: str) -> Iterator[Hit]:
    import ipaddress

    for m in _IPV6.finditer(text):
        s = m.group(0)
        try:
            addr = ipaddress.IPv6Address(s)
        except ValueError:
            continue
        groups = len([g for g in s.split(":") if g]) + ("." in s)
        if groups >= 3 and not (addr.is_loopback or addr.is_unspecified):
            yield Hit(m.start(), m.end(), "ipv6", str(addr))


_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\w.])(?:{_OCTET}\.){{3}}{_OCTET}(?![\w]|\.\d)")


def _ipv4(text: str) -> Iterator[Hit]:
    import ipaddress

    for m in _IPV4.finditer(text):
        addr = ipaddress.IPv4Address(m.group(0))
        if addr.is_loopback or addr.is_unspecified or m.group(0).startswith("255."):
            continue
        if max(len(octet) for octet in m.group(0).split(".")) > 1:  # not 2.6.0.1 (a version)
            yield Hit(m.start(), m.end(), "ipv4", str(addr))


_PHONE = re.compile(
    r"""(?<![\w+.-])(?<!\d\s)(?:
      (?P<intl>\+\d{1,3}(?:[ .-]?(?:\(\d{1,4}\)|\d{1,4})){2,6})
    | (?P<area>\(\d{2,4}\)[ .-]?\d{2,4}(?:[ .-]\d{2,4}){1,3})
    | (?P<dashed>(?:1-)?\d{2,4}(?:-\d{2,4}){2,3})
    | (?P<dotted>\d{3}\.\d{3}\.\d{4})
    | (?P<trunk>0\d{1,4}(?:[ .]\d{2,4}){2,4})
    )(?![\w]|[.-]\d)""",
    re.X,
)
_DATE_START = re.compile(r"(?:19|20)\d\d-(?:0[1-9]|1[0-2])-")


def _phone(text: str) -> Iterator[Hit]:
    for m in _PHONE.finditer(text):
        s = m.group(0)
        digits = re.sub(r"\D", "", s)
        if not 9 <= len(digits) <= 15:
            continue
        if m.group("dashed") and _DATE_START.match(s):
            continue
        if m.group("trunk") and len(set(re.findall(r"[ .]", s))) > 1:
            continue
        yield Hit(m.start(), m.end(), "phone", ("+" if s[0] == "+" else "") + digits)


# -- high entropy -------------------------------------------------------------------------------

_RUN = re.compile(r"(?<![A-Za-z0-9+/_-])[A-Za-z0-9+/_-]{20,}={0,2}(?![A-Za-z0-9+/_-])")
_RUN_CUT = re.compile(r"(?<![A-Za-z0-9+/_-])[A-Za-z0-9+/_-]{12,19}={0,2}\Z")
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


def _high_entropy(text: str) -> Iterator[Hit]:
    for m in _RUN.finditer(text):
        if text[max(0, m.start() - 7) : m.start()].lower() == "base64,":
            continue  # a data: URI payload (an image), not a secret
        for a, b in _pieces(text, m.start(), m.end()):
            if b - a >= 20:
                for s, e in _random_parts(text, a, b):
                    yield Hit(s, e, "high_entropy", text[s:e])
    cut = _at_cut(text, _RUN_CUT)
    if cut and not PLACEHOLDER.search(cut.group(0)) and _looks_random(cut.group(0), 12):
        yield Hit(cut.start(), cut.end(), "high_entropy", cut.group(0))


# -- the table ----------------------------------------------------------------------------------

Detector = Callable[[str], Iterator[Hit]]
DETECTORS: tuple[tuple[Detector, tuple[str, ...]], ...] = (
    # (detector, substrings one of which a match needs: a cheap test that skips the regex)
    (_pem, ()),
    (_url_credentials, ("://",)),
    (_jwt, ("eyJ",)),
    (
        _api_key,
        (
            "sk-",
            "_live_",
            "_test_",
            "gh",
            "xox",
            "xapp-",
            "AKIA",
            "ASIA",
            "AIza",
            "hf_",
            "glpat-",
            "npm_",
            "ya29.",
            "SG.",
            "whsec_",
            "hooks.slack",
            "earer",
            "asic",
        ),
    ),
    (_credential, (":", "=")),
    (_email, ("@", "[", "(", "{")),
    (_iban, ()),
    (_credit_card, ()),
    (_ipv6, (":",)),
    (_ipv4, (".",)),
    (_phone, ()),
    (_high_entropy, ()),
)
_ALNUM = re.compile(r"[A-Za-z0-9]")


def detect(text: str, label: str | None = None) -> list[Hit]:
    """Non-overlapping hits, in text order; an earlier detector wins an overlap, and within one
    detector an earlier hit does. ``label``: the JSON key the text is the value of."""
    starts: list[int] = []
    ends: list[int] = []
    hits: list[Hit] = []
    for find, needles in DETECTORS:
        found = find(text) if not needles or any(n in text for n in needles) else iter(())
        if find is _credential and label:
            found = itertools.chain(_label_hit(text, label), found)
        new: list[Hit] = []
        new_starts: list[int] = []
        new_ends: list[int] = []
        for h in found:
            if not _ALNUM.search(PLACEHOLDER.sub("", text[h.start : h.end])):
                continue
            if _overlaps(starts, ends, h) or _overlaps(new_starts, new_ends, h):
                continue
            i = bisect.bisect_right(new_starts, h.start)  # mostly an append: hits come in order
            new_starts.insert(i, h.start)
            new_ends.insert(i, h.end)
            new.insert(i, h)
        if new:  # merging two sorted lists keeps this linear in the number of hits
            hits = sorted(hits + new)
            starts = [h.start for h in hits]
            ends = [h.end for h in hits]
    return hits


def _overlaps(starts: list[int], ends: list[int], h: Hit) -> bool:
    i = bisect.bisect_right(starts, h.start)
    return bool((i and ends[i - 1] > h.start) or (i < len(starts) and starts[i] < h.end))
