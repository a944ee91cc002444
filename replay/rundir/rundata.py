"""A run directory as tables: results, grades, server metrics and teacher-forced scores.

``load_run(RUN_DIR)`` gives pandas DataFrames, one row per request x target (results, grades),
per scrape (metrics) or per scored sequence (teacher-forced), with the nested JSON flattened
into named columns, so a user can answer their own questions of a run without parsing JSONL:

    run = replay.load_run("reports/20261201-...")
    run.results.groupby(["target", "bucket"])["ttft_s"].median()

What the tables leave out is what has no place in a cell: token ids, per-chunk arrival times
(their count and the ITL summary stay) and the metrics' histogram buckets (sums and counts
stay). ``replay export RUN_DIR --format csv|parquet`` writes the same tables to files, a piece
at a time (``EXPORT_ROWS`` rows), each column of one declared type, never through a link and
with no CSV cell a spreadsheet would run as a formula (``export_files``). The tables are read
as the analysis reads them: a last line a kill cut short is left out, a line that is not JSON
(a NaN) is an error naming it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from replay.core.errors import InputError
from replay.rundir.export_files import export_folder, inert_cell, open_table, reason
from replay.rundir.files import (
    GRADES,
    MANIFEST,
    RESULTS,
    TEACHER_FORCED,
    complete_results,
    complete_rows,
)

if TYPE_CHECKING:
    import pandas as pd

TABLES = ("results", "grades", "metrics", "teacher_forced")


@dataclass(frozen=True)
class RunData:
    run_dir: Path
    results: pd.DataFrame
    grades: pd.DataFrame
    metrics: pd.DataFrame
    teacher_forced: pd.DataFrame

    def tables(self) -> dict[str, pd.DataFrame]:
        return {name: getattr(self, name) for name in TABLES}


def load_run(run_dir: str | Path) -> RunData:
    """The run directory's results, grades, metrics and teacher-forced scores as DataFrames
    (empty ones, with their columns, for what a run did not write)."""
    path = _run_path(run_dir)
    frames = {name: _frame(rows, columns) for name, (rows, columns) in _table_rows(path).items()}
    return RunData(run_dir=path, **frames)


def _run_path(run_dir: str | Path) -> Path:
    path = Path(run_dir)
    if not (path / MANIFEST).is_file() and not (path / RESULTS).is_file():
        raise InputError(
            f"{path}: no manifest.json or results.jsonl; is this a kvcanary run directory?"
        )
    return path


def _table_rows(path: Path) -> dict[str, tuple[Iterator[dict[str, Any]], list[str]]]:
    """Each table's rows, read as they are asked for, and its columns."""
    return {
        "results": (_result_rows(path), RESULT_COLUMNS),
        "grades": (_grade_rows(path / GRADES), GRADE_COLUMNS),
        "metrics": (_metric_rows(path / "metrics"), METRIC_COLUMNS),
        "teacher_forced": (_tf_rows(path / TEACHER_FORCED), TF_COLUMNS),
    }


def _frame(rows: Iterable[Mapping[str, Any]], columns: list[str]) -> pd.DataFrame:
    """The rows as a table, gathered column by column as they are read: a million rows are
    never held as a million dicts."""
    import pandas as pd

    cells = next(_gathered(rows, columns, None))
    if not cells[columns[0]]:
        return pd.DataFrame([], columns=columns)  # no rows: its columns, of no type yet
    return pd.DataFrame(cells, columns=columns)


def _gathered(
    rows: Iterable[Mapping[str, Any]], columns: Sequence[str], size: int | None
) -> Iterator[dict[str, list[Any]]]:
    """The rows' cells, column by column, ``size`` rows at a time (None: all at once); at
    least one piece, which a table without rows gives empty."""
    cells: dict[str, list[Any]] = {c: [] for c in columns}
    given = False
    for row in rows:
        for c, values in cells.items():
            values.append(row.get(c))
        if len(cells[columns[0]]) == size:
            yield cells
            cells, given = {c: [] for c in columns}, True
    if cells[columns[0]] or not given:
        yield cells


EXPORT_ROWS = 65_536  # rows a table is written at a time: what export holds, at any size
CSV_ROW_END = "\r\n"


def export_run(run_dir: str | Path, out_dir: Path, fmt: str) -> list[Path]:
    """Write each table as ``<table>.csv`` or ``<table>.parquet`` under ``out_dir``: the rows
    ``load_run`` gives, ``EXPORT_ROWS`` at a time, each column of one declared type
    (``_kinds``: whole numbers stay whole where some are missing)."""
    if fmt not in ("csv", "parquet"):
        raise InputError(f"--format: '{fmt}' is not one of csv, parquet")
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401  (the parquet writer)
        except ImportError:
            raise InputError(
                "--format parquet needs pyarrow: pip install 'kvcanary[data]' (or use --format csv)"
            ) from None
    path = _run_path(run_dir)
    export_folder(out_dir)
    written = []
    for name, (rows, columns) in _table_rows(path).items():
        target = out_dir / f"{name}.{fmt}"
        kinds = _kinds(name, columns)
        chunks = _typed_chunks(rows, kinds)
        with open_table(target, "w" if fmt == "csv" else "wb") as fh:
            try:
                if fmt == "csv":
                    _write_csv(fh, chunks, kinds)
                else:
                    _write_parquet(fh, chunks, kinds)
            except OSError as exc:  # a full disk: the file, not a traceback
                raise InputError(f"{target}: cannot write it: {reason(exc)}") from None
        written.append(target)
    return written


def _write_csv(fh: IO[str], chunks: Iterable[pd.DataFrame], kinds: Mapping[str, str]) -> None:
    """The chunks as CSV, every text cell ``inert_cell`` (no spreadsheet runs it). Rows end in
    CRLF (RFC 4180), so a cell holding a carriage return is quoted: with a bare LF it was not,
    and a reader ended the row there, making the rest of an answer a row of its own (whose
    first cell could be a formula again)."""
    text = [c for c, k in kinds.items() if k == "text"]
    for k, chunk in enumerate(chunks):
        for column in text:
            chunk[column] = chunk[column].map(inert_cell)
        chunk.to_csv(fh, header=k == 0, index=False, lineterminator=CSV_ROW_END)


def _typed_chunks(
    rows: Iterable[Mapping[str, Any]], kinds: Mapping[str, str]
) -> Iterator[pd.DataFrame]:
    """The rows as frames of ``EXPORT_ROWS``, each column of its kind (at least one frame: a
    table with no rows is written with its columns)."""
    import pandas as pd

    dtypes = {c: _PANDAS[k] for c, k in kinds.items()}
    for cells in _gathered(rows, list(kinds), EXPORT_ROWS):
        yield pd.DataFrame({c: pd.array(v, dtype=dtypes[c]) for c, v in cells.items()})


def _write_parquet(
    target: IO[bytes], chunks: Iterable[pd.DataFrame], kinds: Mapping[str, str]
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = {"text": pa.string(), "float": pa.float64(), "int": pa.int64(), "bool": pa.bool_()}
    schema = pa.schema([(c, types[k]) for c, k in kinds.items()])
    with pq.ParquetWriter(target, schema) as writer:
        for chunk in chunks:
            writer.write_table(pa.Table.from_pandas(chunk, schema=schema, preserve_index=False))


# -- rows ---------------------------------------------------------------------------------------

RESULT_COLUMNS = [
    "target",
    "phase",
    "bucket",
    "request_id",
    "status",
    "error_kind",
    "error",
    "http_status",
    "scheduled",
    "sent",
    "first_token",
    "done",
    "queue_delay_s",
    "ttft_s",
    "e2e_s",
    "itl_mean_s",
    "itl_p50_s",
    "chunks",
    "prompt_tokens",
    "output_tokens",
    "finish_reason",
    "tool_calls",
    "tokens_estimated",
    "chunk_tokens_estimated",
    "output_truncated",
    "output_text",
    "first_answer_token",
    "time_to_answer_s",
    "reasoning_tokens",
    "reasoning_tokens_estimated",
    "shared_stamps",
]


def _result_rows(run_dir: Path) -> Iterator[dict[str, Any]]:
    for r in complete_results(run_dir):
        itl = r.itl()
        yield {
            "target": r.target,
            "phase": r.phase,
            "bucket": r.bucket,
            "request_id": r.request_id,
            "status": r.status,
            "error_kind": r.error_kind,
            "error": r.error,
            "http_status": r.http_status,
            "scheduled": r.scheduled,
            "sent": r.sent,
            "first_token": r.first_token,
            "done": r.done,
            "queue_delay_s": r.queue_delay,
            "ttft_s": r.ttft,
            "e2e_s": r.e2e,
            "itl_mean_s": statistics.fmean(itl) if itl else None,
            "itl_p50_s": statistics.median(itl) if itl else None,
            "chunks": len(r.chunk_times),
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens,
            "finish_reason": r.finish_reason,
            "tool_calls": len(r.tool_calls),
            "tokens_estimated": r.tokens_estimated,
            "chunk_tokens_estimated": r.chunk_tokens_estimated,
            "output_truncated": r.output_truncated,
            "output_text": r.output_text,
            "first_answer_token": r.first_answer_token,
            "time_to_answer_s": r.time_to_answer,
            "reasoning_tokens": r.reasoning_tokens,
            "reasoning_tokens_estimated": r.reasoning_tokens_estimated,
            "shared_stamps": r.shared_stamps,
        }


GRADE_COLUMNS = [
    "target",
    "phase",
    "bucket",
    "request_id",
    "task",
    "answered",
    "error",
    "grade_passed",
    "grade_reason",
    "grade_score",
    "derived_rule",
    "derived_passed",
    "derived_reason",
    "agree_exact",
    "agree_normalized",
    "first_divergence",
]


def _grade_rows(path: Path) -> Iterator[dict[str, Any]]:
    for row in _jsonl(path):
        grade = _obj(row.get("grade"))
        derived = _obj(row.get("derived"))
        agree = _obj(row.get("agreement"))
        yield {
            "target": row.get("target"),
            "phase": row.get("phase"),
            "bucket": row.get("bucket"),
            "request_id": row.get("request_id"),
            "task": row.get("task"),
            "answered": row.get("answered"),
            "error": row.get("error"),
            "grade_passed": grade.get("passed"),
            "grade_reason": grade.get("reason"),
            "grade_score": grade.get("score"),
            "derived_rule": derived.get("rule"),
            "derived_passed": derived.get("passed"),
            "derived_reason": derived.get("reason"),
            "agree_exact": agree.get("exact"),
            "agree_normalized": agree.get("normalized"),
            "first_divergence": agree.get("first_divergence"),
        }


METRIC_KEYS = (
    "running",
    "waiting",
    "kv_usage",
    "prefix_queries",
    "prefix_hits",
    "preemptions",
    "prompt_tokens",
    "generation_tokens",
)
METRIC_COLUMNS = [
    "target",
    "t",
    *METRIC_KEYS,
    *(f"{h}_{k}" for h in ("ttft", "itl", "e2e") for k in ("sum", "count")),
]


def _metric_rows(folder: Path) -> Iterator[dict[str, Any]]:
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("*.jsonl")):
        for snap in _jsonl(path):
            row: dict[str, Any] = {"target": path.stem, "t": snap.get("t")}
            row.update({k: snap.get(k) for k in METRIC_KEYS})
            for h in ("ttft", "itl", "e2e"):
                hist = _obj(snap.get(f"{h}_hist"))
                row[f"{h}_sum"], row[f"{h}_count"] = hist.get("sum"), hist.get("count")
            yield row


TF_COLUMNS = ["target", "request_id", "bucket", "tokens", "mean_nll", "top1_agreement", "error"]


def _tf_rows(path: Path) -> Iterator[dict[str, Any]]:
    for row in _jsonl(path):
        nll = [x for x in row.get("nll") or () if isinstance(x, (int, float))]
        top1 = list(row.get("top1") or ())
        yield {
            "target": row.get("target"),
            "request_id": row.get("request_id"),
            "bucket": row.get("bucket"),
            "tokens": row.get("n"),
            "mean_nll": statistics.fmean(nll) if nll else None,
            "top1_agreement": sum(map(bool, top1)) / len(top1) if top1 else None,
            "error": row.get("error"),
        }


# Each column's type as export writes it (a name in several tables has one type in all but
# metrics, whose every number is a Prometheus float: ``_kinds``).
_KINDS: dict[str, str] = {
    **dict.fromkeys(
        (
            *("target", "phase", "bucket", "request_id", "status", "error_kind", "error"),
            *("finish_reason", "output_text", "task", "grade_reason", "derived_rule"),
            "derived_reason",
        ),
        "text",
    ),
    **dict.fromkeys(
        (
            *("scheduled", "sent", "first_token", "done", "queue_delay_s", "ttft_s", "e2e_s"),
            *("itl_mean_s", "itl_p50_s", "first_answer_token", "time_to_answer_s", "t"),
            *("grade_score", "mean_nll", "top1_agreement"),
        ),
        "float",
    ),
    **dict.fromkeys(
        (
            *("http_status", "chunks", "prompt_tokens", "output_tokens", "tool_calls"),
            *("reasoning_tokens", "shared_stamps", "first_divergence", "tokens"),
        ),
        "int",
    ),
    **dict.fromkeys(
        (
            *("tokens_estimated", "chunk_tokens_estimated", "output_truncated"),
            *("reasoning_tokens_estimated", "answered", "grade_passed", "derived_passed"),
            *("agree_exact", "agree_normalized"),
        ),
        "bool",
    ),
}
# The pandas type of each kind: nullable, so that a missing value stays missing.
_PANDAS = {"text": "object", "float": "Float64", "int": "Int64", "bool": "boolean"}


def _kinds(table: str, columns: list[str]) -> dict[str, str]:
    if table == "metrics":
        return {c: "text" if c == "target" else "float" for c in columns}
    return {c: _KINDS[c] for c in columns}


def _jsonl(path: Path) -> Iterable[Mapping[str, Any]]:
    """A table's lines as the analysis reads them (``complete_rows``: a line a kill cut short
    is left out, one that is not JSON is an InputError naming it)."""
    if not path.is_file():
        return ()
    return (row for row in complete_rows(path) if isinstance(row, Mapping))


def _obj(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}
