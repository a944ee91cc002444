"""A target's error budget: backoff while it does not answer, a stop with the reason once it is
spent, every request still accounted for, and `replay`'s own exit code for a target that
answered none of its requests or too many errors. The faulty servers are the in-process fake
(a real server cannot be made to fail every request on demand)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from replay.analysis.schemas import Summary
from replay.cli import EXIT_OK, EXIT_TARGET_ERRORS, main, target_errors
from replay.run.budget import ErrorBudget
from replay.rundir.files import read_results
from tests.conftest import ROOT
from tests.support.fault_server import fault_server

TRACE = ROOT / "traces" / "sample.jsonl"
SAMPLE_IDS = [json.loads(line)["id"] for line in TRACE.read_text().splitlines() if line.strip()]


def test_backoff_doubles_while_unreachable_then_stops_with_the_reason() -> None:
    b = ErrorBudget(max_unreachable=5, backoff_base_s=0.1, backoff_cap_s=0.3)
    assert b.delay() == 0
    delays = []
    for _ in range(4):
        b.record("error", "connect", None, "cannot connect: refused")
        delays.append(b.delay())
    assert delays == [0.1, 0.2, 0.3, 0.3] and not b.spent
    b.record("error", "connect", None, "cannot connect: refused")
    assert b.spent and "5 requests in a row" in (b.reason or "")
    assert "cannot connect: refused" in (b.reason or "")


def test_an_answer_resets_the_backoff_and_cancellations_count_for_nothing() -> None:
    b = ErrorBudget(max_unreachable=3)
    b.record("error", "disconnect")
    b.record("error", "http", 503)
    b.record("ok")
    assert b.delay() == 0 and b.unreachable_run == 0
    for _ in range(10):
        b.record("cancelled", "cancelled")
    assert b.finished == 3 and not b.spent
    b.record("error", "http", 500)  # the server answered: an error, not unreachable
    assert b.unreachable_run == 0


def test_error_count_and_rate_caps() -> None:
    b = ErrorBudget(max_errors=3)
    for _ in range(3):
        b.record("error", "protocol", None, "bad JSON")
    assert b.spent and "--max-errors" in (b.reason or "")
    rate = ErrorBudget(max_error_rate=0.1, min_requests=10)
    for i in range(9):
        rate.record("error" if i < 2 else "ok", "http" if i < 2 else None, 500)
    assert not rate.spent  # 2 of 9, but fewer than min_requests finished
    rate.record("ok")
    assert rate.spent and "2 of 10" in (rate.reason or "")
    with pytest.raises(ValueError):
        ErrorBudget(max_error_rate=1.5)


def _replay(url: str, out: Path, *extra: str) -> tuple[int, Path]:
    res = CliRunner().invoke(
        main,
        [
            "--trace",
            str(TRACE),
            "--targets",
            f"fp8={url}",
            "--buckets",
            "256,1K",
            "--concurrency",
            "1",
            "--no-teacher-forced",
            "--timeout",
            "5",
            "--out",
            str(out),
            "--run-id",
            "run",
            *extra,
        ],
    )
    return res.exit_code, out / "run"


def test_a_target_that_stops_answering_is_backed_off_then_stopped(tmp_path: Path) -> None:
    with fault_server("reset") as bad:
        code, run_dir = _replay(bad.url, tmp_path)
        reached = bad.requests
    results = list(read_results(run_dir))
    assert Counter(r.request_id for r in results) == Counter(SAMPLE_IDS)  # each once
    kinds = Counter(r.error_kind for r in results)
    # Ten resets in a row stop the target; the rest are accounted as not sent.
    assert reached == kinds["disconnect"] == 10, kinds
    assert kinds["unavailable"] == len(SAMPLE_IDS) - 10
    assert all(
        "stopped answering" in (r.error or "") for r in results if r.error_kind == "unavailable"
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    target = summary["targets"]["fp8"]
    assert target["status"] == "failed" and "error budget spent" in target["reason"]
    assert code == EXIT_TARGET_ERRORS
    # The backoff spaced the sends out: 0.05 s doubling, so the tenth waited seconds.
    sent = sorted(r.sent for r in results if r.error_kind == "disconnect" and r.sent)
    assert sent[-1] - sent[0] > 3.0


def test_every_request_failing_exits_with_its_own_code(tmp_path: Path) -> None:
    # --max-error-rate 1: the budget never stops the target, so all 30 are sent and fail.
    with fault_server("http500") as bad:
        code, run_dir = _replay(bad.url, tmp_path, "--max-error-rate", "1")
        reached = bad.requests
    assert reached == len(SAMPLE_IDS)
    assert code == EXIT_TARGET_ERRORS
    summary = Summary.from_json(json.loads((run_dir / "summary.json").read_text()))
    assert target_errors(summary, 1.0) == [("fp8", f"answered none of its {reached} requests")]


def test_the_error_rate_stops_a_target_and_a_healthy_run_exits_zero(tmp_path: Path) -> None:
    with fault_server("http500") as bad:
        code, run_dir = _replay(bad.url, tmp_path / "a", "--max-error-rate", "0.5")
        reached = bad.requests
    assert reached == 20 and code == EXIT_TARGET_ERRORS  # stopped after min_requests
    results = list(read_results(run_dir))
    assert len(results) == len(SAMPLE_IDS)
    with fault_server("split") as good:
        code, _ = _replay(good.url, tmp_path / "b")
    assert code == EXIT_OK
