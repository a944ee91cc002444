"""The replay as a user runs it (the CLI, in a subprocess: a traceback or a wrong exit code is
what they would see) against a loopback server that streams the answer a test gives.

The server is tests/hostile/test_hostile_server.py's ``FakeServer`` (vLLM's shape of answer), with
the chat answer canned: only a fake can be made to answer with a NUL or an ESC on demand, and
the full-disk test needs answers of a known size, not a model's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.hostile.test_hostile_server import Canned, FakeServer, fake_server


@contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``path`` (made here) while the block runs: mounting needs root (CI
    runs as root); the test skips, saying why, where it cannot."""
    if os.geteuid() != 0:
        pytest.skip("the test mounts a small tmpfs, which needs root (CI runs as root)")
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def sse(text: str, pieces: int = 4) -> bytes:
    """A streamed chat answer of ``text`` in ``pieces`` chunks, usage on every chunk."""
    step = max(1, -(-len(text) // pieces))
    events = []
    for n, k in enumerate(range(0, len(text), step), start=1):
        choice = {"index": 0, "delta": {"content": text[k : k + step]}, "token_ids": [5]}
        events.append({"choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
    events[-1]["choices"][0]["finish_reason"] = "stop"
    events[0]["prompt_token_ids"] = [1, 2, 3]
    body = b"".join(f"data: {json.dumps(ev)}\n\n".encode() for ev in events)
    return body + b"data: [DONE]\n\n"


@contextmanager
def answering(text: str) -> Iterator[FakeServer]:
    """A server whose every chat answer is ``text``."""
    canned = Canned(sse(text), content_type="text/event-stream")
    with fake_server({"/v1/chat/completions": canned}) as server:
        yield server


def chat_trace(path: Path, n: int, check: dict[str, object] | None = None) -> Path:
    records = [
        {"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]}
        | ({"check": check} if check else {})
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def replay_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``replay ARGS`` in a subprocess, its output unwrapped (a wide console)."""
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "1000"}
    return subprocess.run(
        [sys.executable, "-m", "replay.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
