"""Results held for the analysis are read with the garbage collector paused."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from replay.core.records import Result
from replay.pipeline.analyse import held


def _rows() -> list[dict[str, object]]:
    return [
        {"request_id": f"r{i}", "target": "a", "phase": "c1", "bucket": "<256", "scheduled": 0.0}
        for i in range(3)
    ]


def test_held_results_are_read_with_the_collector_paused_and_it_runs_again() -> None:
    seen: list[bool] = []

    def reading() -> Iterator[Result]:
        for row in _rows():
            seen.append(gc.isenabled())
            yield Result.from_json({**row, "ttft": 1.0})

    results = held(reading())
    assert [r.request_id for r in results] == ["r0", "r1", "r2"]
    assert seen == [False] * 3
    assert gc.isenabled()


def test_the_collector_runs_again_after_a_bad_result() -> None:
    with pytest.raises(TypeError):
        held(Result.from_json({"request_id": "r"}) for _ in range(1))
    assert gc.isenabled()


def test_from_json_leaves_the_callers_row_as_it_is() -> None:
    row = {"request_id": "r", "target": "a", "phase": "c1", "bucket": "b", "scheduled": 0.0}
    row["e2e"] = 2.0
    assert Result.from_json(row).request_id == "r"
    assert row["e2e"] == 2.0
