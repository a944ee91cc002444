"""Reading a trace's rows, for every importer: JSON lines and CSV, streamed, and the field
checks they share.

An importer is ``importer(path, LengthPolicy)``: a generator of ``(line, Request | TraceError |
Skip)``, one per non-blank line, that never holds the file. A row it cannot read is a
``TraceError`` naming file, line and field, and a field it does not understand is one too:
nothing a trace says is dropped without a word. Field checks raise ``ValueError("FIELD:
reason")``; ``as_trace_error`` turns that into the row's error.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Collection, Generator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError

from replay.core.errors import InputError, TraceError
from replay.core.strict import integer, number, shown
from replay.traces.importers.lengths import LengthPolicy
from replay.traces.trace import Parsed, first_error, iter_lines

# Generators, not just iterators: a reader that stops early closes them (and their file).
Records = Generator[Parsed, None, None]
Importer = Callable[[Path, LengthPolicy], Records]
Rows = Generator[tuple[int, dict[str, Any] | TraceError], None, None]

MAPPING_HINT = "to read another layout, map its columns: --trace-format csv:t=COL,in=COL,out=COL"


def json_objects(path: Path, what: str) -> Rows:
    """The JSON object of every non-blank line (``what`` names one in the error for a line
    that is something else)."""
    src = str(path)
    for lineno, raw in iter_lines(path):
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            yield lineno, TraceError(src, lineno, "(line)", f"not valid JSON ({exc})")
            continue
        if not isinstance(obj, dict):
            yield lineno, TraceError(src, lineno, "(line)", f"{what} must be a JSON object")
            continue
        yield lineno, obj


def csv_rows(path: Path, need: Sequence[str], known: Collection[str] | None, expected: str) -> Rows:
    """The rows of a CSV file with a header, as ``{column: text}``.

    The header must have every ``need`` column; with ``known``, a column outside it is refused
    (the header's error is raised, not yielded: no row can be read). A row with more fields
    than the header is a bad row; a missing field reads as ``None``.
    """
    src = str(path)
    try:
        # Undecodable bytes become lone surrogates: the row's field then fails validation
        # with its line and field named, instead of breaking the whole stream. utf-8-sig:
        # a CSV saved by Excel starts with a byte order mark, which is not part of a column.
        fh = path.open(newline="", encoding="utf-8-sig", errors="surrogateescape")
    except OSError as exc:
        raise InputError(f"{src}: cannot read: {exc}") from None
    with fh:
        reader = csv.DictReader(fh)
        try:
            header = list(reader.fieldnames or ())
        except UnicodeDecodeError as exc:
            raise TraceError(src, 1, "(header)", f"not UTF-8 text: {exc}") from None
        missing = set(need) - set(header)
        if missing:
            raise TraceError(
                src, 1, "(header)", f"missing column(s) {sorted(missing)}; expected {expected}"
            )
        extra = [c for c in header if known is not None and c not in known]
        if extra:
            raise TraceError(
                src, 1, "(header)", f"column(s) {extra} are not part of {expected}; {MAPPING_HINT}"
            )
        while True:
            at = reader.line_num
            try:
                row = next(reader)
            except StopIteration:
                break
            except csv.Error as exc:
                yield reader.line_num, TraceError(src, reader.line_num, "(line)", str(exc))
                if reader.line_num == at:
                    break  # the reader cannot move past this point
                continue
            if None in row:
                n = len(header) + len(row[None])
                yield (
                    reader.line_num,
                    TraceError(
                        src, reader.line_num, "(line)", f"{n} fields; the header has {len(header)}"
                    ),
                )
                continue
            yield reader.line_num, row


def refuse_unknown(obj: dict[str, Any], known: Collection[str], name: str, hint: str = "") -> None:
    """A field outside ``known`` is an error that names it: a trace of another format must not
    pass for this one with its own fields dropped."""
    # A key that is empty or holds ':' is quoted, so the error still names its field.
    extra = [k if k and ":" not in k else repr(k) for k in obj if k not in known]
    if extra:
        also = f" (nor is {', '.join(extra[1:])})" if extra[1:] else ""
        raise ValueError(
            f"{extra[0]}: not a {name} field{also}; {name} has {', '.join(known)}{hint}"
        )


def json_int(obj: dict[str, Any], key: str, minimum: int = 1) -> int:
    """An integer >= ``minimum`` by ``replay.core.strict``'s rule (2.0 counts as 2; true does
    not count as 1)."""
    v = integer(obj.get(key))
    if v is None or v < minimum:
        want = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{key}: must be {want}, got {shown(obj.get(key))}")
    return v


def json_seconds(obj: dict[str, Any], key: str, unit: str = "seconds") -> float:
    """A finite JSON number >= 0, in ``unit`` (named in the error)."""
    v = number(obj.get(key))
    if v is None or v < 0:
        raise ValueError(f"{key}: must be {unit} >= 0, got {shown(obj.get(key))}")
    return v


def json_hash_ids(obj: dict[str, Any], key: str = "hash_ids") -> tuple[int, ...]:
    v = obj.get(key, [])
    ids = [integer(h) for h in v] if isinstance(v, list) else None
    if ids is None or None in ids:
        raise ValueError(f"{key}: must be a list of integers")
    return tuple(h for h in ids if h is not None)


def csv_int(row: dict[str, Any], key: str, minimum: int = 1) -> int:
    raw = (row.get(key) or "").strip()
    want = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    try:
        v = int(raw)
    except ValueError:
        raise ValueError(f"{key}: must be {want}, got {raw!r}") from None
    if v < minimum:
        raise ValueError(f"{key}: must be {want}, got {v}")
    return v


def csv_seconds(row: dict[str, Any], key: str, unit: str = "seconds") -> float:
    raw = (row.get(key) or "").strip()
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{key}: must be {unit} >= 0, got {raw!r}") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{key}: must be {unit} >= 0, got {raw!r}")
    return v


def iso_seconds(value: Any, key: str) -> float:
    """POSIX seconds of an ISO-8601 date-time string (``datetime.fromisoformat``: e.g.
    ``2025-01-31T12:00:00.250Z``, ``2025-01-31 12:00:00+02:00``); without a zone it is UTC."""
    if not isinstance(value, str):
        raise ValueError(f"{key}: must be an ISO-8601 date-time string, got {value!r}")
    try:
        when = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(f"{key}: not an ISO-8601 date-time: {value!r}") from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def as_trace_error(src: str, lineno: int, exc: Exception) -> TraceError:
    """The row's error from a field check's ``ValueError("FIELD: reason")`` or a record that
    failed validation."""
    if isinstance(exc, ValidationError):
        field, reason = first_error(exc)
        return TraceError(src, lineno, field, reason)
    field, sep, reason = str(exc).partition(": ")
    return TraceError(src, lineno, field if sep else "(line)", reason if sep else str(exc))
