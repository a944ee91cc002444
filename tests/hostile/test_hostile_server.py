"""Servers that answer introspection and tokenization with the wrong shape, redirect, refuse
connections or require a key: every case is a recorded target failure or problem that names
the endpoint and what came back, never a crash, and every planned request has a result.

The server is an in-process fake on loopback (only it can be made to answer a list where an
object belongs); the replay runs as the CLI does, in a subprocess, so a traceback or a wrong
exit code is what a user would see.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from replay.cli import EXIT_INPUT, EXIT_OK, EXIT_TARGET_FAILED
from replay.core.errors import EndpointError, TargetError
from replay.rundir.files import read_results
from replay.serving.endpoints import fetch
from replay.serving.introspect import introspect, served_model
from replay.serving.prompt_tokens import token_pool
from replay.traces.importers import load
from tests.conftest import ROOT
from tests.support.fault_server import METRICS, LoopbackServer

KEY = "kvc-test-key-123"
KEY_ENV = "KVC_HOSTILE_TEST_KEY"
ENDPOINTS = (
    "/v1/models",
    "/version",
    "/metrics",
    "/tokenize",
    "/v1/completions",
    "/v1/chat/completions",
)


@dataclass
class Canned:
    """A fixed answer for one path, whatever was asked."""

    body: bytes
    status: int = 200
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


def canned_json(value: Any) -> Canned:
    return Canned(json.dumps(value).encode())


class FakeServer(LoopbackServer):
    """An OpenAI-compatible server on loopback that answers like vLLM unless ``canned`` says
    otherwise for a path; with ``key`` it answers 401 to any call without that bearer key.
    ``seen`` counts calls by path, ``refused`` the ones without the key."""

    def __init__(self, canned: dict[str, Canned] | None = None, key: str | None = None) -> None:
        self.canned = canned or {}
        self.key = key
        self.seen: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()

    @web.middleware
    async def _gate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.seen[request.path] += 1
        if self.key is not None and request.headers.get("Authorization") != f"Bearer {self.key}":
            self.refused[request.path] += 1
            return web.json_response({"error": {"message": "invalid api key"}}, status=401)
        canned = self.canned.get(request.path)
        if canned is not None:
            await request.read()
            return web.Response(
                body=canned.body,
                status=canned.status,
                content_type=canned.content_type,
                headers=canned.headers,
            )
        resp: web.StreamResponse = await handler(request)
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "fake", "root": "fake", "max_model_len": 4096}]}
        )

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "fake-0"})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def _tokenize(self, request: web.Request) -> web.Response:
        n = 8 + len(await request.read()) // 16
        return web.json_response({"tokens": list(range(10, 10 + n)), "count": n})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        if not body.get("stream"):  # teacher-forced scoring: every prompt token top-1
            prompt = body["prompt"]
            lps = [None] + [{str(t): {"logprob": -0.5, "rank": 1}} for t in prompt[1:]]
            return web.json_response(
                {"choices": [{"index": 0, "text": "x", "prompt_logprobs": lps}]}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        events: list[dict[str, Any]] = []
        for n, (text, tok) in enumerate((("ye", 5), ("s", 6)), start=1):
            choice: dict[str, Any] = {
                "index": 0,
                "token_ids": [tok],
                "finish_reason": "stop" if n == 2 else None,
            }
            choice.update({"delta": {"content": text}} if chat else {"text": text})
            events.append(
                {"choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": n}}
            )
        events[0]["prompt_token_ids"] = [1, 2, 3]
        for ev in events:
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._gate])
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        return app


@contextmanager
def fake_server(
    canned: dict[str, Canned] | None = None, key: str | None = None
) -> Iterator[FakeServer]:
    server = FakeServer(canned, key)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def chat_trace(tmp_path: Path) -> Path:
    """Three chat requests and one completions request (text prompts: /tokenize counts)."""
    lines = [
        {"id": f"c{i}", "messages": [{"role": "user", "content": f"say yes {i}"}], "max_tokens": 4}
        for i in range(3)
    ]
    lines.append({"id": "p0", "api": "completions", "prompt": "say yes", "max_tokens": 4})
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


def synth_trace(tmp_path: Path) -> Path:
    """Length-only (Mooncake): its prompts are made of ids from the target's /tokenize."""
    path = tmp_path / "mooncake.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": i, "input_length": 16, "output_length": 2, "hash_ids": [i]})
            + "\n"
            for i in range(3)
        ),
        encoding="utf-8",
    )
    return path


@dataclass
class Replay:
    rc: int
    output: str
    run_dir: Path

    def manifest(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.run_dir / "manifest.json").read_text())
        return data

    def target(self) -> dict[str, Any]:
        target: dict[str, Any] = self.manifest()["targets"]["fake"]
        return target


def replay(tmp_path: Path, trace: Path, url: str, *, key_env: bool = False) -> Replay:
    """The CLI against one target named ``fake`` (with ``api_key_env`` when asked)."""
    toml = tmp_path / "targets.toml"
    toml.write_text(
        f'[targets.fake]\nurl = "{url}"\n' + (f'api_key_env = "{KEY_ENV}"\n' if key_env else ""),
        encoding="utf-8",
    )
    env = {**os.environ, KEY_ENV: KEY, "NO_COLOR": "1", "COLUMNS": "1000"}  # no wrapping
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "replay.cli",
            "--trace",
            str(trace),
            "--targets",
            "fake",
            "--targets-file",
            str(toml),
            "--out",
            str(tmp_path / "runs"),
            "--run-id",
            "r",
            "--concurrency",
            "2",
            "--timeout",
            "20",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return Replay(proc.returncode, proc.stdout + proc.stderr, tmp_path / "runs" / "r")


def assert_accounted(run: Replay, trace: Path, status: str) -> list[Any]:
    """A manifest, a summary, and exactly one result per request of the trace."""
    assert "Traceback" not in run.output, run.output
    assert (run.run_dir / "manifest.json").is_file()
    assert (run.run_dir / "summary.json").is_file()
    results = list(read_results(run.run_dir))
    ids = [r.id for r in load(trace).requests]
    assert Counter(r.request_id for r in results) == Counter(ids)
    assert {r.status for r in results} == {status}, {(r.status, r.error) for r in results}
    return results


def test_key_goes_to_every_endpoint_of_the_target(tmp_path: Path) -> None:
    """A server that 401s any call without the key: with api_key_env every request is ok,
    and no endpoint was ever called without it."""
    with fake_server(key=KEY) as srv:
        run = replay(tmp_path, chat_trace(tmp_path), srv.url, key_env=True)
        refused, seen = dict(srv.refused), dict(srv.seen)
    assert run.rc == EXIT_OK, run.output
    assert_accounted(run, chat_trace(tmp_path), "ok")
    assert refused == {}
    assert set(ENDPOINTS) <= set(seen), seen  # teacher-forced scoring is /v1/completions too
    target = run.target()
    assert target["model_id"] == "fake" and target["engine_version"] == "fake-0"
    assert target["cache_config"]["cache_dtype"] == "fp8"
    assert target["problems"] == []
    assert target["scrape_failures"] == 0
    assert KEY not in (run.run_dir / "manifest.json").read_text()


def test_synthetic_prompts_use_the_key_for_the_token_pool(tmp_path: Path) -> None:
    with fake_server(key=KEY) as srv:
        trace = synth_trace(tmp_path)
        run = replay(tmp_path, trace, srv.url, key_env=True)
        refused = dict(srv.refused)
    assert run.rc == EXIT_OK, run.output
    assert_accounted(run, trace, "ok")
    assert refused == {}


def test_without_the_key_the_failure_names_the_endpoint_and_status(tmp_path: Path) -> None:
    with fake_server(key=KEY) as srv:
        trace = chat_trace(tmp_path)
        run = replay(tmp_path, trace, srv.url)
    assert run.rc == EXIT_TARGET_FAILED, run.output
    results = assert_accounted(run, trace, "error")
    assert {r.error_kind for r in results} == {"unavailable"}
    assert all("GET /v1/models: HTTP 401" in (r.error or "") for r in results)
    assert "invalid api key" in run.target()["reason"]


# path -> canned answer, words the reason must hold (the endpoint and what came back)
TARGET_FAILURES = {
    "models-list": (
        "/v1/models",
        canned_json([{"id": "fake"}]),
        'GET /v1/models: expected an object with a "data" list, got \'[{"id"',
    ),
    "models-data-of-strings": (
        "/v1/models",
        canned_json({"data": ["fake"]}),
        "GET /v1/models: expected data[0] to be an object",
    ),
    "models-id-a-number": (
        "/v1/models",
        canned_json({"data": [{"id": 5}]}),
        'non-empty string "id", got \'{"data": [{"id": 5}]}\'',
    ),
    "models-empty": (
        "/v1/models",
        canned_json({"data": []}),
        "at least one model listed, got '{\"data\": []}'",
    ),
    "models-html": (
        "/v1/models",
        Canned(b"<html><body>login</body></html>", content_type="text/html"),
        "GET /v1/models: expected JSON, got '<html><body>login",
    ),
    "models-redirect": (
        "/v1/models",
        Canned(b"", status=302, headers={"Location": "http://elsewhere.test/v1"}),
        "GET /v1/models: HTTP 302 redirect to 'http://elsewhere.test/v1': not followed",
    ),
}


@pytest.mark.parametrize("case", list(TARGET_FAILURES))
def test_unusable_models_answer_fails_the_target(case: str, tmp_path: Path) -> None:
    path, canned, words = TARGET_FAILURES[case]
    trace = chat_trace(tmp_path)
    with fake_server({path: canned}) as srv:
        run = replay(tmp_path, trace, srv.url)
        seen = dict(srv.seen)
    assert run.rc == EXIT_TARGET_FAILED, run.output
    results = assert_accounted(run, trace, "error")
    assert {r.error_kind for r in results} == {"unavailable"}
    assert all(words in (r.error or "") for r in results), {r.error for r in results}
    target = run.target()
    assert target["status"] == "failed" and words in target["reason"]
    assert words in run.output  # the CLI says why, not only the run directory
    assert "/v1/chat/completions" not in seen  # nothing sent to a target without a model


@pytest.mark.parametrize(
    ("shape", "words"),
    [
        ([1, 2, 3], "got '[1, 2, 3]'"),
        ({"tokens": 5}, "got '{\"tokens\": 5}'"),
        ({"tokens": [1, 2]}, "too small"),
    ],
)
def test_unusable_tokenize_fails_a_synthetic_trace(shape: Any, words: str, tmp_path: Path) -> None:
    trace = synth_trace(tmp_path)
    with fake_server({"/tokenize": canned_json(shape)}) as srv:
        run = replay(tmp_path, trace, srv.url)
    assert run.rc == EXIT_TARGET_FAILED, run.output
    results = assert_accounted(run, trace, "error")
    assert {r.error_kind for r in results} == {"unavailable"}
    reason = run.target()["reason"]
    assert "POST /tokenize" in reason and words in reason, reason


@pytest.mark.parametrize("shape", [[1, 2, 3], {"tokens": 5}, {"tokens": ["a"]}])
def test_unusable_tokenize_leaves_text_prompts_uncounted(shape: Any, tmp_path: Path) -> None:
    """Text prompts are sent as text: a /tokenize that cannot count them costs the bucket
    (recorded as a problem), not the replay."""
    trace = chat_trace(tmp_path)
    with fake_server({"/tokenize": canned_json(shape)}) as srv:
        run = replay(tmp_path, trace, srv.url)
    assert run.rc == EXIT_OK, run.output
    results = assert_accounted(run, trace, "ok")
    assert {r.bucket for r in results} == {"unknown"}
    target = run.target()
    assert target["tokens_counted"] == 0
    assert any(
        p.startswith("4 of 4 prompt(s) not counted") and "POST /tokenize: expected" in p
        for p in target["problems"]
    ), target["problems"]


@pytest.mark.parametrize(
    ("path", "canned", "words"),
    [
        (
            "/version",
            canned_json(["0.1"]),
            'GET /version: expected an object with a string "version", got \'["0.1"]\'',
        ),
        ("/version", canned_json({"version": {"major": 0}}), "GET /version: expected"),
        (
            "/metrics",
            Canned(b"\xff\xfe\x00garbage", content_type="text/plain"),
            "GET /metrics: expected UTF-8 Prometheus text",
        ),
        (
            "/metrics",
            Canned(b"{{{ not prometheus", content_type="text/plain"),
            "GET /metrics: not Prometheus text",
        ),
        (
            "/metrics",
            Canned(b"", status=307, headers={"Location": "http://elsewhere.test/m"}),
            "GET /metrics: HTTP 307 redirect to 'http://elsewhere.test/m'",
        ),
    ],
)
def test_unusable_version_or_metrics_is_a_recorded_problem(
    path: str, canned: Canned, words: str, tmp_path: Path
) -> None:
    """What the engine version and the server-side series need, not what the requests need:
    the replay runs, and the manifest says what the endpoint answered."""
    trace = chat_trace(tmp_path)
    with fake_server({path: canned}) as srv:
        run = replay(tmp_path, trace, srv.url)
    assert run.rc == EXIT_OK, run.output
    assert_accounted(run, trace, "ok")
    problems = run.target()["problems"]
    assert any(words in p for p in problems), problems


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_dead_port_says_the_connection_was_refused(tmp_path: Path) -> None:
    trace = chat_trace(tmp_path)
    run = replay(tmp_path, trace, f"http://127.0.0.1:{closed_port()}")
    assert run.rc == EXIT_TARGET_FAILED, run.output
    results = assert_accounted(run, trace, "error")
    reason = run.target()["reason"]
    assert reason.startswith("target unreachable at http://127.0.0.1:"), reason
    assert "Connection refused (ECONNREFUSED)" in reason
    assert "no model" not in reason
    assert all(r.error == reason for r in results)


def test_trace_that_is_a_directory_is_named_so(tmp_path: Path) -> None:
    run = replay(tmp_path, tmp_path, "http://127.0.0.1:9")
    assert run.rc == EXIT_INPUT, run.output
    assert "is a directory" in run.output and "no such trace file" not in run.output


# -- the pieces, without a subprocess ------------------------------------------------------


async def _introspect(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    async with aiohttp.ClientSession(headers=headers) as session:
        return await introspect(session, url)


def test_redirect_is_not_followed_and_the_key_stays_home() -> None:
    """A redirect to another server: the other server sees nothing (not the call, not the
    key), and the problem names where the target pointed."""
    with fake_server() as elsewhere:
        canned = Canned(b"", status=301, headers={"Location": elsewhere.url + "/v1/models"})
        with fake_server({"/v1/models": canned}) as srv:
            info = asyncio.run(_introspect(srv.url, {"Authorization": f"Bearer {KEY}"}))
        assert dict(elsewhere.seen) == {}
    with pytest.raises(TargetError, match=f"HTTP 301 redirect to '{elsewhere.url}/v1/models'"):
        served_model(info)


def test_a_key_the_server_echoes_is_not_recorded() -> None:
    canned = Canned(json.dumps({"error": f"bad key {KEY}"}).encode(), status=403)
    with fake_server({"/v1/models": canned}) as srv:
        info = asyncio.run(_introspect(srv.url, {"Authorization": f"Bearer {KEY}"}))
    assert KEY not in json.dumps(info) and "***" in info["problems"][0]


def test_an_oversized_answer_is_cut_off() -> None:
    big = Canned(b'{"data": [' + b" " * 4096 + b"]}")

    async def go(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            await fetch(session, "GET", url, "/v1/models", max_bytes=1024)

    with (
        fake_server({"/v1/models": big}) as srv,
        pytest.raises(EndpointError, match="over the 1024-byte limit"),
    ):
        asyncio.run(go(srv.url))


def test_token_pool_names_what_tokenize_answered() -> None:
    async def go(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            await token_pool(session, url, "fake")

    html = Canned(b"<html>nope</html>", content_type="text/html")
    with (
        fake_server({"/tokenize": html}) as srv,
        pytest.raises(TargetError, match="POST /tokenize: expected JSON, got '<html>nope"),
    ):
        asyncio.run(go(srv.url))


def test_locust_preparation_and_metrics_tap_carry_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Locust adapter's sessions toward the target (preparation, the metrics tap)."""
    from replay.core.buckets import Buckets
    from replay.locust.target import MetricsTap, prepare
    from replay.serving.targets import TargetSpec

    monkeypatch.setenv(KEY_ENV, KEY)
    reqs = load(ROOT / "traces" / "sample.jsonl").requests[:4]
    snaps: list[dict[str, Any]] = []

    async def go(url: str) -> tuple[Any, dict[str, Any], int]:
        spec = TargetSpec(name="fake", url=url, api_key_env=KEY_ENV)
        prepared = await prepare(spec, reqs, Buckets.parse("256,1K"))
        tap = MetricsTap(spec, lambda: 0.0, snaps.append)
        info = await tap.start()
        return prepared, info, await tap.stop()

    with fake_server(key=KEY) as srv:
        prepared, info, failures = asyncio.run(go(srv.url))
        refused = dict(srv.refused)
    assert refused == {}
    assert prepared.model == "fake" and info["model_id"] == "fake"
    assert prepared.info["tokens_counted"] == len(reqs) and failures == 0 and snaps


def test_locust_preparation_fails_with_the_endpoint_named() -> None:
    from replay.core.buckets import Buckets
    from replay.locust.target import prepare
    from replay.serving.targets import TargetSpec

    reqs = load(ROOT / "traces" / "sample.jsonl").requests[:2]

    async def go(url: str) -> None:
        await prepare(TargetSpec(name="fake", url=url), reqs, Buckets.parse("256,1K"))

    with (
        fake_server({"/v1/models": canned_json([1])}) as srv,
        pytest.raises(
            TargetError, match=r"no model served by .*GET /v1/models: expected an object"
        ),
    ):
        asyncio.run(go(srv.url))
    with pytest.raises(TargetError, match="Connection refused"):
        asyncio.run(go(f"http://127.0.0.1:{closed_port()}"))


@pytest.mark.parametrize(
    ("canned", "words"),
    [
        (
            canned_json([1, 2]),
            "POST /v1/completions: no prompt_logprobs in the response; got '[1, 2]'",
        ),
        (canned_json({"choices": [{"prompt_logprobs": "x"}]}), "has the wrong length; got"),
        (
            Canned(b"", status=302, headers={"Location": "http://elsewhere.test/"}),
            "POST /v1/completions: HTTP 302 redirect to 'http://elsewhere.test/'",
        ),
    ],
)
def test_teacher_forced_scoring_names_what_came_back(canned: Canned, words: str) -> None:
    from replay.run.teacher import score_tokens

    async def go(url: str) -> str | None:
        async with aiohttp.ClientSession() as session:
            return (await score_tokens(session, url, "fake", [1, 2], [3, 4])).error

    with fake_server({"/v1/completions": canned}) as srv:
        error = asyncio.run(go(srv.url))
    assert error is not None and words in error, error
