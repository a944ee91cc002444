"""The systems rule through a whole replay, against in-process servers whose timing a test
sets: two targets that differ only by noise give no systems claim; on a machine whose load
rises through the run, arms measured one after another make the candidate (measured last) look
slower, which the rule does not weigh, and interleaved they do not.

A fake server here only stands in for what a real one cannot be made to do on demand (a given
latency distribution, a load that rises on schedule); the real servers' runs are in
docs/canary.md.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from replay.rundir.manifest import read_manifest
from tests.support.fault_server import fault_server

ROOT = Path(__file__).resolve().parents[3]


def _trace(path: Path, n: int = 160) -> Path:
    with path.open("w") as fh:
        for i in range(n):
            rec = {
                "id": f"r{i}",
                "api": "chat",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": f"say a {i}"}],
                "check": {"type": "contains", "values": ["a"]},
            }
            fh.write(json.dumps(rec) + "\n")
    return path


class RisingLoad:
    """One machine's load, shared by its servers: 1 at the run's first request, then rising
    by ``per_s`` each second."""

    def __init__(self, per_s: float) -> None:
        self.per_s = per_s
        self.start: float | None = None

    def __call__(self) -> float:
        now = time.perf_counter()
        self.start = now if self.start is None else self.start
        return 1.0 + self.per_s * (now - self.start)


def _replay(
    tmp: Path, run_id: str, *, drift: float, extra: tuple[str, ...] = (), n: int = 160
) -> dict[str, Any]:
    load = RisingLoad(drift)
    timing = {"chunks": 4, "gap_s": 0.02, "first_s": 0.05, "jitter": 0.2, "load": load}
    with (
        fault_server("usage_every", seed=1, **timing) as a,
        fault_server("usage_every", seed=2, **timing) as b,
    ):
        cmd = [
            sys.executable,
            "-m",
            "replay.cli",
            "--trace",
            str(_trace(tmp / f"{run_id}.jsonl", n)),
            "--targets",
            f"ref={a.url},cand={b.url}",
            "--reference",
            "ref",
            "--candidate",
            "cand",
            "--no-teacher-forced",
            "--out",
            str(tmp),
            "--run-id",
            run_id,
            *extra,
        ]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    path = tmp / run_id / "summary.json"
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary: dict[str, Any] = json.loads(path.read_text())
    return summary


def _calls(summary: dict[str, Any]) -> dict[tuple[str, str], str]:
    rule = summary["systems"]["rule"]
    assert rule["control"] == "ref-control", rule  # on by default when targets are compared
    return {(c["metric"], str(c["bucket"])): c["call"] for c in rule["cells"]}


def test_targets_that_differ_only_by_noise_give_no_systems_claim(tmp_path: Path) -> None:
    summary = _replay(tmp_path, "noise", drift=0.0)
    calls = _calls(summary)
    assert set(calls.values()) == {"same"}, calls  # all weighed, none beyond the floor
    assert {m for m, _ in calls} == {"ttft_ms", "itl_ms", "e2e_ms"}
    headline = summary["verdict"]["headline"]
    assert "faster" not in headline and "slower" not in headline, headline
    # The report lists every cell weighed, with its interval and floor.
    md = (tmp_path / "noise" / "report.md").read_text()
    rows = [line for line in md.split("### Systems")[1].splitlines() if line.startswith("| c4 |")]
    assert len(rows) == len(calls) and all("±" in r and "same" in r for r in rows), rows
    manifest = json.loads((tmp_path / "noise" / "manifest.json").read_text())
    assert manifest["run_spec"]["load"]["interleave"] is True
    assert manifest["run_spec"]["load"]["block_size"] == 0  # by the schedule
    blocks = manifest["targets"]["cand"]["phases"]["c4"]["blocks"]
    assert len(blocks) == 160 // 8 and [b[0] for b in blocks] == list(range(20))


def test_a_drifting_machine_favours_no_arm(tmp_path: Path) -> None:
    """Interleaved, the drift falls on every arm alike; one after another, the candidate ran
    last on the busiest machine, and the rule weighs nothing (one block per arm)."""
    apart = _replay(tmp_path, "apart", drift=0.05, extra=("--no-interleave",))
    assert set(_calls(apart).values()) == {"unweighed"}
    cells = apart["systems"]["rule"]["cells"]
    assert all("one after another" in c["why"] for c in cells)
    assert all(c["change"] > 0.15 for c in cells), cells  # the drift, read as the candidate's
    together = _calls(_replay(tmp_path, "together", drift=0.05))
    assert set(together.values()) == {"same"}, together


def test_the_serial_quality_pass_is_interleaved_and_weighs_no_systems_cell(tmp_path: Path) -> None:
    """--quality-pass serial: c1 goes first, in blocks of 2 arm after arm (each answer computed
    alone, one server working at a time); the quality side reads it, the systems rule only the
    workload's own phase."""
    summary = _replay(tmp_path, "serial", drift=0.0, extra=("--quality-pass", "serial"), n=48)
    manifest = read_manifest(tmp_path / "serial")
    assert manifest.schedules == ("c1", "c4") and manifest.quality_phase == "c1"
    for arm in ("ref", "ref-control", "cand"):
        blocks = manifest.targets[arm].phases["c1"]["blocks"]
        assert [b[0] for b in blocks] == list(range(24)), (arm, blocks)
    cells = summary["systems"]["rule"]["cells"]
    assert cells and {c["phase"] for c in cells} == {"c4"}, cells
    assert summary["systems"]["phase"] == "c4"


def test_an_interrupted_interleaved_run_resumes_with_every_request_once(tmp_path: Path) -> None:
    """Ctrl-C in the middle of a block: the resume sends what is missing, to each arm, and
    keeps the blocks each arm sent whole in the first process."""
    timing = {"chunks": 4, "gap_s": 0.01, "first_s": 0.02}
    run = tmp_path / "r"
    with (
        fault_server("usage_every", seed=1, **timing) as a,
        fault_server("usage_every", seed=2, **timing) as b,
    ):
        cmd = [
            sys.executable,
            "-m",
            "replay.cli",
            "--trace",
            str(_trace(tmp_path / "trace.jsonl")),
            "--targets",
            f"ref={a.url},cand={b.url}",
            "--reference",
            "ref",
            "--concurrency",
            "2,4",
            "--no-teacher-forced",
            "--drain",
            "0.2",
            "--out",
            str(tmp_path),
            "--run-id",
            "r",
        ]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 300
        while len(_rows(run)) < 200 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err.decode()[-2000:]
        first = json.loads((run / "manifest.json").read_text())
        # The run is its spec: it resumes from the manifest's run_spec alone.
        del first["cli_options"]
        (run / "manifest.json").write_text(json.dumps(first))
        # On a loaded machine the interrupt may land before c2 wrote a block: nothing is kept.
        kept = {
            n: t.get("phases", {}).get("c2", {}).get("blocks", [])
            for n, t in first["targets"].items()
        }
        again = [sys.executable, "-m", "replay.cli", "--resume", str(run)]
        done = subprocess.run(again, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = Counter((r["target"], r["phase"], r["request_id"]) for r in _rows(run))
    arms = ("ref", "ref-control", "cand")
    assert set(seen) == {(t, p, f"r{i}") for t in arms for p in ("c2", "c4") for i in range(160)}
    assert set(seen.values()) == {1}, "a request appears twice"
    manifest = json.loads((run / "manifest.json").read_text())
    spec = first["run_spec"]
    assert manifest["run_spec"] == {**spec, "run_dir": {**spec["run_dir"], "resume": True}}
    assert json.dumps(manifest).count('"tolerance"') == 1  # written once: the spec's
    for name in arms:
        blocks = manifest["targets"][name]["phases"]["c2"]["blocks"]
        assert all(b in blocks for b in kept[name]), name  # the first process's whole blocks
        assert len({b[0] for b in blocks}) == len(blocks) <= 160 // 4


def _rows(run: Path) -> list[dict[str, Any]]:
    path = run / "results.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
