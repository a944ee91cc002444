"""One process at a time in a run directory (replay/rundir/run_lock.py): a second holder is
refused naming the directory and the first one's pid, and a holder that was killed leaves no
stale lock. The end-to-end refusal of a second ``replay --resume`` is
tests/hostile/test_round4_files.py's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from replay.core.errors import InputError
from replay.rundir.run_lock import LOCK_FILE, holding
from tests.conftest import ROOT


def test_a_second_holder_is_refused_naming_the_directory_and_the_pid(tmp_path: Path) -> None:
    with holding(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        with pytest.raises(InputError) as info, holding(tmp_path):
            pass
    assert f"{tmp_path}: the run directory is in use" in str(info.value)
    assert f"(pid {os.getpid()})" in str(info.value)
    with holding(tmp_path):  # released when the block ended
        pass


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    hold = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from replay.rundir.run_lock import holding\n"
        "with holding(Path(sys.argv[1])):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", hold, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        with pytest.raises(InputError, match=f"pid {proc.pid}"), holding(tmp_path):
            pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    with holding(tmp_path):  # the kernel let go of the killed process's lock
        pass


def test_a_lock_file_planted_as_a_link_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).symlink_to(victim)
    with pytest.raises(InputError, match="cannot open its lock file"), holding(run_dir):
        pass
    assert victim.read_text() == "keep me"
