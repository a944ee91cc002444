"""Checkers over the answer's text: exact, contains, regex, number, retrieval."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from replay.checkers.base import (
    Answer,
    Grade,
    SpecError,
    allowed_keys,
    get,
    normalize,
    numbers_in,
    register,
)


@register("exact")
@dataclass(frozen=True)
class Exact:
    """The whole answer equals ``value`` (normalized unless ``normalize`` is false)."""

    value: str
    normalized: bool = True

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Exact:
        allowed_keys(spec, "value", "normalize")
        return cls(str(get(spec, "value", (str, int, float))), get(spec, "normalize", bool, True))

    def grade(self, answer: Answer) -> Grade:
        got, want = answer.text, self.value
        if self.normalized:
            got, want = normalize(got), normalize(want)
        else:
            got = got.strip()
        if got == want:
            return Grade(True, "exact match", 1.0)
        return Grade(False, f"expected {self.value!r}, got {answer.text.strip()[:200]!r}", 0.0)


@register("contains")
@dataclass(frozen=True)
class Contains:
    """The answer contains every (or, with ``all: false``, any) of ``values``."""

    values: tuple[str, ...]
    require_all: bool = True
    case_sensitive: bool = False

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Contains:
        allowed_keys(spec, "values", "all", "case_sensitive")
        values = get(spec, "values", list)
        if not values or not all(isinstance(v, str | int | float) for v in values):
            raise SpecError("values", "must be a non-empty list of strings or numbers")
        return cls(
            tuple(str(v) for v in values),
            get(spec, "all", bool, True),
            get(spec, "case_sensitive", bool, False),
        )

    def grade(self, answer: Answer) -> Grade:
        text = answer.text if self.case_sensitive else answer.text.lower()
        found = [v for v in self.values if (v if self.case_sensitive else v.lower()) in text]
        missing = [v for v in self.values if v not in found]
        ok = not missing if self.require_all else bool(found)
        score = len(found) / len(self.values)
        if ok:
            return Grade(True, f"contains {found}", score)
        return Grade(
            False,
            f"missing {missing}" if self.require_all else f"none of {list(self.values)} found",
            score,
        )


REGEX_TIMEOUT_S = 1.0
# Characters a pattern (a ``regex`` check's, a schema's) may have: a 1 MB one took 18 s and
# 640 MB to compile for grading; a pattern an answer must match is never that long.
MAX_PATTERN_CHARS = 10_000


def check_pattern_size(field: str, pattern: str) -> None:
    """Refuse a pattern longer than ``MAX_PATTERN_CHARS`` (SpecError naming ``field``)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise SpecError(
            field,
            f"the pattern is {len(pattern):,} characters, more than the {MAX_PATTERN_CHARS:,} "
            "a check may have (compiling it would take seconds and hundreds of MB at every "
            "grading); match a shorter pattern, or check the answer with 'contains' or 'exact'",
        )


@register("regex")
@dataclass(frozen=True)
class Regex:
    """``pattern`` matches somewhere in the answer (``fullmatch: true`` for all of it).

    Matched by the ``regex`` module (``re``'s syntax) with a timeout: a backtracking pattern
    such as ``(a+)+$`` takes time exponential in the answer's length, and ``re`` cannot be
    stopped. A match that runs out of time fails the answer, with the reason."""

    pattern: Any  # a compiled regex.Pattern (the module ships no type information)
    full: bool = False

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Regex:
        import regex

        allowed_keys(spec, "pattern", "flags", "fullmatch")
        flags = 0
        for ch in get(spec, "flags", str, ""):
            if ch not in "imsx":
                raise SpecError("flags", f"unknown flag {ch!r}; use any of i, m, s, x")
            flags |= {"i": regex.I, "m": regex.M, "s": regex.S, "x": regex.X}[ch]
        source = get(spec, "pattern", str)
        check_pattern_size("pattern", source)
        try:
            pattern = regex.compile(source, flags)
        except (regex.error, ValueError, OverflowError) as exc:
            raise SpecError("pattern", f"not a valid regular expression: {exc}") from None
        return cls(pattern, get(spec, "fullmatch", bool, False))

    def grade(self, answer: Answer) -> Grade:
        text = answer.text.strip()
        match = self.pattern.fullmatch if self.full else self.pattern.search
        try:
            m = match(text, timeout=REGEX_TIMEOUT_S)
        except TimeoutError:
            return Grade(
                False,
                f"checker error: /{str(self.pattern.pattern)[:100]}/ ran over "
                f"{REGEX_TIMEOUT_S:g} s on this answer (a backtracking pattern); the "
                "answer fails",
                0.0,
                {"checker_error": "timeout"},
            )
        if m:
            return Grade(True, f"matched {str(m.group(0))[:100]!r}", 1.0)
        return Grade(False, f"no match for /{self.pattern.pattern}/", 0.0)


@register("number")
@dataclass(frozen=True)
class Number:
    """A number in the answer (the last one, or ``which: "any"``) is ``value`` within
    ``tolerance`` (absolute) or ``rel_tolerance``."""

    value: float
    tolerance: float = 0.0
    rel_tolerance: float = 0.0
    which: str = "last"

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Number:
        allowed_keys(spec, "value", "tolerance", "rel_tolerance", "which")
        value = float(get(spec, "value", (int, float)))
        tol = float(get(spec, "tolerance", (int, float), 0.0))
        rel = float(get(spec, "rel_tolerance", (int, float), 0.0))
        if not math.isfinite(value) or tol < 0 or rel < 0:
            raise SpecError("tolerance", "value must be finite and tolerances >= 0")
        which = get(spec, "which", str, "last")
        if which not in ("last", "first", "any"):
            raise SpecError("which", "must be 'last', 'first' or 'any'")
        return cls(value, tol, rel, which)

    def close(self, x: float) -> bool:
        return abs(x - self.value) <= max(self.tolerance, self.rel_tolerance * abs(self.value))

    def grade(self, answer: Answer) -> Grade:
        nums = numbers_in(answer.text)
        if not nums:
            return Grade(False, "no number in the answer", 0.0)
        pool = nums if self.which == "any" else [nums[-1] if self.which == "last" else nums[0]]
        hit = next((x for x in pool if self.close(x)), None)
        if hit is not None:
            return Grade(True, f"{hit:g} matches {self.value:g}", 1.0)
        return Grade(False, f"expected {self.value:g}, got {pool[-1]:g}", 0.0)


@register("retrieval")
@dataclass(frozen=True)
class Retrieval:
    """The answer cites the expected passage id(s) and/or states the expected fact
    (normalized: case, whitespace, punctuation, number formats)."""

    passage_ids: tuple[str, ...]
    fact: str | None

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Retrieval:
        allowed_keys(spec, "passage_ids", "fact")
        ids = get(spec, "passage_ids", list, [])
        if not all(isinstance(i, str | int) and not isinstance(i, bool) and str(i) for i in ids):
            raise SpecError("passage_ids", "must be a list of ids (strings or integers)")
        fact = get(spec, "fact", (str, int, float), None)
        if not ids and fact is None:
            raise SpecError("fact", "give 'fact', 'passage_ids' or both")
        return cls(tuple(str(i) for i in ids), None if fact is None else str(fact))

    def grade(self, answer: Answer) -> Grade:
        norm = f" {normalize(answer.text)} "
        cited = [p for p in self.passage_ids if f" {normalize(p)} " in norm]
        checks = len(self.passage_ids) + (self.fact is not None)
        fact_ok = self.fact is None or f" {normalize(self.fact)} " in norm
        score = (len(cited) + (self.fact is not None and fact_ok)) / checks
        problems = []
        missing = [p for p in self.passage_ids if p not in cited]
        if missing:
            problems.append(f"passage(s) {missing} not cited")
        if not fact_ok:
            problems.append(f"fact {self.fact!r} not stated")
        if problems:
            return Grade(False, "; ".join(problems), score)
        return Grade(True, "cites the passage(s) and states the fact", score)
