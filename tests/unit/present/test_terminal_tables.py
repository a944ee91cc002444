"""Tables on stdout keep every column whole when stdout is a pipe (rich would draw them at 80
columns, cutting cells to "…")."""

from __future__ import annotations

import pytest
from rich.table import Table

from replay.present.terminal import print_tables


def wide_table() -> Table:
    table = Table("layer", *(f"setting number {i} of this advice" for i in range(6)))
    table.add_row("12", *(f"+0.{i:04d} [+0.0001, +0.0002]" for i in range(6)))
    return table


def test_a_piped_table_is_as_wide_as_it_needs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    print_tables([wide_table()])
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) > 80
    assert "…" not in out
    assert "setting number 5 of this advice" in out
    assert "+0.0005 [+0.0001, +0.0002]" in out


def test_a_narrow_table_is_drawn_as_before(capsys: pytest.CaptureFixture[str]) -> None:
    table = Table("a", "b")
    table.add_row("1", "2")
    print_tables([table])
    out = capsys.readouterr().out
    assert "│ 1 │ 2 │" in out
