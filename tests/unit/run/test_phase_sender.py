"""The runner's seam for sending a phase (replay/run/senders.py): a run given a sender of the
test's own sends nothing over the wire to answer requests; the runner still checks its target
(introspection of the in-process fake), keeps the manifest and the resume state, and stops where
the sender interrupts it (the sender is tests/support/nowire.py's; test_run_without_sockets has
neither wire nor fake server). The real senders (this process, a worker pool) are tested on the
wire in test_runner*, test_workers and test_faults."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

from replay.analysis.run_spec import BudgetSpec
from replay.core.schedule import MonotonicClock
from replay.run.run_config import RunConfig
from replay.run.runner import Runner
from replay.rundir.files import new_run_dir, read_results
from replay.traces.importers import load
from tests.support.fault_server import fault_server
from tests.support.nowire import TRACE, Scripted, config

LIMIT = 6


def _config(url: str, run_dir: Path, resume: bool = False) -> RunConfig:
    return config(
        run_dir,
        limit=LIMIT,
        url=url,
        load={"timeout_s": 3.0},
        budget=BudgetSpec(drain_s=0.1),
        resume=resume,
    )


def test_every_phase_goes_through_the_injected_sender_on_the_injected_clock(
    tmp_path: Path,
) -> None:
    sender, clock = Scripted(), MonotonicClock()
    with fault_server("usage_every") as fake:
        cfg = _config(fake.url, new_run_dir(tmp_path))
        runner = Runner(cfg, clock=clock, sender=sender)
        summary = asyncio.run(runner.run()).to_json()
        reached = fake.requests
    assert reached == 0  # the sender answered; the fake was only introspected
    assert runner.clock is clock
    assert [(t, p) for t, p, _ in sender.sent] == [("bf16", "c1"), ("bf16", "c2")]
    manifest = json.loads((Path(summary["run_dir"]) / "manifest.json").read_text())
    phases = manifest["targets"]["bf16"]["phases"]
    assert set(phases) == {"c1", "c2"} and not manifest.get("interrupted")
    assert all(0 <= w["start"] <= w["end"] <= clock.now() for w in phases.values())
    results = list(read_results(Path(summary["run_dir"])))
    assert Counter((r.phase, r.status) for r in results) == {
        ("c1", "ok"): LIMIT,
        ("c2", "ok"): LIMIT,
    }


def test_an_interrupt_from_the_sender_stops_the_run_and_resume_sends_only_the_rest(
    tmp_path: Path,
) -> None:
    first, second = Scripted(interrupt_after=2), Scripted()
    with fault_server("usage_every") as fake:
        run_dir = new_run_dir(tmp_path)
        asyncio.run(Runner(_config(fake.url, run_dir), sender=first).run())
        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert manifest["interrupted"] is True
        assert [(t, p) for t, p, _ in first.sent] == [("bf16", "c1")]  # c2 never began
        asyncio.run(Runner(_config(fake.url, run_dir, resume=True), sender=second).run())
    # The resumed run sends c1's last four (the first two stand) and all of c2.
    (c1_asked,) = [ids for _, p, ids in second.sent if p == "c1"]
    assert len(c1_asked) == LIMIT - 2
    assert [p for _, p, _ in second.sent] == ["c1", "c2"]
    results = list(read_results(run_dir))
    assert Counter((r.phase, r.request_id) for r in results) == Counter(
        (p, r.id) for p in ("c1", "c2") for r in load(TRACE).requests[:LIMIT]
    )
