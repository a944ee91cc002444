"""How every detector reads a text: the hit it reports, the placeholders it leaves alone, the
folded view of look-alike characters, and where a truncated text's content ends (the only place
shorter, cut-off shapes are accepted)."""

from __future__ import annotations

import re
import unicodedata
from typing import NamedTuple

# What the anonymizer writes in place of a value: never detected again.
PLACEHOLDER = re.compile(r"(?:USER|SECRET|EMAIL|IBAN|CARD|IP|PHONE)_[0-9a-f]{8}")
NL = r"(?:\r?\n|(?:\\r)?\\n)"  # a line break, or its escape in text that was JSON once


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
# The characters an address is written with, percent-encoded (``kim%40example.com``, as a URL's
# query string has it) or as an HTML character reference (``kim&#64;example.com``,
# ``&#x40;``, ``&commat;``): read as the character itself.
_ENCODED = {
    "@": r"%40|&#0*64;|&#[xX]0*40;|&commat;",
    ".": r"%2[eE]|&#0*46;|&#[xX]0*2[eE];|&period;",
}
_DECODE = re.compile(
    "|".join(f"(?P<{'at' if ch == '@' else 'dot'}>{rx})" for ch, rx in _ENCODED.items())
)
_SPECIAL = re.compile(f"[{_INVISIBLE}]|{_DECODE.pattern}")


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
    """The text as detectors read it and, when characters were skipped or encoded ones read as
    one, where each of its characters (and its end) is in ``text``; ``None`` when positions are
    unchanged."""
    plain = text.isascii()
    if plain and "%" not in text and "&" not in text:
        return text, None
    if not _SPECIAL.search(text):
        return (text if plain else text.translate(_FOLD)), None
    parts: list[str] = []
    where: list[int] = []
    prev = 0
    for m in _SPECIAL.finditer(text):
        parts.append(text[prev : m.start()].translate(_FOLD))
        where.extend(range(prev, m.start()))
        if m.lastgroup is not None:  # an encoded character, read as itself
            parts.append("@" if m.lastgroup == "at" else ".")
            where.append(m.start())
        prev = m.end()
    parts.append(text[prev:].translate(_FOLD))
    where.extend(range(prev, len(text) + 1))
    return "".join(parts), where


# -- truncation ---------------------------------------------------------------------------------

_TRUNC_MARK = re.compile(
    r"(?:[ \t]*(?:…|\.{2,}(?!\.)|[\[(<][ \t]*(?:…|\.{3}|[^\])>\n]{0,30}"
    r"(?:truncat|trimm|omitted|more|chars|characters|bytes|cut)[^\])>\n]{0,30})[\])>]))+\s*\Z",
    re.I,
)
_TAIL = 600  # how far before the end a cut item may start


def cut_end(text: str) -> int:
    """Where a truncated text's content ends: before a trailing truncation mark, if any."""
    base = max(0, len(text) - 160)
    m = _TRUNC_MARK.search(text, base)
    end = m.start() if m else len(text)
    base = max(0, end - _TAIL)
    return base + len(text[base:end].rstrip())


def at_cut(text: str, pattern: re.Pattern[str]) -> re.Match[str] | None:
    """``pattern`` (ending in ``\\Z``) matched at the end of the truncated text's content."""
    end = cut_end(text)
    return pattern.search(text, max(0, end - _TAIL), end)
