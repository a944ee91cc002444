"""Checkers over structure: JSON against a schema, tool calls, code run against its tests."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from replay.checkers.base import Answer, Grade, SpecError, allowed_keys, get, register
from replay.checkers.schema_rules import (
    PatternTimeout,
    bounded_validator,
    check_can_pass,
    check_patterns,
    check_size,
    validating,
)
from replay.checkers.text import REGEX_TIMEOUT_S

# Lazy up to the closing tag or the end, whitespace stripped afterwards: a '\s*' on both sides
# of a lazy group backtracks over every run of spaces (quadratic on a hostile answer).
TOOL_TAG = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
_FENCE = re.compile(r"```(?:[\w+-]*)\n(.*?)```", re.S)
_OPENER = re.compile(r"[{\[]")
_TOO_DEEP = "the JSON in the answer is nested too deeply to read"
_MAX_ERRORS = 100  # schema violations looked at (the first by path is reported)


def first_json(text: str) -> Any:
    """The first JSON value in the text (a fenced block, or the first '{'/'[' that parses).
    ValueError when there is none, or when it nests deeper than the parser goes."""
    dec = json.JSONDecoder()
    for candidate in [m.group(1) for m in _FENCE.finditer(text)] + [text]:
        for m in _OPENER.finditer(candidate):
            try:
                return dec.raw_decode(candidate, m.start())[0]
            except json.JSONDecodeError:
                continue
            except RecursionError:
                # Every later opener sits inside the same nest: trying them would cost the
                # answer's length times the parser's depth, to find nothing.
                raise ValueError(_TOO_DEEP) from None
    raise ValueError("no JSON value in the answer")


def parse_json(text: str) -> Any:
    """json.loads, with a nest too deep for the parser as ValueError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(_TOO_DEEP) from None


_REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")


def remote_ref(schema: Any) -> tuple[str, str] | None:
    """(dotted path, value) of the first reference that is not a '#...' pointer into the schema
    itself: resolving one would mean reading a URL or a file."""
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:  # iterative: a schema nested 10,000 deep is still only refused
        path, node = stack.pop()
        items = (
            node.items()
            if isinstance(node, dict)
            else enumerate(node)
            if isinstance(node, list)
            else ()
        )
        for key, value in items:
            here = f"{path}.{key}" if path else str(key)
            if key in _REF_KEYS and isinstance(value, str) and not value.startswith("#"):
                return here, value
            stack.append((here, value))
    return None


@register("json_schema")
@dataclass(frozen=True)
class JsonSchema:
    """The answer holds JSON (its first object or array) that validates against ``schema``;
    the schema must be able to pass and its patterns are bounded (``schema_rules``)."""

    schema: Mapping[str, Any]

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> JsonSchema:
        import jsonschema

        allowed_keys(spec, "schema")
        schema = get(spec, "schema", dict)
        check_size(schema)
        check_patterns(schema)
        remote = remote_ref(schema)
        if remote is not None:
            where, ref = remote
            raise SpecError(
                f"schema.{where}",
                f"{ref!r} is not a local reference: graders "
                "fetch nothing (no URL, no file); put the referenced schema under "
                "'$defs' and point at it with '#/$defs/NAME'",
            )
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise SpecError("schema", f"not a valid JSON schema: {exc.message}") from None
        except RecursionError:
            raise SpecError("schema", "nested too deeply to check") from None
        check_can_pass(schema)
        return cls(schema)

    def grade(self, answer: Answer) -> Grade:
        from referencing import Registry
        from referencing.exceptions import Unresolvable

        try:
            value = first_json(answer.text)
        except ValueError as exc:
            return Grade(False, str(exc), 0.0)
        # An empty registry that retrieves nothing: without one, jsonschema fetches remote
        # references over the network (spec validation refuses them; this is the backstop).
        validator = bounded_validator(dict(self.schema), Registry())
        try:
            with validating():
                errors = sorted(
                    itertools.islice(validator.iter_errors(value), _MAX_ERRORS),
                    key=lambda e: list(e.path),
                )
        except PatternTimeout as exc:
            return Grade(
                False,
                f"checker error: the schema's pattern /{exc.pattern[:100]}/ ran over "
                f"{REGEX_TIMEOUT_S:g} s on this answer (a backtracking pattern); the answer "
                "fails",
                0.0,
                {"checker_error": "timeout"},
            )
        except Unresolvable as exc:
            return Grade(
                False,
                f"checker error: unresolvable reference in the schema: {exc}",
                0.0,
                {"checker_error": "exception"},
            )
        except RecursionError:
            return Grade(False, "the answer's JSON is nested too deeply to validate", 0.0)
        if errors:
            where = "/".join(map(str, errors[0].path)) or "(root)"
            return Grade(False, f"schema violation at {where}: {errors[0].message}", 0.0)
        return Grade(True, "valid against the schema", 1.0)


def calls_from_answer(answer: Answer) -> tuple[list[tuple[str, Any]], str]:
    """(name, arguments) pairs: streamed ``tool_calls`` first, else JSON in the text."""
    if answer.tool_calls:
        out = []
        for c in answer.tool_calls:
            try:
                args = parse_json(c.arguments) if c.arguments.strip() else {}
            except ValueError:
                args = c.arguments  # kept as text: compares unequal, reason shows it
            out.append((c.name, args))
        return out, "streamed tool_calls"
    blobs = TOOL_TAG.findall(answer.text)
    values = []
    for blob in [b.strip() for b in blobs] or [answer.text]:
        try:
            values.append(first_json(blob))
        except ValueError:
            continue
    out = []
    for v in values:
        for item in v if isinstance(v, list) else [v]:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                args = item.get("arguments", item.get("parameters", {}))
                if isinstance(args, str):
                    try:
                        args = parse_json(args)
                    except ValueError:
                        pass
                out.append((item["name"], args))
    return out, "JSON in the text"


def same(want: Any, got: Any, coerce: bool) -> bool:
    """Type-aware equality: 3 != "3" unless ``coerce``; 3 == 3.0 (JSON has one number type)."""
    if isinstance(want, dict) and isinstance(got, dict):
        return want.keys() == got.keys() and all(same(want[k], got[k], coerce) for k in want)
    if isinstance(want, list) and isinstance(got, list):
        return len(want) == len(got) and all(
            same(a, b, coerce) for a, b in zip(want, got, strict=True)
        )
    if isinstance(want, bool) or isinstance(got, bool):
        return (type(want) is type(got) and want == got) or (
            coerce and str(want).lower() == str(got).lower()
        )
    if isinstance(want, int | float) and isinstance(got, int | float):
        return float(want) == float(got)
    if coerce:
        return str(want).strip() == str(got).strip()
    return type(want) is type(got) and bool(want == got)


@register("tool_call")
@dataclass(frozen=True)
class ToolCallCheck:
    """The right tool(s) with the right arguments. ``match: exact`` (all arguments equal) or
    ``subset`` (the expected ones are there and equal; extra arguments allowed).
    ``coerce_types`` makes "3" equal 3 on purpose; by default types must agree.
    A missing or an extra call fails, with the reason."""

    calls: tuple[tuple[str, Mapping[str, Any]], ...]
    subset: bool = False
    coerce: bool = False

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> ToolCallCheck:
        allowed_keys(spec, "calls", "match", "coerce_types")
        calls = get(spec, "calls", list)
        if not calls:
            raise SpecError("calls", "must list at least one expected call")
        parsed = []
        for i, c in enumerate(calls):
            if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not c["name"]:
                raise SpecError(f"calls.{i}.name", "each call needs a tool name")
            args = c.get("arguments", {})
            if not isinstance(args, dict):
                raise SpecError(f"calls.{i}.arguments", "must be an object")
            parsed.append((c["name"], args))
        match = get(spec, "match", str, "exact")
        if match not in ("exact", "subset"):
            raise SpecError("match", "must be 'exact' or 'subset'")
        return cls(tuple(parsed), match == "subset", get(spec, "coerce_types", bool, False))

    def args_ok(self, want: Mapping[str, Any], got: Any) -> bool:
        if not isinstance(got, dict):
            return False
        if self.subset:
            return all(k in got and same(v, got[k], self.coerce) for k, v in want.items())
        return same(dict(want), got, self.coerce)

    def grade(self, answer: Answer) -> Grade:
        got, source = calls_from_answer(answer)
        if not got:
            return Grade(False, "no tool call in the answer", 0.0)
        remaining = list(got)
        matched, problems = 0, []
        for name, want in self.calls:
            idx = next(
                (i for i, (n, a) in enumerate(remaining) if n == name and self.args_ok(want, a)),
                None,
            )
            if idx is None:
                same_name = [a for n, a in remaining if n == name]
                problems.append(
                    f"{name}: arguments {json.dumps(same_name[0])[:200]} != "
                    f"{json.dumps(want)[:200]}"
                    if same_name
                    else f"missing call {name}"
                )
            else:
                matched += 1
                remaining.pop(idx)
        if remaining and not problems:
            problems.append(f"extra call(s): {[n for n, _ in remaining]}")
        score = matched / max(len(self.calls), len(got))
        if problems:
            return Grade(False, "; ".join(problems) + f" (from {source})", score)
        return Grade(True, f"all {matched} call(s) match (from {source})", 1.0)


def extract_code(text: str) -> str:
    """The first fenced block, else the whole answer."""
    m = _FENCE.search(text)
    return m.group(1) if m else text


@register("code")
@dataclass(frozen=True)
class Code:
    """Run the answer's code against ``tests`` (Python) in the sandbox; pass iff they pass.

    Limits that stay by design (``sandbox.run``, ``harness.runner``): the solution starts no
    thread and no process (``max_procs`` 0: ``threading.Thread`` fails the run with "process
    limit"), reaches no network, and its values reach the tests as literals only (no objects,
    classes or identity). The tests run with the builtins they were written against: ``from
    solution import *`` never takes a builtin's name, so a task's ``max`` is ``solution.max``."""

    tests: str
    timeout_s: float = 10.0
    memory_mb: int = 512

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Code:
        allowed_keys(spec, "tests", "language", "timeout_s", "memory_mb")
        if get(spec, "language", str, "python") != "python":
            raise SpecError("language", "only 'python' is supported")
        tests = get(spec, "tests", str)
        try:
            compile(tests, "<tests>", "exec")
        except SyntaxError as exc:
            raise SpecError("tests", f"not valid Python: {exc}") from None
        timeout = float(get(spec, "timeout_s", (int, float), 10.0))
        memory = int(get(spec, "memory_mb", int, 512))
        if not 0 < timeout <= 120 or not 32 <= memory <= 8192:
            raise SpecError("timeout_s", "timeout_s must be in (0, 120], memory_mb in [32, 8192]")
        return cls(tests, timeout, memory)

    def grade(self, answer: Answer) -> Grade:
        from replay.checkers.sandbox.limits import SandboxLimits
        from replay.checkers.sandbox.run import run_python

        res = run_python(
            extract_code(answer.text),
            self.tests,
            SandboxLimits(wall_s=self.timeout_s, memory_mb=self.memory_mb),
        )
        detail = {
            "isolation": res.isolation,
            "network_isolated": res.network_isolated,
            "namespaces_locked": res.namespaces_locked,
            "duration_s": round(res.duration_s, 3),
            "stderr": res.stderr[-500:],
        }
        return Grade(res.passed, res.reason, 1.0 if res.passed else 0.0, detail)
