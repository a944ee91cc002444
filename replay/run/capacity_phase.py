"""The capacity phase: does FP8's larger cache turn into requests per second on this machine?

FP8's point is a cache twice as large, which a light replay never touches. This phase measures
it: the reference and the candidate are started again with the same, smaller KV-cache memory
(``--kv-cache-memory-bytes``, stated in the manifest; VLLM_CPU_KVCACHE_SPACE is left out,
since vLLM CPU would take it instead), sized so that the loop's demand is twice what the
reference's cache holds (``capacity_plan``, checked against what its server reports once it is
up), and loaded with a closed loop of ``concurrency``. The reference's cache then fills and it
queues or preempts, while the candidate's, at the same bytes, holds what its dtype gives it.
The servers run at once (the A/A control on a third, of the reference's spec) and are sent
the same blocks in turn, as ``interleave`` sends a phase; the trace is cycled to give at least
``BLOCKS`` blocks, each cycle under its own cache salt, each block a stride of the trace so
that every block mixes its lengths (only the trace's first ``units_needed`` units are used, and
held).

The phase stops as soon as its rule decides: after every block, the call its cell would get
at the planned blocks (``analysis.capacity.settled_call``: the same figures the analysis
reads) is asked for, and once the blocks not sent could not change it, and the reference's
cache was seen full, no more are sent. ``time_limit_s`` bounds the blocks' time (checked
between blocks); a phase stopped by it is undecided, and its cell says so.

The manifest's ``capacity`` block says what ran, why it stopped (``stop``), or why it did not
run (remote targets cannot be restarted with a smaller cache; a workload that fills the
reference's cache already shows the need; the quality side decided without it), and the
phase's files are ``capacity/results.jsonl``, ``capacity/metrics/`` and
``capacity/servers/``. ``analysis.capacity`` reads them: was the reference's cache full, and
what did each arm serve within the SLOs there.
"""

from __future__ import annotations

import asyncio
import math
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from replay.analysis.capacity import settled_call
from replay.analysis.summary import server_over, spans_of
from replay.analysis.systems_cells import CAPACITY as PHASE
from replay.core.errors import KvcanaryError, RunDirError, TargetError
from replay.core.schedule import Clock, ClosedLoop
from replay.core.slo import SloSpec
from replay.pipeline.analyse import read_series
from replay.run.budget import ErrorBudget
from replay.run.capacity_plan import Plan
from replay.run.phase import Phase, TargetSession
from replay.run.progress import Progress
from replay.run.run_config import DEFAULT_STARTUP_TIMEOUT_S, RunConfig
from replay.run.servers import ServerFactory, launch, local_servers, stop
from replay.rundir.files import (
    CAPACITY_DIR,
    RESULTS,
    JsonlWriter,
    complete_results,
    complete_rows,
    write_failure,
)
from replay.rundir.manifest import read_manifest
from replay.serving.client import Client
from replay.serving.endpoints import api_session
from replay.serving.introspect import introspect, served_model
from replay.serving.local_server import LocalServer
from replay.serving.metrics import Scraper
from replay.serving.targets import TargetSpec, check_served_dtype
from replay.traces.sessions import Unit
from replay.traces.trace import Request

# Blocks per arm the phase plans (at least; the trace's cycles may give a few more): the sign
# interval of 24 at alpha / 2 reaches from d(7) to d(18).
BLOCKS = 24
PER_BLOCK = 2  # a block is this many times the concurrency
# The capacity servers' /metrics are read this often (the workload's once a second): a block
# of 2 x 12 requests lasts about a second on the embedded model, and its reference's cache sits
# at 90% or more only in moments (vLLM admits a request once its whole prompt fits; most wait
# for the step's token budget): five runs saw it in 1 to 4 of their blocks.
SCRAPE_S = 0.25


@dataclass(frozen=True)
class CapacityLoop(ClosedLoop):
    """A closed loop whose phase is the capacity phase's."""

    @property
    def label(self) -> str:
        return PHASE


def finished_capacity(cfg: RunConfig) -> dict[str, Any] | None:
    """The capacity block of the run being resumed, when its phase finished (ran, skipped or
    failed): kept as it is. One that was interrupted runs again, whole."""
    try:
        block = read_manifest(cfg.run_dir).capacity
    except (OSError, ValueError, KvcanaryError):
        return None
    done = block is not None and block.get("status") in ("ran", "skipped", "failed")
    return dict(block) if block is not None and done else None


def peak_usage(
    run_dir: Path, reference: str, phases: Mapping[str, Mapping[str, Any]]
) -> float | None:
    """The reference's peak KV usage over its workload phases (their blocks, if interleaved)."""
    series = read_series(run_dir, iter([reference]), reference)[reference]
    peaks = []
    for w in phases.values():
        spans = spans_of(w) or [(float(w["start"]), float(w["end"]))]
        stats = server_over(series, spans)
        if stats.peak_kv_usage is not None:
            peaks.append(stats.peak_kv_usage)
    return max(peaks) if peaks else None


def why_not(
    mode: str,
    reference: TargetSpec,
    candidate: TargetSpec | None,
    failed: bool,
    peak: float | None,
    needed_usage: float,
    control: bool = True,
) -> str | None:
    """Why the capacity phase does not run (None: it runs). ``mode`` auto runs it only where
    the workload's own load never filled the reference's cache (``peak`` below
    ``needed_usage``); on runs it wherever it can. Without an A/A ``control`` its cell has no
    floor, and is never weighed."""
    if candidate is None:
        return "no candidate to compare"
    if not control:
        return "no A/A control (--no-control): its cell would have no floor to be weighed against"
    if not (reference.is_local and candidate.is_local):
        return (
            "it restarts the servers with a smaller cache, which only local servers (bf16, fp8, "
            "NAME=DIR) can be; sweep --concurrency against remote ones instead"
        )
    if reference.emulated or candidate.emulated:
        return "an emulated FP8 cache has BF16's capacity: there is nothing to measure"
    if failed:
        return "the reference or the candidate did not serve the workload"
    if mode == "auto" and peak is None:
        return "no KV-cache usage was scraped from the reference's server"
    if mode == "auto" and peak is not None and peak >= needed_usage:
        return (
            f"the workload's own load filled the reference's cache (peak KV usage "
            f"{100 * peak:.0f}%): the need is measured already"
        )
    return None


def strided_blocks(
    units: Sequence[Unit], per_block: int, blocks: int
) -> Iterator[tuple[int, int, list[tuple[int, Request]]]]:
    """(k, cycle, requests): ``units`` cycled to ``blocks`` blocks, block j of a cycle every
    (cycle's blocks)-th unit from j, so that each block mixes the trace's lengths."""
    per_cycle = max(1, round(len(units) / max(1, per_block)))
    k = 0
    for cycle in range(math.ceil(blocks / per_cycle)):
        for j in range(per_cycle):
            reqs = [pair for unit in units[j::per_cycle] for pair in unit]
            if reqs:
                yield k, cycle, reqs
                k += 1


def units_needed(concurrency: int) -> int:
    """The trace's first units the phase sends (and holds): what its blocks need at most."""
    return BLOCKS * PER_BLOCK * concurrency


@dataclass(frozen=True)
class Judge:
    """What the stop rule judges with: the run's SLOs (the metric), alpha and threshold."""

    slo: SloSpec | None = None
    alpha: float = 0.05
    threshold: float = 0.05


def stop_record(
    why: str, sent: int, planned: int, elapsed_s: float, limit_s: float, call: str | None
) -> dict[str, Any]:
    """The manifest's ``stop``: why the phase stopped sending (decided, time_limit,
    interrupted, all_blocks), after how many of its planned blocks, and in words (``cause``
    is what an undecided cell names)."""
    cause = {
        "time_limit": f"stopped by its time bound, {limit_s:g} s",
        "interrupted": "interrupted",
    }.get(why, "")
    words = {
        "decided": f"decided after {sent} of {planned} blocks ({call}): the blocks not sent "
        "could not change the call",
        "time_limit": f"stopped by its time bound ({limit_s:g} s) after {sent} of {planned} blocks",
        "interrupted": f"interrupted after {sent} of {planned} blocks",
        "all_blocks": f"all {planned} blocks sent",
    }[why]
    return {
        "why": why,
        "blocks": sent,
        "planned": planned,
        "elapsed_s": round(elapsed_s, 1),
        "time_limit_s": limit_s,
        "call": call,
        "cause": cause,
        "words": words,
    }


@dataclass
class CapacityRun:
    """One capacity phase, given what the workload phases left: each arm's session (its prompt
    counts and token pool: the capacity servers have the same tokenizer)."""

    run_dir: Path
    reference: TargetSpec
    candidate: TargetSpec
    control: TargetSpec | None  # the A/A control: a server of the reference's spec
    arms: Mapping[str, TargetSession]
    plan: Plan
    units: Sequence[Unit]  # the trace's first ``units_needed`` units
    phase: Callable[..., Phase]  # a Phase of the run (trace, buckets, clock...) from these
    progress: Progress
    clock: Clock
    stopping: asyncio.Event
    save: Callable[[dict[str, Any]], None]  # the manifest's capacity block, as it stands
    budget: Callable[[], ErrorBudget] = ErrorBudget  # each arm's, as the run's targets have
    judge: Judge = field(default_factory=Judge)
    time_limit_s: float = 600.0  # the blocks' time, checked between blocks
    timeout_s: float = 600.0
    seed: int = 0
    servers: ServerFactory = field(default_factory=lambda: local_servers(DEFAULT_STARTUP_TIMEOUT_S))
    # A file of the run directory that cannot be written (the run's ``RunStop``: it stops the
    # run, exit 5); None: the writer raises.
    cannot_write: Callable[[RunDirError], None] | None = None

    async def run(self) -> dict[str, Any]:
        """Start both servers, send the blocks, stop them; the manifest's block."""
        where = self.run_dir / CAPACITY_DIR
        shutil.rmtree(where, ignore_errors=True)  # a resume runs the whole phase again
        try:
            (where / "metrics").mkdir(parents=True)
        except OSError as exc:
            raise write_failure(where, exc) from None
        p = self.plan
        block: dict[str, Any] = {
            "status": "running",
            "reason": p.sizing,
            "concurrency": p.concurrency,
            "cache_bytes": p.cache_bytes,
            "max_model_len": p.max_model_len,
            "time_limit_s": self.time_limit_s,
            "servers": {},
            "arms": {},
        }
        servers = [
            self.servers(self._spec(s), where / "servers" / f"{s.name}.log") for s in self._arms()
        ]
        infos: dict[str, dict[str, Any]] = block["servers"]
        for sv in servers:
            infos[sv.spec.name] = {}
        writer = JsonlWriter(where / RESULTS, self.cannot_write)
        try:
            started = await asyncio.gather(
                *(launch(sv, infos[sv.spec.name], lambda: None, self.stopping) for sv in servers)
            )
            self.save(block)
            if all(started):
                await self._serve(servers, block, writer)
        except TargetError as exc:
            block.update(status="failed", reason=str(exc))
        finally:
            writer.close()
            for sv in servers:
                await stop(sv, infos[sv.spec.name])
                infos[sv.spec.name]["log"] = str(sv.log_path.relative_to(self.run_dir))
        if block["status"] == "running":
            block["status"] = "interrupted" if self.stopping.is_set() else "ran"
        self.save(block)
        return block

    def _arms(self) -> list[TargetSpec]:
        """The reference, its control and the candidate: the order of each block's first turn."""
        control = [self.control] if self.control is not None else []
        return [self.reference, *control, self.candidate]

    def _spec(self, spec: TargetSpec) -> TargetSpec:
        env = {k: v for k, v in spec.env.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
        return replace(spec, args=(*spec.args, *self.plan.args()), env=env)

    async def _serve(
        self, servers: Sequence[LocalServer], block: dict[str, Any], writer: JsonlWriter
    ) -> None:
        async with AsyncExitStack() as stack:
            arms = {
                sv.spec.name: await self._session(stack, sv, block["servers"][sv.spec.name])
                for sv in servers
            }
            served = block["servers"][self.reference.name].get("cache_config") or {}
            block["pressure"], problem = self.plan.check(served)
            if problem is not None:
                block.update(status="skipped", reason=problem)
                return
            await self._blocks([s.name for s in self._arms()], arms, block, writer)

    async def _session(
        self, stack: AsyncExitStack, sv: LocalServer, info: dict[str, Any]
    ) -> TargetSession:
        """A capacity server's arm: introspected and checked, scraped into capacity/metrics/."""
        session = await stack.enter_async_context(api_session(sv.spec.auth_headers()))
        info.update(await introspect(session, sv.url))
        served = info["cache_config"].get("cache_dtype")
        check_served_dtype(sv.spec, served, sv.log_text(), info["problems"])
        client = Client(
            sv.url,
            served_model(info),
            timeout_s=self.timeout_s,
            seed=self.seed,
            clock=self.clock.now,
        )
        stack.push_async_callback(client.close)
        series = JsonlWriter(
            self.run_dir / CAPACITY_DIR / "metrics" / f"{sv.spec.name}.jsonl", self.cannot_write
        )
        stack.callback(series.close)
        scraper = Scraper(
            session, sv.url, self.clock.now, lambda s: series.write(s.to_json()), SCRAPE_S
        )
        scraper.start()
        stack.push_async_callback(scraper.stop)
        # The workload's arm of the same name (the control's, or with a shared control the
        # reference's): its prompt counts and token pool.
        arm = self.arms.get(sv.spec.name) or self.arms[self.reference.name]
        return replace(arm, name=sv.spec.name, client=client, budget=self.budget(), scraper=scraper)

    async def _blocks(
        self,
        names: Sequence[str],
        arms: Mapping[str, TargetSession],
        block: dict[str, Any],
        writer: JsonlWriter,
    ) -> None:
        """Every block to every arm in turn (the order rotated by block), as ``interleave``,
        until the stop rule decides, the time bound or an interrupt."""
        plan = list(strided_blocks(self.units, PER_BLOCK * self.plan.concurrency, BLOCKS))
        info: dict[str, dict[str, Any]] = {
            n: {"cache_config": block["servers"][n].get("cache_config", {}), "blocks": []}
            for n in names
        }
        block.update(arms=info, blocks_planned=len(plan))
        for n in names:
            self.progress.phase(n, PHASE, sum(len(reqs) for _, _, reqs in plan))
        loop = CapacityLoop(self.plan.concurrency)
        start, why, call, sent = self.clock.now(), "all_blocks", None, 0
        for k, cycle, reqs in plan:
            ids = {req.id for _, req in reqs}
            turn = k % len(names)
            for n in [*names[turn:], *names[:turn]]:
                if self.stopping.is_set():
                    break
                salt = f"{self.run_dir.name}.{n}.{PHASE}.{cycle}"
                window = await self.phase(
                    target=arms[n], sched=loop, writer=writer, only=ids, requests=reqs, salt=salt
                ).run()
                if window is not None and not window.get("interrupted"):
                    info[n]["blocks"].append([k, window["start"], window["end"]])
            if self.stopping.is_set():
                why = "interrupted"
                break
            sent = k + 1
            call = self._settled(block, names)
            if call is not None and sent < len(plan):
                why = "decided"
                break
            if self.clock.now() - start >= self.time_limit_s and sent < len(plan):
                why = "time_limit"
                break
            self.save(block)
        spent = self.clock.now() - start
        block["stop"] = stop_record(why, sent, len(plan), spent, self.time_limit_s, call)

    def _settled(self, block: Mapping[str, Any], names: Sequence[str]) -> str | None:
        """The stop rule on the blocks so far, read back from the phase's files as the
        analysis reads them."""
        where = self.run_dir / CAPACITY_DIR
        results = list(complete_results(where))
        series = {n: list(complete_rows(where / "metrics" / f"{n}.jsonl")) for n in names}
        control = self.control.name if self.control is not None else None
        roles = (self.reference.name, self.candidate.name, control)
        j = self.judge
        return settled_call(block, results, series, j.slo, roles, j.alpha, j.threshold)
