"""What a ``json_schema`` check's schema must be, beyond a valid schema with local references
only, and the bounded validator it grades with.

Checked when the trace loads:

* **It can pass.** The checker validates the first JSON object or array in the answer
  (``first_json``), so a schema whose root admits neither (``{"type": "string"}``,
  ``{"const": 3}``, ``{"enum": ["a", "b"]}``, ``{"not": {}}``, an ``allOf`` of an object and an
  array) fails every answer; it is refused, saying what checks a scalar answer instead. The
  root's ``type``, ``const``, ``enum``, ``not``, ``allOf``, ``anyOf`` and ``oneOf`` are read;
  what a ``$ref`` points at is not (such a root is taken as admitting both).
* **Its regular expressions are bounded, as a ``regex`` check's are.** Every ``pattern`` and
  every ``patternProperties`` key is compiled by the ``regex`` module (one it cannot read names
  its path), and grading matches each with what is left of ``REGEX_TIMEOUT_S`` for the
  answer: a backtracking pattern (``(a+)+$``) fails that answer with a checker error within
  about a second, instead of holding a grading worker until its time limit kills it.
  ``unevaluatedProperties`` beside ``patternProperties`` is refused: jsonschema matches those
  patterns itself, with ``re``, which nothing can stop. A pattern longer than
  ``MAX_PATTERN_CHARS`` is refused before it is compiled.
* **It is of a bounded size.** A schema of more than ``MAX_SCHEMA_BYTES`` as JSON is refused:
  checking one costs seconds at load and again in every grading worker (on a loaded 2-core
  machine, 85 KiB took 1.3 s and 1.4 MiB 11 s), and a schema an answer must meet is never
  that large.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator
from typing import Any

from replay.checkers.base import SpecError
from replay.checkers.text import REGEX_TIMEOUT_S, check_pattern_size

_BOTH = frozenset({"object", "array"})
_NOTHING: frozenset[str] = frozenset()
_MAX_DEPTH = 64  # roots nested deeper than this are taken as admitting both kinds
_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})  # values, not schemas
MAX_SCHEMA_BYTES = 64 * 1024


class PatternTimeout(Exception):
    """A schema pattern ran out of the answer's time for regular expressions."""

    def __init__(self, pattern: str) -> None:
        super().__init__(pattern)
        self.pattern = pattern


def check_can_pass(schema: dict[str, Any]) -> None:
    """Refuse a schema no answer can pass (SpecError)."""
    if not (_kinds(schema, 0) & _BOTH):
        raise SpecError(
            "schema",
            "admits no JSON object or array, and the checker validates the first JSON "
            "object or array in the answer, so no answer could pass; check a scalar "
            "answer with 'regex', 'exact' or 'number', or ask for an object and check "
            'that: {"type": "object", "properties": {...}}',
        )


def check_size(schema: dict[str, Any]) -> None:
    """Refuse a schema of more than ``MAX_SCHEMA_BYTES`` as JSON (SpecError)."""
    size = _json_size(schema, MAX_SCHEMA_BYTES)
    if size > MAX_SCHEMA_BYTES:
        raise SpecError(
            "schema",
            f"is more than {MAX_SCHEMA_BYTES >> 10} KiB as JSON, the most a check's schema "
            "may be (checking it would take seconds at load and in every grading worker); "
            "check the parts of the answer that decide its grade",
        )


def _json_size(value: Any, stop_after: int) -> int:
    """About how many bytes ``value`` takes as JSON (a string or key by its characters, any
    other value or container as a few), counted without recursion and only up to past
    ``stop_after``."""
    size, stack = 0, [value]
    while stack and size <= stop_after:
        node = stack.pop()
        size += 2
        if isinstance(node, str):
            size += len(node)
        elif isinstance(node, dict):
            size += sum(len(str(k)) + 3 for k in node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return size


def check_patterns(schema: dict[str, Any]) -> None:
    """Refuse a pattern the ``regex`` module cannot read, naming its path, or patterns whose
    matching cannot be bounded (SpecError)."""
    import regex

    pattern_properties = unevaluated = None
    for path, key, value in _schema_keys(schema):
        where = f"schema.{path}{'.' if path else ''}{key}"
        if key == "unevaluatedProperties":
            unevaluated = unevaluated or where
            continue
        patterns = (
            [(where, value)]
            if key == "pattern" and isinstance(value, str)
            else [(f"{where}.{p}", p) for p in value]
            if key == "patternProperties" and isinstance(value, dict)
            else []
        )
        if key == "patternProperties" and patterns:
            pattern_properties = pattern_properties or where
        for at, pattern in patterns:
            check_pattern_size(at, pattern)
            try:
                regex.compile(pattern)
            except (regex.error, ValueError, OverflowError) as exc:
                raise SpecError(at, f"not a valid regular expression: {exc}") from None
    if unevaluated and pattern_properties:
        raise SpecError(
            unevaluated,
            f"cannot be used beside patternProperties ({pattern_properties}): jsonschema "
            "matches those patterns itself where grading cannot bound their time; list "
            "the properties, or use additionalProperties",
        )


def _kind(value: Any) -> str:
    return "object" if isinstance(value, dict) else "array" if isinstance(value, list) else ""


def _kinds(schema: Any, depth: int) -> frozenset[str]:
    """Which of a JSON object and a JSON array the schema can accept."""
    if schema is False:
        return _NOTHING
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return _BOTH
    kinds = _BOTH
    declared = schema.get("type")
    if isinstance(declared, str | list):
        kinds &= frozenset([declared] if isinstance(declared, str) else declared)
    if "const" in schema:
        kinds &= {_kind(schema["const"])}
    if isinstance(schema.get("enum"), list):
        kinds &= {_kind(v) for v in schema["enum"]}
    if schema.get("not") is True or schema.get("not") == {}:
        kinds = _NOTHING
    for sub in _list(schema.get("allOf")):
        kinds &= _kinds(sub, depth + 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            kinds &= frozenset().union(*(_kinds(s, depth + 1) for s in schema[key]))
    return kinds


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _schema_keys(schema: Any) -> Iterator[tuple[str, str, Any]]:
    """(path, key, value) of every key of every object in the schema, but inside the values of
    ``const``, ``enum``, ``default`` and ``examples`` (data, not schema); iterative."""
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                yield path, str(key), value
                if key not in _DATA_KEYS:
                    stack.append((f"{path}.{key}" if path else str(key), value))
        elif isinstance(node, list):
            stack.extend((f"{path}.{i}", v) for i, v in enumerate(node))


# -- grading: the patterns matched under the answer's time ------------------------------------

_deadline: contextvars.ContextVar[float] = contextvars.ContextVar("schema_regex_deadline")


def bounded_validator(schema: dict[str, Any], registry: Any) -> Any:
    """A validator of ``schema`` whose ``pattern``, ``patternProperties`` and
    ``additionalProperties`` match with ``regex`` under the answer's deadline; ``validating``
    sets the deadline."""
    import jsonschema

    return _bounded_class(jsonschema.validators.validator_for(schema))(schema, registry=registry)


class validating:
    """The time regular expressions get while one answer is validated."""

    def __enter__(self) -> None:
        self._token = _deadline.set(time.monotonic() + REGEX_TIMEOUT_S)

    def __exit__(self, *exc: object) -> None:
        _deadline.reset(self._token)


_classes: dict[type, type] = {}


def _bounded_class(base: type) -> type:
    if base not in _classes:
        import jsonschema

        _classes[base] = jsonschema.validators.extend(
            base,
            {
                "pattern": _pattern,
                "patternProperties": _pattern_properties,
                "additionalProperties": _additional_properties,
            },
        )
    return _classes[base]


def _search(pattern: str, text: str) -> bool:
    import regex

    left = _deadline.get(time.monotonic() + REGEX_TIMEOUT_S) - time.monotonic()
    if left <= 0:
        raise PatternTimeout(pattern)
    try:
        return regex.search(pattern, text, timeout=left) is not None
    except TimeoutError:
        raise PatternTimeout(pattern) from None


# jsonschema's own keywords (4.x, ``_keywords``), with ``re.search`` replaced by ``_search``.


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[Any]:
    from jsonschema import ValidationError

    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance[:100]!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: Any, instance: Any, schema: Any) -> Iterator[Any]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for k, v in instance.items():
            if _search(pattern, k):
                yield from validator.descend(v, subschema, path=k, schema_path=pattern)


def _additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Iterator[Any]:
    from jsonschema import ValidationError

    if not validator.is_type(instance, "object"):
        return
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras = [
        k for k in instance if k not in properties and not any(_search(p, k) for p in patterns)
    ]
    if validator.is_type(extra, "object"):
        for k in extras:
            yield from validator.descend(instance[k], extra, path=k)
    elif not extra and extras:
        shown = ", ".join(repr(k) for k in sorted(extras)[:10])
        yield ValidationError(f"additional properties are not allowed ({shown} unexpected)")
