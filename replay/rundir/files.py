"""The run directory: everything a run learns, written as it arrives.

reports/<run-id>/
  manifest.json          command, options, trace digest, tool version, each target's
                         introspection (rewritten as it grows)
  results.jsonl          one line per request and target, appended and flushed on completion
  results.w<k>.jsonl     --workers: load process k's results during a phase, merged into
                         results.jsonl when the phase ends (replay/rundir/shard_files.py)
  bad_lines.jsonl        trace lines that were skipped, with file, line, field and reason
  metrics/<target>.jsonl server /metrics scraped about once a second
  servers/<target>.log   stdout/stderr of servers kvcanary started
  grades.jsonl           per result: checker grade, agreement with the reference
  teacher_forced.jsonl   the reference's answers scored under each target (per token)
  summary.json           per target x bucket x phase aggregates, and quality
  run.lock               the pid of the process running it, under its flock (run_lock.py)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import orjson

from replay.analysis.schemas.manifest import MANIFEST_FILE
from replay.core.errors import InputError, RunDirError, TraceError
from replay.core.records import Result

RESULTS = "results.jsonl"
MANIFEST = MANIFEST_FILE
SUMMARY = "summary.json"
BAD_LINES = "bad_lines.jsonl"
GRADES = "grades.jsonl"
TEACHER_FORCED = "teacher_forced.jsonl"
# The capacity phase's own results, metrics and server logs (replay/run/capacity_phase.py).
CAPACITY_DIR = "capacity"

# -- where a run directory may go -------------------------------------------------------------


def run_id_problem(run_id: str) -> str | None:
    """Why ``run_id`` cannot name a run directory inside ``--out``, or None."""
    if run_id in ("", ".", ".."):
        return "must name a folder"
    if "/" in run_id or "\\" in run_id:
        return "must be one folder name, without '/': the run directory is --out/RUN_ID"
    if not run_id.isprintable() or run_id != run_id.strip():
        return "must be printable, without spaces at either end"
    return None


def check_run_location(root: Path, run_id: str | None) -> None:
    """Refuse, before a trace is read or a server started, a run directory that cannot be made
    inside ``root`` (``--out``): ``root`` a file or not writable, ``run_id`` not one folder name
    or taken already. ``new_run_dir`` makes it."""
    if run_id is not None:
        why = run_id_problem(run_id)
        if why is not None:
            raise InputError(f"--run-id {run_id!r}: {why}")
        taken = root / run_id
        if taken.exists() or taken.is_symlink():
            raise InputError(
                f"--run-id {run_id}: {taken} exists already; give another --run-id, or "
                f"continue that run with `replay --resume {taken}`"
            )
    existing = next((p for p in (root, *root.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise InputError(f"--out {root}: {existing} is a file, not a folder; give a folder")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"--out {root}: {existing} is not writable; give a folder you can write")


def new_run_dir(root: Path, run_id: str | None = None) -> Path:
    """Make ``root/run_id`` (a fresh name when None) with its subfolders; an InputError says why
    it cannot be made."""
    check_run_location(root, run_id)
    run_id = run_id or time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
    path = root / run_id
    try:
        path.mkdir(parents=True, exist_ok=False)
        (path / "metrics").mkdir()
        (path / "servers").mkdir()
    except FileExistsError:
        raise InputError(f"--run-id {run_id}: {path} exists already; give another") from None
    except OSError as exc:
        raise InputError(f"--out {root}: cannot make {path}: {_reason(exc)}") from None
    return path


# -- writing: whole lines and whole files, or a RunDirError ----------------------------------


def _reason(exc: OSError) -> str:
    return f"{exc.strerror} (errno {exc.errno})" if exc.strerror else str(exc)


def write_failure(path: Path, exc: OSError) -> RunDirError:
    return RunDirError(str(path), _reason(exc))


def _atomic(path: Path, fill: Callable[[IO[bytes]], object]) -> None:
    """Write ``path`` whole or not at all: a reader, a crash or a full disk never leaves half a
    file, and a failed write keeps the file as it was (RunDirError)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as fh:
            fill(fh)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise write_failure(path, exc) from None


def write_json(path: Path, obj: Any) -> None:
    """Atomic: a reader (or a crash) never sees half a file."""
    option = orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY
    data = orjson.dumps(obj, option=option)
    _atomic(path, lambda fh: fh.write(data))


def write_text(path: Path, text: str) -> None:
    """A text file of the run directory (a report), atomically."""
    data = text.encode("utf-8")
    _atomic(path, lambda fh: fh.write(data))


def read_json(path: Path) -> Any:
    return orjson.loads(path.read_bytes())


_LINE = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE


class JsonlWriter:
    """Append-only JSON lines, each written whole as it comes (a crash loses at most the line
    in flight).

    A write that fails (a full disk) is undone: the file is cut back to its whole lines, and
    neither that row nor any later one is written. With ``on_failure`` the writer reports the
    failure there once and then drops rows (its owner stops the run, which ``--resume`` finishes
    by sending what has no result), and never raises; without, the failed write (or opening
    the file) raises RunDirError, and so does every write after it."""

    def __init__(self, path: Path, on_failure: Callable[[RunDirError], None] | None = None) -> None:
        self.path = path
        self.on_failure = on_failure
        self._failed: RunDirError | None = None
        self._fd: int | None = None
        self._size = 0
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            self._size = os.fstat(self._fd).st_size
        except OSError as exc:
            self._fail(write_failure(path, exc))

    @property
    def failed(self) -> RunDirError | None:
        """The write that failed, if one did."""
        return self._failed

    def write(self, obj: Any) -> None:
        if self._failed is not None:
            if self.on_failure is None:
                raise self._failed
            return
        assert self._fd is not None, "writer closed"
        data = orjson.dumps(obj, option=_LINE)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)  # a partial line goes: whole lines only
            self._fail(write_failure(self.path, exc))
            return
        self._size += len(data)

    def _fail(self, err: RunDirError) -> None:
        self._failed = err
        if self.on_failure is None:
            raise err
        self.on_failure(err)

    def close(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        except OSError as exc:
            if self._failed is None:
                self._fail(write_failure(self.path, exc))
        finally:
            os.close(fd)


def write_bad_lines(run_dir: Path, bad: Iterable[TraceError]) -> int:
    n = 0

    def fill(fh: IO[bytes]) -> None:
        nonlocal n
        for err in bad:
            fh.write(orjson.dumps(err.as_dict(), option=orjson.OPT_APPEND_NEWLINE))
            n += 1

    _atomic(run_dir / BAD_LINES, fill)
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
    """Replace a JSONL file atomically (RunDirError, the old file kept, when it cannot be)."""

    def fill(fh: IO[bytes]) -> None:
        for row in rows:
            fh.write(orjson.dumps(row, option=_LINE))

    _atomic(path, fill)


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


def complete_rows(path: Path) -> Iterator[Any]:
    """The JSON lines of a file that a kill may have cut short: an unfinished last line is
    the one being written, not data. A line that is not JSON (a NaN, a torn write inside the
    file) is an InputError naming the file and line."""
    if not path.exists():
        return
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.endswith(b"\n"):
                return
            if raw.strip():
                try:
                    yield orjson.loads(raw)
                except orjson.JSONDecodeError as exc:
                    raise InputError(f"{path}:{lineno}: not JSON ({exc})") from None


def complete_results(run_dir: Path) -> Iterator[Result]:
    """The run's results as ``complete_rows`` reads them; a row that is not a result is an
    InputError naming it."""
    for lineno, row in enumerate(complete_rows(run_dir / RESULTS), 1):
        try:
            yield Result.from_json(row)
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(
                f"{run_dir / RESULTS}: result {lineno} is not a result "
                f"({type(exc).__name__}: {exc})"
            ) from None


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
