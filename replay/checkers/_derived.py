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
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
import secrets
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from replay.core.records import ToolCall

from ._base import _NUM, Answer, Grade, canonical_number, normalize
from ._bounded import DERIVED_TYPE, MAX_ANSWER_CHARS, answer_size, checker_error
from ._sandbox import SandboxLimits, run_python
from ._structured import _TOOL_TAG, _loads

TOOL_ARGS, JSON_VALUE, CODE, CODE_TEXT, FACTS = (
    "derived:tool_args",
    "derived:json",
    "derived:code",
    "derived:code_text",
    "derived:facts",
)
DERIVED_RULES = (TOOL_ARGS, JSON_VALUE, CODE, CODE_TEXT, FACTS)
UNKNOWN_RULE = "derived"  # a grade that failed before its rule was known (checker error)

MAX_FACTS = 64
MAX_CALLS = 12
MIN_CALLS = 4
CALL_TIME_S = 0.5
CODE_LIMITS = SandboxLimits(wall_s=15.0, cpu_s=10, memory_mb=512)
_CALL_CHARS = 300  # longest call expression read from a prompt or an answer
_CALL_SCAN = 400  # call heads looked at per text
_MAX_FUNCTIONS = 20
_QUOTE_CHARS = 200
_LOOKUPS = 400  # quoted spans, and capitalized runs, looked up in the prompt
_NAME_WORDS = 6  # a longer capitalized run is looked up word by word
_MAX_BLOCKS = 50  # fenced blocks read per answer
_OUTCOME_CHARS = 1000  # longer canonical values are compared by their SHA-256
_SHOW = 80
_CACHE_MAX = 1024

_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.S)
# The tag is followed by blanks and a newline only: a tag run that may reach anything before
# its newline would rescan the rest of the line from every backtick of a hostile answer.
_FENCE = re.compile(r"```[ \t]*([\w+.#-]*)[ \t]*\r?\n(.*?)```", re.S)
_PY_TAGS = frozenset({"", "python", "py", "python3", "py3"})
_JSON_TAGS = frozenset({"", "json", "jsonc", "json5"})
_TOKEN = re.compile(r"\w+(?:[.-]\w+)*")
_QUOTES = tuple(
    re.compile(f"{left}([^{right}\\n]{{1,{_QUOTE_CHARS}}}){right}")
    for left, right in (('"', '"'), ("\u201c", "\u201d"), ("`", "`"))
)
_QUOTES += (re.compile(rf"(?<!\w)'([^'\n]{{1,{_QUOTE_CHARS}}})'(?!\w)"),)
_CAMEL = re.compile(r"[a-z][A-Z]")
# Capitalized only because they start a sentence or a heading, in the prompt or the answer.
_STOP = frozenset(
    """
a an the this that these those it its i we you he she they them there here what which who
whom whose when where why how yes no not sure okay ok so and but or nor if then else also
however therefore thus hence first second third next finally in on at of for to from by with
as is are was were be been am do does did has have had can could will would shall should may
might must let please thanks thank hello hi dear note answer question example examples result
results step steps based according given using because since while after before each every all
any some none one two three my our your his her their
""".split()
)


# -- answers as values ------------------------------------------------------------------------


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
                args = _loads(text) if text.strip() else {}
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
                args: Any = _loads(c.arguments) if c.arguments.strip() else {}
            except ValueError as exc:
                args = Unparsed(c.arguments, str(exc))
            calls.append((c.name, args))
        return Calls(tuple(calls), "streamed tool_calls")
    text = answer_text(answer.text)
    if "<tool_call>" in text:
        found: list[tuple[str, Any]] = []
        problems = []
        for blob in _TOOL_TAG.findall(text):
            try:
                got = _as_calls(_loads(blob.strip()), need_arguments=False)
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
            got = _as_calls(_loads(body), need_arguments=True)
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
            value = _loads(body)
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


# -- facts ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fact:
    kind: str  # number | identifier | quote | name
    text: str  # as the reference wrote it
    key: str  # what the answer must hold (canonical number, token, normalized text)


def _is_identifier(token: str) -> bool:
    letters = any(c.isalpha() for c in token)
    return letters and (
        any(c.isdigit() for c in token)
        or "_" in token.strip("_")
        or _CAMEL.search(token) is not None
    )


def _word_kind(token: str) -> str:
    """ "identifier", "name" (a capitalized word that is not a common sentence word),
    "capitalized" (one that is) or ""."""
    if _is_identifier(token):
        return "identifier"
    if len(token) < 2 or not token[0].isupper():
        return ""
    if token.lower() in _STOP or not any(c.isalpha() for c in token[1:]):
        return "capitalized"
    return "name"


def _bounded_word(text: str) -> re.Pattern[str]:
    return re.compile(r"(?<!\w)" + re.escape(text) + r"(?!\w)")


def facts_of(reference: str, prompt: str) -> tuple[list[Fact], bool]:
    """The facts the reference's answer copies from the prompt, in the answer's order, and
    whether there were more than ``MAX_FACTS``."""
    if not prompt or not reference:
        return [], False
    prompt_numbers = {canonical_number(m.group(0)) for m in _NUM.finditer(prompt)}
    prompt_tokens: set[str] = set()
    proper: set[str] = set()  # capitalized inside a sentence of the prompt: a name there
    for m in _TOKEN.finditer(prompt):
        word = m.group(0)
        prompt_tokens.add(word)
        if word[0].isupper() and word not in proper and not _sentence_start(prompt, m.start()):
            proper.add(word)
    norm_prompt = f" {normalize(prompt)} "
    found: list[tuple[int, Fact]] = []
    for m in _NUM.finditer(reference):
        key = canonical_number(m.group(0))
        if key in prompt_numbers and not _list_marker(reference, m):
            found.append((m.start(), Fact("number", m.group(0), key)))
    looked: dict[str, bool] = {}
    for pattern in _QUOTES:
        for m in pattern.finditer(reference):
            key = normalize(m.group(1))
            if key and key not in looked and len(looked) < _LOOKUPS:
                looked[key] = f" {key} " in norm_prompt
            if key and looked.get(key):
                found.append((m.start(), Fact("quote", m.group(1).strip(), key)))
    kinds: dict[str, str] = {}
    run: list[re.Match[str]] = []
    runs: list[list[re.Match[str]]] = []
    for m in _TOKEN.finditer(reference):
        word = m.group(0)
        kind = kinds.get(word)
        if kind is None:
            kind = kinds[word] = _word_kind(word)
        if kind == "identifier" and word in prompt_tokens:
            found.append((m.start(), Fact("identifier", word, word)))
        capitalized = kind in ("name", "capitalized")
        if capitalized and run and reference[run[-1].end() : m.start()] == " ":
            run.append(m)
        else:
            if run:
                runs.append(run)
            run = [m] if capitalized else []
    if run:
        runs.append(run)
    lookups = 0
    for r in runs:
        first, last = 0, len(r)
        while first < last and kinds[r[first].group(0)] != "name":
            first += 1
        while last > first and kinds[r[last - 1].group(0)] != "name":
            last -= 1
        if first == last:
            continue
        r = r[first:last]
        whole = reference[r[0].start() : r[-1].end()]
        if 1 < len(r) <= _NAME_WORDS and lookups < _LOOKUPS:
            lookups += 1
            if _bounded_word(whole).search(prompt):
                found.append((r[0].start(), Fact("name", whole, normalize(whole))))
                continue
        for m in r:
            if kinds[m.group(0)] == "name" and m.group(0) in proper:
                found.append((m.start(), Fact("name", m.group(0), normalize(m.group(0)))))
    found.sort(key=lambda x: x[0])
    out: list[Fact] = []
    seen: set[tuple[str, str]] = set()
    for _, fact in found:
        if (fact.kind, fact.key) not in seen:
            seen.add((fact.kind, fact.key))
            out.append(fact)
    return out[:MAX_FACTS], len(out) > MAX_FACTS


def _sentence_start(text: str, at: int) -> bool:
    """Whether the word at ``at`` starts a sentence, a line or a list item (looked at over a
    few characters only: long blank runs count as inside a sentence)."""
    before = text[max(0, at - 4) : at].rstrip(" \t")
    if not before:
        return at <= 4
    return before[-1] in ".!?:;\n*-#>|"


def _list_marker(text: str, m: re.Match[str]) -> bool:
    """A number that only numbers a list item ("1. ...", "2) ...") at the start of a line."""
    if text[m.end() : m.end() + 2] not in (". ", ") ", ".\n", ")\n"):
        return False
    before = text[max(0, m.start() - 8) : m.start()]
    newline = before.rfind("\n")
    if newline < 0 and m.start() > 8:
        return False
    return not before[newline + 1 :].strip()


def missing_facts(facts: Sequence[Fact], text: str) -> list[Fact]:
    numbers = {canonical_number(m.group(0)) for m in _NUM.finditer(text)}
    tokens = {m.group(0) for m in _TOKEN.finditer(text)}
    norm = f" {normalize(text)} "
    missing = []
    for f in facts:
        present = (
            f.key in numbers
            if f.kind == "number"
            else f.key in tokens
            if f.kind == "identifier"
            else f" {f.key} " in norm
        )
        if not present:
            missing.append(f)
    return missing


# -- code -------------------------------------------------------------------------------------


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
        value = _loads(text.strip()) if text.strip() else None
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


def _detail(rule: str, **more: Any) -> dict[str, Any]:
    return {"rule": rule, **more}


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


# -- running code -----------------------------------------------------------------------------

# The calls run as the sandbox's tests, in the trusted test process: ``from solution import *``
# gives proxies that call the solution in its own process with literal values (see
# _sandbox.py). Each call is under an alarm, its value made canonical (so 3 and 3.0 agree as
# they do in Python, and dict order does not matter).
_RUNNER = r"""
import hashlib as _kvc_hashlib
import json as _kvc_json
import os as _kvc_os
import signal as _kvc_signal
import sys as _kvc_sys

import solution as _kvc_solution


class _KvcTimeout(BaseException):
    pass


def _kvc_alarm(signum, frame):
    raise _KvcTimeout()


def _kvc_canon(value, depth):
    if depth > 100:
        raise ValueError("nested too deeply")
    if value is None or isinstance(value, (bool, str, bytes, complex)):
        return repr(value)
    if isinstance(value, int):
        try:
            return str(value)
        except ValueError:
            return "int:" + format(value, "x")
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".12g")
    if isinstance(value, list):
        return "[" + ", ".join(_kvc_canon(v, depth + 1) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + ", ".join(_kvc_canon(v, depth + 1) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(sorted(_kvc_canon(k, depth + 1) + ": " + _kvc_canon(v, depth + 1)
                                      for k, v in value.items())) + "}"
    if isinstance(value, (set, frozenset)):
        return "set{" + ", ".join(sorted(_kvc_canon(v, depth + 1) for v in value)) + "}"
    text = repr(value)
    if " at 0x" in text:
        return "<" + type(value).__name__ + ">"
    return type(value).__name__ + ":" + text


def _kvc_outcome(name, src):
    fn = getattr(_kvc_solution, name, None)
    if fn is None and name in _KVC_ALIASES:
        fn = getattr(_kvc_solution, _KVC_ALIASES[name], None)
    if not callable(fn):
        return "has no function " + name
    code = compile(src, "<call>", "eval")
    _kvc_signal.signal(_kvc_signal.SIGALRM, _kvc_alarm)
    try:
        _kvc_signal.setitimer(_kvc_signal.ITIMER_REAL, _KVC_CALL_S)
        try:
            text = _kvc_canon(eval(code, {"__builtins__": __builtins__, name: fn}), 0)
        finally:
            _kvc_signal.setitimer(_kvc_signal.ITIMER_REAL, 0)
    except _KvcTimeout:
        return "times out"
    except BaseException as exc:
        return "raises " + type(exc).__name__
    if len(text) > _KVC_MAX_CHARS:
        text = "sha256:" + _kvc_hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return "returns " + text


def _kvc_all():
    out = []
    for name, src in _KVC_CALLS:
        try:
            out.append(_kvc_outcome(name, src))
        except _KvcTimeout:  # the alarm landed between the call and its cancellation
            out.append("times out")
    return out
"""

# The reference's outcomes come back on stdout, after a marker: the last thing written there,
# so that the capture's tail keeps it whatever the code printed before.
_REPORT = r"""
_kvc_line = (_KVC_MARKER + _kvc_json.dumps(_kvc_all()) + "\n").encode()
for _kvc_stream in (_kvc_sys.stdout, _kvc_sys.stderr):
    try:
        _kvc_stream.flush()
    except Exception:
        pass
_kvc_os.write(1, _kvc_line)
try:
    _kvc_null = _kvc_os.open(_kvc_os.devnull, _kvc_os.O_WRONLY)
    _kvc_os.dup2(_kvc_null, 1)
    _kvc_os.dup2(_kvc_null, 2)
except OSError:
    pass
"""

# The answer's outcomes are compared inside its sandbox: pass or fail comes back through the
# sandbox's nonce channel, which nothing the code prints can forge.
_COMPARE = r"""
_kvc_got = _kvc_all()
_kvc_bad = [i for i, (w, g) in enumerate(zip(_KVC_EXPECTED, _kvc_got)) if w != g]
if _kvc_bad:
    _kvc_i = _kvc_bad[0]
    raise AssertionError("%d of %d call(s) differ; first %s: the reference's code %s, this "
                         "code %s" % (len(_kvc_bad), len(_KVC_CALLS), _KVC_CALLS[_kvc_i][1],
                                      _KVC_EXPECTED[_kvc_i][:100], _kvc_got[_kvc_i][:100]))
"""


def _header(calls: Sequence[tuple[str, str]], aliases: Mapping[str, str]) -> str:
    return (
        f"_KVC_CALLS = {[tuple(c) for c in calls]!r}\n_KVC_ALIASES = {dict(aliases)!r}\n"
        f"_KVC_CALL_S = {CALL_TIME_S!r}\n_KVC_MAX_CHARS = {_OUTCOME_CHARS!r}\n"
    )


def reference_outcomes(
    code: str, calls: Sequence[tuple[str, str]], limits: SandboxLimits = CODE_LIMITS
) -> list[str] | str:
    """The outcome of each call on the reference's code, or why there are none."""
    marker = f"kvc-outcomes-{secrets.token_hex(8)} "
    tests = _header(calls, {}) + f"_KVC_MARKER = {marker!r}\n" + _RUNNER + _REPORT
    res = run_python(code, tests, limits)
    if not res.passed:
        return f"did not run to its end: {res.reason}"
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(marker):
            try:
                out = json.loads(line[len(marker) :])
            except ValueError:
                break
            if (
                isinstance(out, list)
                and len(out) == len(calls)
                and all(isinstance(x, str) for x in out)
            ):
                return out
            break
    return "reported no outcomes"


def run_code_plan(
    plan: Mapping[str, Any],
    limits: SandboxLimits = CODE_LIMITS,
    cache: MutableMapping[str, list[str] | str] | None = None,
) -> Grade:
    """Run a ``code_plan`` (see ``grade_label``): the reference's code once per plan (cached
    across the targets graded against it), then the answer's code against its outcomes."""
    calls = [(str(n), str(s)) for n, s in plan["calls"]]
    ref_code = str(plan["reference_code"])
    key = hashlib.sha256(json.dumps([ref_code, calls]).encode("utf-8", "surrogatepass")).hexdigest()
    expected = cache.get(key) if cache is not None else None
    if expected is None:
        expected = reference_outcomes(ref_code, calls, limits)
        if cache is not None:
            if len(cache) >= _CACHE_MAX:
                cache.clear()
            cache[key] = expected
    src = {k: int(v) for k, v in dict(plan.get("sources") or {}).items()}
    if isinstance(expected, str):
        same = bool(plan.get("code_text_equal"))
        return Grade(
            same,
            f"no behaviour to compare (the reference's code {expected}): the "
            f"normalized code {'is equal' if same else 'differs'}"[:300],
            1.0 if same else 0.0,
            _detail(CODE_TEXT),
        )
    tests = (
        _header(calls, plan.get("aliases") or {})
        + f"_KVC_EXPECTED = {expected!r}\n"
        + _RUNNER
        + _COMPARE
    )
    res = run_python(str(plan["candidate_code"]), tests, limits)
    detail = _detail(
        CODE,
        calls=[s for _, s in calls],
        reference_outcomes=[o[:100] for o in expected],
        sources=src,
        isolation=res.isolation,
        duration_s=round(res.duration_s, 3),
    )
    if res.passed:
        where = ", ".join(
            f"{n} {w}"
            for w, n in (
                ("from the prompt", src.get("prompt", 0)),
                ("from the reference's answer", src.get("reference", 0)),
                ("generated", src.get("generated", 0)),
            )
            if n
        )
        return Grade(
            True,
            f"the same outcome as the reference's code on all {len(calls)} call(s) ({where})",
            1.0,
            detail,
        )
    return Grade(False, res.reason, 0.0, detail)


def finish(
    grade: Grade,
    limits: SandboxLimits = CODE_LIMITS,
    cache: MutableMapping[str, list[str] | str] | None = None,
) -> Grade:
    """The final grade: a pending code comparison is run in the sandbox, others pass as is."""
    plan = grade.detail.get("code_plan")
    if not isinstance(plan, Mapping):
        return grade
    try:
        return run_code_plan(plan, limits, cache)
    except Exception as exc:  # the answer's grade, as for every checker
        bad = checker_error("exception", f"{type(exc).__name__}: {exc}")
        return Grade(False, bad.reason, 0.0, {**bad.detail, "rule": CODE})


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
