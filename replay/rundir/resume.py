"""What an earlier process of a run finished, so ``--resume`` sends only the rest.

The rule is read from the manifest's phase windows, not from error texts: a phase the manifest
records as ended (without ``interrupted``) is final, cancelled results included (a phase time
limit cancels what it cut short, and a second try would measure another phase). A phase that
was interrupted, or that a killed process never recorded, resends what it cancelled."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replay.core.records import Result
from replay.rundir.files import (
    RESULTS,
    TEACHER_FORCED,
    read_jsonl,
    read_results,
    repair_jsonl,
    rewrite_jsonl,
)
from replay.rundir.manifest import written_targets
from replay.rundir.shard_files import merge_leftovers


@dataclass
class ResumeState:
    # request ids with a final result, by (target, phase)
    done: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    # (target, request id) pairs already scored teacher-forced
    tf_done: set[tuple[str, str]] = field(default_factory=set)
    # the earlier manifest's targets, by name
    previous: dict[str, Any] = field(default_factory=dict)
    # what resuming did, for the manifest's "resumed"
    note: dict[str, Any] = field(default_factory=dict)

    def finished(self, target: str, phase: str) -> set[str]:
        return self.done.get((target, phase), set())

    @classmethod
    def load(cls, run_dir: Path) -> ResumeState:
        """Repair what a crash cut short and read what an earlier process of this run wrote;
        results that will be sent again are removed from results.jsonl."""
        state = cls()
        state.previous = written_targets(run_dir)
        # --workers: what the load processes of a killed run wrote joins results.jsonl first.
        merged = merge_leftovers(run_dir)
        dropped = repair_jsonl(run_dir / RESULTS)
        kept, redo = [], 0
        for r in read_results(run_dir):
            if not keep_result(r, state):
                redo += 1  # cut short by the interrupt: it will be sent again
                continue
            kept.append(r.to_json())
            state.done.setdefault((r.target, r.phase), set()).add(r.request_id)
        rewrite_jsonl(run_dir / RESULTS, kept)
        tf_dropped = repair_jsonl(run_dir / TEACHER_FORCED)
        for row in read_jsonl(run_dir / TEACHER_FORCED):
            state.tf_done.add((row["target"], row["request_id"]))
        state.note = {
            "kept_results": len(kept),
            "resent_interrupted": redo,
            "repaired_bytes": dropped + tf_dropped,
            **({"merged_worker_rows": merged} if merged else {}),
        }
        return state

    def phase_ended(self, target: str, phase: str) -> bool:
        """The earlier process closed this phase of this target without an interrupt."""
        target_info = self.previous.get(target)
        phases = target_info.get("phases") if isinstance(target_info, dict) else None
        window = phases.get(phase) if isinstance(phases, dict) else None
        return isinstance(window, dict) and not window.get("interrupted")

    def restore(self, name: str) -> tuple[str, str | None, dict[str, Any], dict[str, Any]]:
        """A target the earlier process completed: its status, reason, phases and info. One
        still ``pending`` there has every result it needs, and the process ended (a kill, a full
        disk) before it could say so: it served the run."""
        prev = dict(self.previous.get(name) or {})
        status, reason = prev.pop("status", "ok"), prev.pop("reason", None)
        if status == "pending":
            status = "ok"
        phases = prev.pop("phases", {}) or {}
        prev.pop("spec", None)
        return status, reason, phases, prev


def keep_result(r: Result, state: ResumeState) -> bool:
    """Whether an earlier result stands, or its request is sent again."""
    return r.status != "cancelled" or state.phase_ended(r.target, r.phase)
