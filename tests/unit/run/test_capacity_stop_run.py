"""The capacity phase's blocks (``CapacityRun._blocks``) without servers: each arm's block is
answered by a fake phase at the arm's own rate on a fake clock, its server scraped full, and
the phase stops as its rule says (decided, its time bound, every block) and records why."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from replay.core.records import Result
from replay.run.capacity_phase import BLOCKS, PER_BLOCK, CapacityRun, Judge, strided_blocks
from replay.run.capacity_plan import Plan
from replay.run.progress import QuietProgress
from replay.rundir.files import CAPACITY_DIR, RESULTS, JsonlWriter
from replay.serving.targets import TargetSpec
from replay.traces.trace import Request

CONCURRENCY = 2
ARMS = ("bf16", "bf16-control", "fp8")


class Clock:
    epoch = 0.0

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


class Blocks:
    """A Phase factory: each block answered whole at ``rates[arm]`` requests a second, the
    arm's cache full while it runs (usage 100%, requests waiting) if ``full``."""

    def __init__(self, where: Path, clock: Clock, rates: dict[str, float], full: bool) -> None:
        self.where, self.clock, self.rates, self.full = where, clock, rates, full
        self.sent: list[tuple[str, int]] = []

    def __call__(self, **kw: Any) -> Blocks.One:
        return Blocks.One(self, kw)

    class One:
        def __init__(self, blocks: Blocks, kw: dict[str, Any]) -> None:
            self.b, self.kw = blocks, kw

        async def run(self) -> dict[str, Any]:
            b, kw = self.b, self.kw
            arm, reqs = str(kw["target"]), kw["requests"]
            start = b.clock.t
            end = start + len(reqs) / b.rates[arm]
            for i, (_, req) in enumerate(reqs):
                at = start + (end - start) * i / len(reqs)
                row = Result(req.id, arm, "capacity", "b", at, status="ok", prompt_tokens=9)
                kw["writer"].write(row.to_json())
            usage = 1.0 if b.full else 0.5
            snaps = [
                {"t": t, "kv_usage": u, "waiting": w, "running": 2.0, "preemptions": 0.0}
                for t, u, w in ((start, 0.0, 0.0), ((start + end) / 2, usage, 3.0), (end, 0.0, 0.0))
            ]
            with (b.where / "metrics" / f"{arm}.jsonl").open("ab") as fh:
                fh.writelines(orjson.dumps(s) + b"\n" for s in snaps)
            b.sent.append((arm, len(reqs)))
            b.clock.t = end + 0.01
            return {"start": start, "end": end}


def run_blocks(
    tmp_path: Path, rates: dict[str, float], *, full: bool = True, limit_s: float = 600.0
) -> tuple[dict[str, Any], Blocks]:
    where = tmp_path / CAPACITY_DIR
    (where / "metrics").mkdir(parents=True)
    clock = Clock()
    blocks = Blocks(where, clock, rates, full)
    cap = CapacityRun(
        run_dir=tmp_path,
        reference=TargetSpec("bf16"),
        candidate=TargetSpec("fp8"),
        control=TargetSpec("bf16-control"),
        arms={n: n for n in ARMS},  # type: ignore[misc]  # the fake phase reads the name
        plan=Plan(CONCURRENCY, 1 << 20, 64, "sized"),
        units=units(),
        phase=blocks,  # type: ignore[arg-type]  # answers as a Phase does
        progress=QuietProgress(),
        clock=clock,  # type: ignore[arg-type]
        stopping=asyncio.Event(),
        save=lambda block: None,
        judge=Judge(None, 0.05, 0.05),
        time_limit_s=limit_s,
    )
    block: dict[str, Any] = {"status": "running", "servers": {n: {} for n in ARMS}}
    writer = JsonlWriter(where / RESULTS)
    try:
        asyncio.run(cap._blocks(list(ARMS), cap.arms, block, writer))
    finally:
        writer.close()
    return block, blocks


def units() -> list[list[tuple[int, Request]]]:
    """Blocks of 2 x the concurrency, 24 of them in one cycle."""
    n = BLOCKS * PER_BLOCK * CONCURRENCY
    return [[(i, Request(id=f"r{i}", api="completions", prompt="x"))] for i in range(n)]


def planned() -> int:
    return len(list(strided_blocks(units(), PER_BLOCK * CONCURRENCY, BLOCKS)))


def test_no_change_stops_as_soon_as_the_rest_could_not_change_the_call(tmp_path: Path) -> None:
    block, blocks = run_blocks(tmp_path, {"bf16": 10.0, "bf16-control": 10.0, "fp8": 10.0})
    stop = block["stop"]
    assert stop["why"] == "decided" and stop["call"] == "same"
    assert stop["planned"] == block["blocks_planned"] == planned() >= BLOCKS
    # The interval at 24 blocks ends at d(7) and d(18): seven blocks settle it.
    assert stop["blocks"] == 7 < planned()
    assert len(blocks.sent) == 7 * len(ARMS)
    assert stop["words"].startswith("decided after 7 of")


def test_a_cache_never_seen_full_keeps_the_phase_going(tmp_path: Path) -> None:
    block, _ = run_blocks(tmp_path, {"bf16": 10.0, "bf16-control": 10.0, "fp8": 10.0}, full=False)
    assert block["stop"]["why"] == "all_blocks" and block["stop"]["call"] is None
    assert block["stop"]["blocks"] == planned()


def test_the_time_bound_stops_it_undecided(tmp_path: Path) -> None:
    # Each block takes 0.4 s an arm: the bound of 2 s passes during the second block.
    block, blocks = run_blocks(
        tmp_path, {"bf16": 10.0, "bf16-control": 10.0, "fp8": 10.0}, full=False, limit_s=2.0
    )
    assert len(blocks.sent) == 2 * len(ARMS)
    stop = block["stop"]
    assert stop["why"] == "time_limit" and stop["call"] is None
    assert stop["blocks"] == 2 and stop["elapsed_s"] >= 2.0
    assert stop["cause"] == "stopped by its time bound, 2 s"


@pytest.mark.parametrize("fp8", [5.0, 20.0])
def test_a_clear_change_is_decided_before_the_last_block(tmp_path: Path, fp8: float) -> None:
    block, _ = run_blocks(tmp_path, {"bf16": 10.0, "bf16-control": 10.0, "fp8": fp8})
    stop = block["stop"]
    assert stop["call"] == ("better" if fp8 > 10 else "worse")
    assert stop["why"] == "decided" and stop["blocks"] < planned()
