"""A target's credentials (replay/serving/targets.py, endpoints.py, client.py): user-info sent
as Basic auth and taken off the URL, a query kept after every endpoint's path, a key from the
environment that fits one header line, and none of them in what is written."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest

from replay.core.errors import ConfigError
from replay.core.records import Result
from replay.serving.client import Client
from replay.serving.endpoints import endpoint_url
from replay.serving.targets import TargetSpec, load_targets_config, parse_targets
from replay.traces.trace import Request
from tests.support.fault_server import ScriptedServer

SECRET = "s3cret-T0KEN"
REQ = Request(id="r", api="completions", prompt="hello", max_tokens=4)


def test_user_info_becomes_basic_auth_and_the_query_stays_on_the_url() -> None:
    (spec,) = parse_targets(f"gw=http://me:{SECRET}@127.0.0.1:9/gw/?api_key={SECRET}", None)
    assert spec.connect_url == f"http://127.0.0.1:9/gw/?api_key={SECRET}"
    token = base64.b64encode(f"me:{SECRET}".encode()).decode()
    assert spec.auth_headers() == {"Authorization": f"Basic {token}"}
    assert spec.describe()["url"] == "http://***@127.0.0.1:9/gw/?api_key=***"
    assert SECRET not in repr(spec.describe())


@pytest.mark.parametrize(
    ("base", "path", "url"),
    [
        ("http://h:1", "/v1/models", "http://h:1/v1/models"),
        ("http://h:1/", "/metrics", "http://h:1/metrics"),
        ("http://h:1/gw?api_key=T", "/v1/models", "http://h:1/gw/v1/models?api_key=T"),
        ("http://h:1/?a=1&b=2", "/tokenize", "http://h:1/tokenize?a=1&b=2"),
    ],
)
def test_an_endpoint_is_joined_to_the_urls_path_and_its_query_follows(
    base: str, path: str, url: str
) -> None:
    assert endpoint_url(base, path) == url


def sse_answer(echo: bytes) -> ScriptedServer:
    """Every request answered 401, quoting what the server was sent."""
    body = b'{"error": {"message": "refused: ' + echo + b'"}}'
    head = b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\n"
    answer = head + b"content-length: %d\r\n\r\n%s" % (len(body), body)
    return ScriptedServer(lambda _n: ([(0.0, answer)], False))


def test_the_client_sends_the_query_after_the_path_and_records_no_echoed_secret() -> None:
    echo = f"/gw/v1/completions?api_key={SECRET} Bearer key-{SECRET}".encode()

    async def go(url: str) -> Result:
        client = Client(url, "m", headers={"Authorization": f"Bearer key-{SECRET}"})
        try:
            return await client.send(REQ, Result("r", "t", "p", "b", 0.0))
        finally:
            await client.close()

    with sse_answer(echo).running() as server:
        result = asyncio.run(go(f"{server.url}/gw?api_key={SECRET}"))
    assert server.paths == [f"/gw/v1/completions?api_key={SECRET}"]
    assert result.status == "error" and "HTTP 401" in (result.error or ""), result.error
    assert SECRET not in (result.error or "") and "***" in (result.error or ""), result.error


def test_the_client_refuses_user_info_it_would_not_send() -> None:
    with pytest.raises(ValueError, match=r"http://\*\*\*@h:1.*Authorization header") as info:
        Client(f"http://me:{SECRET}@h:1", "m")
    assert SECRET not in str(info.value)


@pytest.mark.parametrize(
    ("key", "problem"),
    [("sk\r\nX-Injected: 1", "a line break"), ("sk\x1b[2J", "a control character")],
)
def test_a_key_that_does_not_fit_a_header_line_is_refused_naming_the_variable(
    key: str, problem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVC_UNIT_KEY", key)
    spec = TargetSpec(name="remote", url="http://127.0.0.1:9", api_key_env="KVC_UNIT_KEY")
    with pytest.raises(ConfigError) as info:
        spec.auth_headers()
    said = str(info.value)
    assert "KVC_UNIT_KEY (api_key_env)" in said and problem in said and "\n" not in said
    assert "set it to the key alone" in said and key not in said


def test_a_targets_file_with_user_info_and_a_key_variable_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "t.toml"
    p.write_text(f'[targets.r]\nurl = "http://me:{SECRET}@h:1"\napi_key_env = "K"\n')
    with pytest.raises(ConfigError, match="give one of them") as info:
        load_targets_config(p)
    assert SECRET not in str(info.value)


def test_a_targets_file_url_with_a_comma_is_refused(tmp_path: Path) -> None:
    """--targets separates URLs with commas, and the redaction ends a URL at one."""
    p = tmp_path / "t.toml"
    p.write_text(f'[targets.r]\nurl = "http://h:1/?k={SECRET},x"\n')
    with pytest.raises(ConfigError, match="holds a comma; percent-encode it") as info:
        load_targets_config(p)
    assert SECRET not in str(info.value)


@pytest.mark.parametrize(
    ("url", "words"),
    [
        (f"http://h:1/?k={SECRET} x", "holds a space"),
        (f"http://h:1/?k={SECRET}#x", "fragment"),
        (f"http://me:{SECRET}@h:port", "is no URL kvcanary can send to"),
        (f"http://me:{SECRET}@:1", "names no host"),
        ("http://h:1/ключ", "non-ASCII"),
    ],
)
def test_a_url_that_would_not_be_sent_as_written_is_refused_redacted(url: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as info:
        parse_targets(f"x={url}", None)
    assert SECRET not in str(info.value)
