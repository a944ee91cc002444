"""The grading process (``grader.Grader`` starts it): one JSON request a line on stdin (a check
or a derived spec, and an answer), one JSON grade a line on stdout, each answer graded under
``grader.grade_safely``, its memory limited to ``WORKER_MEMORY_MB``, its parsed checkers kept
(specs repeat across the targets of a run)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
from collections.abc import Mapping
from typing import Any

from replay.checkers.base import DERIVED_TYPE, Answer, Checker, Grade, checker_error, parse_check
from replay.checkers.grader import READY, WORKER_MEMORY_MB, grade_safely, spec_key

CACHE_MAX = 4096  # parsed checkers the worker keeps


def serve() -> None:
    """The worker: one JSON request a line on stdin, one JSON grade a line on stdout."""
    _limit_memory()
    out = os.fdopen(os.dup(1), "wb")
    # Whatever a checker prints must not land in the replies.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    cache: dict[str, Checker | Mapping[str, Any]] = {}
    out.write(READY)
    out.flush()
    for line in sys.stdin.buffer:
        grade = _serve_one(line, cache)
        try:
            reply = json.dumps(grade.to_json(), default=str)
        except (TypeError, ValueError) as exc:
            reply = json.dumps(checker_error("exception", f"ungradeable detail: {exc}").to_json())
        out.write(reply.encode() + b"\n")
        out.flush()


def _serve_one(line: bytes, cache: dict[str, Checker | Mapping[str, Any]]) -> Grade:
    try:
        req = json.loads(line)
        spec = req["check"]
        answer = Answer(req["text"], tuple(_call(*c) for c in req["calls"]))
    except (ValueError, KeyError, TypeError) as exc:
        return checker_error("worker", f"bad request: {exc}")
    if isinstance(spec, dict) and spec.get("type") == DERIVED_TYPE:
        # Not cached: each holds a reference's answer and a prompt, and is used a few times.
        try:
            from replay.checkers.derived.checker import Derived

            return grade_safely(Derived.from_spec(spec), answer)
        except Exception as exc:  # the answer's grade, by this module's contract
            return checker_error("exception", f"{type(exc).__name__}: {exc}")
    key = spec_key(spec)
    check = cache.get(key)
    if check is None:
        if len(cache) >= CACHE_MAX:
            cache.clear()
        try:
            check = parse_check(spec)
        except Exception:
            check = spec  # grade_safely turns the parse error into the grade
        cache[key] = check
    return grade_safely(check, answer)


def _call(index: int, id_: str | None, name: str, arguments: str) -> Any:
    from replay.core.records import ToolCall

    return ToolCall(index=index, id=id_, name=name, arguments=arguments)


def _limit_memory() -> None:
    soft = WORKER_MEMORY_MB * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
