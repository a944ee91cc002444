"""What ``open_loop.py`` and ``workers.py`` share: a trace of short requests, a run of the real
``replay`` CLI against the fast fake server (its own process, pinned where asked, its CPU
from ``wait4``), the server's CPU over the run, and the machine around them.

The CLI is run exactly as a user runs it (``python -m replay --trace ... --targets ...``);
the figures come from what its run directory records (``results.jsonl``: ``scheduled``,
``sent``, ``done``, ``output_tokens`` per request, seconds on the run's monotonic clock).
"""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import orjson
from _machine import describe, machine_busy_s
from client_overhead import FastServer

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RUN_TIMEOUT_S = 900.0


def write_trace(path: Path, n: int, max_tokens: int) -> Path:
    """``n`` completions requests of ``max_tokens`` each (ids ``r0000000``...). The prompt is
    four token ids, so the replay knows its length without calling /tokenize per request."""
    with path.open("wb") as fh:
        for i in range(n):
            rec = {"id": f"r{i:07d}", "api": "completions", "prompt": [1, 2, 3, 4]}
            fh.write(orjson.dumps({**rec, "max_tokens": max_tokens}) + b"\n")
    return path


@dataclass
class ReplayRun:
    """One ``replay`` process: its CPU (itself and the load processes it waited for), wall
    time, exit code, the end of its output, and the server's and the machine's CPU meanwhile."""

    run_dir: Path
    exit_code: int
    wall_s: float
    cpu_s: float
    server_cpu_s: float
    machine_cpu_s: float
    output_tail: str

    def results(self) -> Iterator[dict[str, Any]]:
        with (self.run_dir / "results.jsonl").open("rb") as fh:
            for line in fh:
                yield orjson.loads(line)

    def figures(self) -> dict[str, Any]:
        return {
            "exit_code": self.exit_code,
            "wall_s": round(self.wall_s, 2),
            "replay_cpu_s": round(self.cpu_s, 2),
            "server_cpu_s": round(self.server_cpu_s, 2),
            "machine_cpu_s": round(self.machine_cpu_s, 2),
            "other_cpu_s": round(self.machine_cpu_s - self.cpu_s - self.server_cpu_s, 2),
        }


def _pin(cpus: set[int] | None) -> Any:
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def run_replay(
    server: FastServer,
    args: list[str],
    run_dir: Path,
    cpus: set[int] | None,
    tty: bool = False,
) -> ReplayRun:
    """``python -m replay ARGS --targets bench=URL --out ... --run-id ...``, pinned to ``cpus``;
    with ``tty``, its output goes to a pseudo-terminal (as in a user's shell: the progress bars
    are drawn), else to a file."""
    cmd = [sys.executable, "-m", "replay", *args, "--targets", f"bench={server.url}"]
    cmd += ["--no-teacher-forced", "--no-control", "--out", str(run_dir.parent)]
    cmd += ["--run-id", run_dir.name]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "160", "LINES": "40"}
    server_cpu0, busy0, t0 = server.stamps("none:")[1], machine_busy_s(), time.monotonic()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    with log.open("wb") as out:
        if tty:
            env.setdefault("TERM", "xterm-256color")
            status, cpu = _run_in_terminal(cmd, env, cpus, out)
        else:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, preexec_fn=_pin(cpus)
            )
            status, cpu = _wait(proc)
    wall, busy = time.monotonic() - t0, machine_busy_s() - busy0
    return ReplayRun(
        run_dir=run_dir,
        exit_code=os.waitstatus_to_exitcode(status),
        wall_s=wall,
        cpu_s=cpu,
        server_cpu_s=server.stamps("none:")[1] - server_cpu0,
        machine_cpu_s=busy,
        output_tail=log.read_text(errors="replace")[-1500:],
    )


def _run_in_terminal(
    cmd: list[str], env: dict[str, str], cpus: set[int] | None, out: IO[bytes]
) -> tuple[int, float]:
    """Run ``cmd`` with a pseudo-terminal (160 x 40) as its stdout and stderr; a thread copies
    what it draws into ``out`` (a terminal nobody reads would block it)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))

    def copy() -> None:
        while True:
            try:
                data = os.read(leader, 1 << 16)
            except OSError:  # EIO: every writer has closed its end
                return
            if not data:
                return
            out.write(data)

    reader = threading.Thread(target=copy, daemon=True)
    reader.start()
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=follower,
            stderr=follower,
            env=env,
            cwd=ROOT,
            preexec_fn=_pin(cpus),
        )
        os.close(follower)
        result = _wait(proc)
        reader.join(10)
        return result
    finally:
        os.close(leader)


def _wait(proc: subprocess.Popen[bytes]) -> tuple[int, float]:
    """``wait4`` on the replay: its exit status and CPU seconds, the load processes it
    waited for included; killed after ``RUN_TIMEOUT_S``."""
    status, ru = wait_rusage(proc, RUN_TIMEOUT_S)
    return status, ru.ru_utime + ru.ru_stime


# On Linux a process's ru_maxrss starts at the high-water mark of the process it was forked
# from (exec keeps the old memory map's peak), so a command forked from a bench script (tens of
# MiB; hundreds once it holds a tokenizer) would never measure below the script's size. A bare
# launcher (~10 MiB) posix_spawns the command and writes ``wait4``'s figures for it to a file:
# ``[sys.executable, "-c", SPAWN, REPORT, *cmd]``, read back with ``spawned_usage(REPORT)``.
SPAWN = """import os, sys
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
_, status, ru = os.wait4(pid, 0)
with open(sys.argv[1], "w") as fh:
    fh.write(f"{ru.ru_maxrss} {ru.ru_utime + ru.ru_stime} {os.waitstatus_to_exitcode(status)}")
"""


def spawned_usage(report: Path) -> tuple[float, float, int]:
    """What the ``SPAWN`` launcher wrote: the command's own peak RSS in KiB, CPU seconds (its
    waited children included) and exit code."""
    peak, cpu, code = report.read_text().split()
    return float(peak), float(cpu), int(code)


def wait_rusage(proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[int, Any]:
    """``wait4`` on ``proc``: its exit status and resource usage (CPU, peak RSS in KiB), the
    processes it waited for included; killed after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return status, ru
        if time.monotonic() > deadline:
            proc.kill()
        time.sleep(0.05)


def percentiles_ms(values: list[float]) -> dict[str, float]:
    a = np.asarray(values) * 1e3
    if a.size == 0:
        return {}
    p = np.percentile(a, [1, 50, 90, 99, 99.9])
    return {
        "n": int(a.size),
        "min": round(float(a.min()), 3),
        "p1": round(float(p[0]), 3),
        "p50": round(float(p[1]), 3),
        "p90": round(float(p[2]), 3),
        "p99": round(float(p[3]), 3),
        "p99_9": round(float(p[4]), 3),
        "max": round(float(a.max()), 3),
        "mean": round(float(a.mean()), 3),
    }


def machine_info() -> dict[str, Any]:
    head = subprocess.run(
        ["git", "-C", str(ROOT), "log", "-1", "--format=%h"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    ).stdout.strip()
    return {
        **describe(("aiohttp", "orjson", "uvloop")),
        "load_average_at_start": list(os.getloadavg()),
        "commit": head or None,
    }


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
