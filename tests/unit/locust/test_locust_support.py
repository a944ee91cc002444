"""The Locust adapter's core side (``replay.locust``), without Locust or a server:
load plans, sharding, Results as Locust events, target resolution, the run directory.

Nothing here imports Locust: importing it monkey-patches the whole test process (gevent).
The adapter itself runs in subprocesses in ``test_locust.py``.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replay.analysis.run_spec import (
    BudgetSpec,
    LoadSpec,
    QualitySpec,
    RunDirSpec,
    RunSpec,
    TraceSpec,
)
from replay.checkers import Grader
from replay.core.errors import ConfigError
from replay.core.records import Result
from replay.locust.events import LocustEvent, check_event, locust_events, sample_evenly
from replay.locust.messages import RunPlan
from replay.locust.plans import (
    Constant,
    StepSweep,
    TraceTimes,
    parse_levels,
    read_shard,
    shard_indices,
)
from replay.locust.recorder import RunRecorder, cancelled_result
from replay.locust.target import resolve_target
from replay.present.report import write_reports
from replay.rundir.files import file_digest
from replay.rundir.manifest import read_manifest
from replay.serving.targets import TargetSpec
from replay.traces.importers import load, scan
from replay.traces.trace import Request
from tests.conftest import ROOT
from tests.support.run_config import bare_spec

SAMPLE = ROOT / "traces" / "sample.jsonl"


# -- plans ------------------------------------------------------------------------------------


def test_step_sweep_ramps_holds_and_ends() -> None:
    plan = StepSweep((1, 4, 16), hold_s=10.0, ramp=2.0)
    # level 1: 0.5 s ramp + 10 s; level 4: 1.5 s + 10 s; level 16: 6 s + 10 s
    assert plan.ends() == pytest.approx([10.5, 22.0, 38.0])
    assert plan.labels == ["c1", "c4", "c16"]
    assert plan.tick(0.0) == plan.tick(10.4)
    assert (plan.tick(0.0).users, plan.tick(0.0).label) == (1, "c1")  # type: ignore[union-attr]
    assert plan.tick(10.5).label == "c4"  # type: ignore[union-attr]
    assert plan.tick(37.9).users == 16  # type: ignore[union-attr]
    assert plan.tick(37.9).spawn_rate == 2.0  # type: ignore[union-attr]
    assert plan.tick(38.0) is None
    assert StepSweep((1, 4), 10.0, 2.0, run_time_s=5.0).tick(5.0) is None


def test_constant_and_trace_plans() -> None:
    c = Constant(4, 2.0)
    assert c.labels == ["c4"] and c.tick(1e6) is not None
    assert Constant(4, 2.0, run_time_s=3.0).tick(3.0) is None
    t = TraceTimes(8, time_scale=0.5)
    assert t.labels == ["trace-x0.5"]
    tk = t.tick(100.0)
    assert tk is not None and tk.users == 8 and tk.label == "trace-x0.5"


@pytest.mark.parametrize("text", ["", "0,4", "1,x", "4,4", "-1"])
def test_bad_levels_are_input_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="--kvc-levels"):
        parse_levels(text)


def test_bad_plan_parameters() -> None:
    with pytest.raises(ConfigError, match="--kvc-hold"):
        StepSweep((1,), hold_s=0.0, ramp=1.0)
    with pytest.raises(ConfigError, match="--kvc-max-in-flight"):
        TraceTimes(0)
    with pytest.raises(ConfigError, match="--kvc-time-scale"):
        TraceTimes(4, time_scale=float("nan"))


# -- sharding ---------------------------------------------------------------------------------


@given(st.integers(0, 200), st.integers(1, 9))
def test_shards_cover_every_position_exactly_once(n: int, count: int) -> None:
    seen = Counter(i for k in range(count) for i in shard_indices(n, k, count))
    assert set(seen) == set(range(n)) and set(seen.values()) <= {1}
    assert shard_indices(n, 0, count) == shard_indices(n, 0, count)  # deterministic
    sizes = [len(shard_indices(n, k, count)) for k in range(count)]
    assert max(sizes) - min(sizes) <= 1


def test_shard_that_does_not_exist() -> None:
    with pytest.raises(ValueError):
        shard_indices(10, 2, 2)
    with pytest.raises(ValueError):
        read_shard([], 2, 2)


@given(st.lists(st.one_of(st.none(), st.floats(0, 1e6)), max_size=40), st.integers(1, 7))
def test_a_shard_read_from_the_stream_is_its_positions_on_the_traces_clock(
    times: list[float | None], count: int
) -> None:
    reqs = [Request(id=f"r{i}", api="completions", prompt="x", t=t) for i, t in enumerate(times)]
    for k in range(count):
        shard = read_shard(iter(reqs), k, count)  # one pass, as over a file
        assert [i for i, _ in shard.items] == list(shard_indices(len(reqs), k, count))
        assert all(reqs[i] is req for i, req in shard.items)
        # Every shard's clock starts at the whole trace's first timestamp, not its own.
        assert shard.t0 == min((t for t in times if t is not None), default=0.0)


# -- Results as Locust events -----------------------------------------------------------------


def _ok(bucket: str = "<256", chunks: int = 5) -> Result:
    r = Result(
        request_id="r1",
        target="t",
        phase="c1",
        bucket=bucket,
        scheduled=0.0,
        sent=1.0,
        first_token=1.25,
        done=2.0,
        prompt_tokens=100,
        output_tokens=chunks + 1,
    )
    r.chunk_times = [1.25 + 0.1 * k for k in range(chunks)]
    r.chunk_tokens = [1] * (chunks - 1) + [2]
    return r


def test_ok_result_events_per_bucket() -> None:
    events = locust_events(_ok("8K-32K"))
    names = Counter(e.name for e in events)
    assert names == {"ttft 8K-32K": 1, "itl 8K-32K": 5, "e2e 8K-32K": 1, "output_tokens 8K-32K": 1}
    by = {e.name: e for e in events}
    assert by["ttft 8K-32K"].response_time == pytest.approx(250.0)
    assert by["ttft 8K-32K"].response_length == 100
    assert by["e2e 8K-32K"].response_time == pytest.approx(1000.0)
    assert by["output_tokens 8K-32K"].response_time == 6.0
    itl = [e.response_time for e in events if e.name.startswith("itl")]
    # four 1-token gaps of 100 ms and the last chunk's 2 tokens: two gaps of 50 ms
    assert itl == pytest.approx([100.0, 100.0, 100.0, 50.0, 50.0])
    assert all(e.error is None and e.request_type == "LLM" for e in events)


def test_an_answer_that_reasoned_adds_its_time_to_answer_and_reasoning_tokens() -> None:
    r = _ok("<256")
    r.first_answer_token, r.reasoning_tokens = 1.55, 3
    by = {e.name: e for e in locust_events(r)}
    assert by["ttft <256"].response_time == pytest.approx(250.0)  # the first token of any kind
    assert by["answer <256"].response_time == pytest.approx(550.0)
    assert by["answer <256"].response_length == 3
    assert by["reasoning_tokens <256"].response_time == 3.0
    r.first_answer_token = None  # cut by max_tokens while reasoning: no time to an answer
    assert "answer <256" not in {e.name for e in locust_events(r)}


def test_itl_events_are_capped_and_sampled_evenly() -> None:
    assert (
        len([e for e in locust_events(_ok(chunks=1001), itl_cap=10) if e.name.startswith("itl")])
        == 10
    )
    assert sample_evenly(list(range(100)), 4) == [0, 25, 50, 75]
    assert sample_evenly([1.0, 2.0], 10) == [1.0, 2.0]
    assert sample_evenly([1.0], 0) == []


def test_failed_result_is_one_failure_with_kind_and_reason() -> None:
    r = Result(
        request_id="r1",
        target="t",
        phase="c1",
        bucket=">=64K",
        scheduled=0.0,
        sent=1.0,
        done=1.5,
        status="error",
        error_kind="http",
        error="HTTP 400: prompt too long",
    )
    assert locust_events(r) == [
        LocustEvent("LLM", "e2e >=64K", 500.0, 0, "http: HTTP 400: prompt too long")
    ]


def test_cancelled_result_fires_nothing() -> None:
    r = cancelled_result(
        load(SAMPLE).requests[0], "t", "c1", "<256", 3.0, "cancelled", "not sent: the test stopped"
    )
    assert r.status == "cancelled" and locust_events(r) == []
    u = cancelled_result(load(SAMPLE).requests[0], "t", "c1", "<256", 3.0, "unavailable", "x")
    assert (u.status, u.error_kind) == ("error", "unavailable")


def test_check_event_passes_and_fails_with_the_reason() -> None:
    reqs = {r.id: r for r in load(SAMPLE).requests}
    req = reqs["exact-short"]  # expects "yes"
    r = _ok()
    r.request_id, r.output_text = req.id, "yes"
    with Grader() as grader:
        ev = check_event(r, req, grader)
        assert ev is not None and ev.name == "check <256" and ev.error is None
        r.output_text = "no"
        ev = check_event(r, req, grader)
        assert ev is not None and ev.request_type == "CHECK" and ev.error
        assert ev.error.startswith("exact: ")
        assert check_event(r, reqs["ids-short"], grader) is None  # no checker
        # A hostile answer is a failed check with a reason, never an exception in the user.
        r.output_text = "[" * 5000
        ev = check_event(r, reqs["json-short"], grader)
        assert ev is not None and ev.error


# -- targets and the worker plan ---------------------------------------------------------------


def test_resolve_target_forms(tmp_path: Path) -> None:
    t = resolve_target("http://127.0.0.1:8000/", None, None)
    assert (t.name, t.url, t.expect_cache_dtype) == ("target", "http://127.0.0.1:8000", None)
    t = resolve_target("", "http://h:1", None)
    assert t.url == "http://h:1"
    t = resolve_target("fp8=http://127.0.0.1:8001", None, None)
    assert (t.name, t.expect_cache_dtype) == ("fp8", "fp8")
    cfg = tmp_path / "targets.toml"
    cfg.write_text(
        '[targets.gpu]\nurl = "http://10.0.0.1:8000"\n[targets.local]\nmodel = "/m"\n',
        encoding="utf-8",
    )
    assert resolve_target("gpu", None, str(cfg)).url == "http://10.0.0.1:8000"
    with pytest.raises(ConfigError, match="Locust starts no servers"):
        resolve_target("local", None, str(cfg))
    with pytest.raises(ConfigError, match="names no server"):
        resolve_target("bf16", None, None)
    with pytest.raises(ConfigError, match="no target"):
        resolve_target("", "", None)
    with pytest.raises(ConfigError, match="one target"):
        resolve_target("a=http://x:1,b=http://y:2", None, None)


def test_run_plan_round_trip_and_salt() -> None:
    run = RunSpec(
        trace=TraceSpec(path="t.jsonl", format="v1", sha256="ab", requests=12),
        load=LoadSpec(targets=("bf16",), schedules=("c1", "c4"), timeout_s=60.0, workers=2),
        quality=QualitySpec(buckets="8K"),
        budget=BudgetSpec(max_errors=3),
        run_dir=RunDirSpec(path="reports/r"),
    )
    plan = RunPlan(
        run=run,
        target={
            "name": "bf16",
            "url": "http://x:1",
            "api_key_env": None,
            "expect_cache_dtype": "auto",
        },
        mode="step",
        time_scale=1.0,
        itl_events=256,
        epoch_wall=1.0,
    ).with_shard(1)
    back = RunPlan.from_msg(json.loads(json.dumps({**plan.to_msg(), "unknown": 1})))
    assert back == plan
    assert back.target_spec() == TargetSpec(
        name="bf16", url="http://x:1", expect_cache_dtype="auto"
    )
    assert (back.run_id, back.shard, back.shards, back.first_label) == ("r", 1, 2, "c1")
    assert back.budget().max_errors == 3 and back.run.load.timeout_s == 60.0
    assert plan.salt("bf16", "c4", 0) == "r.bf16.c4"  # as the runner's salt
    assert plan.salt("bf16", "c4", 2) == "r.bf16.c4.p2"


# -- the run directory --------------------------------------------------------------------------


def test_run_recorder_writes_a_run_directory_replay_report_renders(tmp_path: Path) -> None:
    trace = scan(SAMPLE, "v1", limit=12)
    reqs = list(trace.iter_requests())
    spec = TargetSpec(name="bf16", url="http://127.0.0.1:1", expect_cache_dtype="auto")
    sample = TraceSpec(path=str(SAMPLE), format="v1", sha256=file_digest(SAMPLE), requests=12)
    rec = RunRecorder(
        run_dir=tmp_path / "run",
        trace=trace,
        run_spec=replace(bare_spec(["bf16"], ["c1", "c4"], buckets="256,1K"), trace=sample),
        spec=spec,
        options={"driver": "locust"},
        driver={"name": "locust"},
        command=["locust"],
    )
    rec.info = {
        "cache_config": {"cache_dtype": "auto", "kv_cache_size_tokens": "524288"},
        "problems": [],
    }
    rec.open_phase("c1", 0.0)
    rows = []
    for i, req in enumerate(reqs):
        phase = "c1" if i < 6 else "c4"
        if i == 6:
            rec.open_phase("c4", 5.0)
        r = _ok("<256" if i % 2 else "256-1K")
        r.request_id, r.phase, r.target, r.output_text = req.id, phase, "bf16", "yes"
        rows.append(r.to_json())
    rows[-1] = cancelled_result(
        reqs[-1], "bf16", "c4", "<256", 9.0, "cancelled", "not sent: the test stopped"
    ).to_json()
    rec.add_results(rows)
    rec.add_snapshot({"t": 1.0, "kv_usage": 0.1, "running": 2.0})
    rec.close_phase(10.0)
    summary = rec.finish()
    rec.close()

    run = tmp_path / "run"
    assert {p.name for p in run.iterdir()} >= {
        "manifest.json",
        "results.jsonl",
        "summary.json",
        "grades.jsonl",
        "metrics",
    }
    phases = summary["targets"]["bf16"]["phases"]
    assert set(phases) == {"c1", "c4"}
    assert phases["c4"]["duration_s"] == 5.0
    assert set(phases["c1"]["buckets"]) == {"<256", "256-1K"}
    assert phases["c4"]["all"]["errors_by_kind"] == {"cancelled": 1}
    assert summary["quality"]["phases"]["c1"]["bf16"]["all"]["graded"] > 0
    manifest = read_manifest(run)
    assert manifest.targets["bf16"].phases["c1"] == {"start": 0.0, "end": 5.0}
    assert manifest.trace.sha256 == file_digest(SAMPLE) and manifest.trace.requests == 12
    # Its one target is the reference, which the roles hold: written once, as the CLI does.
    assert manifest.reference == "bf16" and manifest.roles is not None
    assert manifest.schedules == ("c1", "c4") and manifest.buckets.labels == (
        "<256",
        "256-1K",
        ">=1K",
    )
    raw = json.loads((run / "manifest.json").read_text())
    assert not {"buckets", "schedules", "reference"} & set(raw)
    assert set(raw["trace"]) == {"lines", "bad_lines", "skipped_rows"}
    html, md = write_reports(run)
    assert Path(html).is_file() and "no verdict" in Path(md).read_text().lower()


def test_recorder_gives_a_window_to_a_phase_without_one(tmp_path: Path) -> None:
    trace = scan(SAMPLE, "v1", limit=2)
    reqs = list(trace.iter_requests())
    rec = RunRecorder(
        run_dir=tmp_path / "run",
        trace=trace,
        run_spec=bare_spec(["t"], ["c1"], checkers=False),
        spec=TargetSpec(name="t", url="http://x:1"),
        options={},
        driver={},
        command=[],
    )
    rec.fail("target unavailable: no model")
    rec.add_results(
        [
            cancelled_result(
                r, "t", "c1", "unknown", 2.0, "unavailable", "target unavailable: no model"
            ).to_json()
            for r in reqs
        ]
    )
    summary = rec.finish()
    rec.close()
    t = summary["targets"]["t"]
    assert t["status"] == "failed" and t["phases"]["c1"]["all"]["errors"] == 2
    assert not (tmp_path / "run" / "grades.jsonl").exists()
