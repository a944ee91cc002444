"""Load shapes for kvcanary's Locust scenario: concurrency sweeps and the trace's own clock.

The schedules themselves are the core's pure plans (``replay.locust.plans``: ``Constant``,
``StepSweep``, ``TraceTimes``); these classes only hand them to Locust. Every shape also ends
the test when the trace is exhausted (unless ``--kvc-loop on``), names each load level as a
phase (``c1``, ``c4``, ... or ``trace-x1``), and tells the workers when a new phase starts.

Selecting a shape:

* command line and web UI: ``--kvc-shape users|step|trace`` (the "kvcanary" parameters of
  the start form), read by ``KvcShape``, which Locust uses by default as the file's first
  shape class;
* web UI with ``--class-picker``: the shape classes ``KvcShape``, ``StepSweep`` and
  ``TraceTimes`` are offered by name.

``users`` is Locust's own ``-u``/``-r`` (and ``--run-time``) as one phase. ``step`` ramps to
each of ``--kvc-levels`` at ``--kvc-ramp`` users/s and holds it ``--kvc-hold`` seconds;
``trace`` keeps ``--kvc-max-in-flight`` users that send each request at its trace timestamp
(gaps times ``--kvc-time-scale``). The time of a shape counts from when every worker has
prepared the trace (token counts for the buckets), so the first level is not eaten by setup.

Locust makes the shape objects; ``locustfile.py`` gives each one the process's ``Master``,
which holds the test the shape ticks for (only a master or standalone process ticks).
"""

from __future__ import annotations

from typing import Any, ClassVar

from locust import LoadTestShape

from kvc.master import Master


class KvcShape(LoadTestShape):
    """The shape named by ``--kvc-shape`` (users, step or trace)."""

    use_common_options = True  # users: -u/-r/--run-time; every shape: --run-time as a cap
    mode: ClassVar[str | None] = None
    master: Master | None = None  # given when the master role is wired (locustfile.py)

    def kvc_mode(self, opts: Any) -> str:
        return self.mode or str(getattr(opts, "kvc_shape", "users"))

    def tick(self) -> tuple[int, float] | None:
        return None if self.master is None else self.master.tick()


class StepSweep(KvcShape):
    """Concurrency sweep: ``--kvc-levels`` in turn, ``--kvc-ramp`` users/s between levels,
    each held ``--kvc-hold`` seconds."""

    use_common_options = False
    mode = "step"


class TraceTimes(KvcShape):
    """The trace's own arrival times (``--kvc-time-scale``), at most ``--kvc-max-in-flight``
    requests in flight."""

    use_common_options = False
    mode = "trace"
