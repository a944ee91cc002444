"""The composition root of a run: which flags go together (refused before a run directory is
made), and the runner they give, with its clock, its phase sender, its order
(replay/run/order.py's ``RunOrder``) and its local servers' factory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from replay.cli.run_options import RunOptions
from replay.core.errors import InputError
from replay.core.schedule import ClosedLoop, MonotonicClock
from replay.run.interleave import Interleaved
from replay.run.phase import Schedule
from replay.run.progress import Progress
from replay.run.run_config import RunConfig
from replay.run.runner import Runner
from replay.run.servers import local_servers
from replay.run.worker_pool import WorkerPoolSender, check_workers

# --quality-pass serial: the phase whose answers are graded, one request at a time.
SERIAL_PHASE = "c1"


def refuse_combinations(o: RunOptions, schedules: Sequence[Schedule]) -> None:
    """The flags that do not go together (--interleave's are resolved with it, in
    replay/cli/measuring.py)."""
    if o.quality_pass == "serial" and o.sequential:
        raise InputError(
            "--quality-pass serial and --sequential: the sequential canary sends its own "
            "rounds; leave one out"
        )
    check_workers(o.workers, schedules, o.session_history)
    if o.sequential and o.workers > 1:
        raise InputError("--sequential sends its rounds from one process: leave out --workers")
    if o.sequential and (o.rate is not None or o.trace_times):
        raise InputError("--sequential sends closed-loop rounds: leave out --rate/--trace-times")


def compose(cfg: RunConfig, progress: Progress) -> Runner:
    """The runner of ``cfg``'s spec, with its clock and its local servers' factory: over
    --workers load processes, in interleaved blocks, the sequential canary's rounds (on the
    first --concurrency), or one target after another."""
    clock = MonotonicClock()
    given: dict[str, Any] = {"clock": clock, "servers": local_servers(cfg.startup_timeout_s)}
    if cfg.load.workers > 1:
        return Runner(cfg, progress, sender=WorkerPoolSender(cfg, clock), **given)
    if cfg.load.interleave:
        return Runner(cfg, progress, order=Interleaved(), **given)
    seq = cfg.spec.sequential
    if seq is None:
        return Runner(cfg, progress, **given)
    from replay.run.sequential_run import RoundLoop, Rounds

    first = cfg.schedules[0]
    assert isinstance(first, ClosedLoop)  # refuse_combinations: no open loop
    loop = RoundLoop(first.concurrency)
    return Runner(cfg.with_schedules([loop]), progress, order=Rounds(seq), **given)
