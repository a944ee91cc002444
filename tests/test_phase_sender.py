"""The runner's seam for sending a phase (replay/run/senders.py): a run given a sender of the
test's own sends nothing over the wire to answer requests; the runner still checks its target
(introspection of the in-process fake), keeps the manifest and the resume state, and stops
where the sender interrupts it. The real senders (this process, a worker pool) are tested on
the wire in test_runner*, test_workers and test_faults."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

from replay.core.buckets import Buckets
from replay.core.records import Result
from replay.core.schedule import ClosedLoop, MonotonicClock
from replay.run.config import RunConfig, TargetRun
from replay.run.phase import Phase
from replay.run.rundir import new_run_dir, read_results
from replay.run.runner import Runner
from replay.run.stopping import RunStop
from replay.serving.targets import TargetSpec
from replay.traces.importers import load

from .conftest import ROOT
from .fault_server import fault_server

TRACE = ROOT / "traces" / "sample.jsonl"
LIMIT = 6


class ScriptedSender:
    """Answers every request of a phase at once (``ok``, one token), on the run's clock; with
    ``interrupt_after`` it answers that many requests of the first phase, then interrupts the
    run as Ctrl-C would, and sends nothing more."""

    def __init__(self, interrupt_after: int | None = None) -> None:
        self.interrupt_after = interrupt_after
        self.sent: list[tuple[str, str, frozenset[str]]] = []  # target, phase, before_done

    async def send(self, phase: Phase, run: TargetRun, stop: RunStop) -> dict[str, Any] | None:
        if stop.event.is_set():
            return None
        self.sent.append((phase.target.name, phase.label, frozenset(phase.before_done)))
        start = phase.clock.now()
        todo = [r for r in phase.trace.iter_requests() if r.id not in phase.before_done]
        for k, req in enumerate(todo):
            if self.interrupt_after is not None and k == self.interrupt_after:
                stop.interrupt()
                return {"start": start, "end": phase.clock.now(), "interrupted": True}
            now = phase.clock.now()
            phase.writer.write(
                Result(
                    request_id=req.id,
                    target=phase.target.name,
                    phase=phase.label,
                    bucket="<256",
                    scheduled=now,
                    sent=now,
                    first_token=now,
                    done=now,
                    output_tokens=1,
                    chunk_times=[now],
                    chunk_tokens=[1],
                    output_text="x",
                ).to_json()
            )
        return {"start": start, "end": phase.clock.now()}


def _config(url: str, run_dir: Path, resume: bool = False) -> RunConfig:
    trace = load(TRACE)
    trace.requests = trace.requests[:LIMIT]
    return RunConfig(
        trace=trace,
        trace_path=TRACE,
        trace_format="v1",
        targets=[TargetSpec(name="bf16", url=url)],
        schedules=[ClosedLoop(1), ClosedLoop(2)],
        buckets=Buckets.parse("256,1K"),
        run_dir=run_dir,
        timeout_s=3.0,
        teacher_forced=False,
        drain_s=0.1,
        resume=resume,
    )


def test_every_phase_goes_through_the_injected_sender_on_the_injected_clock(
    tmp_path: Path,
) -> None:
    sender, clock = ScriptedSender(), MonotonicClock()
    with fault_server("usage_every") as fake:
        cfg = _config(fake.url, new_run_dir(tmp_path))
        runner = Runner(cfg, clock=clock, sender=sender)
        summary = asyncio.run(runner.run())
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
    first, second = ScriptedSender(interrupt_after=2), ScriptedSender()
    with fault_server("usage_every") as fake:
        run_dir = new_run_dir(tmp_path)
        asyncio.run(Runner(_config(fake.url, run_dir), sender=first).run())
        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert manifest["interrupted"] is True
        assert [(t, p) for t, p, _ in first.sent] == [("bf16", "c1")]  # c2 never began
        asyncio.run(Runner(_config(fake.url, run_dir, resume=True), sender=second).run())
    # The resumed run sends c1's last four (the first two stand) and all of c2.
    (c1_done,) = [done for _, p, done in second.sent if p == "c1"]
    assert len(c1_done) == 2
    assert [p for _, p, _ in second.sent] == ["c1", "c2"]
    results = list(read_results(run_dir))
    assert Counter((r.phase, r.request_id) for r in results) == Counter(
        (p, r.id) for p in ("c1", "c2") for r in load(TRACE).requests[:LIMIT]
    )
