"""Reasoning streams on a real vLLM CPU server: the thinker (``replay.testmodel.thinker``, the
embedded model writing ``<think> value</think> KEY VALUE``) served with
``--reasoning-parser deepseek_r1``, which streams the block as ``delta.reasoning`` and counts
it in ``usage.completion_tokens_details.reasoning_tokens``.

Every figure the client records is checked against the server's own: its token counts and
its own split of the same answer into reasoning and content (asked again without streaming).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from replay.core.records import Result
from replay.serving.client import Client
from replay.serving.local_server import LocalServer
from replay.serving.targets import DEFAULT_MODEL_ARGS, TargetSpec
from replay.traces.importers import load
from replay.traces.trace import Request
from tests.conftest import ROOT, url_targets

pytestmark = pytest.mark.vllm

PARSER = ("--reasoning-parser", "deepseek_r1")


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    from replay.testmodel.thinker import ensure_thinker_model

    spec = TargetSpec(
        name="thinker",
        model=str(ensure_thinker_model()),
        args=(*DEFAULT_MODEL_ARGS, *PARSER),
        expect_cache_dtype="auto",
    )
    server = LocalServer(spec, tmp_path_factory.mktemp("servers") / "thinker.log")
    server.start()
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def retrieval(n: int) -> list[Request]:
    reqs = load(ROOT / "traces" / "testmodel_heldout.jsonl").requests
    return [r for r in reqs if r.task == "retrieval"][:n]


def stream(server: LocalServer, reqs: list[Request]) -> list[Result]:
    async def go() -> list[Result]:
        client = Client(server.url, str(server.spec.model), timeout_s=120.0)
        try:
            return [await client.send(r, Result(r.id, "thinker", "p", "b", 0.0)) for r in reqs]
        finally:
            await client.close()

    return asyncio.run(go())


def server_says(server: LocalServer, req: Request) -> dict[str, Any]:
    """The server's own answer to the same request, not streamed: its message (reasoning and
    content as its parser split them) and its usage."""

    async def go() -> dict[str, Any]:
        body = {
            "model": server.spec.model,
            "messages": list(req.messages or ()),
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "seed": 0,
            **req.params,
        }
        url = f"{server.url}/v1/chat/completions"
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
            assert resp.status == 200, await resp.text()
            doc: dict[str, Any] = await resp.json()
            return doc

    return asyncio.run(go())


def test_reasoning_fields_match_the_servers_own_counts(thinker: LocalServer) -> None:
    reqs = retrieval(6)
    for req, result in zip(reqs, stream(thinker, reqs), strict=True):
        assert result.status == "ok", result.error
        said = server_says(thinker, req)
        message, usage = said["choices"][0]["message"], said["usage"]
        # The server's split of the answer, and its counts.
        assert result.reasoning_text == message["reasoning"] == " value"
        assert result.output_text == message["content"]
        assert result.output_tokens == usage["completion_tokens"] == 6
        assert result.reasoning_tokens == usage["completion_tokens_details"]["reasoning_tokens"]
        assert result.reasoning_tokens == 1 and not result.reasoning_tokens_estimated
        # TTFT is the reasoning token; the answer comes after it; ITL covers both.
        assert result.first_token is not None and result.first_answer_token is not None
        assert result.sent is not None and result.sent < result.first_token
        # Equal when both came in one read (a busy machine: shared_stamps), else in order.
        assert result.first_token <= result.first_answer_token
        assert result.chunk_times[0] == result.first_token
        # Every token is in an arrival: <think> and </think> have no text of their own, so
        # they go with the next chunk's; EOS comes with the last answer chunk, or after it in
        # a chunk of its own (no text: counted, no arrival).
        assert sum(result.chunk_tokens) in (result.output_tokens - 1, result.output_tokens)
        # Grading reads the answer: the fact is in it, not in the reasoning.
        fact = str((req.check or {})["fact"])
        assert fact in result.output_text and fact not in result.reasoning_text


def test_reasoning_cut_by_max_tokens_is_an_ok_answer_without_text(thinker: LocalServer) -> None:
    """max_tokens 2: ``<think> value`` and then the limit, before any answer, with the
    server's usage on every chunk. (The replay always asks for usage and a record's params
    may not turn it off; a server that sends none is
    tests/unit/serving/test_reasoning_stream.py's.)"""
    (req,) = retrieval(1)
    cut = req.model_copy(update={"max_tokens": 2})
    (result,) = stream(thinker, [cut])
    assert (result.status, result.error) == ("ok", None)
    assert result.finish_reason == "length" and result.output_text == ""
    assert result.reasoning_text == " value" and result.first_answer_token is None
    assert result.reasoning_tokens == 1 and not result.reasoning_tokens_estimated
    assert result.output_tokens == 2 and not result.tokens_estimated


def test_a_replay_run_reports_time_to_answer_and_reasoning(
    thinker: LocalServer, tmp_path: Path
) -> None:
    """The command line against the server: the summary's buckets carry the reasoning block,
    results.jsonl the new fields, and the retrieval checks pass on the answers."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(json.dumps(r.model_dump(exclude_none=True)) + "\n" for r in retrieval(8))
    )
    targets = url_targets(tmp_path / "targets.toml", {"thinker": thinker})
    cmd = [
        sys.executable,
        "-m",
        "replay.cli",
        "--trace",
        str(trace),
        "--targets-file",
        str(targets),
        "--targets",
        "thinker",
        "--buckets",
        "256,1K",
        "--concurrency",
        "2",
        "--no-teacher-forced",
        "--out",
        str(tmp_path),
        "--run-id",
        "think",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    run = tmp_path / "think"
    assert (run / "summary.json").exists(), proc.stdout + proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    (phase,) = summary["targets"]["thinker"]["phases"].values()
    buckets = phase["buckets"]
    assert sum(b["requests"] for b in buckets.values()) == 8
    for b in buckets.values():
        r = b["reasoning"]
        assert r["answers"] == b["ok"] == b["requests"] and r["tokens"] == b["ok"]
        # The reasoning token comes first; the answer's first token may share its read (one
        # stamp) when the client's loop is slow, so the answer is never earlier, not always later.
        assert r["time_to_answer_ms"]["p50"] >= b["ttft_ms"]["p50"]
        assert r["no_answer"] == 0 and not r["tokens_estimated"]
    results = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    assert all(x["first_answer_token"] >= x["first_token"] for x in results)
    grades = [json.loads(line) for line in (run / "grades.jsonl").read_text().splitlines()]
    assert len(grades) == 8 and all(g["grade"]["passed"] for g in grades)
    assert "First answer token p50 / p90 (ms)" in (run / "report.md").read_text()
    assert "reasoning" not in summary  # one target: nothing to compare its reasoning with
