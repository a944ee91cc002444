"""Tokens that read as random rather than as words: the entropy and word-shape tests behind the
``high_entropy`` detector (calibrated as the package docstring says), and the detector."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterator

from replay.tools.pii._reading import PLACEHOLDER, Hit, at_cut

# -- randomness ---------------------------------------------------------------------------------


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


def word_share(s: str) -> float:
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
    return word_share(s) < 0.75


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


def high_entropy(text: str) -> Iterator[Hit]:
    for m in _RUN.finditer(text):
        if text[max(0, m.start() - 7) : m.start()].lower() == "base64,":
            continue  # a data: URI payload (an image), not a secret
        for a, b in _pieces(text, m.start(), m.end()):
            if b - a >= 20:
                for s, e in _random_parts(text, a, b):
                    yield Hit(s, e, "high_entropy", text[s:e])
    cut = at_cut(text, _RUN_CUT)
    if cut and not PLACEHOLDER.search(cut.group(0)) and _looks_random(cut.group(0), 12):
        yield Hit(cut.start(), cut.end(), "high_entropy", cut.group(0))
