"""Sessions as a schedule sends them: units in the order of their first turn, turns in order,
think times from the trace's gaps or fixed, and the history a later turn carries."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.core.errors import InputError
from replay.core.records import Result
from replay.run.session_history import ReferenceHistory, check_mode, new_messages
from replay.run.session_turns import Sessions, SessionTurns
from replay.traces.sessions import ThinkTime, common_prefix, has_sessions, units
from replay.traces.trace import Request


def chat(rid: str, session: str | None, t: float, text: str, **meta: object) -> Request:
    return Request(
        id=rid,
        t=t,
        session=session,
        messages=({"role": "user", "content": text},),
        meta=dict(meta),
    )


def test_units_keep_sessions_together_in_the_order_of_their_first_turn() -> None:
    reqs = [
        chat("a2", "a", 2.0, "x", turn=2),
        chat("solo", None, 0.5, "x"),
        chat("b1", "b", 1.0, "x"),
        chat("a1", "a", 0.0, "x", turn=1),
        chat("b2", "b", 3.0, "x"),
    ]
    got = [[r.id for _, r in u] for u in units(enumerate(reqs))]
    # a's first line comes first in the file; its turns are ordered by meta.turn, b's by t.
    assert got == [["a1", "a2"], ["solo"], ["b1", "b2"]]
    assert has_sessions(reqs) and not has_sessions([reqs[1]])


def test_think_time_is_the_traces_gap_scaled_or_fixed() -> None:
    a, b = chat("1", "s", 1.0, "x"), chat("2", "s", 4.0, "y")
    assert ThinkTime(None, 0.5).between(a, b) == pytest.approx(1.5)
    assert ThinkTime(None, 1.0).between(b, a) == 0.0  # never negative
    assert ThinkTime(0.2).between(a, b) == 0.2
    assert ThinkTime(0.2).describe() == "0.2 s"


def test_common_prefix_counts_shared_leading_tokens() -> None:
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix([], [1]) == 0


def test_reference_history_builds_later_turns_from_the_references_answers(tmp_path: Path) -> None:
    history = ReferenceHistory(tmp_path, "bf16")
    sessions = Sessions(ThinkTime(), history, is_reference=True)
    first, second = chat("1", "s", 0.0, "Hi"), chat("2", "s", 1.0, "And then?")
    ref = SessionTurns(sessions, "c1")
    assert ref.request(0, first) is first
    ref.answered(0, first, Result("1", "bf16", "c1", "<8K", 0.0, output_text="Hello."))
    sent = ref.request(1, second)
    assert sent is not None and [m["content"] for m in sent.messages or ()] == [
        "Hi",
        "Hello.",
        "And then?",
    ]
    history.close()
    # Another target (a later process, even) reads the same answers: the same history.
    other = SessionTurns(Sessions(ThinkTime(), ReferenceHistory(tmp_path, "bf16")), "c1")
    other.request(0, first)
    again = other.request(1, second)
    assert again is not None and again.messages == sent.messages
    # Without the reference's answer a later turn cannot be built, and says why.
    missing = SessionTurns(Sessions(ThinkTime(), ReferenceHistory(tmp_path, "bf16")), "c4")
    missing.request(0, first)
    assert missing.request(1, second) is None and "no answer to turn 1" in (missing.why_not or "")


def test_a_failed_reference_turn_stops_its_later_turns(tmp_path: Path) -> None:
    turns = SessionTurns(Sessions(ThinkTime(), ReferenceHistory(tmp_path, "r"), True), "c1")
    first = chat("1", "s", 0.0, "Hi")
    turns.request(0, first)
    turns.answered(0, first, Result("1", "r", "c1", "<8K", 0.0, status="error"))
    assert turns.request(1, chat("2", "s", 1.0, "x")) is None
    assert turns.why_not == "the reference failed turn 1"


def test_new_messages_are_those_after_the_last_answer() -> None:
    req = Request(
        id="x",
        messages=(
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ),
    )
    assert new_messages(req) == [{"role": "user", "content": "c"}]


def test_reference_history_refuses_parallel_targets() -> None:
    with pytest.raises(InputError, match="drop --parallel-targets"):
        check_mode("reference", parallel_targets=True)
    assert check_mode("trace", parallel_targets=True) == "trace"
