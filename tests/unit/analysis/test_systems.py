"""Systems comparison: paired latency deltas and the break-even context length."""

from __future__ import annotations

import pytest

from replay.analysis.systems import crossing, fit_line, systems
from replay.core.records import Result


def test_fit_line_recovers_a_line() -> None:
    assert fit_line([0, 1, 2, 3], [5, 7, 9, 11]) == pytest.approx((5.0, 2.0))
    assert fit_line([1, 1, 1], [1, 2, 3]) is None
    assert fit_line([1, 2], [1, 2]) is None


def test_break_even() -> None:
    # FP8: +10 ms fixed overhead, 0.01 ms/token less: wins above 1,000 tokens.
    tokens, wins = crossing((100.0, 0.05), (110.0, 0.04))
    assert wins == "above" and tokens == pytest.approx(1000.0)
    assert crossing((100.0, 0.05), (90.0, 0.05)) == (None, "always")
    assert crossing((100.0, 0.05), (110.0, 0.05)) == (None, "never")
    assert crossing(None, (1.0, 1.0)) == (None, "unknown")


def _res(target: str, rid: str, tokens: int, ttft: float) -> Result:
    return Result(
        request_id=rid,
        target=target,
        phase="c1",
        bucket="b",
        scheduled=0.0,
        sent=0.0,
        first_token=ttft,
        done=ttft + 0.1,
        prompt_tokens=tokens,
        output_tokens=2,
        chunk_times=[ttft, ttft + 0.1],
        chunk_tokens=[1, 1],
    )


def test_systems_short_workload_below_break_even() -> None:
    results = []
    for i, n in enumerate((100, 200, 300, 400, 500, 600)):
        results.append(_res("bf16", f"r{i}", n, (100 + 0.05 * n) / 1000))
        results.append(_res("fp8", f"r{i}", n, (110 + 0.04 * n) / 1000))
    s = systems(results, "bf16", "fp8", "c1").to_json()
    assert s["pairs"] == 6
    row = s["buckets"]["b"]["ttft_ms"]
    assert row["delta_mean"] > 0 and row["lo"] > 0  # FP8 slower on these short prompts
    assert s["fits"]["ttft_ms"]["fp8_wins"] == "above"
    assert s["fits"]["ttft_ms"]["tokens"] == pytest.approx(1000.0, rel=1e-6)
    # Nothing weighed without the systems rule's cells (``systems_cells``): no call either way.
    assert s["below_break_even"] is True and s["latency_better"] is None
