"""What a run promises on a hostile answer (docs/run-directory.md): a server's answer of the
wrong shape or type is that request's protocol error, never a crash and never stored as it
came; a model's code cannot forge its own pass; and nothing in an answer acts on whoever reads
the report.

Each test is one promise, named after it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from replay.checkers import Answer, parse_check
from replay.checkers.derived.code_run import run_code_plan
from replay.checkers.sandbox.run import run_python
from replay.serving.sse import ProtocolError
from tests.hostile.test_hostile_client import content, fold, tool
from tests.hostile.test_hostile_server import Canned, fake_server
from tests.support.promise_run import answering, chat_trace, replay_cli

# -- code: the tests run with the builtins they were written against -------------------------

# (a wrong function, the builtin its author redefined so that the tests pass, the tests)
FORGERIES = {
    "range": (
        "def total(xs):\n    return 0\n\ndef range(*args):\n    return []\n",
        "def test_total():\n    for n in range(1, 4):\n"
        "        assert total(list(range(n))) == sum(range(n))\n",
    ),
    "sorted": (
        "def my_sort(xs):\n    return xs\n\ndef sorted(xs):\n    return xs\n",
        "def test_sort():\n    assert my_sort([3, 1, 2]) == sorted([3, 1, 2])\n",
    ),
    "len": (
        "def words(s):\n    return []\n\ndef len(x):\n    return 3\n",
        "def test_words():\n    assert len(words('a b c')) == 3\n",
    ),
    "all": (
        "def evens(n):\n    return [1, 3]\n\ndef all(xs):\n    return True\n",
        "def test_evens():\n    assert all([x % 2 == 0 for x in evens(4)])\n",
    ),
    "min": (
        "def smallest(xs):\n    return xs[0]\n\ndef min(xs):\n    return xs[0]\n",
        "def test_smallest():\n    assert smallest([3, 1, 2]) == min([3, 1, 2])\n",
    ),
}


@pytest.mark.parametrize("builtin", sorted(FORGERIES))
def test_hostile_answer_code_cannot_pass_by_redefining_a_builtin(builtin: str) -> None:
    code, tests = FORGERIES[builtin]
    check = parse_check({"type": "code", "tests": tests})
    grade = check.grade(Answer(f"```python\n{code}```"))
    assert not grade.passed, grade.reason
    # the same tests pass a right function: the builtins are the ones they were written against
    right = {
        "range": "def total(xs):\n    return sum(xs)\n",
        "sorted": "def my_sort(xs):\n    return sorted(xs)\n",
        "len": "def words(s):\n    return s.split()\n",
        "all": "def evens(n):\n    return [x for x in range(n) if x % 2 == 0]\n",
        "min": "def smallest(xs):\n    return min(xs)\n",
    }[builtin]
    assert check.grade(Answer(f"```python\n{right}```")).passed


def test_hostile_answer_derived_code_is_compared_with_the_real_builtins() -> None:
    """The comparison of a derived code grade runs in the answer's sandbox: an answer that
    redefines ``zip`` (or ``enumerate``) must not turn "differs" into "the same"."""
    plan: dict[str, Any] = {
        "calls": [["square", "square(3)"], ["square", "square(4)"]],
        "reference_code": "def square(n):\n    return n * n\n",
        "candidate_code": "def square(n):\n    return n + n\n\n"
        "def zip(*args, **kw):\n    return []\n\ndef enumerate(*args, **kw):\n    return []\n",
        "sources": {"prompt": 2},
    }
    grade = run_code_plan(plan)
    assert not grade.passed and "differ" in grade.reason, grade.reason


def test_hostile_answer_a_function_named_like_a_builtin_is_still_reachable() -> None:
    res = run_python(
        "def max(xs):\n    return 'mine'\n",
        "import solution\nfrom solution import max as theirs\n"
        "def test_max():\n    assert max([1, 2]) == 2\n"
        "    assert solution.max([1, 2]) == theirs([1]) == 'mine'\n",
    )
    assert res.passed, res.reason


# -- a server's answer: one strictness rule --------------------------------------------------


@pytest.mark.parametrize(
    ("events", "words"),
    [
        (
            [{**content("a"), "usage": {"prompt_tokens": 2, "completion_tokens": True}}],
            "not a count: true",
        ),
        (
            [{**content("a"), "usage": {"prompt_tokens": 2, "completion_tokens": "1"}}],
            "not a count: '1'",
        ),
        (
            [{**content("a"), "usage": {"prompt_tokens": 2, "completion_tokens": 1.5}}],
            "not a count: 1.5",
        ),
        (
            [{**content("a"), "usage": {"prompt_tokens": True, "completion_tokens": 1}}],
            "prompt_tokens",
        ),
        ([{**content("a", 1), "usage": "lots"}], "usage is not an object"),
        ([content("a", 1, ids=["5"])], "token_ids is not a list of token ids"),
        ([content("a", 1, ids=[True])], "token_ids is not a list of token ids"),
        ([content("a", 1, ids=[-3])], "token_ids is not a list of token ids"),
        ([{**content("a", 1), "prompt_token_ids": ["1", "2"]}], "prompt_token_ids"),
        (
            [{"choices": [{"index": 0, "delta": {"content": 5}}]}],
            "delta.content 5 is neither a string nor a list of parts",
        ),
        ([tool(0, name=7)], "tool call name is not a string"),  # type: ignore[arg-type]
    ],
)
def test_hostile_answer_a_value_of_the_wrong_type_is_the_servers_protocol_error(
    events: list[dict[str, Any]], words: str
) -> None:
    with pytest.raises(ProtocolError, match=words.replace("(", r"\(")):
        fold(events)


def test_hostile_answer_an_integral_count_is_a_count() -> None:
    r = fold([content("a", 1, ids=[5]), {**content("b"), "usage": {"completion_tokens": 2.0}}])
    assert r.output_tokens == 2 and r.output_ids == [5]


# -- the report: nothing in an answer acts on its reader -------------------------------------

ACTING = ["\x00", "\x07", "\x1b", "\u202e", "\u2066", "\u2028", "\x85", "\x7f", "\u200b"]
ANSWER = "bell\x07 nul\x00 esc\x1b[2J rlo\u202edesrever isolate\u2066x del\x7f nel\x85 zw\u200bsp"


def test_hostile_answer_control_and_bidi_characters_never_reach_a_report_raw(
    tmp_path: Path,
) -> None:
    trace = chat_trace(tmp_path / "t.jsonl", 4, {"type": "contains", "values": ["\u202e"]})
    with answering(ANSWER) as server:
        done = replay_cli(
            "--trace", str(trace), "--targets", f"fake={server.url}", "--concurrency", "2",
            "--out", str(tmp_path / "runs"), "--run-id", "r", "--no-teacher-forced",
        )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    run = tmp_path / "runs" / "r"
    html = (run / "report.html").read_text(encoding="utf-8")
    md = (run / "report.md").read_text(encoding="utf-8")
    for ch in ACTING:
        assert ch not in html and ch not in md, ascii(ch)
        assert ch not in done.stdout + done.stderr, ascii(ch)
    # what they were is shown, escaped, where the answer is
    assert r"esc\x1b[2J rlo\u202edesrever" in html and r"nul\x00" in html


def test_hostile_answer_a_wrong_usage_type_is_recorded_on_its_request(tmp_path: Path) -> None:
    """End to end: a server whose usage says ``true`` fails its requests (protocol), and the
    run goes on to account for every one of them."""
    body = (
        b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}, "token_ids": [5]}], '
        b'"usage": {"prompt_tokens": 3, "completion_tokens": true}}\n\ndata: [DONE]\n\n'
    )
    trace = chat_trace(tmp_path / "t.jsonl", 3)
    canned = {"/v1/chat/completions": Canned(body, content_type="text/event-stream")}
    with fake_server(canned) as server:
        done = replay_cli(
            "--trace", str(trace), "--targets", f"fake={server.url}", "--out",
            str(tmp_path / "runs"), "--run-id", "r", "--no-teacher-forced",
        )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    rows = [json.loads(line) for line in (tmp_path / "runs" / "r" / "results.jsonl").open()]
    assert len(rows) == 3
    assert {(r["status"], r["error_kind"]) for r in rows} == {("error", "protocol")}
    assert all("completion_tokens is not a count: true" in r["error"] for r in rows)
