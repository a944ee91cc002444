"""Machine-wide CPU use, to tell a quiet measurement from one other work disturbed."""

from __future__ import annotations

import os


def machine_busy_s() -> float:
    """CPU seconds all processes on the machine have used so far (``/proc/stat``, jiffies)."""
    with open("/proc/stat", "rb") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = f[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
