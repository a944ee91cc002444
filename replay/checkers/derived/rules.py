"""The derived rules by name, the grade detail that names its rule, and a derived grade as the
record ``grades.jsonl`` holds (see ``derived.checker`` for what each rule grades)."""

from __future__ import annotations

from typing import Any

from replay.checkers.base import Grade

TOOL_ARGS, JSON_VALUE, CODE, CODE_TEXT, FACTS = (
    "derived:tool_args",
    "derived:json",
    "derived:code",
    "derived:code_text",
    "derived:facts",
)
DERIVED_RULES = (TOOL_ARGS, JSON_VALUE, CODE, CODE_TEXT, FACTS)
UNKNOWN_RULE = "derived"  # a grade that failed before its rule was known (checker error)


def _detail(rule: str, **more: Any) -> dict[str, Any]:
    return {"rule": rule, **more}


def derived_record(grade: Grade, exact: bool | None = None) -> dict[str, Any]:
    """A derived grade as it is written in ``grades.jsonl``: rule, passed (null when
    ungraded), reason, the normalized exact match beside it, and the rule's detail."""
    detail = dict(grade.detail)
    rule = str(detail.pop("rule", UNKNOWN_RULE))
    ungraded = bool(detail.pop("ungraded", False))
    return {
        "rule": rule,
        "passed": None if ungraded else grade.passed,
        "reason": _clean(grade.reason),
        "exact": exact,
        "detail": _clean(detail),
    }


def _clean(value: Any) -> Any:
    """Strings that any JSON writer accepts: facts are copied from answers, which may hold
    lone surrogates a decoder let through (the details are two levels deep at most)."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {_clean(k): _clean(v) for k, v in value.items()}
    return value
