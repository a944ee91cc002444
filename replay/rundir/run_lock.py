"""One process at a time in a run directory.

``holding(run_dir)`` takes an exclusive ``flock`` on ``run.lock`` in it for as long as the run
lasts, and writes its pid there. A second ``replay --resume`` of the same directory (or of a run
still starting) is refused at once, naming the directory and the holder's pid: two processes
would each rewrite ``results.jsonl`` and the manifest under the other. The kernel releases the
lock when the holder's descriptor closes, however the process ends, so a crash or a kill never
leaves a stale lock (the file stays; it holds nothing). The descriptor is not inherited by the
servers and load processes a run starts (close-on-exec), so none of them keeps the lock after
the run has gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from replay.core.errors import InputError

LOCK_FILE = "run.lock"


@contextlib.contextmanager
def holding(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir`` while the block runs; an InputError says who holds it already."""
    path = run_dir / LOCK_FILE
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        raise InputError(f"{run_dir}: cannot open its lock file {LOCK_FILE}: {exc}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(_held_message(run_dir, _holder(fd))) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def _holder(fd: int) -> int | None:
    """The pid the holder wrote, if it has yet (it writes it just after taking the lock)."""
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None


def _held_message(run_dir: Path, pid: int | None) -> str:
    who = f"pid {pid}" if pid is not None else "a process that has not yet written its pid"
    stop = f"kill {pid}" if pid is not None else "stop it"
    return (
        f"{run_dir}: the run directory is in use by another replay ({who}); two processes "
        f"in one run would write over each other's results. Wait for it to end (or {stop}), "
        f"then continue the run with `replay --resume {run_dir}`"
    )
