"""Processes and uids of the sandbox: a dedicated uid per concurrent run (one no account has and no
process runs as), the tasks a uid runs (what RLIMIT_NPROC counts), and the kills that leave
nothing of a run behind."""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

_UID_BASE, _UID_COUNT = 61000, 2000
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


def _acquire_uid() -> int:
    """A uid of our range that no account has and no process runs as, for this run alone."""
    busy = {uid for _, uid, _ in _processes()}
    start = secrets.randbelow(_UID_COUNT)
    with _uid_lock:
        for i in range(_UID_COUNT):
            uid = _UID_BASE + (start + i) % _UID_COUNT
            if uid in busy or uid in _uids_in_use or _is_account(uid):
                continue
            _uids_in_use.add(uid)
            return uid
    raise RuntimeError("no free sandbox uid")


def _release_uid(uid: int) -> None:
    with _uid_lock:
        _uids_in_use.discard(uid)


def _is_account(uid: int) -> bool:
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return False


def _processes() -> Iterator[tuple[int, int, str]]:
    """(pid, real uid, state letter) of every process, from /proc."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(entry.path, "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        try:
            yield int(entry.name), int(fields["Uid"].split()[0]), fields["State"].split()[0]
        except (KeyError, ValueError, IndexError):
            continue


def _tasks_of_uid(uid: int) -> int:
    """Threads of all processes of ``uid``: what RLIMIT_NPROC counts."""
    total = 0
    for pid, owner, _ in _processes():
        if owner == uid:
            with contextlib.suppress(OSError):
                total += max(1, len(os.listdir(f"/proc/{pid}/task")))
    return total


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _kill_uid(uid: int) -> None:
    """SIGKILL every live process of the sandbox uid until none is left (bounded)."""
    for _ in range(50):
        alive = [pid for pid, owner, state in _processes() if owner == uid and state != "Z"]
        if not alive:
            return
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
