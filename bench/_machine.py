"""The machine a benchmark ran on: its CPU model, and its machine-wide CPU use, to tell a quiet
measurement from one other work disturbed."""

from __future__ import annotations

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
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says of the processor."""
    return next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
