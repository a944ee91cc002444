"""How a run measures, resolved from its options before it starts: the A/A control (every
metric's noise floor), interleaved arms (replay/run/interleave.py) and the capacity phase
(replay/run/capacity_phase.py). Resolved values are saved with the options, so a resume measures the
same way."""

from __future__ import annotations

from collections.abc import Sequence

from replay.analysis.run_spec import CapacitySpec
from replay.cli.common import console
from replay.cli.run_options import RunOptions
from replay.core.errors import InputError
from replay.run.interleave import SERVERS_AT_ONCE
from replay.serving.targets import TargetSpec
from replay.traces.importers import StreamedTrace
from replay.traces.sessions import has_sessions


def resolve_control(o: RunOptions, trace: StreamedTrace) -> RunOptions:
    """Every metric compared needs its noise floor: how far the reference moves from itself
    (derived grades, latency). It costs one more pass of the reference (the README says so).
    Saved resolved: a resume must replay the same arms."""
    if o.control is not None:
        return o
    control = len([t for t in o.targets.split(",") if t.strip()]) > 1
    if control:
        why = (
            f"{trace.unlabeled} request(s) have no check and every latency needs a floor"
            if trace.unlabeled
            else "every latency compared needs a floor"
        )
        console.print(
            f"{why}: the reference is replayed a second time, as its A/A control (a server "
            "of its own when local; --no-control to skip)"
        )
    return o.replace(control=control)


def resolve_interleave(
    o: RunOptions, trace: StreamedTrace, targets: Sequence[TargetSpec]
) -> RunOptions:
    """Interleaved by default when targets are compared (replay/run/interleave.py), except
    where a run cannot be: several load processes, targets run at once each on its own
    schedule, later turns built from the reference's answers (it must answer first), or the
    sequential canary's rounds; and by default not with more local servers than can be held
    at once. Saved resolved: a resume sends the same way."""
    sessions = o.session_history == "reference" and has_sessions(trace.iter_requests())
    blocked = next(
        (
            flag
            for flag, on in (
                ("--sequential", o.sequential),
                ("--workers", o.workers > 1),
                ("--parallel-targets", o.parallel_targets),
                ("--session-history reference", sessions),
            )
            if on
        ),
        None,
    )
    if o.interleave and blocked:
        raise InputError(f"--interleave cannot be combined with {blocked}")
    if o.interleave is not None:
        return o
    local = sum(t.is_local for t in targets)
    if blocked is None and len(targets) > 1 and local > SERVERS_AT_ONCE:
        console.print(
            f"{local} local servers: more than {SERVERS_AT_ONCE} held at once, so targets run "
            "one after another (--interleave to hold them all)"
        )
    return o.replace(interleave=len(targets) > 1 and blocked is None and local <= SERVERS_AT_ONCE)


def capacity_options(o: RunOptions, canary: bool) -> CapacitySpec:
    """``--capacity-phase``: on, off, or by default auto in the canary (where it can run:
    its blocks are sent interleaved; and only where the verdict needs it)."""
    if o.capacity_phase and not o.interleave:
        raise InputError("--capacity-phase sends its blocks interleaved: leave out --no-interleave")
    mode = "on" if o.capacity_phase else "off"
    if o.capacity_phase is None and canary and o.interleave:
        mode = "auto"
    return CapacitySpec(
        mode=mode,
        concurrency=o.capacity_concurrency,
        cache_mib=o.capacity_cache_mib,
        time_limit_s=o.capacity_time_limit,
    )
