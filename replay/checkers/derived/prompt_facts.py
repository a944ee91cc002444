"""The facts of ``derived:facts``: what the reference's free-text answer copies from the prompt
(numbers, identifiers, quoted spans, names), and which of them an answer leaves out."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from replay.checkers.base import NUMBER, canonical_number, normalize
from replay.checkers.derived.values import _bounded_word

MAX_FACTS = 64
_QUOTE_CHARS = 200
_LOOKUPS = 400  # quoted spans, and capitalized runs, looked up in the prompt
_NAME_WORDS = 6  # a longer capitalized run is looked up word by word
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


def facts_of(reference: str, prompt: str) -> tuple[list[Fact], bool]:
    """The facts the reference's answer copies from the prompt, in the answer's order, and
    whether there were more than ``MAX_FACTS``."""
    if not prompt or not reference:
        return [], False
    seen_in = _Prompt(prompt)
    found: list[tuple[int, Fact]] = []
    for m in NUMBER.finditer(reference):
        key = canonical_number(m.group(0))
        if key in seen_in.numbers() and not _list_marker(reference, m):
            found.append((m.start(), Fact("number", m.group(0), key)))
    looked: dict[str, bool] = {}
    for pattern in _QUOTES:
        for m in pattern.finditer(reference):
            key = normalize(m.group(1))
            if key and key not in looked and len(looked) < _LOOKUPS:
                looked[key] = f" {key} " in seen_in.normalized()
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
        if kind == "identifier" and word in seen_in.tokens()[0]:
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
            if kinds[m.group(0)] == "name" and m.group(0) in seen_in.tokens()[1]:
                found.append((m.start(), Fact("name", m.group(0), normalize(m.group(0)))))
    found.sort(key=lambda x: x[0])
    out: list[Fact] = []
    seen: set[tuple[str, str]] = set()
    for _, fact in found:
        if (fact.kind, fact.key) not in seen:
            seen.add((fact.kind, fact.key))
            out.append(fact)
    return out[:MAX_FACTS], len(out) > MAX_FACTS


class _Prompt:
    """What the reference's candidates are looked up in, read off the prompt when first
    asked: a reference that holds no number, quote or word of a kind never reads the prompt
    for it (the prompt is often the longer text by far)."""

    def __init__(self, prompt: str) -> None:
        self.prompt = prompt
        self._numbers: set[str] | None = None
        self._normalized: str | None = None
        self._tokens: tuple[set[str], set[str]] | None = None

    def numbers(self) -> set[str]:
        if self._numbers is None:
            self._numbers = {canonical_number(m.group(0)) for m in NUMBER.finditer(self.prompt)}
        return self._numbers

    def normalized(self) -> str:
        if self._normalized is None:
            self._normalized = f" {normalize(self.prompt)} "
        return self._normalized

    def tokens(self) -> tuple[set[str], set[str]]:
        """The prompt's words, and those capitalized inside a sentence (a name there)."""
        if self._tokens is None:
            prompt, tokens, proper = self.prompt, set[str](), set[str]()
            for m in _TOKEN.finditer(prompt):
                word = m.group(0)
                tokens.add(word)
                upper = word[0].isupper() and word not in proper
                if upper and not _sentence_start(prompt, m.start()):
                    proper.add(word)
            self._tokens = tokens, proper
        return self._tokens


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
    numbers = {canonical_number(m.group(0)) for m in NUMBER.finditer(text)}
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
