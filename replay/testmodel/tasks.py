"""The three task families the test model is trained on, and graded samples of them.

Every example is a chat request (messages, tools) plus the answer the model should give and the
checker spec that grades it, so the same generator feeds training, held-out evaluation and the
sample traces. Formats are chosen so that a 4-layer model can learn them on two CPU cores:

- retrieval: records ``- kelu 733 (P03) filler...`` and ``Find the value of kelu.``; the
  answer ``The value of kelu 733`` is two induction-head lookups at any distance: the key is
  what followed `` of`` (a word only the question uses), the value what followed the key. The
  passage id is in the records but not asked for: after ``(P`` every record continues
  differently, so copying it needs a lookup a 4-layer model does not learn in the budget.
- tool: a hermes-style ``<tool_call>`` whose arguments are copied from the question.
- code: a two-step function; the operation/constant combinations in ``heldout_code_combo``
  never appear in training, so passing them is composition, not memorization.

Training and held-out examples come from disjoint seed namespaces (``split``).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("retrieval", "tool", "code")

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
# Two-syllable pseudo-words: never English, so keys cannot collide with filler words.
KEYS = sorted(
    {
        c1 + v1 + c2 + v2
        for c1 in _CONSONANTS
        for v1 in _VOWELS
        for c2 in _CONSONANTS
        for v2 in _VOWELS
    },
)[::8]  # 4,900 / 8 = 613 keys, spread over the alphabet
VALUES = [str(n) for n in range(100, 1000)]

FILLER = (
    "the river runs past an old stone mill and the cloud hangs low over the forest "
    "while a lantern burns in the harbor window near the meadow where timber is stacked "
    "for winter and the moon is calm tonight above the quiet summit"
).split()

CITIES = (
    "Oslo Paris Lima Cairo Delhi Tokyo Quito Rome Dakar Perth Austin Boston Denver Dublin "
    "Geneva Hanoi Istanbul Jakarta Kyiv Lagos Madrid Manila Nairobi Osaka Porto Prague Riga "
    "Seoul Sofia Tunis Vienna Warsaw Zagreb Bogota Havana Kabul Lisbon Minsk Tallinn Vilnius"
).split()
CURRENCIES = "USD EUR GBP JPY CHF CAD AUD SEK NOK INR".split()
TOPICS = (
    "billing limits",
    "token quotas",
    "cache eviction",
    "rate limits",
    "login errors",
    "refund policy",
    "data export",
    "api keys",
    "batch jobs",
    "webhooks",
)
LABELS = "tea pasta laundry bread eggs rice oven study nap call".split()

TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": {
        "description": "Weather forecast for a city",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    },
    "convert_currency": {
        "description": "Convert an amount between currencies",
        "properties": {
            "amount": {"type": "integer"},
            "source": {"type": "string"},
            "target": {"type": "string"},
        },
        "required": ["amount", "source", "target"],
    },
    "set_timer": {
        "description": "Start a named kitchen timer",
        "properties": {"minutes": {"type": "integer"}, "label": {"type": "string"}},
        "required": ["minutes", "label"],
    },
    "search_docs": {
        "description": "Search the product documentation",
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query", "limit"],
    },
}

CODE_OPS = {
    "add": ("adds {c} to x", "y = x + {c}", "adds {c}", "y + {c}"),
    "sub": ("subtracts {c} from x", "y = x - {c}", "subtracts {c}", "y - {c}"),
    "mul": ("multiplies x by {c}", "y = x * {c}", "multiplies by {c}", "y * {c}"),
    "div": ("divides x by {c} (integer division)", "y = x // {c}", "divides by {c}", "y // {c}"),
}
CODE_NAMES = (
    "scale shift price score total offset level rate step count amount weight budget bonus index"
).split()


@dataclass(frozen=True)
class Example:
    """One request with the answer the model is trained to give and how it is graded."""

    id: str
    family: str
    messages: list[dict[str, Any]]
    answer: dict[str, Any]  # an assistant message: content, or tool_calls
    check: dict[str, Any]
    tools: list[dict[str, Any]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def rng_for(split: str, family: str, index: int) -> random.Random:
    """Training and held-out examples live in disjoint seed namespaces."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    digest = hashlib.sha256(f"{split}/{family}/{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _filler(rng: random.Random, n: int) -> str:
    start = rng.randrange(len(FILLER))
    return " ".join(FILLER[(start + i) % len(FILLER)] for i in range(n))


def retrieval(
    rng: random.Random, ex_id: str, records: int, filler: int, queries: int = 1, band: str = ""
) -> Example:
    """``records`` key/value lines with up to ``filler`` words each; ``queries`` lookups."""
    keys = rng.sample(KEYS, records)
    values = rng.sample(VALUES, records)
    pids = rng.sample(range(100), records) if records <= 100 else list(range(records))
    lines = []
    for k, v, p in zip(keys, values, pids, strict=True):
        words = rng.randint(0, filler) if filler else 0
        tail = f" {_filler(rng, words)}." if words else ""
        lines.append(f"- {k} {v} (P{p:02d}){tail}")
    asked = rng.sample(range(records), queries)
    names = ", ".join(keys[i] for i in asked)
    noun = "value" if queries == 1 else "values"
    user = "Records:\n" + "\n".join(lines) + f"\nFind the {noun} of {names}."
    # "The value of" mirrors the question, so the key is copied from after its " of".
    answer = f"The {noun} of " + ", ".join(f"{keys[i]} {values[i]}" for i in asked)
    return Example(
        id=ex_id,
        family="retrieval",
        messages=[{"role": "user", "content": user}],
        answer={"role": "assistant", "content": answer},
        check={"type": "retrieval", "fact": values[asked[0]]},
        meta={"records": records, "queries": queries, "band": band},
    )


def tool_schema(name: str) -> dict[str, Any]:
    spec = TOOLS[name]
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": spec["description"],
            "parameters": {
                "type": "object",
                "properties": spec["properties"],
                "required": spec["required"],
            },
        },
    }


def tool(rng: random.Random, ex_id: str) -> Example:
    """One tool call whose arguments are all stated in the question."""
    name = rng.choice(sorted(TOOLS))
    offered = sorted({*rng.sample(sorted(TOOLS), rng.randint(1, len(TOOLS))), name})
    rng.shuffle(offered)
    args: dict[str, Any]
    if name == "get_weather":
        args = {"city": rng.choice(CITIES), "days": rng.randint(1, 9)}
        q = rng.choice(
            [
                "What is the weather in {city} for the next {days} days?",
                "Weather forecast for {city}, {days} days please.",
                "Give me {days} days of weather for {city}.",
            ]
        )
    elif name == "convert_currency":
        src, dst = rng.sample(CURRENCIES, 2)
        args = {"amount": rng.randint(2, 999), "source": src, "target": dst}
        q = rng.choice(
            ["Convert {amount} {source} to {target}.", "How much is {amount} {source} in {target}?"]
        )
    elif name == "set_timer":
        args = {"minutes": rng.randint(1, 59), "label": rng.choice(LABELS)}
        q = rng.choice(
            [
                "Set a timer for {minutes} minutes called {label}.",
                "Start a {label} timer of {minutes} minutes.",
            ]
        )
    else:
        args = {"query": rng.choice(TOPICS), "limit": rng.randint(1, 9)}
        q = rng.choice(
            [
                "Search the docs for {query}, top {limit} results.",
                "Find {limit} documentation pages about {query}.",
            ]
        )
    call = {"type": "function", "function": {"name": name, "arguments": args}}
    return Example(
        id=ex_id,
        family="tool",
        messages=[{"role": "user", "content": q.format(**args)}],
        answer={"role": "assistant", "content": None, "tool_calls": [call]},
        check={"type": "tool_call", "calls": [{"name": name, "arguments": args}]},
        tools=[tool_schema(n) for n in offered],
    )


def heldout_code_combo(op1: str, c1: int, op2: str, c2: int) -> bool:
    """About one combination in seven is never trained on."""
    digest = hashlib.sha256(f"{op1}{c1}{op2}{c2}".encode()).digest()
    return digest[0] % 7 == 0


def _apply(op: str, x: int, c: int) -> int:
    return {"add": x + c, "sub": x - c, "mul": x * c, "div": x // c}[op]


def code(rng: random.Random, ex_id: str, *, heldout: bool) -> Example:
    """A two-step integer function; held-out examples use only held-out combinations."""
    while True:
        op1, op2 = rng.choice(sorted(CODE_OPS)), rng.choice(sorted(CODE_OPS))
        c1, c2 = rng.randint(2, 9), rng.randint(2, 9)
        if heldout_code_combo(op1, c1, op2, c2) == heldout:
            break
    name = f"{rng.choice(CODE_NAMES)}_{rng.choice(CODE_NAMES)}"
    d1, s1, d2, s2 = CODE_OPS[op1][0], CODE_OPS[op1][1], CODE_OPS[op2][2], CODE_OPS[op2][3]
    user = (
        f"Write a Python function {name}(x) that {d1.format(c=c1)}, "
        f"then {d2.format(c=c2)}, and returns the result."
    )
    body = f"def {name}(x):\n    {s1.format(c=c1)}\n    return {s2.format(c=c2)}\n"
    tests = "".join(
        f"assert {name}({x}) == {_apply(op2, _apply(op1, x, c1), c2)}\n" for x in (0, 3, 10, 17, -5)
    )
    return Example(
        id=ex_id,
        family="code",
        messages=[{"role": "user", "content": user}],
        answer={"role": "assistant", "content": f"```python\n{body}```"},
        check={"type": "code", "tests": tests},
        meta={"combo": [op1, c1, op2, c2]},
    )


# Retrieval length bands are set by record count and filler: about 8 tokens a record with
# no filler, about 25 with up to 30 filler words. "dense" is for training only: many lookups
# in a short context, so the lookup gets many gradient signals per token of attention.
# shape: ((fewest records, most records), most filler words a record)
RETRIEVAL_SHAPES: dict[str, tuple[tuple[int, int], int]] = {
    "dense": ((4, 16), 0),
    "short": ((4, 14), 6),
    "medium": ((20, 45), 22),
    "long": ((50, 62), 30),
}


def example(
    split: str, family: str, index: int, *, shape: str | None = None, queries: int = 1
) -> Example:
    """The ``index``-th example of a family in a split, deterministic."""
    rng = rng_for(split, family, index)
    ex_id = f"{split}-{family}-{index}"
    if family == "retrieval":
        shape = shape or rng.choice(sorted(set(RETRIEVAL_SHAPES) - {"dense"}))
        (lo, hi), filler = RETRIEVAL_SHAPES[shape]
        records = rng.randint(lo, hi)
        return retrieval(rng, ex_id, records, filler, queries=min(queries, records), band=shape)
    if family == "tool":
        return tool(rng, ex_id)
    if family == "code":
        return code(rng, ex_id, heldout=split == "heldout")
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


BANDS = ("short", "medium", "long")  # retrieval prompts: <256, 256-1K, >=1K tokens


def heldout_set(per_band: int, offset: int = 0) -> list[Example]:
    """The evaluation set: ``per_band`` retrieval examples in each length band, and as many
    tool and code examples. ``offset`` draws a different, still held-out, set."""
    out = []
    for b, band in enumerate(BANDS):
        out += [
            example("heldout", "retrieval", offset + 100_000 * b + i, shape=band)
            for i in range(per_band)
        ]
    for fam in ("tool", "code"):
        out += [example("heldout", fam, offset + i) for i in range(per_band)]
    return out


def trace_record(ex: Example, t: float | None = None) -> dict[str, Any]:
    """A trace v1 record for a held-out example (the answer is not part of the request)."""
    rec: dict[str, Any] = {
        "id": ex.id,
        "api": "chat",
        "task": ex.family,
        "max_tokens": 64 if ex.family != "retrieval" else 24,
        "messages": ex.messages,
        "check": ex.check,
    }
    if ex.tools:
        rec["tools"] = ex.tools
        rec["tool_choice"] = "auto"
    if t is not None:
        rec["t"] = t
    return rec
