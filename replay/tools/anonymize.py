"""Anonymization: scrub personal data and secrets from production logs before they become traces.

``replay trace anonymize`` rewrites every string of every record (messages, prompt text, tools,
tool-call arguments, checker specs, ``meta``); ``replay trace scan`` reports what remains.

What is detected (``Finding.kind``) is the table in ``replay.tools.pii``: PEM blocks, credentials in
URLs, JWTs, API keys, labelled secrets (``?token=``, ``password=``, ``"client_secret": …``),
emails, IBANs, card numbers, IPv6 and IPv4 addresses, phone numbers and high-entropy tokens,
read through a fold of full-width and look-alike characters, including what a truncated field
leaves of them. Scan and anonymize run the same table.

Placeholders are ``<PREFIX>_<hash8>``: ``EMAIL``, ``PHONE``, ``IP`` (v4 and v6), ``CARD``,
``IBAN``, ``SECRET`` (pem, api_key, credential, jwt, high_entropy) and, for URL credentials,
``USER`` (so ``postgres://admin:pw@db/x`` becomes ``postgres://USER_1a2b3c4d@db/x``). ``hash8``
is the first 8 hex digits of HMAC-SHA256(secret, prefix + NUL + canonical value); the canonical
value folds formats that mean the same thing (emails lower-cased, phone and card numbers to
their digits, IBANs compact upper-case, IPs in ``ipaddress`` form). So one value gets one
placeholder in the message, the tool arguments and the check alike (retrieval, contains, exact
and tool-call checks still pass for an answer that copies the placeholder), across traces
scrubbed with one secret, and not across secrets. Placeholders are word characters only: never
detected again, safe in JSON, regular expressions and code. A scrubbed string is re-scanned
until nothing is found, so ``scrub_text`` is idempotent and a scan of its output is clean.

Records: every string is scrubbed, dict keys only where a key itself is detected (ordinary keys
never are); a string under a secret label (``{"password": "…"}``, ``{"Authorization": "Token
…"}``) is a ``credential`` as the same text in ``key: value`` form would be; a string that holds
a JSON object or array (tool-call ``arguments``) is parsed, its values scrubbed and
re-serialized (``#`` in a ``Finding.field`` marks the step into it); the pattern of a ``regex``
check is matched with its escapes (``\\.``) undone; integers of 13-19 digits that are card
numbers become the card placeholder (not in ``prompt``/``synth`` token ids, nor in a ``number``
check). ``anonymize_file`` marks each record with ``meta.anonymized = {"by": "kvcanary",
"version": 1}``; ``is_scanned`` checks that mark.

Repeated keys: in ``{"content": "mail bob@example.com", "content": "benign"}`` orjson and json
alike keep the last value, and a reader that keeps the first would find the address. So
``scan_file`` reads every value, those a repeated key hides too, and reports each repeated key
itself (``duplicate_key``: the key's path, and how many values it has); anonymize keeps the last
value and drops the others (a JSON string, such as tool-call ``arguments``, is re-serialized
without them), so its output has neither.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from replay.core.errors import TraceError
from replay.tools.pii import KINDS, PLACEHOLDER, PREFIX, detect, fold

__all__ = [
    "DUPLICATE_KEY",
    "KINDS",
    "MARKER",
    "PLACEHOLDER",
    "Anonymizer",
    "Finding",
    "anonymize_file",
    "is_scanned",
    "scan_file",
    "scan_record",
    "scan_text",
]
MARKER = {"by": "kvcanary", "version": 1}
DUPLICATE_KEY = "duplicate_key"  # a scan finding of its own, not a kind anonymize replaces
_MAX_PASSES = 8


@dataclass(frozen=True, slots=True)
class Finding:
    """One detected item: its kind, where (JSON path and span in that string) and a masked
    excerpt (two characters and the length, never the value). A ``duplicate_key`` finding names
    the key's path; its span is 0-0 and its excerpt how many values the key has."""

    kind: str
    field: str
    start: int
    end: int
    excerpt: str

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "field": self.field,
            "start": self.start,
            "end": self.end,
            "excerpt": self.excerpt,
        }


# -- span bookkeeping ---------------------------------------------------------------------------


class _Edits:
    """One pass's replacements, ``(start, end, replacement length)`` in the text before them,
    indexed so that a position maps back in O(log n) (a pass may replace a million items)."""

    def __init__(self, edits: list[tuple[int, int, int]]) -> None:
        self.edits = edits
        self.new_starts: list[int] = []
        self.shifts: list[int] = []  # the shift after each edit
        shift = 0
        for s, e, n in edits:
            self.new_starts.append(s + shift)
            shift += n - (e - s)
            self.shifts.append(shift)

    def back(self, pos: int, is_end: bool) -> int:
        """Map a position in the text after the edits to the text before them (a position
        inside a replacement maps to that replacement's start, or end for an end)."""
        k = (bisect.bisect_left if is_end else bisect.bisect_right)(self.new_starts, pos)
        if not k:
            return pos
        s, e, n = self.edits[k - 1]
        if pos < self.new_starts[k - 1] + n or (is_end and pos == self.new_starts[k - 1] + n):
            return e if is_end else s
        return pos - self.shifts[k - 1]


def _mask(value: str) -> str:
    return f"{value[:2]}…({len(value)})"


View = Callable[[str], tuple[str, list[int] | None]]


def _plain(text: str) -> tuple[str, list[int] | None]:
    return text, None


def _regex_view(pattern: str) -> tuple[str, list[int] | None]:
    """A regex pattern with escaped punctuation undone (``a\\.b`` reads ``a.b``); the list maps
    each shown character (and the end) to where its escape sequence starts in the pattern."""
    shown: list[str] = []
    where: list[int] = []
    i = 0
    while i < len(pattern):
        where.append(i)
        if pattern[i] == "\\" and i + 1 < len(pattern) and not pattern[i + 1].isalnum():
            shown.append(pattern[i + 1])
            i += 2
        else:
            shown.append(pattern[i])
            i += 1
    where.append(len(pattern))
    return "".join(shown), where


def _folded(shown: str, where: list[int] | None) -> tuple[str, list[int] | None]:
    """A view read through the fold of look-alike characters (``pii.fold``)."""
    folded, fwhere = fold(shown)
    if fwhere is None:
        return folded, where
    return folded, [where[i] for i in fwhere] if where else fwhere


# -- objects with a repeated key --------------------------------------------------------------


class _Shadowing(dict[str, Any]):
    """A JSON object that holds a key more than once: each key's last value, as every reader here
    (orjson, json) takes it, and in ``shadowed`` the earlier values it hides, which a reader that
    keeps the first one would take instead."""

    shadowed: list[tuple[str, Any]]


def _every_pair(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: a plain dict, or a ``_Shadowing`` one when a key repeats."""
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    out = _Shadowing(obj)
    last = {key: i for i, (key, _) in enumerate(pairs)}
    out.shadowed = [(key, v) for i, (key, v) in enumerate(pairs) if last[key] != i]
    return out


def _loads_every_pair(data: str | bytes) -> Any:
    return json.loads(data, object_pairs_hook=_every_pair)


# -- the anonymizer -----------------------------------------------------------------------------


@dataclass
class _Walk:
    findings: list[Finding] = field(default_factory=list)
    numbers: bool = True
    regex_field: str | None = None
    repeated: list[Finding] = field(default_factory=list)  # keys an object holds twice or more


def _join(path: str, key: str) -> str:
    if not path:
        return key
    return path + key if path.endswith("#") else f"{path}.{key}"


_JSONISH = re.compile(r"\s*[\[{]")


class Anonymizer:
    """Consistent pseudonyms keyed by a secret: one value, one placeholder."""

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("the anonymization secret must not be empty")
        self._secret = bytes(secret)

    def placeholder(self, kind: str, key: str) -> str:
        prefix = PREFIX[kind]
        mac = hmac.new(self._secret, f"{prefix}\0{key}".encode(), hashlib.sha256)
        return f"{prefix}_{mac.hexdigest()[:8]}"

    def scrub_text(self, text: str, field: str = "") -> tuple[str, list[Finding]]:
        """The text with every detected item replaced; findings have spans in ``text``."""
        return self._scrub(text, field, _plain)

    def _scrub(
        self, text: str, field: str, view: View, label: str | None = None
    ) -> tuple[str, list[Finding]]:
        findings: list[Finding] = []
        history: list[_Edits] = []
        for _ in range(_MAX_PASSES):
            shown, where = _folded(*view(text))
            hits = detect(shown, label)
            if not hits:
                break
            parts: list[str] = []
            edits: list[tuple[int, int, int]] = []
            pos = 0
            for h in hits:
                s, e = (where[h.start], where[h.end]) if where else (h.start, h.end)
                ph = self.placeholder(h.kind, h.key)
                parts += [text[pos:s], ph]
                pos = e
                edits.append((s, e, len(ph)))
                a, b = s, e
                for old in reversed(history):
                    a, b = old.back(a, False), old.back(b, True)
                findings.append(Finding(h.kind, field, a, b, _mask(shown[h.start : h.end])))
            parts.append(text[pos:])
            text = "".join(parts)
            history.append(_Edits(edits))
        return text, findings

    def scrub_record(self, obj: dict[str, Any]) -> tuple[dict[str, Any], list[Finding]]:
        """A scrubbed copy of one trace record (same keys, same shape) and what was found."""
        out, findings, _ = self._scrub_record(obj)
        return out, findings

    def _scrub_record(
        self, obj: dict[str, Any]
    ) -> tuple[dict[str, Any], list[Finding], list[Finding]]:
        """``scrub_record``, and the keys an object (parsed by ``_loads_every_pair``) repeats."""
        findings: list[Finding] = []
        repeated: list[Finding] = []
        check = obj.get("check")
        kind = check.get("type") if isinstance(check, dict) else None

        def walk(key: str, value: Any) -> Any:
            if (
                key == "synth"
                or (key == "prompt" and isinstance(value, list))
                or not isinstance(value, str | list | dict)
            ):
                return value  # token ids, hash ids and top-level numbers are not text
            ctx = _Walk(
                findings,
                numbers=not (key == "check" and kind == "number"),
                regex_field="check.pattern" if kind == "regex" else None,
                repeated=repeated,
            )
            return self._walk(value, key, ctx)

        out = {key: walk(key, value) for key, value in obj.items()}
        for key, value in getattr(obj, "shadowed", ()):
            walk(key, value)  # what a hidden value holds is found; the value is dropped
        repeated[:0] = self._repeats(obj, "")
        return out, findings, repeated

    def _walk(self, value: Any, path: str, ctx: _Walk) -> Any:
        if isinstance(value, str):
            return self._walk_str(value, path, ctx)
        if isinstance(value, dict):
            return self._walk_dict(value, path, ctx)
        if isinstance(value, list):
            return [self._walk(v, _join(path, str(i)), ctx) for i, v in enumerate(value)]
        if (
            ctx.numbers
            and isinstance(value, int)
            and not isinstance(value, bool)
            and 10**12 <= abs(value) < 10**19
        ):
            new, found = self._scrub(str(value), path, _plain)
            ctx.findings += found
            return new if found else value
        return value

    def _walk_dict(self, value: dict[str, Any], path: str, ctx: _Walk) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, v in value.items():
            new_key, found = self._scrub(key, "", _plain) if isinstance(key, str) else (key, [])
            child = _join(path, str(new_key))
            ctx.findings += [
                Finding(f.kind, f"{child}(key)", f.start, f.end, f.excerpt) for f in found
            ]
            out[new_key] = self._walk_value(key, v, child, ctx)
        for key, v in getattr(value, "shadowed", ()):
            # what a hidden value holds is found; the value is dropped from the output
            self._walk_value(key, v, self._key_path(path, key), ctx)
        ctx.repeated += self._repeats(value, path)
        return out

    def _walk_value(self, key: Any, v: Any, child: str, ctx: _Walk) -> Any:
        if isinstance(v, str) and isinstance(key, str):
            return self._walk_str(v, child, ctx, label=key)
        return self._walk(v, child, ctx)

    def _key_path(self, path: str, key: str) -> str:
        """A key's path, with the key as scrubbed (its findings are the shown value's)."""
        return _join(path, self._scrub(key, "", _plain)[0])

    def _repeats(self, value: dict[str, Any], path: str) -> list[Finding]:
        """A ``duplicate_key`` finding for each key a ``_Shadowing`` object holds again."""
        hidden = Counter(key for key, _ in getattr(value, "shadowed", ()))
        return [
            Finding(DUPLICATE_KEY, self._key_path(path, key), 0, 0, f"{n + 1} values")
            for key, n in hidden.items()
        ]

    def _walk_str(self, value: str, path: str, ctx: _Walk, label: str | None = None) -> str:
        if _JSONISH.match(value):
            inner = self._walk_json(value, path, ctx)
            if inner is not None:
                return inner
        view = _regex_view if path == ctx.regex_field else _plain
        new, found = self._scrub(value, path, view, label)
        ctx.findings += found
        return new

    def _walk_json(self, value: str, path: str, ctx: _Walk) -> str | None:
        """A string holding a JSON object/array: scrub its values, re-serialize if changed."""
        try:
            parsed = _loads_every_pair(value)
        except (ValueError, RecursionError):
            return None
        if not isinstance(parsed, dict | list):
            return None
        before = len(ctx.findings), len(ctx.repeated)
        new = self._walk(parsed, path + "#", ctx)
        if (len(ctx.findings), len(ctx.repeated)) == before:
            return value
        return json.dumps(new, ensure_ascii=False)  # without the values a repeated key hid


_SCANNER = Anonymizer(b"kvcanary-scan")


def scan_text(text: str) -> list[Finding]:
    """What ``scrub_text`` would replace (findings only; nothing is changed)."""
    return _SCANNER.scrub_text(text)[1]


def scan_record(obj: dict[str, Any]) -> list[Finding]:
    """What ``scrub_record`` would replace, then each key an object (parsed by
    ``_loads_every_pair``, as ``scan_file`` does) holds more than once."""
    _, findings, repeated = _SCANNER._scrub_record(obj)
    return findings + repeated


# -- files --------------------------------------------------------------------------------------


def _records(path: Path) -> Iterator[tuple[int, bytes]]:
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if raw.strip():
                yield lineno, raw


def _load_record(raw: bytes, path: Path, lineno: int) -> dict[str, Any]:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise TraceError(str(path), lineno, "(line)", f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise TraceError(str(path), lineno, "(line)", "a trace line must be a JSON object")
    return obj


def anonymize_file(src: Path, dst: Path, secret: bytes) -> dict[str, int]:
    """Scrub a JSONL trace line by line into ``dst`` (written whole or not at all), marking each
    record ``meta.anonymized``. Returns how many items of each kind were replaced."""
    anon = Anonymizer(secret)
    counts = dict.fromkeys(KINDS, 0)
    tmp = dst.with_name(f".{dst.name}.partial")
    try:
        with tmp.open("wb") as out:
            for lineno, raw in _records(src):
                record, found = anon.scrub_record(_load_record(raw, src, lineno))
                meta = record.get("meta", {})
                if not isinstance(meta, dict):
                    raise TraceError(str(src), lineno, "meta", "must be an object")
                record["meta"] = {**meta, "anonymized": dict(MARKER)}
                out.write(orjson.dumps(record) + b"\n")
                for f in found:
                    counts[f.kind] += 1
        tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)
    return counts


def scan_file(path: Path) -> tuple[int, list[tuple[int, Finding]]]:
    """(lines scanned, findings with their line numbers); a line that is not a JSON object is
    scanned as text (field ``(line)``). Every value of a line is scanned, those of a repeated key
    too, and a repeated key is a finding of its own (``duplicate_key``)."""
    lines = 0
    out: list[tuple[int, Finding]] = []
    for lineno, raw in _records(path):
        lines += 1
        try:
            obj = orjson.loads(raw)  # what is valid JSON: orjson's verdict, as anonymize's
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            found = scan_record(_every_value(raw, obj))
        else:
            found = [
                Finding(f.kind, "(line)", f.start, f.end, f.excerpt)
                for f in scan_text(raw.decode("utf-8", "replace"))
            ]
        out += [(lineno, f) for f in found]
    return lines, out


def _every_value(raw: bytes, obj: dict[str, Any]) -> dict[str, Any]:
    """The line parsed again keeping the values a repeated key hides (``obj``, orjson's parse,
    where the standard library's parser gives up first: nesting too deep for it)."""
    try:
        every = _loads_every_pair(raw)
    except (ValueError, RecursionError):
        return obj
    return every if isinstance(every, dict) else obj


def _marked(raw: bytes) -> bool:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    meta = obj.get("meta") if isinstance(obj, dict) else None
    mark = meta.get("anonymized") if isinstance(meta, dict) else None
    return (
        isinstance(mark, dict)
        and mark.get("by") == MARKER["by"]
        and isinstance(mark.get("version"), int)
        and mark["version"] >= 1
    )


def is_scanned(path: Path) -> bool:
    """True when the trace has records and every one carries the anonymized mark (streams;
    stops at the first unmarked record)."""
    seen = False
    for _, raw in _records(path):
        if not _marked(raw):
            return False
        seen = True
    return seen
