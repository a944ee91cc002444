"""The view models every section builds and both renderers read: a ``Table`` of ``Cell``s
(the HTML template draws it, the Markdown writer keeps its text)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Cell:
    text: str
    cls: str = ""
    title: str = ""


@dataclass
class Table:
    headers: list[str]
    rows: list[list[Cell]] = field(default_factory=list)
    caption: str = ""

    def add(self, *cells: str | Cell) -> None:
        self.rows.append([c if isinstance(c, Cell) else Cell(c, _numeric(c)) for c in cells])


NUMERIC = re.compile(r"[+\-]?\d[\d,]*(\.\d+)?[%×]?(\s.*)?")


def _numeric(s: str) -> str:
    """Right-align numbers (with an interval or a count after them), not labels like 256-1K."""
    return "num" if NUMERIC.fullmatch(s) else ""
