"""Ordinary text is left alone: numbers, dates, ids, code, hashes, labels without a secret after
them and near misses of every detector's shape have no findings, and the shipped sample trace
scans clean."""

from __future__ import annotations

import pytest

from replay.tools.anonymize import scan_file, scan_text
from tests.unit.tools.planted import ROOT

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
