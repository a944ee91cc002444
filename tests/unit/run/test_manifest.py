"""The run manifest is typed: what a run writes reads back as a ``Manifest`` whose records name
every key written, and a value of the wrong type is an error naming its field (or, for the
report, a problem listed)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import orjson
import pytest

from replay.analysis.run_spec import QualitySpec
from replay.analysis.schemas.manifest import Manifest, SpecFacts, TargetEntry, TraceFacts
from replay.core.errors import SummaryError
from replay.core.schedule import ClosedLoop
from replay.run.runner import Runner
from replay.rundir.files import new_run_dir
from replay.rundir.manifest import read_manifest, written_targets
from replay.serving.targets import TargetSpec
from replay.traces.importers import scan
from tests.support.fault_server import fault_server
from tests.support.run_config import run_config
from tests.unit.run.test_streaming import write_trace


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("manifest")
    path = write_trace(tmp / "t.jsonl", 12)
    with fault_server("split") as server:
        cfg = run_config(
            trace=scan(path),
            trace_path=path,
            trace_format="v1",
            targets=[
                TargetSpec(name="bf16", url=server.url),
                TargetSpec(name="bf16-b", url=server.url),
            ],
            schedules=[ClosedLoop(2)],
            quality=QualitySpec(buckets="256,1K", teacher_forced=False),
            run_dir=new_run_dir(tmp),
        )
        asyncio.run(Runner(cfg).run())
    return cfg.run_dir


def test_every_key_a_run_writes_is_a_field_of_the_records(run_dir: Path) -> None:
    raw: dict[str, Any] = orjson.loads((run_dir / "manifest.json").read_bytes())
    assert set(raw) <= _fields(Manifest), set(raw) - _fields(Manifest)
    assert set(raw["trace"]) <= _fields(TraceFacts)
    for name, entry in raw["targets"].items():
        assert set(entry) <= _fields(TargetEntry), (name, set(entry) - _fields(TargetEntry))
        assert set(entry["spec"]) <= _fields(SpecFacts), name


def test_a_run_reads_back_with_no_problem(run_dir: Path) -> None:
    problems: list[str] = []
    m = read_manifest(run_dir, problems)
    assert problems == []
    assert m.reference == "bf16" and list(m.schedules) == ["c2"]
    assert set(m.targets) == {"bf16", "bf16-b"} and m.target("bf16-b") is not None
    entry = m.targets["bf16"]
    assert entry.status == "ok" and entry.spec.url is not None and "c2" in entry.phases
    assert m.trace.requests == 12 and m.trace.sha256
    assert m.buckets.labels == ("<256", "256-1K", ">=1K")
    assert not m.emulated("bf16") and m.spec("nobody") is None


def test_a_run_records_its_spec_and_reads_it_back(run_dir: Path) -> None:
    spec = read_manifest(run_dir).run_spec
    assert spec is not None and spec.load.targets == ("bf16", "bf16-b")
    assert spec.load.schedules == ("c2",) and spec.trace.requests == 12
    assert spec.quality.buckets == "256,1K" and not spec.quality.teacher_forced
    assert (
        spec.run_dir.path == str(run_dir)
        and spec.trace.sha256 == read_manifest(run_dir).trace.sha256
    )


def test_resume_carries_the_entries_forward_as_written(run_dir: Path) -> None:
    raw = orjson.loads((run_dir / "manifest.json").read_bytes())
    assert written_targets(run_dir) == raw["targets"]
    assert written_targets(run_dir / "missing") == {}


def test_a_wrong_type_names_its_field(run_dir: Path, tmp_path: Path) -> None:
    raw = orjson.loads((run_dir / "manifest.json").read_bytes())
    raw["targets"]["bf16"]["max_model_len"] = "4096"
    (tmp_path / "manifest.json").write_bytes(orjson.dumps(raw))
    with pytest.raises(SummaryError, match=r"targets\.bf16\.max_model_len: expected an integer"):
        read_manifest(tmp_path)
    problems: list[str] = []
    m = read_manifest(tmp_path, problems)
    assert len(problems) == 1 and "targets.bf16.max_model_len" in problems[0]
    assert m.targets["bf16"].max_model_len is None and m.targets["bf16"].status == "ok"


def test_an_older_manifest_reads_with_its_keys_missing() -> None:
    m = Manifest.from_json({"reference": "bf16", "targets": {"bf16": {"status": "ok"}}})
    assert m.roles is None and m.cli_options is None and m.capacity is None
    assert m.targets["bf16"].spec.meant_format is None and m.schedules == ()
