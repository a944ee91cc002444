"""Tables on stdout that a pipe keeps whole.

Rich draws at the terminal's width, or at 80 columns when stdout is not a terminal, so a table
piped to a file or a CI log had its columns cut or folded. Here the width is the terminal's on
a terminal and, anywhere else, as wide as the widest table needs.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console, RenderableType

_NATURAL = 100_000  # wide enough that a measurement is the renderable's own width


def print_tables(renderables: Iterable[RenderableType]) -> None:
    """Print ``renderables`` to stdout, each whole."""
    items = list(renderables)
    out = Console()
    if not out.is_terminal and items:
        probe = Console(width=_NATURAL)
        width = max(probe.measure(r).maximum for r in items)
        out = Console(width=max(width, 80))
    for r in items:
        out.print(r)
