"""Hostile input, round 4: the stream reader, and the memory a server's claims could size.

A server's claimed token count must not size the analysis's memory (each claimed token is an
ITL gap): a count over the request's max_tokens is that request's protocol error, found
before its tokens are given to anything. Every error shape a server streams is an error, never
a graded answer; a BOM, a ``message`` in place of a ``delta``, content after the finish reason
and a reset after it each leave the answer the model gave, or say why there is none.

The server is ``FakeServer`` (vLLM's shape of answer) with the streamed answer scripted, on
loopback: only a fake can be made to claim a trillion tokens or reset after its last chunk.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from replay.core.records import Result
from replay.serving.accumulator import StreamAccumulator
from replay.serving.client import Client
from replay.serving.sse import ProtocolError, SSEDecoder
from replay.traces.trace import Request
from tests.conftest import ROOT
from tests.hostile.test_hostile_server import FakeServer
from tests.support.promise_run import chat_trace
from tests.unit.serving.test_accounting import Ticks

MAX_TOKENS = 64
CHAT = Request(
    id="r", api="chat", messages=({"role": "user", "content": "hi"},), max_tokens=MAX_TOKENS
)
COMPLETION = Request(id="r", api="completions", prompt="hi", max_tokens=MAX_TOKENS)
BOM = b"\xef\xbb\xbf"


def event(ev: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(ev).encode() + b"\n\n"


def piece(text: str, n: int, finish: str | None = None, *, chat: bool = True) -> bytes:
    """One streamed chunk of ``text``, with usage so far ``n`` (vLLM's continuous usage)."""
    choice: dict[str, Any] = {"index": 0, "token_ids": [5], "finish_reason": finish}
    choice.update({"delta": {"content": text}} if chat else {"text": text})
    return event({"choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": n}})


DONE = b"data: [DONE]\n\n"
ANSWER = "hello world this is a fake answer"


def answer_body(*, chat: bool = True, finish: bool = True) -> list[bytes]:
    """ANSWER in four chunks of one token each, the last with finish_reason stop."""
    words = ["hello wo", "rld this", " is a fake", " answer"]
    return [
        piece(w, n, "stop" if finish and n == len(words) else None, chat=chat)
        for n, w in enumerate(words, start=1)
    ]


# Longer than a test's client waits: a server that holds the line open.
HANG_S = 5.0
GAP_S = 0.01  # between the writes: chunks that come in one read are one arrival


class ScriptedServer(FakeServer):
    """``FakeServer`` whose every streamed answer is ``writes``, ``GAP_S`` apart; with
    ``reset``, a TCP reset follows them where the end of the message belonged; with ``hang``,
    the connection stays open and silent after them."""

    def __init__(self, writes: list[bytes], reset: bool = False, hang: bool = False) -> None:
        super().__init__()
        self.writes, self.reset, self.hang = writes, reset, hang

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for data in self.writes:
            await resp.write(data)
            await asyncio.sleep(GAP_S)
        if self.hang:
            await asyncio.sleep(HANG_S)
        if self.reset:
            await asyncio.sleep(0.2)  # read by the client: a reset drops what is unsent
            assert request.transport is not None
            sock = request.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            request.transport.abort()  # linger 0: the close is a RST, not a FIN
            return resp
        await resp.write_eof()
        return resp


@contextmanager
def scripted(
    writes: list[bytes], reset: bool = False, hang: bool = False
) -> Iterator[ScriptedServer]:
    server = ScriptedServer(writes, reset, hang)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def send(
    writes: list[bytes],
    req: Request = CHAT,
    reset: bool = False,
    hang: bool = False,
    timeout_s: float = 20.0,
) -> Result:
    """``req`` through the real client against a server streaming ``writes``."""

    async def go(url: str) -> Result:
        client = Client(url, "m", timeout_s=timeout_s)
        try:
            return await client.send(req, Result("r", "t", "p", "b", 0.0))
        finally:
            await client.close()

    with scripted(writes, reset, hang) as server:
        return asyncio.run(go(server.url))


# -- 2. a claimed token count sizes nothing ----------------------------------------------------


@pytest.mark.parametrize("claim", [10**6, 10**13])
def test_a_count_over_max_tokens_is_a_protocol_error_before_it_is_given_to_a_chunk(
    claim: int,
) -> None:
    """Millions a chunk (an ok answer on main, its ITL gaps 2 GB in the summary) or 10**13
    (an error on main at 2**40, its chunk counts kept all the same): refused as they come."""
    r = send([piece("a", 1), *(piece("b", claim * k) for k in (1, 2, 3)), DONE])
    assert (r.status, r.error_kind) == ("error", "protocol"), (r.status, r.error)
    assert f"completion_tokens {claim} over the request's max_tokens {MAX_TOKENS}" in (
        r.error or ""
    )
    assert sum(r.chunk_tokens) <= MAX_TOKENS and r.output_tokens <= MAX_TOKENS


def test_the_accumulator_bounds_counts_by_the_max_tokens_it_is_given() -> None:
    r = Result("r", "t", "p", "b", 0.0, sent=0.0)
    acc = StreamAccumulator(r, Ticks(), max_tokens=4)
    ev = {"choices": [{"index": 0, "delta": {"content": "a"}}], "usage": {"completion_tokens": 4}}
    acc.add(ev)
    with pytest.raises(ProtocolError, match="completion_tokens 5 over the request's max_tokens 4"):
        acc.add({**ev, "usage": {"completion_tokens": 5}})
    assert r.chunk_tokens == [4]


# Virtual memory the replay may have: its imports (numpy, pandas) and threads reserve most of
# it (measured: a run against an honest server passes at 0.75 GiB, not at 0.5 GiB); a run
# whose analysis sized an array by the claimed counts needs gigabytes more.
ADDRESS_SPACE = 1 << 30


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


@pytest.mark.parametrize("claim", [10**8, 10**13])
def test_a_run_against_inflated_counts_fits_in_bounded_memory(claim: int, tmp_path: Path) -> None:
    """The whole replay, in a process of 1 GiB of address space: on main the summary's ITL
    gaps (np.repeat over the claimed counts) asked for 6.7 GiB at 10**8 (three requests) and
    terabytes at 10**13, and the run ended in a traceback with no summary and no grades."""
    body = [piece("a", 1), *(piece("b", claim * k) for k in (1, 2, 3))]
    body += [piece("c", 3 * claim + 1, "stop"), DONE]
    trace = chat_trace(tmp_path / "t.jsonl", 3, {"type": "contains", "values": ["a"]})
    with scripted(body) as server:
        done = subprocess.run(
            [sys.executable, "-m", "replay.cli", "--trace", str(trace), "--targets",
             f"fake={server.url}", "--out", str(tmp_path / "runs"), "--run-id", "r",
             "--no-teacher-forced"],
            cwd=ROOT, env={**os.environ, "NO_COLOR": "1", "COLUMNS": "1000"},
            capture_output=True, text=True, timeout=300, check=False, preexec_fn=_limited,
        )  # fmt: skip
    output = done.stdout + done.stderr
    assert "Traceback" not in output and "MemoryError" not in output, output[-3000:]
    run = tmp_path / "runs" / "r"
    assert (run / "summary.json").is_file(), output[-3000:]
    rows = [json.loads(line) for line in (run / "results.jsonl").open()]
    assert len(rows) == 3
    assert {(x["status"], x["error_kind"]) for x in rows} == {("error", "protocol")}
    assert all("over the request's max_tokens 128" in x["error"] for x in rows)


# -- 3. an error in the stream is an error ------------------------------------------------------

ERRORS: dict[str, dict[str, Any]] = {
    "older vLLM": {"object": "error", "message": "KV cache is full", "type": "x", "code": 500},
    "Responses-style": {"type": "error", "message": "KV cache is full", "code": "x"},
}


@pytest.mark.parametrize("shape", list(ERRORS))
def test_an_error_event_after_a_token_is_the_servers_error_not_an_answer(shape: str) -> None:
    """On main the older vLLM shape after one token was an ok answer 'hello ' (and graded)."""
    r = send([piece("hello ", 1), event(ERRORS[shape]), DONE])
    assert (r.status, r.error_kind) == ("error", "server_error"), (r.status, r.error)
    assert r.error == "KV cache is full"


def test_a_finish_reason_of_error_is_the_servers_error() -> None:
    r = send([piece("hello ", 1), piece("", 2, "error"), DONE])
    assert (r.status, r.error_kind) == ("error", "server_error"), (r.status, r.error)
    assert "finish_reason error" in (r.error or "")


# -- 4. answers neither cut nor changed by the stream's shape ---------------------------------


def test_a_bom_before_the_first_event_is_not_part_of_it() -> None:
    """On main the BOM hid the first event's ``data:``: 'rld this is a fake answer'."""
    for req, chat in ((CHAT, True), (COMPLETION, False)):
        r = send([BOM, *answer_body(chat=chat), DONE], req)
        assert (r.status, r.output_text) == ("ok", ANSWER), (r.status, r.error)


def test_a_bom_is_dropped_however_the_reads_cut_it() -> None:
    stream = b"".join([BOM, *answer_body(), DONE])
    for cut in range(1, 8):
        d = SSEDecoder()
        events = [ev for i in range(0, len(stream), cut) for ev in d.feed(stream[i : i + cut])]
        texts = [ev["choices"][0]["delta"]["content"] for ev in events if isinstance(ev, dict)]
        assert "".join(texts) == ANSWER, cut
    # A BOM anywhere but at the start is not dropped: that line is no ``data:`` line.
    d = SSEDecoder()
    assert list(d.feed(piece("a", 1) + BOM + piece("b", 2))) == [json.loads(piece("a", 1)[6:])]


def test_content_in_message_instead_of_delta_is_refused_by_name() -> None:
    """On main: an ok answer of no text with 5 output tokens, silently."""
    chunks = [
        event(
            {
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": w}, "finish_reason": f}
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": n},
            }
        )
        for n, (w, f) in enumerate([("hello ", None), ("world", "stop")], start=1)
    ]
    r = send([*chunks, DONE])
    assert (r.status, r.error_kind) == ("error", "protocol"), (r.status, r.error)
    assert "carried 'message'" in (r.error or "") and "'delta' belongs" in (r.error or "")


def test_content_after_the_finish_reason_is_not_read_and_is_counted() -> None:
    """On main it was appended to the answer. The usage after the finish still counts (vLLM
    sends its last usage alone, after the finish chunk)."""
    tail = [piece(" EXTRA", 5), event({"choices": [], "usage": {"completion_tokens": 6}})]
    r = send([*answer_body(), *tail, DONE])
    assert (r.status, r.output_text, r.finish_reason) == ("ok", ANSWER, "stop"), r.error
    assert r.after_finish == 1 and r.output_tokens == 6
    assert sum(r.chunk_tokens) == 4


def test_a_reset_after_the_finish_reason_keeps_the_complete_answer() -> None:
    """On main: a ``disconnect`` error with the answer's text blanked."""
    r = send(answer_body(), reset=True)
    assert (r.status, r.output_text, r.finish_reason) == ("ok", ANSWER, "stop"), r.error
    assert r.no_done and r.output_tokens == 4


def test_a_server_silent_after_the_finish_reason_keeps_the_complete_answer() -> None:
    """No [DONE] and no close after the finish reason, until the client's time limit: on main
    a ``timeout`` error with the answer's text blanked."""
    r = send(answer_body(), hang=True, timeout_s=1.0)
    assert (r.status, r.output_text, r.finish_reason) == ("ok", ANSWER, "stop"), r.error
    assert r.no_done
    r = send(answer_body(finish=False), hang=True, timeout_s=1.0)
    assert (r.status, r.error_kind) == ("error", "timeout"), (r.status, r.error)


def test_a_reset_after_the_servers_error_keeps_the_servers_error() -> None:
    """On main: a ``disconnect``, the server's own word lost."""
    r = send([piece("hello ", 1), event(ERRORS["older vLLM"])], reset=True)
    assert (r.status, r.error_kind, r.error) == ("error", "server_error", "KV cache is full")


def test_a_reset_before_the_finish_reason_is_still_a_disconnect() -> None:
    r = send(answer_body(finish=False), reset=True)
    assert (r.status, r.error_kind) == ("error", "disconnect"), (r.status, r.error)
