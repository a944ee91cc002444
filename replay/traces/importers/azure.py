"""Azure LLM inference traces 2023/2024 (Azure/AzurePublicDataset): CSV of ``TIMESTAMP`` (a
date-time with 7 fractional digits), ``ContextTokens`` and ``GeneratedTokens``.

Arrival offsets count from the first row; there are no hash ids, so no prefix is shared.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from pydantic import ValidationError

from replay.core.errors import TraceError
from replay.traces.importers.lengths import LengthPolicy, Lengths, length_record
from replay.traces.importers.trace_rows import Records, as_trace_error, csv_int, csv_rows

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def parse_azure_time(text: str) -> float:
    """'2023-11-16 18:15:46.6805900' (7 fractional digits) -> POSIX seconds."""
    whole, _, frac = text.strip().partition(".")
    base = datetime.fromisoformat(whole).timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def import_azure(path: Path, policy: LengthPolicy) -> Records:
    """Azure LLM inference traces 2023/2024 CSV: ``TIMESTAMP, ContextTokens, GeneratedTokens``."""
    src = str(path)
    first: float | None = None
    for lineno, row in csv_rows(path, COLUMNS, COLUMNS, ",".join(COLUMNS)):
        if isinstance(row, TraceError):
            yield lineno, row
            continue
        try:
            try:
                t = parse_azure_time(row["TIMESTAMP"] or "")
            except (ValueError, TypeError):
                raise ValueError(f"TIMESTAMP: not a date-time: {row['TIMESTAMP']!r}") from None
            first = t if first is None else first
            lengths = Lengths(csv_int(row, "ContextTokens"), csv_int(row, "GeneratedTokens"))
            meta = {"source": "azure", "line": lineno}
            record = length_record(f"azure-{lineno}", max(0.0, t - first), lengths, policy, meta)
            yield lineno, record
        except (ValueError, ValidationError) as exc:
            yield lineno, as_trace_error(src, lineno, exc)
