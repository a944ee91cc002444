"""What a sandbox run leaves to read: stdout and stderr captured as they come (the middle cut
beyond ``output_kb``), and the reason a run failed, from its timeout, its signal, its setup or
the last line of its stderr."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import IO

from replay.checkers.base import clip_reason
from replay.checkers.sandbox.limits import SandboxLimits

_SETUP_FAILED = 125  # the namespace init's exit status when it could not set up


# --- reasons ---------------------------------------------------------------------------------


def _reason(
    passed: bool,
    timed_out: bool,
    returncode: int | None,
    completed: bool,
    stderr: str,
    limits: SandboxLimits,
) -> str:
    if passed:
        return "tests passed"
    if timed_out:
        return f"timed out after {limits.wall_s:g} s"
    assert returncode is not None
    if returncode < 0:
        return _signal_reason(-returncode)
    last = _last_line(stderr)
    if returncode == _SETUP_FAILED and last.startswith("sandbox setup failed"):
        return clip_reason(last)
    if returncode == 0:
        return "exited with status 0 before the tests finished"
    if not last:
        return f"exited with status {returncode}"
    return clip_reason(_classify(last))


def _signal_reason(sig: int) -> str:
    if sig == signal.SIGXCPU:
        return "killed: CPU time limit"
    if sig == signal.SIGXFSZ:
        return "killed: file size limit"
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    if sig == signal.SIGKILL:
        return "killed: SIGKILL (CPU time hard limit or out of memory)"
    return f"killed: {name}"


def _classify(line: str) -> str:
    """The exception line, prefixed with the limit it points to when it points to one."""
    if "MemoryError" in line or "Cannot allocate memory" in line:
        return f"memory limit: {line}"
    if "[Errno 27]" in line:  # EFBIG
        return f"file size limit: {line}"
    if "[Errno 11]" in line or "can't start new thread" in line:  # EAGAIN from fork/clone
        return f"process limit: {line}"
    return line


def _last_line(text: str) -> str:
    for line in reversed(text.splitlines()):
        if line.strip():
            return line.strip()
    return ""


# --- output ----------------------------------------------------------------------------------


class _Capture:
    """Reads a pipe to its end on a thread; keeps its first and last ``limit / 2`` bytes."""

    def __init__(self, stream: IO[bytes], limit: int) -> None:
        self._stream = stream
        self._head_max = limit // 2
        self._tail_max = limit - self._head_max
        self._head = bytearray()
        self._tail = bytearray()
        self._dropped = 0
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            while chunk := os.read(self._stream.fileno(), 65536):
                self._add(chunk)

    def _add(self, chunk: bytes) -> None:
        room = self._head_max - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        self._tail += chunk
        excess = len(self._tail) - self._tail_max
        if excess > 0:
            del self._tail[:excess]
            self._dropped += excess

    def _join(self) -> None:
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._stream.close()

    def text(self) -> str:
        self._join()
        middle = f"\n[... {self._dropped} bytes truncated ...]\n".encode() if self._dropped else b""
        return bytes(self._head + middle + self._tail).decode("utf-8", errors="replace")
