"""BurstGPT traces: four months of ChatGPT and GPT-4 requests served by Azure OpenAI.

Source: github.com/HPMLL/BurstGPT (README, "Schema"; ``data/BurstGPT_*.csv``), Wang et al.,
"BurstGPT: A Real-world Workload Dataset to Optimize LLM Serving Systems" (arXiv 2401.17644).
CSV with a header, e.g.::

    Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
    5,ChatGPT,472,18,490,Conversation log

``Timestamp`` is the submission time in seconds from 0:00:00 on the trace's first day,
``Model`` the model called (ChatGPT, GPT-4), ``Total tokens`` the sum of the two counts (read
only to check it is a count), ``Log Type`` "Conversation log" or "API log".

A row whose ``Response tokens`` is 0 is a request that failed (the README: ``BurstGPT_1.csv``
and ``_2.csv`` keep them, the ``without_fails`` files do not): it is counted as ``failed`` (a
``Skip``: the scan, ``replay trace validate`` and the run manifest report it) and not replayed.
The others become length-only requests with no shared prefix (the trace has no hash ids); meta
keeps the model and the log type. A column outside the six is refused.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from replay.core.errors import TraceError
from replay.traces.importers.lengths import LengthPolicy, Lengths, length_record
from replay.traces.importers.trace_rows import (
    Records,
    as_trace_error,
    csv_int,
    csv_rows,
    csv_seconds,
)
from replay.traces.trace import Skip

COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
REQUIRED = ("Timestamp", "Model", "Request tokens", "Response tokens")
FAILED = Skip("failed")


def import_burstgpt(path: Path, policy: LengthPolicy) -> Records:
    """BurstGPT CSV (see the module docstring); failed requests are counted, not replayed."""
    src = str(path)
    for lineno, row in csv_rows(path, REQUIRED, COLUMNS, "BurstGPT's " + ",".join(COLUMNS)):
        if isinstance(row, TraceError):
            yield lineno, row
            continue
        try:
            t = csv_seconds(row, "Timestamp")
            model = (row.get("Model") or "").strip()
            if not model:
                raise ValueError("Model: empty")
            inp = csv_int(row, "Request tokens")
            out = csv_int(row, "Response tokens", minimum=0)
            if (row.get("Total tokens") or "").strip():
                csv_int(row, "Total tokens")  # not used (it is the sum), but must be a count
            if out == 0:
                yield lineno, FAILED
                continue
            meta = {"source": "burstgpt", "line": lineno, "model": model}
            if (row.get("Log Type") or "").strip():
                meta["log_type"] = (row.get("Log Type") or "").strip()
            record = length_record(f"burstgpt-{lineno}", t, Lengths(inp, out), policy, meta)
            yield lineno, record
        except (ValueError, ValidationError) as exc:
            yield lineno, as_trace_error(src, lineno, exc)
