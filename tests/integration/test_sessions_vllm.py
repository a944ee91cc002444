"""Multi-turn sessions and the production-trace importers on a real vLLM CPU server: turns go
in order (turn k+1 only after turn k finished, plus the think time), every target sees the same
history, and each importer's requests reach the server with exactly their declared lengths."""

from __future__ import annotations

import csv
import itertools
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: these tests start vLLM servers")

from replay.rundir.files import read_results
from replay.serving.local_server import LocalServer
from tests.conftest import ROOT

pytestmark = pytest.mark.vllm
TIMEOUT_S = 900
QUESTIONS = ["Name a colour.", "Why that one?", "Say it backwards.", "Spell it."]


def replay(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "replay.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def chat_sessions(path: Path, sessions: int = 3, turns: int = 3) -> Path:
    """Sessions whose later turns hold only their new question: the history is the run's."""
    with path.open("w") as fh:
        for s in range(sessions):
            for k in range(turns):
                rec = {
                    "id": f"s{s}-t{k + 1}",
                    "t": 0.1 * s + 0.3 * k,
                    "session": f"s{s}",
                    "messages": [{"role": "user", "content": QUESTIONS[k]}],
                    "max_tokens": 12,
                    "meta": {"turn": k + 1},
                }
                fh.write(json.dumps(rec) + "\n")
    return path


def by_target(run_dir: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = defaultdict(dict)
    for r in read_results(run_dir):
        out[r.target][r.request_id] = r
    return out


def test_turns_go_in_order_with_the_references_history_on_every_target(
    bf16_server: LocalServer, tmp_path: Path
) -> None:
    trace = chat_sessions(tmp_path / "sessions.jsonl")
    url = bf16_server.url
    replay(
        "--trace", str(trace), "--targets", f"ref={url},other={url}", "--reference", "ref",
        "--session-history", "reference", "--think-time", "0.3", "--concurrency", "2",
        "--buckets", "256,1K", "--no-teacher-forced", "--no-control", "--out", str(tmp_path),
        "--run-id", "run",
    )  # fmt: skip
    run_dir = tmp_path / "run"
    results = by_target(run_dir)
    assert set(results) == {"ref", "other"} and all(len(v) == 9 for v in results.values())
    for target, rows in results.items():
        for s in range(3):
            turns = [rows[f"s{s}-t{k}"] for k in (1, 2, 3)]
            assert all(t.status == "ok" for t in turns), [t.error for t in turns]
            assert [t.turn for t in turns] == [1, 2, 3] and {t.session for t in turns} == {f"s{s}"}
            for before, after in itertools.pairwise(turns):
                # Sent only once the previous turn finished, and the think time passed.
                assert after.sent >= before.done + 0.3 - 1e-3, (target, s)
                # The later prompt begins with what the previous turn asked and answered.
                assert after.reused_prefix_tokens >= len(before.prompt_ids), (target, s)
    for rid, ref in results["ref"].items():
        # Identical histories: the server saw the same prompt tokens from both targets.
        assert results["other"][rid].prompt_ids == ref.prompt_ids, rid
    history = [json.loads(line) for line in (run_dir / "session_history.jsonl").open()]
    assert len(history) == 3 * 3  # the reference's every answer: sessions x turns (one phase)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["options"]["sessions"] == {"think_time": "0.3 s"}
    assert manifest["run_spec"]["load"]["session_history"] == "reference"
    summary = json.loads((run_dir / "summary.json").read_text())
    sessions = summary["targets"]["other"]["phases"]["c2"]["all"]["sessions"]
    assert sessions["later_turns"] == 6 and sessions["reused_prefix_share"] > 0.5


def _bailian(path: Path) -> dict[str, int]:
    rows = [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.0, "input_length": 40,
         "output_length": 4, "type": "text", "turn": 1, "hash_ids": [1, 2, 3]},
        {"chat_id": 2, "parent_chat_id": -1, "timestamp": 0.2, "input_length": 24,
         "output_length": 3, "type": "text", "turn": 1, "hash_ids": [7, 8]},
        {"chat_id": 3, "parent_chat_id": 1, "timestamp": 0.5, "input_length": 72,
         "output_length": 5, "type": "text", "turn": 2, "hash_ids": [1, 2, 3, 4, 5]},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {f"bailian-{r['chat_id']}": int(r["input_length"]) for r in rows}


def _burstgpt(path: Path) -> dict[str, int]:
    rows = [
        (0.0, "ChatGPT", 30, 5, 35, "Conversation log"),
        (0.4, "GPT-4", 55, 0, 55, "API log"),  # failed: counted, not replayed
        (0.9, "ChatGPT", 18, 4, 22, "API log"),
    ]
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens",
                    "Log Type"])  # fmt: skip
        w.writerows(rows)
    return {}


@pytest.mark.parametrize("fmt", ["bailian", "burstgpt", "csv-mapping"])
def test_each_importer_sends_exactly_its_declared_lengths(
    bf16_server: LocalServer, tmp_path: Path, fmt: str
) -> None:
    args: list[str] = []
    if fmt == "bailian":
        trace = tmp_path / "bailian.jsonl"
        _bailian(trace)
    elif fmt == "burstgpt":
        trace = tmp_path / "burst.csv"
        _burstgpt(trace)
    else:
        trace = tmp_path / "gateway.csv"
        trace.write_text("ts,prompt_tokens,completion_tokens\n0,33,3\n0.5,21,2\n")
        args = ["--trace-format", "csv:t=ts,in=prompt_tokens,out=completion_tokens"]
    replay(
        "--trace", str(trace), *args, "--targets", f"bf16={bf16_server.url}",
        "--concurrency", "1", "--buckets", "256,1K", "--no-teacher-forced",
        "--out", str(tmp_path), "--run-id", "run",
    )  # fmt: skip
    run_dir = tmp_path / "run"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    results = list(read_results(run_dir))
    assert results and all(r.status == "ok" for r in results), [r.error for r in results]
    # What the importer declares, as `replay trace import` writes it.
    converted = tmp_path / "v1.jsonl"
    fmt_args = ["--format", args[1]] if args else []
    subprocess.run(
        [sys.executable, "-m", "replay.cli", "trace", "import", str(trace), "-o", str(converted),
         *fmt_args],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    declared = {(rec := json.loads(line))["id"]: rec for line in converted.open()}
    assert {r.request_id for r in results} == set(declared)
    for r in results:
        want = declared[r.request_id]
        # The server's own count of the prompt it was sent (return_token_ids).
        assert r.prompt_ids is not None and len(r.prompt_ids) == want["synth"]["input_tokens"]
        assert r.output_tokens == want["max_tokens"]
    if fmt == "burstgpt":
        assert manifest["trace"]["skipped_rows"] == {"failed": 1} and len(results) == 2
    if fmt == "bailian":
        sent = {r.request_id: r for r in results}
        child, parent = sent["bailian-3"], sent["bailian-1"]
        assert child.session == parent.session and child.sent >= parent.done
        # The child's hash ids begin with its parent's: the parent's whole prompt is shared.
        assert parent.prompt_ids is not None and child.reused_prefix_tokens is not None
        assert child.reused_prefix_tokens >= len(parent.prompt_ids) == 40


def test_a_request_log_replays_its_sessions_in_order_with_its_tools(
    bf16_server: LocalServer, tmp_path: Path
) -> None:
    """A gateway's log: a two-turn conversation whose second turn carries the logged answer
    (with a tool call), and a request with tools; each reaches the server as logged."""
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}  # fmt: skip
    first = [{"role": "user", "content": "Weather in Oslo?"}]
    second = [
        *first,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "12 C, rain"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    rows = [
        {"id": "a1", "timestamp": 0.0, "session": "conv-a",
         "request": {"messages": first, "tools": [tool], "max_tokens": 12},
         "response": {"choices": [{"message": {"role": "assistant", "content": None,
                                               "tool_calls": [call]}}]}},
        {"id": "b1", "timestamp": 0.2, "request": {"messages": [{"role": "user",
         "content": "Say hi."}], "max_tokens": 6, "temperature": 0}},
        {"id": "a2", "timestamp": 1.5, "session": "conv-a",
         "request": {"messages": second, "tools": [tool], "max_tokens": 12}},
    ]  # fmt: skip
    trace = tmp_path / "gateway.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    replay(
        "--trace", str(trace), "--trace-format", "openai-log", "--targets",
        f"bf16={bf16_server.url}", "--concurrency", "2", "--think-time", "0.2",
        "--buckets", "256,1K", "--no-teacher-forced", "--out", str(tmp_path), "--run-id", "run",
    )  # fmt: skip
    sent = {r.request_id: r for r in read_results(tmp_path / "run")}
    assert set(sent) == {"a1", "b1", "a2"} and all(r.status == "ok" for r in sent.values())
    a1, a2 = sent["a1"], sent["a2"]
    assert (a1.session, a1.turn, a2.session, a2.turn) == ("conv-a", 1, "conv-a", 2)
    assert a2.sent >= a1.done + 0.2 - 1e-3  # the second turn only after the first, plus think
    # The logged history (the tool call and its result) is in the second turn's prompt, and
    # the first turn's prompt, tools included, is where it begins.
    assert a1.prompt_ids is not None and a2.prompt_ids is not None
    assert a2.reused_prefix_tokens is not None and a2.reused_prefix_tokens > 0
    assert len(a2.prompt_ids) > len(a1.prompt_ids)
    assert all(r.output_tokens <= (12 if r.request_id != "b1" else 6) for r in sent.values())
