"""The runner's own logic with no socket at all: a connector and senders of the test's own
(tests/support/nowire.py), a virtual clock, and no analysis at the end (it has tests of its
own, and the summary on the wire is test_error_budget's), so that resume, the error budget,
draining after an interrupt (Ctrl-C, SIGTERM) and the run orders are each checked in
milliseconds, their waits on a virtual clock. The sequential rounds grade each round's answers
as the canary does, in a grading process it starts once: those tests take up to about a second. The
wire's side of the same (a phase's own draining, backoff, a dead server) is in test_faults,
test_error_budget and test_phase_sender."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import pkgutil
import signal
import socket
import time
from collections import Counter
from dataclasses import MISSING, fields, replace
from pathlib import Path
from typing import Any

import pytest

import replay
from replay.analysis.run_spec import BudgetSpec, SequentialSpec
from replay.cli.compose import compose, refuse_combinations
from replay.cli.run_options import RunOptions
from replay.core.errors import InputError
from replay.core.schedule import ClosedLoop
from replay.run.interleave import Interleaved
from replay.run.phase import Phase
from replay.run.progress import QuietProgress
from replay.run.run_config import RunConfig, TargetRun
from replay.run.runner import OneAfterAnother, Runner
from replay.run.sequential_run import RoundLoop, Rounds
from replay.run.stopping import RunStop
from replay.run.teacher import Scoring
from replay.run.worker_pool import WorkerPoolSender
from replay.rundir.files import JsonlWriter, new_run_dir, read_results
from tests.support.nowire import NoWire, Scripted, VirtualClock, answer, config, todo, unanalysed

LIMIT = 6


@pytest.fixture(autouse=True)
def no_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any connection these runs tried would fail the test."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a run without the wire connected a socket")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


def _run(runner: Runner) -> dict[str, Any]:
    return asyncio.run(runner.run()).to_json()


def _runner(run_dir: Path, sender: Any, clock: VirtualClock | None = None, **kw: Any) -> Runner:
    cfg = config(run_dir, limit=LIMIT, **kw)
    connector = NoWire(LIMIT)
    clock = clock or VirtualClock()
    return Runner(cfg, clock=clock, sender=sender, connector=connector, analysis=unanalysed)


def _manifest(run_dir: Path) -> dict[str, Any]:
    return dict(json.loads((run_dir / "manifest.json").read_text()))


def _rows(run_dir: Path) -> Counter[tuple[str, str, str]]:
    return Counter((r.target, r.phase, r.status) for r in read_results(run_dir))


# -- resume ---------------------------------------------------------------------------------
def test_resume_sends_only_what_has_no_final_result(tmp_path: Path) -> None:
    run_dir = new_run_dir(tmp_path)
    first = Scripted(interrupt_after=2)
    _run(_runner(run_dir, first))
    assert _manifest(run_dir)["interrupted"] is True
    assert [(t, p) for t, p, _ in first.sent] == [("bf16", "c1")]
    second = Scripted()
    _run(_runner(run_dir, second, resume=True))
    (c1,) = [ids for _, p, ids in second.sent if p == "c1"]
    assert len(c1) == LIMIT - 2  # the first two stand
    assert [p for _, p, _ in second.sent] == ["c1", "c2"]
    assert _rows(run_dir) == {("bf16", "c1", "ok"): LIMIT, ("bf16", "c2", "ok"): LIMIT}
    manifest = _manifest(run_dir)
    assert not manifest.get("interrupted") and manifest["targets"]["bf16"]["status"] == "ok"
    assert manifest["targets"]["bf16"]["phases"]["c1"].get("resumed") is True


def test_resuming_a_finished_run_sends_nothing_and_keeps_every_target(tmp_path: Path) -> None:
    run_dir = new_run_dir(tmp_path)
    _run(_runner(run_dir, Scripted(), targets=("bf16", "fp8")))
    again, connector = Scripted(), NoWire(LIMIT)
    cfg = config(run_dir, targets=("bf16", "fp8"), limit=LIMIT, resume=True)
    _run(Runner(cfg, clock=VirtualClock(), sender=again, connector=connector, analysis=unanalysed))
    assert again.sent == [] and connector.opened == []  # nothing connected, nothing sent
    targets = _manifest(run_dir)["targets"]
    assert {n: t["status"] for n, t in targets.items()} == {"bf16": "ok", "fp8": "ok"}
    assert sum(_rows(run_dir).values()) == 2 * 2 * LIMIT


def test_resume_finishes_the_target_that_was_cut_short_and_restores_the_other(
    tmp_path: Path,
) -> None:
    run_dir = new_run_dir(tmp_path)
    # bf16 (the reference) finishes both phases; fp8 is interrupted in its first.
    _run(_runner(run_dir, Scripted(interrupt_after=2 * LIMIT + 3), targets=("bf16", "fp8")))
    second = Scripted()
    _run(_runner(run_dir, second, targets=("bf16", "fp8"), resume=True))
    assert [(t, p, len(ids)) for t, p, ids in second.sent] == [
        ("fp8", "c1", LIMIT - 3),
        ("fp8", "c2", LIMIT),
    ]
    assert _rows(run_dir) == {(t, p, "ok"): LIMIT for t in ("bf16", "fp8") for p in ("c1", "c2")}


# -- the error budget -----------------------------------------------------------------------
def test_a_spent_budget_fails_its_target_and_the_others_go_on(tmp_path: Path) -> None:
    run_dir = new_run_dir(tmp_path)
    sender = Scripted(failing=frozenset({"fp8"}))
    budget = BudgetSpec(max_errors=3, drain_s=30.0)
    _run(_runner(run_dir, sender, targets=("bf16", "fp8"), budget=budget))
    # fp8's budget is spent in c1: its c2 is written as not sent; bf16 gets every phase.
    assert [(t, p) for t, p, _ in sender.sent] == [
        ("bf16", "c1"),
        ("bf16", "c2"),
        ("fp8", "c1"),
        ("fp8", "c2"),
    ]
    fp8 = _manifest(run_dir)["targets"]["fp8"]
    assert fp8["status"] == "failed"
    assert fp8["reason"].startswith("error budget spent: 3 failed requests reached --max-errors")
    assert fp8["error_budget"] == {
        "finished": 3,
        "errors": 3,
        "reason": fp8["error_budget"]["reason"],
    }
    rows = _rows(run_dir)
    assert rows[("fp8", "c1", "error")] == LIMIT  # 3 answered 500, 3 written as not sent
    assert rows[("fp8", "c2", "error")] == LIMIT
    assert rows[("bf16", "c2", "ok")] == LIMIT


def test_the_budget_counts_a_rate_not_just_a_count(tmp_path: Path) -> None:
    run_dir = new_run_dir(tmp_path)
    sender = Scripted(failing=frozenset({"bf16"}))
    runner = _runner(run_dir, sender, budget=BudgetSpec(max_error_rate=0.5, drain_s=30.0))
    runner.runs["bf16"].budget.min_requests = 4
    _run(runner)
    bf16 = _manifest(run_dir)["targets"]["bf16"]
    assert bf16["status"] == "failed"
    assert "4 of 4 requests failed, more than --max-error-rate 0.5" in bf16["reason"]


def test_a_target_that_cannot_be_used_accounts_for_every_request(tmp_path: Path) -> None:
    run_dir = new_run_dir(tmp_path)
    sender, connector = Scripted(), NoWire(LIMIT, down=frozenset({"fp8"}))
    cfg = config(run_dir, targets=("bf16", "fp8"), limit=LIMIT)
    _run(Runner(cfg, clock=VirtualClock(), sender=sender, connector=connector, analysis=unanalysed))
    fp8 = _manifest(run_dir)["targets"]["fp8"]
    assert fp8["status"] == "failed" and "refused" in fp8["reason"]
    assert _rows(run_dir)[("fp8", "c1", "error")] == LIMIT
    assert {t for t, _, _ in sender.sent} == {"bf16"}


# -- draining after an interrupt ------------------------------------------------------------
class InFlight:
    """Answers two requests, is interrupted (``interrupts`` times), and has one request in
    flight that ends ``answer_after`` virtual seconds later (cancelled if the drain ends
    first)."""

    def __init__(self, answer_after: float, interrupts: int = 1) -> None:
        self.answer_after, self.interrupts = answer_after, interrupts
        self.interrupted_at: float | None = None
        self.phases: list[str] = []

    async def send(self, phase: Phase, run: TargetRun, stop: RunStop) -> dict[str, Any] | None:
        if stop.event.is_set():
            return None
        self.phases.append(phase.label)
        start = phase.clock.now()
        first, second, third = todo(phase)[:3]
        answer(phase, first)
        answer(phase, second)
        self.interrupted_at = phase.clock.now()
        for _ in range(self.interrupts):
            stop.interrupt()
        await phase.clock.sleep_until(phase.clock.now() + self.answer_after)
        answer(phase, third)
        return {"start": start, "end": phase.clock.now(), "interrupted": True}


def test_an_interrupt_lets_the_request_in_flight_finish_within_the_drain(tmp_path: Path) -> None:
    run_dir, clock, sender = new_run_dir(tmp_path), VirtualClock(), InFlight(answer_after=5.0)
    began = time.monotonic()
    _run(_runner(run_dir, sender, clock, budget=BudgetSpec(drain_s=30.0)))
    assert time.monotonic() - began < 5  # virtual seconds
    assert sender.phases == ["c1"]  # c2 never begins
    assert _rows(run_dir) == {("bf16", "c1", "ok"): 3}
    assert clock.now() == pytest.approx(5.0)
    manifest = _manifest(run_dir)
    assert manifest["interrupted"] is True
    assert manifest["targets"]["bf16"]["phases"]["c1"]["interrupted"] is True


def test_what_outlasts_the_drain_is_cancelled_at_its_end(tmp_path: Path) -> None:
    run_dir, clock, sender = new_run_dir(tmp_path), VirtualClock(), InFlight(answer_after=3600.0)
    began = time.monotonic()
    _run(_runner(run_dir, sender, clock, budget=BudgetSpec(drain_s=30.0)))
    assert time.monotonic() - began < 5
    assert clock.now() == pytest.approx(30.0)  # the drain's end, not the answer's
    assert _rows(run_dir) == {("bf16", "c1", "ok"): 2}
    assert _manifest(run_dir)["interrupted"] is True


def test_a_second_interrupt_cancels_at_once(tmp_path: Path) -> None:
    run_dir, clock = new_run_dir(tmp_path), VirtualClock()
    _run(
        _runner(
            run_dir,
            InFlight(answer_after=5.0, interrupts=2),
            clock,
            budget=BudgetSpec(drain_s=30.0),
        )
    )
    assert clock.now() == 0.0
    assert _rows(run_dir) == {("bf16", "c1", "ok"): 2}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_interrupts_the_run_and_the_handlers_before_are_back(
    tmp_path: Path, sig: signal.Signals
) -> None:
    class Signalling(Scripted):
        async def send(self, phase: Phase, run: TargetRun, stop: RunStop) -> dict[str, Any] | None:
            if stop.event.is_set():
                return None
            os.kill(os.getpid(), sig)
            while not stop.event.is_set():
                await asyncio.sleep(0.001)
            return {"start": 0.0, "end": phase.clock.now(), "interrupted": True}

    before = signal.getsignal(sig)
    run_dir = new_run_dir(tmp_path)
    _run(_runner(run_dir, Signalling()))
    assert _manifest(run_dir)["interrupted"] is True
    assert signal.getsignal(sig) == before


# -- orders ---------------------------------------------------------------------------------
def _interleaved(cfg: RunConfig, sender: Any, connector: NoWire) -> Runner:
    return Runner(
        cfg,
        clock=VirtualClock(),
        sender=sender,
        connector=connector,
        order=Interleaved(),
        analysis=unanalysed,
    )


def _two_arms(run_dir: Path) -> RunConfig:
    """bf16 and fp8 at concurrency 1, in blocks of 2."""
    return config(
        run_dir,
        targets=("bf16", "fp8"),
        schedules=(ClosedLoop(1),),
        limit=LIMIT,
        load={"block_size": 2},
    )


def _blocks(cfg: RunConfig) -> list[frozenset[str]]:
    """The blocks of a 6-request run at block size 2: strided, every third request."""
    ids = [r.id for r in cfg.trace.iter_requests()]
    return [frozenset({ids[j], ids[j + 3]}) for j in range(3)]


def test_interleaved_blocks_go_to_every_arm_in_a_rotating_order(tmp_path: Path) -> None:
    run_dir, sender = new_run_dir(tmp_path), Scripted()
    cfg = _two_arms(run_dir)
    _run(_interleaved(cfg, sender, NoWire(LIMIT)))
    blocks = _blocks(cfg)
    assert [(t, b) for t, _, b in sender.sent] == [
        ("bf16", blocks[0]),
        ("fp8", blocks[0]),
        ("fp8", blocks[1]),
        ("bf16", blocks[1]),
        ("bf16", blocks[2]),
        ("fp8", blocks[2]),
    ]
    manifest = _manifest(run_dir)
    assert manifest["run_spec"]["load"]["parallel_targets"] is True
    assert [b[0] for b in manifest["targets"]["fp8"]["phases"]["c1"]["blocks"]] == [0, 1, 2]


class _TokensAndScores:
    """Answers every request with the same tokens and logprobs, and notes, as each block is
    sent, which teacher-forced scores were written by then."""

    def __init__(self, run_dir: Path) -> None:
        self.scores = run_dir / "teacher_forced.jsonl"
        self.sent: list[tuple[str, frozenset[str], set[tuple[str, str]]]] = []

    async def send(self, phase: Phase, run: TargetRun, stop: RunStop) -> dict[str, Any]:
        lines = self.scores.read_text().splitlines() if self.scores.exists() else []
        scored = {(row["target"], row["request_id"]) for row in map(json.loads, lines)}
        reqs = todo(phase)
        self.sent.append((phase.target.name, frozenset(r.id for r in reqs), scored))
        start = phase.clock.now()
        for req in reqs:
            answer(phase, req, prompt_ids=[1, 2, 3], output_ids=[4, 5], output_logprobs=[-1, -2])
        return {"start": start, "end": phase.clock.now()}


def test_interleaved_arms_are_scored_right_after_their_own_turns(tmp_path: Path) -> None:
    """Each arm's answers are scored teacher-forced right after its own turn in a block, once
    the reference's are in, before the next arm sends (its server still holds the prompts);
    what the reference answers later is scored after the arm's next turn."""
    run_dir = new_run_dir(tmp_path)
    sender = _TokensAndScores(run_dir)
    cfg = _two_arms(run_dir)
    cfg = cfg.with_spec(quality=replace(cfg.quality, teacher_forced=True))

    def scoring(writer: JsonlWriter) -> Scoring:
        # The answers agree token for token: every score is the arm's own, no server is asked.
        session: Any = None
        return Scoring(
            session, "http://unused.invalid", "model", writer, QuietProgress(), 1.0, None
        )

    _run(_interleaved(cfg, sender, NoWire(LIMIT, scoring=scoring)))
    b = _blocks(cfg)
    # bf16 b0, fp8 b0 | fp8 b1, bf16 b1 | bf16 b2, fp8 b2: what was scored before each turn.
    before = [scored for _, _, scored in sender.sent]
    assert [(t, blk) for t, blk, _ in sender.sent] == [
        ("bf16", b[0]), ("fp8", b[0]), ("fp8", b[1]), ("bf16", b[1]), ("bf16", b[2]), ("fp8", b[2])
    ]  # fmt: skip
    assert before[0] == set()
    assert before[1] == {("bf16", i) for i in b[0]}
    assert before[2] == before[1] | {("fp8", i) for i in b[0]}
    assert before[3] == before[2]  # fp8's b1 waits for the reference's
    assert before[4] == before[3] | {("bf16", i) for i in b[1]}
    assert before[5] == before[4] | {("bf16", i) for i in b[2]}
    rows = [json.loads(x) for x in (run_dir / "teacher_forced.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * LIMIT and all(r["own"] == r["n"] == 2 for r in rows)
    spans = {t: e["teacher_forced"]["spans"] for t, e in _manifest(run_dir)["targets"].items()}
    assert [s[2] for s in spans["bf16"]] == [2, 2, 2]
    assert [s[2] for s in spans["fp8"]] == [2, 4]  # b0, then b1 and b2 after its last turn


def test_no_run_subclasses_the_runner() -> None:
    """Orders, senders and connectors are given to the runner; nothing overrides its steps."""
    for mod in pkgutil.walk_packages(replay.__path__, "replay."):
        if mod.name.endswith(".__main__"):
            continue  # runs the command line
        try:
            importlib.import_module(mod.name)
        except ImportError:  # an optional extra that is not installed
            continue
    assert Runner.__subclasses__() == []


def _rounds(
    run_dir: Path,
    sender: Any,
    max_requests: int | None,
    resume: bool = False,
    max_time_s: float | None = None,
) -> Runner:
    cfg = config(
        run_dir, targets=("bf16", "fp8"), schedules=(RoundLoop(1),), limit=LIMIT, resume=resume
    )
    order = Rounds(SequentialSpec(round_size=1, max_requests=max_requests, max_time_s=max_time_s))
    connector = NoWire(LIMIT)
    return Runner(
        cfg,
        clock=VirtualClock(),
        sender=sender,
        connector=connector,
        order=order,
        analysis=unanalysed,
    )


def test_sequential_rounds_go_to_both_arms_and_are_folded_in(tmp_path: Path) -> None:
    run_dir, sender = new_run_dir(tmp_path), Scripted()
    _run(_rounds(run_dir, sender, max_requests=3))
    # One request a round (one bucket open), to the reference and the candidate alike.
    assert [(t, p, len(ids)) for t, p, ids in sender.sent] == [
        (t, "seq", 1) for _ in range(3) for t in ("bf16", "fp8")
    ]
    state = json.loads((run_dir / "sequential.json").read_text())
    assert len(state["run"]["sent"]) == 3 and state["run"]["stopped"] == "max_requests"
    assert _rows(run_dir) == {("bf16", "seq", "ok"): 3, ("fp8", "seq", "ok"): 3}


def test_an_interrupted_round_is_not_folded_in_and_a_resume_sends_it_again(
    tmp_path: Path,
) -> None:
    run_dir = new_run_dir(tmp_path)
    # Round 1 (bf16, fp8) is folded in; round 2's fp8 answer is cut short.
    _run(_rounds(run_dir, Scripted(interrupt_after=3), max_requests=3))
    state = json.loads((run_dir / "sequential.json").read_text())
    assert len(state["run"]["sent"]) == 1 and state["run"]["stopped"] == "interrupted"
    second = Scripted()
    _run(_rounds(run_dir, second, max_requests=3, resume=True))
    state = json.loads((run_dir / "sequential.json").read_text())
    assert len(state["run"]["sent"]) == 3
    # results.jsonl matches the state: round 2's first answer was dropped and sent again.
    assert _rows(run_dir) == {("bf16", "seq", "ok"): 3, ("fp8", "seq", "ok"): 3}


def test_the_sequential_canary_stops_at_its_max_time_on_the_run_clock(tmp_path: Path) -> None:
    class TenSeconds(Scripted):
        async def send(self, phase: Phase, run: TargetRun, stop: RunStop) -> dict[str, Any] | None:
            await phase.clock.sleep_until(phase.clock.now() + 10.0)
            return await super().send(phase, run, stop)

    run_dir, sender = new_run_dir(tmp_path), TenSeconds()
    began = time.monotonic()
    _run(_rounds(run_dir, sender, max_requests=None, max_time_s=25.0))
    assert time.monotonic() - began < 5  # 30 virtual seconds
    state = json.loads((run_dir / "sequential.json").read_text())
    # Rounds of 10 s each (the arms at once): the third ends past 25 s, and no fourth begins.
    assert len(state["run"]["sent"]) == 3 and state["run"]["stopped"] == "max_time"
    assert len(sender.sent) == 6


# -- the composition root -------------------------------------------------------------------
def _options(**kw: Any) -> RunOptions:
    defaults = {f.name: f.default for f in fields(RunOptions) if f.default is not MISSING}
    required = {
        f.name: None for f in fields(RunOptions) if f.default is MISSING and f.name not in kw
    }
    return RunOptions(**{**required, **defaults, "concurrency": "2", "trace_times": False, **kw})


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ({"sequential": True, "rate": 5.0}, "--sequential sends closed-loop rounds"),
        ({"sequential": True, "workers": 2}, "--sequential sends its rounds from one process"),
        ({"sequential": True, "quality_pass": "serial"}, "--quality-pass serial and --sequential"),
        ({"workers": 0}, "--workers 0"),
    ],
)
def test_flags_that_do_not_go_together_are_refused_in_one_place(
    given: dict[str, Any], why: str
) -> None:
    with pytest.raises(InputError, match=why):
        refuse_combinations(_options(**given), [ClosedLoop(2)])


def test_the_composition_root_picks_the_order_and_the_sender(tmp_path: Path) -> None:
    cfg = config(new_run_dir(tmp_path), targets=("bf16", "fp8"), limit=LIMIT)
    progress = QuietProgress()
    assert isinstance(compose(cfg, progress).order, OneAfterAnother)
    interleaved = compose(cfg.with_load(interleave=True), progress)
    assert isinstance(interleaved.order, Interleaved)
    sequential = compose(cfg.with_spec(sequential=SequentialSpec()), progress)
    assert isinstance(sequential.order, Rounds)
    assert [s.label for s in sequential.cfg.schedules] == ["seq"]
    assert (
        sequential.cfg.quality.teacher_forced is False
        and sequential.cfg.load.parallel_targets is True
    )
    pooled = compose(cfg.with_load(workers=2), progress)
    assert isinstance(pooled.sender, WorkerPoolSender) and pooled.sender.clock is pooled.clock
