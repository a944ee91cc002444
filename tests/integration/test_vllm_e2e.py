"""End to end on real vLLM CPU servers, the way a user runs it: the README's command.

Runs first in the vLLM suite (file order), so its own servers do not share the CPU with the
session servers of the other integration tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from replay.traces.importers import load
from tests.conftest import ROOT, cpu_can_serve_fp8_kv

pytestmark = pytest.mark.vllm


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_replay_sample_bf16_fp8_from_the_command_line(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "replay.cli",
        "--trace",
        "traces/sample.jsonl",
        "--targets",
        "bf16,fp8",
        "--buckets",
        "256,1K",
        "--concurrency",
        "1,4",
        "--out",
        str(tmp_path),
        "--run-id",
        "e2e",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    run_dir = tmp_path / "e2e"
    summary = json.loads((run_dir / "summary.json").read_text())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    bf16, fp8 = summary["targets"]["bf16"], summary["targets"]["fp8"]

    # The terminal table shows every bucket of the sample.
    for label in ("<256", "256-1K", ">=1K"):
        assert label in proc.stdout
    assert bf16["status"] == "ok" and bf16["cache_dtype"] == "auto"

    # Every scheduled request appears exactly once per target and phase (the A/A control, on
    # by default when targets are compared, is the reference's second server).
    reqs = {r.id for r in load(ROOT / "traces" / "sample.jsonl").requests}
    rows = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    seen = Counter((r["target"], r["phase"], r["request_id"]) for r in rows)
    arms = ("bf16", "bf16-control", "fp8")
    expected = {(t, p, i) for t in arms for p in ("c1", "c4") for i in reqs}
    assert set(seen) == expected and set(seen.values()) == {1}
    assert all(r["status"] == "ok" for r in rows if r["target"] == "bf16")
    assert {r["bucket"] for r in rows if r["target"] == "bf16"} == {"<256", "256-1K", ">=1K"}

    if cpu_can_serve_fp8_kv():
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert fp8["status"] == "ok" and fp8["cache_dtype"].startswith("fp8")
        ratio = fp8["kv_cache_size_tokens"] / bf16["kv_cache_size_tokens"]
        assert 1.9 <= ratio <= 2.1
        # The systems rule weighed every phase.
        assert {c["phase"] for c in summary["systems"]["rule"]["cells"]} == {"c1", "c4"}
    else:
        # vLLM CPU refuses FP8 KV without AVX-512/AMX: the run records the refusal in the
        # server's own words, accounts for every request, and exits with the target code.
        assert proc.returncode == 3, proc.stderr[-3000:]
        assert fp8["status"] == "failed"
        assert "AVX-512" in fp8["reason"]
        assert all(r["error_kind"] == "unavailable" for r in rows if r["target"] == "fp8")
        assert "target fp8 failed" in proc.stderr

    # Both phases were sent interleaved, in blocks.
    assert manifest["run_spec"]["load"]["interleave"] is True
    assert manifest["run_spec"]["load"]["block_size"] == 0  # by the schedule
    assert manifest["targets"]["bf16"]["phases"]["c4"].get("blocks")

    # Servers the tool started are gone.
    for name in arms:
        pid = manifest["targets"][name]["server"]["pid"]
        assert not _alive(pid), f"server of {name} (pid {pid}) still running"
        assert (run_dir / "servers" / f"{name}.log").stat().st_size > 0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # Only zombies left counts as gone.
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_stops_the_servers_it_started(tmp_path: Path, sig: signal.Signals) -> None:
    cmd = [
        sys.executable,
        "-m",
        "replay.cli",
        "--trace",
        "traces/sample.jsonl",
        "--targets",
        "bf16",
        "--buckets",
        "256,1K",
        "--out",
        str(tmp_path),
        "--run-id",
        "int",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    manifest = tmp_path / "int" / "manifest.json"
    pid = None
    deadline = time.monotonic() + 120
    while pid is None and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
        try:
            pid = json.loads(manifest.read_text())["targets"]["bf16"]["server"]["pid"]
        except (OSError, ValueError, KeyError):
            pass
    assert pid is not None, "the server never started"
    time.sleep(3)  # let the server get going (engine processes spawned)
    assert _group_alive(pid)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == (143 if sig == signal.SIGTERM else 130), err.decode()[-2000:]
    assert b"interrupted" in err
    assert not _group_alive(pid), "server processes survived the interrupt"


def _results(run_dir: Path) -> list[dict[str, object]]:
    path = run_dir / "results.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


@pytest.mark.parametrize("how", ["sigint", "sigkill"])
def test_interrupted_run_resumes_with_every_request_exactly_once(tmp_path: Path, how: str) -> None:
    run_dir = tmp_path / "r"
    cmd = [
        sys.executable,
        "-m",
        "replay.cli",
        "--trace",
        "traces/sample.jsonl",
        "--targets",
        "bf16",
        "--buckets",
        "256,1K",
        "--concurrency",
        "1,2",
        "--drain",
        "5",
        "--limit",
        "16",
        "--out",
        str(tmp_path),
        "--run-id",
        "r",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while len(_results(run_dir)) < 6 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    assert len(_results(run_dir)) >= 6, "the run never got going"
    server_pid = json.loads((run_dir / "manifest.json").read_text())["targets"]["bf16"]["server"][
        "pid"
    ]
    if how == "sigint":
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err.decode()[-2000:]
        assert b"--resume" in err
        # The partial run is reported: summary and report exist, the manifest says so.
        assert json.loads((run_dir / "manifest.json").read_text())["interrupted"] is True
        assert (run_dir / "summary.json").exists() and (run_dir / "report.html").exists()
    else:
        proc.kill()
        proc.communicate(timeout=60)
        # A crash mid-write leaves half a line; resume must repair it.
        with (run_dir / "results.jsonl").open("a") as fh:
            fh.write('{"request_id": "half-writ')
    deadline = time.monotonic() + 60
    while _group_alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _group_alive(server_pid), "the server outlived the tool"
    before = len(_results(run_dir))

    done = subprocess.run(
        [sys.executable, "-m", "replay.cli", "--resume", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _results(run_dir)
    ids = {r.id for r in load(ROOT / "traces" / "sample.jsonl").requests[:16]}
    seen = Counter((r["phase"], r["request_id"]) for r in rows)
    assert set(seen) == {(p, i) for p in ("c1", "c2") for i in ids}
    assert set(seen.values()) == {1}, "a request appears twice"
    assert all(r["status"] == "ok" for r in rows)
    note = json.loads((run_dir / "manifest.json").read_text())["resumed"]
    assert note["kept_results"] >= before - 2
    if how == "sigkill":
        assert note["repaired_bytes"] == len('{"request_id": "half-writ')
