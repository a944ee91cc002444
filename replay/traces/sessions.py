"""Multi-turn sessions: the turns of one conversation, sent in order.

A trace record with a ``session`` is one turn of it (Bailian's parent chain, an OpenAI log's
conversation, or a v1 trace's own ``session``). A schedule sends *units*: a request without a
session alone, or a whole session, whose turns go one after another, each once the previous one
has finished and the think time has passed. The think time is the trace's gap between the two
turns' arrivals (``t``, scaled like the trace's own clock), or a fixed ``--think-time``.

Turns of a session may be anywhere in the file, so a trace with sessions is grouped in memory
(the requests of its sessions, not their results); a trace without sessions streams as before.
Within a session, turns are ordered by ``meta.turn`` where the importer gives it, else by
``t``, else by their order in the file.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from replay.core.errors import InputError
from replay.traces.trace import Request

Turn = tuple[int, Request]  # (position in the trace, the request)
Unit = list[Turn]  # what a schedule sends as one item: one request, or a session's turns


def has_sessions(requests: Iterable[Request]) -> bool:
    return any(r.session for r in requests)


def _order(turn: Turn) -> tuple[float, float, int]:
    i, req = turn
    number = req.meta.get("turn")
    by_turn = (
        float(number) if isinstance(number, int | float) and not isinstance(number, bool) else 0
    )
    return (by_turn, req.t if req.t is not None else 0.0, i)


def units(turns: Iterable[Turn]) -> Iterator[Unit]:
    """The trace's units in the order of their first turn: requests without a session one by
    one, each session's turns together and in order."""
    sessions: dict[str, Unit] = {}
    order: list[tuple[int, str | None, Turn | None]] = []
    for i, req in turns:
        if not req.session:
            order.append((i, None, (i, req)))
            continue
        if req.session not in sessions:
            sessions[req.session] = []
            order.append((i, req.session, None))
        sessions[req.session].append((i, req))
    for _, key, single in order:
        if key is None:
            assert single is not None
            yield [single]
        else:
            yield sorted(sessions.pop(key), key=_order)


@dataclass(frozen=True)
class ThinkTime:
    """How long the next turn waits after the previous one finished: the trace's gap between
    their arrivals times ``scale`` (``fixed`` None), or ``fixed`` seconds."""

    fixed: float | None = None
    scale: float = 1.0

    def between(self, previous: Request, following: Request) -> float:
        if self.fixed is not None:
            return self.fixed
        if previous.t is None or following.t is None:
            return 0.0
        return max(0.0, following.t - previous.t) * self.scale

    def describe(self) -> str:
        if self.fixed is not None:
            return f"{self.fixed:g} s"
        return f"the trace's gaps x{self.scale:g}"


def think_time(text: str, time_scale: float) -> ThinkTime:
    """``--think-time``: 'auto' (the trace's gaps between turns, scaled by --time-scale) or
    a fixed number of seconds."""
    if text.strip() == "auto":
        return ThinkTime(None, time_scale)
    try:
        seconds = float(text)
    except ValueError:
        raise InputError(f"--think-time: '{text}' is not 'auto' or a number of seconds") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise InputError(f"--think-time: '{text}' must be zero or more seconds")
    return ThinkTime(seconds, time_scale)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens two sequences share from the start: what a prefix cache can serve the second."""
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k
