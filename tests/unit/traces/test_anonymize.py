"""Anonymization: a planted corpus of PII and secrets is fully scrubbed, pseudonyms are consistent
(so checks on scrubbed records still pass), a re-scan is clean, ordinary text is left alone; the
hostile corpus (tests/support/pii_corpus.py) is found item by item by scan and left empty by
anonymize;
time stays linear on near-miss input."""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.checkers import Answer, parse_check
from replay.core.errors import TraceError
from replay.core.records import ToolCall
from replay.tools.anonymize import (
    KINDS,
    PLACEHOLDER,
    Anonymizer,
    _Edits,
    anonymize_file,
    is_scanned,
    scan_file,
    scan_record,
    scan_text,
)
from replay.traces.trace import parse_line
from tests.support import pii_corpus
from tests.support.pii_corpus import CERT, EC, RSA, Planted, pem_block

ROOT = Path(__file__).resolve().parents[3]
SECRET = b"test-secret-1"


def _b64(obj: object) -> str:
    raw = json.dumps(obj, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _jwt(header: dict[str, Any], payload: dict[str, Any], sig: str) -> str:
    return f"{_b64(header)}.{_b64(payload)}.{sig}"


# Every planted item: (kind, the text planted, the sensitive part that must be gone).
EMAILS = ["alice.smith@corp-mail.com", "bob+billing@example.org", "carol_92@sub.domain.co.uk"]
PHONES = [
    "+1 (415) 555-0132",
    "+44 20 7946 0958",
    "020 7946 0018",
    "(212) 555-0147",
    "415-555-0199",
]
IPV4 = ["10.12.34.56", "192.168.1.20", "203.0.113.7"]
IPV6 = [
    "2001:db8:85a3::8a2e:370:7334",
    "fe80::1ff:fe23:4567:890a",
    "2001:0db8:0000:0000:0000:ff00:0042:8329",
]
CARDS = ["4111 1111 1111 1111", "5500-0000-0000-0004", "378282246310005", "6011111111111117"]
IBANS = ["DE89 3704 0044 0532 0130 00", "GB82WEST12345698765432", "FR1420041010050500013M02606"]
KEYS = [
    "sk-proj-Ab3dE5gH7jK9mN1pQ3rS5tU7vW9xY1zA",
    "ghp_R7tY2uI9oP4aS6dF1gH3jK8lZ5xC0vB2nM7q",
    "AKIAIOSFODNN7EXAMPLE",
    "xoxb-2048-4096-Zx81Lq0pWm3",
    "AIza" + "SyD4f8Gh2Jk6Lm0Np3Qr7St1Uv5Wx9Yz2Ab",
    "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789",
    "glpat-Ab1Cd2Ef3Gh4Ij5Kl6Mn",
    "sk_live_51HxYzAbCdEfGhIjKlMn",
    "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuv",
]
BEARER = "7fQx2LmZp9RtW4sKy8Vn"
JWTS = [
    _jwt(
        {"alg": "HS256", "typ": "JWT"},
        {"sub": "1234567890", "name": "Alice"},
        "dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    ),
    _jwt(
        {"alg": "RS256", "kid": "k1"},
        {"sub": "u-42", "exp": 1700000000},
        "Xq9vLm2Tz8Rk4Wp7Ns1Hd5Jb3Gf6Yc0A",
    ),
    _jwt({"alg": "none"}, {"admin": True}, ""),
]
ENTROPY = [
    "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "Zq8Xv3Lm9Tp2Rw7Ks4Nd6Hb1Gf5Jc0Ya",
    "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b",
    "Kxep+hNu9n51529fGidYu7a3wO0=",
]
PEMS = [
    pem_block("RSA PRIVATE KEY", RSA[:6]),
    pem_block("EC PRIVATE KEY", EC),
    pem_block("CERTIFICATE", CERT[:5]),
]
CREDS = [
    ("password=Winter2024!", "Winter2024!"),
    ("https://x.example.com/cb?token=blue-Falcon-77", "blue-Falcon-77"),
    ('"client_secret": "Zt7-uQ2-pLm"', "Zt7-uQ2-pLm"),
]
URLS = [
    ("postgres://admin:s3cr3tP4ss@db.internal:5432/app", "admin:s3cr3tP4ss"),
    ("https://deploy:hunter2x@git.example.com/repo.git", "deploy:hunter2x"),
    ("redis://:pa55word@cache.internal:6379/0", ":pa55word"),
]

PLANTED: list[tuple[str, str, str]] = (
    [("email", v, v) for v in EMAILS]
    + [("phone", v, v) for v in PHONES]
    + [("ipv4", v, v) for v in IPV4]
    + [("ipv6", v, v) for v in IPV6]
    + [("credit_card", v, v) for v in CARDS]
    + [("iban", v, v) for v in IBANS]
    + [("api_key", v, v) for v in KEYS]
    + [("api_key", f"Bearer {BEARER}", BEARER)]
    + [("jwt", v, v) for v in JWTS]
    + [("high_entropy", v, v) for v in ENTROPY]
    + [("url_credentials", url, creds) for url, creds in URLS]
    + [("pem", v, v) for v in PEMS]
    + [("credential", text, v) for text, v in CREDS]
)
CARD_INT = 4012888888881881  # a Visa test number stored as a JSON number


def corpus() -> list[dict[str, Any]]:
    """Valid v1 records with every planted item placed in messages, tool arguments, tools,
    checks, prompts and meta."""
    args = json.dumps({"to": EMAILS[0], "card": CARDS[0], "note": f"token {JWTS[0]}"})
    return [
        {
            "id": "support-1",
            "task": "tool",
            "messages": [
                {
                    "role": "system",
                    "content": f"Agent for {EMAILS[0]}. Escalate to {PHONES[1]} or "
                    f"{IPV4[0]}. Internal key {KEYS[0]}.",
                },
                {
                    "role": "user",
                    "content": f"Please email {EMAILS[0]} the invoice, charge card "
                    f"{CARDS[0]} and wire to {IBANS[0]}. I am on {PHONES[0]}.",
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_Zx81Lq0pWm3Ab3dE5gH7",
                            "type": "function",
                            "function": {"name": "send_email", "arguments": args},
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "call_Zx81Lq0pWm3Ab3dE5gH7",
                    "content": json.dumps({"status": "sent", "server": IPV6[0]}),
                },
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "send_email",
                        "description": f"Send mail via {URLS[0][0]}; auth {KEYS[1]}",
                        "parameters": {
                            "type": "object",
                            "properties": {
                                "to": {"type": "string", "description": f"e.g. {EMAILS[1]}"},
                                "card": {"type": "string"},
                            },
                        },
                    },
                }
            ],
            "check": {
                "type": "tool_call",
                "calls": [{"name": "send_email", "arguments": {"to": EMAILS[0], "card": CARDS[0]}}],
            },
            "meta": {"user": EMAILS[2], "client_ip": IPV4[1], "session_token": ENTROPY[0]},
        },
        {
            "id": "contains-1",
            "messages": [
                {"role": "user", "content": f"Reply with address {EMAILS[1]} and IBAN {IBANS[1]}."}
            ],
            "check": {"type": "contains", "values": [EMAILS[1], IBANS[1]]},
        },
        {
            "id": "retrieval-1",
            "task": "retrieval",
            "messages": [
                {
                    "role": "user",
                    "content": f"[P0] The billing phone is {PHONES[2]}.\n[P1] The server "
                    f"is {IPV6[1]}.\nWhich passage names the billing phone?",
                }
            ],
            "check": {"type": "retrieval", "passage_ids": ["P0"], "fact": PHONES[2]},
        },
        {
            "id": "exact-1",
            "messages": [{"role": "user", "content": f"Repeat: {CARDS[1]}"}],
            "check": {"type": "exact", "value": CARDS[1]},
        },
        {
            "id": "regex-1",
            "messages": [{"role": "user", "content": f"Who is {EMAILS[2]}?"}],
            "check": {"type": "regex", "pattern": re.escape(EMAILS[2])},
        },
        {
            "id": "json-1",
            "task": "json",
            "messages": [
                {"role": "user", "content": f"Return JSON with token {KEYS[2]} and key {KEYS[3]}."}
            ],
            "check": {
                "type": "json_schema",
                "schema": {
                    "type": "object",
                    "required": ["token"],
                    "properties": {"token": {"const": KEYS[2]}},
                },
            },
        },
        {
            "id": "code-1",
            "task": "code",
            "messages": [
                {"role": "user", "content": f"Write mask(s) hiding {CARDS[2]} and {KEYS[4]}."}
            ],
            "check": {
                "type": "code",
                "tests": f'assert mask("{CARDS[2]}") == "****"\n'
                f'assert "{KEYS[5]}" not in mask("x")\n',
            },
        },
        {
            "id": "completion-1",
            "api": "completions",
            "prompt": f"Log: user {EMAILS[1]} from {IPV4[2]} ({IPV6[2]}) token {JWTS[1]} secret "
            f"{ENTROPY[1]} db {URLS[1][0]} phone {PHONES[3]} iban {IBANS[2]} card {CARDS[3]} "
            f"keys {KEYS[6]} {KEYS[7]} {KEYS[8]} client secret {ENTROPY[2]} {ENTROPY[3]}",
        },
        {"id": "tokens-1", "api": "completions", "prompt": [5, CARD_INT, 7]},
        {
            "id": "meta-1",
            "messages": [{"role": "user", "content": f"Call me on {PHONES[4]}"}],
            "meta": {
                "source": {
                    "url": URLS[2][0],
                    "headers": {"Authorization": f"Bearer {BEARER}"},
                    "jwt": JWTS[2],
                },
                "card_number": CARD_INT,
                "phones": [PHONES[4]],
            },
        },
        {
            "id": "secrets-1",
            "messages": [
                {"role": "user", "content": f"Deploy with {CREDS[0][0]} and this key:\n{PEMS[0]}"}
            ],
            "meta": {
                "config": f"{CREDS[1][0]} and {{{CREDS[2][0]}}}",
                "cert": PEMS[2],
                "key_file": PEMS[1],
            },
        },
    ]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture()
def scrubbed(tmp_path: Path) -> tuple[Path, Path, dict[str, int]]:
    src = write_jsonl(tmp_path / "raw.jsonl", corpus())
    dst = tmp_path / "clean.jsonl"
    return src, dst, anonymize_file(src, dst, SECRET)


def records(path: Path) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def ph(value: str) -> str:
    """The placeholder a planted value gets (scrubbing the value alone shows it)."""
    out, found = Anonymizer(SECRET).scrub_text(value)
    m = PLACEHOLDER.search(out)
    assert len(found) == 1 and m, (value, out)
    return m.group(0)


# -- the planted corpus -------------------------------------------------------------------------


def test_every_planted_kind_has_three_examples() -> None:
    for kind in KINDS:
        assert sum(k == kind for k, _, _ in PLANTED) >= 3, kind


@pytest.mark.parametrize(("kind", "text", "secret"), PLANTED, ids=[p[1][:24] for p in PLANTED])
def test_each_planted_item_is_detected_with_its_span(kind: str, text: str, secret: str) -> None:
    sentence = f"note: {text} (end)"
    found = scan_text(sentence)
    assert [f.kind for f in found] == [kind]
    assert sentence[found[0].start : found[0].end] == secret
    assert secret not in found[0].excerpt


def test_planted_corpus_is_fully_scrubbed(scrubbed: tuple[Path, Path, dict[str, int]]) -> None:
    src, dst, counts = scrubbed
    data = dst.read_bytes()
    for _kind, _text, secret in PLANTED:
        for form in {secret, json.dumps(secret)[1:-1], re.sub(r"\D", "", secret)}:
            if len(form) >= 6:
                assert form.encode() not in data, form
    assert str(CARD_INT).encode() in data  # only inside the token-id prompt
    assert records(dst)["tokens-1"]["prompt"] == [5, CARD_INT, 7]
    assert records(dst)["meta-1"]["meta"]["card_number"] == ph(str(CARD_INT))
    assert scan_file(dst) == (len(corpus()), [])
    assert all(counts[k] >= 3 for k in KINDS), counts
    lines, found = scan_file(src)
    assert lines == len(corpus()) and {f.kind for _, f in found} == set(KINDS)


def test_scrubbed_trace_is_valid_and_marked(scrubbed: tuple[Path, Path, dict[str, int]]) -> None:
    src, dst, _ = scrubbed
    for i, line in enumerate(dst.read_text().splitlines(), start=1):
        req = parse_line(line, str(dst), i)
        assert req.meta["anonymized"] == {"by": "kvcanary", "version": 1}
    assert is_scanned(dst) and not is_scanned(src)


def test_same_value_same_placeholder_everywhere(
    scrubbed: tuple[Path, Path, dict[str, int]],
) -> None:
    out = records(scrubbed[1])
    rec = out["support-1"]
    p_email, p_card = ph(EMAILS[0]), ph(CARDS[0])
    for text in (rec["messages"][0]["content"], rec["messages"][1]["content"]):
        assert p_email in text
    args = json.loads(rec["messages"][2]["tool_calls"][0]["function"]["arguments"])
    assert args["to"] == p_email and args["card"] == p_card and ph(JWTS[0]) in args["note"]
    assert rec["check"]["calls"][0]["arguments"] == {"to": p_email, "card": p_card}
    assert out["contains-1"]["check"]["values"] == [ph(EMAILS[1]), ph(IBANS[1])]
    assert ph(EMAILS[1]) in out["completion-1"]["prompt"]  # across records too
    assert rec["tools"][0]["function"]["description"].startswith(
        f"Send mail via {Anonymizer(SECRET).scrub_text(URLS[0][0])[0]};"
    )
    assert ph(URLS[0][0]) == Anonymizer(SECRET).placeholder("url_credentials", URLS[0][1])
    assert rec["meta"]["user"] == ph(EMAILS[2]) and rec["meta"]["client_ip"] == ph(IPV4[1])
    assert rec["messages"][3]["tool_call_id"] == rec["messages"][2]["tool_calls"][0]["id"]
    # Different values never share a placeholder; one value in two formats does.
    distinct = {ph(text) for _, text, _ in PLANTED}
    assert len(distinct) == len(PLANTED)
    assert ph("+1 415 555 0132") == ph("+14155550132") == ph(PHONES[0])
    assert ph("4111-1111-1111-1111") == ph(CARDS[0]) and ph("Alice.Smith@Corp-Mail.com") == ph(
        EMAILS[0]
    )


def _grade(check: dict[str, Any], text: str, calls: tuple[ToolCall, ...] = ()) -> bool:
    return parse_check(check).grade(Answer(text=text, tool_calls=calls)).passed


def _copy(message: str, value: str) -> str:
    """The placeholder for ``value``, copied out of the scrubbed message as a model would."""
    want = ph(value)
    found = [m.group(0) for m in PLACEHOLDER.finditer(message) if m.group(0) == want]
    assert found, (value, message)
    return found[0]


def test_checks_still_pass_on_scrubbed_records(scrubbed: tuple[Path, Path, dict[str, int]]) -> None:
    out = records(scrubbed[1])
    user = {rid: r["messages"][-1]["content"] for rid, r in out.items() if r.get("messages")}
    user["support-1"] = out["support-1"]["messages"][1]["content"]
    call = ToolCall(
        index=0,
        name="send_email",
        arguments=json.dumps(
            {"to": _copy(user["support-1"], EMAILS[0]), "card": _copy(user["support-1"], CARDS[0])}
        ),
    )
    assert _grade(out["support-1"]["check"], "", (call,))
    email, iban = _copy(user["contains-1"], EMAILS[1]), _copy(user["contains-1"], IBANS[1])
    assert _grade(out["contains-1"]["check"], f"Address {email}, IBAN {iban}.")
    phone = _copy(user["retrieval-1"], PHONES[2])
    assert _grade(out["retrieval-1"]["check"], f"[P0] says the billing phone is {phone}.")
    assert _grade(out["exact-1"]["check"], _copy(user["exact-1"], CARDS[1]))
    assert _grade(out["regex-1"]["check"], f"That is {_copy(user['regex-1'], EMAILS[2])}.")
    token = _copy(user["json-1"], KEYS[2])
    assert _grade(out["json-1"]["check"], json.dumps({"token": token}))
    assert not _grade(out["contains-1"]["check"], f"Address {EMAILS[1]}, IBAN {IBANS[1]}.")
    assert ph(CARDS[2]) in out["code-1"]["check"]["tests"]
    compile(out["code-1"]["check"]["tests"], "<tests>", "exec")


def test_checks_pass_on_the_raw_records_too() -> None:
    """The same answers in raw form pass the raw checks: scrubbing kept what the check means."""
    raw = {r["id"]: r for r in corpus()}
    assert _grade(raw["contains-1"]["check"], f"Address {EMAILS[1]}, IBAN {IBANS[1]}.")
    assert _grade(raw["regex-1"]["check"], f"That is {EMAILS[2]}.")
    assert _grade(raw["retrieval-1"]["check"], f"[P0] says {PHONES[2]}.")


def test_finding_fields_name_the_json_path() -> None:
    found = scan_record(corpus()[0])
    fields = {f.field for f in found}
    assert "messages.2.tool_calls.0.function.arguments#to" in fields
    assert "messages.3.content#server" in fields
    assert "tools.0.function.parameters.properties.to.description" in fields
    assert "check.calls.0.arguments.card" in fields and "meta.session_token" in fields
    text = corpus()[0]["messages"][1]["content"]
    for f in found:
        if f.field == "messages.1.content":
            assert scan_text(text[f.start : f.end])[0].kind == f.kind


def test_secret_keys_pseudonyms() -> None:
    a, b = Anonymizer(b"one"), Anonymizer(b"two")
    text = f"mail {EMAILS[0]} card {CARDS[0]}"
    assert a.scrub_text(text)[0] == Anonymizer(b"one").scrub_text(text)[0]
    assert a.scrub_text(text)[0] != b.scrub_text(text)[0]
    with pytest.raises(ValueError, match="secret"):
        Anonymizer(b"")


# -- record handling ----------------------------------------------------------------------------


def test_json_arguments_with_escapes_are_parsed() -> None:
    rec = {
        "id": "x",
        "messages": [
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "function": {
                            "name": "f",
                            "arguments": '{"to": "alice\\u0040corp.com", "n": 3}',
                        }
                    }
                ],
            }
        ],
    }
    out, found = Anonymizer(SECRET).scrub_record(rec)
    args = out["messages"][0]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(args) == {"to": ph("alice@corp.com"), "n": 3}
    assert [f.field for f in found] == ["messages.0.tool_calls.0.function.arguments#to"]


def test_unchanged_json_strings_keep_their_bytes() -> None:
    args = '{ "city":"Paris",\n "days": 2 }'
    rec = {"id": "x", "messages": [{"role": "user", "content": args}]}
    assert Anonymizer(SECRET).scrub_record(rec) == (rec, [])


def test_keys_are_kept_unless_a_key_is_itself_detected() -> None:
    rec = {"id": "x", "meta": {"owners": {EMAILS[0]: "admin", "team": "infra"}}}
    out, found = Anonymizer(SECRET).scrub_record(rec)
    assert out["meta"]["owners"] == {ph(EMAILS[0]): "admin", "team": "infra"}
    assert found[0].field == f"meta.owners.{ph(EMAILS[0])}(key)"


def test_regex_pattern_escapes_are_seen_through() -> None:
    pattern = r"^Mail (alice\.smith@corp\.com)\.$"
    rec: dict[str, Any] = {"id": "x", "check": {"type": "regex", "pattern": pattern}}
    out, found = Anonymizer(SECRET).scrub_record(rec)
    scrubbed = out["check"]["pattern"]
    assert scrubbed == rf"^Mail ({ph('alice.smith@corp.com')})\.$"
    assert re.search(scrubbed, f"Mail {ph('alice.smith@corp.com')}.")
    assert rec["check"]["pattern"][found[0].start : found[0].end] == r"alice\.smith@corp\.com"
    assert found[0].field == "check.pattern"


def test_number_checks_and_top_level_numbers_are_untouched() -> None:
    rec = {"id": "x", "t": 1.5, "max_tokens": 16, "check": {"type": "number", "value": CARD_INT}}
    assert Anonymizer(SECRET).scrub_record(rec) == (rec, [])


def test_spans_are_in_the_input_when_a_second_pass_is_needed() -> None:
    # The e-mail wins the overlap with the high-entropy run; the run's tail is found next.
    text = f"see {EMAILS[0]}/Zq8Xv3Lm9Tp2Rw7Ks4Nd6Hb1Gf5Jc0Ya ok"
    out, found = Anonymizer(SECRET).scrub_text(text)
    assert [(f.kind, text[f.start : f.end]) for f in found] == [
        ("email", EMAILS[0]),
        ("high_entropy", "Zq8Xv3Lm9Tp2Rw7Ks4Nd6Hb1Gf5Jc0Ya"),
    ]
    assert scan_text(out) == []


# -- files --------------------------------------------------------------------------------------


def test_anonymize_file_rejects_a_bad_line_and_writes_nothing(tmp_path: Path) -> None:
    src = tmp_path / "raw.jsonl"
    src.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n\n{oops\n')
    dst = tmp_path / "out.jsonl"
    with pytest.raises(TraceError, match=r"raw.jsonl:3"):
        anonymize_file(src, dst, SECRET)
    assert not dst.exists() and list(tmp_path.iterdir()) == [src]


def test_is_scanned(tmp_path: Path) -> None:
    marked = {
        "id": "a",
        "messages": [{"role": "user", "content": "hi"}],
        "meta": {"anonymized": {"by": "kvcanary", "version": 1}},
    }
    good = write_jsonl(tmp_path / "good.jsonl", [marked, marked | {"id": "b"}])
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [marked, {"id": "b", "messages": []}])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert is_scanned(good)
    assert not is_scanned(mixed) and not is_scanned(empty)
    assert is_scanned(ROOT / "traces" / "sample.jsonl")  # shipped through anonymize


def test_scan_file_reports_line_numbers_and_scans_non_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(f'{{"id": "a", "meta": {{"ip": "{IPV4[0]}"}}}}\n\nnot json {EMAILS[0]}\n')
    lines, found = scan_file(path)
    assert lines == 2
    assert [(n, f.kind, f.field) for n, f in found] == [
        (1, "ipv4", "meta.ip"),
        (3, "email", "(line)"),
    ]


# -- false positives ----------------------------------------------------------------------------

ORDINARY = [
    "In 2023 we sold 1,250 units at $19.99 each (EUR 1.234,56); code 4821, PIN 0000, room 101.",
    "The meeting is on 2024-01-15 at 12:30:45 UTC, or 01.02.2024 12:30, or 15/01/2024.",
    "Order #123456789 shipped; ISBN 978-3-16-148410-0; invoice 2024-000123.",
    "sizes 128 256 512 1024 2048 4096 and years 2019 2020 2021 2022 2023",
    "[128000, 9906, 1917, 13, 4435, 374, 264, 1296, 315, 279, 12047, 1887]",
    "Request 550e8400-e29b-41d4-a716-446655440000 and 123E4567-E89B-12D3-A456-426614174000.",
    "def convertToBase64String(value: bytes) -> str:\n    return base64.b64encode(value).decode()",
    "class Qwen3OmniMoeTextSparseMoeBlock(nn.Module): pass  # Meta-Llama-3-70B-Instruct-FP8",
    "path /usr/local/lib/python3.11/site-packages/torch/nn/modules/linear.py line 114",
    "Use vllm==0.6.3.post1 or torch 2.6.0.1; see section 4.2.3.1 and RFC 5890 §2.3.2.1.",
    "git clone git@github.com:owner/repo.git && open icon@2x.png",
    "localhost 127.0.0.1:8000, 0.0.0.0:80, netmask 255.255.255.0, ::1 and a[1::2] std::vector",
    "tool call call_VSPygqKTWdrhaFErNvMV18Yl and toolu_01D7FLrfh4GYq7yT1ULFeyMV finished",
    "image: data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk",
    "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 and commit "
    "e7da7f221d5bf496a48136c0cd264e630fe9fcc8",
    "Authorization: Bearer $OPENAI_API_KEY or Bearer YOUR_API_KEY_HERE (the bearer of news)",
    "The quick brown fox jumps over the lazy dog; the model's accuracy is 87.5% at 3x speed.",
    "| id | value |\n|----|-------|\n| 17 | 0.731 |\n| 18 | -2.5e-3 |",
    "ratio 3:4:5, time 10:45, MAC 00:1A:2B:3C:4D:5E, scikit sk-learn-compatible-estimator",
    "timestamps 1700000000000 and 1700000000123456789; negative -4111111111111111",
    "hex colour #ff00ff, 0xDEADBEEF, version v1.2.3-rc.1+build.5",
    # labels without a secret after them: prose, code, templates, paths, LLM tokens
    "The secret: practice every day. Password: see the admin guide. Token: a unit of text.",
    "sorted(items, key=lambda x: x[1]); d.get(key=k); connect(user=user, password=password)",
    "sort(key=str.lower); token=self.token; password=args.password; key=itemgetter(1)",
    '{"eos_token": "</s>", "pad_token": "<pad>", "token": " the", "logprob": -0.31} '
    "max_tokens=256 token_id=1917 num_tokens: 12",
    "pwd: /home/user/project; PWD=/srv/app; password=${DB_PASSWORD}; api_key=YOUR_API_KEY; "
    "secret: <redacted>; token: $GITHUB_TOKEN; password=%(password)s; key={key}",
    "fn check(password: &str, key: String) -> bool; let token: string; password: str = x",
    "?page=2&sort=asc&limit=50&key_id=12&sort_key=name&monkey=banana",
    "if password == expected: ok; passport: required; keyboard: us; signed: yes",
    # near misses of the other new shapes
    "Files that end with -----END----- or a markdown rule\n-----\nare not keys.",
    "MIME lines are 76 characters; see RFC 2045 and MIIT (a ministry).",
    "Look (at) this. Email me at noon [at] the office. user@localhost and root@server ok",
    "Привет, как дела? Сегодня хорошая погода. Καλημέρα κόσμε. 你好，世界。我的名字是李。",
    "price 4111 USD\n1111 units\n and columns:\n1234 5678\n9012 3456\n4111\n1111\n1111\n1111",
    "ids\n4111111111\n111111\n2222",
    "cursor=eyJpZCI6MTIzfQ and the word Basic Authentication and Bearer of news",
    "scikit sk-learn-v2 and hf_hub_download(), ghp_ prefix docs, AKIA prefix, xoxb- docs",
    "ends with an ellipsis… and a [truncated] mark [+120 chars]",
    # code that names secrets without holding one
    '_SK_START = b"-----BEGIN OPENSSH PRIVATE KEY-----"\n'
    '_SK_END = b"-----END OPENSSH PRIVATE KEY-----"',
    'assert "-----BEGIN CERTIFICATE-----" in contents',
    "proxy_auth = await get_auth(x)\nlogin, account, password = auth_from_netrc\ncreds = in_memory",
    'GRANT_TYPE_REFRESH_TOKEN = "refresh_token"\napiKey = "apiKey"\nAUTH_TYPE = "user_oauth"',
    "def sign(self, private_key: SSHCertPrivateKeyTypes, password: SecretStr) -> None: ...",
    "the worker's standing credential: polling\nalways works; fetch(url, {credentials: 'include'})",
    "`Authorization: Bearer` auth is sent; the session_id: 42 and token: 7",
]


@pytest.mark.parametrize("text", ORDINARY)
def test_ordinary_text_has_no_findings(text: str) -> None:
    assert scan_text(text) == []


def test_sample_trace_is_clean() -> None:
    lines, found = scan_file(ROOT / "traces" / "sample.jsonl")
    assert lines > 0 and found == []


# -- the hostile corpus: one set of planted items, for scan and anonymize alike -------------------

HOSTILE = pii_corpus.PLANTED


def test_hostile_corpus_covers_every_kind() -> None:
    assert {p.kind for p in HOSTILE} == set(KINDS) - {"url_credentials", "ipv6", "ipv4", "phone"}
    assert len({p.name for p in HOSTILE}) == len(HOSTILE)
    for p in HOSTILE:
        assert p.secret in p.text, p.name


def _covered(item: Planted, found: list[Any]) -> bool:
    """A finding of the item's kind, in its field, spans the planted secret."""
    at = item.text.index(item.secret)
    return any(
        f.kind == item.kind
        and f.field == pii_corpus.field(item)
        and f.start <= at
        and f.end >= at + len(item.secret)
        for f in found
    )


@pytest.mark.parametrize("item", HOSTILE, ids=[p.name for p in HOSTILE])
def test_scan_finds_each_hostile_item(item: Planted) -> None:
    found = scan_record(pii_corpus.record(item))
    assert _covered(item, found), [(f.kind, f.field, f.start, f.end) for f in found]
    for f in found:
        assert item.secret not in f.excerpt


def _strings(value: Any) -> Iterator[str]:
    """Every string in a record, keys too, and inside strings that hold JSON."""
    if isinstance(value, str):
        yield value
        try:
            inner = json.loads(value)
        except ValueError:
            return
        if isinstance(inner, dict | list):
            yield from _strings(inner)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _fragments(secret: str, n: int = 8) -> set[str]:
    """Every n-character piece of a secret that holds a letter or digit (all of a short one)."""
    if len(secret) <= n:
        return {secret}
    return {
        secret[i : i + n]
        for i in range(len(secret) - n + 1)
        if any(c.isalnum() for c in secret[i : i + n])
    }


def _survivors(item: Planted, scrubbed: dict[str, Any]) -> list[str]:
    blob = "\0".join(_strings(scrubbed))
    return sorted(w for s in (item.secret, *item.also) for w in _fragments(s) if w in blob)


@pytest.mark.parametrize("item", HOSTILE, ids=[p.name for p in HOSTILE])
def test_anonymize_leaves_nothing_of_each_hostile_item(item: Planted) -> None:
    out, found = ANON.scrub_record(pii_corpus.record(item))
    assert _covered(item, found)
    assert _survivors(item, out) == []
    assert scan_record(out) == []
    assert ANON.scrub_record(out) == (out, [])


def test_hostile_corpus_file_scan_then_anonymize(tmp_path: Path) -> None:
    raw = tmp_path / "hostile.jsonl"
    raw.write_text(pii_corpus.jsonl(), encoding="utf-8")
    lines, found = scan_file(raw)
    assert lines == len(HOSTILE)
    by_line: dict[int, list[Any]] = {}
    for lineno, f in found:
        by_line.setdefault(lineno, []).append(f)
    for lineno, item in enumerate(HOSTILE, start=1):
        assert _covered(item, by_line.get(lineno, [])), item.name
    clean = tmp_path / "clean.jsonl"
    counts = anonymize_file(raw, clean, SECRET)
    assert scan_file(clean) == (len(HOSTILE), [])
    assert sum(counts.values()) >= len(HOSTILE)
    for i, line in enumerate(clean.read_text(encoding="utf-8").splitlines()):
        item = HOSTILE[i]
        record = json.loads(line)
        assert record["id"] == item.name and _survivors(item, record) == [], item.name
        parse_line(line, str(clean), i + 1)  # still a valid trace record


def test_disguised_values_share_the_plain_placeholder() -> None:
    """Folding full-width, look-alike and invisible characters keys the pseudonym on the value,
    so a check written with the plain value still matches the disguised one's placeholder."""
    plain = ph("john@example.com")
    assert ph("ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ") == ph("john＠example.com") == plain
    assert ph("jоhn@ехаmple.com") == plain  # Cyrillic о, е, х, а
    assert ph("ali\u200bce@corp.com") == ph("alice@corp.com")
    assert ph("john [at] example [dot] com") == plain
    assert ph("４１１１１１１１１１１１１１１１") == ph("4111 1111\n1111 1111") == ph(CARDS[0])


def test_disguised_spans_are_in_the_original_text() -> None:
    text = "cc ali\u200bce@corp.com and ｍａｒｙ＠ｅｘａｍｐｌｅ．ｏｒｇ end"
    out, found = ANON.scrub_text(text)
    assert [text[f.start : f.end] for f in found] == [
        "ali\u200bce@corp.com",
        "ｍａｒｙ＠ｅｘａｍｐｌｅ．ｏｒｇ",
    ]
    assert out == f"cc {ph('alice@corp.com')} and {ph('mary@example.org')} end"


def test_labels_stay_and_values_go() -> None:
    text = 'GET /a?user=bob&token=blue-Falcon-77 with password: hunter2 and "pwd": "s3c"'
    out, found = ANON.scrub_text(text)
    assert [f.kind for f in found] == ["credential"] * 3
    assert out == (
        f"GET /a?user=bob&token={ph('?token=blue-Falcon-77')} with password: "
        f'{ph("password=hunter2")} and "pwd": "{ph("pwd=s3c")}"'
    )
    rec = {"id": "x", "meta": {"headers": {"Authorization": "Token abc123", "Accept": "abc123"}}}
    scrubbed, found = ANON.scrub_record(rec)
    assert scrubbed["meta"]["headers"] == {
        "Authorization": f"Token {ph('pwd=abc123')}",
        "Accept": "abc123",
    }
    assert [f.field for f in found] == ["meta.headers.Authorization"]


CUT = [
    ("key sk-ab3dE5gH7j", "sk-ab3dE5gH7j"),
    ("mail alice.smith@corp-ma…", "alice.smith@corp-ma"),
    ("card 4111 1111 1111 11 [...]", "4111 1111 1111 11"),
    ("Authorization: Bearer 7fQx2Lm9 (truncated)", "7fQx2Lm9"),
    ("blob Zq8Xv3Lm9Tp2Rw...", "Zq8Xv3Lm9Tp2Rw"),
    ("iban DE89 3704 0044 05 [+9 chars]", "DE89 3704 0044 05"),
]


@pytest.mark.parametrize(("text", "fragment"), CUT, ids=[c[1] for c in CUT])
def test_a_cut_fragment_counts_only_at_the_cut(text: str, fragment: str) -> None:
    """Shorter shapes are secrets where a field was cut, not in the middle of a text."""
    found = scan_text(text)
    assert [text[f.start : f.end] for f in found] == [fragment]
    middle = text.replace(fragment, f"{fragment} and more words", 1)
    assert [f for f in scan_text(middle) if f.kind != "credential"] == []


@settings(max_examples=300)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6), st.integers(1, 12)), max_size=12),
    st.integers(0, 400),
    st.booleans(),
)
def test_edit_positions_map_back_like_a_walk(
    spec: list[tuple[int, int, int]], pos: int, is_end: bool
) -> None:
    """The indexed mapping agrees with walking the edits one by one."""
    edits, at = [], 0
    for gap, width, n in spec:
        edits.append((at + gap, at + gap + width, n))
        at += gap + width
    shift = 0
    want = None
    for s, e, n in edits:
        new_s = s + shift
        if pos < new_s or (is_end and pos == new_s):
            break
        if pos < new_s + n or (is_end and pos == new_s + n):
            want = e if is_end else s
            break
        shift += n - (e - s)
    assert _Edits(edits).back(pos, is_end) == (pos - shift if want is None else want)


# -- bounded time -------------------------------------------------------------------------------

MB = 1_000_000
# Near misses: what each detector starts on, repeated, with nothing to find (or a little).
NEAR_MISS = [
    "-",
    "-----BEGIN-----\n",
    "A" * 64 + "\n",
    "MII\n",
    "eyJ",
    "sk-",
    "Bearer ",
    "key=",
    "password: ",
    '"token": "',
    "?token=a&",
    "a@",
    "a [at] b [dot] ",
    "ｊｏｈｎ＠",
    "1:",
    "1 1 1 1 1\n",
    "4111 1111\n",
    " ",
    "…",
]


def _seconds(text: str) -> float:
    start = time.perf_counter()
    ANON.scrub_text(text)
    return time.perf_counter() - start


def test_near_miss_megabyte_lines_take_linear_time() -> None:
    """A 1 MB line of near-miss characters costs a bounded multiple of a plain 1 MB line: no
    pattern backtracks catastrophically, nothing is quadratic (a regression reads as minutes)."""
    plain = min(
        _seconds(("the quick brown fox jumps over the lazy dog. " * 22300)[:MB]) for _ in range(2)
    )
    slow = {}
    for unit in NEAR_MISS:
        took = _seconds((unit * (MB // len(unit) + 1))[:MB])
        if took > 40 * plain:
            slow[unit] = round(took / plain, 1)
    assert slow == {}, f"plain 1 MB line: {plain:.3f}s; ratios {slow}"


def test_a_megabyte_of_findings_is_linear_too(tmp_path: Path) -> None:
    """Many replacements in one string (and a second pass over them) stay linear: spans map
    back through an index, not by walking every earlier replacement."""
    unit = "alice@corp.com/Zq8Xv3Lm9Tp2Rw7Ks4Nd6Hb1Gf5Jc0Ya "
    small, big = unit * 2000, unit * 8000
    ratio = _seconds(big) / max(_seconds(small), 1e-3)
    assert ratio < 12, ratio  # 4x the input: about 4x the time, never 16x


# -- properties ---------------------------------------------------------------------------------

ANON = Anonymizer(SECRET)
GLUE = st.text(alphabet=st.sampled_from(list(" .,:;/@-_+=()[]{}\"'\n0123456789abcXYZ")), max_size=4)
FRAGMENT = st.one_of(
    st.sampled_from([text for _, text, _ in PLANTED] + [p.text for p in HOSTILE]),
    GLUE,
    st.text(max_size=8),
)


def _idempotent(text: str) -> None:
    out, found = ANON.scrub_text(text)
    assert ANON.scrub_text(out) == (out, [])
    for f in found:
        assert 0 <= f.start < f.end <= len(text) and f.kind in KINDS


@given(st.text())
def test_scrub_never_raises_and_is_idempotent(text: str) -> None:
    _idempotent(text)


@settings(max_examples=300)
@given(st.lists(FRAGMENT, max_size=8).map("".join))
def test_scrub_is_idempotent_on_glued_secrets(text: str) -> None:
    _idempotent(text)


@settings(max_examples=50)
@given(st.lists(FRAGMENT, max_size=6).map("".join))
def test_scrub_record_is_idempotent(text: str) -> None:
    rec = {
        "id": "x",
        "messages": [{"role": "user", "content": text}],
        "meta": {"args": json.dumps({"v": text})},
    }
    out, _ = ANON.scrub_record(rec)
    assert ANON.scrub_record(out) == (out, [])


def _luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


@given(
    st.integers(10**15, 10**16 - 1).filter(lambda n: not _luhn_ok(str(n))),
    st.sampled_from(["", " ", "-"]),
)
def test_luhn_invalid_card_numbers_are_left_alone(n: int, sep: str) -> None:
    digits = str(n)
    number = sep.join(digits[i : i + 4] for i in range(0, 16, 4))
    text = f"card {number} end"
    assert ANON.scrub_text(text) == (text, [])
