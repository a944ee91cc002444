"""``replay --workers`` scaling at the client's ceiling: throughput of ``--workers 1`` against
``--workers 2`` in a closed loop that makes the client the bottleneck.

    python bench/workers.py [--workers 1,2] [--concurrency 256] [--requests 60000]
                            [--tokens 64] [--reps 3] [--out PATH]

The real CLI (``python -m replay --trace T --concurrency C --workers N``) replays the same
trace against the fast fake server in ``--burst`` mode (``_fast_sse_server.py``: the whole
answer pre-encoded, written at once, no timers: as cheap per token as the server gets), so
the client's CPU is what limits throughput. Throughput = completed requests (and output
tokens) over the span from the first ``sent`` to the last ``done`` in ``results.jsonl``.
Runs alternate between the worker counts (``--reps`` rounds); the summary takes each
count's median and the ratio of the largest to ``--workers 1``. Target: >= 1.8x at 2.

Pinning (``--pin``, default): the server on CPU 1; ``--workers 1`` on CPU 0; more workers are
not pinned (the parent spawns them; they spread over every CPU, the server's included). On a
2-CPU machine the server cannot have a core of its own beside two workers, so the summary
gives the server's own CPU share (its CPU seconds over the load's span) and the CPU the
replay used: what bounds the ratio there.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _replay_runs import (
    BENCH,
    ReplayRun,
    machine_info,
    run_replay,
    write_json,
    write_trace,
)
from client_overhead import FastServer
from rich.console import Console

TARGET_RATIO = 1.8


def throughput(run: ReplayRun) -> dict[str, Any]:
    """Completed requests and output tokens per second over the load's span."""
    ok = [r for r in run.results() if r["status"] == "ok"]
    if not ok:
        raise SystemExit(f"workers: no request completed:\n{run.output_tail}")
    span = max(r["done"] for r in ok) - min(r["sent"] for r in ok)
    tokens = sum(r["output_tokens"] or 0 for r in ok)
    return {
        "ok": len(ok),
        "span_s": round(span, 3),
        "requests_per_s": round(len(ok) / span, 1),
        "tokens_per_s": round(tokens / span, 1),
        "replay_cpu_per_span": round(run.cpu_s / span, 2),
        "server_cpu_share": round(run.server_cpu_s / span, 3),
        **run.figures(),
    }


def summarize(runs: list[dict[str, Any]], counts: list[int]) -> dict[str, Any]:
    per: dict[str, Any] = {}
    for n in counts:
        mine = [r for r in runs if r["workers"] == n]
        per[str(n)] = {
            key: statistics.median(r[key] for r in mine)
            for key in ("requests_per_s", "tokens_per_s", "server_cpu_share", "replay_cpu_per_span")
        }
    base, top = per[str(counts[0])], per[str(counts[-1])]
    ratio = top["requests_per_s"] / base["requests_per_s"]
    return {
        "per_workers": per,
        "ratio": round(ratio, 3),
        "ratio_of": f"--workers {counts[-1]} / --workers {counts[0]}, median requests/s",
        "target": f">= {TARGET_RATIO:g}x",
        "met": ratio >= TARGET_RATIO,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2", help="worker counts, the first is the base")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--requests", type=int, default=60000)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-pin", dest="pin", action="store_false")
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "workers.json")
    a = ap.parse_args(argv)
    counts = [int(x) for x in a.workers.split(",")]
    console, machine, runs = Console(), machine_info(), []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvcanary-workers-") as tmp:
        trace = write_trace(Path(tmp) / "trace.jsonl", a.requests, a.tokens)
        with FastServer(0.0, 0.0, a.pin, ("--burst",)) as server:
            for rep in range(a.reps):
                for n in counts:
                    args = ["--trace", str(trace), "--concurrency", str(a.concurrency)]
                    cpus = {0} if a.pin and n == 1 else None
                    run_dir = Path(tmp) / "runs" / f"w{n}-r{rep}"
                    run = run_replay(server, [*args, "--workers", str(n)], run_dir, cpus)
                    fig = {"workers": n, "rep": rep, "pinned": bool(cpus), **throughput(run)}
                    runs.append(fig)
                    console.print(
                        f"--workers {n} (rep {rep}): {fig['requests_per_s']:.0f} req/s, "
                        f"{fig['tokens_per_s']:.0f} tok/s, replay CPU "
                        f"{fig['replay_cpu_per_span']:.2f}/s, server "
                        f"{fig['server_cpu_share']:.2f}, other {fig['other_cpu_s']:.1f} s"
                    )
    summary = summarize(runs, counts)
    doc = {
        "bench": "workers",
        "machine": machine,
        "config": {
            "workers": counts,
            "concurrency": a.concurrency,
            "requests": a.requests,
            "tokens": a.tokens,
            "reps": a.reps,
            "server": "fake (_fast_sse_server.py --burst: whole answer at once, pre-encoded)",
            "pinning": "server on CPU 1, --workers 1 on CPU 0, more workers unpinned"
            if a.pin
            else "none",
            "command": "python -m replay --trace T --concurrency C --workers N "
            "--targets bench=URL --no-teacher-forced --no-control",
        },
        "summary": summary,
        "runs": runs,
        "total_wall_s": round(time.monotonic() - started, 1),
    }
    write_json(a.out, doc)
    console.print(
        f"ratio {summary['ratio']:.2f}x ({summary['ratio_of']}; target "
        f"{summary['target']}: {'met' if summary['met'] else 'missed'}); wrote {a.out}"
    )


if __name__ == "__main__":
    main()
