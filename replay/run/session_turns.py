"""One session as a phase sends it: its turns in order, the history each is sent with
(replay/run/session_history.py), and what each turn could reuse of the previous one's tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from replay.core.records import Result
from replay.run.session_history import ReferenceHistory, new_messages
from replay.traces.sessions import ThinkTime
from replay.traces.trace import Request


@dataclass(frozen=True)
class Sessions:
    """How a phase sends sessions: the think time, and the reference's answers when every
    target is to see the reference's history (``is_reference``: this target writes them)."""

    think: ThinkTime
    history: ReferenceHistory | None = None
    is_reference: bool = False


@dataclass(frozen=True)
class TurnContext:
    session: str | None
    number: int  # 1-based
    previous_ids: list[int] | None  # the previous turn's prompt and answer token ids


@dataclass
class SessionTurns:
    sessions: Sessions
    phase: str
    conversation: list[dict[str, Any]] = field(default_factory=list)
    previous_ids: list[int] | None = None
    session: str | None = None
    why_not: str | None = None  # set when a later turn cannot be built

    def request(self, k: int, req: Request) -> Request | None:
        """Turn ``k`` (0-based) as it is sent; None when its history is missing."""
        self.session = req.session
        history = self.sessions.history
        if history is None:
            return req
        if k == 0:
            self.conversation = list(req.messages or ())
            return req
        if self.why_not is not None:
            return None
        assert req.session is not None
        answer = history.answer(self.phase, req.session, k - 1)
        if answer is None:
            self.why_not = f"the reference {history.reference} has no answer to turn {k}"
            return None
        self.conversation += [answer, *new_messages(req)]
        return req.model_copy(update={"messages": tuple(self.conversation)})

    def context(self, k: int) -> TurnContext:
        return TurnContext(self.session, k + 1, self.previous_ids)

    def answered(self, k: int, req: Request, res: Result) -> None:
        self.previous_ids = [*res.prompt_ids, *res.output_ids] if res.prompt_ids else None
        history = self.sessions.history
        if history is None or not self.sessions.is_reference or req.session is None:
            return
        if res.status == "ok":
            history.record(self.phase, req.session, k, res)
        else:
            # Later turns cannot carry an answer the reference never gave.
            self.why_not = f"the reference failed turn {k + 1}"
