"""Column mappings: any CSV or JSON-lines trace of arrival times and token counts, read by
naming its columns in ``--trace-format``.

Grammar (no spaces around ``:``, ``,`` or ``=``; a column name is the rest of its pair, so it
may hold spaces but not ``,`` or ``=``)::

    FORMAT  := KIND ":" PAIR ("," PAIR)*
    KIND    := "csv" | "jsonl"
    PAIR    := KEY "=" VALUE
    KEY     := "t" | "in" | "out"              required: the columns of the arrival time,
                                               the input tokens and the output tokens
             | "session" | "id"                optional: columns of a session and a request id
             | "t_unit"                        optional: "s" (default), "ms", "us", or "iso"
                                               (ISO-8601 date-time text; no zone: UTC)

e.g. ``csv:t=ts,in=prompt_tokens,out=completion_tokens,session=sid,t_unit=ms``. A CSV file
has a header row naming its columns; in JSON lines a column is a top-level key. Each row
becomes a length-only request with no shared prefix (no hash ids); its arrival offset is its
time minus the first row's (a row earlier than the first is a bad row), its id the ``id``
column's or ``KIND-LINE``. An empty ``session`` cell means no session. Columns the mapping
does not name are not read: the mapping says which ones matter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from replay.core.errors import InputError, TraceError
from replay.traces.importers.lengths import LengthPolicy, Lengths, length_record
from replay.traces.importers.trace_rows import (
    Importer,
    Records,
    Rows,
    as_trace_error,
    csv_rows,
    iso_seconds,
    json_objects,
)

KINDS = ("csv", "jsonl")
REQUIRED = ("t", "in", "out")
OPTIONAL = ("session", "id", "t_unit")
T_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "iso": 1.0}
GRAMMAR = "csv:t=COL,in=COL,out=COL[,session=COL][,id=COL][,t_unit=s|ms|us|iso] (or jsonl:...)"


@dataclass(frozen=True)
class ColumnMapping:
    """A parsed ``--trace-format KIND:...``: which column holds what."""

    spec: str
    kind: str
    columns: dict[str, str]  # key (t, in, out, session, id) -> column
    t_unit: str = "s"

    def column(self, key: str) -> str | None:
        return self.columns.get(key)

    def mapped(self, key: str) -> str:
        return f"{key}={self.columns[key]}"


def is_mapping(fmt: str) -> bool:
    return fmt.partition(":")[0] in KINDS and ":" in fmt


def parse_mapping(spec: str) -> ColumnMapping:
    """Parse and check a mapping; an ``InputError`` names what is wrong with it."""
    kind, _, rest = spec.partition(":")

    def bad(reason: str) -> InputError:
        return InputError(f"--trace-format {spec}: {reason} (grammar: {GRAMMAR})")

    if kind not in KINDS:
        raise bad(f"unknown kind '{kind}'; a mapping starts with csv: or jsonl:")
    pairs: dict[str, str] = {}
    for part in rest.split(","):
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key:
            raise bad(f"'{part}' is not KEY=COLUMN")
        if key not in (*REQUIRED, *OPTIONAL):
            raise bad(f"unknown key '{key}' (keys: {', '.join((*REQUIRED, *OPTIONAL))})")
        if key in pairs:
            raise bad(f"'{key}' is mapped twice")
        if not value:
            raise bad(f"'{key}=' names no column")
        pairs[key] = value
    missing = [k for k in REQUIRED if k not in pairs]
    if missing:
        raise bad(f"missing mapping for {', '.join(missing)} (t, in and out are required)")
    unit = pairs.pop("t_unit", "s")
    if unit not in T_UNITS:
        raise bad(f"t_unit={unit}: give one of {', '.join(T_UNITS)}")
    return ColumnMapping(spec, kind, pairs, unit)


def mapped_importer(spec: str) -> Importer:
    """The importer of a ``--trace-format`` mapping (checked here, before any file is read)."""
    return partial(import_mapped, parse_mapping(spec))


def import_mapped(mapping: ColumnMapping, path: Path, policy: LengthPolicy) -> Records:
    """Rows of a mapped CSV or JSON-lines file (see the module docstring)."""
    src = str(path)
    first: float | None = None
    for lineno, row in _rows(mapping, path):
        if isinstance(row, TraceError):
            yield lineno, row
            continue
        try:
            when = _time(mapping, row)
            first = when if first is None else first
            if when < first:
                raise ValueError(
                    f"{mapping.columns['t']}: {first - when:.3f} s before the first row's; "
                    "sort the trace by time"
                )
            lengths = Lengths(_count(mapping, row, "in"), _count(mapping, row, "out"))
            meta = {"source": mapping.kind, "line": lineno}
            rid = _text(mapping, row, "id") or f"{mapping.kind}-{lineno}"
            session = _text(mapping, row, "session")
            yield lineno, length_record(rid, when - first, lengths, policy, meta, session)
        except (ValueError, ValidationError) as exc:
            yield lineno, as_trace_error(src, lineno, exc)


def _rows(mapping: ColumnMapping, path: Path) -> Rows:
    if mapping.kind == "csv":
        need = list(mapping.columns.values())
        return csv_rows(path, need, None, f"by --trace-format {mapping.spec}")
    return json_objects(path, "a JSON-lines row")


def _value(mapping: ColumnMapping, row: dict[str, Any], key: str) -> Any:
    column = mapping.columns[key]
    value = row.get(column)
    if value is None:
        raise ValueError(f"{column}: missing (mapped as {mapping.mapped(key)})")
    return value.strip() if isinstance(value, str) else value


def _time(mapping: ColumnMapping, row: dict[str, Any]) -> float:
    column, value = mapping.columns["t"], _value(mapping, row, "t")
    if mapping.t_unit == "iso":
        return iso_seconds(value, column)
    want = f"{column}: must be a time in {mapping.t_unit} >= 0 (mapped as {mapping.mapped('t')})"
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{want}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{want}, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{want}, got {value!r}")
    return float(value) * T_UNITS[mapping.t_unit]


def _count(mapping: ColumnMapping, row: dict[str, Any], key: str) -> int:
    column, value = mapping.columns[key], _value(mapping, row, key)
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 1:
        raise ValueError(
            f"{column}: must be a positive integer (mapped as {mapping.mapped(key)}), got {value!r}"
        )
    if not math.isfinite(value) or int(value) != value:
        raise ValueError(f"{column}: must be a positive integer, got {value!r}")
    return int(value)


def _text(mapping: ColumnMapping, row: dict[str, Any], key: str) -> str | None:
    """An optional id or session: text or an integer; an empty cell is none."""
    if key not in mapping.columns:
        return None
    column = mapping.columns[key]
    value = row.get(column)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if value is None or (isinstance(value, str) and not value.strip()):
        if key == "id":
            raise ValueError(f"{column}: missing (mapped as {mapping.mapped(key)})")
        return None
    if not isinstance(value, str):
        raise ValueError(f"{column}: must be text or an integer, got {value!r}")
    return value.strip()
