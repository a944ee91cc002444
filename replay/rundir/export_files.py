"""What ``replay export`` writes a user will open: files never written through a link, and CSV
cells a spreadsheet shows but never runs.

A run directory holds text from outside (prompts, answers, a server's error messages) and may
itself come from elsewhere, so:

* **No link is followed.** The export folder and each table file must not be symbolic links
  (one planted as ``RUN_DIR/export`` would send the tables anywhere the user can write): a link
  is refused with one line naming it, and the file is opened with ``O_NOFOLLOW`` so that a link
  made after the check is refused too.
* **No cell is a formula.** A CSV text cell that begins as a formula does (``=``, ``+``, ``-``,
  ``@``, a tab or a carriage return: ``=HYPERLINK(...)``, ``=cmd|' /C calc'!A0``) gets a
  leading single quote, OWASP's rule against CSV injection. Numbers are never touched, nor is
  text that is a plain number (``-5``): a spreadsheet reads it as the number it is. Rows end
  in CRLF, so that a carriage return inside a cell is quoted and never ends a row early.
  Parquet files and ``load_run``'s DataFrames keep the text as it was: programs read them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import IO, Any

from replay.core.errors import InputError

# What a spreadsheet takes for the start of a formula (OWASP, "CSV Injection").
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def inert_cell(value: Any) -> Any:
    """``value`` as a CSV cell that no spreadsheet runs: text that begins as a formula gets a
    leading ``'``; anything else is returned as it is."""
    if (
        isinstance(value, str)
        and value.startswith(FORMULA_START)
        and not _PLAIN_NUMBER.fullmatch(value)
    ):
        return "'" + value
    return value


def export_folder(out_dir: Path) -> Path:
    """Make ``out_dir`` (and its parents) for the tables; a link there, or a folder that cannot
    be made, is an InputError naming it."""
    if out_dir.is_symlink():
        raise InputError(
            f"{out_dir}: is a symbolic link; export writes only into a real folder: remove "
            "the link, or give another folder with -o"
        )
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{out_dir}: cannot make the export folder: {reason(exc)}") from None
    return out_dir


def open_table(path: Path, mode: str) -> IO[Any]:
    """``path`` opened for writing (``"w"`` text, ``"wb"`` bytes), created or emptied, never
    through a link: an InputError names a link, or why the file cannot be opened."""
    link = (
        f"{path}: is a symbolic link; export never writes through one: remove it, or give "
        "another folder with -o"
    )
    if path.is_symlink():
        raise InputError(link)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if path.is_symlink():  # made after the check: O_NOFOLLOW refused it (ELOOP)
            raise InputError(link) from None
        raise InputError(f"{path}: cannot write it: {reason(exc)}") from None
    if "b" in mode:
        return os.fdopen(fd, mode)
    return os.fdopen(fd, mode, encoding="utf-8", newline="")


def reason(exc: OSError) -> str:
    return f"{exc.strerror} (errno {exc.errno})" if exc.strerror else str(exc)
