"""What a run promises on a full disk (docs/run-directory.md): the run stops with a clear error
(exit 5, no traceback), every result written before stays whole, and ``--resume`` finishes the
run once there is room; and what the run directory's writers promise on their own.

The disk is a small tmpfs, filled but for a little room by a ballast file: mounting one needs
root (CI runs as root); elsewhere these tests skip, saying so.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from replay.cli import ExitCode
from replay.core.errors import RunDirError
from replay.rundir.files import JsonlWriter, write_json
from tests.support.promise_run import answering, chat_trace, replay_cli, tmpfs

ANSWER = "The answer, at length. " * 150  # about 3.5 KB a result: the disk fills mid-run
REQUESTS = 60


def fill(disk: Path, leave_kb: int) -> Path:
    """A ballast file that leaves about ``leave_kb`` of the disk free."""
    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    ballast = disk / "ballast"
    ballast.write_bytes(b"\0" * max(0, free - leave_kb * 1024))
    return ballast


def rows(path: Path) -> list[dict[str, Any]]:
    """Every line of a JSONL file, each of which must be whole."""
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), "a line was left cut short"
    return [json.loads(line) for line in data.splitlines()]


@pytest.mark.parametrize("workers", [1, 2])
def test_full_disk_mid_run_stops_clearly_keeps_every_written_result_and_resume_finishes(
    tmp_path: Path, workers: int
) -> None:
    trace = chat_trace(tmp_path / "t.jsonl", REQUESTS)
    with tmpfs(tmp_path / "disk", "size=1024k") as disk, answering(ANSWER) as server:
        ballast = fill(disk, 96)
        run = disk / "runs" / "r"
        first = replay_cli(
            "--trace", str(trace), "--targets", f"fake={server.url}", "--concurrency", "2",
            "--out", str(disk / "runs"), "--run-id", "r", "--workers", str(workers),
        )  # fmt: skip
        said = first.stdout + first.stderr
        assert first.returncode == ExitCode.RUN_DIR, said
        assert "Traceback" not in said, said
        assert "No space left on device" in said and f"replay --resume {run}" in said, said
        # --workers: the load processes' own files hold what the merge could not take
        before = [r for p in sorted(run.glob("results*.jsonl")) for r in rows(p)]
        assert 0 < len(before) < REQUESTS, len(before)
        assert not (run / "summary.json").exists()

        ballast.unlink()  # room again
        second = replay_cli("--resume", str(run))
        assert second.returncode == ExitCode.OK, second.stdout + second.stderr
        after = rows(run / "results.jsonl")
        assert Counter(r["request_id"] for r in after) == {f"r{i}": 1 for i in range(REQUESTS)}
        assert all(r["status"] == "ok" for r in after)
        kept = [r for r in before if r["status"] == "ok"]
        assert kept and all(r in after for r in kept), "a result written before was lost"
        assert (run / "summary.json").is_file() and (run / "report.html").is_file()
        assert [p.name for p in run.glob("results*.jsonl")] == ["results.jsonl"]
        manifest = json.loads((run / "manifest.json").read_text())
        assert manifest["targets"]["fake"]["status"] == "ok"


def test_full_disk_a_failed_line_is_undone_and_the_file_keeps_whole_lines(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", "size=256k") as disk:
        path = disk / "results.jsonl"
        failures: list[RunDirError] = []
        writer = JsonlWriter(path, failures.append)
        fill(disk, 8)
        written = 0
        while not failures:
            writer.write({"n": written, "pad": "x" * 700})
            written += 1
        writer.write({"n": "after"})  # dropped: the owner is stopping the run
        writer.close()
        got = rows(path)
        assert [r["n"] for r in got] == list(range(written - 1))
        assert "No space left on device" in str(failures[0]) and len(failures) == 1


def test_full_disk_a_file_rewritten_whole_keeps_its_old_content(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", "size=256k") as disk:
        path = disk / "manifest.json"
        write_json(path, {"old": True})
        fill(disk, 4)
        with pytest.raises(RunDirError, match="No space left on device"):
            write_json(path, {"new": "x" * 64_000})
        assert json.loads(path.read_text()) == {"old": True}
        assert sorted(p.name for p in disk.iterdir()) == ["ballast", "manifest.json"]
