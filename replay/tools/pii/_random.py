"""Tokens that read as random rather than as words: the entropy and word-shape tests behind the
``high_entropy`` detector (calibrated as the package docstring says), and the detector, which
takes a bare AWS secret access key whole."""

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


def _looks_random(s: str, min_len: int = 20, min_entropy: float = 4.4) -> bool:
    """A base64-alphabet token that reads as random, not as words (see the module docstring)."""
    n = len(s)
    if n < min_len or s.startswith(_ID_PREFIXES):
        return False
    if not (
        any(c.isupper() for c in s) and any(c.islower() for c in s) and any(c.isdigit() for c in s)
    ):
        return False
    if _entropy(s) < min(0.84 * math.log2(n), min_entropy):
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


# A bare AWS secret access key: exactly 40 characters of base64's alphabet, taken whole before
# the runs below, whose per-``/``-segment test leaves parts of ~40% of random ones (and all of
# some). The entropy floor is a little lower than a run's: this length and alphabet are rare
# outside keys (calibration in the package docstring).
_AWS_SECRET = re.compile(r"(?<![A-Za-z0-9+/_-])[A-Za-z0-9+/]{40}(?![A-Za-z0-9+/=_-])")
_AWS_MIN_ENTROPY = 4.3  # bits a char; random keys: median 4.78, 0.1% below 4.35; hex: <= 4


def _data_uri_payload(text: str, start: int) -> bool:
    return text[max(0, start - 7) : start].lower() == "base64,"  # an image, not a secret


def high_entropy(text: str) -> Iterator[Hit]:
    for m in _AWS_SECRET.finditer(text):
        key = m.group(0)
        if not _data_uri_payload(text, m.start()) and _looks_random(key, 40, _AWS_MIN_ENTROPY):
            yield Hit(m.start(), m.end(), "high_entropy", key)
    for m in _RUN.finditer(text):
        if _data_uri_payload(text, m.start()):
            continue
        for a, b in _pieces(text, m.start(), m.end()):
            if b - a >= 20:
                for s, e in _random_parts(text, a, b):
                    yield Hit(s, e, "high_entropy", text[s:e])
    cut = at_cut(text, _RUN_CUT)
    if cut and not PLACEHOLDER.search(cut.group(0)) and _looks_random(cut.group(0), 12):
        yield Hit(cut.start(), cut.end(), "high_entropy", cut.group(0))
