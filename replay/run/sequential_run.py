"""``replay canary --sequential``: the reference and the candidate served at once, the trace's
requests sent to both (and to the A/A control on the reference's server) in rounds, and the
run stopped as soon as the sequential evidence decides (``analysis.sequential``).

Each round takes up to ``round_size`` requests per open bucket
(``analysis.sequential.plan.plan_round``; buckets by prompt length on the reference's
tokenizer), sends them to every arm (each arm a
``Phase`` limited to the round's requests, a closed loop of ``--concurrency``, phase ``seq``),
grades the round's pairs as the analysis does (explicit checks, derived grades against the
A/A control), folds them into the state and saves ``sequential.json``. A decided bucket gets no
more requests; the run stops once decided, or when ``--max-requests`` pairs are sent,
``--max-time`` seconds are spent (checked between rounds), the trace runs out or an arm's
error budget is spent.

Interrupts and resume: Ctrl-C/SIGTERM stops sending; the round in flight is *not* folded into
the state. ``--resume`` reloads ``sequential.json``, drops from results.jsonl every result of a
request the state does not list as folded (those of the interrupted round), and *resends*
them: the state file is the truth, and results.jsonl always matches it.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from replay.analysis.grading.rows import grade_rows, grading_spec
from replay.analysis.run_spec import SequentialSpec
from replay.analysis.sequential.plan import plan_round
from replay.analysis.sequential.state import SequentialState
from replay.checkers.grader import Grader
from replay.core.errors import ConfigError, RunDirError
from replay.core.records import Result
from replay.core.schedule import ClosedLoop
from replay.run.order import Run
from replay.run.phase import TargetSession
from replay.run.run_config import RunConfig, TargetRun
from replay.rundir.files import RESULTS, JsonlWriter, read_results, rewrite_jsonl
from replay.rundir.sequential_file import SequentialRun, load
from replay.serving.prompt_tokens import UNKNOWN

SEQ_PHASE = "seq"
UNKNOWN_BUCKET = "unknown"  # a prompt whose length the tokenizer did not give


@dataclass(frozen=True)
class RoundLoop(ClosedLoop):
    """A closed loop whose phase is the sequential canary's (``seq``)."""

    @property
    def label(self) -> str:
        return SEQ_PHASE


class _Tee(JsonlWriter):
    """results.jsonl, and the round's rows kept for its grading."""

    def __init__(self, inner: JsonlWriter) -> None:
        self.inner, self.path = inner, inner.path
        self.rows: list[dict[str, Any]] = []
        self._fd = None

    @property
    def failed(self) -> RunDirError | None:
        return self.inner.failed

    def write(self, obj: Any) -> None:
        self.inner.write(obj)
        self.rows.append(obj)

    def close(self) -> None:
        pass


def drop_unfolded(cfg: RunConfig) -> None:
    """Resume: keep only the results of requests the saved state folded in."""
    saved = load(cfg.run_dir)
    folded = set(saved[0].sent) if saved is not None else set()
    if (cfg.run_dir / RESULTS).exists():
        keep = [r.to_json() for r in read_results(cfg.run_dir) if r.request_id in folded]
        rewrite_jsonl(cfg.run_dir / RESULTS, keep)


class Rounds:
    """The run's order (``RunOrder``) for the sequential canary: the reference (with its A/A
    control) and the candidate served at once, the trace sent to every arm in rounds."""

    def __init__(self, opts: SequentialSpec) -> None:
        self._runner: Run | None = None
        self.opts = opts
        self.candidate: str | None = None
        self.arms: dict[str, TargetSession] = {}
        self._ready: dict[str, asyncio.Event] = {}
        self._grader: Grader | None = None  # the rounds' (``_rounds``)
        self._over = asyncio.Event()
        self.seq: SequentialRun | None = None
        self.queues: dict[str, deque[int]] = {}

    @property
    def runner(self) -> Run:
        assert self._runner is not None, "bind the order to its runner first"
        return self._runner

    def prepare(self, cfg: RunConfig) -> RunConfig:
        """No teacher-forced scoring, every arm at once; a resume first drops the results of
        the round that was not folded in (they are sent again)."""
        if cfg.resume:
            drop_unfolded(cfg)
        quality = replace(cfg.quality, teacher_forced=False)
        return cfg.with_load(parallel_targets=True).with_spec(quality=quality)

    def bind(self, runner: Run) -> None:
        if runner.candidate is None or len(runner.runs) != 2:
            raise ConfigError("--sequential: give exactly two targets, a reference and a candidate")
        self._runner = runner
        self.candidate = runner.candidate
        self._ready = {n: asyncio.Event() for n in runner.runs}

    def arms_on(self, target: str) -> list[str]:
        r = self.runner
        control = r.control is not None and target == r.reference
        return [target] + ([r.control.spec.name] if r.control and control else [])

    def manifest_extra(self) -> dict[str, Any]:
        return {}

    # -- serving: every arm up at once, waiting for the rounds --------------------------------
    async def run_targets(self) -> None:
        tasks = [asyncio.ensure_future(self._serving(t)) for t in self.runner.runs.values()]
        try:
            await self._rounds()
        finally:
            self._over.set()
            await asyncio.gather(*tasks)

    async def _serving(self, run: TargetRun) -> None:
        try:
            await self.runner.serve_target(run)
        finally:
            self._ready[run.spec.name].set()  # also when it failed: the rounds do not wait

    async def send_arms(self, run: TargetRun, arm: TargetSession) -> bool:
        """Register the target's arms for the rounds and hold its server until they end;
        False: nothing follows them (no teacher-forced scoring)."""
        r = self.runner
        self.arms[arm.name] = arm
        if run.spec.name == r.reference and r.control is not None:
            ctl = replace(arm, name=r.control.spec.name, budget=r.control.budget)
            self.arms[ctl.name] = ctl
        self._ready[run.spec.name].set()
        await self._over.wait()
        if r.control is not None and run.spec.name == r.reference:
            r.control.info = dict(run.info)
            if not r.control.budget.spent:
                r.control.status = "ok"
        return False

    # -- the rounds ---------------------------------------------------------------------------
    def _start_state(self) -> None:
        """The buckets of the reference's prompt lengths (those the trace has requests in),
        the saved state on a resume, and each bucket's queue of requests not sent yet."""
        c = self.runner.cfg
        counts = self.arms[self.runner.reference].counts
        labels = [*c.buckets.labels, UNKNOWN_BUCKET]
        saved = load(c.run_dir) if c.resume else None
        sent = set(saved[0].sent) if saved is not None else set()
        pools: Counter[str] = Counter()
        queues: dict[str, deque[int]] = {b: deque() for b in labels}
        for i, req in enumerate(c.trace.iter_requests()):
            n = counts[i]
            b = c.buckets.label(n) if n != UNKNOWN else UNKNOWN_BUCKET
            pools[b] += 1
            if req.id not in sent:
                queues[b].append(i)
        names = [b for b in labels if pools[b]]
        self.queues = {b: queues[b] for b in names}
        if saved is not None:
            self.seq = saved[0]
            self.seq.stopped = "running"
            return
        state = SequentialState.start(names, c.thresholds.rule)
        self.seq = SequentialRun(state, self.opts.round_size, {b: pools[b] for b in names})

    def unsent(self) -> dict[str, int]:
        return {b: len(q) for b, q in self.queues.items()}

    def _why_stop(self, began: float) -> str | None:
        assert self.seq is not None
        o, seq = self.opts, self.seq
        if self.runner.stopping.is_set():
            return "interrupted"
        if any(r.budget.spent for r in self.runner.all_runs().values()):
            return "error_budget"
        if seq.state.decision != "open":
            return "decided"
        if o.max_requests is not None and len(seq.sent) >= o.max_requests:
            return "max_requests"
        spent = seq.elapsed_s + self.runner.clock.now() - began
        if o.max_time_s is not None and spent >= o.max_time_s:
            return "max_time"
        if not any(self.unsent().get(b, 0) for b in seq.state.open_buckets):
            return "trace"
        return None

    async def _rounds(self) -> None:
        r = self.runner
        await asyncio.gather(*(e.wait() for e in self._ready.values()))
        names = [*r.runs, *([r.control.spec.name] if r.control else [])]
        if r.stopping.is_set() or any(n not in self.arms for n in names):
            return  # a target failed (recorded by the runner) or the run was interrupted
        self._start_state()
        assert self.seq is not None
        began = r.clock.now()  # --max-time is on the run's clock
        # One grading process for every round (each would otherwise start its own).
        with Grader() as self._grader:
            while (why := self._why_stop(began)) is None:
                await self._round(names)
                elapsed = self.seq.elapsed_s + r.clock.now() - began
                self.seq.elapsed_s, began = elapsed, r.clock.now()
        self.seq.stopped = why
        for t in r.all_runs().values():
            if t.budget.spent and t.status != "failed":
                r.budget_spent(t)
        seq = self.seq
        r.stop.guarded(lambda: seq.save(r.cfg.run_dir, self.unsent()))

    async def _round(self, names: list[str]) -> None:
        """One round: plan, send to every arm, grade, fold in, save."""
        assert self.seq is not None
        r, seq, o = self.runner, self.seq, self.opts
        room = len(seq.state.open_buckets) * o.round_size
        if o.max_requests is not None:
            room = min(room, o.max_requests - len(seq.sent))
        plan = plan_round(seq.state, self.unsent(), room)
        chosen = {self.queues[b].popleft(): b for b, k in plan.items() for _ in range(k)}
        ids = {i: req.id for i, req in enumerate(r.cfg.trace.iter_requests()) if i in chosen}
        tee = _Tee(r.writer)
        await asyncio.gather(*(self._send(n, set(ids.values()), tee) for n in names))
        if r.stopping.is_set():
            return  # not folded: a resume sends these again
        counts = self._grade(tee.rows, {ids[i]: b for i, b in chosen.items()})
        seq.state = seq.state.update(counts)
        seq.sent += [ids[i] for i in sorted(chosen)]
        r.stop.guarded(lambda: seq.save(r.cfg.run_dir, self.unsent()))
        r.save_manifest()

    async def _send(self, name: str, ids: set[str], tee: _Tee) -> None:
        r = self.runner
        run = r.all_runs()[name]
        phase = r.phase(self.arms[name], r.cfg.schedules[0], writer=tee, sessions=None, only=ids)
        window = await r.send(phase, run)
        if window is not None:
            old = run.phases.get(SEQ_PHASE)
            run.phases[SEQ_PHASE] = window if old is None else {**window, "start": old["start"]}

    def _grade(
        self, rows: list[dict[str, Any]], buckets: Mapping[str, str]
    ) -> dict[str, tuple[int, int, int]]:
        from replay.analysis.sequential.summary_block import round_counts

        r = self.runner
        results = [Result.from_json(x) for x in rows]
        specs = {q.id: grading_spec(q) for q in r.cfg.trace.iter_requests() if q.id in buckets}
        graded = grade_rows(results, specs, r.reference, self._grader)
        control = r.control.spec.name if r.control is not None else None
        assert self.candidate is not None
        return round_counts(graded, buckets, self.candidate, r.reference, control)
