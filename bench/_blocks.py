"""Generated blocks in a Markdown file: the text between a begin and an end marker, rewritten
from a results file (``tables.py``, ``real_model.py``, ``first_run.py``)."""

from __future__ import annotations

import textwrap
from pathlib import Path


def rewrite(text: str, begin: str, end: str, block: str, where: Path) -> str:
    """``text`` with the block between ``begin`` and ``end`` replaced by ``block``;
    ValueError naming ``where`` when the markers are missing."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"{where}: no '{begin}' ... '{end}' block to rewrite")
    return text[: start + len(begin)] + "\n" + block + text[stop:]


def paragraph(text: str, width: int = 96) -> str:
    """``text`` wrapped as the docs' prose is, words and hyphenated names kept whole."""
    return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False)
