"""The report's section views: one module per group of sections builds each one's view from
a ``Run`` (``sections`` puts them in order), and here is the view model they all build and
both renderers read: a ``Table`` of ``Cell``s (the HTML template draws it, the Markdown
writer keeps its text).

    verdict        the verdict with its evidence and a few numbers at a glance; serving path
    quality        quality per bucket: pass rates, paired differences, noise floor, agreement
    systems        speed and capacity: paired latency, distributions, KV capacity and usage
    systems_rule   the systems rule's cells and the capacity phase's arms
    load           a sweep's latency against load, its knees and SLO ceilings
    sequential     how a sequential canary reached its decision
    workers        a distributed Locust run's load generators
    requests       the per-request drill-down
"""

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
