"""Reference, A/A control and candidates measured interleaved, so that a machine whose load
drifts cannot favour one of them (the default whenever a run compares targets).

One after another, the reference is measured in one minute and the candidate in the next: on
a shared machine whose load changes between the two, that change is read as the candidate's.
Here every target's server is up at once and each phase is sent in blocks (``block_size``
units: requests, or whole sessions): a closed loop's blocks are strided through windows of the
trace (block j of a window takes every n-th unit from j, so a trace sorted by length still
gives every bucket many blocks), an open loop's are consecutive, with their arrival offsets
started again from each block's first. Block k goes to every arm in turn (the reference, its
A/A control, each candidate), in an order rotated by k (A B C, B C A, C A B, ...) so that every
arm holds every position equally often. Only one server works at a time, at the phase's own
load. So each request's pair was measured seconds apart, and a slow drift falls on every arm
alike; what the machine does during one arm's turn moves all of that block's requests, which
is why the systems rule's intervals are over blocks, not requests (``systems_cells``). A local
reference's control runs on a second server of the reference's own spec (within
``SERVERS_AT_ONCE`` local servers), so that every arm starts each block on a server that sat
idle through the previous one (on the reference's server it would sometimes follow the
reference warm, as the candidate never can: measured on the 2-core machine, that gave the
control a TTFT 27% below the reference's).

Each arm's block is a ``Phase`` limited to the block's requests, with the phase's label and
its own edge scrapes. The arm's window in the manifest keeps its blocks (``[k, start, end]``,
only blocks the arm sent whole in one process) and ``busy_s``; the summary's rates and server
figures of the phase are over the arm's own blocks (``summary.server_over``), and the systems
rule pairs the arms' blocks by k. A phase time limit counts each arm's own time in the phase.

In the first phase, right after an arm's turn and before the next arm's, the reference's
answers that arm has answered too are scored teacher-forced on its server
(``Run.score_between``): their prompts are still in its prefix cache, so only the answers'
tokens are computed, where after a long phase most prompts would be evicted and prefilled
again. Scoring follows the arm's own turn, never precedes it: with three arms or more its
server still sits idle through another arm's turn before its next block.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from replay.core.iterate import closing
from replay.core.schedule import ClosedLoop, OpenLoop
from replay.run.capacity_phase import finished_capacity
from replay.run.capacity_step import CapacityStep
from replay.run.order import Run
from replay.run.phase import Schedule, TargetSession
from replay.run.progress import Progress
from replay.run.run_config import RunConfig, TargetRun
from replay.traces.sessions import Unit, units
from replay.traces.trace import Request

BLOCKS_PER_CONCURRENCY = 2  # a closed loop's block: this many times its concurrency
OPEN_LOOP_BLOCK = 32  # an open loop's block, in units
STRIDE_WINDOW = 32  # a closed loop's blocks are strided within this many blocks of the trace
# Local servers held at once: a run with more local targets goes one after another by default,
# and a local control gets a server of its own only within this many (a reference, its control
# and a candidate: about 3 x 3 GB for the embedded model on vLLM CPU).
SERVERS_AT_ONCE = 3


def block_size(sched: Schedule, asked: int) -> int:
    """``asked`` (``--block-size``), or by default 2 x a closed loop's concurrency, 32 units of
    an open loop. Blocks are the units the systems rule's intervals are over (a block's
    requests share the machine's state while an arm sends it), so many small blocks weigh
    more than a few large ones; the price is a ramp down at every block's end, the same for
    every arm."""
    if asked > 0:
        return asked
    if isinstance(sched, ClosedLoop):
        return BLOCKS_PER_CONCURRENCY * sched.concurrency
    return OPEN_LOOP_BLOCK


@dataclass(frozen=True)
class Block:
    """Block k of a phase: its units (requests by trace position) and, for an open loop, their
    offsets. A block is held whole while every arm sends it: ``block_size`` units."""

    k: int
    units: list[Unit]
    offsets: list[float] | None

    def ids(self) -> set[str]:
        return {req.id for unit in self.units for _, req in unit}

    def requests(self) -> list[tuple[int, Request]]:
        return [pair for unit in self.units for pair in unit]

    def schedule(self, sched: Schedule, todo: set[str]) -> Schedule:
        """The phase's schedule for the units of ``todo``: an open loop's offsets from the
        first of them."""
        if not isinstance(sched, OpenLoop) or self.offsets is None:
            return sched
        mine = [
            o
            for u, o in zip(self.units, self.offsets, strict=True)
            if {req.id for _, req in u} <= todo
        ]
        start = mine[0] if mine else 0.0
        return OpenLoop([o - start for o in mine], sched.max_in_flight, sched.name)


class _QuietPhases:
    """A block's ``Phase`` reports its requests, not a new bar: the bar is the phase's."""

    def __init__(self, inner: Progress) -> None:
        self.inner = inner

    def status(self, message: str) -> None:
        self.inner.status(message)

    def phase(self, target: str, label: str, total: int) -> None:
        pass

    def advance(self, target: str, label: str, ok: bool) -> None:
        self.inner.advance(target, label, ok)


@dataclass
class _Window:
    """One arm's window over an interleaved phase."""

    start: float | None = None
    end: float | None = None
    blocks: list[list[float]] = field(default_factory=list)
    flags: dict[str, bool] = field(default_factory=dict)

    def add(self, k: int, window: dict[str, Any], whole: bool) -> None:
        self.start = window["start"] if self.start is None else self.start
        self.end = window["end"]
        interrupted = bool(window.get("interrupted"))
        if interrupted:
            self.flags["interrupted"] = True
        if whole and not interrupted:
            self.blocks.append([k, window["start"], window["end"]])

    def json(self) -> dict[str, Any]:
        blocks = sorted(self.blocks)
        return {
            "start": self.start,
            "end": self.end,
            "blocks": blocks,
            "busy_s": sum(b[2] - b[1] for b in blocks),
            **self.flags,
        }


class Interleaved:
    """The run's order (``RunOrder``) when its arms are interleaved: every target's server up at
    once, each phase sent in blocks, arm after arm; then the capacity phase."""

    def __init__(self) -> None:
        self._runner: Run | None = None
        self.control_server = False
        self.arms: dict[str, TargetSession] = {}
        self._ready: dict[str, asyncio.Event] = {}
        self._over = asyncio.Event()
        # The capacity phase's manifest block; a resume keeps one that finished.
        self.capacity: dict[str, Any] | None = None

    @property
    def runner(self) -> Run:
        assert self._runner is not None, "bind the order to its runner first"
        return self._runner

    def prepare(self, cfg: RunConfig) -> RunConfig:
        return cfg.with_load(parallel_targets=True)

    def bind(self, runner: Run) -> None:
        self._runner = r = runner
        # A local reference's A/A control gets a server of its own, started like the others:
        # every arm then starts each of its blocks on a server the previous block left idle.
        # (Sharing the reference's, it would follow it warm in some blocks, which the
        # candidate never can.) A remote reference's control shares its server.
        ref = r.runs[r.reference]
        local = sum(t.spec.is_local for t in r.runs.values())
        self.control_server = (
            r.control is not None and ref.spec.is_local and local < SERVERS_AT_ONCE
        )
        if r.control is not None and self.control_server:
            rest = {n: t for n, t in r.runs.items() if n != r.reference}
            r.runs = {r.reference: ref, r.control.spec.name: r.control, **rest}
        self._ready = {n: asyncio.Event() for n in r.runs}
        self.capacity = finished_capacity(r.cfg) if r.cfg.resume else None

    def manifest_extra(self) -> dict[str, Any]:
        return {"capacity": self.capacity} if self.capacity is not None else {}

    # -- serving: every server up at once, waiting for the blocks ----------------------------
    async def run_targets(self) -> None:
        r = self.runner
        tasks = [asyncio.ensure_future(self._serving(t)) for t in r.runs.values()]
        try:
            await asyncio.gather(*(e.wait() for e in self._ready.values()))
            await self._phases_interleaved()
        finally:
            if r.ref_done is not None:
                r.ref_done.set()  # teacher-forced scoring reads the reference's answers
            self._over.set()
            await asyncio.gather(*tasks)
        if self.capacity is None and not r.stopping.is_set():
            # The capacity phase (replay/run/capacity_step.py), once the workload's servers
            # stopped.
            step = CapacityStep(
                r, self.arms, self._units, self._save_capacity, _QuietPhases(r.progress)
            )
            await step.run()

    def _save_capacity(self, block: dict[str, Any]) -> None:
        self.capacity = block
        self.runner.save_manifest()

    def _units(self) -> Iterator[Unit]:
        """The trace's units (a session's turns, or one request), read again."""
        with closing(self.runner.cfg.trace.iter_requests()) as reqs:
            if self.runner.sessions:
                yield from units(enumerate(reqs))
            else:
                yield from ([t] for t in enumerate(reqs))

    async def _serving(self, run: TargetRun) -> None:
        try:
            await self.runner.serve_target(run)
        finally:
            self._ready[run.spec.name].set()  # also when it failed: the blocks do not wait

    async def send_arms(self, run: TargetRun, arm: TargetSession) -> bool:
        """Register the target's arms (and the reference's A/A control) for the blocks, and
        hold its server until every phase is sent."""
        r = self.runner
        self.arms[arm.name] = arm
        if self.arms_on(run.spec.name)[1:] and r.control is not None:
            r.control.info = dict(run.info)
            self.arms[r.control.spec.name] = replace(
                arm, name=r.control.spec.name, budget=r.control.budget
            )
        self._ready[run.spec.name].set()
        await self._over.wait()
        for name in self.arms_on(run.spec.name):
            t = r.all_runs()[name]
            if t.budget.spent:
                r.budget_spent(t)
            elif name != run.spec.name:
                t.status = "ok"  # the control: its target's status is set by the runner
        return not run.budget.spent and not r.stopping.is_set()

    # -- the blocks ---------------------------------------------------------------------------
    def _order(self) -> list[str]:
        """The arms in the runner's order: the reference, its control, then the others."""
        names = [n for t in self.runner.runs for n in self.arms_on(t)]
        return [n for n in names if n in self.arms]

    async def _phases_interleaved(self) -> None:
        r = self.runner
        live = self._order()
        for k, sched in enumerate(r.cfg.schedules):
            if r.stopping.is_set() or not live:
                return
            arms = [n for n in live if sched.label not in r.skipped_before(self._owner(n))]
            await self._phase_in_blocks(sched, arms)
            rest = [s.label for s in r.cfg.schedules[k + 1 :]]
            if rest:
                stopped = {t for t in r.runs if t in live and self._stops(t, rest)}
                live = [n for n in live if self._owner(n) not in stopped]

    def arms_on(self, target: str) -> list[str]:
        """A target and the arms on its server: the control has its own when it can."""
        r = self.runner
        if self.control_server or r.control is None or target != r.reference:
            return [target]
        return [target, r.control.spec.name]

    def _owner(self, name: str) -> str:
        """The target whose server an arm runs on (a shared control's is the reference's)."""
        r = self.runner
        if r.control and name == r.control.spec.name and not self.control_server:
            return r.reference
        return name

    def _stops(self, target: str, rest: Sequence[str]) -> bool:
        r = self.runner
        run = r.runs[target]
        if not r.saturated(run, target):
            return False
        skipped = {"skipped": list(rest)}
        for name in self.arms_on(target):
            t = r.all_runs()[name]
            t.info["sweep_stopped"] = {**run.info["sweep_stopped"], **skipped}
        r.save_manifest()
        return True

    async def _phase_in_blocks(self, sched: Schedule, names: Sequence[str]) -> None:
        r = self.runner
        label, size = sched.label, block_size(sched, r.cfg.load.block_size)
        windows = {n: self._resumed_window(n, label) for n in names}
        for n in names:
            r.progress.phase(n, label, r.cfg.trace.count - len(r.finished(n, label)))
        spent = {n: 0.0 for n in names}
        first = label == r.cfg.schedules[0].label  # the phase teacher-forced scoring reads
        for block in self._blocks(sched, size):
            if r.stopping.is_set():
                break
            turn = block.k % len(names)
            for n in [*names[turn:], *names[:turn]]:
                todo = block.ids() - r.finished(n, label)
                if not todo or r.stopping.is_set():
                    continue
                window = await self._send_block(n, sched, block, todo, spent[n])
                if window is not None:
                    windows[n].add(block.k, window, whole=todo == block.ids())
                    spent[n] += window["end"] - window["start"]
                if first:
                    await r.score_between(n)
        for n, w in windows.items():
            if w.start is not None:
                r.all_runs()[n].phases[label] = w.json()
        r.save_manifest()

    def _resumed_window(self, name: str, label: str) -> _Window:
        """An earlier process's whole blocks of this phase (a resume keeps them)."""
        r = self.runner
        prev = (r.previous(name).get("phases") or {}).get(label) or {}
        w = _Window(prev.get("start"), prev.get("end"), [list(b) for b in prev.get("blocks", [])])
        if r.finished(name, label):
            w.flags["resumed"] = True
        return w

    async def _send_block(
        self, name: str, sched: Schedule, block: Block, todo: set[str], spent: float
    ) -> dict[str, Any] | None:
        r = self.runner
        phase = r.phase(
            self.arms[name],
            block.schedule(sched, todo),
            progress=_QuietPhases(r.progress),
            timeout_s=max(1e-3, r.cfg.phase_timeout_s - spent),
            salt=r.cfg.phase_salt(name, sched.label),
            only=todo,
            requests=block.requests(),
        )
        return await r.send(phase, r.all_runs()[name])

    def _blocks(self, sched: Schedule, size: int) -> Iterator[Block]:
        """The phase's blocks: an open loop's consecutive units with their offsets; a closed
        loop's strided within windows of ``STRIDE_WINDOW`` blocks (``strided``)."""
        if isinstance(sched, OpenLoop):
            yield from consecutive(self._units(), iter(sched.offsets), size)
        else:
            yield from strided(self._units(), size)


def consecutive(items: Iterator[Unit], offsets: Iterator[float], size: int) -> Iterator[Block]:
    """``size`` units to a block, in trace order, each with its offset (an open loop's
    arrivals keep their order and spacing)."""
    chunk: list[Unit] = []
    offs: list[float] = []
    k = 0
    for unit in items:
        o = next(offsets, None)
        if o is None:  # never: Poisson and trace offsets cover every unit
            break
        chunk.append(unit)
        offs.append(o)
        if len(chunk) == size:
            yield Block(k, chunk, offs)
            chunk, offs, k = [], [], k + 1
    if chunk:
        yield Block(k, chunk, offs)


def strided(items: Iterator[Unit], size: int) -> Iterator[Block]:
    """Blocks of about ``size`` units: the trace is read ``STRIDE_WINDOW`` blocks at a time and
    block j of a window takes every n-th unit from j (n blocks in the window), so that every
    block holds every part of the window (a trace sorted by length still gives each bucket
    many blocks) and only a window is held."""
    k = 0
    while window := list(itertools.islice(items, size * STRIDE_WINDOW)):
        n = math.ceil(len(window) / size)
        for j in range(n):
            yield Block(k, window[j::n], None)
            k += 1
