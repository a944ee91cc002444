"""Writes traces/sample.jsonl: a small, deterministic, graded trace across three context
buckets (<256, 256-1K, >=1K tokens on the embedded test model): chat and completions, tools,
and a checker of every kind (retrieval, tool_call, code, json_schema, number, exact, regex,
contains). Retrieval, tool and code requests are held-out examples of the tasks the embedded
model was trained on (``replay.testmodel.tasks``), so they grade what a working model does; the
other kinds exercise their checkers on requests the model was not trained for.

    python traces/make_sample.py > /tmp/sample.jsonl
    replay trace anonymize /tmp/sample.jsonl -o traces/sample.jsonl --secret-env SECRET

``python traces/make_sample.py --first-run`` writes ``traces/first_run.jsonl``, the trace of the
README's first command: enough graded requests per bucket, of the tasks the embedded model
does, for the stop rule to decide, and unlabeled ones graded against the reference's answers.
``--first-run --scale K`` writes K times as many (the sequential canary's test uses K = 3).

``python traces/make_sample.py --heldout 30`` writes the evaluation trace instead
(``traces/testmodel_heldout.jsonl``: 30 retrieval requests per length band, 30 tool calls, 30
code tasks), the set the model's accuracy is measured on.

(the content is synthetic: anonymize finds nothing and only adds its "scanned" marker)
"""

from __future__ import annotations

import json
import random
import sys

from replay.testmodel import tasks

WORDS = (
    "river stone cloud ember forest harbor lantern meadow orbit pepper quartz saddle "
    "timber velvet willow anchor bridge cobalt falcon garnet hollow island jasper kernel "
    "ledger marble nectar oyster prism ridge summit tundra vector walnut zenith"
).split()


def passages(rng: random.Random, n: int) -> str:
    out = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(12))
        out.append(f"[P{i}] The {rng.choice(WORDS)} code is {rng.randint(1000, 9999)}. {words}.")
    return "\n".join(out)


def chat(rid: str, ctx: str, question: str, check: dict, task: str, **extra: object) -> dict:
    return {
        "id": rid,
        "api": "chat",
        "task": task,
        "max_tokens": 24,
        "check": check,
        "messages": [
            {"role": "system", "content": "Answer from the context."},
            {"role": "user", "content": f"{ctx}\n{question}"},
        ],
        **extra,
    }


def records_for(size: str, n_passages: int, rng: random.Random) -> list[dict]:
    band = {"short": 0, "medium": 1, "long": 2}[size]
    # Held-out indices far from the evaluation set's, so the two traces share no request.
    out = [
        tasks.trace_record(
            tasks.example("heldout", "retrieval", 500_000 + 10 * band + k, shape=size)
        )
        for k in range(2)
    ]
    out.append(tasks.trace_record(tasks.example("heldout", "tool", 500_000 + band)))
    out.append(tasks.trace_record(tasks.example("heldout", "code", 500_000 + band)))
    ctx = passages(rng, n_passages)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    out.append(
        chat(
            f"json-{size}",
            ctx,
            "Reply with JSON: the first passage id and its colour.",
            {
                "type": "json_schema",
                "schema": {
                    "type": "object",
                    "required": ["id", "colour"],
                    "properties": {"id": {"type": "string"}, "colour": {"type": "string"}},
                },
            },
            "json",
        )
    )
    out.append(
        chat(
            f"number-{size}",
            ctx,
            f"What is {a} + {b * 10}?",
            {"type": "number", "value": a + b * 10},
            "chat",
        )
    )
    out.append(
        chat(
            f"exact-{size}",
            ctx,
            "Answer with one word: is the sky blue?",
            {"type": "exact", "value": "yes"},
            "chat",
        )
    )
    out.append(
        chat(
            f"regex-{size}",
            ctx,
            "Give a four-digit code from the passages.",
            {"type": "regex", "pattern": r"\b\d{4}\b"},
            "chat",
        )
    )
    out.append(
        {
            "id": f"completion-{size}",
            "api": "completions",
            "task": "chat",
            "prompt": ctx + "\nThe passages mention the word",
            "max_tokens": 24,
            "check": {"type": "contains", "values": WORDS[:5], "all": False},
        }
    )
    out.append(
        {
            "id": f"ids-{size}",
            "api": "completions",
            "task": "perf",
            "synth": {
                "input_tokens": {"short": 100, "medium": 600, "long": 1500}[size],
                "hash_ids": [1, 2, 3],
                "block_tokens": 64,
            },
            "max_tokens": 24,
            "params": {"ignore_eos": True},
        }
    )
    return out


# The first-run trace: per context bucket enough labeled pairs for the stop rule to decide
# (with no discordant pair, (1 - 0.05)^n <= 0.05 needs n >= 59), all from the task families
# the embedded model does, plus unlabeled requests (no check, no task) that are graded against
# the reference's answers. Held-out seeds of their own, disjoint from the other traces.
FIRST_RUN_OFFSET = 200_000
# On the embedded tokenizer code and half the tool calls land in <256, the other half in 256-1K.
FIRST_RUN = {
    "retrieval-short": 20,
    "retrieval-medium": 48,
    "retrieval-long": 64,
    "tool": 32,
    "code": 28,
}
FIRST_RUN_UNLABELED = 6  # of each of the five kinds


def first_run(scale: int = 1) -> list[dict]:
    """The first-run trace; ``scale`` times as many requests of every kind (distinct held-out
    seeds: the first ``1 / scale`` of them are not those of scale 1) for a canary that needs
    more pairs than the fixed design, such as the sequential one."""
    records = []
    for kind, labeled in FIRST_RUN.items():
        family, _, band = kind.partition("-")
        labeled *= scale
        for i in range(labeled + scale * FIRST_RUN_UNLABELED):
            index = FIRST_RUN_OFFSET + 10_000 * list(FIRST_RUN).index(kind) + i
            ex = tasks.example("heldout", family, index, shape=band or None)
            rec = tasks.trace_record(ex)
            if i >= labeled:  # production traffic carries no labels
                del rec["check"], rec["task"]
                rec["id"] = f"unlabeled-{rec['id']}"
            records.append(rec)
    return records


def main() -> None:
    if sys.argv[1:2] == ["--heldout"]:
        for ex in tasks.heldout_set(int(sys.argv[2])):
            print(json.dumps(tasks.trace_record(ex)))
        return
    if sys.argv[1:2] == ["--first-run"]:
        scale = int(sys.argv[3]) if sys.argv[2:3] == ["--scale"] else 1
        for i, r in enumerate(first_run(scale)):
            r["t"] = round(i * 0.25, 2)
            print(json.dumps(r))
        return
    rng = random.Random(7)
    records = []
    for size, n_passages in (("short", 2), ("medium", 25), ("long", 80)):
        records.extend(records_for(size, n_passages, rng))
    for i, r in enumerate(records):
        r["t"] = round(i * 0.25, 2)
        print(json.dumps(r))


if __name__ == "__main__":
    main()
