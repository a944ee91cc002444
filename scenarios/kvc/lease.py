"""A worker's requests for one test, and the lease that lets it send them.

The worker takes requests in its list's order (its shard, then what it adopts from lost
workers, in the order the master re-assigned them) and sends one only once the master has
granted its claim (``replay.locust.ledger``): the master then knows at every moment what a
worker may have sent, and a lost worker's unclaimed requests can go to another without any
reaching the target twice. Claims run ahead of the users by a window (one request a user, at
least ``MIN_LEASE``), so a user rarely waits for the master's answer; in the trace shape only
requests due within ``LEASE_AHEAD_S`` are claimed, so what a lost worker leaves as lost is
what it had in flight or was about to send, not the next minutes of its shard.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from gevent.event import Event

from replay.traces.importers import stream
from replay.traces.trace import Request

MIN_LEASE = 2  # requests claimed ahead, at the least
LEASE_AHEAD_S = 0.25  # trace shape: claim a request this long before it is due


@dataclass
class Item:
    """One request taken for sending: its claim's ``seq``, its trace position, the pass over
    the list it belongs to (a looping test), and when it is due (trace shape)."""

    seq: int
    req: Request
    position: int
    pass_no: int
    due: float | None


class Lease:
    """The worker's list (``items``: trace position and request; ``offsets``: each one's due
    time on the trace's clock), the cursor of what is claimed, and what the master granted."""

    def __init__(
        self,
        items: list[tuple[int, Request]],
        offsets: list[float],
        loop: bool,
        timed: bool,
    ) -> None:
        self.items, self.offsets, self.loop, self.timed = items, offsets, loop, timed
        self.cursor = self.pass_no = self.seq = 0
        self.leased: deque[Item] = deque()
        self.claiming: dict[int, Item] = {}  # seq -> item, claimed, not answered yet
        self.revoked = False  # the master gave this worker up: it claims nothing more
        self._pulse = Event()

    # waiting -------------------------------------------------------------------------------
    def pulse(self) -> None:
        """Wake every user waiting for a grant, more requests or the stop."""
        ev, self._pulse = self._pulse, Event()
        ev.set()

    def wait(self, timeout: float) -> None:
        self._pulse.wait(timeout)

    # the list ------------------------------------------------------------------------------
    def extend(self, items: Sequence[tuple[int, Request]], offsets: Sequence[float]) -> None:
        """Requests re-assigned to this worker, after its own."""
        self.items += items
        self.offsets += offsets
        self.pulse()

    def claims(self, want: int, go_at: float, horizon: float | None) -> list[Item]:
        """Up to ``want`` requests from the cursor, now being claimed (the cursor moves past
        them); in the trace shape only those due before ``horizon``."""
        out: list[Item] = []
        while len(out) < want and not self.revoked:
            if self.cursor >= len(self.items):
                if not self.loop or not self.items:
                    break
                self.cursor, self.pass_no = 0, self.pass_no + 1
            due = go_at + self.offsets[self.cursor] if self.timed else None
            if horizon is not None and due is not None and due > horizon:
                break
            position, req = self.items[self.cursor]
            item = Item(self.seq, req, position, self.pass_no, due)
            self.cursor += 1
            self.seq += 1
            self.claiming[item.seq] = item
            out.append(item)
        return out

    def next_due(self, go_at: float) -> float | None:
        """When the next request to claim is due (trace shape); None: none is waiting."""
        if not self.timed or self.revoked or not self.items:
            return None
        if self.cursor >= len(self.items):
            return go_at + self.offsets[0] if self.loop else None
        return go_at + self.offsets[self.cursor]

    def granted(self, seqs: Iterable[int]) -> None:
        for seq in seqs:
            item = self.claiming.pop(int(seq), None)
            if item is not None:
                self.leased.append(item)
        self.pulse()

    def revoke(self) -> None:
        """The master refused a claim: it has given this worker up and re-assigned what it
        had not granted. What was granted is still this worker's to send."""
        self.revoked = True
        self.claiming.clear()
        self.cursor = len(self.items)
        self.pulse()

    def pop(self) -> Item | None:
        return self.leased.popleft() if self.leased else None

    def idle(self) -> bool:
        """Nothing granted, nothing being claimed and nothing left to claim."""
        if self.leased or self.claiming:
            return False
        return self.revoked or (not self.loop and self.cursor >= len(self.items))

    def unsent(self) -> tuple[list[Item], list[tuple[int, Request]]]:
        """What the worker will not send now that it stops, all let go: in a single pass,
        the claimed requests no user took (granted or not) and those it never claimed (a
        looping test owes no request a result: what no user took is simply not sent)."""
        claimed = [] if self.loop else [*self.leased, *self.claiming.values()]
        self.leased.clear()
        self.claiming.clear()
        rest: list[tuple[int, Request]] = []
        if not self.loop and not self.revoked:
            rest = self.items[self.cursor :]
        self.cursor = len(self.items)
        return claimed, rest


def read_positions(path: Path, limit: int, positions: Sequence[int]) -> list[tuple[int, Request]]:
    """The requests at ``positions`` of the trace (``limit`` as the master read it), in the
    order given, read as the file streams past (the others are dropped as they are read)."""
    wanted = {p: k for k, p in enumerate(positions)}
    found: list[tuple[int, Request] | None] = [None] * len(positions)
    requests = stream(path)
    try:
        for i, req in enumerate(islice(requests, limit or None)):
            k = wanted.get(i)
            if k is not None:
                found[k] = (i, req)
    finally:
        requests.close()
    missing = [p for p, got in zip(positions, found, strict=True) if got is None]
    if missing:
        raise ValueError(f"{path}: no request at position(s) {missing[:5]} of the trace")
    return [got for got in found if got is not None]
