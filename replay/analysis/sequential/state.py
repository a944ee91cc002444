"""The sequential canary: evidence per bucket that may be looked at after every round.

The fixed design (``stats.evidence``) must guess N up front, and looking at it before N inflates
its error rates. Here each context-length bucket keeps the counts of its graded pairs (pairs,
regressions = reference passed and candidate failed, improvements = the reverse) and, after
each round of new pairs, reads the always-valid betting capital of ``capital`` for
two questions about its drop ``P(ref pass) - P(cand pass)``:

* LOSS: reject "drop <= 0" (the candidate is worse);
* EQUIVALENT: reject "drop >= tolerance", with at least ``min_pairs`` pairs.

A bucket is decided when one of them is rejected (a loss first, if both are in the same round),
and then gets no more pairs. The pool of every bucket's pairs asks LOSS once more, against "no
bucket's drop is positive": a shift spread thinly over every bucket, which no bucket shows
alone, adds up there (the stratified test's role in the fixed design). The run is

* ``loss`` as soon as any bucket or the pool shows a loss;
* ``equivalent`` (KEEP-compatible) once every bucket is equivalent and none, nor the pool,
  showed a loss;
* ``open`` otherwise (and undecided for good once the requests run out).

The level, spelled out (``stats.rule.Rule``, its ``pool_share`` included): the two questions
of a bucket have disjoint nulls, so each gets the whole of alpha, as in the fixed design.
EQUIVALENT needs every bucket, so a run is wrongly called equivalent only if some bucket with
a drop of at least the tolerance is, which happens with probability at most alpha (no split
across buckets is needed). LOSS needs any of B + 1 tests, so under "no drop anywhere" they
share alpha by Bonferroni: ``pool_share`` of it to the pool and the rest in equal parts to the
buckets (with one bucket, the bucket gets all of it and there is no pool). Ville's inequality
makes each level hold however many rounds are looked at, with the pairs assumed independent
draws from each bucket's traffic.

Each bucket's interval is the running intersection of its confidence sequence, so it only
narrows: the lower end at the bucket's LOSS level (above 0: a loss) and the upper at alpha
(below the tolerance: equivalent). :class:`SequentialState` is immutable and serializable
(``to_json`` / ``from_json``, an exact round trip), with one history row per round per open
bucket. ``plan`` says what each open bucket would still need and which buckets
the next round's requests go to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from replay.analysis.sequential.capital import lower_bound, rejects, upper_bound
from replay.analysis.stats.equivalence import check_counts
from replay.analysis.stats.rule import Rule

FORMAT = "kvcanary.sequential/1"

OPEN, LOSS, EQUIVALENT = "open", "loss", "equivalent"


@dataclass(frozen=True, slots=True)
class Tally:
    """Counts, interval and status of one bucket, or of the pool (``name`` None; its
    ``upper`` stays 1.0: the pool asks only LOSS)."""

    name: str | None
    pairs: int = 0
    regressions: int = 0
    improvements: int = 0
    status: str = OPEN
    decided_round: int | None = None
    lower: float = -1.0  # the drop is above this (at the arm's LOSS level)
    upper: float = 1.0  # the drop is below this (at alpha)

    def add(self, pairs: int, regressions: int, improvements: int) -> Tally:
        return replace(
            self,
            pairs=self.pairs + pairs,
            regressions=self.regressions + regressions,
            improvements=self.improvements + improvements,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pairs": self.pairs,
            "regressions": self.regressions,
            "improvements": self.improvements,
            "status": self.status,
            "decided_round": self.decided_round,
            "lower": self.lower,
            "upper": self.upper,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Tally:
        arm = cls(
            name=d["name"],
            pairs=int(d["pairs"]),
            regressions=int(d["regressions"]),
            improvements=int(d["improvements"]),
            status=str(d["status"]),
            decided_round=None if d["decided_round"] is None else int(d["decided_round"]),
            lower=float(d["lower"]),
            upper=float(d["upper"]),
        )
        check_counts(arm.pairs, arm.regressions, arm.improvements, "sequential state")
        if arm.status not in (OPEN, LOSS, EQUIVALENT):
            raise ValueError(f"sequential state: unknown status {arm.status!r}")
        return arm


@dataclass(frozen=True, slots=True)
class HistoryRow:
    """One bucket (or the pool: ``bucket`` None) after one round: counts so far, interval."""

    round: int
    bucket: str | None
    pairs: int
    regressions: int
    improvements: int
    lower: float
    upper: float
    status: str

    def to_json(self) -> list[Any]:
        return [
            self.round,
            self.bucket,
            self.pairs,
            self.regressions,
            self.improvements,
            self.lower,
            self.upper,
            self.status,
        ]

    @classmethod
    def from_json(cls, row: list[Any]) -> HistoryRow:
        r, bucket, n, x, y, lo, hi, status = row
        return cls(int(r), bucket, int(n), int(x), int(y), float(lo), float(hi), str(status))


HISTORY_COLUMNS = (
    "round",
    "bucket",
    "pairs",
    "regressions",
    "improvements",
    "lower",
    "upper",
    "status",
)


@dataclass(frozen=True, slots=True)
class SequentialState:
    """Everything the sequential canary knows after ``round`` rounds (see the module docstring).

    Build it with :meth:`start`, feed it each round's new pairs with :meth:`update` (which
    returns a new state), read :attr:`decision`.
    """

    rule: Rule
    buckets: tuple[Tally, ...]
    pool: Tally
    round: int = 0
    history: tuple[HistoryRow, ...] = ()

    @classmethod
    def start(cls, buckets: list[str] | tuple[str, ...], rule: Rule = Rule()) -> SequentialState:
        names = tuple(buckets)
        if not names or len(set(names)) != len(names):
            raise ValueError(f"sequential: need distinct bucket names, got {list(names)}")
        return cls(rule=rule, buckets=tuple(Tally(name) for name in names), pool=Tally(None))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(str(b.name) for b in self.buckets)

    def bucket(self, name: str) -> Tally:
        for b in self.buckets:
            if b.name == name:
                return b
        raise KeyError(f"sequential: no bucket {name!r} (buckets: {', '.join(self.names)})")

    @property
    def pooled(self) -> bool:
        """Is the pooled question asked (two buckets or more)?"""
        return len(self.buckets) > 1

    @property
    def decision(self) -> str:
        """``loss``, ``equivalent`` (KEEP-compatible) or ``open``."""
        if self.pool.status == LOSS or any(b.status == LOSS for b in self.buckets):
            return LOSS
        if all(b.status == EQUIVALENT for b in self.buckets):
            return EQUIVALENT
        return OPEN

    @property
    def open_buckets(self) -> tuple[str, ...]:
        """Buckets that still take pairs: none once the run is decided."""
        if self.decision != OPEN:
            return ()
        return tuple(str(b.name) for b in self.buckets if b.status == OPEN)

    def update(self, new_pairs: Mapping[str, tuple[int, int, int]]) -> SequentialState:
        """The state after one more round: ``new_pairs[bucket] = (pairs, regressions,
        improvements)`` graded in this round (buckets left out got none).

        Pairs that reach a decided bucket (requests in flight when it was decided) still count,
        and narrow its interval, but never change its status.
        """
        for name, (n, x, y) in new_pairs.items():
            self.bucket(name)
            check_counts(n, x, y, f"sequential.update bucket {name!r}")
        k = self.round + 1
        open_before = {b.name for b in self.buckets if b.status == OPEN}
        buckets = tuple(
            self._settle(b.add(*new_pairs[str(b.name)]), k) if b.name in new_pairs else b
            for b in self.buckets
        )
        pool = self.pool
        if self.pooled and any(n for n, _, _ in new_pairs.values()):
            pool = Tally(
                None,
                pairs=sum(b.pairs for b in buckets),
                regressions=sum(b.regressions for b in buckets),
                improvements=sum(b.improvements for b in buckets),
                status=pool.status,
                decided_round=pool.decided_round,
                lower=pool.lower,
            )
            pool = self._settle_pool(pool, k)
        rows = [_row(k, b) for b in buckets if b.name in open_before]
        if self.pooled:
            rows.append(_row(k, pool))
        return replace(self, buckets=buckets, pool=pool, round=k, history=(*self.history, *rows))

    def _settle(self, b: Tally, k: int) -> Tally:
        """A bucket's interval narrowed by its counts, and its status if a question settles."""
        r, n, x, y = self.rule, b.pairs, b.regressions, b.improvements
        a_loss = r.bucket_loss_alpha(len(self.buckets))
        lower = max(b.lower, lower_bound(n, x, y, a_loss))
        upper = min(b.upper, upper_bound(n, x, y, r.alpha))
        status, decided = b.status, b.decided_round
        if status == OPEN and bool(rejects(n, x, y, 0.0, "above", a_loss)):
            status, decided = LOSS, k
        elif (
            status == OPEN
            and n >= r.min_pairs
            and bool(rejects(n, x, y, r.tolerance, "below", r.alpha))
        ):
            status, decided = EQUIVALENT, k
        if status == EQUIVALENT:  # rejected at exactly the tolerance; the bisection is 1e-9
            upper = min(upper, r.tolerance)
        return replace(b, lower=lower, upper=upper, status=status, decided_round=decided)

    def _settle_pool(self, pool: Tally, k: int) -> Tally:
        """The pool's lower end bounds the largest bucket drop from below (its null is "no
        bucket's drop is above m", whatever share of the pairs each bucket got)."""
        n, x, y, a = pool.pairs, pool.regressions, pool.improvements, self.rule.pool_loss_alpha()
        lower = max(pool.lower, lower_bound(n, x, y, a))
        if pool.status == OPEN and bool(rejects(n, x, y, 0.0, "above", a)):
            return replace(pool, lower=lower, status=LOSS, decided_round=k)
        return replace(pool, lower=lower)

    def path(self, bucket: str | None) -> list[HistoryRow]:
        """One bucket's (or the pool's) rows, round by round: the interval narrowing."""
        return [row for row in self.history if row.bucket == bucket]

    def to_json(self) -> dict[str, Any]:
        r = self.rule
        return {
            "format": FORMAT,
            "rule": {
                "tolerance": r.tolerance,
                "alpha": r.alpha,
                "min_pairs": r.min_pairs,
                "pool_share": r.pool_share,
            },
            "round": self.round,
            "decision": self.decision,
            "buckets": [b.to_json() for b in self.buckets],
            "pool": self.pool.to_json(),
            "history_columns": list(HISTORY_COLUMNS),
            "history": [row.to_json() for row in self.history],
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SequentialState:
        if d.get("format") != FORMAT:
            raise ValueError(f"sequential state: format {d.get('format')!r}, expected {FORMAT!r}")
        rule = Rule(
            tolerance=float(d["rule"]["tolerance"]),
            alpha=float(d["rule"]["alpha"]),
            min_pairs=int(d["rule"]["min_pairs"]),
            pool_share=float(d["rule"]["pool_share"]),
        )
        return cls(
            rule=rule,
            buckets=tuple(Tally.from_json(b) for b in d["buckets"]),
            pool=Tally.from_json(d["pool"]),
            round=int(d["round"]),
            history=tuple(HistoryRow.from_json(row) for row in d["history"]),
        )


def _row(k: int, arm: Tally) -> HistoryRow:
    return HistoryRow(
        k,
        arm.name,
        arm.pairs,
        arm.regressions,
        arm.improvements,
        arm.lower,
        arm.upper,
        arm.status,
    )
