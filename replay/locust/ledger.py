"""Who holds which trace requests in a distributed test, as the master keeps it (plain data,
no Locust): one ``Account`` per worker, and what a lost worker leaves behind.

A worker sends only requests it has *claimed* and the master has granted: the master writes a
claim down before it answers it, so it knows at every moment which requests a worker may have
sent. When a worker is lost (Locust stops hearing its heartbeat, or no longer lists it):

* the results it reported are kept;
* the requests it had claimed and not reported are *lost*: they may have reached the target,
  their answers never came back (one that does come back later, from a worker that was only
  cut off, is answered after all);
* the requests it never claimed were never sent, so they go to the live workers
  (*re-assigned*: no request reaches the target twice), or, with re-assignment off or no
  worker left to take them, are *unavailable*.

Positions are places in the trace as the test reads it (``--kvc-limit`` applied), ``0..n-1``;
worker ``k`` of ``s`` starts with ``range(k, n, s)`` (``plans.shard_indices``) and appends
what it adopts, in the order the master re-assigned it. Claims and results carry the worker's
``seq`` (one per request taken, across passes of a looping test).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# What a lost worker leaves without a result: the request's position, its bucket when known
# (None: the worker never said), the kind recorded and why.
Unresolved = tuple[int, str | None, str, str]


class LedgerError(RuntimeError):
    """A worker's claim that does not follow its list: a bug in kvcanary, not the user's
    input nor the target's, so it stands outside kvcanary's error tree."""


@dataclass
class Loss:
    """How a worker was lost and what it left."""

    reason: str
    at: float  # on the run's clock
    # seq -> (position, bucket): claimed, no result when it was lost, none since.
    open: dict[int, tuple[int, str]] = field(default_factory=dict)
    unavailable: list[int] = field(default_factory=list)  # never sent, not re-assigned
    unavailable_reason: str = ""
    back_at: float | None = None  # Locust hears it again (it was only cut off)
    answered_late: int = 0  # lost requests whose results came back after all


@dataclass
class Account:
    """One worker's part of the test: the requests it is to send and what became of them."""

    shard: int
    node: str  # Locust's client id of the worker process
    base: range
    adopted: list[int] = field(default_factory=list)  # re-assigned to it, in order
    adopted_from: dict[int, int] = field(default_factory=dict)  # shard -> requests
    claimed: int = 0  # of its list (first pass), the prefix claimed so far
    open: dict[int, tuple[int, str]] = field(default_factory=dict)  # seq -> position, bucket
    reported: int = 0  # results it reported
    sent: int = 0  # of them, requests that went to the target
    answered: int = 0  # of them, answers (status ok)
    adoptions: int = 0  # re-assignments sent to it: its "done" counts after the last one
    done: bool = False
    given: int = 0  # its requests re-assigned to other workers
    lost: Loss | None = None

    @property
    def size(self) -> int:
        return len(self.base) + len(self.adopted)

    def position(self, j: int) -> int:
        """The trace position of the ``j``-th request of its list."""
        n = len(self.base)
        return self.base[j] if j < n else self.adopted[j - n]

    def positions(self, start: int = 0) -> list[int]:
        return [self.position(j) for j in range(start, self.size)]

    def to_json(self) -> dict[str, Any]:
        """Its line in the run's accounting (``driver.accounts`` in the manifest and summary)."""
        loss = self.lost
        return {
            "shard": self.shard,
            "node": self.node,
            "status": "lost" if loss else ("done" if self.done else "stopped"),
            "reason": loss.reason if loss else None,
            "assigned": len(self.base),
            "adopted": len(self.adopted),
            "adopted_from": {str(k): n for k, n in sorted(self.adopted_from.items())},
            "reported": self.reported,
            "sent": self.sent,
            "answered": self.answered,
            "lost": len(loss.open) if loss else 0,
            "answered_after_loss": loss.answered_late if loss else 0,
            "reassigned": self.given,
            "unavailable": len(loss.unavailable) if loss else 0,
            "lost_at_s": round(loss.at, 3) if loss else None,
            "back_at_s": round(loss.back_at, 3) if loss and loss.back_at is not None else None,
        }


class Ledger:
    """Every worker's ``Account`` for one test, and the rules for claims, results and loss."""

    def __init__(self, count: int, nodes: Sequence[str], loop: bool) -> None:
        shards = max(1, len(nodes))
        names = list(nodes) or ["local"]
        self.loop = loop
        self.accounts = [Account(k, names[k], range(k, count, shards)) for k in range(shards)]

    def account(self, shard: int) -> Account | None:
        return self.accounts[shard] if 0 <= shard < len(self.accounts) else None

    def live(self) -> list[Account]:
        return [a for a in self.accounts if a.lost is None]

    def claim(self, shard: int, claims: Sequence[Sequence[Any]]) -> bool:
        """Grant ``claims`` (``[seq, position, bucket]``, in the worker's order); False, with
        nothing granted, to a lost worker: what it had not claimed is another's now."""
        acc = self.accounts[shard]
        if acc.lost is not None:
            return False
        for seq, position, bucket in claims:
            if not self.loop:  # a single pass takes its list in order, each request once
                if seq < acc.claimed and acc.position(seq) == position:
                    continue  # claimed again (the grant did not reach it): granted as before
                if seq != acc.claimed or acc.claimed >= acc.size:
                    raise LedgerError(f"shard {shard}: claim of seq {seq} after {acc.claimed}")
                if acc.position(seq) != position:
                    raise LedgerError(
                        f"shard {shard}: seq {seq} is position {acc.position(seq)}, "
                        f"claimed as {position}"
                    )
                acc.claimed += 1
            acc.open[int(seq)] = (int(position), str(bucket))
        return True

    def reported(self, shard: int, seq: int | None, row: Mapping[str, Any]) -> bool:
        """A result from ``shard``'s worker (``seq``: its claim; None: a request it records as
        not sent). True when it answers a request recorded as lost (the worker came back)."""
        acc = self.accounts[shard]
        acc.reported += 1
        acc.sent += row.get("sent") is not None
        acc.answered += row.get("status") == "ok"
        if seq is None or acc.open.pop(seq, None) is not None:
            return False
        if acc.lost is not None and acc.lost.open.pop(seq, None) is not None:
            acc.lost.answered_late += 1
            return True
        return False

    def finish(self, shard: int, adoptions: int) -> None:
        """The worker reports its list done, having seen ``adoptions`` re-assignments; an
        older report (re-assigned work on its way to it) does not count."""
        acc = self.accounts[shard]
        if adoptions >= acc.adoptions:
            acc.done = True

    def finished(self) -> bool:
        """Every account is done, or lost and not back: no request is waiting for a worker
        (one that came back sends what it was granted, then reports done)."""
        return all(a.done or (a.lost is not None and a.lost.back_at is None) for a in self.accounts)

    def lose(
        self,
        shard: int,
        reason: str,
        at: float,
        takers: Sequence[int],
        why_not: str | None = None,
    ) -> dict[int, list[int]]:
        """``shard``'s worker is lost. What it had claimed and not reported is lost; what it
        never claimed goes to ``takers`` (shards of live workers that can send), round robin,
        or, when there are none or ``why_not`` says why not, is unavailable. Returns
        {shard: positions} to send as re-assignments."""
        acc = self.accounts[shard]
        if acc.lost is not None:
            return {}
        acc.lost = Loss(reason, at, dict(acc.open))
        acc.open.clear()
        # A looping test's worker sends its list again and again: all of it goes on.
        left = acc.positions() if self.loop else acc.positions(acc.claimed)
        acc.claimed = acc.size
        live = [t for t in takers if t != shard and self.accounts[t].lost is None]
        if not left:
            return {}
        if why_not is not None or not live:
            if not self.loop:
                acc.lost.unavailable = left
                why = why_not or "no live worker could take them"
                acc.lost.unavailable_reason = (
                    f"not sent: worker {acc.node} (shard {shard + 1}) was lost ({reason}); {why}"
                )
            return {}
        plan = {t: left[i :: len(live)] for i, t in enumerate(live)}
        for t, part in plan.items():
            taker = self.accounts[t]
            taker.adopted += part
            taker.adopted_from[shard] = taker.adopted_from.get(shard, 0) + len(part)
            taker.adoptions += 1
            taker.done = False
        acc.given += len(left)
        return {t: part for t, part in plan.items() if part}

    def came_back(self, shard: int, at: float | None) -> bool:
        """Locust hears a lost worker again (``at``), or no longer does (None); True when
        that changes."""
        loss = self.accounts[shard].lost
        if loss is None or (loss.back_at is None) == (at is None):
            return False
        loss.back_at = at
        return True

    def holders(self) -> dict[int, int]:
        """The shard that holds each re-assigned position (the others: their own shard's)."""
        return {p: a.shard for a in self.accounts for p in a.adopted}

    def unresolved(self) -> Iterator[Unresolved]:
        """What lost workers leave without a result, for the run directory: the requests
        they had claimed (``lost``) and those nobody sent (``unavailable``)."""
        for acc in self.accounts:
            loss = acc.lost
            if loss is None:
                continue
            why = (
                f"lost with worker {acc.node} (shard {acc.shard + 1}): {loss.reason}; it had "
                "taken this request for sending and no result came back"
            )
            for position, bucket in loss.open.values():
                yield position, bucket, "lost", why
            for position in loss.unavailable:
                yield position, None, "unavailable", loss.unavailable_reason

    def to_json(self) -> list[dict[str, Any]]:
        return [a.to_json() for a in self.accounts]
