"""The capacity phase's place in an interleaved run (``interleave.Interleaved`` runs it once
the workload's servers stopped): whether it runs, its plan from the workload's answers, and
the phase itself (``capacity.CapacityRun``).

It does not run where it cannot measure (``capacity.why_not``: remote or emulated targets, no
A/A control, a workload that failed or already filled the reference's cache), and, in the
canary's auto mode, where it cannot change the verdict: the run's analysis is asked first
(``pipeline.analyse.quality_verdict``, the stop rule's own steps on the workload's results),
and a verdict the quality side decides alone (CALIBRATE, REJECT, INSUFFICIENT EVIDENCE...)
leaves the phase skipped, "not needed", with that verdict as its reason. ``--capacity-phase``
runs it wherever it can measure.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from replay.analysis.schemas import Verdict
from replay.pipeline.analyse import load_results, quality_verdict
from replay.run.capacity_phase import (
    CapacityRun,
    Judge,
    peak_usage,
    units_needed,
    why_not,
)
from replay.run.capacity_plan import Plan, kv_bytes_per_token, ref_layers, size
from replay.run.order import Run
from replay.run.phase import Phase, TargetSession
from replay.run.progress import Progress
from replay.run.run_config import TargetRun
from replay.traces.sessions import Unit


def not_needed(verdict: Verdict) -> str:
    """The reason a phase skipped for the quality side's verdict gives."""
    return (
        f"not needed: the quality side decided {verdict.headline}, whatever the capacity phase "
        "would measure"
    )


class CapacityStep:
    """The capacity phase of one run: decided, planned and run; its manifest block goes to
    ``save`` as it stands."""

    def __init__(
        self,
        runner: Run,
        arms: Mapping[str, TargetSession],
        units: Callable[[], Iterator[Unit]],
        save: Callable[[dict[str, Any]], None],
        progress: Progress,
    ) -> None:
        self.runner, self.arms, self.units, self.save = runner, arms, units, save
        self.progress = progress  # a block's (the phase's bar is the phase's)

    async def run(self) -> None:
        r = self.runner
        c, cand = r.cfg, r.candidate
        if c.capacity.mode == "off":
            return
        ref_run = r.runs[r.reference]
        cand_run = r.runs.get(cand) if cand else None
        failed = ref_run.status != "ok" or cand_run is None or cand_run.status != "ok"
        peak = peak_usage(c.run_dir, r.reference, ref_run.phases)
        why = why_not(
            c.capacity.mode,
            ref_run.spec,
            cand_run.spec if cand_run else None,
            failed,
            peak,
            c.thresholds.capacity_needed_usage,
            control=r.control is not None,
        )
        plan = why or self._quality_decided() or self._plan(ref_run)
        if isinstance(plan, str):
            self.save({"status": "skipped", "reason": plan})
            return
        assert cand_run is not None
        r.progress.status("capacity phase: starting servers with a smaller KV cache")
        await CapacityRun(
            run_dir=c.run_dir,
            reference=ref_run.spec,
            candidate=cand_run.spec,
            control=r.control.spec if r.control else None,
            arms=self.arms,
            plan=plan,
            units=list(itertools.islice(self.units(), units_needed(c.capacity.concurrency))),
            phase=self._block,
            progress=r.progress,
            clock=r.clock,
            stopping=r.stopping,
            save=self.save,
            budget=r.new_budget,
            judge=Judge(c.slo, c.thresholds.alpha, c.thresholds.systems_threshold),
            time_limit_s=c.capacity.time_limit_s,
            timeout_s=c.load.timeout_s,
            seed=c.load.seed,
            servers=r.servers,
            cannot_write=r.stop.cannot_write,
        ).run()

    def _quality_decided(self) -> str | None:
        """In auto mode, why the phase is not needed: the verdict the quality side decides
        alone (None: whether FP8 pays decides, which the phase measures)."""
        r = self.runner
        if r.cfg.capacity.mode != "auto":
            return None
        r.progress.status("capacity phase: does the verdict need it? (the workload's analysis)")
        verdict = quality_verdict(*r.analysis())
        return not_needed(verdict) if verdict is not None else None

    def _plan(self, ref_run: TargetRun) -> Plan | str:
        r = self.runner
        info = ref_run.info
        results = [
            x for x in load_results(r.cfg.run_dir, prompt_ids=False) if x.target == r.reference
        ]
        max_tokens = {q.id: q.max_tokens for q in r.cfg.trace.iter_requests()}
        per_token = kv_bytes_per_token(ref_run.spec, info.get("cache_config") or {})
        layers = ref_layers(ref_run.spec, info.get("cache_config") or {})
        return size(
            results, max_tokens, per_token, info.get("max_model_len"), r.cfg.capacity, layers
        )

    def _block(self, **kw: Any) -> Phase:
        """A Phase of the capacity phase: the run's trace, buckets, clock and interrupt."""
        r = self.runner
        return Phase(
            trace=r.cfg.trace,
            buckets=r.cfg.buckets,
            progress=self.progress,
            clock=r.clock,
            stopping=r.stopping,
            timeout_s=r.cfg.phase_timeout_s,
            sessions=r.sessions_of(kw["target"].name),
            **kw,
        )
