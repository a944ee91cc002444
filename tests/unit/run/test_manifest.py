"""The run manifest is typed: what a run writes reads back as a ``Manifest`` whose records name
every key written, and a value of the wrong type is an error naming its field (or, for the
report, a problem listed)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from replay.analysis.run_spec import QualitySpec
from replay.analysis.schemas.manifest import (
    BucketFacts,
    Manifest,
    SpecFacts,
    TargetEntry,
    TraceFacts,
)
from replay.core.errors import SummaryError
from replay.core.schedule import ClosedLoop
from replay.run.runner import Runner
from replay.rundir.files import file_digest, new_run_dir
from replay.rundir.manifest import read_manifest, written_targets
from replay.serving.targets import TargetSpec
from replay.traces.importers import scan
from tests.support import nowire
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


# -- each fact once ---------------------------------------------------------------------------


def _socketless_run(tmp: Path) -> Path:
    """A run of the CLI's runner with no socket (tests/support/nowire.py), its analysis left
    out: the manifest is what it wrote."""
    run_dir = new_run_dir(tmp)
    cfg = nowire.config(run_dir, targets=("bf16", "fp8"), limit=4)
    runner = Runner(
        cfg,
        clock=nowire.VirtualClock(),
        sender=nowire.Scripted(),
        connector=nowire.NoWire(4),
        analysis=nowire.unanalysed,
    )
    asyncio.run(runner.run())
    return run_dir


def _where(doc: Any, found: Callable[[str, Any], bool], at: str = "") -> list[str]:
    """The paths in ``doc`` of the keys (and their values) ``found`` picks."""
    if isinstance(doc, dict):
        return [
            path
            for k, v in doc.items()
            for path in ([f"{at}{k}"] if found(k, v) else []) + _where(v, found, f"{at}{k}.")
        ]
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in _where(v, found, f"{at}{i}.")]
    return []


def test_a_run_writes_the_trace_schedules_buckets_and_reference_once(tmp_path: Path) -> None:
    run_dir = _socketless_run(tmp_path)
    raw = orjson.loads((run_dir / "manifest.json").read_bytes())
    path, digest = str(nowire.TRACE), file_digest(nowire.TRACE)
    assert _where(raw, lambda k, v: v == path) == ["run_spec.trace.path"]
    assert _where(raw, lambda k, v: v == digest) == ["run_spec.trace.sha256"]
    assert _where(raw, lambda k, v: k == "schedules") == ["run_spec.load.schedules"]
    assert _where(raw, lambda k, v: k == "buckets") == ["run_spec.quality.buckets"]
    assert _where(raw, lambda k, v: k == "labels") == []  # they follow from the bounds
    assert _where(raw, lambda k, v: k == "reference" and v) == ["roles.reference"]
    # The trace block holds only what reading the file found.
    assert set(raw["trace"]) == {"lines", "bad_lines", "skipped_rows"}
    # ...and the manifest reads as it did when the top level repeated them.
    m = read_manifest(run_dir)
    assert (m.trace.path, m.trace.format, m.trace.sha256) == (path, "v1", digest)
    assert m.trace.requests == 4 and m.trace.bad_lines == 0
    assert m.trace.length_policy == {
        "scale": 1.0,
        "max_input_tokens": None,
        "max_output_tokens": None,
    }
    assert m.schedules == ("c1", "c2") and m.reference == "bf16"
    assert m.buckets == BucketFacts(bounds="256,1K", labels=("<256", "256-1K", ">=1K"))


def test_an_older_manifest_with_the_keys_at_the_top_level_reads_the_same(tmp_path: Path) -> None:
    """A run directory written before the manifest held each fact once: the trace's facts, the
    buckets, the schedules and the reference at the top level, and (older still) no run spec
    and no roles."""
    run_dir = _socketless_run(tmp_path)
    raw = orjson.loads((run_dir / "manifest.json").read_bytes())
    new = Manifest.from_json(raw)
    repeated = {
        **raw,
        "trace": {
            **raw["trace"],
            "path": str(nowire.TRACE),
            "format": "v1",
            "sha256": file_digest(nowire.TRACE),
            "requests": 4,
            "length_policy": {"scale": 1.0, "max_input_tokens": None, "max_output_tokens": None},
        },
        "buckets": {"bounds": "256,1K", "labels": ["<256", "256-1K", ">=1K"]},
        "schedules": ["c1", "c2"],
        "reference": "bf16",
    }
    no_spec = {k: v for k, v in repeated.items() if k not in ("run_spec", "roles")}
    for old in (repeated, no_spec):
        m = Manifest.from_json(old)
        assert (m.trace, m.buckets, m.schedules, m.reference) == (
            new.trace,
            new.buckets,
            new.schedules,
            new.reference,
        )
    assert Manifest.from_json(no_spec).run_spec is None
    # Bounds that do not parse are the spec's field's problem, as a wrong type is.
    bad = {**raw, "run_spec": {**raw["run_spec"], "quality": {"buckets": "1K,256"}}}
    with pytest.raises(SummaryError, match=r"run_spec\.quality\.buckets: --buckets"):
        Manifest.from_json(bad, where="manifest.json")
    problems: list[str] = []
    assert Manifest.from_json(bad, problems=problems).buckets.labels == ()
    assert len(problems) == 1 and "increasing" in problems[0]
