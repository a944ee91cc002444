"""The analysis holds a run's results as columns (``ResultTable``): a row comes back as the
``Result`` it was (what the analysis keeps of it), the summary's table and the systems side's
timings read from the columns are what a loop over ``Result`` objects gives, to the last digit,
and a row that is not a result is refused as ``Result.from_json`` refuses it."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from replay.analysis.result_table import ResultTable, keyed_rows, phase_spans
from replay.analysis.summary import _decode_rate, results_frame, tpot
from replay.analysis.timings import Timings
from replay.core.records import Result, ToolCall
from replay.pipeline.analyse import lean


def _results(n: int, seed: int) -> list[Result]:
    """Results of every shape the table holds: failures, missing times, reasoning, tool
    calls, sessions, odd text, token ids, chunk counts of zero."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = Result(
            request_id=f"r{i % 7}",
            target=rng.choice(["ref", "cand", "ref-control"]),
            phase=rng.choice(["c1", "c4"]),
            bucket=rng.choice(["<256", "256-1K"]),
            scheduled=float(i) + rng.random(),
        )
        kind = rng.random()
        if kind < 0.15:
            r.status, r.error_kind, r.error = "error", "http", f"HTTP 500 #{i}"
        elif kind < 0.2:
            r.status, r.error_kind = "skipped", "too_long"
        else:
            r.sent = r.scheduled + rng.random() / 10
            steps = [rng.random() / 50 for _ in range(rng.randrange(0, 12))]
            r.chunk_times = times = list(itertools.accumulate(steps, initial=r.sent + 0.05))
            r.first_token, r.done = times[0], rng.choice([times[-1], None])
            r.chunk_tokens = [rng.randrange(0, 4) for _ in times]
            r.output_tokens = sum(r.chunk_tokens)
            r.output_text = rng.choice(["", "yes", "caf\u00e9 \ud800", "a\nb"])
            r.output_ids = [rng.randrange(50_000) for _ in range(rng.randrange(4))]
            r.prompt_tokens = rng.choice([None, rng.randrange(10, 900)])
            r.http_status = 200
            r.finish_reason = rng.choice([None, "stop", "length"])
            r.reasoning_tokens = rng.choice([0, 0, 5])
            r.first_answer_token = rng.choice([None, times[0]])
            if rng.random() < 0.1:
                r.tool_calls = [ToolCall(index=0, id="c", name="f", arguments="{}")]
            if rng.random() < 0.1:
                r.session, r.turn, r.reused_prefix_tokens = "s1", 2, 30
            r.other_content_parts = {"image_url": 1} if rng.random() < 0.05 else {}
            r.tokens_estimated = rng.random() < 0.1
        out.append(r)
    return out


def test_a_row_comes_back_as_the_result_the_analysis_keeps() -> None:
    results = _results(300, seed=1)
    table = ResultTable.from_rows(r.to_json() for r in results)
    assert len(table) == len(results)
    for got, r in zip(table, results, strict=True):
        r.prompt_ids = [1, 2]  # what lean drops
        assert got == lean(r)
    assert table[-1] == table[len(table) - 1] and table[1:3] == [table[1], table[2]]
    for i, whole in enumerate(table):  # what grading reads of it, the same
        row = table.answer_row(i)
        assert row._replace(tool_calls=list(row.tool_calls)) == tuple(
            getattr(whole, f) for f in row._fields
        )
    assert list(ResultTable.of(results)) == list(table)


def test_the_summary_table_is_what_each_result_says() -> None:
    results = _results(400, seed=2)
    frame, itl = results_frame(ResultTable.of(results))

    def same(a: float, b: float | None) -> bool:
        return (b is None and math.isnan(a)) or a == b

    for row, r in zip(frame.itertuples(), results, strict=True):
        assert (row.target, row.phase, row.bucket) == (r.target, r.phase, r.bucket)
        assert row.error_kind == (r.error_kind or "unknown")
        assert same(row.ttft, r.ttft) and same(row.e2e, r.e2e)
        assert same(row.queue_delay, r.queue_delay)
        assert same(row.time_to_answer, r.time_to_answer)
        assert same(row.decode_rate, _decode_rate(r)) and same(row.tpot, tpot(r))
        assert same(row.prompt_tokens, r.prompt_tokens) and same(row.turn, r.turn)
        assert row.ok == (r.status == "ok") and row.skipped == (r.status == "skipped")
        assert list(itl[row.itl_at : row.itl_at + row.itl_n]) == r.itl()


def test_the_timings_are_each_results_to_the_last_digit() -> None:
    results = _results(400, seed=3)
    tm = Timings(ResultTable.of(results))
    for phase in ("c1", "c4"):
        rows = tm.rows("cand", phase)
        # A request answered twice in a phase: its last answer, as a dict of them keeps it.
        last = {
            r.request_id: r
            for r in results
            if (r.target, r.phase, r.status) == ("cand", phase, "ok")
        }
        assert rows.keys() == last.keys()
        for rid, i in rows.items():
            r = last[rid]
            gaps = r.itl()
            assert tm.value("ttft_ms", i) == (None if r.ttft is None else 1000 * r.ttft)
            assert tm.value("e2e_ms", i) == (None if r.e2e is None else 1000 * r.e2e)
            assert tm.value("itl_ms", i) == (1000 * float(np.mean(gaps)) if gaps else None)
            assert tm.bucket[i] == r.bucket and tm.scheduled[i] == r.scheduled


def test_rows_by_key_and_the_spans_of_phases_without_a_window() -> None:
    results = _results(200, seed=4)
    table = ResultTable.of(results)
    keyed = keyed_rows(table, "ref")
    expected = {(r.phase, r.request_id): i for i, r in enumerate(results) if r.target == "ref"}
    assert keyed == expected
    spans = phase_spans(table, ["c1"], target="cand")
    mine = [r for r in results if r.target == "cand" and r.phase == "c4"]
    times = [t for r in mine for t in (r.scheduled, r.sent, r.done) if t is not None]
    assert spans == {"c4": (min(times), max(times))}
    assert phase_spans(table, ["c1", "c4"]) == {}


@pytest.mark.parametrize(
    ("row", "error"),
    [
        ({"request_id": "r", "target": "t", "phase": "p", "bucket": "b"}, TypeError),
        (
            {"request_id": "r", "target": "t", "phase": "p", "bucket": "b", "scheduled": 0, "x": 1},
            TypeError,
        ),
        ({"request_id": 7, "target": "t", "phase": "p", "bucket": "b", "scheduled": 0}, TypeError),
        (
            {"request_id": "r", "target": "t", "phase": "p", "bucket": "b", "scheduled": "soon"},
            ValueError,
        ),
        (
            {
                "request_id": "r",
                "target": "t",
                "phase": "p",
                "bucket": "b",
                "scheduled": 0,
                "chunk_times": [1.0, 2.0],
                "chunk_tokens": [1],
            },
            ValueError,
        ),
    ],
)
def test_a_row_that_is_not_a_result_is_refused(
    row: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        ResultTable.from_rows([row])
