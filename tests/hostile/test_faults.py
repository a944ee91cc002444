"""The fault matrix: every fault is a recorded result, never a crash, never a lost request.

The faulty target sits beside a healthy real vLLM server; the healthy one must be unaffected
and the verdict must treat the faulty one as a failed target, not as a quality result.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from replay.analysis.run_spec import QualitySpec
from replay.core.schedule import ClosedLoop
from replay.run.runner import Runner
from replay.rundir.files import new_run_dir, read_results
from replay.serving.local_server import LocalServer
from replay.serving.targets import TargetSpec
from replay.traces.importers import load
from tests.conftest import ROOT
from tests.support.fault_server import describe, fault_server
from tests.support.run_config import run_config

pytestmark = pytest.mark.vllm

TRACE = ROOT / "traces" / "sample.jsonl"
LIMIT = 8

# mode -> (error kind, words in the reason); None = the request succeeds
FAULTS = {
    "http500": ("http", "HTTP 500"),
    "http429": ("http", "HTTP 429"),
    "http400": ("http", "maximum context length"),
    "bad_json": ("protocol", "bad JSON"),
    "no_done": ("protocol", "without [DONE]"),
    "stall": ("timeout", "no complete answer within"),
    "reset": ("disconnect", "connection lost"),
    "trickle": ("timeout", "no complete answer within"),
    "split": None,
}


@pytest.mark.parametrize("mode", list(FAULTS))
def test_fault_is_a_result(mode: str, bf16_server: LocalServer, tmp_path: Path) -> None:
    trace = load(TRACE)
    trace.requests = trace.requests[:LIMIT]
    with fault_server(mode) as bad:
        cfg = run_config(
            trace=trace,
            trace_path=TRACE,
            trace_format="v1",
            targets=[
                TargetSpec(name="bf16", url=bf16_server.url),
                TargetSpec(name="fp8", url=bad.url, expect_cache_dtype="fp8"),
            ],
            schedules=[ClosedLoop(2)],
            quality=QualitySpec(buckets="256,1K", teacher_forced=False),
            run_dir=new_run_dir(tmp_path),
            load={"timeout_s": 3.0, "parallel_targets": True},
        )
        summary = asyncio.run(Runner(cfg).run()).to_json()
        reached = bad.requests
    results = list(read_results(Path(summary["run_dir"])))
    ids = {r.id for r in trace.requests}
    seen = Counter((r.target, r.request_id) for r in results)
    assert set(seen) == {(t, i) for t in ("bf16", "fp8") for i in ids}
    assert set(seen.values()) == {1}  # exactly once, no retries
    assert reached == LIMIT  # every request was sent once to the faulty server
    assert all(r.status == "ok" for r in results if r.target == "bf16")  # unaffected
    fp8 = [r for r in results if r.target == "fp8"]
    expected = FAULTS[mode]
    if expected is None:
        assert all(r.status == "ok" and r.output_tokens == 3 for r in fp8)
        # Two events, cut every 7 bytes mid-line: read apart they are [1, 2]; on a loaded
        # machine both may arrive in one read, [3]. Never a lost or doubled token.
        assert all(r.chunk_tokens in ([1, 2], [3]) for r in fp8), [r.chunk_tokens for r in fp8]
        assert all(r.output_text == "abc" for r in fp8)
        return
    kind, words = expected
    assert all(r.status == "error" and r.error_kind == kind for r in fp8), {
        (r.error_kind, r.error) for r in fp8
    }
    assert all(words in (r.error or "") for r in fp8)
    assert describe(summary, "fp8") == {kind: LIMIT}
    verdict = summary["verdict"]
    assert verdict["verdict"] == "reject"
    assert any("requests failed" in e["text"] for e in verdict["evidence"])
    if mode == "http429":
        assert all("Retry-After: 7" in (r.error or "") for r in fp8)


def test_target_killed_mid_run(model_dir: Path, tmp_path: Path) -> None:
    """A real vLLM server SIGKILLed mid-run: the run finishes, every request has one result,
    the ones after the kill fail as connection errors until the error budget stops the
    target, and the summary counts them by kind."""
    import os
    import signal
    import threading

    from replay.serving.targets import DEFAULT_MODEL_ARGS

    spec = TargetSpec(
        name="fp8", model=str(model_dir), kv_cache_dtype="auto", args=DEFAULT_MODEL_ARGS
    )
    server = LocalServer(spec, tmp_path / "victim.log")
    server.start()
    try:
        server.wait_healthy()
        assert server.proc is not None
        pgid = server.proc.pid
        trace = load(TRACE)
        cfg = run_config(
            trace=trace,
            trace_path=TRACE,
            trace_format="v1",
            targets=[TargetSpec(name="fp8", url=server.url)],
            schedules=[ClosedLoop(1)],
            quality=QualitySpec(buckets="256,1K", teacher_forced=False),
            run_dir=new_run_dir(tmp_path),
            load={"timeout_s": 30.0},
        )
        results_file = cfg.run_dir / "results.jsonl"

        def killer() -> None:
            for _ in range(1200):
                if results_file.exists() and len(results_file.read_text().splitlines()) >= 5:
                    os.killpg(pgid, signal.SIGKILL)
                    return
                threading.Event().wait(0.1)

        t = threading.Thread(target=killer)
        t.start()
        summary = asyncio.run(Runner(cfg).run()).to_json()
        t.join()
    finally:
        server.stop()
    results = list(read_results(Path(summary["run_dir"])))
    assert Counter(r.request_id for r in results) == Counter(r.id for r in trace.requests)
    ok = [r for r in results if r.status == "ok"]
    failed = [r for r in results if r.status != "ok"]
    assert len(ok) >= 5 and failed
    kinds = Counter(r.error_kind for r in failed)
    # After ten failures in a row (backed off) the error budget stops the dead target: what
    # it did not send is accounted for as unavailable, with the reason.
    assert set(kinds) <= {"connect", "disconnect", "unavailable"}, kinds
    assert kinds["connect"] + kinds["disconnect"] == 10 and kinds["unavailable"] >= 1
    assert all(
        "stopped answering" in (r.error or "") for r in failed if r.error_kind == "unavailable"
    )
    assert describe(summary, "fp8") == dict(kinds)
