"""Locust's distributed mode beyond one network namespace and beyond workers that all live to
the end: a master and workers on hosts of their own (network namespaces joined by veth pairs,
``tests/support/netns.py``), a worker killed mid-test, a worker cut off and back, and the
master stopped by SIGTERM while workers send. Every trace request must end in the run
directory exactly once: answered, or lost / unavailable / cancelled with its reason.

The target is the bench's fast fake server (``tests/support/fast_target.py``), paced so a
test is mid-way when a worker goes; Locust runs in subprocesses, as in ``test_locust.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from replay.serving.local_server import free_port
from tests.integration.test_locust import TIMEOUT_S, locust, report, rows, started
from tests.support.fast_target import fast_target
from tests.support.netns import Hosts, unavailable

TOKENS = 8


def write_trace(path: Path, n: int) -> list[str]:
    """``n`` short completions (four prompt token ids, ``TOKENS`` out); each names itself in
    the body's ``user``, which the fast server keys its stamps by."""
    ids = [f"r{i:04d}" for i in range(n)]
    with path.open("wb") as fh:
        for rid in ids:
            rec = {"id": rid, "api": "completions", "prompt": [1, 2, 3, 4]}
            fh.write(orjson.dumps({**rec, "max_tokens": TOKENS, "params": {"user": rid}}) + b"\n")
    return ids


def options(url: str, trace: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "--kvc-target",
        url,
        "--kvc-trace",
        str(trace),
        "--kvc-checkers",
        "off",
        "--kvc-run-dir",
        str(run_dir),
        *extra,
    ]


def accounts(run_dir: Path) -> list[dict[str, Any]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    out: list[dict[str, Any]] = summary["driver"]["accounts"]
    return out


def wait_rows(run_dir: Path, n: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not ((run_dir / "results.jsonl").exists() and len(rows(run_dir)) >= n):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)


def wait_log(log: Path, text: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)


def loopback_fleet(
    tmp_path: Path, url: str, trace: Path, run_dir: Path, *extra: str
) -> tuple[list[str], list[str]]:
    """The commands of a master (``-u 2``: one user per worker) and of one worker."""
    port = free_port()
    master = locust(
        "--master",
        "--headless",
        "--expect-workers",
        "2",
        "-u",
        "2",
        "-r",
        "2",
        "--master-bind-host",
        "127.0.0.1",
        "--master-bind-port",
        str(port),
        *options(url, trace, run_dir, *extra),
    )
    return master, locust("--worker", "--master-host", "127.0.0.1", "--master-port", str(port))


def finish(m: subprocess.Popen[bytes], log: Path, *workers: subprocess.Popen[bytes]) -> int:
    try:
        rc = m.wait(timeout=TIMEOUT_S)
        for w in workers:
            w.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("distributed run did not finish:\n" + log.read_text()[-4000:])
    return rc


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    """A master, two workers and a target, each in a network namespace of its own; removed
    whatever the test does."""
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    with Hosts(2) as net:
        yield net


# -- across hosts -------------------------------------------------------------------------------


def test_master_and_two_workers_on_three_hosts_match_a_single_process_run(
    hosts: Hosts, tmp_path: Path
) -> None:
    """The master in one namespace, each worker in another, the target in a fourth that only
    the workers reach: every request once, as a single process sends the same trace."""
    ids = write_trace(tmp_path / "trace.jsonl", 40)
    trace, single, dist = tmp_path / "trace.jsonl", tmp_path / "single", tmp_path / "dist"
    with fast_target(tmp_path / "target.log", hosts=hosts) as target:
        one = hosts.cmd(
            "w1", locust("--headless", "-u", "4", "-r", "4", *options(target.url, trace, single))
        )
        with started(one, tmp_path / "single.log") as p:
            assert finish(p, tmp_path / "single.log") == 0
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
            hosts.master_addr,
            "--master-bind-port",
            "5557",
            *options(target.url, trace, dist),
        )
        worker = locust("--worker", "--master-host", hosts.master_addr, "--master-port", "5557")
        log = tmp_path / "master.log"
        with (
            started(hosts.cmd("master", master), log) as m,
            started(hosts.cmd("w1", worker), tmp_path / "w1.log") as w1,
            started(hosts.cmd("w2", worker), tmp_path / "w2.log") as w2,
        ):
            rc = finish(m, log, w1, w2)
    assert rc == 0, log.read_text()[-4000:]
    got, alone = rows(dist), rows(single)
    assert Counter(r["request_id"] for r in got) == Counter(ids)  # every id, once
    assert Counter(r["request_id"] for r in alone) == Counter(ids)
    assert {r["status"] for r in got} == {r["status"] for r in alone} == {"ok"}
    assert {r["output_tokens"] for r in got} == {TOKENS}
    books = accounts(dist)
    assert [(a["assigned"], a["reported"], a["answered"], a["lost"]) for a in books] == [
        (20, 20, 20, 0),
        (20, 20, 20, 0),
    ]
    assert len({a["node"] for a in books}) == 2
    # The master has no route to the target: the run keeps a worker's view of it.
    manifest = json.loads((dist / "manifest.json").read_text())
    target_info = manifest["targets"]["target"]
    assert any("the master cannot reach the target" in p for p in target_info["problems"])
    assert target_info["model_id"] == "bench"
    report(dist)


# -- a worker lost ------------------------------------------------------------------------------


def test_a_worker_killed_mid_test_loses_nothing_silently(tmp_path: Path) -> None:
    """SIGKILL one of two workers once 10 results are in: what it reported is kept, what it
    had taken is lost with the reason, what it never took goes to the other, and the master
    finishes with every request once, each worker's account in the summary and the report."""
    ids = write_trace(tmp_path / "trace.jsonl", 60)
    run_dir, log = tmp_path / "run", tmp_path / "master.log"
    with fast_target(tmp_path / "target.log", ttft_ms=20, itl_ms=10) as target:
        master, worker = loopback_fleet(tmp_path, target.url, tmp_path / "trace.jsonl", run_dir)
        t0 = time.monotonic()
        with (
            started(master, log) as m,
            started(worker, tmp_path / "w1.log") as w1,
            started(worker, tmp_path / "w2.log") as w2,
        ):
            wait_rows(run_dir, 10, m, log)
            os.killpg(w2.pid, signal.SIGKILL)
            rc = finish(m, log, w1)
        took = time.monotonic() - t0
    out = log.read_text()
    assert rc == 0, out[-4000:]
    got = rows(run_dir)
    assert Counter(r["request_id"] for r in got) == Counter(ids)  # nothing twice, none missing
    kinds = Counter((r["status"], r["error_kind"]) for r in got)
    assert set(kinds) <= {("ok", None), ("cancelled", "lost")}, kinds
    lost = [r for r in got if r["error_kind"] == "lost"]
    assert 1 <= len(lost) <= 8, kinds  # in flight, or granted and about to be sent
    assert all("lost with worker" in r["error"] and "missing" in r["error"] for r in lost)
    by_status = {a["status"]: a for a in accounts(run_dir)}
    dead, alive = by_status["lost"], by_status["done"]
    assert dead["lost"] == len(lost) and dead["reassigned"] == alive["adopted"] > 0
    assert dead["answered"] + alive["answered"] == kinds[("ok", None)]
    assert dead["reported"] + dead["lost"] + dead["reassigned"] == dead["assigned"] == 30
    summary = json.loads((run_dir / "summary.json").read_text())
    (phase,) = summary["targets"]["target"]["phases"].values()
    assert phase["all"]["errors_by_kind"] == {"lost": len(lost)}
    assert "lost: Locust marked it missing" in out
    assert took < 90
    report(run_dir)
    html = (run_dir / "report.html").read_text()
    assert 'id="workers"' in html and "Locust marked it missing" in html


def test_a_worker_cut_off_and_back_sends_what_it_was_granted(tmp_path: Path) -> None:
    """SIGSTOP a worker until the master gives it up (its unclaimed requests go to the
    other), then SIGCONT: what it was granted it still sends, and those answers count."""
    ids = write_trace(tmp_path / "trace.jsonl", 60)
    run_dir, log = tmp_path / "run", tmp_path / "master.log"
    with fast_target(tmp_path / "target.log", ttft_ms=20, itl_ms=10) as target:
        master, worker = loopback_fleet(tmp_path, target.url, tmp_path / "trace.jsonl", run_dir)
        with (
            started(master, log) as m,
            started(worker, tmp_path / "w1.log") as w1,
            started(worker, tmp_path / "w2.log") as w2,
        ):
            wait_rows(run_dir, 10, m, log)
            os.killpg(w2.pid, signal.SIGSTOP)
            wait_log(log, "lost: Locust marked it missing", m)
            os.killpg(w2.pid, signal.SIGCONT)
            rc = finish(m, log, w1, w2)
    out = log.read_text()
    assert rc == 0, out[-4000:]
    got = rows(run_dir)
    assert Counter(r["request_id"] for r in got) == Counter(ids)
    (back,) = [a for a in accounts(run_dir) if a["status"] == "lost"]
    assert back["back_at_s"] is not None and back["answered_after_loss"] >= 1, back
    assert back["lost"] == 0  # all it had taken came back answered
    assert {r["status"] for r in got} == {"ok"}
    assert "is back after it was given up" in out


def test_master_sigterm_while_workers_send_completes_the_run_directory(tmp_path: Path) -> None:
    """A container stop of the master mid-test: the workers' in-flight and unsent requests
    are recorded as cancelled, the run directory is complete and ``replay report`` renders
    it."""
    ids = write_trace(tmp_path / "trace.jsonl", 60)
    run_dir, log = tmp_path / "run", tmp_path / "master.log"
    with fast_target(tmp_path / "target.log", ttft_ms=20, itl_ms=10) as target:
        master, worker = loopback_fleet(tmp_path, target.url, tmp_path / "trace.jsonl", run_dir)
        with (
            started(master, log) as m,
            started(worker, tmp_path / "w1.log") as w1,
            started(worker, tmp_path / "w2.log") as w2,
        ):
            wait_rows(run_dir, 10, m, log)
            m.send_signal(signal.SIGTERM)
            rc = finish(m, log, w1, w2)
    assert rc == 143, log.read_text()[-4000:]
    got = rows(run_dir)
    assert Counter(r["request_id"] for r in got) == Counter(ids)
    kinds = Counter(r["status"] for r in got)
    assert set(kinds) == {"ok", "cancelled"} and kinds["ok"] >= 10, kinds
    books = accounts(run_dir)
    assert sum(a["reported"] for a in books) == len(ids)
    assert all(a["status"] == "done" and a["lost"] == 0 for a in books), books
    report(run_dir)
