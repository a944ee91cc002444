"""How a number and a text read in everything a person reads: the HTML and Markdown reports
and the terminal. One vocabulary, so that a percentage, a difference in points or a count
looks the same wherever it appears, and one escape (``visible``), so that no text from a model,
a server or a trace acts on the reader instead of showing itself.

A missing value is a dash, never 0. The reports take any JSON value (``num`` turns what is
not a finite number into a missing one) and show an em dash (``DASH``); the terminal tables
take the summary's typed numbers as they are and show an en dash (``TERMINAL_DASH``).
"""

from __future__ import annotations

import functools
import math
import re
import unicodedata
from collections.abc import Callable

DASH = "—"
TERMINAL_DASH = "–"


# -- text: what shows, never what acts ---------------------------------------------------------

# Characters that act instead of showing: controls (NUL, BEL, ESC...; newline and tab stay),
# format characters (the bidi overrides U+202A-U+202E and isolates U+2066-U+2069, zero-width
# spaces, the soft hyphen), line and paragraph separators, lone surrogates, private-use and
# unassigned code points. The zero-width joiner and non-joiner stay: scripts and emoji need them.
_ACTING = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
_JOINERS = frozenset({"\u200c", "\u200d"})
_NOT_PLAIN = re.compile(r"[^\n\t\x20-\x7e]")


@functools.lru_cache(maxsize=4096)
def _shown(ch: str) -> str:
    if ch in _JOINERS or unicodedata.category(ch) not in _ACTING:
        return ch
    cp = ord(ch)
    return f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}" if cp < 0x10000 else f"\\U{cp:08x}"


def visible(text: str) -> str:
    """``text`` with every character that would act instead of show written as its escape
    (``\\x1b``, ``\\u202e``): the one escape every report and terminal line applies to text it did
    not write itself (answers, ids, trace and server text), after which HTML or Markdown
    escaping makes it safe markup."""
    return _NOT_PLAIN.sub(lambda m: _shown(m.group(0)), text)


def num(x: object) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


def text(x: object) -> str:
    return DASH if x is None or x == "" else str(x)


# -- the primitives: a value or the missing mark ----------------------------------------------


def fixed(v: float | None, spec: str, missing: str = DASH) -> str:
    """``v`` in a format spec (``".1f"``, ``",.0f"``, ``"+.4f"``), or ``missing``."""
    return missing if v is None else format(v, spec)


def percent(v: float | None, digits: int = 1, missing: str = DASH) -> str:
    """A fraction as a percentage: ``0.25`` is ``25.0%``."""
    return missing if v is None else f"{100 * v:.{digits}f}%"


def points(v: float | None, digits: int = 1, missing: str = DASH) -> str:
    """A difference of fractions in signed percentage points: ``-0.1`` is ``-10.0``."""
    return missing if v is None else f"{100 * v:+.{digits}f}"


# -- the reports' formats: any JSON value in ------------------------------------------------


def f_sig(x: object) -> str:
    """About three significant figures (milliseconds, seconds, rates)."""
    v = num(x)
    if v is None:
        return DASH
    a = abs(v)
    return fixed(v, ",.0f" if a >= 100 else ".1f" if a >= 10 else ".2f")


def f_int(x: object) -> str:
    return fixed(num(x), ",.0f")


def f_pct(x: object) -> str:
    return percent(num(x))


def f_pts(x: object) -> str:
    return points(num(x))


def f_p(x: object) -> str:
    return fixed(num(x), ".3g")


def f_nll(x: object) -> str:
    return fixed(num(x), "+.4f")


def f_ratio(x: object) -> str:
    v = num(x)
    return DASH if v is None else f"{v:.2f}×"


def f_bool(x: object) -> str:
    return DASH if not isinstance(x, bool) else ("yes" if x else "no")


def f_ci(lo: object, hi: object, fmt: Callable[[object], str]) -> str:
    return DASH if num(lo) is None and num(hi) is None else f"[{fmt(lo)}, {fmt(hi)}]"


def f_est(x: object, lo: object, hi: object, fmt: Callable[[object], str]) -> str:
    """An estimate with its interval: ``-3.0 [-8.1, +1.9]``."""
    ci = f_ci(lo, hi, fmt)
    return fmt(x) if ci == DASH else f"{fmt(x)} {ci}"
