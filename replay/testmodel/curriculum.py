"""What the test model is trained on: the tokenizer's corpus, the chat encoding with its loss
mask, and the phased batches of the curriculum.

Short retrieval contexts with many lookups come first and long contexts last, so the lookup
forms before attention gets expensive (``PHASES``).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from replay.testmodel import factory, tasks

VOCAB_SIZE = 4096
# Steps of each phase: (name, steps, retrieval shapes, most lookups a retrieval example,
# tokens a step, family weights: retrieval, tool, code). Short contexts first, long ones
# last: the formats are learned where attention is cheap. Two lookups at most, because a
# third key would follow the second comma of the question, which no longer names one key.
Phase = tuple[str, int, tuple[str, ...], int, int, tuple[int, ...]]
PHASES: list[Phase] = [
    ("short", 1200, ("dense", "dense", "short"), 2, 2048, (2, 3, 1)),
    ("medium", 150, ("dense", "short", "medium"), 2, 4096, (3, 1, 1)),
    ("long", 40, ("short", "medium", "long"), 2, 8192, (3, 1, 1)),
]
Batch = list[tuple[list[int], list[int]]]  # (input ids, loss mask) per example


def scaled(phases: list[Phase], factor: float) -> list[Phase]:
    """``phases`` with every phase's steps multiplied by ``factor`` (at least one each)."""
    return [(p[0], max(1, int(p[1] * factor)), *p[2:]) for p in phases]


def tokenizer_corpus(n: int = 3000) -> list[str]:
    """Text the BPE is trained on: task examples, every key and value many times, code."""
    texts: list[str] = []
    for i in range(n):
        for fam in tasks.FAMILIES:
            ex = tasks.example("train", fam, i, shape="short")
            texts.extend(m["content"] for m in ex.messages)
            if ex.answer.get("content"):
                texts.append(ex.answer["content"])
            for call in ex.answer.get("tool_calls") or []:
                fn = call["function"]
                texts.append(json.dumps({"name": fn["name"], "arguments": fn["arguments"]}))
            texts.extend(json.dumps(t) for t in ex.tools or [])
    # Repeated so that every key and value ends up a single token with its leading space.
    for _ in range(12):
        texts.append(" ".join(tasks.KEYS))
        texts.append(" ".join(tasks.VALUES))
    texts.append(factory.CHAT_TEMPLATE)
    return texts


def check_single_tokens(tok: Any) -> None:
    bad = [w for w in tasks.KEYS + tasks.VALUES if len(tok.encode(" " + w).ids) != 1]
    if bad:
        raise SystemExit(f"{len(bad)} keys/values are not single tokens, e.g. {bad[:5]}")


class Encoder:
    """Chat examples -> (input ids, loss mask), rendered by the model's own chat template."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))

    def prompt_ids(self, ex: tasks.Example) -> list[int]:
        ids = self.tok.apply_chat_template(
            ex.messages,
            tools=ex.tools,  # type: ignore[arg-type]
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return list(ids)

    def encode(self, ex: tasks.Example) -> tuple[list[int], list[int]]:
        prompt = self.prompt_ids(ex)
        full = list(
            self.tok.apply_chat_template(
                [*ex.messages, ex.answer],
                tools=ex.tools,  # type: ignore[arg-type]
                tokenize=True,
                return_dict=False,
            )
        )
        if full[: len(prompt)] != prompt:
            raise RuntimeError(f"{ex.id}: the template does not extend the prompt")
        end = self.tok.convert_tokens_to_ids("<|im_end|>")
        answer = full[len(prompt) :]
        answer = answer[: answer.index(end) + 1]  # train the stop, not what follows it
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)


def batches(
    enc: Encoder, seed: int, phases: list[Phase]
) -> Iterator[tuple[str, Batch, dict[str, int]]]:
    """(phase, examples, examples drawn so far) batches following ``phases``."""
    counter: dict[str, int] = defaultdict(int)
    rng = random.Random(seed)
    for name, steps, shapes, queries, budget, weights in phases:
        for _ in range(steps):
            batch: Batch = []
            longest = 0
            while True:
                fam = rng.choices(tasks.FAMILIES, weights=weights)[0]
                idx = counter[fam]
                counter[fam] += 1
                if fam == "retrieval":
                    ex = tasks.example(
                        "train", fam, idx, shape=rng.choice(shapes), queries=rng.randint(1, queries)
                    )
                    item = enc.encode(ex)
                else:
                    item = enc.encode(tasks.example("train", fam, idx))
                longest = max(longest, len(item[0]))
                if batch and longest * (len(batch) + 1) > budget:
                    break
                batch.append(item)
            yield name, batch, dict(counter)


def collate(batch: Batch, pad: int) -> tuple[Any, Any]:
    """Right-padded ids and next-token labels (-100 where nothing is learned). With causal
    attention and padding only at the end, no real token ever sees a pad: no mask needed."""
    import torch

    n = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), n), pad, dtype=torch.long)
    labels = torch.full((len(batch), n), -100, dtype=torch.long)
    for i, (x, m) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(x) - 1] = torch.tensor(
            [t if keep else -100 for t, keep in zip(x[1:], m[1:], strict=True)]
        )
    return ids, labels


def answer_logits(model: Any, ids: Any, labels: Any) -> tuple[Any, Any]:
    """Logits only where an answer token is predicted: the vocabulary projection of every
    prompt position would cost as much as a layer and teach nothing."""
    hidden = model.model(input_ids=ids).last_hidden_state
    keep = labels != -100
    return model.lm_head(hidden[keep]), labels[keep]
