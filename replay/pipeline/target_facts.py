"""What the summary needs of a target (an entry of ``AnalysedRun.targets``), from its manifest
entry: its status and why, the cache configuration its server reported, its phase windows
and, for its capacity counted per layer type (``analysis.layer_capacity``), the folders that
may hold its model and its max_model_len."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


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
