"""Writes traces/sample.jsonl: a small, deterministic, graded trace across three context
buckets (<256, 256-1K, >=1K tokens on the embedded test model): chat and completions, tools,
and a checker of every kind (retrieval, tool_call, code, json_schema, number, exact, regex,
contains).

    python traces/make_sample.py > /tmp/sample.jsonl
    replay trace anonymize /tmp/sample.jsonl -o traces/sample.jsonl --secret-env SECRET

(the content is synthetic: anonymize finds nothing and only adds its "scanned" marker)
"""

from __future__ import annotations

import json
import random

WORDS = ("river stone cloud ember forest harbor lantern meadow orbit pepper quartz saddle "
         "timber velvet willow anchor bridge cobalt falcon garnet hollow island jasper kernel "
         "ledger marble nectar oyster prism ridge summit tundra vector walnut zenith").split()

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}


def passages(rng: random.Random, n: int) -> str:
    out = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(12))
        out.append(f"[P{i}] The {rng.choice(WORDS)} code is {rng.randint(1000, 9999)}. {words}.")
    return "\n".join(out)


def chat(rid: str, ctx: str, question: str, check: dict, task: str, **extra: object) -> dict:
    return {"id": rid, "api": "chat", "task": task, "max_tokens": 24, "check": check,
            "messages": [{"role": "system", "content": "Answer from the context."},
                         {"role": "user", "content": f"{ctx}\n{question}"}], **extra}


def records_for(size: str, n_passages: int, rng: random.Random) -> list[dict]:
    out = []
    for k in range(2):
        codes = [rng.randint(1000, 9999) for _ in range(n_passages)]
        ctx = "\n".join(f"[P{i}] The {WORDS[i % len(WORDS)]} code is {c}." for i, c in
                        enumerate(codes))
        i = rng.randrange(n_passages)
        out.append(chat(f"retrieval-{size}-{k}", ctx, f"Which passage names the "
                        f"{WORDS[i % len(WORDS)]} code, and what is it?",
                        {"type": "retrieval", "passage_ids": [f"P{i}"], "fact": str(codes[i])},
                        "retrieval"))
    ctx = passages(rng, n_passages)
    city = rng.choice(WORDS)
    out.append(chat(f"tool-{size}", ctx, f"What is the weather in {city} for 2 days?",
                    {"type": "tool_call", "calls": [{"name": "get_weather",
                                                     "arguments": {"city": city, "days": 2}}]},
                    "tool", tools=[WEATHER_TOOL], tool_choice="auto"))
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    out.append(chat(f"code-{size}", ctx, f"Write a Python function scale(x) returning x * {a} "
                    f"+ {b}.", {"type": "code", "tests": f"assert scale(3) == {3 * a + b}\n"
                                f"assert scale(0) == {b}\n"}, "code"))
    out.append(chat(f"json-{size}", ctx, "Reply with JSON: the first passage id and its colour.",
                    {"type": "json_schema", "schema": {
                        "type": "object", "required": ["id", "colour"],
                        "properties": {"id": {"type": "string"}, "colour": {"type": "string"}}}},
                    "json"))
    out.append(chat(f"number-{size}", ctx, f"What is {a} + {b * 10}?",
                    {"type": "number", "value": a + b * 10}, "chat"))
    out.append(chat(f"exact-{size}", ctx, "Answer with one word: is the sky blue?",
                    {"type": "exact", "value": "yes"}, "chat"))
    out.append(chat(f"regex-{size}", ctx, "Give a four-digit code from the passages.",
                    {"type": "regex", "pattern": r"\b\d{4}\b"}, "chat"))
    out.append({"id": f"completion-{size}", "api": "completions", "task": "chat",
                "prompt": ctx + "\nThe passages mention the word", "max_tokens": 24,
                "check": {"type": "contains", "values": WORDS[:5], "all": False}})
    out.append({"id": f"ids-{size}", "api": "completions", "task": "perf",
                "synth": {"input_tokens": {"short": 100, "medium": 600, "long": 1500}[size],
                          "hash_ids": [1, 2, 3], "block_tokens": 64},
                "max_tokens": 24, "params": {"ignore_eos": True}})
    return out


def main() -> None:
    rng = random.Random(7)
    records = []
    for size, n_passages in (("short", 2), ("medium", 25), ("long", 80)):
        records.extend(records_for(size, n_passages, rng))
    for i, r in enumerate(records):
        r["t"] = round(i * 0.25, 2)
        print(json.dumps(r))


if __name__ == "__main__":
    main()
