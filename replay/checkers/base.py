"""What every checker shares: the answer it sees, the grade it returns, the registry.

A checker is built from a trace record's ``check`` spec (validated when the trace loads, before
any request is sent) and grades an ``Answer``. A failed grade is a result with a reason; only
a bad spec raises (``SpecError``, naming the field).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from replay.core.records import ToolCall


class SpecError(ValueError):
    """A checker spec is wrong (the trace author's fault); ``field`` is relative to ``check``."""

    def __init__(self, field: str, reason: str) -> None:
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


@dataclass(frozen=True, slots=True)
class Answer:
    """What a target answered: text and assembled tool calls."""

    text: str
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True)
class Grade:
    passed: bool
    reason: str
    score: float | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "reason": self.reason,
            "score": self.score,
            "detail": dict(self.detail),
        }


MAX_ANSWER_CHARS = 1_000_000  # larger answers fail as a checker error instead of being graded
DERIVED_TYPE = "derived"  # a derived grade's spec (``derived.checker``), never a trace's check


def answer_size(answer: Answer) -> int:
    return len(answer.text) + sum(len(c.name) + len(c.arguments) for c in answer.tool_calls)


REASON_MAX = 300  # characters of a grade's reason: it is shown in tables and reports


def clip_reason(text: str) -> str:
    return text if len(text) <= REASON_MAX else text[: REASON_MAX - 3] + "..."


def checker_error(kind: str, message: str) -> Grade:
    """The failed grade of an answer that could not be graded, and why."""
    return Grade(False, clip_reason(f"checker error: {message}"), 0.0, {"checker_error": kind})


class Checker(Protocol):
    kind: ClassVar[str]

    def grade(self, answer: Answer) -> Grade: ...


REGISTRY: dict[str, Callable[[Mapping[str, Any]], Checker]] = {}


def register(kind: str) -> Callable[[Any], Any]:
    def deco(cls: Any) -> Any:
        cls.kind = kind
        REGISTRY[kind] = cls.from_spec
        return cls

    return deco


def parse_check(spec: Any) -> Checker:
    """Build the checker a spec describes; SpecError names the field and the fix."""
    if not isinstance(spec, Mapping):
        raise SpecError("(check)", "must be an object with a 'type'")
    kind = spec.get("type")
    if not isinstance(kind, str) or kind not in REGISTRY:  # a list or dict is unhashable
        raise SpecError(
            "type", f"unknown checker {kind!r}. Available: {', '.join(sorted(REGISTRY))}"
        )
    return REGISTRY[kind](spec)


# -- spec helpers ---------------------------------------------------------------------------


def allowed_keys(spec: Mapping[str, Any], *keys: str) -> None:
    extra = set(spec) - {"type", *keys}
    if extra:
        key = sorted(extra)[0]
        # An empty key still needs a visible name in "file:line: field 'check.…'".
        raise SpecError(
            key or '""',
            f"unknown key for a '{spec['type']}' check; valid keys: {', '.join(sorted(keys))}",
        )


def get(
    spec: Mapping[str, Any],
    key: str,
    types: type | tuple[type, ...],
    default: Any = ...,
) -> Any:
    if key not in spec:
        if default is ...:
            raise SpecError(key, "required")
        return default
    value = spec[key]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise SpecError(key, f"must be {_names(types)}, got a boolean")
    if not isinstance(value, types):
        raise SpecError(key, f"must be {_names(types)}, got {type(value).__name__}")
    return value


def _names(types: type | tuple[type, ...]) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    return " or ".join(
        {
            "str": "a string",
            "int": "an integer",
            "float": "a number",
            "bool": "true/false",
            "list": "a list",
            "dict": "an object",
        }.get(t.__name__, t.__name__)
        for t in ts
    )


# -- normalization --------------------------------------------------------------------------

_PUNCT = re.compile(r"[^\w\s.-]|(?<!\d)[.-]|[.-](?!\d)")
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?")


def normalize(text: str) -> str:
    """Case, whitespace, punctuation and number formats folded: 'The value is 4,821.'
    and 'the value is 4821' compare equal."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = NUMBER.sub(lambda m: canonical_number(m.group(0)), text)
    text = _PUNCT.sub(" ", text)
    return " ".join(text.split())


def canonical_number(token: str) -> str:
    value = float(token.replace(",", ""))
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


def numbers_in(text: str) -> list[float]:
    return [float(m.group(0).replace(",", "")) for m in NUMBER.finditer(text)]
