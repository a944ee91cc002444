"""Hostile input, round 4: PII a scan or the anonymizer let through, and a checker pass that
StopIteration bought.

- ``trace scan`` reads every value of a line: a key a JSON object repeats hides a value from
  orjson and json alike (the last one wins), and another reader may take the first.
- The anonymizer joins what a line break split (an address after its ``@``, a key after its
  prefix) without joining ordinary text that runs onto the next line; reads ``00``-prefixed
  international phone numbers and internationalised addresses; takes a bare 40-character AWS
  secret key whole, and still leaves long identifiers, words and labelled digests alone.
- The code checker's sandbox does not let a StopIteration out of the solution end a ``map``
  early and make ``assert all(map(...))`` hold.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest
from click.testing import CliRunner

from replay.checkers.sandbox.run import run_python
from replay.cli import main
from replay.tools.anonymize import Anonymizer, anonymize_file, scan_file, scan_text

SECRET = b"round-4"
DUPLICATE_KEY = "duplicate_key"  # the finding's kind, as ``trace scan`` prints it


def scrub(text: str) -> str:
    return Anonymizer(SECRET).scrub_text(text)[0]


def found(text: str) -> list[tuple[str, str]]:
    """(kind, the text it covers) of each finding."""
    return [(f.kind, text[f.start : f.end]) for f in scan_text(text)]


# -- a repeated JSON key ------------------------------------------------------------------------

SHADOWED = (
    '{"messages": [{"role": "user", "content": "mail bob@example.com", "content": "benign"}], '
    '"max_tokens": 5}\n'
)


def test_scan_reads_the_value_a_repeated_key_hides_and_reports_the_key(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(SHADOWED)
    lines, findings = scan_file(path)
    assert lines == 1
    assert [(n, f.kind, f.field) for n, f in findings] == [
        (1, "email", "messages.0.content"),
        (1, DUPLICATE_KEY, "messages.0.content"),
    ]
    out = CliRunner().invoke(main, ["trace", "scan", str(path)])
    assert out.exit_code == 1
    assert f"{path}:1: duplicate_key in messages.0.content: 2 values" in out.output
    assert f"{path}:1: email in messages.0.content" in out.output


def test_a_repeated_key_without_pii_is_a_finding_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}], "meta": {"k": 1, "k": 1}}\n')
    _, findings = scan_file(path)
    assert [(n, f.kind, f.field, f.excerpt) for n, f in findings] == [
        (1, DUPLICATE_KEY, "meta.k", "2 values")
    ]
    assert CliRunner().invoke(main, ["trace", "scan", str(path)]).exit_code == 1


def test_a_repeated_key_in_tool_arguments_is_scanned_and_anonymized_away(tmp_path: Path) -> None:
    arguments = json.dumps({"q": "x"})[:-1] + ', "q": "call +44 20 7946 0958"}'
    record = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"function": {"name": "f", "arguments": arguments}}],
    }
    src, dst = tmp_path / "raw.jsonl", tmp_path / "clean.jsonl"
    src.write_text(json.dumps(record) + "\n")
    kinds = {(f.kind, f.field) for _, f in scan_file(src)[1]}
    assert kinds == {
        ("phone", "tools.0.function.arguments#q"),
        (DUPLICATE_KEY, "tools.0.function.arguments#q"),
    }
    anonymize_file(src, dst, SECRET)
    assert "7946" not in dst.read_text()
    assert scan_file(dst)[1] == []


def test_anonymize_output_of_a_repeated_key_scans_clean(tmp_path: Path) -> None:
    src, dst = tmp_path / "raw.jsonl", tmp_path / "clean.jsonl"
    src.write_text(SHADOWED)
    anonymize_file(src, dst, SECRET)
    assert json.loads(dst.read_text())["messages"][0]["content"] == "benign"
    assert scan_file(dst)[1] == []


# -- split across a line break ------------------------------------------------------------------

RNG = random.Random(42)
KEY_TAIL = "".join(RNG.choice(string.ascii_letters + string.digits) for _ in range(120))


@pytest.mark.parametrize("brk", ["\n", "\r\n", "\\n"])
def test_an_address_wrapped_after_its_at_is_one_address(brk: str) -> None:
    text = f"mail bob@exa{brk}mple.com please"
    assert scrub(text) == scrub("mail bob@example.com please")


@pytest.mark.parametrize("brk", ["\n", "\\n"])
def test_a_key_wrapped_after_its_prefix_is_one_key(brk: str) -> None:
    key = "sk-proj-abc" + KEY_TAIL
    # lines of 45 and 75 characters: two of 60-76 would read as a PEM body
    wrapped = f"sk-proj-abc{brk}{KEY_TAIL[:45]}{brk}{KEY_TAIL[45:]}"
    out = scrub(f"key {wrapped}\nThanks")
    assert out == scrub(f"key {key}\nThanks")
    assert KEY_TAIL[-20:] not in out and "abc" not in out


# Ordinary text running onto the next line: nothing is joined across the break.
BROKEN_ORDINARY = [
    ("Contact:\nbob@example.com", ["bob@example.com"]),
    ("write to\nbob@example.com today", ["bob@example.com"]),
    ("mail bob@example.com\nmore text follows", ["bob@example.com"]),
    ("thanks\n@alice.dev for the review", []),
    ("user@localhost\nand root@server are fine", []),
    ("The quick brown\nfox jumps over\nthe lazy dog.", []),
    ("see the docs at\nexample.com for more", []),
    ("Your key is sk-proj-abc123XYZ789\nUse it wisely.", ["sk-proj-abc123XYZ789"]),
    ("export OPENAI_API_KEY=sk-proj-abc123XYZ789\npython run.py", ["sk-proj-abc123XYZ789"]),
    ("sk-proj-abc123XYZ789\nPython3 and x86_64 builds", ["sk-proj-abc123XYZ789"]),
    ("the prefix sk-proj-\nfollowed by text", []),
    ("the prefix sk-proj-\nx86_64 build", []),
    # lists, one item a line: each its own
    ("bob@example.com\nalice@example.org", ["bob@example.com", "alice@example.org"]),
    (
        "sk-proj-Ab3dEf6hIj9kLm2nOp5q\nsk-proj-Zz9yXw8vUt7sRq6pOn5m",
        ["sk-proj-Ab3dEf6hIj9kLm2nOp5q", "sk-proj-Zz9yXw8vUt7sRq6pOn5m"],
    ),
]


@pytest.mark.parametrize(("text", "items"), BROKEN_ORDINARY)
def test_ordinary_text_across_a_break_is_not_joined(text: str, items: list[str]) -> None:
    assert [covered for _, covered in found(text)] == items


# -- phones, internationalised addresses --------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "plus"),
    [
        ("0049-30-1234567", "+49 30 1234567"),
        ("0049 30 1234567", "+49 30 1234567"),
        ("0049.30.1234567", "+49 30 1234567"),
        ("001 212 555 0147", "+1 212 555 0147"),
        ("0044 20 7946 0958", "+44 20 7946 0958"),
    ],
)
def test_00_prefixed_phone_numbers_are_the_plus_form(text: str, plus: str) -> None:
    assert found(f"call {text} now") == [("phone", text)]
    assert scrub(f"call {text} now") == scrub(f"call {plus} now")


@pytest.mark.parametrize("text", ["+49 30 1234567", "+49-30-1234567", "+49.30.1234567"])
def test_plus_phone_numbers_with_separators_stay_found(text: str) -> None:
    assert found(f"call {text} now") == [("phone", text)]


@pytest.mark.parametrize(
    "text", ["order 0012-3456-7890 shipped", "dates 0001-01-01 and 0099 12 31", "id 0049-30"]
)
def test_00_numbers_that_are_no_phone_are_left_alone(text: str) -> None:
    assert found(text) == []


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("write to 用户@例子.广告 ok", "用户@例子.广告"),
        ("邮箱：用户@例子.中国。", "用户@例子.中国"),
        ("メール: ユーザー@例え.テスト です", "ユーザー@例え.テスト"),
        ("write to user@例子.广告 ok", "user@例子.广告"),
        ("请联系bob@example.com谢谢。再见", "请联系bob@example.com"),
    ],
)
def test_internationalised_addresses_are_found(text: str, address: str) -> None:
    assert found(text) == [("email", address)]
    assert address not in scrub(text)


@pytest.mark.parametrize(
    "text",
    ["你好，世界。我的名字是李。", "感谢@张三", "回复@张三：好的", "感谢@张三.今天天气很好呢"],
)
def test_cjk_prose_and_mentions_are_not_addresses(text: str) -> None:
    assert found(text) == []


# -- a bare AWS secret access key ---------------------------------------------------------------

# The documented example, and random ones whose '/'-segments alone read as random (only a part
# was replaced) or do not (none was).
AWS_KEYS = [
    "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "riGp/58WAm+dX3a5IDnOdcdbWB2dC4/DSDC6Lc1m",
    "jVN3TPap45SNZR/oWWAaJz70Nv5zUaX2ZRi/FLc0",
    "Lo6JnfLbbl0ofyE1uo5vEun3WLG9OmAOfdbLO5YO",
]


@pytest.mark.parametrize("key", AWS_KEYS)
def test_a_bare_aws_secret_key_is_replaced_whole(key: str) -> None:
    text = f"aws {key} ok"
    assert found(text) == [("high_entropy", key)]
    assert scrub(text).startswith("aws SECRET_") and scrub(text).endswith(" ok")


def test_random_aws_secret_keys_are_caught_as_the_docstring_says() -> None:
    rng = random.Random(7)
    alphabet = string.ascii_letters + string.digits + "+/"
    keys = ["".join(rng.choice(alphabet) for _ in range(40)) for _ in range(400)]
    whole = sum(found(f"key {k} end") == [("high_entropy", k)] for k in keys)
    assert whole / len(keys) >= 0.98  # ~99.3% documented


@pytest.mark.parametrize(
    "text",
    [
        # 40-character identifiers and paths with digits, from real code
        "V1OrganizationExternalKeysPostRequestGcp",
        "cudaResViewFormatSignedBlockCompressed6H",
        "hipResViewFormatUnsignedBlockCompressed1",
        "see may/VIGRE/VIGRE2010/REUPapers/Margoliash",
        "slack.com/archives/C3PDTEV8E/p1705929610405409",
        # long words and camel-case prose in base64's alphabet
        "pneumonoultramicroscopicsilicovolcanoconiosis and antidisestablishmentarianism",
        "TheQuickBrownFox/JumpsOver/TheLazyDog42",
        # a git SHA where it is labelled as one
        "commit e7da7f221d5bf496a48136c0cd264e630fe9fcc8",
    ],
)
def test_identifiers_words_and_labelled_digests_are_no_aws_key(text: str) -> None:
    assert found(text) == []


# -- the code checker: StopIteration does not end a map early -----------------------------------

STOPS = "def ok(x):\n    if x > 1:\n        raise StopIteration\n    return True\n"


@pytest.mark.parametrize(
    "tests",
    [
        "assert all(map(ok, [1, 2, 3]))\n",
        "assert list(filter(ok, [1, 2, 3])) == [1]\n",
        "def test_ok():\n    assert all(map(ok, range(5)))\n",
    ],
)
def test_a_stopiteration_from_the_solution_fails_the_test(tests: str) -> None:
    res = run_python(STOPS, tests)
    assert not res.passed, res
    assert res.reason == "RuntimeError: ok() raised StopIteration", res.reason


def test_a_right_solution_under_map_still_passes_and_a_test_can_expect_one() -> None:
    code = "def ok(x):\n    return x > 0\n\ndef first(xs):\n    return next(iter(xs))\n"
    tests = (
        "assert all(map(ok, [1, 2, 3]))\n"
        "try:\n    first([])\nexcept RuntimeError as exc:\n"
        "    assert isinstance(exc.__cause__, StopIteration)\n"
        "else:\n    raise AssertionError('no error')\n"
    )
    res = run_python(code, tests)
    assert res.passed, res
