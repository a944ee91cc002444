"""Write a generated page, or check that it is current (``--check``): the command line both
reference pages share (``cli_reference.py``, ``run_directory_reference.py``)."""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path


def write_or_check(argv: list[str] | None, about: str, page: Path, text: str, root: Path) -> int:
    """Rewrite ``page`` with ``text``; with ``--check``, exit status 1 and a diff when the
    page on disk differs from it."""
    ap = argparse.ArgumentParser(description=about)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    name = page.relative_to(root)
    if a.check:
        old = page.read_text(encoding="utf-8") if page.exists() else ""
        if old != text:
            diff = difflib.unified_diff(old.splitlines(True), text.splitlines(True), "old", "now")
            print("".join(list(diff)[:60]))
            print(f"{name} is stale: run the script that generates it (its first line says)")
            return 1
        return 0
    page.write_text(text, encoding="utf-8")
    print(f"wrote {name}")
    return 0
