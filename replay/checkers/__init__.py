"""Task checkers, from a registry keyed by the spec's ``type``.

    check = parse_check({"type": "retrieval", "passage_ids": ["P3"], "fact": "4821"})
    grade = check.grade(Answer(text, tool_calls))   # Grade(passed, reason, score, detail)

Kinds: retrieval, tool_call, code, json_schema, regex, exact, number, contains.

Answers nobody has read go through a ``Grader`` (time and size bounds, a checker's exception
as the answer's failed grade; see ``grader``):

    with Grader() as grader:
        grade = grader.grade(spec, Answer(text, tool_calls))

A request without a spec is graded against the reference's answer to it (``derived.checker``; rules
derived:tool_args, derived:json, derived:code, derived:code_text, derived:facts):

    grade = grader.grade_derived(reference_answer, answer, prompt_text)
    row = derived_record(grade, exact)   # {"rule", "passed", "reason", "exact", "detail"}
"""

from replay.checkers.base import (
    MAX_ANSWER_CHARS,
    REGISTRY,
    Answer,
    Checker,
    Grade,
    SpecError,
    normalize,
    parse_check,
)
from replay.checkers.derived.checker import derive
from replay.checkers.derived.rules import DERIVED_RULES, derived_record
from replay.checkers.grader import GRADE_TIME_S, Grader, Job, grade_safely
from replay.checkers.structured import Code, JsonSchema, ToolCallCheck
from replay.checkers.text import Contains, Exact, Number, Regex, Retrieval

__all__ = [
    "DERIVED_RULES",
    "GRADE_TIME_S",
    "MAX_ANSWER_CHARS",
    "REGISTRY",
    "Answer",
    "Checker",
    "Code",
    "Contains",
    "Exact",
    "Grade",
    "Grader",
    "Job",
    "JsonSchema",
    "Number",
    "Regex",
    "Retrieval",
    "SpecError",
    "ToolCallCheck",
    "derive",
    "derived_record",
    "grade_safely",
    "normalize",
    "parse_check",
]
