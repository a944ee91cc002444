"""The committed long-context traces (traces/long.jsonl, traces/long_tests.jsonl, written by
traces/make_long.py) as a replay reads them: every line valid, ids unique, every kind in each
bucket of ``--buckets 2K,8K,16K``, the tests' trace a strict subset of the kinds and none of
the benchmark's ids, every planted answer in its prompt where ``meta`` says, and every check
passing the planted answer and failing a wrong one. No server, no torch; the token counts are
checked on the long model's tokenizer only where ``replay model --long`` has built it."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from replay.checkers import parse_check
from replay.checkers.base import Answer
from replay.core.buckets import Buckets
from replay.tools.anonymize import is_scanned
from replay.traces.importers import load
from replay.traces.trace import Request

ROOT = Path(__file__).resolve().parents[3]
LONG = ROOT / "traces" / "long.jsonl"
TESTS = ROOT / "traces" / "long_tests.jsonl"
BENCH_BUCKETS = Buckets.parse("2K,8K,16K")
TESTS_BUCKETS = Buckets.parse("1K")
KINDS = {"single", "multi", "multihop", "aggregate", "summary"}
LABELED = KINDS - {"summary"}
CONTEXT = 32_768


@pytest.fixture(scope="module")
def long() -> list[Request]:
    return load(LONG, "v1").requests  # a bad line or a repeated id raises


@pytest.fixture(scope="module")
def tests() -> list[Request]:
    return load(TESTS, "v1").requests


def test_both_anonymized() -> None:
    assert is_scanned(LONG)
    assert is_scanned(TESTS)


def test_ids_unique_and_self_describing(long: list[Request], tests: list[Request]) -> None:
    for reqs, prefix in ((long, "long-"), (tests, "longtest-")):
        ids = [r.id for r in reqs]
        assert len(ids) == len(set(ids))
        for r in reqs:
            assert r.id.startswith(prefix)
            assert r.id.endswith("-" + r.meta["kind"])
    assert not {r.id for r in long} & {r.id for r in tests}


def test_records_are_completions_that_fit_the_context(
    long: list[Request], tests: list[Request]
) -> None:
    for r in long + tests:
        assert r.api == "completions" and isinstance(r.prompt, str)
        assert r.input_tokens is not None
        assert r.input_tokens + r.max_tokens < CONTEXT
        assert r.meta["kind"] in KINDS
        assert r.meta["source"].startswith("pydoc_data.topics")


def test_long_has_every_kind_in_every_bucket(long: list[Request]) -> None:
    per_bucket = Counter[str]()
    kinds: dict[str, set[str]] = {}
    for r in long:
        assert r.input_tokens is not None
        label = BENCH_BUCKETS.label(r.input_tokens)
        assert r.meta["bucket"] == label
        per_bucket[label] += 1
        kinds.setdefault(label, set()).add(r.meta["kind"])
    assert set(per_bucket) == set(BENCH_BUCKETS.labels)
    assert min(per_bucket.values()) >= 24, per_bucket
    assert all(k == KINDS for k in kinds.values()), kinds


def test_tests_trace_is_small_and_a_strict_subset(
    long: list[Request], tests: list[Request]
) -> None:
    kinds = {r.meta["kind"] for r in tests}
    assert kinds < {r.meta["kind"] for r in long}
    assert not kinds & {"aggregate", "summary"}
    assert 10 <= len(tests) <= 16
    labels = Counter(TESTS_BUCKETS.label(r.input_tokens or 0) for r in tests)
    assert set(labels) == set(TESTS_BUCKETS.labels)
    assert all(r.meta["bucket"] == TESTS_BUCKETS.label(r.input_tokens or 0) for r in tests)
    assert max(r.input_tokens or 0 for r in tests) <= 4096


def test_planted_answers_are_where_meta_says(long: list[Request], tests: list[Request]) -> None:
    for r in long + tests:
        assert isinstance(r.prompt, str)
        kind, needles, answers = r.meta["kind"], r.meta["needles"], r.meta["answers"]
        if kind == "summary":
            assert r.check is None and not needles and not answers
            continue
        assert r.check is not None and r.task == "retrieval" and needles and answers
        for needle in needles:
            at = needle["offset"]
            assert r.prompt[at : at + len(needle["text"])] == needle["text"], r.id
            assert r.prompt[at - 2 : at] in ("\n\n", "") or at == 0  # a paragraph of its own
            assert 0.0 <= needle["depth"] <= 1.0
        text = r.prompt[: r.prompt.rindex("\n\nQuestion: ")]
        for answer in answers:
            word = re.compile(rf"\b{re.escape(answer)}\b")
            in_needles = sum(len(word.findall(n["text"])) for n in needles)
            assert in_needles >= 1, (r.id, answer)
            # nowhere else in the text: the answer can only come from what was planted
            assert len(word.findall(text)) == in_needles, (r.id, answer)
        assert r.prompt.rstrip().split("\n")[-1].startswith("Answer: ")


def ideal(kind: str, answers: list[str]) -> str:
    if kind == "multihop":
        return (
            f" {answers[0]} locker.\nThe access code for the {answers[0]} locker is {answers[1]}."
        )
    return " " + ", ".join(answers) + "."


def test_checks_pass_the_planted_answer_and_fail_a_wrong_one(
    long: list[Request], tests: list[Request]
) -> None:
    for r in long + tests:
        if r.check is None:
            continue
        checker = parse_check(r.check)
        answers = r.meta["answers"]
        assert checker.grade(Answer(ideal(r.meta["kind"], answers))).passed, r.id
        assert not checker.grade(Answer(" 00000 and nobody.")).passed, r.id
        if len(answers) > 1:  # every answer is needed, not one of them
            assert not checker.grade(Answer(ideal("single", answers[:-1]))).passed, r.id


def tokenizer_path() -> Path | None:
    from replay.testmodel.long import long_model_dir

    path = long_model_dir() / "tokenizer.json"
    return path if path.is_file() else None


@pytest.mark.skipif(tokenizer_path() is None, reason="the long model is not built here")
def test_input_tokens_are_the_servers_count(long: list[Request], tests: list[Request]) -> None:
    """What vLLM counts (``<bos>`` included), for the tests' trace and the shortest and the
    longest request of each of the benchmark's buckets (the ones a miscount would move)."""
    from tokenizers import Tokenizer

    path = tokenizer_path()
    assert path is not None
    tok = Tokenizer.from_file(str(path))
    picked = list(tests)
    for label in BENCH_BUCKETS.labels:
        inside = [r for r in long if r.meta["bucket"] == label]
        picked += [min(inside, key=lambda r: r.input_tokens or 0)]
        picked += [max(inside, key=lambda r: r.input_tokens or 0)]
    for r in picked:
        assert isinstance(r.prompt, str)
        ids = tok.encode(r.prompt).ids
        assert ids[0] == 2  # <bos>
        assert len(ids) == r.input_tokens, r.id
