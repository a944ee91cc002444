"""Request ids: one grammar, checked wherever a trace is read, and the id files that use it.

Ids name requests in the trace, in every result, and in the id files: ``calibration_ids.txt``
and ``evaluation_ids.txt`` (written by kvcal) and ``--exclude-ids`` (read by the replay), which
hold one id a line, each line stripped, blank lines and lines starting with ``#`` skipped (so a
person can annotate one). For such a file to name every request exactly, an id is:

* not empty;
* printable characters only (``str.isprintable``): no control character (newline, tab, NUL,
  ESC...), no format character (the bidi override U+202E, a zero-width space...), no line or
  paragraph separator, no space but U+0020;
* without a space at either end;
* not starting with ``#``.

``id_problem`` says what an id breaks; the trace refuses such a record by line and field before
anything is sent, so every id a trace accepts goes into an id file and comes back unchanged, and
a calibration request can never be evaluated because its id read back as another.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from replay.core.errors import InputError

COMMENT = "#"


def id_problem(rid: str) -> str | None:
    """Why ``rid`` is not a request id (an id file could not hold it), or None."""
    if not rid:
        return "must not be empty"
    if not rid.isprintable():
        bad = next(ch for ch in rid if not ch.isprintable())
        return (
            f"holds U+{ord(bad):04X}, which is not a printable character (an id file holds "
            "one id a line; give ids without control, format or separator characters)"
        )
    if rid != rid.strip():
        return "must not start or end with a space (id files strip their lines)"
    if rid.startswith(COMMENT):
        return f"must not start with '{COMMENT}' (id files skip such lines as comments)"
    return None


def write_ids(path: Path, ids: Iterable[str]) -> None:
    """An id file: one id a line. Ids come from a loaded trace, so each fits the grammar; one
    that does not is a bug here, never a file that reads back otherwise."""
    lines = []
    for rid in ids:
        why = id_problem(rid)
        if why is not None:
            raise ValueError(f"request id {rid!r} {why}")
        lines.append(rid + "\n")
    path.write_text("".join(lines), encoding="utf-8")


def read_ids(path: Path, option: str) -> set[str]:
    """The ids an id file lists; a line that is no id names itself (``option`` names the
    option or file it was given as)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{option}: cannot read {path}: {exc}") from None
    ids: set[str] = set()
    for lineno, line in enumerate(text.split("\n"), start=1):
        rid = line.strip()
        if not rid or rid.startswith(COMMENT):
            continue
        why = id_problem(rid)
        if why is not None:
            raise InputError(f"{option}: {path}:{lineno}: {rid!r} is not a request id: it {why}")
        ids.add(rid)
    if not ids:
        raise InputError(f"{option}: {path} lists no request ids (one a line expected)")
    return ids
