"""Which importer reads a trace: the named formats, column mappings, and recognising a file's
format from its first record.

Recognition never guesses between formats whose units differ (Mooncake's milliseconds and
512-token blocks against Qwen-Bailian's seconds and 16-token blocks): a format is picked when
the first record has all of its required fields and it is the only such format, or the only
one that knows every field the record has. A record that fits several, or none, is an error
that lists the candidates and asks for ``--trace-format``.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import orjson

from replay.core.errors import InputError, TraceError
from replay.traces.importers import azure, bailian, burstgpt, mooncake, openai_log
from replay.traces.importers.lengths import LengthPolicy
from replay.traces.importers.mapped import GRAMMAR, is_mapping, mapped_importer
from replay.traces.importers.trace_rows import Importer, Records
from replay.traces.trace import UTF8_BOM, Request, iter_lines, parse_line_or_error


def import_v1(path: Path, policy: LengthPolicy) -> Records:
    """kvcanary's own format (lengths are the trace author's; the policy does not apply)."""
    for lineno, raw in iter_lines(path):
        yield lineno, parse_line_or_error(raw, str(path), lineno)


IMPORTERS: dict[str, Importer] = {
    "v1": import_v1,
    "mooncake": mooncake.import_mooncake,
    "azure": azure.import_azure,
    "bailian": bailian.import_bailian,
    "burstgpt": burstgpt.import_burstgpt,
    "openai-log": openai_log.import_openai_log,
}
FORMAT_HELP = (
    f"Format of the trace: auto (recognised from its first record), {', '.join(IMPORTERS)}, "
    f"or a column mapping {GRAMMAR}."
)


@dataclass(frozen=True)
class Signature:
    """What recognises a format: the fields a record must have and all the ones it may have."""

    fmt: str
    required: frozenset[str]
    known: frozenset[str]
    units: str


JSON_SIGNATURES = (
    Signature("v1", frozenset({"id"}), frozenset(Request.model_fields), "t in seconds"),
    Signature(
        "mooncake",
        frozenset(mooncake.REQUIRED),
        frozenset(mooncake.FIELDS),
        "timestamp in milliseconds, 512-token hash blocks",
    ),
    Signature(
        "bailian",
        frozenset(bailian.REQUIRED),
        frozenset(bailian.FIELDS),
        "timestamp in seconds, 16-token hash blocks, sessions from parent_chat_id",
    ),
    *(
        Signature(
            "openai-log",
            frozenset({body}),
            frozenset(openai_log.TOP_KEYS),
            "chat request bodies, ISO-8601 or POSIX-second timestamps",
        )
        for body in ("request", "body")
    ),
)
CSV_SIGNATURES = (
    Signature("azure", frozenset(azure.COLUMNS), frozenset(azure.COLUMNS), "TIMESTAMP a date-time"),
    Signature(
        "burstgpt",
        frozenset(burstgpt.REQUIRED),
        frozenset(burstgpt.COLUMNS),
        "Timestamp in seconds, failed requests counted",
    ),
)
# The first record is read whole to be recognised; one longer than this is not guessed at.
SNIFF_LIMIT = 16 * 1024 * 1024


def get_importer(name: str) -> Importer:
    if is_mapping(name):
        return mapped_importer(name)
    try:
        return IMPORTERS[name]
    except KeyError:
        raise InputError(
            f"--trace-format: unknown format '{name}'. Available: {', '.join(IMPORTERS)}, "
            f"or a column mapping {GRAMMAR}"
        ) from None


def resolve_format(path: Path, fmt: str) -> str:
    if path.is_dir():
        raise InputError(f"{path}: is a directory; give the trace file in it")
    if not path.is_file():
        raise InputError(
            f"{path}: no such trace file"
            if not path.exists()
            else f"{path}: not a regular file; give a trace file"
        )
    refuse_wide_encoding(path)
    return sniff_format(path) if fmt == "auto" else fmt


# A text file's encoding by its first bytes: a byte order mark, or, without one, where the NUL
# bytes of its first ASCII characters fall (the rule of RFC 4627, section 3). UTF-32 first: its
# little-endian mark begins with UTF-16's.
_WIDE_MARKS = (
    (b"\xff\xfe\x00\x00", "UTF-32LE"),
    (b"\x00\x00\xfe\xff", "UTF-32BE"),
    (b"\xff\xfe", "UTF-16LE"),
    (b"\xfe\xff", "UTF-16BE"),
)
# The first four bytes, 0 a NUL and x any other: "{" and '"' in each encoding.
_WIDE_NULS = {"000x": "UTF-32BE", "x000": "UTF-32LE", "0x0x": "UTF-16BE", "x0x0": "UTF-16LE"}


def wide_encoding(head: bytes) -> str | None:
    """The UTF-16 or UTF-32 encoding a file's first four bytes show, or None (UTF-8, or too
    short to say)."""
    for mark, name in _WIDE_MARKS:
        if head.startswith(mark):
            return name
    return _WIDE_NULS.get("".join("0" if b == 0 else "x" for b in head[:4]))


def refuse_wide_encoding(path: Path) -> None:
    """A trace saved as UTF-16 or UTF-32 (Windows' "Unicode", PowerShell's ``>``) is named as
    such, not read as a record or a CSV header that makes no sense."""
    try:
        with path.open("rb") as fh:
            head = fh.read(4)
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc}") from None
    found = wide_encoding(head)
    if found is not None:
        family = found[:6]  # UTF-16 or UTF-32
        raise TraceError(
            str(path),
            1,
            "encoding",
            f"the file is {family} ({found}); traces are UTF-8: convert it to UTF-8, "
            f"e.g. iconv -f {found} -t UTF-8 {path} > trace.jsonl",
        )


def sniff_format(path: Path) -> str:
    """The format of a trace, from its first non-blank line: a JSON object's fields or a CSV
    header's columns (see the module docstring). A line that is neither is taken for v1, whose
    parser then says what is wrong with it; so is an empty file ("the trace is empty")."""
    head = _first_record(path)
    if head.startswith(b"{"):
        try:
            obj = orjson.loads(head)
        except orjson.JSONDecodeError:
            return "v1"
        return _sniff_fields(path, set(obj)) if isinstance(obj, dict) else "v1"
    columns = next(csv.reader([head.decode("utf-8", "replace")]), [])
    if head.startswith(b"[") or len(columns) < 2:
        return "v1"
    return _sniff_columns(path, [c.strip() for c in columns])


def _first_record(path: Path) -> bytes:
    try:
        with path.open("rb") as fh:
            for lineno, raw in enumerate(iter(lambda: fh.readline(SNIFF_LIMIT), b""), start=1):
                if len(raw) == SNIFF_LIMIT and not raw.endswith(b"\n"):
                    raise InputError(
                        f"{path}: the first record is longer than {SNIFF_LIMIT >> 20} MiB, too "
                        "long to recognise its format: pass --trace-format"
                    )
                head = (raw.removeprefix(UTF8_BOM) if lineno == 1 else raw).strip()
                if head:
                    return head
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc}") from None
    return b""


def _sniff_fields(path: Path, keys: set[str]) -> str:
    fmt = _match(path, keys, JSON_SIGNATURES, "first record's fields")
    if fmt is not None:
        return fmt
    if keys & set(Request.model_fields):
        return "v1"  # a v1 record with a missing or misspelt field: its parser names it
    raise InputError(
        f"{path}: the first record's fields ({', '.join(sorted(keys))}) match no known format "
        f"({_needs(JSON_SIGNATURES)}). Pass --trace-format, or map the fields you need: "
        "--trace-format jsonl:t=FIELD,in=FIELD,out=FIELD"
    )


def _sniff_columns(path: Path, columns: list[str]) -> str:
    fmt = _match(path, set(columns), CSV_SIGNATURES, "CSV header's columns")
    if fmt is not None:
        return fmt
    raise InputError(
        f"{path}: the CSV header's columns ({', '.join(columns)}) match no known format "
        f"({_needs(CSV_SIGNATURES)}). Pass --trace-format, or map the columns you need: "
        "--trace-format csv:t=COL,in=COL,out=COL"
    )


def _needs(signatures: tuple[Signature, ...]) -> str:
    """'mooncake has input_length, ...; openai-log has body or request'."""
    needs: dict[str, list[str]] = {}
    for s in signatures:
        needs.setdefault(s.fmt, []).append(", ".join(sorted(s.required)))
    return "; ".join(f"{fmt} has {' or '.join(sorted(alts))}" for fmt, alts in needs.items())


def _match(path: Path, keys: set[str], signatures: tuple[Signature, ...], what: str) -> str | None:
    """The one format the keys fit, None for none; more than one is an error."""
    fits = [s for s in signatures if s.required <= keys]
    exact = {s.fmt for s in fits if keys <= s.known}
    if len(exact) == 1:
        return exact.pop()  # the others would refuse a field this one reads
    formats = {s.fmt: s.units for s in fits}
    if len(formats) == 1:
        return next(iter(formats))  # its importer names the fields it does not read
    if not formats:
        return None
    raise InputError(
        f"{path}: the {what} ({', '.join(sorted(keys))}) fit more than one format, and their "
        "units differ: "
        + "; ".join(f"{fmt} ({units})" for fmt, units in formats.items())
        + ". Pass --trace-format with the one it is."
    )
