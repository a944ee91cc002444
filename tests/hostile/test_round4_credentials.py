"""Credentials never reach disk or the terminal (issue 42, round 4), and the server still gets
them on every call.

A target's credential comes one of four ways: user-info in its URL (sent as HTTP Basic auth),
a query in its URL (kept on every request, after the path), a key in an environment variable
(``api_key_env``, sent as a Bearer header), or user-info and query together in a targets file.
For each, a planted canary secret runs end to end against a loopback server that refuses any
call without it, and which echoes the request (its path, query and Authorization header) in
the errors it gives, as some gateways do. The run must complete, and the canary must appear in
no file the run writes, nor on stdout or stderr.

A key that would not fit one header line (CR, LF, any control character) is refused before
anything is sent, in one line naming the variable and the fix, without a traceback.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from replay.cli import EXIT_INPUT, EXIT_OK
from replay.rundir.files import read_results
from replay.serving.endpoints import QUOTE_BYTES
from replay.serving.introspect import introspect
from tests.conftest import ROOT
from tests.hostile.test_hostile_server import Canned, FakeServer, fake_server

USER = "kvc-user"
CANARY = "kvcCanary7Q2x9Zr4"  # letters and digits: no URL escaping hides it from the search
KEY_ENV = "KVC_ROUND4_KEY"
ECHO = "echo the request back"  # a prompt the server answers with an error quoting the request
PREFIX = "/gw"  # a gateway's path in front of the API: endpoints are joined after it


class GatedServer(FakeServer):
    """vLLM's shape of answer, at the root and behind a gateway's path (``/gw``), to a request
    ``allowed`` lets through; 401 to any other. Where an error is given (/version always, and a
    chat request asking for ``ECHO``), it quotes the request's path, query and Authorization
    header, as a careless gateway does. ``seen`` and ``refused`` count by the endpoint."""

    def __init__(self, allowed: Callable[[web.Request], bool]) -> None:
        super().__init__()
        self.allowed = allowed

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._gate])
        for prefix in ("", PREFIX):
            app.router.add_get(prefix + "/v1/models", self._models)
            app.router.add_get(prefix + "/version", self._version)
            app.router.add_get(prefix + "/metrics", self._metrics)
            app.router.add_post(prefix + "/tokenize", self._tokenize)
            app.router.add_post(prefix + "/v1/completions", self._complete)
            app.router.add_post(prefix + "/v1/chat/completions", self._complete)
        return app

    @web.middleware
    async def _gate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        endpoint = request.path.removeprefix(PREFIX)
        self.seen[endpoint] += 1
        said = f"{request.path_qs} with {request.headers.get('Authorization', 'no auth')}"
        if not self.allowed(request):
            self.refused[endpoint] += 1
            return web.json_response({"error": {"message": f"refused {said}"}}, status=401)
        if endpoint == "/version":
            return web.Response(text=f"no version here: {said}", status=500)
        if endpoint == "/v1/chat/completions" and ECHO in (await request.text()):
            return web.json_response({"error": {"message": f"rejected {said}"}}, status=400)
        resp: web.StreamResponse = await handler(request)
        return resp


@contextmanager
def gated(allowed: Callable[[web.Request], bool]) -> Iterator[GatedServer]:
    server = GatedServer(allowed)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def basic(password: str) -> str:
    return "Basic " + base64.b64encode(f"{USER}:{password}".encode()).decode()


@dataclass(frozen=True)
class Way:
    """One way a credential is given: the check the server makes, and the replay's target."""

    allowed: Callable[[web.Request], bool]
    url: Callable[[str], str]  # the target URL, from the server's http://127.0.0.1:PORT
    in_file: bool = False  # given in a targets file, not on --targets
    key_env: bool = False
    args: tuple[str, ...] = ()


WAYS = {
    "url-user-info": Way(
        lambda r: r.headers.get("Authorization") == basic(CANARY),
        lambda base: base.replace("http://", f"http://{USER}:{CANARY}@") + PREFIX,
    ),
    "url-query": Way(
        lambda r: r.query.get("api_key") == CANARY,
        lambda base: f"{base}{PREFIX}?api_key={CANARY}",
    ),
    "url-query-load-processes": Way(
        lambda r: r.query.get("api_key") == CANARY,
        lambda base: f"{base}{PREFIX}?api_key={CANARY}",
        args=("--workers", "2"),  # the requests are sent from processes of their own
    ),
    "api-key-env": Way(
        lambda r: r.headers.get("Authorization") == f"Bearer {CANARY}",
        lambda base: base,
        in_file=True,
        key_env=True,
    ),
    "targets-file-user-info-and-query": Way(
        lambda r: r.headers.get("Authorization") == basic(CANARY) and r.query.get("t") == CANARY,
        lambda base: base.replace("http://", f"http://{USER}:{CANARY}@") + f"/?t={CANARY}",
        in_file=True,
    ),
}


def trace(tmp_path: Path) -> Path:
    """Three chat requests, one on completions, and one the server rejects quoting it."""
    lines: list[dict[str, Any]] = [
        {"id": f"c{i}", "messages": [{"role": "user", "content": f"say yes {i}"}], "max_tokens": 4}
        for i in range(3)
    ]
    lines.append({"id": "p0", "api": "completions", "prompt": "say yes", "max_tokens": 4})
    lines.append({"id": "echo", "messages": [{"role": "user", "content": ECHO}], "max_tokens": 4})
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


def replay(
    tmp_path: Path, way: Way, url: str, key: str = CANARY
) -> subprocess.CompletedProcess[str]:
    """The CLI against the target ``fake``, given as ``way`` says (teacher-forced scoring on:
    its calls are the non-streaming endpoints' too)."""
    targets = ["--targets", f"fake={url}"]
    if way.in_file:
        toml = tmp_path / "targets.toml"
        key_line = f'api_key_env = "{KEY_ENV}"\n' if way.key_env else ""
        toml.write_text(f'[targets.fake]\nurl = "{url}"\n{key_line}', encoding="utf-8")
        targets = ["--targets", "fake", "--targets-file", str(toml)]
    env = {**os.environ, KEY_ENV: key, "NO_COLOR": "1", "COLUMNS": "1000"}
    return subprocess.run(
        [sys.executable, "-m", "replay.cli", "--trace", str(trace(tmp_path)), *targets,
         "--out", str(tmp_path / "runs"), "--run-id", "r", "--concurrency", "2",
         "--timeout", "20", "--max-error-rate", "0.5", *way.args],  # the echo request fails
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip


def planted(secret: str) -> list[bytes]:
    """The secret as it could be written: itself, and inside the Basic header it travels in."""
    return [secret.encode(), basic(secret).removeprefix("Basic ").encode()]


def leaks(run_dir: Path, output: str, secret: str) -> list[str]:
    """Every file of the run, and the terminal, that holds the secret in any of its forms."""
    forms = planted(secret)
    found = [
        str(path.relative_to(run_dir))
        for path in sorted(run_dir.rglob("*"))
        if path.is_file() and any(f in path.read_bytes() for f in forms)
    ]
    return found + (["stdout/stderr"] if any(f.decode() in output for f in forms) else [])


@pytest.mark.parametrize("how", list(WAYS))
def test_a_planted_secret_reaches_the_server_on_every_call_and_no_file_or_terminal(
    how: str, tmp_path: Path
) -> None:
    way = WAYS[how]
    with gated(way.allowed) as server:
        done = replay(tmp_path, way, way.url(server.url))
        refused, seen = dict(server.refused), dict(server.seen)
    output = done.stdout + done.stderr
    assert done.returncode == EXIT_OK, output
    assert "Traceback" not in output, output
    # The run completed against a server that needs the credential: every call carried it.
    assert refused == {}, refused
    assert {"/v1/models", "/tokenize", "/metrics", "/v1/completions"} <= set(seen), seen
    run_dir = tmp_path / "runs" / "r"
    results = {r.request_id: r for r in read_results(run_dir)}
    assert {rid for rid, r in results.items() if r.status == "ok"} == {"c0", "c1", "c2", "p0"}
    assert "HTTP 400" in (results["echo"].error or "") and "***" in (results["echo"].error or "")
    assert (run_dir / "report.html").is_file() and (run_dir / "grades.jsonl").is_file()
    assert leaks(run_dir, output, CANARY) == []
    manifest = json.loads((run_dir / "manifest.json").read_text())
    target = manifest["targets"]["fake"]
    assert any("GET /version: HTTP 500" in p and "***" in p for p in target["problems"])
    if not way.key_env:  # the URL is written with its credentials hidden, not dropped
        assert "***" in target["spec"]["url"], target["spec"]["url"]


BAD_KEYS = {
    "crlf": "sk-abc\r\nX-Injected: 1",
    "lf": "sk-abc\n",
    "cr": "sk-abc\rdef",
    "tab": "sk-abc\tdef",
    "esc": "sk-abc\x1b[2Jdef",
    "del": "sk-abc\x7fdef",
    "c1": "sk-abc\x85def",
}


@pytest.mark.parametrize("case", list(BAD_KEYS))
def test_a_key_that_does_not_fit_a_header_line_is_refused_in_one_line(
    case: str, tmp_path: Path
) -> None:
    way = WAYS["api-key-env"]
    with gated(lambda r: True) as server:
        done = replay(tmp_path, way, server.url, key=BAD_KEYS[case])
        seen = dict(server.seen)
    output = done.stdout + done.stderr
    assert done.returncode == EXIT_INPUT, output
    assert "Traceback" not in output, output
    assert seen == {}  # refused before anything was sent
    said = [line for line in output.splitlines() if KEY_ENV in line]
    assert len(said) == 1, output
    assert "api_key_env" in said[0] and "set it to the key alone" in said[0], said
    kind = "a line break" if case in ("crlf", "lf", "cr") else "a control character"
    assert kind in said[0], said
    assert "sk-abc" not in output  # the key itself is never shown


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://127.0.0.1:9/?api_key=a b", "holds a space or a line break"),
        (f"http://127.0.0.1:9/?api_key={CANARY}#frag", "fragment, which is never sent"),
        (f"http://{USER}:{CANARY}@127.0.0.1:http/", "is no URL kvcanary can send to"),
    ],
)
def test_a_target_url_that_cannot_be_sent_as_written_is_refused_without_its_secret(
    url: str, words: str, tmp_path: Path
) -> None:
    done = replay(tmp_path, WAYS["url-query"], url)
    output = done.stdout + done.stderr
    assert done.returncode == EXIT_INPUT, output
    assert words in output and "Traceback" not in output, output
    assert CANARY not in output


def test_user_info_and_a_key_variable_together_are_refused(tmp_path: Path) -> None:
    """One Authorization header per request: Basic from the URL or Bearer from the key."""
    way = WAYS["api-key-env"]
    done = replay(tmp_path, way, f"http://{USER}:{CANARY}@127.0.0.1:9")
    output = done.stdout + done.stderr
    assert done.returncode == EXIT_INPUT, output
    assert "give one of them" in output and "Traceback" not in output, output
    assert CANARY not in output


def test_a_secret_the_error_quote_would_cut_in_two_is_still_hidden() -> None:
    """A server's error is quoted to its first QUOTE_BYTES: the echoed key is hidden before
    the cut, or the half before it would be written."""
    head = json.dumps({"error": ""})[:-2]
    pad = "x" * (QUOTE_BYTES - len(head) - len(" key ") - 4)
    canned = Canned(json.dumps({"error": f"{pad} key {CANARY}"}).encode(), status=403)

    async def go(url: str) -> dict[str, Any]:
        auth = {"Authorization": f"Bearer {CANARY}"}
        async with aiohttp.ClientSession(headers=auth) as session:
            return await introspect(session, url)

    with fake_server({"/v1/models": canned}) as server:
        info = asyncio.run(go(server.url))
    assert "HTTP 403" in info["problems"][0]
    assert CANARY[:4] not in json.dumps(info), info["problems"][0]
