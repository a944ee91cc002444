"""The summary's table is built column by column, with every ITL gap in one array beside it: its
figures are the ones a row per result with each answer's list of gaps gave, to the last digit."""

from __future__ import annotations

import random

from replay.analysis.summary import pct, results_frame, summarize_targets
from replay.core.records import Result


def _results(n: int, seed: int) -> list[Result]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = Result(
            request_id=f"r{i}",
            target=rng.choice(["a", "b"]),
            phase="c8",
            bucket=rng.choice(["<256", "256-1K", "odd"]),
            scheduled=float(i),
        )
        if rng.random() < 0.1:
            r.status, r.error_kind = "error", "http"
        else:
            r.sent = r.scheduled + rng.random() / 10
            times = [r.sent + 0.05]
            for _ in range(rng.randrange(0, 6)):
                times.append(times[-1] + rng.random() / 50)
            r.first_token, r.done = times[0], times[-1]
            r.chunk_times = times
            r.chunk_tokens = [rng.randrange(0, 4) for _ in times]
            r.output_tokens = sum(r.chunk_tokens) or 1
            r.prompt_tokens = rng.choice([None, rng.randrange(10, 900)])
        out.append(r)
    return out


def test_pooled_itl_is_every_gap_in_the_results_order() -> None:
    results = _results(400, seed=3)
    targets = {"a": {"phases": {"c8": {"start": 0.0, "end": 400.0}}}, "b": {}}
    summary = summarize_targets(results, targets, {}, ["<256", "256-1K"])
    phase = summary["a"].phases["c8"]
    mine = [r for r in results if r.target == "a" and r.status == "ok"]
    # The phase's totals add bucket by bucket, in the order the buckets first came.
    order = list(dict.fromkeys(r.bucket for r in results if r.target == "a"))
    assert order != ["<256", "256-1K", "odd"]
    for bucket in order:
        expected = pct([g for r in mine if r.bucket == bucket for g in r.itl()])
        assert phase.buckets[bucket].itl_ms == expected
    by_bucket = [g for b in order for r in mine if r.bucket == b for g in r.itl()]
    assert phase.all.itl_ms == pct(by_bucket)
    assert phase.all.ttft_ms == pct([r.ttft for b in order for r in mine if r.bucket == b])


def test_a_row_names_its_own_gaps() -> None:
    results = _results(50, seed=5)
    frame, itl = results_frame(results)
    for row, r in zip(frame.itertuples(), results, strict=True):
        assert list(itl[row.itl_at : row.itl_at + row.itl_n]) == r.itl()
        assert (row.prompt_tokens == row.prompt_tokens) == (r.prompt_tokens is not None)
