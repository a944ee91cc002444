"""The workers section: a distributed Locust run's load generators, one row each (what it was
given, re-assigned or adopted, what it sent and had answered, what it lost and why), from the
summary's ``driver.accounts`` (``replay.locust.ledger``). Absent for any other run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replay.present.formatting import DASH, f_int, text
from replay.present.reading import Run
from replay.present.views import Table

HEADERS = [
    "Worker",
    "Status",
    "Assigned",
    "Adopted",
    "Sent",
    "Answered",
    "Lost",
    "Re-assigned",
    "Unavailable",
    "Why",
]
NOTE = (
    "Each worker's part of the trace. Sent and answered: the requests it reported. Lost: it "
    "had taken them for sending when it was lost, and no result came back (they may have "
    "reached the target; they count as answered by nobody). Re-assigned: its unsent requests, "
    "sent by the workers that adopted them instead. Unavailable: unsent, and not re-assigned."
)


def workers_view(run: Run) -> dict[str, Any] | None:
    driver = run.summary.driver or run.manifest.driver or {}
    books = driver.get("accounts") if isinstance(driver, Mapping) else None
    if not isinstance(books, list) or not books:
        return None
    table = Table(list(HEADERS))
    for a in books:
        if isinstance(a, Mapping):
            table.add(*_row(a))
    lost = sum(int(a.get("lost") or 0) for a in books if isinstance(a, Mapping))
    return {"note": NOTE, "table": table, "lost": lost}


def _row(a: Mapping[str, Any]) -> list[str]:
    shard, node = a.get("shard"), text(a.get("node"))
    name = f"{int(shard) + 1}: {node}" if isinstance(shard, int) else node
    status = text(a.get("status"))
    if a.get("back_at_s") is not None:
        status += f" (back at {float(a['back_at_s']):.1f} s)"
    why = text(a.get("reason")) if a.get("reason") else DASH
    if a.get("answered_after_loss"):
        why += f"; {f_int(a['answered_after_loss'])} answered after it was lost"
    counts = ("assigned", "adopted", "sent", "answered", "lost", "reassigned", "unavailable")
    return [name, status, *(f_int(a.get(k)) for k in counts), why]
