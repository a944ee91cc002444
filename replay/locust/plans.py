"""Load plans (how many Locust users, over time, as pure functions of time) and sharding
(which trace requests one worker sends)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from replay.core.errors import ConfigError
from replay.traces.trace import Request


@dataclass(frozen=True)
class Tick:
    """What the load should be now: Locust's (user_count, spawn_rate), and the phase label
    results get (``c4`` for four users in a closed loop, as ``replay --concurrency 4``)."""

    users: int
    spawn_rate: float
    label: str


class LoadPlan(Protocol):
    @property
    def labels(self) -> list[str]: ...

    def load_fields(self) -> dict[str, Any]:
        """What the phases are made of, as the run spec's ``LoadSpec`` fields that say it
        (the CLI's --concurrency, or --trace-times with its scale and cap)."""
        ...

    def tick(self, t: float) -> Tick | None:
        """The load ``t`` seconds after the trace is ready; None when the run is over."""
        ...


def _positive(value: float, what: str) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{what} must be a positive number, got {value!r}")
    return value


def parse_levels(text: str) -> tuple[int, ...]:
    """``"1,4,16"`` -> (1, 4, 16): distinct positive user counts, in the order given."""
    try:
        levels = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ConfigError(
            f"--kvc-levels: '{text}' is not a list of integers (e.g. 1,4,16)"
        ) from None
    if not levels or any(v < 1 for v in levels):
        raise ConfigError(f"--kvc-levels: give positive user counts, e.g. 1,4,16 (got '{text}')")
    if len(set(levels)) != len(levels):
        raise ConfigError(f"--kvc-levels: each level once, please (got '{text}')")
    return levels


@dataclass(frozen=True)
class Constant:
    """Locust's own ``-u/-r``: a fixed number of users until ``run_time_s`` (None: until the
    trace is exhausted)."""

    users: int
    spawn_rate: float
    run_time_s: float | None = None

    def __post_init__(self) -> None:
        if self.users < 1:
            raise ConfigError(f"users must be at least 1, got {self.users}")
        _positive(self.spawn_rate, "spawn rate")

    @property
    def labels(self) -> list[str]:
        return [f"c{self.users}"]

    def load_fields(self) -> dict[str, Any]:
        return {"concurrency": str(self.users)}

    def tick(self, t: float) -> Tick | None:
        if self.run_time_s is not None and t >= self.run_time_s:
            return None
        return Tick(self.users, self.spawn_rate, self.labels[0])


@dataclass(frozen=True)
class StepSweep:
    """Concurrency levels in turn. Level k ramps from the previous level at ``ramp`` users/s,
    then holds ``hold_s`` seconds; the sweep ends after its last level. Each level is a phase
    (``c1``, ``c4``, ...), as ``replay --concurrency 1,4,...`` names them."""

    levels: tuple[int, ...]
    hold_s: float
    ramp: float
    run_time_s: float | None = None

    def __post_init__(self) -> None:
        parse_levels(",".join(map(str, self.levels)))
        _positive(self.hold_s, "--kvc-hold")
        _positive(self.ramp, "--kvc-ramp")

    @property
    def labels(self) -> list[str]:
        return [f"c{n}" for n in self.levels]

    def load_fields(self) -> dict[str, Any]:
        return {"concurrency": ",".join(map(str, self.levels))}

    def ends(self) -> list[float]:
        """When each level ends, seconds from the start."""
        out, t, prev = [], 0.0, 0
        for n in self.levels:
            t += abs(n - prev) / self.ramp + self.hold_s
            out.append(t)
            prev = n
        return out

    def tick(self, t: float) -> Tick | None:
        if self.run_time_s is not None and t >= self.run_time_s:
            return None
        for n, end in zip(self.levels, self.ends(), strict=True):
            if t < end:
                return Tick(n, self.ramp, f"c{n}")
        return None


@dataclass(frozen=True)
class TraceTimes:
    """Open loop at the trace's own timestamps (gaps times ``time_scale``). Users send each
    request at its due time; the plan keeps ``max_in_flight`` users, so at most that many
    requests are open at once. A request that finds every user busy keeps its due time as
    ``scheduled``, so the wait shows as queue delay (as ``replay --trace-times
    --max-in-flight``)."""

    max_in_flight: int
    time_scale: float = 1.0
    spawn_rate: float = 100.0
    run_time_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ConfigError(f"--kvc-max-in-flight must be at least 1, got {self.max_in_flight}")
        _positive(self.time_scale, "--kvc-time-scale")
        _positive(self.spawn_rate, "spawn rate")

    @property
    def labels(self) -> list[str]:
        return [f"trace-x{self.time_scale:g}"]

    def load_fields(self) -> dict[str, Any]:
        return {
            "trace_times": True,
            "time_scale": self.time_scale,
            "max_in_flight": self.max_in_flight,
        }

    def tick(self, t: float) -> Tick | None:
        if self.run_time_s is not None and t >= self.run_time_s:
            return None
        return Tick(self.max_in_flight, self.spawn_rate, self.labels[0])


# -- sharding ---------------------------------------------------------------------------------


def shard_indices(n: int, index: int, count: int) -> range:
    """Trace positions worker ``index`` of ``count`` sends: ``i % count == index``. Over all
    workers every position appears exactly once, and the split depends on nothing else."""
    _check_shard(index, count)
    return range(index, n, count)


def _check_shard(index: int, count: int) -> None:
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard {index} of {count} does not exist")


@dataclass
class TraceShard:
    """One worker's part of the trace: its ``(position, request)`` pairs, in trace order, and
    the earliest timestamp of the whole trace replayed (the zero of the trace's clock, which
    every shard must share for their due times to agree)."""

    items: list[tuple[int, Request]]
    t0: float


def read_shard(requests: Iterable[Request], index: int, count: int) -> TraceShard:
    """Worker ``index`` of ``count``'s requests (``shard_indices``' positions), kept as the
    trace streams past: the other shards' requests are read and dropped, never held."""
    _check_shard(index, count)
    items: list[tuple[int, Request]] = []
    t0: float | None = None
    for i, req in enumerate(requests):
        if req.t is not None and (t0 is None or req.t < t0):
            t0 = req.t
        if i % count == index:
            items.append((i, req))
    return TraceShard(items, 0.0 if t0 is None else t0)
