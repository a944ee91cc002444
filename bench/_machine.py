"""The machine: its CPU use (to tell a quiet measurement from one other work disturbed) and
what a results file records of it."""

from __future__ import annotations

import datetime as dt
import os
import platform
from pathlib import Path


def machine_busy_s() -> float:
    """CPU seconds all processes on the machine have used so far (``/proc/stat``, jiffies)."""
    with open("/proc/stat", "rb") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = f[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    return next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )


def describe(packages: tuple[str, ...]) -> dict[str, object]:
    """What a results file records of the machine: date (UTC), CPU model, CPU count, platform,
    Python and the versions of ``packages``."""
    from importlib.metadata import version

    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {p: version(p) for p in packages},
    }
