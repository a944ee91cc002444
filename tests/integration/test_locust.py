"""kvcanary as a Locust test, run the way users run it: ``locust -f scenarios/locustfile.py``.

Locust always runs in subprocesses here: importing it monkey-patches a process (gevent), which
must not happen to the test process. The vLLM tests drive the real CPU server of the session
(``bf16_server``): headless with per-bucket statistics and a run directory ``replay report``
renders, the sweep and trace shapes, a master with two workers (each trace request exactly
once, checked from the run directory), and the web UI in headless Chromium (screenshot kept as
tests/artifacts/locust_ui.png). The others need no server.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

# Found, not imported: importing locust monkeypatches this process with gevent.
if importlib.util.find_spec("locust") is None:
    pytest.skip("Locust comes with the load (or dev) extra", allow_module_level=True)

from replay.rundir.manifest import read_manifest
from replay.serving.local_server import LocalServer, free_port
from replay.traces.importers import load
from tests.conftest import ARTIFACTS, ROOT

LOCUSTFILE = ROOT / "scenarios" / "locustfile.py"
SAMPLE = ROOT / "traces" / "sample.jsonl"
CHROMIUM = shutil.which("chromium")
TIMEOUT_S = 150  # one Locust run; each finishes in well under a minute on two cores


# -- running Locust -----------------------------------------------------------------------------


def locust(*args: str) -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), *args]


@contextmanager
def started(cmd: Sequence[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process in its own group, always killed (with its children) on the way out."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(cmd),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=15)


def run(cmd: Sequence[str], log: Path, timeout: float = TIMEOUT_S) -> tuple[int, str]:
    with started(cmd, log) as proc:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{' '.join(cmd[3:])} ran over {timeout} s:\n{_tail(log)}")
    return rc, log.read_text(errors="replace")


def _tail(log: Path, n: int = 4000) -> str:
    return log.read_text(errors="replace")[-n:]


def rows(run_dir: Path) -> list[dict[str, Any]]:
    text = (run_dir / "results.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def stats_names(prefix: Path) -> dict[str, dict[str, str]]:
    with open(f"{prefix}_stats.csv", newline="") as fh:
        return {r["Name"]: r for r in csv.DictReader(fh) if r["Name"] != "Aggregated"}


def report(run_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "replay.cli", "report", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run_dir / "report.html").stat().st_size > 10_000


def sample_ids(limit: int = 0) -> list[str]:
    reqs = load(SAMPLE).requests
    return [r.id for r in (reqs[:limit] if limit else reqs)]


def chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=8000",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


# -- no server needed ---------------------------------------------------------------------------


def test_locustfile_offers_its_user_and_checks_its_options(tmp_path: Path) -> None:
    rc, out = run(locust("--list"), tmp_path / "list.log", timeout=60)
    assert rc == 0 and "LLMUser" in out, out
    rc, out = run(locust("--headless", "--kvc-shape", "ramp"), tmp_path / "bad.log", timeout=60)
    assert rc == 2 and "--kvc-shape: invalid choice: 'ramp'" in out, out


def test_bad_options_stop_a_headless_run_before_it_starts(tmp_path: Path) -> None:
    rc, out = run(
        locust(
            "--headless",
            "--kvc-trace",
            str(tmp_path / "missing.jsonl"),
            "--kvc-target",
            "http://127.0.0.1:9",
        ),
        tmp_path / "bad.log",
        timeout=60,
    )
    assert rc == 2 and "no such trace file" in out, out
    rc, out = run(
        locust(
            "--headless",
            "--kvc-shape",
            "step",
            "--kvc-levels",
            "4,4",
            "--kvc-target",
            "http://127.0.0.1:9",
        ),
        tmp_path / "bad2.log",
        timeout=60,
    )
    assert rc == 2 and "--kvc-levels" in out, out


def test_unreachable_target_still_accounts_for_every_request(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    rc, out = run(
        locust(
            "--headless",
            "-u",
            "2",
            "-r",
            "2",
            "--kvc-target",
            f"http://127.0.0.1:{free_port()}",
            "--kvc-limit",
            "5",
            "--kvc-run-dir",
            str(run_dir),
        ),
        tmp_path / "locust.log",
        timeout=90,
    )
    assert rc == 3, out
    got = rows(run_dir)
    assert Counter(r["request_id"] for r in got) == Counter(sample_ids(5))
    assert {(r["status"], r["error_kind"]) for r in got} == {("error", "unavailable")}
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["targets"]["target"]["status"] == "failed"
    report(run_dir)


def test_a_target_that_stops_answering_ends_a_looping_test(tmp_path: Path) -> None:
    """--kvc-loop on against a server that resets every answer: the error budget backs off,
    then stops the test with its own exit code and a complete run directory, instead of a
    busy loop that writes errors until the disk is full."""
    from tests.support.fault_server import fault_server

    run_dir = tmp_path / "run"
    with fault_server("reset") as bad:
        t0 = time.monotonic()
        rc, out = run(
            locust(
                "--headless",
                "-u",
                "2",
                "-r",
                "2",
                "--kvc-target",
                f"fp8={bad.url}",
                "--kvc-loop",
                "on",
                "--kvc-checkers",
                "off",
                "--kvc-run-dir",
                str(run_dir),
            ),
            tmp_path / "locust.log",
            timeout=90,
        )
        took = time.monotonic() - t0
    assert rc == 4, out[-3000:]
    assert "error budget spent: the target stopped answering" in out
    got = rows(run_dir)
    kinds = Counter(r["error_kind"] for r in got)
    # Ten resets in a row spend the budget; what the two users had in flight or in hand at the
    # stop is recorded too (cancelled, or not sent), never as a success.
    assert 10 <= kinds["disconnect"] <= bad.requests <= len(got) <= 14, kinds
    assert set(kinds) <= {"disconnect", "cancelled", "unavailable"}, kinds
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "error budget" in summary["targets"]["fp8"]["reason"]
    assert took < 60


def test_a_looping_test_stores_at_most_max_results(tmp_path: Path) -> None:
    from tests.support.fault_server import fault_server

    run_dir = tmp_path / "run"
    with fault_server("split") as good:
        rc, out = run(
            locust(
                "--headless",
                "-u",
                "2",
                "-r",
                "2",
                "--kvc-target",
                f"fp8={good.url}",
                "--kvc-loop",
                "on",
                "--kvc-checkers",
                "off",
                "--kvc-max-results",
                "50",
                "--run-time",
                "4s",
                "--kvc-run-dir",
                str(run_dir),
            ),
            tmp_path / "locust.log",
            timeout=90,
        )
        sent = good.requests
    assert rc == 0, out[-3000:]
    assert len(rows(run_dir)) == 50 < sent  # counted past the cap, not stored
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["results_not_stored"] >= sent - 50 - 4  # minus what the stop cancelled
    assert any("--kvc-max-results 50" in p for p in manifest["targets"]["fp8"]["problems"])


STUB_SERVER = """
import asyncio, json, sys
from aiohttp import web

async def complete(request):
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for k in range(1, 31):
        ev = {"choices": [{"index": 0, "text": "a"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": k}}
        await resp.write(f"data: {json.dumps(ev)}\\n\\n".encode())
        await asyncio.sleep(0.02)
    await resp.write(b"data: [DONE]\\n\\n")
    return resp

app = web.Application()
app.router.add_post("/v1/completions", complete)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""

BRIDGE_CLIENT = """
import locust  # monkey-patches this process, as in a Locust run
import json, sys
import gevent
sys.path.insert(0, sys.argv[2])
from kvc.bridge import AsyncBridge
from replay.serving.client import Client
from replay.core.records import Result
from replay.traces.trace import Request

bridge = AsyncBridge()

async def make():
    return Client(sys.argv[1], "m")

client = bridge.call(make())
req = Request(id="r", api="completions", prompt="x", max_tokens=30)

def user(i):
    res = Result(request_id=f"r{i}", target="t", phase="c4", bucket="<256", scheduled=0.0)
    return bridge.call(client.send(req, res))

def busy():  # other greenlets keep the hub busy, as Locust's own do
    for _ in range(300):
        sum(range(2000))
        gevent.sleep(0.001)

gs = [gevent.spawn(user, i) for i in range(4)] + [gevent.spawn(busy)]
gevent.joinall(gs)
out = [{"status": g.value.status, "tokens": g.value.output_tokens, "itl": g.value.itl()}
       for g in gs[:4]]
print(json.dumps(out))
"""


def test_one_asyncio_loop_in_a_greenlet_keeps_the_core_clients_timing(tmp_path: Path) -> None:
    """The bridge under gevent: chunks 20 ms apart are timed 20 ms apart, not batched, with
    four streams at once and a busy hub."""
    port = free_port()
    (tmp_path / "server.py").write_text(textwrap.dedent(STUB_SERVER))
    (tmp_path / "client.py").write_text(textwrap.dedent(BRIDGE_CLIENT))
    with started([sys.executable, str(tmp_path / "server.py"), str(port)], tmp_path / "server.log"):
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
            except urllib.error.HTTPError:
                break  # the server answers (404 for GET /)
            except OSError:
                assert time.monotonic() < deadline, _tail(tmp_path / "server.log")
                time.sleep(0.2)
        proc = subprocess.run(
            [
                sys.executable,
                str(tmp_path / "client.py"),
                f"http://127.0.0.1:{port}",
                str(ROOT / "scenarios"),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    gaps = [g for r in results for g in r["itl"]]
    assert [r["status"] for r in results] == ["ok"] * 4
    assert [r["tokens"] for r in results] == [30] * 4  # from usage, not chunks
    assert len(gaps) == 4 * 29
    batched = sum(g < 0.005 for g in gaps) / len(gaps)
    median = sorted(gaps)[len(gaps) // 2]
    assert batched < 0.2 and 0.012 < median < 0.04, (batched, median)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package")
def test_web_ui_start_form_has_the_kvcanary_parameters(tmp_path: Path) -> None:
    port = free_port()
    with started(
        locust(
            "--web-host", "127.0.0.1", "--web-port", str(port), "--kvc-target", "http://127.0.0.1:9"
        ),
        tmp_path / "locust.log",
    ):
        wait_http(f"http://127.0.0.1:{port}/")
        dom = chromium(tmp_path / "profile", "--dump-dom", f"http://127.0.0.1:{port}/")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Custom parameters" in dom.stdout
    for name in (
        "kvc_trace",
        "kvc_target",
        "kvc_buckets",
        "kvc_checkers",
        "kvc_shape",
        "kvc_levels",
        "kvc_time_scale",
    ):
        assert name in dom.stdout, name


def test_web_ui_picks_a_shape_and_takes_its_parameters_from_the_form(tmp_path: Path) -> None:
    """Start from the web UI's form (its HTTP API): the Shape picker and the kvcanary fields
    apply to that test; a second test gets a run directory of its own."""
    port, run_dir = free_port(), tmp_path / "run"
    url = f"http://127.0.0.1:{port}/"
    form = urllib.parse.urlencode(
        {
            "user_count": 2,
            "spawn_rate": 2,
            "shape_class": "StepSweep",
            "kvc_levels": "2,3",
            "kvc_hold": 1,
        }
    ).encode()
    with started(
        locust(
            "--web-host",
            "127.0.0.1",
            "--web-port",
            str(port),
            "--class-picker",
            "--kvc-target",
            f"http://127.0.0.1:{free_port()}",
            "--kvc-limit",
            "3",
            "--kvc-run-dir",
            str(run_dir),
        ),
        tmp_path / "locust.log",
    ):
        wait_http(url)
        for attempt in (1, 2):
            with urllib.request.urlopen(url + "swarm", data=form, timeout=10) as resp:
                assert json.load(resp)["success"]
            deadline = time.monotonic() + 60
            while True:  # nothing answers at the target: the test fails fast and stops
                with urllib.request.urlopen(url + "stats/requests", timeout=10) as resp:
                    state = json.load(resp)
                done = run_dir if attempt == 1 else tmp_path / "run-2"
                if state["state"] == "stopped" and (done / "summary.json").exists():
                    break
                assert time.monotonic() < deadline, _tail(tmp_path / "locust.log")
                time.sleep(0.5)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["driver"]["shape"] == "step"
    assert read_manifest(run_dir).schedules == ("c2", "c3")  # the run spec's
    assert manifest["targets"]["target"]["status"] == "failed"
    assert "prepare target" in {s["name"] for s in state["stats"]}  # the reason, in the UI
    assert len(rows(tmp_path / "run-2")) == 3


# -- against the real vLLM CPU server --------------------------------------------------------


@pytest.mark.vllm
def test_headless_run_reports_per_bucket_and_writes_a_run_directory(
    bf16_server: LocalServer, tmp_path: Path
) -> None:
    run_dir, stats = tmp_path / "run", tmp_path / "stats"
    limit = 10
    rc, out = run(
        locust(
            "--headless",
            "-u",
            "4",
            "-r",
            "4",
            "--run-time",
            "120s",
            "--kvc-target",
            f"bf16={bf16_server.url}",
            "--kvc-trace",
            str(SAMPLE),
            "--kvc-buckets",
            "256,1K",
            "--kvc-limit",
            str(limit),
            "--kvc-run-dir",
            str(run_dir),
            "--csv",
            str(stats),
        ),
        tmp_path / "locust.log",
    )
    assert rc == 0, out[-4000:]
    names = stats_names(stats)
    got = rows(run_dir)
    # The sample's first 10 requests: 9 below 256 tokens, and the tool call (its tool
    # definitions make it longer) between 256 and 1K.
    for metric in ("ttft", "e2e", "output_tokens", "check"):
        for bucket in ("<256", "256-1K"):
            assert f"{metric} {bucket}" in names, (metric, bucket, sorted(names))
    # One ITL event per token gap the run directory records: the text answers have many; the
    # tool call (alone in 256-1K) arrives in few deltas, as vLLM's hermes parser buffers it,
    # and on a loaded machine in a single one, which has no gap to report.
    for bucket in ("<256", "256-1K"):
        chunks = [len(r["chunk_tokens"]) for r in got if r["bucket"] == bucket]
        assert (f"itl {bucket}" in names) == any(n > 1 for n in chunks), (bucket, chunks)
    assert not any(n.startswith(("ttft >=1K", "e2e >=1K")) for n in names)
    for bucket in ("<256", "256-1K"):
        assert names[f"e2e {bucket}"]["Failure Count"] == "0"
        assert float(names[f"ttft {bucket}"]["Median Response Time"]) > 0
    assert int(names["itl <256"]["Request Count"]) > int(names["ttft <256"]["Request Count"])
    assert sum(int(names[f"e2e {b}"]["Request Count"]) for b in ("<256", "256-1K")) == limit

    assert Counter(r["request_id"] for r in got) == Counter(sample_ids(limit))
    assert {r["status"] for r in got} == {"ok"} and {r["phase"] for r in got} == {"c4"}
    assert all(r["output_tokens"] > 0 and not r["tokens_estimated"] for r in got)
    summary = json.loads((run_dir / "summary.json").read_text())
    phase = summary["targets"]["bf16"]["phases"]["c4"]
    assert set(phase["buckets"]) == {"<256", "256-1K"}
    # Scraped at the phase's edges (before the go, after the last answer), however short the
    # run: counter and histogram deltas then cover every request of the phase.
    assert phase["all"]["ttft_ms"]["p50"] > 0 and phase["server"]["scrapes"] >= 2
    assert phase["server"]["server_e2e_mean_ms"] is not None
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["driver"]["name"] == "locust" and read_manifest(run_dir).schedules == ("c4",)
    assert manifest["targets"]["bf16"]["cache_config"]["cache_dtype"] == "auto"
    assert (run_dir / "grades.jsonl").read_text().count("\n") == limit
    report(run_dir)
    # One analysis for both drivers: the CLI's run of the same requests has the same fields.
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "replay.cli",
            "--trace",
            str(SAMPLE),
            "--targets",
            f"bf16={bf16_server.url}",
            "--buckets",
            "256,1K",
            "--limit",
            str(limit),
            "--no-teacher-forced",
            "--out",
            str(tmp_path),
            "--run-id",
            "cli",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert cli.returncode == 0, cli.stdout[-3000:] + cli.stderr[-3000:]
    other = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert set(summary) - {"driver"} == set(other) - {"verdict"}
    cli_phase = other["targets"]["bf16"]["phases"]["c4"]
    assert set(phase) == set(cli_phase) and set(phase["all"]) == set(cli_phase["all"])
    assert set(phase["server"]) == set(cli_phase["server"])
    q, cq = summary["quality"]["phases"]["c4"]["bf16"], other["quality"]["phases"]["c4"]["bf16"]
    assert set(q["buckets"]["<256"]) == set(cq["buckets"]["<256"])
    # One manifest builder too: the same fields, less what only one driver has.
    cli_manifest = json.loads((tmp_path / "cli" / "manifest.json").read_text())
    locust_only = {"driver", "results_not_stored"}
    cli_only = {"cli_options", "interrupted", "resumed"}
    assert set(manifest) - locust_only == set(cli_manifest) - cli_only
    assert set(manifest["trace"]) == set(cli_manifest["trace"])
    entry, cli_entry = manifest["targets"]["bf16"], cli_manifest["targets"]["bf16"]
    assert {"spec", "status", "reason", "phases", "cache_config"} <= set(entry) & set(cli_entry)


@pytest.mark.vllm
def test_sigterm_ends_a_looping_test_with_its_summary(
    bf16_server: LocalServer, tmp_path: Path
) -> None:
    """A container stop (SIGTERM) of a headless looping test: the users end at once and the
    run directory is complete (summary, grades), so `replay report` renders it."""
    run_dir = tmp_path / "run"
    cmd = locust(
        "--headless",
        "-u",
        "2",
        "-r",
        "2",
        "--kvc-target",
        f"bf16={bf16_server.url}",
        "--kvc-loop",
        "on",
        "--kvc-buckets",
        "256,1K",
        "--kvc-limit",
        "10",
        "--kvc-run-dir",
        str(run_dir),
    )
    log = tmp_path / "locust.log"
    with started(cmd, log) as proc:
        deadline = time.monotonic() + TIMEOUT_S
        while not ((run_dir / "results.jsonl").exists() and len(rows(run_dir)) >= 12):
            assert proc.poll() is None and time.monotonic() < deadline, _tail(log)
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    out = log.read_text(errors="replace")
    assert rc == 143, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    got = rows(run_dir)
    (phase,) = summary["targets"]["bf16"]["phases"].values()
    assert phase["all"]["requests"] == len(got) >= 12
    assert {r["status"] for r in got} <= {"ok", "cancelled"}
    assert (run_dir / "grades.jsonl").exists()
    report(run_dir)


@pytest.mark.vllm
def test_step_sweep_levels_are_phases(bf16_server: LocalServer, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    rc, out = run(
        locust(
            "--headless",
            "--kvc-shape",
            "step",
            "--kvc-levels",
            "1,3",
            "--kvc-hold",
            "4",
            "--kvc-ramp",
            "3",
            "--kvc-loop",
            "on",
            "--kvc-checkers",
            "off",
            "--kvc-target",
            bf16_server.url,
            "--kvc-buckets",
            "256,1K",
            "--kvc-run-dir",
            str(run_dir),
        ),
        tmp_path / "locust.log",
    )
    assert rc == 0, out[-4000:]
    assert time.monotonic() - t0 < 60  # the sweep ends after its last level
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert read_manifest(run_dir).schedules == ("c1", "c3")
    windows = manifest["targets"]["target"]["phases"]
    assert windows["c1"]["end"] == windows["c3"]["start"]
    assert windows["c1"]["end"] - windows["c1"]["start"] == pytest.approx(4 + 1 / 3, abs=1.2)
    got = rows(run_dir)
    # Every request is tagged with the level it was sent at. On a loaded machine a c3
    # request may outlast the 4 s hold, so only c1 is sure to have finished ones.
    assert {r["phase"] for r in got} == {"c1", "c3"}
    assert any(r["status"] == "ok" and r["phase"] == "c1" for r in got)
    # requests in flight when the sweep ended are recorded as cancelled, not lost
    assert {r["status"] for r in got} <= {"ok", "cancelled"}
    report(run_dir)


@pytest.mark.vllm
def test_trace_shape_sends_at_the_trace_timestamps(
    bf16_server: LocalServer, tmp_path: Path
) -> None:
    run_dir, scale = tmp_path / "run", 0.25
    rc, out = run(
        locust(
            "--headless",
            "--kvc-shape",
            "trace",
            "--kvc-time-scale",
            str(scale),
            "--kvc-max-in-flight",
            "8",
            "--kvc-limit",
            "16",
            "--kvc-checkers",
            "off",
            "--kvc-target",
            bf16_server.url,
            "--kvc-run-dir",
            str(run_dir),
        ),
        tmp_path / "locust.log",
    )
    assert rc == 0, out[-4000:]
    t = {r.id: r.t for r in load(SAMPLE).requests[:16]}
    got = {r["request_id"]: r for r in rows(run_dir)}
    assert set(got) == set(t) and {r["phase"] for r in got.values()} == {"trace-x0.25"}
    first = min(got, key=lambda i: t[i] or 0.0)
    for rid, r in got.items():
        due = ((t[rid] or 0.0) - (t[first] or 0.0)) * scale
        assert r["scheduled"] - got[first]["scheduled"] == pytest.approx(due, abs=1e-6)
        assert r["sent"] >= r["scheduled"]


@pytest.mark.vllm
def test_master_and_two_workers_send_every_request_exactly_once(
    bf16_server: LocalServer, tmp_path: Path
) -> None:
    run_dir, stats, port = tmp_path / "run", tmp_path / "stats", free_port()
    master = locust(
        "--master",
        "--headless",
        "--expect-workers",
        "2",
        "-u",
        "4",
        "-r",
        "4",
        "--master-bind-host",
        "127.0.0.1",
        "--master-bind-port",
        str(port),
        "--kvc-target",
        bf16_server.url,
        "--kvc-trace",
        str(SAMPLE),
        "--kvc-buckets",
        "256,1K",
        "--kvc-checkers",
        "off",
        "--kvc-run-dir",
        str(run_dir),
        "--csv",
        str(stats),
    )
    worker = locust("--worker", "--master-host", "127.0.0.1", "--master-port", str(port))
    with (
        started(master, tmp_path / "master.log") as m,
        started(worker, tmp_path / "w1.log") as w1,
        started(worker, tmp_path / "w2.log") as w2,
    ):
        try:
            rc = m.wait(timeout=TIMEOUT_S)
            w1.wait(timeout=30)
            w2.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("distributed run did not finish:\n" + _tail(tmp_path / "master.log"))
    assert rc == 0, _tail(tmp_path / "master.log")
    ids = sample_ids()
    got = rows(run_dir)
    seen = Counter(r["request_id"] for r in got)
    assert set(seen) == set(ids) and set(seen.values()) == {1}, seen
    assert {r["status"] for r in got} == {"ok"}
    # each worker prepared and sent its own half (i % 2), and the master merged their stats
    logs = [(tmp_path / f"w{k}.log").read_text() for k in (1, 2)]
    assert sorted("shard 1/2 ready: 15 requests" in x for x in logs) == [False, True]
    assert sorted("shard 2/2 ready: 15 requests" in x for x in logs) == [False, True]
    names = stats_names(stats)
    assert sum(int(r["Request Count"]) for n, r in names.items() if n.startswith("e2e ")) == 30
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["driver"]["shards"] == 2 and manifest["driver"]["role"] == "MasterRunner"
    report(run_dir)


@pytest.mark.vllm
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package")
def test_web_ui_shows_the_per_bucket_entries(bf16_server: LocalServer, tmp_path: Path) -> None:
    port, run_dir = free_port(), tmp_path / "run"
    url = f"http://127.0.0.1:{port}/"
    cmd = locust(
        "--web-host",
        "127.0.0.1",
        "--web-port",
        str(port),
        "--autostart",
        "-u",
        "2",
        "-r",
        "2",
        "--kvc-target",
        bf16_server.url,
        "--kvc-buckets",
        "256,1K",
        "--kvc-limit",
        "8",
        "--kvc-run-dir",
        str(run_dir),
    )
    with started(cmd, tmp_path / "locust.log"):
        wait_http(url)
        deadline = time.monotonic() + TIMEOUT_S
        while True:  # the trace is exhausted, the test stops, the UI stays up
            with urllib.request.urlopen(url + "stats/requests", timeout=10) as resp:
                state = json.load(resp)
            if state["state"] == "stopped" and (run_dir / "summary.json").exists():
                break
            assert time.monotonic() < deadline, _tail(tmp_path / "locust.log")
            time.sleep(1)
        dom = chromium(tmp_path / "profile-dom", "--dump-dom", url)
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "locust_ui.png"
        shot.unlink(missing_ok=True)
        snap = chromium(
            tmp_path / "profile-shot",
            f"--screenshot={shot}",
            "--window-size=1400,1000",
            "--hide-scrollbars",
            url,
        )
    assert dom.returncode == 0 and snap.returncode == 0, dom.stderr[-2000:]
    names = {s["name"] for s in state["stats"]}
    for entry in ("ttft <256", "itl <256", "e2e <256", "output_tokens <256", "ttft 256-1K"):
        assert entry in names, entry
        assert entry.replace("<", "&lt;") in dom.stdout, entry  # rendered in the table
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    assert Counter(r["request_id"] for r in rows(run_dir)) == Counter(sample_ids(8))
