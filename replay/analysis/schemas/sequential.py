"""The records of a sequential canary in summary.json (``sequential``): the decision, the
rounds and each bucket's interval (``analysis.sequential.summary_block`` builds them; ``schemas``
holds the rest of the summary)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replay.core.record_json import Record, record


@record
class SequentialBucket(Record):
    """One bucket (or the pool: ``name`` None) at the end of a sequential canary: its counts,
    status (open, loss, equivalent), the round that decided it and its drop's interval."""

    name: str | None
    status: str
    pairs: int
    regressions: int
    improvements: int
    decided_round: int | None
    lower: float
    upper: float


@record
class Sequential(Record):
    """``replay canary --sequential`` (``analysis.sequential.summary_block``): the decision, why the
    run stopped, the requests it sent against the fixed design's N, each bucket, what an
    undecided bucket still needs, and the interval path (one row per round per open bucket,
    and the pool's: round, bucket, pairs, regressions, improvements, lower, upper, status)."""

    decision: str  # loss | equivalent | open
    stopped: str  # decided | max_requests | max_time | trace | interrupted
    rounds: int
    round_size: int
    requests_sent: int  # pairs: each request went to every arm
    fixed_n: int  # pairs the fixed design would have sent (``fixed_method`` says how)
    fixed_method: str
    trace_requests: int  # what the trace holds: what a fixed canary sends every arm
    tolerance: float
    alpha: float
    buckets: tuple[SequentialBucket, ...]
    pool: SequentialBucket | None
    needs: tuple[str, ...]
    path: tuple[Mapping[str, Any], ...]
