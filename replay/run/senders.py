"""How a phase is sent: the runner's seam between deciding what to send and sending it.

The runner builds each ``Phase`` (its target, schedule, writer, clock, interrupt) and hands it
to a ``PhaseSender``: ``InProcess`` sends it from this process's event loop; the worker pool
(replay/run/worker_pool.py, ``replay --workers N``) spreads it over load processes. A test may
pass its own, which sends nothing over a socket.
"""

from __future__ import annotations

from typing import Any, Protocol

from replay.run.phase import Phase
from replay.run.run_config import TargetRun
from replay.run.stopping import RunStop


class PhaseSender(Protocol):
    """Sends one phase and returns its window (``start``, ``end``, and ``resumed`` or
    ``interrupted`` where so), or None when it sent nothing. ``run`` is the phase's target
    (its spec and its ``info``, where a sender notes problems); ``stop`` is the run's: a
    sender that loses a part of its load interrupts the run through it."""

    async def send(self, phase: Phase, run: TargetRun, stop: RunStop) -> dict[str, Any] | None: ...


class InProcess:
    """The phase sent from this process (``Phase.run``)."""

    async def send(self, phase: Phase, run: TargetRun, stop: RunStop) -> dict[str, Any] | None:
        return await phase.run()
