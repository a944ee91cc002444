"""The planted corpus the anonymizer's tests share: three or more examples of every kind of
personal data and secret it finds (``PLANTED``), placed in valid v1 records (``corpus``) in
messages, tool arguments, tools, checks, prompts and meta; and the placeholder each value gets
(``ph``). The hostile corpus is tests/support/pii_corpus.py."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

from replay.tools.anonymize import PLACEHOLDER, Anonymizer
from tests.support.pii_corpus import CERT, EC, RSA, pem_block

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


def records(path: Path) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def ph(value: str) -> str:
    """The placeholder a planted value gets (scrubbing the value alone shows it)."""
    out, found = Anonymizer(SECRET).scrub_text(value)
    m = PLACEHOLDER.search(out)
    assert len(found) == 1 and m, (value, out)
    return m.group(0)


ANON = Anonymizer(SECRET)
