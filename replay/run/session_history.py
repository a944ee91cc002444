"""The history every target sees in a multi-turn session.

``trace`` (the default): each turn is sent as the trace has it; a trace whose turns carry the
conversation so far (the logged answers) gives every target the same history by itself, as
length-only sessions do with their shared hash-id prefix. ``reference``: each later turn is the
conversation as the reference target had it (earlier turns, the reference's answers, then the
turn's own new messages, those after its last assistant message); the reference runs first and
writes its answers to ``session_history.jsonl``, which the other targets (and a resume) read.
The manifest records which it was."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replay.core.errors import InputError, RunDirError
from replay.core.records import Result
from replay.rundir.files import JsonlWriter, read_jsonl
from replay.traces.trace import Request

SESSION_HISTORY = "session_history.jsonl"
MODES = ("trace", "reference")


def check_mode(mode: str, parallel_targets: bool) -> str:
    if mode not in MODES:
        raise InputError(f"--session-history: '{mode}' is not one of {', '.join(MODES)}")
    if mode == "reference" and parallel_targets:
        raise InputError(
            "--session-history reference needs the reference's answers before the other "
            "targets send their later turns: drop --parallel-targets"
        )
    return mode


def new_messages(req: Request) -> list[dict[str, Any]]:
    """A turn's own messages: those after its last assistant message."""
    msgs = list(req.messages or ())
    last = max((k for k, m in enumerate(msgs) if m.get("role") == "assistant"), default=-1)
    return msgs[last + 1 :]


def answer_message(content: str, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


@dataclass
class ReferenceHistory:
    """The reference's answers by (phase, session, turn position), written as they come."""

    run_dir: Path
    reference: str
    answers: dict[tuple[str, str, int], dict[str, Any]] = field(default_factory=dict)
    on_failure: Callable[[RunDirError], None] | None = None  # the file cannot be written

    def __post_init__(self) -> None:
        path = self.run_dir / SESSION_HISTORY
        for row in read_jsonl(path) if path.exists() else ():
            self.answers[(row["phase"], row["session"], row["turn"])] = row["message"]
        self._writer = JsonlWriter(path, self.on_failure)

    def record(self, phase: str, session: str, turn: int, res: Result) -> None:
        calls = [
            {
                "id": f"call_{k}",
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for k, c in enumerate(res.tool_calls)
        ]
        message = answer_message(res.output_text, calls)
        self.answers[(phase, session, turn)] = message
        self._writer.write({"phase": phase, "session": session, "turn": turn, "message": message})

    def answer(self, phase: str, session: str, turn: int) -> dict[str, Any] | None:
        return self.answers.get((phase, session, turn))

    def close(self) -> None:
        self._writer.close()
