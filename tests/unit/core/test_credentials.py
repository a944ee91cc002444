"""The one redaction (replay/core/credentials.py): a URL's user-info and query values, and the
secrets a server may echo, never written; and what a key must be to go into a header."""

from __future__ import annotations

import pytest

from replay.core.credentials import (
    env_for_record,
    header_value_problem,
    redact,
    request_secrets,
    without_user_info,
)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("http://host:8000", "http://host:8000"),
        ("http://host:8000/v1", "http://host:8000/v1"),
        ("http://u:pw@host:8000/v1", "http://***@host:8000/v1"),
        ("https://tok@host", "https://***@host"),
        ("http://u:p@ss@host/", "http://***@host/"),  # an unescaped '@' in the password
        ("http://u:p/ss@host/v1", "http://***@host/v1"),  # an unescaped '/' in it
        ("http://host/?api_key=T0KEN&v=2", "http://host/?api_key=***&v=***"),
        ("http://host/?T0KEN", "http://host/?***"),
        ("http://host/?a=&flag", "http://host/?a=&***"),  # a bare word may be a token
        ("http://host/p#frag", "http://host/p#***"),
        (
            "no model served by http://u:pw@h:1/?k=T0KEN: GET /v1/models: HTTP 404",
            "no model served by http://***@h:1/?k=***: GET /v1/models: HTTP 404",
        ),
        (
            "fake=http://u:pw@h:1,other=HTTPS://h:2/?key=T0KEN",
            "fake=http://***@h:1,other=HTTPS://h:2/?key=***",
        ),
        ("'http://h:1/?k=T0KEN' and then", "'http://h:1/?k=***' and then"),
    ],
)
def test_a_url_in_any_text_is_shown_without_user_info_or_query_values(
    text: str, shown: str
) -> None:
    assert redact(text) == shown


def test_known_secrets_are_replaced_wherever_a_server_echoed_them() -> None:
    said = "rejected /v1/models?api_key=T0KEN-123 with Bearer sk-live-42"
    shown = "rejected /v1/models?api_key=*** with Bearer ***"
    assert redact(said, ["T0KEN-123", "sk-live-42"]) == shown
    # too short to tell from ordinary text: left as it is
    assert redact("status 1 of 2", ["1"]) == "status 1 of 2"


def test_request_secrets_are_the_header_credential_and_the_urls_values_decoded_too() -> None:
    secrets = request_secrets(
        "http://us%40r:p%2Fw@h/?api_key=a%2Bb&flag", {"Authorization": "Bearer sk-1"}
    )
    assert {"sk-1", "us%40r", "us@r", "p%2Fw", "p/w", "a%2Bb", "a+b", "flag"} <= set(secrets)
    assert "" not in secrets


def test_user_info_is_taken_off_the_url_and_decoded() -> None:
    assert without_user_info("http://u%3Ax:p%40ss@h:1/gw?k=v") == (
        "http://h:1/gw?k=v",
        ("u:x", "p@ss"),
    )
    assert without_user_info("http://h:1/?k=v") == ("http://h:1/?k=v", None)
    assert without_user_info("http://tok@h") == ("http://h", ("tok", ""))


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("sk-abc\r\nX-Injected: 1", "a line break (CR or LF)"),
        ("sk-abc\n", "a line break (CR or LF)"),
        ("sk\x00abc", "a control character (U+0000)"),
        ("sk\tabc", "a control character (U+0009)"),
        ("sk\x7fabc", "a control character (U+007F)"),
        ("sk\x85abc", "a control character (U+0085)"),
        ("sk-ключ", "a non-ASCII character (U+043A)"),
        ("sk-ABC_123.x~/+=", None),
    ],
)
def test_a_header_value_is_one_line_of_printable_ascii(value: str, problem: str | None) -> None:
    assert header_value_problem(value) == problem


def test_the_start_of_a_secret_that_a_quote_cut_is_hidden_too() -> None:
    secret = "sk-live-0123456789abcdef"
    cut = f"HTTP 500: 'echo: key={secret[:13]}' ..."
    assert secret[:8] not in redact(cut, [secret])
    assert redact(f"a {secret[:7]} stays", [secret]) == f"a {secret[:7]} stays"
    assert redact(f"x{secret}y {secret[:9]}", [secret]) == "x***y ***"


def test_a_servers_environment_is_recorded_without_its_credentials() -> None:
    env = {"HF_TOKEN": "hf_abcdefgh", "VLLM_CPU_KVCACHE_SPACE": "4", "PROXY": "http://u:p@h:1/"}
    assert env_for_record(env) == {
        "HF_TOKEN": "***",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "PROXY": "http://***@h:1/",
    }
