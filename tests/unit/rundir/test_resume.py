"""What --resume sends again is decided by the manifest's phase windows (explicit state), not
by error texts: an ended phase is final, an interrupted or unrecorded one resends what it
cancelled. And the runner's signal handling gives the process back the handlers it had."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

from replay.core.records import Result
from replay.run.signals import interrupts
from replay.rundir.files import MANIFEST, RESULTS, TEACHER_FORCED, JsonlWriter, write_json
from replay.rundir.resume import ResumeState


def result(rid: str, phase: str, status: str = "ok", error: str | None = None) -> dict[str, Any]:
    kind = None if status == "ok" else "cancelled"
    return Result(
        request_id=rid,
        target="bf16",
        phase=phase,
        bucket="<256",
        scheduled=0.0,
        status=status,  # type: ignore[arg-type]
        error_kind=kind,  # type: ignore[arg-type]
        error=error,
    ).to_json()


def run_dir(tmp_path: Path, phases: dict[str, Any], rows: list[dict[str, Any]]) -> Path:
    write_json(tmp_path / MANIFEST, {"targets": {"bf16": {"status": "ok", "phases": phases}}})
    w = JsonlWriter(tmp_path / RESULTS)
    for row in rows:
        w.write(row)
    w.close()
    return tmp_path


def test_an_ended_phase_keeps_what_its_time_limit_cancelled(tmp_path: Path) -> None:
    rows = [
        result("a", "c1"),
        # in flight when the time limit hit, and never sent: both final for this phase
        result("b", "c1", "cancelled", "cancelled"),
        result("c", "c1", "cancelled", "not sent: phase time limit 5 s"),
    ]
    state = ResumeState.load(run_dir(tmp_path, {"c1": {"start": 0, "end": 5}}, rows))
    assert state.finished("bf16", "c1") == {"a", "b", "c"}
    assert state.note["resent_interrupted"] == 0 and state.note["kept_results"] == 3


def test_an_interrupted_or_unrecorded_phase_resends_what_it_cancelled(tmp_path: Path) -> None:
    rows = [
        result("a", "c1"),
        result("b", "c1", "cancelled", "not sent: phase time limit 5 s"),  # text is not the rule
        result("a", "c4"),
        result("b", "c4", "cancelled", "cancelled"),  # c4: killed before the manifest knew it
    ]
    phases = {"c1": {"start": 0, "end": 5, "interrupted": True}}
    state = ResumeState.load(run_dir(tmp_path, phases, rows))
    assert state.finished("bf16", "c1") == {"a"} and state.finished("bf16", "c4") == {"a"}
    assert state.note["resent_interrupted"] == 2
    kept = (tmp_path / RESULTS).read_text().splitlines()
    assert len(kept) == 2, "results to be sent again leave results.jsonl"


def test_a_line_cut_short_by_a_kill_is_repaired(tmp_path: Path) -> None:
    d = run_dir(tmp_path, {}, [result("a", "c1")])
    with (d / RESULTS).open("a") as fh:
        fh.write('{"request_id": "b", "tar')
    (d / TEACHER_FORCED).write_text('{"target": "bf16", "request_id": "a"}\n{"tar')
    state = ResumeState.load(d)
    assert state.finished("bf16", "c1") == {"a"} and state.tf_done == {("bf16", "a")}
    assert state.note["repaired_bytes"] == len('{"request_id": "b", "tar') + len('{"tar')


def test_a_target_that_wrote_every_result_before_the_crash_counts_as_served(
    tmp_path: Path,
) -> None:
    """A process killed (or stopped by a full disk) after a target's last result but before it
    said so leaves it ``pending``: resumed complete, it served the run, with no reason."""
    write_json(tmp_path / MANIFEST, {"targets": {"bf16": {"status": "pending", "phases": {}}}})
    state = ResumeState.load(tmp_path)
    assert state.restore("bf16")[:2] == ("ok", None)
    write_json(tmp_path / MANIFEST, {"targets": {"bf16": {"status": "failed", "reason": "x"}}})
    assert ResumeState.load(tmp_path).restore("bf16")[:2] == ("failed", "x")


def test_a_run_without_a_readable_manifest_resends_every_cancelled(tmp_path: Path) -> None:
    w = JsonlWriter(tmp_path / RESULTS)
    w.write(result("a", "c1", "cancelled", "cancelled"))
    w.close()
    state = ResumeState.load(tmp_path)
    assert state.previous == {} and state.finished("bf16", "c1") == set()


def test_the_runs_signal_handlers_give_back_the_ones_before() -> None:
    def cli_handler(signum: int, frame: Any) -> None:
        pass

    old = signal.signal(signal.SIGTERM, cli_handler)
    try:

        async def main() -> Any:
            with interrupts(lambda _signal: None):
                inside = signal.getsignal(signal.SIGTERM)
            return inside

        inside = asyncio.run(main())
        assert inside is not cli_handler  # the loop's own handler while the run lasts
        assert signal.getsignal(signal.SIGTERM) is cli_handler
    finally:
        signal.signal(signal.SIGTERM, old)
