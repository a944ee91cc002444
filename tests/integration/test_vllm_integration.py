"""Integration against a real vLLM CPU server (started once per session)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: these tests start vLLM servers")

from replay.analysis.run_spec import QualitySpec  # noqa: E402
from replay.core.schedule import ClosedLoop  # noqa: E402
from replay.run.runner import Runner  # noqa: E402
from replay.rundir.files import new_run_dir, read_results  # noqa: E402
from replay.serving.introspect import introspect  # noqa: E402
from replay.serving.local_server import LocalServer  # noqa: E402
from replay.serving.targets import TargetSpec  # noqa: E402
from replay.traces.importers import LengthPolicy, load  # noqa: E402
from tests.conftest import FP8_DTYPE, ROOT, SHARED_DATA, fp8_emulated  # noqa: E402
from tests.support.run_config import run_config  # noqa: E402

pytestmark = pytest.mark.vllm


async def _introspect(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        return await introspect(s, url)


def replay(
    server_url: str,
    trace: Path,
    tmp_path: Path,
    *,
    name: str = "bf16",
    expect: str | None = "auto",
    concurrency: tuple[int, ...] = (1,),
    buckets: str = "256,1K",
    policy: LengthPolicy | None = None,
) -> dict[str, Any]:
    policy = policy or LengthPolicy()
    cfg = run_config(
        trace=load(trace, policy=policy),
        trace_path=trace,
        trace_format="auto",
        targets=[TargetSpec(name=name, url=server_url, expect_cache_dtype=expect)],
        schedules=[ClosedLoop(c) for c in concurrency],
        quality=QualitySpec(buckets=buckets, teacher_forced=True),
        run_dir=new_run_dir(tmp_path),
        length_policy=policy,
    )
    return asyncio.run(Runner(cfg).run()).to_json()


def test_introspection_reports_what_runs(bf16_server: LocalServer, model_dir: Path) -> None:
    info = asyncio.run(_introspect(bf16_server.url))
    config = json.loads((model_dir / "config.json").read_text())
    assert info["engine_version"] == vllm.__version__
    assert info["max_model_len"] == config["max_position_embeddings"]
    cache = info["cache_config"]
    assert cache["cache_dtype"] == "auto"
    # 1 GiB of cache / (K and V x layers x KV heads x head size x 2 bytes of bf16)
    per_token = (
        2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2
    )
    assert int(cache["kv_cache_size_tokens"]) == (1 << 30) // per_token


def test_every_request_once_and_ttft_agrees_with_server(
    bf16_server: LocalServer, tmp_path: Path
) -> None:
    trace = ROOT / "traces" / "sample.jsonl"
    summary = replay(bf16_server.url, trace, tmp_path, concurrency=(1, 3))
    run_dir = Path(summary["run_dir"])
    max_tokens = {r.id: r.max_tokens for r in load(trace).requests}
    results = list(read_results(run_dir))
    seen = Counter((r.phase, r.request_id) for r in results)
    assert set(seen) == {(p, i) for p in ("c1", "c3") for i in max_tokens}
    assert set(seen.values()) == {1}
    assert all(r.status == "ok" for r in results)
    # The model stops on its own (a text answer, or a tool call it made) or at max_tokens.
    assert all(
        r.output_tokens == max_tokens[r.request_id] or r.finish_reason in ("stop", "tool_calls")
        for r in results
    )

    phase = summary["targets"]["bf16"]["phases"]["c1"]
    ttft = (phase["all"]["ttft_ms"]["mean"], phase["server"]["server_ttft_mean_ms"])
    e2e = (phase["all"]["e2e_ms"]["mean"], phase["server"]["server_e2e_mean_ms"])
    assert None not in (*ttft, *e2e)
    # The server's means are over the phase's own requests, every one of them.
    assert phase["server"]["server_finished"] == len(max_tokens)
    # The engine's clocks start when it got the request, the client's just before it wrote
    # it; the engine's stop when its output reached the API server, the client's when the
    # bytes reached the client's socket. So neither client mean can be below the server's
    # (it was, when `sent` was stamped after the write: the write woke vLLM, which then held
    # both cores for the whole answer before the client ran again).
    assert e2e[0] >= e2e[1], e2e
    assert ttft[0] >= ttft[1] - 0.5, ttft  # 0.5 ms: the two processes' clock readings
    # How far above is not asserted: the client's stamps are the kernel's receive times, but
    # TCP gives one stamp per read, the last segment's. On 2 cores busy with vLLM the client
    # may not run until several chunks have arrived; the earlier ones then carry the later
    # one's time (one CI run: TTFT 50.4 against 24.3 ms while E2E was 58.7 against 57.5).
    # bench/client_overhead.py measures the agreement where the client has a core of its own.
    # Metrics time series were scraped into the run directory.
    series = (run_dir / "metrics" / "bf16.jsonl").read_text().splitlines()
    assert len(series) >= 2 and "kv_usage" in json.loads(series[-1])


def test_sent_is_when_the_body_reached_the_socket(bf16_server: LocalServer) -> None:
    """A busy event loop delays the request's write; ``sent`` must follow the write, or the
    client's TTFT would count its own queueing as the server's."""
    import time

    from replay.core.records import Result
    from replay.serving.client import Client
    from replay.traces.trace import Request

    async def go() -> tuple[Result, float]:
        assert bf16_server.spec.model is not None
        client = Client(bf16_server.url, bf16_server.spec.model)  # clock: perf_counter
        req = Request(id="r", api="completions", prompt="hello", max_tokens=2)
        try:
            await client.send(req, Result("warm", "t", "p", "b", 0.0))  # opens the connection
            result = Result("r", "t", "p", "b", client.now())
            task = asyncio.create_task(client.send(req, result))  # runs once the loop is free
            busy_until = time.perf_counter() + 0.2
            while time.perf_counter() < busy_until:  # other work holds the loop for 200 ms
                pass
            await task
            return result, busy_until
        finally:
            await client.close()

    result, busy_end = asyncio.run(go())
    assert result.status == "ok", result.error
    assert result.sent is not None and result.first_token is not None
    assert busy_end <= result.sent <= result.first_token


MOONCAKE_LINES = (2, 138, 67, 134)  # 138 shares 14 prefix blocks with 2; 134 shares 5 with 67


def test_mooncake_exact_lengths_and_shared_prefixes(
    bf16_server: LocalServer, tmp_path: Path
) -> None:
    src = SHARED_DATA / "mooncake_conversation_trace.jsonl"
    if not src.exists():
        pytest.skip("shared trace data not present")
    lines = src.read_text().splitlines()
    trace = tmp_path / "mooncake_subset.jsonl"
    trace.write_text("".join(lines[n - 1] + "\n" for n in MOONCAKE_LINES))
    # Blocks of 512 * 0.25 = 128 tokens: one vLLM block each, so shared blocks can hit.
    policy = LengthPolicy(scale=0.25, max_output_tokens=4)
    summary = replay(bf16_server.url, trace, tmp_path, policy=policy)
    reqs = {r.id: r for r in load(trace, policy=policy).requests}
    results = list(read_results(Path(summary["run_dir"])))
    assert len(results) == len(MOONCAKE_LINES) and all(r.status == "ok" for r in results)
    for r in results:
        synth = reqs[r.request_id].synth
        assert synth is not None
        assert r.prompt_tokens == synth.input_tokens  # the server's own count
        assert r.output_tokens == 4
    server = summary["targets"]["bf16"]["phases"]["c1"]["server"]
    assert server["prefix_cache_hit_rate"] is not None and server["prefix_cache_hit_rate"] > 0.2


def test_served_dtype_contradicting_the_spec_is_an_error(
    bf16_server: LocalServer, tmp_path: Path
) -> None:
    summary = replay(
        bf16_server.url, ROOT / "traces" / "sample.jsonl", tmp_path, name="fp8", expect="fp8"
    )
    fp8 = summary["targets"]["fp8"]
    assert fp8["status"] == "failed"
    assert "served cache_dtype is 'auto' but target 'fp8' expects 'fp8'" in fp8["reason"]
    results = list(read_results(Path(summary["run_dir"])))
    assert results and all(r.error_kind == "unavailable" for r in results)


@pytest.mark.fp8
def test_fp8_server_capacity_is_twice_bf16(
    bf16_server: LocalServer, fp8_server: LocalServer
) -> None:
    """Served FP8 holds twice the tokens; emulated FP8 stores BF16 and must not pretend."""
    bf16 = asyncio.run(_introspect(bf16_server.url))["cache_config"]
    fp8 = asyncio.run(_introspect(fp8_server.url))["cache_config"]
    ratio = int(fp8["kv_cache_size_tokens"]) / int(bf16["kv_cache_size_tokens"])
    if fp8_emulated():
        assert fp8["cache_dtype"] == "auto"
        assert ratio == pytest.approx(1.0, rel=0.05)
    else:
        assert fp8["cache_dtype"].startswith("fp8")
        assert ratio == pytest.approx(2.0, rel=0.05)


def test_graded_replay_with_control_reports_quality(
    bf16_server: LocalServer, tmp_path: Path
) -> None:
    """The graded sample with --control: pass rates, agreement, teacher-forced divergence and
    the noise floor per bucket, and every grade kept in grades.jsonl."""
    trace = ROOT / "traces" / "sample.jsonl"
    reqs = load(trace).requests
    cfg = run_config(
        trace=load(trace),
        trace_path=trace,
        trace_format="v1",
        targets=[TargetSpec(name="bf16", url=bf16_server.url, expect_cache_dtype="auto")],
        schedules=[ClosedLoop(2)],
        quality=QualitySpec(buckets="256,1K", teacher_forced=True, control=True),
        run_dir=new_run_dir(tmp_path),
    )
    summary = asyncio.run(Runner(cfg).run()).to_json()
    run_dir = Path(summary["run_dir"])
    q = summary["quality"]["phases"]["c2"]
    assert set(q) == {"bf16", "bf16-control"}
    graded_per_bucket = Counter()
    grades = [json.loads(x) for x in (run_dir / "grades.jsonl").read_text().splitlines()]
    assert len(grades) == 2 * len(reqs)
    for g in grades:
        if g["target"] == "bf16" and g["grade"] is not None:
            graded_per_bucket[g["bucket"]] += 1
            assert g["grade"]["reason"]
    assert set(graded_per_bucket) == {"<256", "256-1K", ">=1K"}
    for bucket, n in graded_per_bucket.items():
        ref = q["bf16"]["buckets"][bucket]
        ctl = q["bf16-control"]["buckets"][bucket]
        assert ref["graded"] == n and ref["pass_rate"] is not None and ref["wilson"] is not None
        assert ctl["vs_reference"]["pairs"] == n
        assert ctl["agreement"]["compared"] > 0
        assert ref["noise_floor"] is not None and ctl["noise_floor"] is not None
        assert ctl["teacher_forced"]["tokens"] > 0 and ref["teacher_forced"]["tokens"] > 0
        # The sample has fewer graded pairs per bucket than a match needs (59 at 5 points with
        # no disagreement): the control's evidence is still open, and names how many.
        assert ctl["evidence"]["status"] == "open" and ctl["evidence"]["needed"] > n
    # The A/A control scores the reference's own answers: same server, same numbers.
    assert q["bf16-control"]["teacher_forced"]["nll_delta_mean"] == pytest.approx(0, abs=1e-3)
    tf = [json.loads(x) for x in (run_dir / "teacher_forced.jsonl").read_text().splitlines()]
    assert tf and all(t["error"] is None for t in tf)
    assert all(t["n"] == len(t["nll"]) > 0 for t in tf)


@pytest.mark.fp8
def test_fp8_teacher_forced_scores_differ_from_bf16(
    bf16_server: LocalServer, fp8_server: LocalServer, tmp_path: Path
) -> None:
    trace = ROOT / "traces" / "sample.jsonl"
    cfg = run_config(
        trace=load(trace),
        trace_path=trace,
        trace_format="v1",
        targets=[
            TargetSpec(name="bf16", url=bf16_server.url),
            TargetSpec(name="fp8", url=fp8_server.url, expect_cache_dtype=FP8_DTYPE),
        ],
        schedules=[ClosedLoop(2)],
        quality=QualitySpec(buckets="256,1K", teacher_forced=True),
        run_dir=new_run_dir(tmp_path),
    )
    summary = asyncio.run(Runner(cfg).run()).to_json()
    tf = summary["quality"]["phases"]["c2"]["fp8"]["teacher_forced"]
    assert tf["tokens"] > 0 and not tf["identical_to_reference"]
    assert tf["nll_delta_mean"] != 0


def test_canary_fp8_target_serving_bf16_is_the_fallback_verdict(
    bf16_server: LocalServer, tmp_path: Path
) -> None:
    """The "fp8" URL actually serves cache_dtype=auto: reject for this path, with that
    evidence, exit code 12, a Markdown verdict on stdout and the reports written."""
    import subprocess
    import sys

    url = bf16_server.url
    md = tmp_path / "comment.md"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "replay.cli",
            "canary",
            "--trace",
            "traces/sample.jsonl",
            "--targets",
            f"bf16={url},fp8={url}",
            "--buckets",
            "256,1K",
            "--concurrency",
            "2",
            "--limit",
            "6",
            "--out",
            str(tmp_path),
            "--run-id",
            "canary",
            "--markdown",
            str(md),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 12, proc.stderr[-3000:]
    assert "REJECT FP8 for this path" in proc.stdout
    assert "served cache_dtype is 'auto'" in proc.stdout
    assert md.read_text() == proc.stdout.rstrip("\n") + "\n" or "REJECT" in md.read_text()
    summary = json.loads((tmp_path / "canary" / "summary.json").read_text())
    assert summary["verdict"]["verdict"] == "reject"
    assert any("served cache_dtype is 'auto'" in e["text"] for e in summary["verdict"]["evidence"])
    assert (tmp_path / "canary" / "report.html").exists()


def test_api_key_never_reaches_any_run_artifact(
    bf16_server: LocalServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from replay.present.report import write_reports

    key = "sk-planted-0123456789abcdefSECRET"
    monkeypatch.setenv("KVC_PLANTED_KEY", key)
    trace = ROOT / "traces" / "sample.jsonl"
    loaded = load(trace)
    loaded.requests = loaded.requests[:4]
    cfg = run_config(
        trace=loaded,
        trace_path=trace,
        trace_format="v1",
        targets=[TargetSpec(name="bf16", url=bf16_server.url, api_key_env="KVC_PLANTED_KEY")],
        schedules=[ClosedLoop(2)],
        quality=QualitySpec(buckets="256,1K", teacher_forced=True),
        run_dir=new_run_dir(tmp_path),
    )
    summary = asyncio.run(Runner(cfg).run()).to_json()
    run_dir = Path(summary["run_dir"])
    write_reports(run_dir)
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert len(files) >= 8
    for p in files:
        assert key.encode() not in p.read_bytes(), f"the API key leaked into {p}"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["targets"]["bf16"]["spec"]["api_key_env"] == "KVC_PLANTED_KEY"
    assert all(r.status == "ok" for r in read_results(run_dir))


def test_report_of_a_real_run_in_chromium(bf16_server: LocalServer, tmp_path: Path) -> None:
    """A real replay (bf16 reference, an "fp8" URL that serves BF16), a <script> planted in a
    trace prompt and, through the saved results, in a model answer; `replay report`
    re-renders; headless Chromium shows the verdict, every section, and the payloads as text."""
    import shutil
    import subprocess
    import sys

    from tests.unit.present.test_report import SECTION_IDS
    from tests.unit.present.test_report_browser import ARTIFACTS, chromium

    if shutil.which("chromium") is None:
        pytest.skip("needs Debian's chromium package (scripts/setup --with-browser)")
    payload = "<script>document.title='pwned'</script>"
    lines = (ROOT / "traces" / "sample.jsonl").read_text().splitlines()[:5]
    first = json.loads(lines[0])
    first["messages"][-1]["content"] = payload + first["messages"][-1]["content"]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    url = bf16_server.url
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "replay.cli",
            "--trace",
            str(trace),
            "--targets",
            f"bf16={url},fp8={url}",
            "--buckets",
            "256,1K",
            "--concurrency",
            "2",
            "--out",
            str(tmp_path),
            "--run-id",
            "real",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 3, run.stderr[-2000:]  # the "fp8" target serves BF16
    run_dir = tmp_path / "real"
    results = (run_dir / "results.jsonl").read_text().splitlines()
    answered = json.loads(results[0])
    answered["output_text"] = payload + answered["output_text"]
    (run_dir / "results.jsonl").write_text("\n".join([json.dumps(answered), *results[1:]]) + "\n")
    again = subprocess.run(
        [sys.executable, "-m", "replay.cli", "report", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr
    page = (run_dir / "report.html").resolve().as_uri()
    dom = chromium(tmp_path / "profile", "--dump-dom", page)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert (
        "REJECT" in dom.stdout and "served cache_dtype is &#39;auto&#39;" in dom.stdout
    ) or "served cache_dtype is 'auto'" in dom.stdout
    for sid in SECTION_IDS:
        assert f'<section id="{sid}"' in dom.stdout, sid
    assert "pwned" not in dom.stdout.split("<title>", 1)[1].split("</title>", 1)[0]
    assert dom.stdout.count("&lt;script&gt;document.title='pwned'&lt;/script&gt;") >= 2
    assert "<script>document.title" not in dom.stdout
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "report_real_run.png"
    snap = chromium(tmp_path / "profile2", f"--screenshot={shot}", "--window-size=1400,2400", page)
    assert snap.returncode == 0 and shot.stat().st_size > 10_000
