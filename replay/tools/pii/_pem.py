"""PEM and PGP armoured blocks: from a BEGIN line to its END line or the end of a cut text, an
END line with the body lines before it, and body lines alone (DER or OpenSSH key data, or lines
of the armour's width)."""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator

from replay.tools.pii._reading import NL, Hit, cut_end

# (?<!-) before a run of dashes: a long run is tried once, from its first dash, not from each.
# A type follows BEGIN/END ("RSA PRIVATE KEY"), unless the text was cut right there.
_PEM_BEGIN = re.compile(r"(?<!-)-{2,}[ \t]?BEGIN(?: [A-Z0-9][A-Z0-9 ]{0,59}-{0,5}|[ \t]*\Z)")
_PEM_END = re.compile(r"(?<!-)-{2,}[ \t]?END(?: [A-Z0-9][A-Z0-9 ]{0,59}-{0,5}|[ \t]*\Z)")


_PEM_HEADER = r"[A-Z][A-Za-z-]{2,30}: [^\r\n\\]*"  # Proc-Type, DEK-Info, Comment...
_BODY_LINE = re.compile(r"[ \t]*=?[A-Za-z0-9+/]{4,}={0,2}[ \t]*")
_PEM_LINE = re.compile(rf"[ \t]*(?:=?[A-Za-z0-9+/]{{4,}}={{0,2}}|{_PEM_HEADER})?[ \t]*{NL}")
_PEM_BODY_AHEAD = re.compile(rf"(?:[ \t]*{_PEM_HEADER}{NL}|[ \t]*{NL})*[ \t]*[A-Za-z0-9+/]{{16}}")
_B64_TAIL = re.compile(r"[ \t]*[A-Za-z0-9+/]+={0,2}")
# What follows a BEGIN line when the text was cut inside a short body: base64 lines (and
# headers) up to the end of the truncated text's content, too few characters for
# _PEM_BODY_AHEAD ("-----BEGIN RSA PRIVATE KEY-----\nMIIBOg" at the end of a field).
_PEM_CUT_BODY = re.compile(
    rf"(?:[ \t]*{_PEM_HEADER}{NL}|[ \t]*{NL})*"
    rf"(?:[ \t]*[A-Za-z0-9+/]+={{0,2}}[ \t]*(?:{NL}|\Z))*[ \t]*"
)
_B64_LINE_END = re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{8,}={0,2}[ \t]*\Z")
# The end of an armour line whose start was cut off: "IVATE KEY-----".
_ARMOUR_TAIL = re.compile(r"(?<![A-Za-z0-9])(?:[A-Z0-9]+ )*[A-Z0-9]{2,}-{2,5}[ \t]*\Z")
_DER_START = re.compile(
    r"(?<![A-Za-z0-9+/])(?:MII|MIG|MHc|MC4C|b3BlbnNzaC1rZXkt)"
    r"[A-Za-z0-9+/]{37,}"
)
_B64_LINES = re.compile(rf"(?<![A-Za-z0-9+/])(?:[A-Za-z0-9+/]{{60,76}}={{0,2}}{NL}){{2,}}")


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


def pem(text: str) -> Iterator[Hit]:
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
        if not (
            _PEM_BODY_AHEAD.match(text, m.end())
            or not text[m.end() :].strip()
            or _PEM_CUT_BODY.fullmatch(text, m.end(), max(m.end(), cut_end(text)))
        ):
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
