"""``replay --workers N`` against an in-process server that records what reached it (which
request, when, and from which client port: each load process has its own connections): every
request sent once per phase, an open loop's offsets kept across the workers, a worker or the
parent killed mid-phase and resumed with every request exactly once, sessions within one
worker; and the pure parts (the split, the merge) without processes."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from replay.core.errors import InputError
from replay.core.schedule import poisson_offsets
from replay.core.shards import (
    ClosedLoopShare,
    closed_loop_shards,
    concurrency_shares,
    open_loop_shards,
)
from replay.rundir.files import JsonlWriter
from replay.rundir.shard_files import complete_rows, merge_leftovers, shard_results
from tests.support.fault_server import FaultServer

ROOT = Path(__file__).resolve().parents[3]


class Recorder(FaultServer):
    """Answers like vLLM (usage on every chunk) and keeps (arrival, prompt, client port)."""

    def __init__(self, **options: Any) -> None:
        super().__init__("usage_every", **options)
        self.seen: list[tuple[float, str, int]] = []

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert request.transport is not None
        port = request.transport.get_extra_info("peername")[1]
        self.seen.append((time.perf_counter(), body["messages"][-1]["content"], port))
        return await super()._complete(request)


def _recorder(**options: Any) -> Recorder:
    server = Recorder(**options)
    server.start()
    return server


def _trace(path: Path, n: int, session_turns: int = 0) -> Path:
    with path.open("w") as fh:
        for i in range(n):
            rec: dict[str, Any] = {"id": f"r{i}", "api": "chat", "max_tokens": 8}
            if session_turns:
                j, turn = divmod(i, session_turns)
                rec.update(session=f"s{j}", meta={"turn": turn + 1})
            rec["messages"] = [{"role": "user", "content": f"p{i}"}]
            fh.write(json.dumps(rec) + "\n")
    return path


def _cmd(tmp: Path, url: str, n: int, *extra: str, turns: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "replay.cli",
        "--trace",
        str(_trace(tmp / "trace.jsonl", n, turns)),
        "--targets",
        f"fp8={url}",
        "--out",
        str(tmp),
        "--run-id",
        "run",
        "--no-teacher-forced",
        "--workers",
        "2",
        *extra,
    ]


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def _rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]


def _sent_once_per_phase(run: Path, n: int, phases: list[str]) -> list[dict[str, Any]]:
    rows = _rows(run)
    keys = Counter((r["phase"], r["request_id"]) for r in rows)
    assert set(keys) == {(p, f"r{i}") for p in phases for i in range(n)}, keys
    assert set(keys.values()) == {1}
    assert not list(run.glob("results.w*.jsonl"))  # merged, then removed
    return rows


def test_a_closed_loop_sends_every_request_once_per_phase(tmp_path: Path) -> None:
    server = _recorder(chunks=2, gap_s=0.002)
    try:
        proc = _run(_cmd(tmp_path, server.url, 30, "--concurrency", "2,4"))
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = _sent_once_per_phase(tmp_path / "run", 30, ["c2", "c4"])
    assert {r["status"] for r in rows} == {"ok"}
    got = Counter(prompt for _, prompt, _ in server.seen)
    assert got == {f"p{i}": 2 for i in range(30)}  # once per phase, no more
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["run_spec"]["load"]["workers"] == 2


def test_an_open_loop_keeps_the_schedule_across_workers(tmp_path: Path) -> None:
    n, rate = 60, 40.0
    server = _recorder(chunks=2, gap_s=0.002)
    try:
        proc = _run(_cmd(tmp_path, server.url, n, "--rate", str(rate)))
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {
        r["request_id"]: r for r in _sent_once_per_phase(tmp_path / "run", n, ["poisson-40rps"])
    }
    # The single process's schedule: request i at start + the i-th Poisson offset.
    offsets = poisson_offsets(n, rate, seed=0)
    start = rows["r0"]["scheduled"]
    for i in range(n):
        assert rows[f"r{i}"]["scheduled"] - start == pytest.approx(offsets[i], abs=0.003)
    late = sorted(r["sent"] - r["scheduled"] for r in rows.values())
    assert late[len(late) // 2] < 0.05, late  # sent on time, not just scheduled so
    # Worker k sends the requests at positions k, k + 2, ...: two connection pools, whose
    # sends interleave in time.
    ports = [{port for _, p, port in server.seen if int(p[1:]) % 2 == k} for k in (0, 1)]
    assert ports[0] and ports[1] and not ports[0] & ports[1]
    arrivals = [int(p[1:]) % 2 for _, p, _ in sorted(server.seen)]
    switches = sum(a != b for a, b in itertools.pairwise(arrivals))
    assert switches > n // 4, arrivals


def test_sessions_stay_within_one_worker(tmp_path: Path) -> None:
    server = _recorder(chunks=2, gap_s=0.002)
    try:
        extra = ("--concurrency", "2", "--think-time", "0")
        proc = _run(_cmd(tmp_path, server.url, 24, *extra, turns=3))
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = _sent_once_per_phase(tmp_path / "run", 24, ["c2"])
    # Session j (turns 3j .. 3j+2) is unit j, claimed whole by one worker. With one slot each,
    # a worker sends one session at a time, and the merge keeps each worker's rows together:
    # a session that one worker sent is a run of consecutive rows, one run per session.
    sessions = [int(r["request_id"][1:]) // 3 for r in rows]
    runs = [session for session, _ in itertools.groupby(sessions)]
    assert sorted(runs) == list(range(8)), sessions
    order: dict[int, list[int]] = {}
    for _, prompt, _ in sorted(server.seen):
        session, turn = divmod(int(prompt[1:]), 3)
        order.setdefault(session, []).append(turn)
    assert all(turns == [0, 1, 2] for turns in order.values()), order


def _worker_pids(parent: int) -> list[int]:
    """The spawned load processes of ``parent`` (not multiprocessing's resource tracker)."""
    out = []
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            out.append(int(child))
    return out


def _kill_mid_phase(cmd: list[str], run: Path, victim: str) -> int:
    """Start the run, SIGKILL a worker (or the parent) once results are coming in; the
    parent's exit code (-9 when it is the victim)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        files = list(run.glob("results.w*.jsonl")) if run.exists() else []
        if sum(len(f.read_bytes().splitlines()) for f in files) >= 6:
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("no results came in")
    workers = _worker_pids(proc.pid)
    assert len(workers) == 2, workers
    os.kill(proc.pid if victim == "parent" else workers[0], signal.SIGKILL)
    proc.communicate(timeout=60)
    if victim == "parent":  # its workers see their pipe close and end by themselves
        deadline = time.monotonic() + 20
        while any(Path(f"/proc/{w}").exists() for w in workers):
            assert time.monotonic() < deadline, "workers outlived their parent"
            time.sleep(0.05)
    else:  # the parent says why it stopped
        manifest = json.loads((run / "manifest.json").read_text())
        problems = manifest["targets"]["fp8"]["problems"]
        assert any("load process" in p and "exit -9" in p for p in problems), problems
        assert manifest["interrupted"] is True
    return proc.returncode


@pytest.mark.parametrize("victim", ["worker", "parent"])
def test_a_kill_mid_phase_then_resume_sends_every_request_exactly_once(
    tmp_path: Path, victim: str
) -> None:
    n = 40
    server = _recorder(chunks=4, gap_s=0.03)  # about 0.15 s a request: the kill lands mid-phase
    try:
        cmd = _cmd(tmp_path, server.url, n, "--concurrency", "4", "--drain", "5")
        code = _kill_mid_phase(cmd, tmp_path / "run", victim)
        assert code == (-9 if victim == "parent" else 130), code
        if victim == "parent":
            assert list((tmp_path / "run").glob("results.w*.jsonl"))  # left for the resume
        proc = _run([sys.executable, "-m", "replay.cli", "--resume", str(tmp_path / "run")])
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = _sent_once_per_phase(tmp_path / "run", n, ["c4"])
    assert {r["status"] for r in rows} == {"ok"}
    sent = Counter(prompt for _, prompt, _ in server.seen)
    assert set(sent) == {f"p{i}" for i in range(n)}
    assert sum(sent.values()) - n <= 4  # resent: at most what was in flight when it died


# -- without processes ------------------------------------------------------------------------
def test_a_closed_loop_splits_its_concurrency_and_refuses_fewer_slots_than_workers() -> None:
    assert concurrency_shares(5, 2) == [3, 2] and concurrency_shares(4, 4) == [1, 1, 1, 1]
    with pytest.raises(InputError, match="concurrency 1 cannot give every worker"):
        concurrency_shares(1, 2)
    assert [list(s.take(range(5))) for s in open_loop_shards(2)] == [[0, 2, 4], [1, 3]]
    assert ClosedLoopShare(2, phase="c5").label == "c5"


def test_fewer_slots_than_workers_is_bad_input(tmp_path: Path) -> None:
    proc = _run(_cmd(tmp_path, "http://127.0.0.1:9", 4, "--concurrency", "1"))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    said = " ".join((proc.stdout + proc.stderr).split())
    assert "cannot give every worker a request in flight" in said
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


def test_the_merge_on_resume_repairs_half_lines_and_skips_rows_already_merged(
    tmp_path: Path,
) -> None:
    row = {"target": "a", "phase": "c2", "request_id": "r0", "status": "ok"}
    other = {**row, "request_id": "r1"}
    writer = JsonlWriter(tmp_path / "results.jsonl")
    writer.write(row)  # merged before the kill, its worker file not yet removed
    writer.close()
    with (tmp_path / "results.jsonl").open("a") as fh:
        fh.write('{"target": "a", "pha')  # the parent killed mid-merge
    w0, w1 = shard_results(tmp_path, 0), shard_results(tmp_path, 1)
    w0.write_text(json.dumps(row) + "\n" + '{"target": "a", "phase": "c2", "req')
    w1.write_text(json.dumps(other) + "\n")
    assert list(complete_rows(w0)) == [row]  # the line in flight is left out
    assert merge_leftovers(tmp_path) == 1
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [row, other]
    assert not w0.exists() and not w1.exists()
    assert merge_leftovers(tmp_path) == 0  # idempotent


def test_a_worker_reports_progress_as_counts_and_loses_none() -> None:
    """Finished requests go up the pipe as counts, a message at most every
    ADVANCE_EVERY_S, and what is pending when the worker ends is sent by its flush."""
    import asyncio
    import multiprocessing

    from replay.run.load_process import ADVANCE_EVERY_S, PipeProgress

    ours, theirs = multiprocessing.get_context("spawn").Pipe()

    async def go() -> None:
        progress = PipeProgress(theirs)
        for k in range(500):
            progress.advance("t", "c1", ok=k % 5 != 0)
        await asyncio.sleep(ADVANCE_EVERY_S * 1.5)  # the timer's message
        for _ in range(7):
            progress.advance("t", "c1", ok=True)
        progress.flush()  # the worker's end
        progress.flush()  # nothing more to say

    asyncio.run(go())
    messages = []
    while ours.poll(0.5):
        messages.append(ours.recv())
    assert messages == [("advance", 400, 100), ("advance", 7, 0)]


def test_closed_loop_workers_claim_units_as_their_slots_free_up() -> None:
    """Each position goes to exactly one worker, whoever asks first: a worker that asks
    three times as often takes about three times the units, and none is left or taken twice."""
    import multiprocessing

    counter = multiprocessing.get_context("spawn").Value("q", 0)
    fast, slow = (iter(s.take(range(100))) for s in closed_loop_shards(2, counter))
    taken: dict[str, list[int]] = {"fast": [], "slow": []}
    for turn in itertools.count():
        name, it = ("slow", slow) if turn % 4 == 3 else ("fast", fast)
        got = next(it, None)
        if got is None:
            break
        taken[name].append(got)
    assert sorted(taken["fast"] + taken["slow"]) == list(range(100))
    assert 70 <= len(taken["fast"]) <= 80, taken
    assert next(slow, None) is None  # the positions ran out for both
