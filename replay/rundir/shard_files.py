"""The load processes' own results files (``--workers``) and their merge into results.jsonl.

Each worker appends its results to ``results.w<k>.jsonl``, flushed per line; the parent merges
them into results.jsonl when the phase ends (also after an interrupt or a lost worker), then
removes them. A kill can leave half a line at the end of a worker's file (the request in
flight): the merge leaves it out, and ``--resume`` sends that request again. A kill of the
parent while it merges leaves rows in both places: the merge on resume (``ResumeState.load``
runs it first) skips the rows results.jsonl already has, so it is idempotent.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from replay.rundir.files import RESULTS, JsonlWriter, read_jsonl, repair_jsonl

_NAME = re.compile(r"results\.w(\d+)\.jsonl")


def shard_results(run_dir: Path, index: int) -> Path:
    return run_dir / f"results.w{index}.jsonl"


def leftover_shards(run_dir: Path) -> list[Path]:
    """Workers' files still in the run directory, in worker order."""
    found = [
        (int(m.group(1)), p)
        for p in run_dir.glob("results.w*.jsonl")
        if (m := _NAME.fullmatch(p.name))
    ]
    return [p for _, p in sorted(found)]


def complete_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The whole lines of a worker's file; a last line without its newline was cut short."""
    if not path.exists():
        return
    with path.open("rb") as fh:
        for raw in fh:
            if raw.endswith(b"\n") and raw.strip():
                yield orjson.loads(raw)


def merge_shards(paths: list[Path], writer: JsonlWriter) -> list[dict[str, Any]]:
    """Append the workers' rows to results.jsonl (``writer``), then remove their files: what
    one phase of this process wrote, whose rows are new by construction. When results.jsonl
    could not take them all (a full disk), the files stay for ``--resume`` to merge."""
    rows = [row for p in paths for row in complete_rows(p)]
    for row in rows:
        writer.write(row)
    if writer.failed is None:
        for p in paths:
            p.unlink(missing_ok=True)
    return rows


def _key(row: dict[str, Any]) -> tuple[str, str, str]:
    return (row["target"], row["phase"], row["request_id"])


def merge_leftovers(run_dir: Path) -> int:
    """Resume: merge what the workers of a killed process wrote, skipping rows results.jsonl
    already has (a kill between the merge's append and its removal). Returns rows added."""
    paths = leftover_shards(run_dir)
    if not paths:
        return 0
    results = run_dir / RESULTS
    repair_jsonl(results)  # a kill mid-merge: the half line goes before rows are appended
    known = {_key(row) for row in read_jsonl(results)}
    writer = JsonlWriter(results)
    added = 0
    try:
        for row in (r for p in paths for r in complete_rows(p)):
            if _key(row) not in known:
                known.add(_key(row))
                writer.write(row)
                added += 1
    finally:
        writer.close()
    for p in paths:
        p.unlink()
    return added
