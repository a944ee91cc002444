"""Grades derived from the reference's answer, for requests that carry no ``check``.

Production traffic has no labels, so the reference target's answer to the same request is the
label. The rule is chosen by the kind of the reference's answer, in this order:

``derived:tool_args``
    The reference called tools: streamed ``tool_calls``, ``<tool_call>{...}</tool_call>``
    blocks in the text, or a whole body (or fenced block) that is a JSON object with a string
    ``name`` and an ``arguments`` (or ``parameters``) key, or a list of such objects. The answer
    passes when it makes the same calls in the same order: same names, arguments equal as
    parsed JSON values; the text beside the calls is not compared. Where a call is written
    (streamed or in the text) does not matter, as for ``tool_call`` checks; both sources are
    in the grade's detail.
``derived:json``
    The reference's whole body, or one of its fenced blocks, is a JSON object or array (a bare
    number or string is free text). The answer passes when its whole body, or its first fenced
    block that parses, is an equal JSON value. Prose around an unfenced JSON value is not read.
``derived:code`` / ``derived:code_text``
    The reference wrote Python that defines a function (a fenced block, or the whole answer).
    Behaviour, not text: the reference's and the answer's code run in the sandbox on the same
    calls and must agree on every outcome (the canonical value returned, or the type of the
    exception raised, or a timeout of ``CALL_TIME_S``). Printed output counts for nothing. The
    calls are, in order and without repeats, up to ``MAX_CALLS``: calls with literal arguments
    of the reference's functions written in the prompt (examples, asserts, doctests), then
    those the reference's answer writes, then generated calls of the chosen function from its
    signature (argument types from its annotations or from the calls already found, else
    integers; fixed small values) until there are ``MIN_CALLS``: after a prompt's lone
    example come generated calls, so code that gets the example right by accident fails on the
    next call. Only where no behaviour can be compared (no function, no call can be built, or the
    reference's own code does not run to its end) the rule is ``derived:code_text``: the
    normalized code (``ast.unparse`` without docstrings and comments) must be equal. An answer
    whose code is the reference's, character for character, passes without being run. Only
    top-level functions are called (not methods); the answer's function is found by the
    reference's name, or, when both define a single function, under its own name.
``derived:facts``
    Anything else is free text. The facts are what the reference copies from the prompt, at
    most ``MAX_FACTS``, in the reference's order:

    - numbers in both (compared as numbers: ``4,821`` is ``4821``), except a number that only
      numbers a list item at the start of a line;
    - identifiers in both as whole tokens (a letter with a digit, an inner ``_``, or camelCase:
      ``P30``, ``user_id``, ``getUser``), case-sensitive;
    - quoted spans (``"..."``, curly quotes, backticks, single quotes; up to 200 characters)
      whose normalized text is in the normalized prompt;
    - names: a run of two to six capitalized words (common sentence words trimmed from its
      ends) found as written in the prompt, else each capitalized word that the prompt
      capitalizes inside a sentence (so "Find" at the start of both is not a name).

    The answer passes when every fact is in it (numbers as numbers, identifiers as tokens,
    spans and names normalized, so case-folded). A reference that copies no fact gives no
    grade: ``passed`` is null ("ungraded"), since a pass there would be evidence of nothing.
    The normalized exact match (``exact``) is recorded beside every derived grade as the
    stricter signal.

Type-aware equality (tool arguments and JSON): objects compare key by key in any order, arrays
item by item in order, numbers by value (``3`` equals ``3.0``: JSON has one number type), and
a string never equals a number (``"3"`` is not ``3``: a tool that receives a string where it
takes a number has received something else), nor a boolean a number (``true`` is not ``1``).
Arguments that are not JSON are compared as text.

A ``<think>...</think>`` block is left out of both answers before any rule reads them. The
prompt is what grading kept of it (``grading.PROMPT_KEEP_CHARS``, its head and tail): facts
and examples beyond that are not seen, and a prompt of token ids has no text, so free text
there is ungraded.

Bounds are the ``Grader``'s: ``Grader.grade_derived`` parses both answers in its worker under
its time and size limits, and runs the code in the sandbox in this process (the sandbox has its
own wall and CPU limits, ``CODE_LIMITS``, and a per-call alarm). Whatever a rule raises is a
failed grade whose reason names it. ``derive`` grades in this process, without the worker's time
limit, for tests and callers that hold trusted answers.

Here: the rule a reference's answer falls under (``reference_label``), the grade against it, and
the checker the Grader's worker builds. The parts: ``derived.rules`` (the rules' names, the
record), ``derived.values`` (tool calls and JSON), ``derived.prompt_facts``, ``derived.code`` (the
code and its calls) and ``derived.code_run`` (running them in the sandbox).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, ClassVar

from replay.checkers.base import (
    DERIVED_TYPE,
    MAX_ANSWER_CHARS,
    Answer,
    Grade,
    answer_size,
    checker_error,
)
from replay.checkers.derived.code import (
    CodeLabel,
    _functions,
    _parse,
    answer_code,
    code_label,
    normalized_code,
    reference_code,
)
from replay.checkers.derived.code_run import CODE_LIMITS, finish
from replay.checkers.derived.prompt_facts import Fact, facts_of, missing_facts
from replay.checkers.derived.rules import CODE, CODE_TEXT, FACTS, JSON_VALUE, TOOL_ARGS, _detail
from replay.checkers.derived.values import (
    Calls,
    answer_text,
    json_difference,
    json_of,
    tool_calls_of,
)
from replay.checkers.sandbox.limits import SandboxLimits
from replay.checkers.structured import parse_json
from replay.core.records import ToolCall

# -- the label and the grade ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Label:
    """What the reference's answer says the answer should be, by rule."""

    rule: str
    source: str = ""
    calls: Calls | None = None
    value: Any = None
    code: CodeLabel | None = None
    facts: tuple[Fact, ...] = ()
    facts_capped: bool = False
    why_ungraded: str = ""


def reference_label(reference: Answer, prompt: str = "") -> Label:
    """The rule the reference's answer falls under, and what it expects (module docstring)."""
    calls = tool_calls_of(reference)
    if calls is not None and calls.calls:
        return Label(TOOL_ARGS, calls.source, calls=calls)
    text = answer_text(reference.text)
    try:
        value = parse_json(text.strip()) if text.strip() else None
    except ValueError:
        value = None
    if isinstance(value, dict | list):
        return Label(JSON_VALUE, "the whole answer", value=value)
    code = reference_code(text)
    if code is not None:
        label = code_label(code, reference.text, prompt)
        return Label(CODE if label.calls else CODE_TEXT, "python", code=label)
    found, value, where = json_of(text, containers_only=True)
    if found:
        return Label(JSON_VALUE, where, value=value)
    facts, capped = facts_of(text, prompt)
    why = (
        ""
        if facts
        else "the reference answered nothing"
        if not text.strip() and not reference.tool_calls
        else "the reference's answer copies no fact from the prompt"
        if prompt
        else "no prompt text to find facts in"
    )
    return Label(FACTS, "free text", facts=tuple(facts), facts_capped=capped, why_ungraded=why)


def grade_label(label: Label, answer: Answer) -> Grade:
    """The answer against the label. A code label with calls gives a grade whose detail holds
    a ``code_plan`` for ``finish`` to run in the sandbox."""
    if label.rule == TOOL_ARGS:
        return _grade_tools(label, answer)
    if label.rule == JSON_VALUE:
        found, value, where = json_of(answer.text)
        if not found:
            return Grade(False, where, 0.0, _detail(JSON_VALUE, reference_from=label.source))
        diff = json_difference(label.value, value)
        detail = _detail(JSON_VALUE, reference_from=label.source, answer_from=where)
        if diff is None:
            return Grade(True, f"the same JSON value as the reference ({where})", 1.0, detail)
        return Grade(False, f"JSON differs from the reference's at {diff}", 0.0, detail)
    if label.code is not None:
        return _grade_code(label.code, answer)
    return _grade_facts(label, answer)


def _grade_tools(label: Label, answer: Answer) -> Grade:
    assert label.calls is not None
    want = label.calls.calls
    got = tool_calls_of(answer) or Calls((), "no call in the answer")
    detail = _detail(
        TOOL_ARGS, reference_from=label.calls.source, answer_from=got.source, calls=len(want)
    )
    problems = list(got.problems[:3])
    if len(got.calls) != len(want):
        problems.insert(
            0,
            f"{len(want)} call(s) expected, {len(got.calls)} made "
            f"({[n for n, _ in got.calls][:5]} for {[n for n, _ in want][:5]})",
        )
    else:
        problems = []
        for i, ((wn, wa), (gn, ga)) in enumerate(zip(want, got.calls, strict=True), 1):
            if wn != gn:
                problems.append(f"call {i}: {gn!r} instead of {wn!r}")
                break
            diff = json_difference(wa, ga)
            if diff is not None:
                problems.append(f"call {i} ({wn}): arguments differ at {diff}")
                break
    if problems:
        return Grade(False, "; ".join(problems) + f" (from {got.source})", 0.0, detail)
    return Grade(
        True,
        f"the same {len(want)} call(s) with the same arguments as the reference "
        f"(from {got.source})",
        1.0,
        detail,
    )


def _grade_facts(label: Label, answer: Answer) -> Grade:
    facts = label.facts
    if not facts:
        return Grade(
            False, f"ungraded: {label.why_ungraded}", None, _detail(FACTS, ungraded=True, facts=[])
        )
    missing = missing_facts(facts, answer_text(answer.text))
    detail = _detail(
        FACTS,
        facts=[f.text for f in facts],
        capped=label.facts_capped,
        missing=[f.text for f in missing][:10],
    )
    score = 1 - len(missing) / len(facts)
    if missing:
        shown = ", ".join(repr(f.text[:40]) for f in missing[:5])
        return Grade(
            False,
            f"missing {len(missing)} of {len(facts)} fact(s) the reference took "
            f"from the prompt: {shown}",
            score,
            detail,
        )
    return Grade(
        True,
        f"all {len(facts)} fact(s) the reference took from the prompt are in the answer",
        1.0,
        detail,
    )


def _grade_code(label: CodeLabel, answer: Answer) -> Grade:
    rule = CODE if label.calls else CODE_TEXT
    code = answer_code(answer.text, label.target)
    if code is None:
        return Grade(False, "no code in the answer", 0.0, _detail(rule))
    try:
        tree = _parse(code)
    except SyntaxError as exc:
        return Grade(False, f"the answer's code does not parse: {exc}"[:300], 0.0, _detail(rule))
    if code.strip() == label.code.strip():
        # Most A/A answers, and many candidates': nothing to run to know they behave the same.
        return Grade(
            True,
            "the same code as the reference's (identical text)",
            1.0,
            _detail(rule, identical=True),
        )
    same_text = normalized_code(code) == label.normalized
    if not label.calls:
        why = (
            "the reference defines no function"
            if not label.functions
            else "no call of the reference's function could be built"
        )
        return Grade(
            same_text,
            f"no behaviour to compare ({why}): the normalized code "
            f"{'is equal' if same_text else 'differs'}",
            1.0 if same_text else 0.0,
            _detail(CODE_TEXT),
        )
    mine = [f.name for f in _functions(tree)]
    aliases = {}
    if label.target and label.target not in mine and len(mine) == 1 and len(label.functions) == 1:
        aliases[label.target] = mine[0]  # the same function under the answer's own name
    plan = {
        "reference_code": label.code,
        "candidate_code": code,
        "calls": [list(c) for c in label.calls],
        "aliases": aliases,
        "sources": dict(label.sources),
        "code_text_equal": same_text,
    }
    return Grade(False, "code not run yet", 0.0, _detail(CODE, code_plan=plan))


# -- the Grader's side ------------------------------------------------------------------------


def derived_spec(reference: Answer, prompt: str) -> dict[str, Any]:
    """What the Grader's worker needs to grade answers against ``reference``."""
    return {
        "type": DERIVED_TYPE,
        "prompt": prompt,
        "reference": {
            "text": reference.text,
            "calls": [[c.index, c.id, c.name, c.arguments] for c in reference.tool_calls],
        },
    }


@dataclass(frozen=True)
class Derived:
    """A checker made from a reference's answer (``derived_spec``); only graders build it."""

    kind: ClassVar[str] = DERIVED_TYPE
    label: Label

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Derived:
        ref = spec["reference"]
        calls = tuple(
            ToolCall(index=int(i), id=None if d is None else str(d), name=str(n), arguments=str(a))
            for i, d, n, a in ref.get("calls", [])
        )
        return cls(reference_label(Answer(str(ref["text"]), calls), str(spec.get("prompt", ""))))

    def grade(self, answer: Answer) -> Grade:
        return grade_label(self.label, answer)


def derive(
    reference: Answer,
    answer: Answer,
    prompt: str = "",
    *,
    limits: SandboxLimits = CODE_LIMITS,
    cache: MutableMapping[str, list[str] | str] | None = None,
    max_chars: int = MAX_ANSWER_CHARS,
) -> Grade:
    """The derived grade of ``answer``, all in this process (no time limit on the parsing:
    ``Grader.grade_derived`` has one). Size-capped; whatever a rule raises is the grade."""
    for who, a in (("the reference's answer", reference), ("the answer", answer)):
        size = answer_size(a)
        if size > max_chars:
            return checker_error(
                "size",
                f"{who} is too long to grade: {size:,} characters (the limit is {max_chars:,})",
            )
    try:
        grade = Derived(reference_label(reference, prompt)).grade(answer)
    except Exception as exc:  # the answer's grade, as for every checker
        return checker_error("exception", f"{type(exc).__name__}: {exc}")
    return finish(grade, limits, cache)
