"""Results held for the analysis are left out of the garbage collector's full collections."""

from __future__ import annotations

import gc

from replay.core.records import Result
from replay.run.analyze import held


def test_held_results_are_frozen_and_the_collector_runs_again() -> None:
    rows = [
        {"request_id": f"r{i}", "target": "a", "phase": "c1", "bucket": "<256", "scheduled": 0.0}
        for i in range(3)
    ]
    frozen = gc.get_freeze_count()
    try:
        results = held(Result.from_json({**row, "ttft": 1.0}) for row in rows)
        assert [r.request_id for r in results] == ["r0", "r1", "r2"]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen + len(results)
    finally:
        gc.unfreeze()


def test_from_json_leaves_the_callers_row_as_it_is() -> None:
    row = {"request_id": "r", "target": "a", "phase": "c1", "bucket": "b", "scheduled": 0.0}
    row["e2e"] = 2.0
    assert Result.from_json(row).request_id == "r"
    assert row["e2e"] == 2.0
