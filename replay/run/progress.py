"""How a run reports progress: the runner calls this protocol, so the terminal UI (rich) lives in
the CLI, and tests and library callers run quietly."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def status(self, message: str) -> None: ...

    def phase(self, target: str, label: str, total: int) -> None: ...

    def advance(self, target: str, label: str, ok: bool) -> None: ...


class QuietProgress:
    def status(self, message: str) -> None:
        pass

    def phase(self, target: str, label: str, total: int) -> None:
        pass

    def advance(self, target: str, label: str, ok: bool) -> None:
        pass
