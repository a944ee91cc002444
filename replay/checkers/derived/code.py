"""The code label of ``derived:code``: the reference's Python and the answer's, their normalized
text, and the calls to compare them on: literal calls written in the prompt or the reference's
answer, then calls generated from the target function's signature."""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from replay.checkers.derived.values import _blocks, _bounded_word, _fenced, answer_text

MAX_CALLS = 12
MIN_CALLS = 4
_CALL_CHARS = 300  # longest call expression read from a prompt or an answer
_CALL_SCAN = 400  # call heads looked at per text
_MAX_FUNCTIONS = 20
_PY_TAGS = frozenset({"", "python", "py", "python3", "py3"})


def _functions(tree: ast.Module) -> list[ast.FunctionDef]:
    return [n for n in tree.body if isinstance(n, ast.FunctionDef)][:_MAX_FUNCTIONS]


def _parse(code: str) -> ast.Module:
    """ast.parse, with what a hostile nest makes the parser raise as SyntaxError."""
    try:
        return ast.parse(code)
    except (RecursionError, MemoryError, ValueError) as exc:
        raise SyntaxError(f"{type(exc).__name__}: {exc}".rstrip(": ")) from None


def _try_parse(code: str) -> ast.Module | None:
    try:
        return _parse(code)
    except SyntaxError:
        return None


def reference_code(text: str) -> str | None:
    """The reference's Python: its first fenced block that defines a function, else the whole
    answer when it parses and defines one, else its first Python-tagged block that parses."""
    text = answer_text(text)
    blocks = [(tag, body) for tag, body in _blocks(text) if tag in _PY_TAGS]
    first_python = None
    for tag, body in blocks:
        tree = _try_parse(body)
        if tree is None:
            continue
        if _functions(tree):
            return body
        if first_python is None and tag:
            first_python = body
    if "def " in text:
        tree = _try_parse(text)
        if tree is not None and _functions(tree):
            return text
    return first_python


def answer_code(text: str, target: str | None) -> str | None:
    """The answer's Python: its first fenced block that defines ``target``, else its first
    Python block, else the whole answer when it holds a ``def``."""
    text = answer_text(text)
    blocks = _fenced(text, _PY_TAGS)
    if target is not None:
        head = re.compile(r"^[ \t]*def[ \t]+" + re.escape(target) + r"[ \t]*\(", re.M)
        for body in blocks:
            if head.search(body):
                return body
    if blocks:
        return blocks[0]
    return text if "def " in text else None


def normalized_code(code: str) -> str:
    """The code as ``ast.unparse`` writes it, without docstrings or comments; the text with
    its whitespace folded when it does not parse."""
    tree = _try_parse(code)
    if tree is None:
        return " ".join(code.split())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    try:
        return ast.unparse(tree)
    except (RecursionError, MemoryError, ValueError):
        return " ".join(code.split())


def _call_end(text: str, start: int) -> int | None:
    """Index after the parenthesis that closes the one at ``start`` (quote-aware), if close."""
    depth, quote, i, end = 0, "", start, min(len(text), start + _CALL_CHARS)
    while i < end:
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _literal_call(src: str, names: frozenset[str]) -> tuple[str, ast.Call] | None:
    try:
        node = ast.parse(src, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
    ):
        return None
    if any(k.arg is None for k in node.keywords):
        return None
    for arg in [*node.args, *(k.value for k in node.keywords)]:
        if isinstance(arg, ast.Starred):
            return None
        try:
            ast.literal_eval(arg)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    return node.func.id, node


def calls_in(text: str, names: frozenset[str]) -> list[tuple[str, str, ast.Call]]:
    """Calls of ``names`` with literal arguments only, as written in ``text`` (examples,
    asserts, doctests, a module's own test lines): (function, source, node)."""
    if not names or not text:
        return []
    head = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, sorted(names))) + r")\s*\(")
    out: list[tuple[str, str, ast.Call]] = []
    for n, m in enumerate(head.finditer(text)):
        if n >= _CALL_SCAN or len(out) >= MAX_CALLS:
            break
        end = _call_end(text, m.end() - 1)
        if end is None:
            continue
        got = _literal_call(text[m.start() : end], names)
        if got is not None:
            out.append((got[0], ast.unparse(got[1]), got[1]))
    return out


_VALUES: dict[str, tuple[Any, ...]] = {
    "int": (2, 3, 5, 10, 1, 7, 0),
    "float": (1.5, 2.0, 0.25, 10.0, 3.75),
    "str": ("abc", "hello world", "a", "racecar", "Kv Canary"),
    "bool": (True, False),
    "list": ([3, 1, 2], [1], [5, 5, 2, 8], [10, -1, 4], []),
    "list_str": (["b", "a"], ["x"], ["hello", "world", "hi"], []),
    "dict": ({"a": 1, "b": 2}, {"x": 10}, {}),
    "tuple": ((1, 2), (3, 4, 5), ()),
    "set": ({1, 2, 3}, {4}, set()),
}


def _type_of_value(v: Any) -> str | None:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, list):
        return "list_str" if v and all(isinstance(x, str) for x in v) else "list"
    for key, t in (
        ("int", int),
        ("float", float),
        ("str", str),
        ("dict", dict),
        ("tuple", tuple),
        ("set", set),
    ):
        if isinstance(v, t):
            return key
    return None


def _type_of_annotation(node: ast.expr | None) -> str | None:
    if node is None:
        return None
    try:
        text = ast.unparse(node).replace("typing.", "").lower()
    except (RecursionError, ValueError):
        return None
    if text in ("int", "float", "str", "bool", "dict", "tuple", "set"):
        return text
    head = text.split("[", 1)[0]
    if head in ("list", "sequence", "iterable"):
        return "list_str" if "str" in text else "list"
    return {"mapping": "dict", "frozenset": "set"}.get(head)


_STR_METHODS = frozenset(
    {
        "split",
        "upper",
        "lower",
        "strip",
        "lstrip",
        "rstrip",
        "replace",
        "startswith",
        "endswith",
        "isdigit",
        "isalpha",
        "join",
        "title",
        "capitalize",
        "casefold",
        "encode",
        "find",
        "splitlines",
        "isupper",
        "islower",
        "isspace",
        "zfill",
    }
)
_DICT_METHODS = frozenset({"items", "keys", "values", "get", "setdefault"})
_LIST_METHODS = frozenset({"append", "sort", "pop", "extend", "insert", "remove"})
_SEQUENCE_FUNCS = frozenset(
    {
        "len",
        "sorted",
        "sum",
        "max",
        "min",
        "set",
        "enumerate",
        "reversed",
        "list",
        "tuple",
        "any",
        "all",
        "zip",
    }
)


def _type_from_body(fn: ast.FunctionDef, param: str) -> str | None:
    """What the body does with ``param`` says what it takes: string methods, dict methods,
    iteration or ``len`` (a list), ``range`` or arithmetic with a number (an int)."""
    found: set[str] = set()

    def named(node: ast.AST | None) -> bool:
        return isinstance(node, ast.Name) and node.id == param

    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and named(node.value):
            found.add(
                "str"
                if node.attr in _STR_METHODS
                else "dict"
                if node.attr in _DICT_METHODS
                else "list"
                if node.attr in _LIST_METHODS
                else ""
            )
        elif (isinstance(node, ast.Subscript) and named(node.value)) or (
            isinstance(node, ast.For | ast.comprehension) and named(node.iter)
        ):
            found.add("list")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in _SEQUENCE_FUNCS and node.args and named(node.args[0]):
                found.add("list")
            elif node.func.id == "range" and any(named(a) for a in node.args):
                found.add("int")
        elif isinstance(node, ast.BinOp) and (named(node.left) or named(node.right)):
            other = node.right if named(node.left) else node.left
            if (
                isinstance(other, ast.Constant)
                and isinstance(other.value, int | float)
                and not isinstance(other.value, bool)
            ):
                found.add("int")
    return next((t for t in ("str", "dict", "list", "int") if t in found), None)


def generated_calls(fn: ast.FunctionDef, seen: Sequence[ast.Call], count: int) -> list[str]:
    """``count`` calls of ``fn`` with fixed simple arguments, by position: typed from its
    annotations, else from the calls already found, else from what its body does with each
    argument, else integers."""
    a = fn.args
    if any(d is None for d in a.kw_defaults) or count <= 0:
        return []  # a required keyword-only argument: nothing to build it from
    params = [*a.posonlyargs, *a.args]
    params = params[: len(params) - len(a.defaults)]
    types = []
    for i, p in enumerate(params):
        t = _type_of_annotation(p.annotation)
        for call in seen:
            if t is None and i < len(call.args):
                try:
                    t = _type_of_value(ast.literal_eval(call.args[i]))
                except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                    t = None
        types.append(t or _type_from_body(fn, p.arg) or "int")
    if not params:
        return [f"{fn.name}()"][:count]
    out: list[str] = []
    for j in range(3 * count):
        args = [_VALUES[t][(j + i) % len(_VALUES[t])] for i, t in enumerate(types)]
        src = f"{fn.name}({', '.join(map(repr, args))})"
        if src not in out:
            out.append(src)
        if len(out) >= count:
            break
    return out


@dataclass(frozen=True, slots=True)
class CodeLabel:
    code: str
    functions: tuple[str, ...]
    target: str | None
    calls: tuple[tuple[str, str], ...]  # (function, call source)
    sources: Mapping[str, int]  # how many calls came from where
    normalized: str


def code_label(code: str, reference_text: str, prompt: str) -> CodeLabel:
    tree = _parse(code)
    fns = _functions(tree)
    names = frozenset(f.name for f in fns)
    target = None
    if fns:
        named = [f for f in fns if _bounded_word(f.name).search(prompt)] if prompt else []
        target = (named or fns)[0 if named else -1].name
    calls: list[tuple[str, str]] = []
    nodes: list[ast.Call] = []
    sources = {"prompt": 0, "reference": 0, "generated": 0}
    for where, text in (("prompt", prompt), ("reference", answer_text(reference_text))):
        for name, src, node in calls_in(text, names):
            if len(calls) < MAX_CALLS and (name, src) not in calls:
                calls.append((name, src))
                sources[where] += 1
                if name == target:
                    nodes.append(node)
    fn = next((f for f in fns if f.name == target), None)
    if fn is not None and len(calls) < MIN_CALLS:
        for src in generated_calls(fn, nodes, MIN_CALLS - len(calls) + 2):
            if len(calls) >= MIN_CALLS:
                break
            if (fn.name, src) not in calls:
                calls.append((fn.name, src))
                sources["generated"] += 1
    return CodeLabel(
        code, tuple(f.name for f in fns), target, tuple(calls), sources, normalized_code(code)
    )
