"""What the summary needs of a target (an entry of ``Analysis.targets``), from a run's own
record of it or from its manifest entry: its status and why, the cache configuration its
server reported, its phase windows and, for its capacity counted per layer type
(``analysis.layer_capacity``), the folders that may hold its model and its max_model_len."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from replay.run.config import TargetRun


def target_for_summary(
    status: str | None,
    reason: str | None,
    cache_config: Mapping[str, Any] | None,
    phases: Mapping[str, Any],
    *,
    model_dirs: Sequence[str | None] = (),
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """The entry; ``model_dirs``: its spec's model folder, then the root its server reports
    (a URL target's model is known where that folder is here too)."""
    out: dict[str, Any] = {
        "status": status,
        "reason": reason,
        "cache_config": cache_config or {},
        "phases": phases,
    }
    dirs = [d for d in model_dirs if d]
    if dirs:
        out |= {"model_dirs": dirs, "max_model_len": max_model_len}
    return out


def run_for_summary(run: TargetRun) -> dict[str, Any]:
    """The entry of a target of the run in progress."""
    info = run.info
    return target_for_summary(
        run.status,
        run.reason,
        info.get("cache_config"),
        run.phases,
        model_dirs=(run.spec.model, info.get("model_root")),
        max_model_len=info.get("max_model_len"),
    )
