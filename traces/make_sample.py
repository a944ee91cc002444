"""Writes traces/sample.jsonl: a small, deterministic trace across three context buckets
(<256, 256-1K, >=1K tokens on the embedded test model), chat and completions, some with tools.

    python traces/make_sample.py > traces/sample.jsonl
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


def main() -> None:
    rng = random.Random(7)
    records = []
    for size, n_passages in (("short", 2), ("medium", 25), ("long", 80)):
        for k in range(4):
            ctx = passages(rng, n_passages)
            records.append({"id": f"chat-{size}-{k}", "api": "chat", "task": "retrieval",
                            "messages": [{"role": "system", "content": "Answer from the passages."},
                                         {"role": "user", "content": f"{ctx}\nWhich passage "
                                          f"names the {rng.choice(WORDS)} code?"}],
                            "max_tokens": 24, "meta": {"bucket_hint": size}})
        records.append({"id": f"tool-{size}", "api": "chat", "task": "tool",
                        "messages": [{"role": "user", "content": passages(rng, n_passages)
                                      + "\nWhat is the weather in " + rng.choice(WORDS) + "?"}],
                        "tools": [WEATHER_TOOL], "tool_choice": "auto", "max_tokens": 24})
        records.append({"id": f"completion-{size}", "api": "completions", "task": "chat",
                        "prompt": passages(rng, n_passages) + "\nSummary:", "max_tokens": 24})
        records.append({"id": f"ids-{size}", "api": "completions", "task": "perf",
                        "synth": {"input_tokens": {"short": 100, "medium": 600, "long": 1500}[size],
                                  "hash_ids": [1, 2, 3], "block_tokens": 64},
                        "max_tokens": 24, "params": {"ignore_eos": True}})
    for i, r in enumerate(records):
        r["t"] = round(i * 0.25, 2)
        print(json.dumps(r))


if __name__ == "__main__":
    main()
