"""One run, one ``RunSpec``: the CLI (from its options) and the Locust adapter (from its
``Config``) describe the same trace, target and options as the same record, and the manifest
records it and reads it back typed. No socket: targets are named by URL, never reached."""

from __future__ import annotations

import dataclasses
from argparse import Namespace
from pathlib import Path

import pytest

from replay.analysis.roles import Roles
from replay.analysis.run_spec import (
    BudgetSpec,
    LoadSpec,
    QualitySpec,
    RunDirSpec,
    RunSpec,
    TraceSpec,
)
from replay.cli.measuring import resolve_control, resolve_interleave
from replay.cli.plan import Plan
from replay.cli.run_options import RunOptions
from replay.cli.run_spec import run_config
from replay.core.errors import SummaryError
from replay.locust.config import config_of
from replay.run.load_process import WorkerSpec
from replay.rundir.files import MANIFEST, write_json
from replay.rundir.manifest import build_manifest, read_manifest
from tests.unit.cli.test_run_options import click_defaults
from tests.unit.run.test_streaming import write_trace

TARGET = "bf16=http://127.0.0.1:9"


def cli_spec(trace: Path, run_dir: Path) -> RunSpec:
    o = RunOptions.from_click(
        {
            **click_defaults(),
            "trace_path": trace,
            "targets": TARGET,
            "concurrency": "4",
            "seed": 3,
            "timeout_s": 30.0,
            "max_error_rate": 0.2,
            "slo": "ttft=2s",
            "limit": 10,
        }
    )
    plan = Plan.of(o)
    o = resolve_interleave(resolve_control(o, plan.trace), plan.trace, plan.targets)
    cfg = run_config(o, plan, run_dir, resume=False)
    return cfg.run_spec()


def locust_spec(trace: Path, run_dir: Path) -> RunSpec:
    opts = Namespace(
        kvc_trace=str(trace),
        kvc_target=TARGET,
        kvc_targets_file="",
        kvc_buckets=click_defaults()["bucket_spec"],
        kvc_checkers="on",
        kvc_levels="1,4,16",
        kvc_hold=30.0,
        kvc_ramp=4.0,
        kvc_time_scale=1.0,
        kvc_max_in_flight=32,
        kvc_loop="off",
        kvc_limit=10,
        kvc_run_dir=str(run_dir),
        kvc_timeout=30.0,
        kvc_seed=3,
        kvc_slo="ttft=2s",
        kvc_itl_events=64,
        kvc_max_errors=0,
        kvc_max_error_rate=0.2,
        kvc_max_results=0,
        num_users=4,
        spawn_rate=1.0,
        run_time=None,
    )
    return config_of(opts, None, "users", True).run_spec(run_dir, shards=1)


def test_the_cli_and_locust_build_the_same_run_spec(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", 12)
    run_dir = tmp_path / "run"
    cli, locust = cli_spec(trace, run_dir), locust_spec(trace, run_dir)
    assert cli.trace == locust.trace and cli.trace.requests == 10
    assert cli.run_dir == locust.run_dir
    # What differs by design, each side's own: the CLI bounds a phase's time, scores the
    # reference's answers teacher-forced and drains in-flight requests on Ctrl-C; Locust has
    # no phase limit, no teacher-forced pass, and its own stop.
    assert (cli.load.phase_timeout_s, locust.load.phase_timeout_s) == (3600.0, None)
    assert (cli.quality.teacher_forced, locust.quality.teacher_forced) == (True, False)
    assert (cli.budget.drain_s, locust.budget.drain_s) == (30.0, None)
    assert dataclasses.replace(cli.load, phase_timeout_s=None) == locust.load
    assert dataclasses.replace(cli.quality, teacher_forced=False) == locust.quality
    assert dataclasses.replace(cli.budget, drain_s=None) == locust.budget
    assert locust.load.targets == ("bf16",) and locust.load.schedules == ("c4",)
    assert cli.targets == locust.targets and cli.targets is not None
    assert cli.targets.given == TARGET
    assert (cli.capacity, cli.sequential) == (locust.capacity, locust.sequential)
    # The whole run, field for field, but for the differences above.
    assert (
        dataclasses.replace(
            cli,
            load=dataclasses.replace(cli.load, phase_timeout_s=None),
            quality=dataclasses.replace(cli.quality, teacher_forced=False),
            budget=dataclasses.replace(cli.budget, drain_s=None),
        )
        == locust
    )
    assert locust.quality.slo == "ttft=2s" and locust.budget.max_error_rate == 0.2


def _spec() -> RunSpec:
    return RunSpec(
        trace=TraceSpec(path="t.jsonl", format="v1", sha256="ab", requests=7, max_output_tokens=64),
        load=LoadSpec(
            targets=("bf16", "fp8"),
            schedules=("c1", "c4"),
            seed=5,
            phase_timeout_s=None,
            workers=2,
            interleave=True,
        ),
        quality=QualitySpec(buckets="8K,32K", slo=None, candidate="fp8", control=True),
        budget=BudgetSpec(max_errors=3, max_error_rate=None, drain_s=12.5, max_results=100),
        run_dir=RunDirSpec(path="reports/r1", resume=True),
    )


def test_a_run_spec_round_trips_through_the_manifest(tmp_path: Path) -> None:
    spec = _spec()
    manifest = build_manifest(
        command=["replay"],
        started_at=0.0,
        trace={},
        options={},
        targets={},
        spec=spec,
        roles=Roles("bf16", "fp8"),
    )
    write_json(tmp_path / MANIFEST, manifest)
    back = read_manifest(tmp_path)
    assert back.run_spec == spec
    # What the spec and the roles hold reads as it did when the top level repeated it.
    assert back.schedules == ("c1", "c4") and back.reference == "bf16"
    assert back.buckets.bounds == "8K,32K" and back.buckets.labels == ("<8K", "8K-32K", ">=32K")
    assert (back.trace.path, back.trace.sha256, back.trace.requests) == ("t.jsonl", "ab", 7)
    assert RunSpec.from_json(spec.to_json()) == spec


def test_a_manifest_without_a_spec_reads_none_and_a_bad_one_names_its_field(
    tmp_path: Path,
) -> None:
    write_json(tmp_path / MANIFEST, {"targets": {}})
    assert read_manifest(tmp_path).run_spec is None
    bad = _spec().to_json()
    bad["load"]["seed"] = "five"
    write_json(tmp_path / MANIFEST, {"run_spec": bad})
    with pytest.raises(SummaryError, match=r"run_spec\.load\.seed: expected an integer"):
        read_manifest(tmp_path)


def test_a_workers_spec_is_the_run_spec_plus_its_share() -> None:
    """A load process of ``--workers`` gets the run spec whole, and beside it only what one
    phase hands one worker: no setting of the run is described a second time."""
    hints = {f.name: f.type for f in dataclasses.fields(WorkerSpec)}
    assert hints["run"] == "RunSpec" and "shard" in hints
    described = {
        f.name
        for record in (TraceSpec, LoadSpec, QualitySpec, BudgetSpec, RunDirSpec)
        for f in dataclasses.fields(record)
    }
    assert described.isdisjoint(hints), described & set(hints)


def test_a_runs_spec_gives_back_the_options_that_build_it(tmp_path: Path) -> None:
    """What ``--resume`` does: the manifest's spec, as options, builds the same spec again."""
    from replay.cli.run_spec import options_of

    trace = write_trace(tmp_path / "t.jsonl", 12)
    o = RunOptions.from_click(
        {
            **click_defaults(),
            "trace_path": trace,
            "targets": "ref=http://127.0.0.1:9,cand=http://127.0.0.1:10",
            "reference": "ref",
            "concurrency": "2",
            "sequential": True,
            "round_size": 3,
            "max_time": 60.0,
            "tolerance": 0.1,
            "think_time": "1.5",
            "limit": 8,
            "on_bad_line": "skip",
            "slo": "ttft=2s",
            "capacity_concurrency": 6,
            "max_errors": 4,
        }
    )
    plan = Plan.of(o)
    o = resolve_interleave(resolve_control(o, plan.trace), plan.trace, plan.targets)
    spec = run_config(o, plan, tmp_path / "run", resume=False, canary=True).spec
    assert spec.targets is not None and spec.sequential is not None
    again = options_of(spec, spec.targets)
    plan2 = Plan.of(again)
    assert run_config(again, plan2, tmp_path / "run", resume=False, canary=True).spec == spec
    assert spec.quality.tolerance == 0.1 and spec.load.think_time == "1.5"
