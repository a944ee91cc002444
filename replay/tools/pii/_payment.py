"""Payment details: IBANs (registered length per country, mod-97 checksum) and card numbers
(a network's prefix and Luhn), grouped, split across a line break, or cut at the end."""

from __future__ import annotations

import re
from collections.abc import Iterator

from replay.tools.pii._reading import NL, Hit, at_cut

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


# -- iban, cards --------------------------------------------------------------------------------

_IBAN = re.compile(
    r"(?<![A-Za-z0-9])[A-Z]{2}\d{2}"
    r"(?:[A-Z0-9]{11,30}|(?: [A-Z0-9]{4}){2,7}(?: [A-Z0-9]{1,3})?)(?![A-Za-z0-9])"
)
_IBAN_CUT = re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}\d{2}(?: [A-Z0-9]{4}){2,7}(?: [A-Z0-9]{1,3})?\Z")


def iban(text: str) -> Iterator[Hit]:
    for m in _IBAN.finditer(text):
        compact = m.group(0).replace(" ", "")
        if _iban_ok(compact):
            yield Hit(m.start(), m.end(), "iban", compact)
    if cut := at_cut(text, _IBAN_CUT):
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
_BREAK = rf"[ \t]{{0,2}}[.-]?[ \t]{{0,2}}{NL}[ \t]{{0,2}}"
_CARD_SPLIT = re.compile(
    rf"(?<![\w.+-])\d(?:[ .-]?\d){{0,18}}(?P<br>{_BREAK})"
    r"\d(?:[ .-]?\d){0,18}"
)
_CARD_CUT = re.compile(r"(?<![\w.+-])\d{4}([ .-])\d{4}\1\d{4}(?:\1\d{1,3})?\Z")
_GROUP = re.compile(r"\d+")
_COLUMN_ABOVE = re.compile(rf"\d[ \t]*{NL}[ \t]*\Z")
_COLUMN_BELOW = re.compile(rf"[ \t]*{NL}[ \t]*\d")
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


def credit_card(text: str) -> Iterator[Hit]:
    for m in _CARD.finditer(text):
        if digits := _card_digits(m.group(0)):
            yield Hit(m.start(), m.end(), "credit_card", digits)
    if "\n" in text or "\\n" in text:
        for m in _CARD_SPLIT.finditer(text):
            # at least 13 digits: counted in C before any parsing in Python
            if len(m.group().translate(_NOT_DIGITS)) >= 13 and (found := _split_card(text, m)):
                yield Hit(*found[:2], "credit_card", found[2])
    if cut := at_cut(text, _CARD_CUT):
        digits = re.sub(r"\D", "", cut.group(0))
        if _card_network(digits):
            yield Hit(cut.start(), cut.end(), "credit_card", digits)
