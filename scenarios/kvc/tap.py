"""The master's view of the target: its introspection (for the manifest) and its /metrics,
scraped about once a second and at each phase edge (``replay.locust.target.MetricsTap``).

The target may be one only the workers reach (a server on the load generators' network, not
the master's): the master's own introspection then says it is unreachable, nothing is
scraped (there is nothing to scrape from here), and the run directory takes the
introspection of the first worker that prepared its shard, saying so among its problems.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from kvc.bridge import AsyncBridge
from kvc.run import Test
from replay.core.errors import KvcanaryError
from replay.locust.target import MetricsTap

log = logging.getLogger("kvcanary")
SCRAPE_WAIT_S = 5.0  # a phase-edge /metrics scrape; past it the point is a gap, not a stall
# Why the target cannot be introspected or scraped: a recorded problem of the run (the
# core wraps most of these in KvcanaryError; a few arrive raw). Anything else is a bug.
TAP_FAILS = (KvcanaryError, OSError, aiohttp.ClientError, TimeoutError)


def start_tap(bridge: AsyncBridge, test: Test) -> None:
    tap = MetricsTap(test.cfg.spec, test.now, test.recorder.add_snapshot)
    try:
        info = bridge.call(tap.start(), timeout=60)
    except TAP_FAILS as exc:
        test.recorder.info.setdefault("problems", []).append(f"introspection: {exc!r}")
        return
    if info.get("unreachable"):
        bridge.call(tap.stop(), timeout=30)
        # What the master saw, until a worker says more (the problems copied: the run adds
        # its own to the recorder's list).
        test.recorder.info.update({**info, "problems": list(info.get("problems") or [])})
        test.master_unreachable = info
        worker_info(test, test.worker_info)
        test.recorder.save_manifest()
        return
    test.recorder.info.update(info)
    if test.closed:  # the test ended while the target was being introspected
        bridge.call(tap.stop(), timeout=30)
        return
    test.tap = tap
    test.recorder.save_manifest()


def worker_info(test: Test, info: Mapping[str, Any] | None) -> None:
    """A worker's introspection of the target (in its ready message), used when the master
    cannot reach the target itself; kept until the master knows whether it can."""
    if info is None:
        return
    if test.worker_info is None:
        test.worker_info = dict(info)
    mine = test.master_unreachable
    if mine is None or test.recorder.info.get("model_id"):
        return
    seen = list(mine.get("problems") or [])
    why = seen[0] if seen else "unreachable"
    problems = [
        *(p for p in test.recorder.info.get("problems") or [] if p not in seen),
        *(info.get("problems") or []),
        f"the master cannot reach the target ({why}): its introspection is a worker's, "
        "and no /metrics were scraped",
    ]
    test.recorder.info.pop("unreachable", None)  # the workers reach it
    test.recorder.info.update({**info, "problems": problems})
    test.recorder.save_manifest()
    log.warning("kvcanary: the master cannot reach the target; introspection from a worker")


def scrape(bridge: AsyncBridge, test: Test) -> None:
    """One /metrics point now. The tap's loop scrapes about once a second, so a phase
    shorter than that (a fast machine) would otherwise have no point inside its window;
    a failed scrape is counted by the tap, never an error of the run."""
    if test.tap is None:
        return
    try:
        bridge.call(test.tap.scrape_once(), timeout=SCRAPE_WAIT_S)
    except TimeoutError as exc:
        log.warning("kvcanary: metrics: %s", exc)


def stop_tap(bridge: AsyncBridge, test: Test) -> None:
    """Stopped before the phase closes: the tap's last scrape falls inside the window,
    so counter deltas cover the whole phase however short it was."""
    if test.tap is None:
        return
    tap, test.tap = test.tap, None
    try:
        test.recorder.info["scrape_failures"] = bridge.call(tap.stop(), timeout=30)
    except (OSError, aiohttp.ClientError, TimeoutError) as exc:
        log.warning("kvcanary: metrics: %r", exc)  # the series is complete without it
