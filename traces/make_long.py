"""Writes the long-context traces: facts planted in real text and asked back, at any depth.

The text is the Python language reference as the standard library ships it
(``pydoc_data.topics``: English prose and grammar, PSF license), its paragraphs taken in order
from a drawn one on, as many as a prompt length drawn per request (log-uniform in its bucket)
needs on the long model's tokenizer (Gemma 3 270M, ``replay model --long``; lengths count the
``<bos>`` it prepends, as the server does). The model is a base model, so every request is a
``completions`` prompt that ends with a cue the model completes (``Question: ...`` /
``Answer: The access code for Mira's locker is``). Five kinds; the first four plant sentences,
each a paragraph of its own at a drawn depth, and carry a ``check`` that grades at any depth:

- ``single``: one fact (``The access code for Mira's locker is 58213.``); ``contains`` it;
- ``multi``: two to four facts of one form about different people (distractors), one asked;
  ``number``: the first number of the answer is its value;
- ``multihop``: a chain (``Mira has the otter locker.`` ... ``The access code for the otter
  locker is 58213.``), maybe another person's locker; a worked example (about a person the
  text never names) answers in two hops, so the answer must name the locker and its code (a
  ``regex`` of both, as whole words);
- ``aggregate``: two to five people, each signing the guest book at a depth of their own;
  the question says how many, the answer must name them all (a ``regex`` of every name);
- ``summary``: nothing planted, no ``check`` (``In one sentence, the text above is about``):
  graded against the reference's own answer.

The wording is what the BF16 reference passes about half the time or more at 2K tokens
(traces/README.md has the figures). Asking for two facts at once is left out: over the wordings
tried, the reference passed it at 2K 5 times in 20 (the second answer a distractor's, or a
number made up), too rarely to tell a worse cache from the model. ``meta`` holds the kind, the
bucket, the planted sentences with their character offsets in the prompt and their depths
(fraction of the text before them), and the answers, each of which occurs in the text only
where it is planted.

    python traces/make_long.py > /tmp/long.jsonl
    replay trace anonymize /tmp/long.jsonl -o traces/long.jsonl --secret-env SECRET
    python traces/make_long.py --seed 1 --prefix longtest --buckets 1K --top 3K --bottom 300 \\
        --counts 6,6 --kinds single,multi,multihop > /tmp/long_tests.jsonl
    replay trace anonymize /tmp/long_tests.jsonl -o traces/long_tests.jsonl --secret-env SECRET

Replay them with ``--buckets 2K,8K,16K`` and ``--buckets 1K``. Deterministic for a seed, a Python
version (the text) and the tokenizer. Paragraphs in which the anonymizer finds anything are left
out, so anonymizing adds only its mark to ``meta``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

CONTEXT = 32_768  # the long model's context: prompt + max_tokens stay below it
MAX_PARAGRAPH = 600  # tokens: the few larger paragraphs (wide tables) are left out
KINDS = ("single", "multi", "multihop", "aggregate", "summary")
MAX_TOKENS = {"single": 12, "multi": 12, "multihop": 40, "aggregate": 40}
SUMMARY_TOKENS = 48

NAMES = (
    "Mira Tomas Anika Joren Lucia Bram Selin Odile Kasper Noor Ilse Rafael Yuki Dara Emeka "
    "Greta Hugo Ines Pavel Sanne Teodor Vera Wim Zofia Arjun Beatriz Cyrus Dunja Elif Farid "
    "Hana Ivo Jana Kofi Lotte Matteo Nadia Oskar Priya Rune"
).split()


@dataclass(frozen=True)
class Form:
    """A fact about a person: the sentence planted (it ends with the value) and the question
    that asks for it; the cue is the sentence up to its value."""

    fact: str
    question: str

    def ask(self, k: str) -> str:
        return self.question.format(k=k)

    def cue(self, k: str) -> str:
        return self.fact[: self.fact.index(" {v}")].format(k=k)


FORMS = (
    Form("The access code for {k}'s locker is {v}.", "What is the access code for {k}'s locker?"),
    Form("{k}'s membership number is {v}.", "What is {k}'s membership number?"),
    Form("The parcel for {k} is kept on shelf {v}.", "On which shelf is the parcel for {k} kept?"),
    Form(
        "The booking number of {k}'s train ticket is {v}.",
        "What is the booking number of {k}'s train ticket?",
    ),
)
EXAMPLE = "Karl"  # the worked example's person (never planted)
BRIDGES = "falcon otter badger heron walrus beaver magpie lynx bison gecko".split()
COUNTS = ("zero", "one", "two", "three", "four", "five")


@dataclass(frozen=True)
class Bucket:
    name: str  # id-safe: "lt2K", "2K-8K", ...
    label: str  # the replay's label: "<2K", "2K-8K", ">=16K"
    lo: int  # prompt tokens, inclusive
    hi: int  # exclusive


@dataclass
class Task:
    """What a kind plants and asks: sentences to plant, the prompt's end (a worked example
    where the kind has one, the question, the cue), the check and the answers."""

    plants: list[str]
    tail: str
    check: dict[str, Any] | None
    answers: list[str]
    task: str | None = "retrieval"


def buckets(spec: str, top: int, bottom: int) -> list[Bucket]:
    """The replay's buckets of ``--buckets spec`` (``replay.core.buckets``: ``<b0``, ``b0-b1``,
    ..., ``>=bn``), the first one starting at ``bottom`` tokens, the last one cut at ``top``."""
    from replay.core.buckets import Buckets

    parsed = Buckets.parse(spec)
    edges = [bottom, *parsed.bounds, top]
    out = []
    for label, (lo, hi) in zip(parsed.labels, itertools.pairwise(edges), strict=True):
        # id-safe names: "<2K" is "lt2K", ">=16K" (cut at 32K) is "16K-32K"
        name = label.replace("<", "lt").replace(">=", "")
        if label.startswith(">="):
            name += "-" + Buckets((top,)).spec()
        out.append(Bucket(name, label, lo, hi))
    return out


def paragraphs(tok: Any) -> tuple[list[str], list[int]]:
    """The language reference's paragraphs in topic order, and their token counts; those the
    anonymizer would change, and the largest, are left out."""
    from pydoc_data.topics import topics

    from replay.tools.anonymize import scan_text

    out, cost = [], []
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            para = para.strip("\n").rstrip()
            if not para.strip() or scan_text(para):
                continue
            n = len(tok.encode(para, add_special_tokens=False))
            if n <= MAX_PARAGRAPH:
                out.append(para)
                cost.append(n)
    return out, cost


def draw_number(rng: random.Random, used: set[str], digits: int = 5) -> str:
    while True:
        v = str(rng.randrange(10 ** (digits - 1), 10**digits))
        if v not in used:
            used.add(v)
            return v


def qa(question: str, answer: str) -> str:
    return f"Question: {question}\nAnswer: {answer}"


def task_for(kind: str, rng: random.Random) -> Task:
    used: set[str] = set()
    form = rng.choice(FORMS)
    if kind == "single":
        k, v = rng.choice(NAMES), draw_number(rng, used)
        check = {"type": "contains", "values": [v]}
        return Task([form.fact.format(k=k, v=v)], qa(form.ask(k), form.cue(k)), check, [v])
    if kind == "multi":
        return multi(rng, used, form)
    if kind == "multihop":
        return multihop(rng, used)
    if kind == "aggregate":
        return aggregate(rng)
    return Task([], "In one sentence, the text above is about", None, [], None)


def multi(rng: random.Random, used: set[str], form: Form) -> Task:
    """Two to four facts of one form about different people, one asked: the first number of
    the answer must be its value (a later one may be a distractor the model recites)."""
    people = rng.sample(NAMES, rng.randint(2, 4))
    values = [draw_number(rng, used) for _ in people]
    plants = [form.fact.format(k=k, v=v) for k, v in zip(people, values, strict=True)]
    i = rng.randrange(len(people))
    check = {"type": "number", "value": int(values[i]), "which": "first"}
    return Task(plants, qa(form.ask(people[i]), form.cue(people[i])), check, [values[i]])


def multihop(rng: random.Random, used: set[str]) -> Task:
    """A chain ``K has the B locker.`` / ``The access code for the B locker is V.``, and maybe
    another person with another locker (no code: a distractor for the first hop). A worked
    example shows the answer as two hops, each a question and its answer."""
    others = rng.randint(0, 1)
    lockers = rng.sample(BRIDGES, others + 2)  # the asked one, the others', the example's
    code, example_code = draw_number(rng, used), draw_number(rng, used)
    people = rng.sample(NAMES, others + 1)
    plants = [f"{k} has the {b} locker." for k, b in zip(people, lockers, strict=False)]
    plants.append(f"The access code for the {lockers[0]} locker is {code}.")
    x, bx = EXAMPLE, lockers[-1]
    shot = qa(f"What is the access code for {x}'s locker?", f"{x} has the {bx} locker.")
    shot += "\n" + qa(
        f"What is the access code for the {bx} locker?",
        f"The access code for the {bx} locker is {example_code}.",
    )
    ask = qa(f"What is the access code for {people[0]}'s locker?", f"{people[0]} has the")
    answers = [lockers[0], code]
    return Task(plants, f"{shot}\n\n{ask}", every_word(answers), answers)


def aggregate(rng: random.Random) -> Task:
    """Two to five people sign the guest book, each at a depth of their own; the question says
    how many and the answer must name them all."""
    people = rng.sample(NAMES, rng.randint(2, 5))
    plants = [f"The guest book was signed by {k}." for k in people]
    n = COUNTS[len(people)]
    ask = qa(f"Which {n} people signed the guest book?", f"The {n} people who signed it are")
    return Task(plants, ask, every_word(people), people)


def every_word(words: list[str]) -> dict[str, Any]:
    """A ``regex`` check: the answer holds every word, each as a whole word (``17`` is not
    the end of ``58217``, ``Ines`` not in ``lines``), in any order, any case."""
    ahead = "".join(f"(?=.*\\b{re.escape(w)}\\b)" for w in words)
    return {"type": "regex", "pattern": f"^{ahead}.*", "flags": "is"}


def build(
    paras: list[str], start: int, count: int, task: Task, depths: list[float]
) -> tuple[str, list[dict[str, Any]]]:
    """The prompt: ``count`` paragraphs from ``start`` on (wrapping), each planted sentence a
    paragraph of its own at its depth, then the task's tail; and where each planted sentence
    is (character offset in the prompt, depth: the fraction of the text before it)."""
    body = [paras[(start + i) % len(paras)] for i in range(count)]
    # (paragraph index, plant number), inserted from the last so the indexes hold
    slots = sorted((min(count, round(d * count)), n) for n, d in enumerate(depths))
    for at, n in reversed(slots):
        body.insert(at, f"\x00{n}")
    parts, where, pos = [], {}, 0
    for para in body:
        if para.startswith("\x00"):
            n = int(para[1:])
            para = task.plants[n]
            where[n] = pos
        parts.append(para)
        pos += len(para) + 2
    text = "\n\n".join(parts)
    needles = [
        {"text": plant, "offset": where[n], "depth": round(where[n] / len(text), 3)}
        for n, plant in enumerate(task.plants)
    ]
    return f"{text}\n\n{task.tail}", needles


def fit(
    tok: Any,
    paras: list[str],
    cost: list[int],
    rng: random.Random,
    task: Task,
    lo: int,
    hi: int,
) -> tuple[str, list[dict[str, Any]], int]:
    """A prompt of ``lo`` to ``hi`` - 1 tokens (with ``<bos>``), drawn log-uniform; the
    plants at drawn depths. Returns the prompt, the needles and its exact length."""
    want = math.exp(rng.uniform(math.log(lo * 1.02 + 50), math.log(hi * 0.98)))
    start = rng.randrange(len(paras))
    depths = [rng.random() for _ in task.plants]
    extra = sum(len(tok.encode(p, add_special_tokens=False)) + 2 for p in task.plants)
    extra += len(tok.encode(task.tail, add_special_tokens=False)) + 3
    count, used = 0, extra
    while used + cost[(start + count) % len(paras)] + 2 <= want:
        used += cost[(start + count) % len(paras)] + 2
        count += 1
    count = max(count, 1)
    for _ in range(50):
        prompt, needles = build(paras, start, count, task, depths)
        n = len(tok.encode(prompt))
        if n >= hi:
            count -= 1
        elif n < lo:
            count += 1
        else:
            return prompt, needles, n
    raise RuntimeError(f"no prompt of {lo}-{hi} tokens from paragraph {start}")


def requests(
    tok: Any,
    spans: list[Bucket],
    counts: list[int],
    kinds: list[str],
    seed: int,
    prefix: str,
) -> Iterator[dict[str, Any]]:
    rng = random.Random(seed)
    paras, cost = paragraphs(tok)
    version = ".".join(str(x) for x in sys.version_info[:3])
    for b, (span, n) in enumerate(zip(spans, counts, strict=True)):
        for i in range(n):
            kind = kinds[(i + b) % len(kinds)]
            task = task_for(kind, rng)
            max_tokens = MAX_TOKENS.get(kind, SUMMARY_TOKENS)
            hi = min(span.hi, CONTEXT - max_tokens)
            prompt, needles, n_tokens = fit(tok, paras, cost, rng, task, span.lo, hi)
            check_text(prompt, task)
            row: dict[str, Any] = {"id": f"{prefix}-{span.name}-{i:04d}-{kind}"}
            row.update(api="completions", prompt=prompt, max_tokens=max_tokens)
            if task.task is not None:
                row["task"] = task.task
            if task.check is not None:
                row["check"] = task.check
            row["input_tokens"] = n_tokens
            row["meta"] = {
                "kind": kind,
                "bucket": span.label,
                "source": f"pydoc_data.topics (Python {version})",
                "needles": needles,
                "answers": task.answers,
            }
            yield row


def check_text(prompt: str, task: Task) -> None:
    """The anonymizer finds nothing, and each answer occurs in the text (the prompt before its
    tail) only where it is planted: never by chance in the reference's own prose."""
    from replay.tools.anonymize import scan_text

    if scan_text(prompt):
        raise RuntimeError("the anonymizer would change a prompt: change the seed")
    text = prompt[: len(prompt) - len(task.tail)]
    for answer in task.answers:
        word = re.compile(rf"\b{re.escape(answer)}\b")
        if len(word.findall(text)) != sum(len(word.findall(p)) for p in task.plants):
            raise RuntimeError(f"{answer!r} occurs in the text by chance: change the seed")


def main(argv: list[str] | None = None, out: Callable[[str], Any] = sys.stdout.write) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--buckets", default="2K,8K,16K", help="The replay's --buckets bounds.")
    ap.add_argument("--top", default="32K", help="Upper bound of the last bucket.")
    ap.add_argument("--bottom", type=int, default=700, help="Shortest prompt, in tokens.")
    ap.add_argument("--counts", default="40,30,25,25", help="Requests per bucket.")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix", default="long", help="Start of every id.")
    args = ap.parse_args(argv)
    from replay.core.buckets import Buckets

    spans = buckets(args.buckets, Buckets.parse(args.top).bounds[0], args.bottom)
    counts = [int(c) for c in args.counts.split(",")]
    kinds = [k for k in args.kinds.split(",") if k]
    if len(counts) != len(spans) or not set(kinds) <= set(KINDS):
        ap.error(f"--counts needs {len(spans)} numbers; --kinds takes {', '.join(KINDS)}")
    from transformers import AutoTokenizer

    from replay.testmodel.long import ensure_long_model

    tok = AutoTokenizer.from_pretrained(str(ensure_long_model("traces/make_long.py")))
    for row in requests(tok, spans, counts, kinds, args.seed, args.prefix):
        out(json.dumps(row, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
