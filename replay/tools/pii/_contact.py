"""Contact details: emails (plain, obfuscated as ``[at]``/``(dot)``, or cut after the ``@``),
IPv6 and IPv4 addresses, and phone numbers in the shapes listed in the package docstring."""

from __future__ import annotations

import re
from collections.abc import Iterator

from replay.tools.pii._reading import PLACEHOLDER, Hit, at_cut

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


def email(text: str) -> Iterator[Hit]:
    for m in _EMAIL.finditer(text):
        if _email_ok(m.group(1), m.group(2), m.group(3)):
            yield Hit(m.start(), m.end(), "email", m.group(0).lower())
    if "[" in text or "(" in text or "{" in text:
        for m in _EMAIL_OBF.finditer(text):
            domain = _DOT_RE.sub(".", m.group(2))
            if _email_ok(m.group(1), domain, domain.rsplit(".", 1)[-1]):
                yield Hit(m.start(), m.end(), "email", f"{m.group(1)}@{domain}".lower())
    cut = at_cut(text, _EMAIL_CUT)
    if (
        cut
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
    | (?P<area>\(\d{2,4}\)[ .-]?\d{2,4}(?:[ .-]\d{2,4}){1,3})
    | (?P<dashed>(?:1-)?\d{2,4}(?:-\d{2,4}){2,3})
    | (?P<dotted>\d{3}\.\d{3}\.\d{4})
    | (?P<trunk>0\d{1,4}(?:[ .]\d{2,4}){2,4})
    )(?![\w]|[.-]\d)""",
    re.X,
)
_DATE_START = re.compile(r"(?:19|20)\d\d-(?:0[1-9]|1[0-2])-")


def phone(text: str) -> Iterator[Hit]:
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
