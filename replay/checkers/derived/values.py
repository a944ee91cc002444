"""A derived grade's reading of answers as values: the text without its reasoning block, fenced
blocks, the tool calls an answer makes (streamed or written), its JSON value, and where two
JSON values first differ, type-aware (the rules are in ``derived.checker``'s docstring)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from replay.checkers.base import Answer
from replay.checkers.structured import TOOL_TAG, parse_json

_MAX_BLOCKS = 50  # fenced blocks read per answer
_SHOW = 80  # characters of a value shown in a reason
_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.S)
# The tag is followed by blanks and a newline only: a tag run that may reach anything before
# its newline would rescan the rest of the line from every backtick of a hostile answer.
_FENCE = re.compile(r"```[ \t]*([\w+.#-]*)[ \t]*\r?\n(.*?)```", re.S)
_JSON_TAGS = frozenset({"", "json", "jsonc", "json5"})


@dataclass(frozen=True, slots=True)
class Unparsed:
    """Tool-call arguments that are not JSON: compared as text, and the reason says why."""

    text: str
    why: str


@dataclass(frozen=True, slots=True)
class Calls:
    calls: tuple[tuple[str, Any], ...]
    source: str
    problems: tuple[str, ...] = ()


def answer_text(text: str) -> str:
    """The answer without its reasoning block."""
    return _THINK.sub("", text) if "<think>" in text else text


def _blocks(text: str) -> list[tuple[str, str]]:
    """(tag, body) of the answer's first fenced blocks."""
    out = []
    for m in _FENCE.finditer(text):
        out.append((m.group(1).lower(), m.group(2)))
        if len(out) >= _MAX_BLOCKS:
            break
    return out


def _fenced(text: str, tags: frozenset[str]) -> list[str]:
    return [body for tag, body in _blocks(text) if tag in tags]


def _as_calls(value: Any, need_arguments: bool) -> list[tuple[str, Any]] | None:
    """``value`` as tool calls, or None when it is not one call or a list of calls."""
    items = value if isinstance(value, list) and value else [value]
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        if need_arguments and "arguments" not in item and "parameters" not in item:
            return None
        args: Any = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            text = args
            try:
                args = parse_json(text) if text.strip() else {}
            except ValueError as exc:
                args = Unparsed(text, str(exc))
        out.append((item["name"], args))
    return out


def tool_calls_of(answer: Answer) -> Calls | None:
    """The calls an answer makes: streamed ``tool_calls`` first, else calls in its text."""
    if answer.tool_calls:
        calls = []
        for c in answer.tool_calls:
            try:
                args: Any = parse_json(c.arguments) if c.arguments.strip() else {}
            except ValueError as exc:
                args = Unparsed(c.arguments, str(exc))
            calls.append((c.name, args))
        return Calls(tuple(calls), "streamed tool_calls")
    text = answer_text(answer.text)
    if "<tool_call>" in text:
        found: list[tuple[str, Any]] = []
        problems = []
        for blob in TOOL_TAG.findall(text):
            try:
                got = _as_calls(parse_json(blob.strip()), need_arguments=False)
            except ValueError as exc:
                problems.append(f"a <tool_call> block is not JSON ({exc})")
                continue
            if got is None:
                problems.append("a <tool_call> block is not a call with a name")
            else:
                found += got
        return Calls(tuple(found), "<tool_call> blocks in the text", tuple(problems))
    for body in [text.strip(), *_fenced(text, _JSON_TAGS)]:
        try:
            got = _as_calls(parse_json(body), need_arguments=True)
        except ValueError:
            continue
        if got is not None:
            return Calls(tuple(got), "a JSON call in the text")
    return None


def json_of(text: str, containers_only: bool = False) -> tuple[bool, Any, str]:
    """(found, value, where or why not): the whole body, else the first fenced block, as JSON."""
    text = answer_text(text)
    why = "no JSON value in the answer (its whole body or a fenced block)"
    for where, body in [("the whole answer", text.strip())] + [
        ("a fenced block", b) for b in _fenced(text, _JSON_TAGS)
    ]:
        if not body.strip():
            continue
        try:
            value = parse_json(body)
        except ValueError as exc:
            if "nested too deeply" in str(exc):
                why = f"the JSON in {where} is nested too deeply to read"
            continue
        if containers_only and not isinstance(value, dict | list):
            continue
        return True, value, where
    return False, None, why


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, str):
        return "string"
    if v is None:
        return "null"
    if isinstance(v, dict):
        return "object"
    if isinstance(v, list):
        return "array"
    if isinstance(v, Unparsed):
        return "unparsed"
    return type(v).__name__


def _show(v: Any) -> str:
    if isinstance(v, Unparsed):
        return f"text that is not JSON ({v.why}): {v.text[:_SHOW]!r}"
    try:
        s = json.dumps(v)
    except (TypeError, ValueError, RecursionError):
        s = repr(v)
    return (s if len(s) <= _SHOW else s[: _SHOW - 3] + "...") + f" ({_kind(v)})"


def _step(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if key.isidentifier() else f"{path}[{json.dumps(key)}]"


def json_difference(want: Any, got: Any) -> str | None:
    """Where two parsed JSON values first differ, type-aware (see the module docstring); None
    when equal. Iterative: values nested as deep as the parser allows compare without
    recursion."""
    stack: list[tuple[str, Any, Any]] = [("$", want, got)]
    while stack:
        path, a, b = stack.pop()
        ka, kb = _kind(a), _kind(b)
        where = path if len(path) <= 120 else "..." + path[-117:]
        if ka != kb:
            return f"{where}: {_show(a)} != {_show(b)}"
        if ka == "object":
            missing, extra = [k for k in a if k not in b], [k for k in b if k not in a]
            if missing or extra:
                what = (
                    (f"key(s) {missing[:5]} missing" if missing else "")
                    + ("; " if missing and extra else "")
                    + (f"key(s) {extra[:5]} not expected" if extra else "")
                )
                return f"{where}: {what}"
            stack.extend((_step(path, k), a[k], b[k]) for k in reversed(list(a)))
        elif ka == "array":
            if len(a) != len(b):
                return f"{where}: {len(a)} item(s) != {len(b)} item(s)"
            stack.extend((_step(path, i), a[i], b[i]) for i in reversed(range(len(a))))
        elif ka == "number":
            if not (a == b or (math.isnan(a) and math.isnan(b))):
                return f"{where}: {_show(a)} != {_show(b)}"
        elif a != b:
            return f"{where}: {_show(a)} != {_show(b)}"
    return None


def _bounded_word(text: str) -> re.Pattern[str]:
    """``text`` as a whole word (a name looked up in the prompt), not inside a longer one."""
    return re.compile(r"(?<!\w)" + re.escape(text) + r"(?!\w)")
