"""The hostile corpus (tests/support/pii_corpus.py): every item found by scan with its span and
left empty by anonymize, record by record and as a file; disguised values (full-width,
look-alike, invisible characters) keyed on the plain value; labels kept and values gone; a
cut-off fragment a secret only at the cut."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from replay.tools.anonymize import KINDS, anonymize_file, scan_file, scan_record, scan_text
from replay.traces.trace import parse_line
from tests.support import pii_corpus
from tests.support.pii_corpus import Planted
from tests.unit.tools.planted import ANON, CARDS, SECRET, ph

# -- the hostile corpus: one set of planted items, for scan and anonymize alike -------------------

HOSTILE = pii_corpus.PLANTED


def test_hostile_corpus_covers_every_kind() -> None:
    assert {p.kind for p in HOSTILE} == set(KINDS) - {"url_credentials", "ipv6", "ipv4", "phone"}
    assert len({p.name for p in HOSTILE}) == len(HOSTILE)
    for p in HOSTILE:
        assert p.secret in p.text, p.name


def _covered(item: Planted, found: list[Any]) -> bool:
    """A finding of the item's kind, in its field, spans the planted secret."""
    at = item.text.index(item.secret)
    return any(
        f.kind == item.kind
        and f.field == pii_corpus.field(item)
        and f.start <= at
        and f.end >= at + len(item.secret)
        for f in found
    )


@pytest.mark.parametrize("item", HOSTILE, ids=[p.name for p in HOSTILE])
def test_scan_finds_each_hostile_item(item: Planted) -> None:
    found = scan_record(pii_corpus.record(item))
    assert _covered(item, found), [(f.kind, f.field, f.start, f.end) for f in found]
    for f in found:
        assert item.secret not in f.excerpt


def _strings(value: Any) -> Iterator[str]:
    """Every string in a record, keys too, and inside strings that hold JSON."""
    if isinstance(value, str):
        yield value
        try:
            inner = json.loads(value)
        except ValueError:
            return
        if isinstance(inner, dict | list):
            yield from _strings(inner)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _fragments(secret: str, n: int = 8) -> set[str]:
    """Every n-character piece of a secret that holds a letter or digit (all of a short one)."""
    if len(secret) <= n:
        return {secret}
    return {
        secret[i : i + n]
        for i in range(len(secret) - n + 1)
        if any(c.isalnum() for c in secret[i : i + n])
    }


def _survivors(item: Planted, scrubbed: dict[str, Any]) -> list[str]:
    blob = "\0".join(_strings(scrubbed))
    return sorted(w for s in (item.secret, *item.also) for w in _fragments(s) if w in blob)


@pytest.mark.parametrize("item", HOSTILE, ids=[p.name for p in HOSTILE])
def test_anonymize_leaves_nothing_of_each_hostile_item(item: Planted) -> None:
    out, found = ANON.scrub_record(pii_corpus.record(item))
    assert _covered(item, found)
    assert _survivors(item, out) == []
    assert scan_record(out) == []
    assert ANON.scrub_record(out) == (out, [])


def test_hostile_corpus_file_scan_then_anonymize(tmp_path: Path) -> None:
    raw = tmp_path / "hostile.jsonl"
    raw.write_text(pii_corpus.jsonl(), encoding="utf-8")
    lines, found = scan_file(raw)
    assert lines == len(HOSTILE)
    by_line: dict[int, list[Any]] = {}
    for lineno, f in found:
        by_line.setdefault(lineno, []).append(f)
    for lineno, item in enumerate(HOSTILE, start=1):
        assert _covered(item, by_line.get(lineno, [])), item.name
    clean = tmp_path / "clean.jsonl"
    counts = anonymize_file(raw, clean, SECRET)
    assert scan_file(clean) == (len(HOSTILE), [])
    assert sum(counts.values()) >= len(HOSTILE)
    for i, line in enumerate(clean.read_text(encoding="utf-8").splitlines()):
        item = HOSTILE[i]
        record = json.loads(line)
        assert record["id"] == item.name and _survivors(item, record) == [], item.name
        parse_line(line, str(clean), i + 1)  # still a valid trace record


def test_disguised_values_share_the_plain_placeholder() -> None:
    """Folding full-width, look-alike and invisible characters keys the pseudonym on the value,
    so a check written with the plain value still matches the disguised one's placeholder."""
    plain = ph("john@example.com")
    assert ph("ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ") == ph("john＠example.com") == plain
    assert ph("jоhn@ехаmple.com") == plain  # Cyrillic о, е, х, а
    assert ph("ali\u200bce@corp.com") == ph("alice@corp.com")
    assert ph("john [at] example [dot] com") == plain
    assert ph("４１１１１１１１１１１１１１１１") == ph("4111 1111\n1111 1111") == ph(CARDS[0])


def test_disguised_spans_are_in_the_original_text() -> None:
    text = "cc ali\u200bce@corp.com and ｍａｒｙ＠ｅｘａｍｐｌｅ．ｏｒｇ end"
    out, found = ANON.scrub_text(text)
    assert [text[f.start : f.end] for f in found] == [
        "ali\u200bce@corp.com",
        "ｍａｒｙ＠ｅｘａｍｐｌｅ．ｏｒｇ",
    ]
    assert out == f"cc {ph('alice@corp.com')} and {ph('mary@example.org')} end"


def test_labels_stay_and_values_go() -> None:
    text = 'GET /a?user=bob&token=blue-Falcon-77 with password: hunter2 and "pwd": "s3c"'
    out, found = ANON.scrub_text(text)
    assert [f.kind for f in found] == ["credential"] * 3
    assert out == (
        f"GET /a?user=bob&token={ph('?token=blue-Falcon-77')} with password: "
        f'{ph("password=hunter2")} and "pwd": "{ph("pwd=s3c")}"'
    )
    rec = {"id": "x", "meta": {"headers": {"Authorization": "Token abc123", "Accept": "abc123"}}}
    scrubbed, found = ANON.scrub_record(rec)
    assert scrubbed["meta"]["headers"] == {
        "Authorization": f"Token {ph('pwd=abc123')}",
        "Accept": "abc123",
    }
    assert [f.field for f in found] == ["meta.headers.Authorization"]


CUT = [
    ("key sk-ab3dE5gH7j", "sk-ab3dE5gH7j"),
    ("mail alice.smith@corp-ma…", "alice.smith@corp-ma"),
    ("card 4111 1111 1111 11 [...]", "4111 1111 1111 11"),
    ("Authorization: Bearer 7fQx2Lm9 (truncated)", "7fQx2Lm9"),
    ("blob Zq8Xv3Lm9Tp2Rw...", "Zq8Xv3Lm9Tp2Rw"),
    ("iban DE89 3704 0044 05 [+9 chars]", "DE89 3704 0044 05"),
]


@pytest.mark.parametrize(("text", "fragment"), CUT, ids=[c[1] for c in CUT])
def test_a_cut_fragment_counts_only_at_the_cut(text: str, fragment: str) -> None:
    """Shorter shapes are secrets where a field was cut, not in the middle of a text."""
    found = scan_text(text)
    assert [text[f.start : f.end] for f in found] == [fragment]
    middle = text.replace(fragment, f"{fragment} and more words", 1)
    assert [f for f in scan_text(middle) if f.kind != "credential"] == []
