"""Exceptions kvcanary raises. Failures of the system under test are *not* here: they are
data (``Result.status == "error"``), recorded and reported.

    KvcanaryError                 base; every message says what to do
    ├── InputError                the user's input is wrong (their fault)
    │   ├── TraceError            a trace line: file, line, field, reason
    │   ├── ConfigError           targets / scenario configuration
    │   ├── SummaryError          a summary.json field of a type this version does not read
    │   └── MissingExtra          a command needs an optional dependency not installed
    ├── TargetError               a target cannot be used for this run
    │   ├── ServerStartError      a local server did not come up (log tail attached)
    │   ├── ServingMismatch       the server runs something other than its spec says
    │   └── EndpointError         an endpoint unreachable or answering what cannot be used
    └── RunDirError               the run directory cannot be written mid-run (a full disk)

Every subclass of ``KvcanaryError`` is defined here (a test holds this tree to them).
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


class SummaryError(InputError):
    """A document (summary.json, or a summary handed to the analysis) whose value at the named
    field is not of the type this version reads: the file's fault, or its editor's."""


class MissingExtra(InputError):
    """A command needs an optional dependency that is not installed."""


class TargetError(KvcanaryError):
    """A target cannot be used (the serving side's fault, reported as a target failure)."""


class ServerStartError(TargetError):
    """A local server exited or never became healthy; ``reason`` is the log's own words."""

    def __init__(self, target: str, reason: str, log_path: str) -> None:
        self.target, self.reason, self.log_path = target, reason, log_path
        super().__init__(f"target '{target}': server did not start: {reason} (log: {log_path})")


class ServingMismatch(TargetError):
    """The server serves something other than what its spec asks for (e.g. cache dtype)."""


class EndpointError(TargetError):
    """An endpoint of the target could not be reached or answered something kvcanary cannot
    use (the serving side's fault). The message names the method, the path and what came
    back; ``unreachable`` says the connection itself failed."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class RunDirError(KvcanaryError):
    """A file of the run directory could not be written once the run had started (a full disk,
    a quota, a folder made read-only): the machine's fault, not the input's. What was written
    before stays whole; ``run_dir`` names the run to finish with ``--resume`` once it can be
    written again (None: not known where this was raised)."""

    def __init__(self, path: str, reason: str, run_dir: str | None = None) -> None:
        self.path, self.reason, self.run_dir = path, reason, run_dir
        then = (
            f"; the run stopped, and every result written before it is kept: make room (or "
            f"make the folder writable again), then finish the run with `replay --resume "
            f"{run_dir}`"
            if run_dir is not None
            else ""
        )
        super().__init__(f"cannot write {path}: {reason}{then}")

    def in_run(self, run_dir: str) -> RunDirError:
        """The same failure, saying which run to resume."""
        return self if self.run_dir is not None else RunDirError(self.path, self.reason, run_dir)
