"""Task checkers, from a registry keyed by the spec's ``type``.

    check = parse_check({"type": "retrieval", "passage_ids": ["P3"], "fact": "4821"})
    grade = check.grade(Answer(text, tool_calls))   # Grade(passed, reason, score, detail)

Kinds: retrieval, tool_call, code, json_schema, regex, exact, number, contains.
"""

from ._base import REGISTRY, Answer, Checker, Grade, SpecError, normalize, parse_check
from ._structured import Code, JsonSchema, ToolCallCheck
from ._text import Contains, Exact, Number, Regex, Retrieval

__all__ = ["REGISTRY", "Answer", "Checker", "Code", "Contains", "Exact", "Grade", "JsonSchema",
           "Number", "Regex", "Retrieval", "SpecError", "ToolCallCheck", "normalize",
           "parse_check"]
