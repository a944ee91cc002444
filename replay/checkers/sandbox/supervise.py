"""One sandbox run, supervised: the nonce written into its pipe and the result pipe opened before
the sandbox starts, the process tree watched to its end or its wall timeout and then killed,
and the verdict: the result pipe must hold the harness's lock report and the nonce alone, and
the exit status be 0."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import time
from pathlib import Path

from replay.checkers.sandbox.command import _command, _env, _unwrap_shell_status
from replay.checkers.sandbox.limits import SandboxLimits, SandboxResult, _Plan
from replay.checkers.sandbox.output import _Capture, _reason
from replay.checkers.sandbox.procs import _kill_group, _kill_uid

_CHANNEL_MAX = 65536  # bytes read back from the result pipe (the harness writes ~100)


def _supervise(plan: _Plan, workdir: Path, uid: int | None, limits: SandboxLimits) -> SandboxResult:
    nonce = secrets.token_hex(16).encode()
    nonce_r, nonce_w = os.pipe()
    try:
        os.write(nonce_w, nonce)  # far below a pipe's buffer: never blocks
    finally:
        os.close(nonce_w)
    try:
        result_r, result_w = os.pipe()
    except BaseException:
        os.close(nonce_r)
        raise
    try:
        argv, preexec, user = _command(plan, workdir, uid, limits, (nonce_r, result_w))
        home = "/tmp" if plan.namespaces else str(workdir)
        start = time.monotonic()
        proc = subprocess.Popen(
            argv,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_env(home),
            start_new_session=True,
            preexec_fn=preexec,
            user=user,
            group=user,
            extra_groups=None if user is None else [],
            pass_fds=(nonce_r, result_w),
        )
    except BaseException:
        os.close(result_r)
        raise
    finally:
        # Only the sandbox holds these ends now: the result pipe reads to its end once the
        # sandbox is gone.
        os.close(nonce_r)
        os.close(result_w)
    try:
        return _watch(plan, proc, start, uid, limits, result_r, nonce)
    finally:
        os.close(result_r)


def _watch(
    plan: _Plan,
    proc: subprocess.Popen[bytes],
    start: float,
    uid: int | None,
    limits: SandboxLimits,
    result_r: int,
    nonce: bytes,
) -> SandboxResult:
    assert proc.stdout is not None and proc.stderr is not None
    out = _Capture(proc.stdout, limits.output_kb * 1024)
    err = _Capture(proc.stderr, limits.output_kb * 1024)
    timed_out = False
    try:
        proc.wait(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # also on KeyboardInterrupt: nothing outlives the call
        _kill_group(proc.pid)
        if uid is not None:
            _kill_uid(uid)
        proc.wait()
    duration = time.monotonic() - start
    returncode: int | None = None
    if not timed_out:
        status = proc.returncode
        returncode = _unwrap_shell_status(status) if plan.namespaces else status
    lock, completed = _read_channel(result_r, nonce)
    stdout, stderr = out.text(), err.text()
    passed = not timed_out and returncode == 0 and completed
    isolation = plan.isolation + (
        ", no new namespaces (seccomp)"
        if lock == "ok"
        else f", namespace creation not blocked ({lock})"
    )
    return SandboxResult(
        passed=passed,
        reason=_reason(passed, timed_out, returncode, completed, stderr, limits),
        returncode=returncode,
        stdout=stdout,
        stderr=stderr,
        timed_out=timed_out,
        duration_s=duration,
        network_isolated=plan.namespaces,
        isolation=isolation,
        namespaces_locked=lock == "ok",
    )


def _read_channel(fd: int, nonce: bytes) -> tuple[str, bool]:
    """The harness's lock report, and whether the rest of the result pipe is the nonce alone.
    Read without blocking: a process that escaped the kill may still hold the write end."""
    os.set_blocking(fd, False)
    data = bytearray()
    with contextlib.suppress(BlockingIOError):
        while len(data) <= _CHANNEL_MAX and (chunk := os.read(fd, 65536)):
            data += chunk
    head, newline, rest = bytes(data).partition(b"\n")
    if not newline or not head.startswith(b"lock "):
        return "the harness did not start", False
    lock = head[5:].decode("utf-8", errors="replace")
    return lock, secrets.compare_digest(rest, nonce)
