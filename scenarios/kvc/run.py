"""One test as the master holds it: the ``Test`` (its state between start and run
directory), the ``RunPlan`` every worker gets and the ``RunRecorder`` that writes the run
directory, made from the test's ``Config``."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gevent.event import Event
from locust import __version__ as locust_version

from replay.analysis.run_spec import RunSpec
from replay.locust.config import Config
from replay.locust.messages import RunPlan, target_message
from replay.locust.recorder import RunRecorder
from replay.locust.target import MetricsTap

if TYPE_CHECKING:
    from kvc.fleet import Fleet


@dataclass
class Test:
    cfg: Config
    base: RunPlan
    recorder: RunRecorder
    shards: int
    epoch: float
    ready: dict[int, str | None] = field(default_factory=dict)
    internal: dict[int, tuple[str, str]] = field(default_factory=dict)  # node, traceback
    fleet: Fleet | None = None  # its workers: who holds which requests (set at the start)
    go_at: float | None = None
    label: str | None = None
    failed: str | None = None
    stopping: bool = False
    closed: bool = False
    late: bool = False
    finished: Event = field(default_factory=Event)
    ending: bool = False  # an end() is under way (it waits, so another greenlet may run)
    ended: Event = field(default_factory=Event)  # end() has written the run directory
    tap: MetricsTap | None = None
    # The target as the master saw it when it could not reach it, and as the first worker
    # did (``kvc.tap``: a target only the workers reach).
    master_unreachable: dict[str, Any] | None = None
    worker_info: dict[str, Any] | None = None

    def now(self) -> float:
        return time.perf_counter() - self.epoch


def run_plan(cfg: Config, run_dir: Path, epoch_wall: float, shards: int) -> RunPlan:
    """What every worker is told (each with its own ``shard``)."""
    return RunPlan(
        run=cfg.run_spec(run_dir, shards),
        target=target_message(cfg.spec),
        mode=cfg.mode,
        time_scale=cfg.time_scale,
        itl_events=cfg.itl_events,
        epoch_wall=epoch_wall,
        limit=cfg.limit,
    )


def recorder(
    cfg: Config,
    opts: Any,
    run_dir: Path,
    driver: dict[str, Any],
    spec: RunSpec,
) -> RunRecorder:
    """The run directory's writer, with the manifest's options and ``spec``, and ``driver``
    (the Locust process that ran the test)."""
    return RunRecorder(
        run_dir=run_dir,
        trace=cfg.trace,
        run_spec=spec,
        spec=cfg.spec,
        # What the run spec does not hold: the Locust test's own shape and pacing.
        options={
            "driver": "locust",
            "shape": cfg.mode,
            "limit": cfg.limit,
            "time_scale": cfg.time_scale,
            "levels": str(opts.kvc_levels),
            "hold_s": float(opts.kvc_hold),
            "ramp": float(opts.kvc_ramp),
            "max_in_flight": int(opts.kvc_max_in_flight),
            "itl_events": cfg.itl_events,
            "reassign": cfg.reassign,
        },
        driver={"name": "locust", "version": locust_version, **driver},
        command=list(sys.argv),
        max_results=cfg.max_results,
    )
