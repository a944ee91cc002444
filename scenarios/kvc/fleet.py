"""The workers of one test as the master sees them.

The master keeps a ledger of who holds which trace requests (``replay.locust.ledger``):
each worker's claims are written down before they are granted, and each result resolves
one. Locust's own view of its workers decides when one is lost: a watcher reads
``runner.clients`` twice a second, and a worker Locust has marked missing (its heartbeats
stopped, ``HEARTBEAT_LIVENESS`` intervals in a row) or no longer lists (it quit) is lost.
What it reported is kept; what it had claimed is recorded as lost, with the reason; what it
never claimed goes to the live workers that have users (``kvc_adopt``), or, with
``--kvc-reassign off``, when the test is stopping or when no worker can take it, is recorded
as unavailable. A lost worker that Locust hears again (it was only cut off) sends what it was
granted, and those answers count; it gets nothing new. Every worker's account (sent,
answered, lost, re-assigned) goes into the run directory (``driver.accounts``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import gevent
from locust.env import Environment
from locust.runners import HEARTBEAT_LIVENESS, STATE_MISSING, MasterRunner, Runner

from kvc.protocol import MSG_ADOPT, MSG_LEASE
from replay.locust.config import Config
from replay.locust.ledger import Account, Ledger, LedgerError
from replay.locust.messages import RunPlan
from replay.locust.recorder import RunRecorder, lost_result

log = logging.getLogger("kvcanary")
WATCH_S = 0.5  # how often the master reads Locust's view of its workers


class Test(Protocol):
    """What the fleet reads of the master's test (``kvc.run.Test``, which holds the fleet)."""

    cfg: Config
    base: RunPlan
    recorder: RunRecorder
    label: str | None
    stopping: bool
    closed: bool

    def now(self) -> float: ...


class Fleet:
    """One test's workers: their ledger, their claims and results, and their loss."""

    def __init__(
        self, env: Environment, test: Test, nodes: Sequence[str], on_change: Callable[[], None]
    ) -> None:
        self.env, self.test, self.on_change = env, test, on_change
        self.ledger = Ledger(test.cfg.trace.count, nodes, test.cfg.loop)
        self.recorded: set[str] = set()  # request ids the run directory has as lost
        self._watcher: gevent.Greenlet | None = None

    @property
    def runner(self) -> Runner:
        assert self.env.runner is not None
        return self.env.runner

    def start(self) -> None:
        """Watch Locust's workers (a master only: a standalone process has none to lose)."""
        if isinstance(self.runner, MasterRunner):
            self._watcher = gevent.spawn(self._watch)

    def _send(self, kind: str, data: dict[str, Any], node: str) -> None:
        runner = self.runner
        if isinstance(runner, MasterRunner):
            runner.send_message(kind, data, client_id=node)
        else:
            runner.send_message(kind, data)

    # claims, results, done -----------------------------------------------------------------
    def on_claim(self, node: str, data: Mapping[str, Any]) -> None:
        """Grant a worker's claim (written down first), or refuse it to a lost worker."""
        shard = int(data["shard"])
        if self.ledger.account(shard) is None:
            log.error(
                "kvcanary: a claim from %s for shard %d, which this test has not", node, shard
            )
            return
        self._heard(shard)
        claims = data.get("claims") or []
        try:
            granted = self.ledger.claim(shard, claims)
        except LedgerError as exc:  # a bug: the worker goes on, without what it claimed
            log.error("kvcanary: internal error: %s", exc)
            granted = False
        self._send(
            MSG_LEASE,
            {
                "run": self.test.base.run_id,
                "shard": shard,
                "seqs": [c[0] for c in claims] if granted else [],
                "revoked": not granted,
            },
            node,
        )

    def on_results(
        self, shard: int, rows: Sequence[dict[str, Any]], seqs: Sequence[int | None] | None
    ) -> list[dict[str, Any]]:
        """A worker's results, counted in its account; the rows to store."""
        self._heard(shard)
        keep = []
        for row, seq in zip(rows, seqs or [None] * len(rows), strict=True):
            came_back = (
                self.ledger.reported(shard, seq, row) if self.ledger.account(shard) else False
            )
            if came_back and row.get("request_id") in self.recorded:
                # Its "lost" row is written already: one row per request, and the run says so.
                why = (
                    f"the result of {row.get('request_id')} (shard {shard + 1}) came back "
                    "after the run directory recorded it as lost; not stored"
                )
                log.warning("kvcanary: %s", why)
                self.test.recorder.info.setdefault("problems", []).append(why)
                continue
            keep.append(row)
        return keep

    def on_done(self, shard: int, adoptions: int) -> None:
        if self.ledger.account(shard) is not None:
            self._heard(shard)
            self.ledger.finish(shard, adoptions)
        self.on_change()

    def _heard(self, shard: int) -> None:
        """A message from a worker given up on: it is back (before Locust's next heartbeat
        says so, maybe)."""
        acc = self.ledger.account(shard)
        if acc is not None and acc.lost is not None and acc.lost.back_at is None:
            self._back(acc, gone=False)

    # loss ------------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self.test.closed:
            gevent.sleep(WATCH_S)
            self.check()

    def check(self) -> None:
        """Locust's view of each worker now: lost ones are given up, returning ones noted."""
        runner = self.runner
        if not isinstance(runner, MasterRunner):
            return
        for acc in self.ledger.accounts:
            node = runner.clients.get(acc.node)
            gone = node is None or node.state == STATE_MISSING
            if acc.lost is None and gone and not acc.done:
                why = (
                    "Locust no longer lists it (it quit)"
                    if node is None
                    else f"Locust marked it missing: no heartbeat for {HEARTBEAT_LIVENESS} s"
                )
                self.lose(acc, why)
            elif acc.lost is not None and not acc.done:
                self._back(acc, gone)

    def _back(self, acc: Account, gone: bool) -> None:
        """A lost worker is heard again, or (``gone``) no longer."""
        if self.ledger.came_back(acc.shard, None if gone else self.test.now()):
            log.warning(
                "kvcanary: worker %s (shard %d) %s",
                acc.node,
                acc.shard + 1,
                "is gone again"
                if gone
                else "is back after it was given up: what it was granted still counts, "
                "nothing new goes to it",
            )
            self.on_change()

    def _can_send(self, acc: Account) -> bool:
        """A live worker with users (one without them would leave re-assigned work waiting)."""
        runner = self.runner
        node = runner.clients.get(acc.node) if isinstance(runner, MasterRunner) else None
        return node is not None and node.state != STATE_MISSING and node.user_count > 0

    def lose(self, acc: Account, reason: str) -> None:
        test = self.test
        why_not = None
        if not test.cfg.reassign:
            why_not = "re-assignment is off (--kvc-reassign off)"
        elif test.stopping or test.closed:
            why_not = "the test was stopping"
        takers = [a.shard for a in self.ledger.live() if a is not acc and self._can_send(a)]
        plan = self.ledger.lose(acc.shard, reason, test.now(), takers, why_not)
        loss = acc.lost
        assert loss is not None
        log.warning(
            "kvcanary: worker %s (shard %d) lost: %s; %d result(s) kept, %d request(s) it "
            "had taken recorded as lost, %d re-assigned to shard(s) %s, %d unavailable",
            acc.node,
            acc.shard + 1,
            reason,
            acc.reported,
            len(loss.open),
            acc.given,
            [s + 1 for s in plan] or "-",
            len(loss.unavailable),
        )
        for shard, positions in plan.items():
            taker = self.ledger.accounts[shard]
            data = {"run": test.base.run_id, "shard": shard, "from": acc.shard}
            self._send(MSG_ADOPT, {**data, "positions": positions}, taker.node)
        self.publish()
        test.recorder.save_manifest()
        self.on_change()

    # the run directory -----------------------------------------------------------------------
    def record_unresolved(self) -> int:
        """Write what lost workers left without a result (lost, unavailable) as results, one
        per request; returns how many."""
        test = self.test
        wanted: dict[int, list[tuple[str | None, str, str]]] = {}
        for position, bucket, kind, reason in self.ledger.unresolved():
            wanted.setdefault(position, []).append((bucket, kind, reason))
        if not wanted:
            return 0
        label, at, rows = test.label or test.cfg.plan.labels[0], test.now(), []
        for i, req in enumerate(test.cfg.trace.iter_requests()):
            for bucket, kind, reason in wanted.get(i, ()):
                res = lost_result(
                    req, test.cfg.spec.name, label, bucket or "unknown", at, kind, reason
                )
                rows.append(res.to_json())
                self.recorded.add(req.id)
        test.recorder.add_results(rows)
        return len(rows)

    def publish(self) -> None:
        """Each worker's account into the run's driver block (a master's: a standalone
        process is one worker that cannot be lost)."""
        if isinstance(self.runner, MasterRunner):
            self.test.recorder.driver["accounts"] = self.ledger.to_json()
