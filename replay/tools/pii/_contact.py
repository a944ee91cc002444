"""Contact details: emails (plain, internationalised, obfuscated as ``[at]``/``(dot)``, wrapped
or cut after the ``@``), IPv6 and IPv4 addresses, and phone numbers in the shapes listed in the
package docstring."""

from __future__ import annotations

import re
from collections.abc import Iterator

from replay.tools.pii._reading import NL, PLACEHOLDER, Hit, at_cut

# -- emails -------------------------------------------------------------------------------------

_EMAIL = re.compile(r"(?<![\w.%+-])([^\W_][\w.%+-]*)@((?:[\w-]+\.)+([^\W\d_]{2,24}))(?![\w-])")
_CJK_CHARS = "\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af"
_CJK = re.compile(f"[{_CJK_CHARS}]")
# A top-level domain in a CJK script: the delegated ones have 2-5 characters
# (中国, 公司, 嘉里大酒店).
_CJK_TLD = re.compile(f"[{_CJK_CHARS}]{{2,5}}")
# A Latin TLD with CJK text glued to it (``bob@example.com谢谢``): CJK prose has no spaces, and
# the address ends where the script changes.
_GLUED_TLD = re.compile(f"((?:(?![{_CJK_CHARS}])[^\\W\\d_]){{2,24}})(?=[{_CJK_CHARS}])")
_DENSITY_SUFFIX = re.compile(r"\d+(?:\.\d+)?x\.")
_AT = r"(?:[ \t]{0,2}[\[({][ \t]{0,2}(?:[Aa][Tt]|@)[ \t]{0,2}[\])}][ \t]{0,2}|@)"
_DOT = r"(?:[ \t]{0,2}[\[({][ \t]{0,2}(?:[Dd][Oo][Tt]|\.)[ \t]{0,2}[\])}][ \t]{0,2}|\.)"
_EMAIL_OBF = re.compile(
    rf"(?<![\w.%+-])([A-Za-z0-9][\w.%+-]*){_AT}"
    rf"((?:[A-Za-z0-9-]+{_DOT})+[A-Za-z]{{2,24}})(?![\w-])"
)
_DOT_RE = re.compile(_DOT)
_LATIN = re.compile(r"[A-Za-z0-9]")
_EMAIL_CUT = re.compile(r"(?<![\w.%+-])([^\W_][\w.%+-]{1,63})@([^\W_][\w-]*(?:\.[\w-]*)*)?\Z")
# An address wrapped at a line break after its ``@`` (``bob@exa\nmple.com``). A break before the
# ``@`` is not joined: the word that ends a line before an address that starts the next cannot be
# told from a cut local part, and ``ping\n@alice.dev`` is a mention.
_EMAIL_BROKEN = re.compile(
    rf"(?<![\w.%+-])[^\W_][\w.%+-]{{0,63}}@[\w.-]{{0,253}}({NL})[\w.-]{{1,253}}"
)
# Where the line before the break holds a whole address already, the next line is joined only
# when that makes a common TLD of a cut one (``bob@example.co\nm``), not ``example.commore``.
_COMMON_TLDS = frozenset(
    "com net org edu gov mil int info biz io ai app dev co me tv us uk de fr es it nl be ch at se "
    "no dk fi pl ru cn jp kr in br au ca mx eu".split()
)


def _email_ok(local: str, domain: str, tld: str) -> bool:
    if local == "git" or PLACEHOLDER.search(local) or _DENSITY_SUFFIX.match(domain):
        return False
    return "_" not in domain and (not _CJK.search(tld) or bool(_CJK_TLD.fullmatch(tld)))


def _plain_emails(text: str) -> Iterator[Hit]:
    for m in _EMAIL.finditer(text):
        end, tld = m.end(), m.group(3)
        if _CJK.search(tld) and not _CJK_TLD.fullmatch(tld):
            glued = _GLUED_TLD.match(tld)
            if not glued:
                continue
            tld = glued.group(1)
            end = m.start(3) + len(tld)
        if _email_ok(m.group(1), text[m.start(2) : end], tld):
            yield Hit(m.start(), end, "email", text[m.start() : end].lower())


def _broken_emails(text: str) -> Iterator[Hit]:
    for m in _EMAIL_BROKEN.finditer(text):
        cut, gap = m.start(1) - m.start(), m.end(1) - m.start(1)
        joined = text[m.start() : m.start(1)] + text[m.end(1) : m.end()]
        em = _EMAIL.match(joined)
        if not em or em.end() <= cut or not _email_ok(em.group(1), em.group(2), em.group(3)):
            continue
        if _EMAIL.fullmatch(text, m.start(), m.start(1)) and em.group(3) not in _COMMON_TLDS:
            continue
        yield Hit(m.start(), m.start() + em.end() + gap, "email", em.group(0).lower())


def email(text: str) -> Iterator[Hit]:
    if "@" in text and ("\n" in text or "\\n" in text):
        yield from _broken_emails(text)
    yield from _plain_emails(text)
    if "[" in text or "(" in text or "{" in text:
        for m in _EMAIL_OBF.finditer(text):
            domain = _DOT_RE.sub(".", m.group(2))
            if _email_ok(m.group(1), domain, domain.rsplit(".", 1)[-1]):
                yield Hit(m.start(), m.end(), "email", f"{m.group(1)}@{domain}".lower())
    cut = at_cut(text, _EMAIL_CUT)
    if (
        cut
        and _LATIN.search(cut.group(0))  # 感谢@张三, a mention glued to CJK prose, ends many texts
        and _email_ok(cut.group(1), cut.group(2) or "", "")
        and not (cut.group(2) or "a")[0].isdigit()
        and not PLACEHOLDER.search(cut.group(0))
    ):
        yield Hit(cut.start(), cut.end(), "email", cut.group(0).lower())


# -- ip addresses, phones -----------------------------------------------------------------------

_IPV6 = re.compile(
    r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}"
    r"(?:(?:\d{1,3}\.){3}\d{1,3}|[0-9A-Fa-f]{0,4})(?![\w:]|\.\d)"
)


def ipv6(text: str) -> Iterator[Hit]:
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


def ipv4(text: str) -> Iterator[Hit]:
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
    | (?P<intl00>00(?P<cc>[1-9]\d{0,2})(?P<sep>[ .-])\d{1,8}(?:(?P=sep)\d{1,8}){1,4})
    | (?P<area>\(\d{2,4}\)[ .-]?\d{2,4}(?:[ .-]\d{2,4}){1,3})
    | (?P<dashed>(?:1-)?\d{2,4}(?:-\d{2,4}){2,3})
    | (?P<dotted>\d{3}\.\d{3}\.\d{4})
    | (?P<trunk>0\d{1,4}(?:[ .]\d{2,4}){2,4})
    )(?![\w]|[.-]\d)""",
    re.X,
)
_DATE_START = re.compile(r"(?:19|20)\d\d-(?:0[1-9]|1[0-2])-")
# Country calling codes (ITU-T E.164), for the ``00`` international prefix, which reads like a
# zero-padded number otherwise: 1 and 7, these two-digit codes, and three-digit codes in these
# two-digit zones.
_CC_TWO = frozenset(
    "20 27 30 31 32 33 34 36 39 40 41 43 44 45 46 47 48 49 51 52 53 54 55 56 57 58 "
    "60 61 62 63 64 65 66 81 82 84 86 90 91 92 93 94 95 98".split()
)
_CC_THREE_ZONES = frozenset(
    "21 22 23 24 25 26 29 35 37 38 42 50 59 67 68 69 80 85 87 88 96 97 99".split()
)


def _country_code(cc: str) -> bool:
    if len(cc) == 3:
        return cc[:2] in _CC_THREE_ZONES
    return cc in ("1", "7") or cc in _CC_TWO


def phone(text: str) -> Iterator[Hit]:
    for m in _PHONE.finditer(text):
        s = m.group(0)
        digits = re.sub(r"\D", "", s)
        plus = s[0] == "+"
        if m.group("intl00"):  # 0049-30-1234567 is +49 30 1234567: one number, one placeholder
            if not _country_code(m.group("cc")):
                continue
            plus, digits = True, digits[2:]
        if not 9 <= len(digits) <= 15:
            continue
        if m.group("dashed") and _DATE_START.match(s):
            continue
        if m.group("trunk") and len(set(re.findall(r"[ .]", s))) > 1:
            continue
        yield Hit(m.start(), m.end(), "phone", ("+" if plus else "") + digits)
