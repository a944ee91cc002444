"""The hostile PII corpus: every item planted in its own trace record, with the kind ``scan`` must
report it as and the exact text that finding must cover. One corpus serves both directions: a scan
of the raw records finds every item, and anonymizing them leaves nothing a scan finds, nor any
piece of a planted value.

Items are what realistic logs leak and the plain patterns miss: tokens in query strings and in
``key=value`` / ``key: value`` / JSON-like text, PEM blocks whole, cut or in fragments, e-mail
addresses in full-width, look-alike, obfuscated, percent-encoded or HTML-entity spelling, card
numbers split across a line, and what a string cut in the middle of a secret leaves.
"""

from __future__ import annotations

import base64
import json
import random
from typing import Any, NamedTuple


class Planted(NamedTuple):
    name: str  # the record id, and the test id
    kind: str  # what scan must report it as
    text: str  # the whole string planted
    secret: str  # the part of ``text`` a finding of ``kind`` must cover
    where: str = "meta"  # content | meta | prompt | args:<key> | label:<key> (a JSON object's)
    also: tuple[str, ...] = ()  # other forms that must not survive (digits only, ASCII folds)


def _b64url(obj: object) -> str:
    raw = json.dumps(obj, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def pem_body(der_head: bytes, size: int, seed: int) -> list[str]:
    """Base64 lines of 64 characters, as in PEM, of a DER-like head and random bytes."""
    rnd = random.Random(seed)
    raw = der_head + bytes(rnd.randrange(256) for _ in range(size))
    b64 = base64.b64encode(raw).decode()
    return [b64[i : i + 64] for i in range(0, len(b64), 64)]


def pem_block(label: str, lines: list[str]) -> str:
    return f"-----BEGIN {label}-----\n" + "\n".join(lines) + f"\n-----END {label}-----"


RSA = pem_body(b"\x30\x82\x04\xa4\x02\x01\x00\x02\x82\x01\x01\x00", 600, 1)
EC = pem_body(b"\x30\x77\x02\x01\x01\x04\x20", 100, 2)
SSH = pem_body(b"openssh-key-v1\x00\x00\x00\x00\x04none", 320, 3)
CERT = pem_body(b"\x30\x82\x03\x5a\x30\x82\x02\x42\xa0\x03", 420, 4)
PKCS8 = pem_body(b"\x30\x82\x04\xbd\x02\x01\x00\x30\x0d\x06\x09", 500, 5)

JWT_HEAD = _b64url({"alg": "HS256", "typ": "JWT"})
JWT_BODY = _b64url({"sub": "user-8812", "name": "Dana", "iat": 1700000000})
RSA_BLOCK = pem_block("RSA PRIVATE KEY", RSA)
SSH_CUT = "-----BEGIN OPENSSH PRIVATE KEY-----\n" + "\n".join(SSH[:3]) + "\n" + SSH[3][:22]
EC_TAIL = "\n".join(EC[1:]) + "\n-----END EC PRIVATE KEY-----"
ESCAPED = (
    "-----BEGIN PRIVATE KEY-----\\n" + "\\n".join(PKCS8[:4]) + "\\n-----END PRIVATE KEY-----\\n"
)
ENCRYPTED = (
    "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\n"
    "DEK-Info: AES-128-CBC,3F2A9C1B7E5D4A60\n\n"
    + "\n".join(RSA[2:7])
    + "\n-----END RSA PRIVATE KEY-----"
)
PGP = (
    "-----BEGIN PGP PRIVATE KEY BLOCK-----\nVersion: GnuPG v2\n\n"
    + "\n".join(CERT[2:6])
    + "\n=Qx7T\n-----END PGP PRIVATE KEY BLOCK-----"
)

PLANTED: list[Planted] = [
    # -- secrets labelled by a name: URL query strings ------------------------------------------
    Planted(
        "q-token",
        "credential",
        "GET https://api.example.com/v1/data?token=blue-Falcon-77&format=json",
        "blue-Falcon-77",
        "content",
    ),
    Planted(
        "q-access-token",
        "credential",
        "redirect https://app.example.com/cb#access_token=abcDEF123ghi&state=xyz",
        "abcDEF123ghi",
    ),
    Planted(
        "q-refresh-token",
        "credential",
        "POST /oauth/token?grant_type=refresh_token&refresh_token=1//0gLq2-rT9xYz",
        "1//0gLq2-rT9xYz",
    ),
    Planted(
        "q-auth",
        "credential",
        "feed https://x.example.com/feed?auth=dG9wc2VjcmV0&page=2",
        "dG9wc2VjcmV0",
        "prompt",
    ),
    Planted(
        "q-key",
        "credential",
        "https://maps.example.com/geocode?address=Main+St&key=Maple7Syrup",
        "Maple7Syrup",
    ),
    Planted(
        "q-sas-sig",
        "credential",
        "https://acct.blob.core.windows.net/c/f.txt?sv=2021-08-06&sr=b&sp=r"
        "&sig=k3P9wL0Qp%2Bz8Yy%3D",
        "k3P9wL0Qp%2Bz8Yy%3D",
    ),
    Planted(
        "q-amz-signature",
        "credential",
        "https://bucket.s3.amazonaws.com/o?X-Amz-Date=20240101T000000Z"
        "&X-Amz-Signature=9f2c4e1ab07d&X-Amz-Expires=300",
        "9f2c4e1ab07d",
    ),
    Planted(
        "q-secret",
        "credential",
        "webhook https://hooks.example.com/in?secret=orange-Kite-42",
        "orange-Kite-42",
    ),
    Planted(
        "q-client-secret",
        "credential",
        "curl 'https://auth.example.com/token?client_id=app1&client_secret=Zt7-uQ2-pLm'",
        "Zt7-uQ2-pLm",
        "args:command",
    ),
    Planted(
        "q-password-upper",
        "credential",
        "https://legacy.example.com/login.php?USER=bob&PASSWORD=Hunter2Go",
        "Hunter2Go",
    ),
    Planted(
        "q-passwd", "credential", "ftp://files.example.com/get?passwd=swordfish9", "swordfish9"
    ),
    Planted("q-pwd", "credential", "http://router.local/cgi?pwd=admin1234&lang=en", "admin1234"),
    Planted(
        "q-github-token",
        "api_key",
        "https://api.github.com/user?access_token=ghp_R7tY2uI9oP4aS6dF1gH3jK8lZ5xC0vB2nM7q",
        "ghp_R7tY2uI9oP4aS6dF1gH3jK8lZ5xC0vB2nM7q",
    ),
    Planted(
        "q-slack-token",
        "api_key",
        "https://slack.com/api/chat.postMessage?token=xoxb-2048-4096-Zx81Lq0pWm3&channel=C1",
        "xoxb-2048-4096-Zx81Lq0pWm3",
    ),
    # -- key=value, key: value and JSON-like text ---------------------------------------------
    Planted(
        "kv-password",
        "credential",
        "login with password=Winter2024! please",
        "Winter2024!",
        "content",
    ),
    Planted("kv-pwd-colon", "credential", "ssh box\npwd: correcthorse7\n", "correcthorse7"),
    Planted(
        "kv-env",
        "credential",
        "DB_HOST=db.internal\nDB_PASSWORD=s3cr3t-Pa55\n",
        "s3cr3t-Pa55",
        "content",
    ),
    Planted(
        "kv-python-repr",
        "credential",
        "config was {'user': 'bob', 'password': 'tr0ub4dor&3'} (python repr)",
        "tr0ub4dor&3",
    ),
    Planted(
        "kv-json-cut",
        "credential",
        '{"username": "bob", "password": "Pa$$w0rd-99", "tok',
        "Pa$$w0rd-99",
    ),
    Planted(
        "kv-json-escaped",
        "credential",
        'payload={\\"api_key\\": \\"qwerty-12345-zx\\"}',
        "qwerty-12345-zx",
    ),
    Planted("kv-go", "credential", 'password := "gopher-42"', "gopher-42", "content"),
    Planted(
        "kv-yaml-quoted",
        "credential",
        'db:\n  password: "purple monkey dishwasher"\n',
        "purple monkey dishwasher",
    ),
    Planted(
        "kv-connection-string",
        "credential",
        "Server=db;User Id=sa;Password=Adm1n!23;Encrypt=true",
        "Adm1n!23",
    ),
    Planted(
        "kv-authorization-token",
        "credential",
        "Authorization: Token 9944b09199c62bcf9418ad846dd0e4bbdfc6ee4b",
        "9944b09199c62bcf9418ad846dd0e4bbdfc6ee4b",
    ),
    Planted("kv-x-api-key", "credential", "X-Api-Key: live-7f3a9c", "live-7f3a9c"),
    Planted(
        "kv-aws-secret",
        "credential",
        "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    ),
    # a JSON object's value under a secret key: found whatever it looks like
    Planted("label-password", "credential", "hunter", "hunter", "label:password"),
    Planted("label-api-key", "credential", "k3y-Value", "k3y-Value", "label:apiKey"),
    Planted(
        "label-client-secret", "credential", "GOCSPX-1a2b3c", "GOCSPX-1a2b3c", "label:client_secret"
    ),
    Planted("label-tool-password", "credential", "letmein-77", "letmein-77", "args:password"),
    Planted(
        "label-basic-auth",
        "api_key",
        "Basic YWxpY2U6czNjcjN0",
        "YWxpY2U6czNjcjN0",
        "label:Authorization",
    ),
    # -- PEM blocks ---------------------------------------------------------------------------
    Planted("pem-rsa", "pem", f"Here is my key:\n{RSA_BLOCK}\nthanks", RSA_BLOCK, "content"),
    Planted("pem-openssh-cut", "pem", f"key: {SSH_CUT}", SSH_CUT),
    Planted("pem-end-only", "pem", EC_TAIL, EC_TAIL),
    Planted(
        "pem-begin-cut",
        "pem",
        "…IVATE KEY-----\n" + "\n".join(EC) + "\n-----END EC PRIVATE KEY-----",
        "IVATE KEY-----\n" + "\n".join(EC) + "\n-----END EC PRIVATE KEY-----",
    ),
    Planted("pem-body-only", "pem", "\n".join(PKCS8[:4]), "\n".join(PKCS8[:4])),
    Planted(
        "pem-body-middle",
        "pem",
        "…" + "\n".join(RSA[3:6]) + "\n" + RSA[6][:10] + "…",
        "\n".join(RSA[3:6]) + "\n" + RSA[6][:10],
    ),
    Planted("pem-begin-line-cut", "pem", "the key is -----BEGIN RSA PRIV", "-----BEGIN RSA PRIV"),
    Planted("pem-escaped", "pem", f'"{ESCAPED}"', ESCAPED.removesuffix("\\n"), "prompt"),
    Planted("pem-encrypted", "pem", ENCRYPTED, ENCRYPTED, "content"),
    Planted(
        "pem-certificate",
        "pem",
        f"cert:\n{pem_block('CERTIFICATE', CERT[:6])}\nand the chain follows",
        pem_block("CERTIFICATE", CERT[:6]),
    ),
    Planted("pem-pgp", "pem", PGP, PGP),
    Planted(
        "pem-service-account",
        "pem",
        pem_block("PRIVATE KEY", PKCS8[4:8]) + "\n",
        pem_block("PRIVATE KEY", PKCS8[4:8]),
        "label:private_key",
    ),
    # a field cut a few characters into the key: too short a body to look like key data
    Planted(
        "pem-short-body-at-end",
        "pem",
        "my key:\n-----BEGIN RSA PRIVATE KEY-----\nMIIBOg",
        "-----BEGIN RSA PRIVATE KEY-----\nMIIBOg",
        "content",
    ),
    Planted(
        "pem-short-body-cut-mark",
        "pem",
        "-----BEGIN OPENSSH PRIVATE KEY-----\\nb3BlbnNz… [truncated]",
        "-----BEGIN OPENSSH PRIVATE KEY-----\\nb3BlbnNz",
    ),
    # -- e-mail addresses in disguise ---------------------------------------------------------
    Planted(
        "email-fullwidth",
        "email",
        "mail ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ now",
        "ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ",
        "content",
        ("john@example.com",),
    ),
    Planted(
        "email-fullwidth-at",
        "email",
        "mary＠example.org wrote",
        "mary＠example.org",
        also=("mary@example.org",),
    ),
    Planted(
        "email-cyrillic",
        "email",
        "from jоhn.dое@ехаmple.com today",
        "jоhn.dое@ехаmple.com",
        "content",
        ("john.doe@example.com",),
    ),
    Planted(
        "email-zero-width",
        "email",
        "cc ali\u200bce.w@corp-mail.com",
        "ali\u200bce.w@corp-mail.com",
        also=("ce.w@corp-mail.com",),
    ),
    Planted("email-math-bold", "email", "𝐬𝐚𝐦@𝐞𝐱𝐚𝐦𝐩𝐥𝐞.𝐧𝐞𝐭", "𝐬𝐚𝐦@𝐞𝐱𝐚𝐦𝐩𝐥𝐞.𝐧𝐞𝐭"),
    Planted(
        "email-at-dot",
        "email",
        "write to peter [at] example [dot] com",
        "peter [at] example [dot] com",
        "content",
    ),
    Planted("email-parens", "email", "jane(at)corp(dot)org", "jane(at)corp(dot)org"),
    Planted("email-defanged", "email", "bob.jones@example[.]com", "bob.jones@example[.]com"),
    Planted(
        "email-plus-tag",
        "email",
        "carol+invoices@shop.example.com",
        "carol+invoices@shop.example.com",
    ),
    Planted("email-idn", "email", "иван.петров@почта.рф", "иван.петров@почта.рф"),
    Planted("email-accented", "email", "josé.garcía@correo.es", "josé.garcía@correo.es"),
    Planted("email-cut", "email", "contact: alice.smith@corp-ma…", "alice.smith@corp-ma"),
    # encoded as a URL or an HTML page has it
    Planted(
        "email-percent",
        "email",
        "GET /unsubscribe?email=kim%40example.com&list=7",
        "kim%40example.com",
        "content",
        ("kim@example.com",),
    ),
    Planted(
        "email-percent-dot",
        "email",
        "mailto:lee%40mail%2Eexample%2Eorg",
        "lee%40mail%2Eexample%2Eorg",
        also=("lee@mail.example.org",),
    ),
    Planted(
        "email-html-decimal",
        "email",
        "<a>kim&#64;example.com</a>",
        "kim&#64;example.com",
        "prompt",
        ("kim@example.com",),
    ),
    Planted(
        "email-html-hex",
        "email",
        "reply to ana&#x40;corp&#x2e;net please",
        "ana&#x40;corp&#x2e;net",
        also=("ana@corp.net",),
    ),
    Planted(
        "email-html-named",
        "email",
        "contact: raj&commat;example&period;in",
        "raj&commat;example&period;in",
        "content",
        ("raj@example.in",),
    ),
    # -- card numbers split or disguised ------------------------------------------------------
    Planted(
        "card-split-spaces",
        "credit_card",
        "card 4111 1111\n1111 1111 exp 12/29",
        "4111 1111\n1111 1111",
        "content",
        ("4111111111111111",),
    ),
    Planted(
        "card-split-dashes",
        "credit_card",
        "5500-0000-0000-\n0004 on file",
        "5500-0000-0000-\n0004",
        also=("5500000000000004",),
    ),
    Planted(
        "card-wrapped",
        "credit_card",
        "num 37828224\n6310005 ok",
        "37828224\n6310005",
        also=("378282246310005",),
    ),
    Planted(
        "card-crlf",
        "credit_card",
        "6011 1111 1111\r\n1117",
        "6011 1111 1111\r\n1117",
        also=("6011111111111117",),
    ),
    Planted(
        "card-escaped-newline",
        "credit_card",
        "card 4012 8888\\n8888 1881",
        "4012 8888\\n8888 1881",
        also=("4012888888881881",),
    ),
    Planted(
        "card-nbsp",
        "credit_card",
        "card 5105\u00a01051\u00a00510\u00a05100",
        "5105\u00a01051\u00a00510\u00a05100",
        also=("5105105105105100",),
    ),
    Planted(
        "card-fullwidth",
        "credit_card",
        "カード ４２４２４２４２４２４２４２４２",
        "４２４２４２４２４２４２４２４２",
        also=("4242424242424242",),
    ),
    Planted(
        "card-dotted",
        "credit_card",
        "6011.0009.9013.9424",
        "6011.0009.9013.9424",
        also=("6011000990139424",),
    ),
    Planted(
        "card-en-dash",
        "credit_card",
        "3566–0020–2036–0505",
        "3566–0020–2036–0505",
        also=("3566002020360505",),
    ),
    # -- what a string cut in the middle of a secret leaves -----------------------------------
    Planted("cut-sk-proj", "api_key", "key sk-proj-Ab3dE5gH7j", "sk-proj-Ab3dE5gH7j"),
    Planted("cut-sk", "api_key", "OPENAI_API_KEY=sk-ab3dE5gH7j [truncated]", "sk-ab3dE5gH7j"),
    Planted("cut-ghp", "api_key", "token ghp_R7tY2uI9oP4a…", "ghp_R7tY2uI9oP4a"),
    Planted("cut-akia", "api_key", "aws key AKIAIOSFODNN7…", "AKIAIOSFODNN7"),
    Planted("cut-hf", "api_key", "HF token hf_AbCdEfGhIj12", "hf_AbCdEfGhIj12"),
    Planted("cut-bearer", "api_key", "Authorization: Bearer 7fQx2Lm9…", "7fQx2Lm9"),
    Planted(
        "cut-jwt-no-signature", "jwt", f"session {JWT_HEAD}.{JWT_BODY}", f"{JWT_HEAD}.{JWT_BODY}"
    ),
    Planted(
        "cut-jwt-payload",
        "jwt",
        f"session {JWT_HEAD}.{JWT_BODY[:12]}",
        f"{JWT_HEAD}.{JWT_BODY[:12]}",
    ),
    Planted("cut-jwt-header", "jwt", f"auth {JWT_HEAD[:14]}", JWT_HEAD[:14]),
    Planted("cut-card", "credit_card", "card on file 4111 1111 1111 11…", "4111 1111 1111 11"),
    Planted("cut-iban", "iban", "iban DE89 3704 0044 05…", "DE89 3704 0044 05"),
    Planted("cut-base64", "high_entropy", "blob: Zq8Xv3Lm9Tp2Rw…", "Zq8Xv3Lm9Tp2Rw"),
    # -- more keys and headers ----------------------------------------------------------------
    Planted(
        "key-basic-header",
        "api_key",
        "Authorization: Basic YWxhZGRpbjpvcGVuc2VzYW1l",
        "YWxhZGRpbjpvcGVuc2VzYW1l",
        "content",
    ),
    Planted(
        "key-slack-webhook",
        "api_key",
        "post to https://hooks.slack.com/services/T0A1B2C3D/B0E4F5G6H/abcdEFGHijklMNOP1234",
        "T0A1B2C3D/B0E4F5G6H/abcdEFGHijklMNOP1234",
    ),
    Planted(
        "key-google-oauth",
        "api_key",
        "token ya29.a0AfH6SMBx3kLq9-Zr8T2pW",
        "ya29.a0AfH6SMBx3kLq9-Zr8T2pW",
    ),
    Planted(
        "key-sendgrid",
        "api_key",
        "SG.abcdefghijklmnopqrstuv.ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789abcdefg",
        "SG.abcdefghijklmnopqrstuv.ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789abcdefg",
    ),
    Planted(
        "key-stripe-webhook", "api_key", "whsec_1a2B3c4D5e6F7g8H9i0J", "whsec_1a2B3c4D5e6F7g8H9i0J"
    ),
]


def record(item: Planted) -> dict[str, Any]:
    """A valid v1 record with the item planted where it says."""
    rec: dict[str, Any] = {
        "id": item.name,
        "messages": [{"role": "user", "content": "Summarize the log."}],
    }
    place, _, key = item.where.partition(":")
    if place == "content":
        rec["messages"][0]["content"] = item.text
    elif place == "prompt":
        rec = {"id": item.name, "api": "completions", "prompt": item.text}
    elif place == "args":
        rec["messages"] += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "run", "arguments": json.dumps({key: item.text})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "done"},
        ]
    elif place == "label":
        rec["meta"] = {"source": "support-log", key: item.text}
    else:
        rec["meta"] = {"source": "support-log", "note": item.text}
    return rec


def field(item: Planted) -> str:
    """The ``Finding.field`` the item is found in."""
    place, _, key = item.where.partition(":")
    return {
        "content": "messages.0.content",
        "prompt": "prompt",
        "meta": "meta.note",
        "label": f"meta.{key}",
        "args": f"messages.1.tool_calls.0.function.arguments#{key}",
    }[place]


def jsonl() -> str:
    return "".join(json.dumps(record(p), ensure_ascii=False) + "\n" for p in PLANTED)
