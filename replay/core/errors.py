"""Exceptions kvcanary raises. Failures of the system under test are *not* here: they are
data (``Result.status == "error"``), recorded and reported.

    KvcanaryError                 base; every message says what to do
    ├── InputError                the user's input is wrong (their fault)
    │   ├── TraceError            a trace line: file, line, field, reason
    │   └── ConfigError           targets / scenario configuration
    └── TargetError               a target cannot be used for this run
        ├── ServerStartError      a local server did not come up (log tail attached)
        └── ServingMismatch       the server runs something other than its spec says
"""

from __future__ import annotations


class KvcanaryError(Exception):
    """Base class."""


class InputError(KvcanaryError):
    """The user's input is wrong; the message names where and how to fix it."""


class TraceError(InputError):
    """A trace line failed validation (the trace author's fault)."""

    def __init__(self, path: str, line: int, field: str, reason: str) -> None:
        self.path, self.line, self.field, self.reason = path, line, field, reason
        super().__init__(f"{path}:{line}: field '{field}': {reason}")

    def as_dict(self) -> dict[str, object]:
        return {"path": self.path, "line": self.line, "field": self.field, "reason": self.reason}


class ConfigError(InputError):
    """A target or scenario configuration is wrong (the configuration author's fault)."""


class TargetError(KvcanaryError):
    """A target cannot be used (the serving side's fault, reported as a target failure)."""


class ServerStartError(TargetError):
    """A local server exited or never became healthy; ``reason`` is the log's own words."""

    def __init__(self, target: str, reason: str, log_path: str) -> None:
        self.target, self.reason, self.log_path = target, reason, log_path
        super().__init__(f"target '{target}': server did not start: {reason} (log: {log_path})")


class ServingMismatch(TargetError):
    """The server serves something other than what its spec asks for (e.g. cache dtype)."""
