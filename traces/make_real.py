"""Writes the real model's traces: unlabeled chat traffic over real text, as a gateway logs it.

The text is the Python standard library's own source (what every Python installation ships,
PSF license): modules' code and docstrings, cut to a token length drawn per request on
SmolLM2-135M-Instruct's tokenizer (``replay model --real``). Five kinds of request, none with a
``check`` (production traffic has no labels; the reference's answers grade them):

- ``doc``: a source excerpt of 0.8K-7.5K tokens and a question about one function in it;
- ``json``: a short excerpt and "list its functions as a JSON array";
- ``code``: "write a Python function that ..." (a fixed list of small tasks);
- ``summary``: a docstring and "summarize it in one sentence";
- ``session``: a two-turn conversation over an excerpt (the second turn carries the logged
  first answer, as a gateway's log does).

``--kinds`` picks some: the tests replay ``doc,json,code``; ``summary`` and ``session`` stay out
of them, so the README's figures (the whole trace) are not tuned to what the tests see.
``--oversize N`` adds N requests longer than the model's 8,192-token context (a replay records
them as not sent, never as the server's failure).

    python traces/make_real.py --requests 240 --oversize 1 > /tmp/real.jsonl
    replay trace anonymize /tmp/real.jsonl -o traces/real.jsonl --secret-env SECRET
    python traces/make_real.py --requests 24 --kinds doc,json,code --seed 1 --oversize 1 \
        --length-scale 0.3 --answer-scale 0.5 > /tmp/t.jsonl
    replay trace anonymize /tmp/t.jsonl -o traces/real_tests.jsonl --secret-env SECRET

Deterministic for a seed, a Python version (the text) and the tokenizer.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Modules whose source is plain, documented Python (stable across 3.11 patch releases).
MODULES = (
    "textwrap shlex fractions heapq bisect calendar colorsys difflib fnmatch glob gzip "
    "hashlib hmac imghdr ipaddress keyword linecache locale mimetypes netrc numbers "
    "operator optparse pathlib pprint queue quopri random reprlib sched secrets selectors "
    "shutil smtplib socketserver statistics string stringprep tabnanny tempfile "
    "threading timeit tokenize trace traceback tracemalloc uu uuid wave weakref "
    "zipapp zipfile argparse base64 bdb cmd code codeop configparser contextlib copy csv "
    "dataclasses datetime decimal dis enum filecmp fileinput ftplib functools getopt "
    "gettext graphlib inspect json/decoder json/encoder logging/handlers"
).split()

CODE_TASKS = (
    "returns the sum of the squares of a list of numbers",
    "returns True when a string is a palindrome, ignoring case",
    "returns the largest of three numbers",
    "counts the vowels in a string",
    "returns the factorial of n",
    "returns a list with the duplicates removed, keeping the first occurrence",
    "returns the n-th Fibonacci number",
    "reverses the words of a sentence",
    "returns the average of a list of numbers, or 0 for an empty list",
    "returns True when n is a prime number",
    "converts a temperature from Celsius to Fahrenheit",
    "returns the number of words in a string",
    "returns the second largest number in a list",
    "merges two sorted lists into one sorted list",
    "returns a dictionary counting how often each character occurs in a string",
    "returns the greatest common divisor of two integers",
    "capitalizes the first letter of every word in a string",
    "returns the list of even numbers in a list",
    "returns the sum of the digits of an integer",
    "returns True when two strings are anagrams of each other",
    "flattens a list of lists into one list",
    "returns the index of the smallest number in a list",
    "repeats a string n times separated by commas",
    "returns the product of all numbers in a list",
)

KIND_LENGTHS = {  # (min, max) prompt tokens of the text put in the prompt, drawn log-uniform
    "doc": (800, 7500),
    "json": (200, 1500),
    "summary": (120, 1200),
    "session": (400, 4000),
}
MAX_TOKENS = {"doc": 96, "json": 96, "code": 128, "summary": 64, "session": 64}
SYSTEM = "You are a helpful assistant. Answer briefly."


def stdlib_sources() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in MODULES:
        path = root / f"{name}.py"
        if path.is_file():
            out.append((name.replace("/", "."), path.read_text(encoding="utf-8")))
    return out


def functions(source: str) -> list[ast.FunctionDef]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]


def excerpt(tok: Any, source: str, start_line: int, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of ``source`` from ``start_line`` on; when the file ends
    first, lines before ``start_line`` are added until it is long enough (or whole)."""
    lines = source.splitlines()
    cost = [len(tok.encode(line + "\n", add_special_tokens=False)) for line in lines]
    lo = hi = min(start_line, len(lines))
    used = 0
    while hi < len(lines) and (used + cost[hi] <= n_tokens or hi == lo):
        used += cost[hi]
        hi += 1
    while lo > 0 and used + cost[lo - 1] <= n_tokens:
        lo -= 1
        used += cost[lo]
    return "\n".join(lines[lo:hi])


def log_line(rid: str, t: float, messages: list[dict[str, str]], max_tokens: int, **more: Any):
    row: dict[str, Any] = {
        "id": rid,
        "t": round(t, 3),
        "request": {"messages": messages, "max_tokens": max_tokens, "temperature": 0},
    }
    row.update(more)
    return row


def requests(
    tok: Any,
    n: int,
    kinds: list[str],
    seed: int,
    oversize: int,
    scale: float = 1.0,
    answer_scale: float = 1.0,
) -> Iterator[dict]:
    rng = random.Random(seed)
    sources = stdlib_sources()
    t, i, emitted = 0.0, 0, 0
    while emitted < n:  # a session's two turns count as two requests
        kind = kinds[i % len(kinds)]
        t += rng.expovariate(2.0)
        rid = f"real-{seed}-{i:04d}-{kind}"
        for row in _one(tok, rng, sources, kind, rid, t, scale):
            emitted += 1
            row["request"]["max_tokens"] = round(row["request"]["max_tokens"] * answer_scale)
            yield row
        i += 1
    for j in range(oversize):
        # The longest modules, cut to a prompt just past the 8,192-token context as the server
        # renders it (its chat template included).
        text = "\n".join(s[1] for s in sorted(sources, key=lambda s: -len(s[1]))[:3])
        want = 8300
        while True:
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{excerpt(tok, text, 0, want)}\n\nWhat does it do?"},
            ]
            n = len(
                tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
            )
            if n > 8300:
                break
            want += 200
        yield log_line(f"real-{seed}-oversize-{j}", t + j, messages, 64)


def _one(
    tok: Any,
    rng: random.Random,
    sources: list[tuple[str, str]],
    kind: str,
    rid: str,
    t: float,
    scale: float = 1.0,
) -> Iterator[dict]:
    if kind == "code":
        task = rng.choice(CODE_TASKS)
        ask = f"Write a Python function named `solve` that {task}. Reply with the code only."
        yield log_line(rid, t, [{"role": "user", "content": ask}], MAX_TOKENS[kind])
        return
    lo, hi = (int(x * scale) for x in KIND_LENGTHS[kind])
    # Log-uniform lengths: as many short prompts as long ones per factor of length.
    n_tokens = int(lo * (hi / lo) ** rng.random())
    # A source long enough for the length drawn, where there is one (about 3 chars a token).
    long_enough = [s for s in sources if len(s[1]) >= 3 * n_tokens] or sources
    while True:
        _, source = rng.choice(long_enough)
        defs = functions(source)
        if defs:
            break
    fn = rng.choice(defs)
    start = max(0, fn.lineno - 1 - rng.randint(0, 40))
    text = excerpt(tok, source, start, n_tokens)
    if kind == "doc":
        named = [d.name for d in defs if f"def {d.name}(" in text] or [fn.name]
        target = rng.choice(named)
        q = rng.choice(
            [
                f"What are the parameters of the function `{target}` in the code above?",
                f"What does the function `{target}` in the code above return?",
                f"Which module-level names does `{target}` use in the code above?",
            ]
        )
        msgs = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{text}\n\n{q}"},
        ]
        yield log_line(rid, t, msgs, MAX_TOKENS[kind])
    elif kind == "json":
        q = "List the names of the functions defined above as a JSON array of strings."
        yield log_line(rid, t, [{"role": "user", "content": f"{text}\n\n{q}"}], MAX_TOKENS[kind])
    elif kind == "summary":
        doc = ast.get_docstring(fn) or text
        doc = excerpt(tok, doc, 0, n_tokens)
        q = "Summarize the text above in one sentence."
        yield log_line(rid, t, [{"role": "user", "content": f"{doc}\n\n{q}"}], MAX_TOKENS[kind])
    else:  # session: two turns, the second carrying the logged first answer
        first = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{text}\n\nWhat does the function `{fn.name}` do?"},
        ]
        yield log_line(rid + "-t1", t, first, MAX_TOKENS[kind], session=rid)
        logged = (ast.get_docstring(fn) or f"It is the function {fn.name}.").split("\n")[0]
        second = [
            *first,
            {"role": "assistant", "content": logged},
            {"role": "user", "content": f"Give the name of `{fn.name}`'s first parameter."},
        ]
        yield log_line(rid + "-t2", t + 2.0, second, MAX_TOKENS[kind], session=rid)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--kinds", default="doc,json,code,summary,session")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--oversize", type=int, default=0)
    ap.add_argument("--length-scale", type=float, default=1.0, help="Scale every kind's lengths.")
    ap.add_argument(
        "--answer-scale", type=float, default=1.0, help="Scale every kind's max_tokens."
    )
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from replay.testmodel.real import ensure_real_model

    tok = AutoTokenizer.from_pretrained(str(ensure_real_model("traces/make_real.py")))
    kinds = [k for k in args.kinds.split(",") if k]
    rows = requests(
        tok, args.requests, kinds, args.seed, args.oversize, args.length_scale, args.answer_scale
    )
    for row in rows:
        sys.stdout.write(json.dumps(row, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
