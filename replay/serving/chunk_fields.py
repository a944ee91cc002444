"""The fields of a streamed chunk, read strictly (``replay.core.strict``): counts, token ids and
text that are what they say or the server's ``ProtocolError``, and the two shapes a chunk's
choice may not take (``message`` where ``delta`` belongs; anything of an answer after the
finish reason)."""

from __future__ import annotations

from typing import Any

from replay.core.strict import integer, shown, token_ids
from replay.serving.sse import ProtocolError


def carries_answer(choices: Any) -> bool:
    """Whether choices that came after the finish reason carried anything of an answer."""
    for choice in choices or ():
        if not isinstance(choice, dict):
            return True
        delta = choice.get("delta") or choice.get("message") or {}
        if choice.get("text") or choice.get("token_ids"):
            return True
        if not isinstance(delta, dict) or any(v for k, v in delta.items() if k != "role"):
            return True
    return False


def refuse_message(message: Any) -> None:
    """A streamed choice with ``message`` where its ``delta`` belongs: refused when it holds
    any of an answer. A stream of them may send pieces or the whole answer so far; read as
    deltas, the second kind repeats the answer, and left unread, an answer is silently empty."""
    if not isinstance(message, dict) or any(
        message.get(k) for k in ("content", "tool_calls", "reasoning_content", "reasoning")
    ):
        raise ProtocolError(
            "a streamed choice carried 'message', a whole answer's shape, where a chunk's "
            "'delta' belongs: not read as the answer (pieces or the whole so far cannot be "
            f"told apart; did the server ignore stream=true?): {shown(message)}"
        )


def usage_count(value: object, name: str) -> int:
    n = integer(value)
    if n is None:
        raise ProtocolError(f"impossible usage: {name} is not a count: {shown(value)}")
    return n


def token_id_list(value: object, name: str) -> list[int]:
    ids = token_ids(value)
    if ids is None:
        raise ProtocolError(f"{name} is not a list of token ids: {shown(value)}")
    return ids


def text_field(value: object, name: str) -> str:
    """A text field of a chunk: a string, or nothing (null or absent)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ProtocolError(f"{name} is not a string: {shown(value)}")
    return value
