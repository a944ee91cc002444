"""``run_config``: a ``RunConfig`` for a test, its load named after its targets and schedules."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from replay.run.config import RunConfig, load_for
from replay.run.phase import Schedule
from replay.serving.targets import TargetSpec


def run_config(
    *,
    targets: Sequence[TargetSpec],
    schedules: Sequence[Schedule],
    load: Mapping[str, Any] | None = None,
    **kw: Any,
) -> RunConfig:
    """``load``: the ``LoadSpec`` settings that differ from their defaults (timeouts, seed,
    parallel targets); ``kw``: the rest of the ``RunConfig``."""
    return RunConfig(
        targets=targets,
        schedules=schedules,
        load=load_for(targets, schedules, **(load or {})),
        **kw,
    )
