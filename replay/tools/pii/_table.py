"""The detector table and ``detect``: every detector in priority order, each behind a cheap
substring test, and the overlaps resolved so that an earlier kind wins."""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Callable, Iterator

from replay.tools.pii._contact import email, ipv4, ipv6, phone
from replay.tools.pii._keys import api_key, jwt, url_credentials
from replay.tools.pii._labelled import credential, label_hit
from replay.tools.pii._payment import credit_card, iban
from replay.tools.pii._pem import pem
from replay.tools.pii._random import high_entropy
from replay.tools.pii._reading import PLACEHOLDER, Hit

# The kinds in priority order (an earlier kind wins an overlap), and each one's placeholder.
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

Detector = Callable[[str], Iterator[Hit]]
DETECTORS: tuple[tuple[Detector, tuple[str, ...]], ...] = (
    # (detector, substrings one of which a match needs: a cheap test that skips the regex)
    (pem, ()),
    (url_credentials, ("://",)),
    (jwt, ("eyJ",)),
    (
        api_key,
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
    (credential, (":", "=")),
    (email, ("@", "[", "(", "{")),
    (iban, ()),
    (credit_card, ()),
    (ipv6, (":",)),
    (ipv4, (".",)),
    (phone, ()),
    (high_entropy, ()),
)
# A hit holds a letter or a digit, of any script, besides placeholders (``用户@例子.广告`` has no
# ASCII one): one of punctuation and placeholders alone is what a scrub left, not a value.
_ALNUM = re.compile(r"[^\W_]")


def detect(text: str, label: str | None = None) -> list[Hit]:
    """Non-overlapping hits, in text order; an earlier detector wins an overlap, and within one
    detector an earlier hit does. ``label``: the JSON key the text is the value of."""
    starts: list[int] = []
    ends: list[int] = []
    hits: list[Hit] = []
    for find, needles in DETECTORS:
        found = find(text) if not needles or any(n in text for n in needles) else iter(())
        if find is credential and label:
            found = itertools.chain(label_hit(text, label), found)
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
