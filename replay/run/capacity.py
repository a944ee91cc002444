"""The capacity phase: does FP8's larger cache turn into requests per second on this machine?

FP8's point is a cache twice as large, which a light replay never touches. This phase measures
it: the reference and the candidate are started again with the same, smaller KV-cache memory
(``--kv-cache-memory-bytes``, stated in the manifest; VLLM_CPU_KVCACHE_SPACE is left out,
since vLLM CPU would take it instead), sized so that the reference holds ``HOLDS`` of
``concurrency`` requests of the workload's median length (and at least its longest; each
layer counted by its attention type where the model's config.json says, ``RefLayers``), and
loaded with a closed loop of ``concurrency``. The reference's cache then fills and it queues
or preempts, while the candidate's, at the same bytes, holds what its dtype gives it. The
servers run at once (the A/A control on a third, of the reference's spec) and are sent the
same blocks in turn, as ``interleave`` sends a phase; the trace is cycled to give ``BLOCKS``
blocks, each cycle under its own cache salt, each block a stride of the trace so that every
block mixes its lengths (only the trace's first ``units_needed`` units are used, and held).

The manifest's ``capacity`` block says what ran, or why it did not (remote targets cannot be
restarted with a smaller cache; a workload that fills the reference's cache already shows the
need), and the phase's files are ``capacity/results.jsonl``, ``capacity/metrics/`` and
``capacity/servers/``. ``analysis.capacity`` reads them: was the reference's cache full, and
what did each arm serve within the SLOs there.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from replay.analysis.summary import server_over, spans_of
from replay.analysis.systems_cells import CAPACITY as PHASE
from replay.core.errors import KvcanaryError, RunDirError, TargetError
from replay.core.records import Result
from replay.core.schedule import ClosedLoop, MonotonicClock
from replay.run.analyze import read_series
from replay.run.budget import ErrorBudget
from replay.run.config import CapacityOptions, RunConfig
from replay.run.manifest import read_manifest
from replay.run.phase import Phase, TargetSession
from replay.run.progress import Progress
from replay.run.rundir import (
    CAPACITY_DIR,
    RESULTS,
    JsonlWriter,
    write_failure,
)
from replay.run.servers import launch, stop
from replay.serving import kv_formats
from replay.serving.client import Client
from replay.serving.endpoints import api_session
from replay.serving.introspect import introspect, served_model
from replay.serving.kv_layout import Engine, KvLayout
from replay.serving.kv_served import skip_words
from replay.serving.local_server import DEFAULT_KV_CACHE_GIB, KV_CACHE_BYTES_FLAG, LocalServer
from replay.serving.metrics import Scraper
from replay.serving.targets import TargetSpec, check_served_dtype
from replay.traces.sessions import Unit
from replay.traces.trace import Request

MIB, GIB = 1 << 20, 1 << 30
BLOCKS = 24  # blocks per arm: the sign interval of 24 at alpha / 2 reaches from d(7) to d(18)
PER_BLOCK = 2  # a block is this many times the concurrency
# The reference's cache holds this share of the concurrency's requests of median length, so
# that it queues; the candidate's, at twice the tokens, holds them all with room to spare.
HOLDS = 0.6
MARGIN_TOKENS = 512  # the cache holds the longest request and this much more


@dataclass(frozen=True)
class CapacityLoop(ClosedLoop):
    """A closed loop whose phase is the capacity phase's."""

    @property
    def label(self) -> str:
        return PHASE


@dataclass(frozen=True)
class Plan:
    """The capacity servers' cache and model length, and how they were sized (in words)."""

    concurrency: int
    cache_bytes: int
    max_model_len: int
    sizing: str

    def args(self) -> tuple[str, ...]:
        return (
            KV_CACHE_BYTES_FLAG,
            str(self.cache_bytes),
            "--max-model-len",
            str(self.max_model_len),
        )


def kv_bytes_per_token(spec: TargetSpec, cache_config: Mapping[str, Any]) -> float | None:
    """The reference's cache bytes over its tokens: from the memory its server was given
    (``--kv-cache-memory-bytes``, else VLLM_CPU_KVCACHE_SPACE as kvcanary starts it)."""
    try:
        tokens = float(cache_config.get("kv_cache_size_tokens") or 0)
    except (TypeError, ValueError):
        return None
    args = list(spec.args)
    if tokens <= 0:
        return None
    if KV_CACHE_BYTES_FLAG in args[:-1]:
        return float(args[args.index(KV_CACHE_BYTES_FLAG) + 1]) / tokens
    gib = spec.env.get("VLLM_CPU_KVCACHE_SPACE") or os.environ.get(
        "VLLM_CPU_KVCACHE_SPACE", DEFAULT_KV_CACHE_GIB
    )
    return float(gib) * GIB / tokens if gib.strip().isdigit() else None


@dataclass(frozen=True)
class RefLayers:
    """The reference's cache per layer type: its model's layout, its served format, the
    layers it keeps in BF16 and its engine's block size (``serving.kv_layout``)."""

    layout: KvLayout
    fmt: str = "auto"
    skip: tuple[int, ...] = ()
    engine: Engine = field(default_factory=Engine)

    def request_bytes(self, tokens: int) -> float:
        return self.layout.request_bytes(tokens, self.fmt, self.skip, self.engine)

    def describe(self) -> str:
        windows = [w for w in self.layout.windows if w is not None]
        if not windows:
            return f"all {self.layout.layers} layers attend in full"
        return f"{len(windows)} of {self.layout.layers} layers slide over {max(windows)} tokens"


def ref_layers(spec: TargetSpec, cache_config: Mapping[str, Any]) -> RefLayers | None:
    """The reference's layers, where its model folder has a config.json and its served
    format's layout is modelled; None: size from bytes per token."""
    layout = KvLayout.of_model(spec.model)
    fmt = str(cache_config.get("cache_dtype") or spec.kv_cache_dtype or "auto")
    known = kv_formats.FORMATS.get(fmt)
    if layout is None or known is None or known.family == "other":
        return None
    skip = layout.skip_indices(skip_words(cache_config.get("kv_cache_dtype_skip_layers")))
    try:
        block = int(cache_config.get("block_size") or 0)
    except (TypeError, ValueError):
        block = 0
    return RefLayers(layout, fmt, skip, Engine(block_size=block) if block > 0 else Engine())


def size(
    results: Sequence[Result],
    max_tokens: Mapping[str, int],
    per_token: float | None,
    served_max_len: int | None,
    opts: CapacityOptions,
    layers: RefLayers | None = None,
) -> Plan | str:
    """The capacity servers' plan from the reference's workload answers, or why none. With
    the reference's ``layers``, a request's cache is counted per layer type: bytes per token
    (cache over kv_cache_size_tokens, a figure taken at max_model_len) undercount a hybrid
    model's request at any shorter length, its sliding-window layers holding their window
    (and whole blocks) whatever the length: 4.6x at 2,000 tokens for Gemma 3 270M."""
    ok = [r for r in results if r.status == "ok" and r.prompt_tokens is not None]
    if not ok:
        return "the reference answered no request to size the cache from"
    median = float(np.median([float(r.prompt_tokens or 0) + r.output_tokens for r in ok]))
    longest = max(
        int(r.prompt_tokens or 0) + max_tokens.get(r.request_id, r.output_tokens) for r in ok
    )
    tokens = max(math.ceil(HOLDS * opts.concurrency * median), longest + MARGIN_TOKENS)
    if opts.cache_mib > 0:
        cache, how = opts.cache_mib * MIB, f"--capacity-cache-mib {opts.cache_mib}"
    elif layers is not None:
        each = layers.request_bytes(math.ceil(median))
        need = max(HOLDS * opts.concurrency * each, layers.request_bytes(longest + MARGIN_TOKENS))
        cache = math.ceil(need / MIB) * MIB
        how = (
            f"sized per layer type ({layers.describe()}) for the reference to hold "
            f"{HOLDS * opts.concurrency:g} requests of the workload's median {median:.0f} tokens "
            f"({each / MIB:.1f} MiB each) and its longest, {longest}"
        )
    elif per_token is None:
        return (
            "the reference's bytes per cached token are unknown (not a CPU server kvcanary "
            "started); give --capacity-cache-mib"
        )
    else:
        cache = math.ceil(tokens * per_token / MIB) * MIB
        how = (
            f"sized for the reference to hold {HOLDS * opts.concurrency:g} requests of the "
            f"workload's median {median:.0f} tokens (and its longest, {longest}) at "
            f"{per_token:.0f} bytes a token"
        )
    length = min(longest, served_max_len or longest)
    return Plan(opts.concurrency, cache, length, how)


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
) -> str | None:
    """Why the capacity phase does not run (None: it runs). ``mode`` auto runs it only where
    the workload's own load never filled the reference's cache (``peak`` below
    ``needed_usage``); on runs it wherever it can."""
    if candidate is None:
        return "no candidate to compare"
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
    clock: MonotonicClock
    stopping: asyncio.Event
    save: Callable[[dict[str, Any]], None]  # the manifest's capacity block, as it stands
    budget: Callable[[], ErrorBudget] = ErrorBudget  # each arm's, as the run's targets have
    timeout_s: float = 600.0
    seed: int = 0
    startup_timeout_s: float = 900.0
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
            "servers": {},
            "arms": {},
        }
        servers = [
            LocalServer(
                self._spec(s),
                where / "servers" / f"{s.name}.log",
                startup_timeout_s=self.startup_timeout_s,
            )
            for s in self._arms()
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
            epoch=self.clock.epoch,
        )
        stack.push_async_callback(client.close)
        series = JsonlWriter(
            self.run_dir / CAPACITY_DIR / "metrics" / f"{sv.spec.name}.jsonl", self.cannot_write
        )
        stack.callback(series.close)
        scraper = Scraper(session, sv.url, self.clock.now, lambda s: series.write(s.to_json()))
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
        """Every block to every arm in turn (the order rotated by block), as ``interleave``."""
        plan = list(strided_blocks(self.units, PER_BLOCK * self.plan.concurrency, BLOCKS))
        info: dict[str, dict[str, Any]] = {
            n: {"cache_config": block["servers"][n].get("cache_config", {}), "blocks": []}
            for n in names
        }
        block["arms"] = info
        for n in names:
            self.progress.phase(n, PHASE, sum(len(reqs) for _, _, reqs in plan))
        loop = CapacityLoop(self.plan.concurrency)
        for k, cycle, reqs in plan:
            ids = {req.id for _, req in reqs}
            turn = k % len(names)
            for n in [*names[turn:], *names[:turn]]:
                if self.stopping.is_set():
                    return
                salt = f"{self.run_dir.name}.{n}.{PHASE}.{cycle}"
                window = await self.phase(
                    target=arms[n], sched=loop, writer=writer, only=ids, requests=reqs, salt=salt
                ).run()
                if window is not None and not window.get("interrupted"):
                    info[n]["blocks"].append([k, window["start"], window["end"]])
            self.save(block)
