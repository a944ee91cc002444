"""``Timings``: what the systems side reads of a run's results, from their table.

The systems comparison and the systems rule pair each answered request of the candidate with
the reference's and read three latencies of each, its bucket, when it was scheduled and its
prompt tokens. Here those are arrays a row per result (milliseconds; NaN where a result has
none, where ``Result`` says None), and a target's answered requests in a phase are a dict of
request id to row: no ``Result`` object is made. A result's ITL is the mean of its gaps, each
taken with ``np.mean`` as ``Result.itl`` gives them, so the figures are the ones a loop over
``Result`` objects gives, to the last digit.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from replay.analysis.result_table import ResultTable
from replay.analysis.summary import itl_gaps
from replay.core.records import Result

LATENCY = ("ttft_ms", "itl_ms", "e2e_ms")
_BUILT: weakref.WeakKeyDictionary[ResultTable, Timings] = weakref.WeakKeyDictionary()


class Timings:
    """The answered results' latencies (``LATENCY``, ms), buckets, schedule times and prompt
    tokens, a row per result of ``table``."""

    def __init__(self, table: ResultTable) -> None:
        t = self.table = table
        self.ok = t.codes("status") == t.code_of("status", "ok")
        self.bucket = t.labels("bucket")
        self.scheduled = t.floats("scheduled")
        self.prompt_tokens = t.floats("prompt_tokens")
        sent, first, done = t.floats("sent"), t.floats("first_token"), t.floats("done")
        tokens = t.counts("output_tokens")
        # Seconds, as the SLOs bound them (``Result.ttft``, ``summary.tpot``, ``Result.e2e``).
        self.ttft_s, self.e2e_s = first - sent, done - sent
        with np.errstate(invalid="ignore", divide="ignore"):
            self.tpot_s = np.where(tokens > 1, (done - first) / (tokens - 1), np.nan)
        self.ms: dict[str, npt.NDArray[np.float64]] = {
            "ttft_ms": 1000 * self.ttft_s,
            "itl_ms": _itl_means(t, self.ok),
            "e2e_ms": 1000 * self.e2e_s,
        }

    def rows(self, target: str | None, phase: str) -> dict[str, int]:
        """``target``'s answered requests in ``phase``: request id -> row (a request answered
        twice, as a looping Locust test may: its last answer)."""
        t = self.table
        mask = self.ok & (t.codes("phase") == t.code_of("phase", phase))
        mask &= t.codes("target") == (-2 if target is None else t.code_of("target", target))
        at = np.flatnonzero(mask)
        ids = t.values("request_id")
        return {ids[code]: int(i) for code, i in zip(t.codes("request_id")[at], at, strict=True)}

    def value(self, metric: str, row: int) -> float | None:
        x = float(self.ms[metric][row])
        return None if x != x else x


def timings(results: Iterable[Result]) -> Timings:
    """The timings of ``results`` (made once per table)."""
    table = ResultTable.of(results)
    built = _BUILT.get(table)
    if built is None:
        built = _BUILT[table] = Timings(table)
    return built


def _itl_means(t: ResultTable, ok: npt.NDArray[np.bool_]) -> npt.NDArray[np.float64]:
    """Each answered result's mean ITL in ms (NaN: no gap, or not answered)."""
    gaps, n = itl_gaps(t)
    at = np.cumsum(n) - n
    out = np.full(len(t), np.nan)
    for i in np.flatnonzero(ok & (n > 0)):
        out[i] = 1000 * float(np.mean(gaps[at[i] : at[i] + n[i]]))
    return out
