"""The worker role: the shard of the current test (``kvc.shard``) and the master's messages
to it, and the step each Locust user repeats (take a granted request, send it, report it)."""

from __future__ import annotations

import logging
from typing import Any

from gevent.event import Event
from locust.env import Environment

from kvc.bridge import AsyncBridge
from kvc.shard import Shard
from replay.locust.messages import RunPlan

log = logging.getLogger("kvcanary")
NO_PLAN_WAIT_S = 30.0


class Worker:
    """The worker role of this process (a worker, or a standalone process): the shard of the
    current test, the master's messages to it, and the users' steps."""

    def __init__(self, env: Environment, bridge: AsyncBridge) -> None:
        self.env, self.bridge = env, bridge
        self.shard: Shard | None = None
        self.planned = Event()  # the first plan has come

    def on_plan(self, environment: Environment, msg: Any, **_: Any) -> None:
        old = self.shard
        if old is not None and not old.done:
            old.stop("cancelled", "not sent: a new test started")
        plan = RunPlan.from_msg(msg.data)
        self.shard = Shard(environment, self.bridge, plan)
        self.planned.set()
        log.info(
            "kvcanary: plan for shard %d/%d (run %s)", plan.shard + 1, plan.shards, plan.run_id
        )

    def _mine(self, msg: Any) -> Shard | None:
        """The shard a message of the master is for (None: an earlier test's)."""
        shard = self.shard
        if shard is None or msg.data.get("run") != shard.plan.run_id:
            return None
        return shard

    def on_phase(self, environment: Environment, msg: Any, **_: Any) -> None:
        if self.shard is not None:
            self.shard.start(str(msg.data["label"]))

    def on_lease(self, environment: Environment, msg: Any, **_: Any) -> None:
        shard = self._mine(msg)
        if shard is not None:
            shard.granted(msg.data.get("seqs") or [], bool(msg.data.get("revoked")))

    def on_adopt(self, environment: Environment, msg: Any, **_: Any) -> None:
        shard = self._mine(msg)
        if shard is not None:
            shard.adopt([int(p) for p in msg.data["positions"]], int(msg.data["from"]))

    def on_stop(self, environment: Environment, msg: Any, **_: Any) -> None:
        self.stop_shard(str(msg.data["kind"]), str(msg.data["reason"]))

    def stop_shard(self, kind: str, reason: str) -> None:
        if self.shard is not None:
            self.shard.stop(kind, reason)

    def close(self) -> None:
        if self.shard is not None:
            self.shard.close()

    def user_step(self) -> bool:
        """One task iteration of a user: take a request, send it, report it. False: this
        user has nothing more to do (test stopping, shard failed, or no plan came)."""
        if self.shard is None and not self.planned.wait(timeout=NO_PLAN_WAIT_S):
            log.warning(
                "kvcanary: no plan from the master (did this worker join after the "
                "test started?); this user stops"
            )
            return False
        shard = self.shard
        assert shard is not None
        item = shard.take()
        if item is None:
            return False
        shard.serve(item)
        return True
