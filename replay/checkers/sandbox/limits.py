"""What a sandbox run is given (``SandboxLimits``), how it is isolated (the plan: a mode of
``sandbox.run``'s docstring, the interpreter, the isolation's description) and what it gives back
(``SandboxResult``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    wall_s: float = 10.0  # wall-clock timeout, the whole process tree is killed after it
    cpu_s: int = 5  # RLIMIT_CPU
    memory_mb: int = 512  # RLIMIT_AS
    file_size_mb: int = 1  # RLIMIT_FSIZE
    max_procs: int = 0  # extra processes (threads count) the code may create; 0 = no fork
    output_kb: int = 64  # stdout/stderr kept (truncated beyond)


@dataclass(frozen=True, slots=True)
class SandboxResult:
    passed: bool  # tests ran to completion with exit 0
    reason: str  # "tests passed", "AssertionError: ...", "timed out after 10 s", ...
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    network_isolated: bool  # True when the code ran in its own network namespace
    isolation: str  # what isolation was in force
    namespaces_locked: bool = False  # the code could create no namespace (seccomp filter)


Mode = Literal["root-ns", "user-ns", "root-uid", "plain"]


@dataclass(frozen=True, slots=True)
class _Plan:
    mode: Mode
    python: str
    isolation: str

    @property
    def namespaces(self) -> bool:
        return self.mode in ("root-ns", "user-ns")
