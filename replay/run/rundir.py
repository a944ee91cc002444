"""The run directory: everything a run learns, written as it arrives.

reports/<run-id>/
  manifest.json          command, options, trace digest, tool version, each target's
                         introspection (rewritten as it grows)
  results.jsonl          one line per request and target, appended and flushed on completion
  results.w<k>.jsonl     --workers: load process k's results during a phase, merged into
                         results.jsonl when the phase ends (replay/run/shard_files.py)
  bad_lines.jsonl        trace lines that were skipped, with file, line, field and reason
  metrics/<target>.jsonl server /metrics scraped about once a second
  servers/<target>.log   stdout/stderr of servers kvcanary started
  grades.jsonl           per result: checker grade, agreement with the reference
  teacher_forced.jsonl   the reference's answers scored under each target (per token)
  summary.json           per target x bucket x phase aggregates, and quality
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

import orjson

from replay.core.errors import TraceError
from replay.core.records import Result

RESULTS = "results.jsonl"
MANIFEST = "manifest.json"
SUMMARY = "summary.json"
BAD_LINES = "bad_lines.jsonl"
GRADES = "grades.jsonl"
TEACHER_FORCED = "teacher_forced.jsonl"
# The capacity phase's own results, metrics and server logs (replay/run/capacity.py).
CAPACITY_DIR = "capacity"


def new_run_dir(root: Path, run_id: str | None = None) -> Path:
    run_id = run_id or time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
    path = root / run_id
    path.mkdir(parents=True, exist_ok=False)
    (path / "metrics").mkdir()
    (path / "servers").mkdir()
    return path


def write_json(path: Path, obj: Any) -> None:
    """Atomic: a reader (or a crash) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(
        orjson.dumps(
            obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY
        )
    )
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return orjson.loads(path.read_bytes())


class JsonlWriter:
    """Append-only JSON lines, flushed per line so a crash loses at most the line in flight."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: TextIO | None = path.open("a", encoding="utf-8")

    def write(self, obj: Any) -> None:
        assert self._fh is not None, "writer closed"
        self._fh.write(orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY).decode() + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None


def write_bad_lines(run_dir: Path, bad: Iterable[TraceError]) -> int:
    n = 0
    with (run_dir / BAD_LINES).open("w", encoding="utf-8") as fh:
        for err in bad:
            fh.write(orjson.dumps(err.as_dict()).decode() + "\n")
            n += 1
    return n


def repair_jsonl(path: Path) -> int:
    """A crash can leave half a line at the end: cut it off. Returns the bytes removed."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return 0
    keep = data.rfind(b"\n") + 1
    with path.open("r+b") as fh:
        fh.truncate(keep)
    return len(data) - keep


def rewrite_jsonl(path: Path, rows: Iterable[Any]) -> None:
    """Replace a JSONL file atomically."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(orjson.dumps(row).decode() + "\n")
    os.replace(tmp, path)


def read_jsonl(path: Path) -> Iterator[Any]:
    if not path.exists():
        return
    with path.open("rb") as fh:
        for raw in fh:
            if raw.strip():
                yield orjson.loads(raw)


def read_results(run_dir: Path) -> Iterator[Result]:
    path = run_dir / RESULTS
    if not path.exists():
        return
    with path.open("rb") as fh:
        for raw in fh:
            if raw.strip():
                yield Result.from_json(orjson.loads(raw))


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
