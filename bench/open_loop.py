"""Open-loop schedule fidelity: how late kvcanary's replay sends each request of a Poisson
schedule, at 1,000 requests/s for 30 s by default.

    python bench/open_loop.py [--rate 1000] [--duration-s 30] [--tokens 4] [--no-tty] [--out PATH]

The real CLI (``python -m replay --trace T --rate R``, as users run it) replays a trace of
``rate x duration`` short completions requests against the fast fake server
(``_fast_sse_server.py``, its own process; TTFT 1 ms, ITL 0.5 ms, ``--tokens`` tokens, so
the server is cheap). Per request, schedule lag = ``sent - scheduled`` from
``results.jsonl``: ``scheduled`` is the request's due time (the run's start plus its Poisson
offset), ``sent`` is when its body reached the socket (the client's aiohttp hook), both on
the run's monotonic clock. Target: lag p99 <= 1 ms. With ``--pin`` (default) the server runs
on CPU 1 and the replay on CPU 0. The replay writes to a pseudo-terminal, as in a user's shell,
so its progress bars are drawn as they would be (``--no-tty``: to a file, where rich draws
nothing). ``--workers N`` sends from N load processes (then not
pinned). Writes ``bench/results/open_loop.json``: machine, config, lag percentiles (all
requests, and after the first second, when connections are already open), CPU of the
replay, the server and the rest of the machine (other work there disturbs the figures).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from _replay_runs import BENCH, machine_info, percentiles_ms, run_replay, write_json, write_trace
from client_overhead import FastServer
from rich.console import Console

TARGET_P99_MS = 1.0
PROBE_SLEEPS = 500


def timer_probe() -> dict[str, Any]:
    """Wake-up minus due time of ``PROBE_SLEEPS`` sleeps of 0.2-4 ms under uvloop (what the
    replay runs on): bare ``asyncio.sleep``, and the schedule's clock."""
    import asyncio
    import random

    import uvloop

    from replay.core.schedule import MonotonicClock

    async def probe() -> dict[str, Any]:
        clock, rng = MonotonicClock(), random.Random(0)
        bare, sched = [], []
        for _ in range(PROBE_SLEEPS):
            delay = rng.uniform(0.0002, 0.004)
            t0 = clock.now()
            await asyncio.sleep(delay)
            bare.append(clock.now() - t0 - delay)
            due = clock.now() + delay
            await clock.sleep_until(due)
            sched.append(clock.now() - due)
        return {
            "asyncio_sleep_ms": percentiles_ms(bare),
            "schedule_clock_ms": percentiles_ms(sched),
        }

    return uvloop.run(probe())


def lag_figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Lag percentiles of the sent requests: all, and those due after the first second."""
    sent = [r for r in results if r.get("sent") is not None]
    if not sent:
        raise SystemExit("open_loop: the run sent no request (see its log)")
    t0 = min(r["scheduled"] for r in sent)
    lag = [r["sent"] - r["scheduled"] for r in sent]
    warm = [r["sent"] - r["scheduled"] for r in sent if r["scheduled"] - t0 >= 1.0]
    span = max(r["scheduled"] for r in sent) - t0
    return {
        "requests": len(results),
        "sent": len(sent),
        "ok": sum(r["status"] == "ok" for r in results),
        "scheduled_span_s": round(span, 3),
        "achieved_rate_rps": round(len(sent) / span, 1) if span > 0 else None,
        "lag_ms": percentiles_ms(lag),
        "lag_ms_after_first_s": percentiles_ms(warm),
        "late_over_1ms": sum(x > 1e-3 for x in lag),
        "early": sum(x < 0 for x in lag),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=1000.0, help="requests/s (Poisson)")
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument("--tokens", type=int, default=4, help="max_tokens of every request")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--no-pin", dest="pin", action="store_false")
    ap.add_argument(
        "--no-tty",
        dest="tty",
        action="store_false",
        help="the replay's output to a file, not a pseudo-terminal (no progress bars drawn)",
    )
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "open_loop.json")
    a = ap.parse_args(argv)
    console = Console()
    n = round(a.rate * a.duration_s)
    machine = machine_info()
    probe = timer_probe()
    with tempfile.TemporaryDirectory(prefix="kvcanary-open-loop-") as tmp:
        trace = write_trace(Path(tmp) / "trace.jsonl", n, a.tokens)
        with FastServer(1.0, 0.5, a.pin) as server:
            args = ["--trace", str(trace), "--rate", f"{a.rate:g}", "--workers", str(a.workers)]
            cpus = {0} if a.pin and a.workers == 1 else None
            started = time.monotonic()
            run = run_replay(server, args, Path(tmp) / "runs" / "open", cpus, a.tty)
            if run.exit_code != 0:
                raise SystemExit(f"replay exited {run.exit_code}:\n{run.output_tail}")
            figures = lag_figures(list(run.results()))
    p99 = figures["lag_ms"]["p99"]
    doc = {
        "bench": "open_loop",
        "machine": machine,
        "config": {
            "rate_rps": a.rate,
            "duration_s": a.duration_s,
            "requests": n,
            "tokens": a.tokens,
            "workers": a.workers,
            "server": "fake (_fast_sse_server.py: TTFT 1 ms, ITL 0.5 ms)",
            "pinning": "server on CPU 1, replay on CPU 0"
            if cpus
            else "server on CPU 1"
            if a.pin
            else "none",
            "command": "python -m replay --trace T --rate R --targets bench=URL "
            "--no-teacher-forced --no-control",
            "output": "a pseudo-terminal (progress bars drawn)" if a.tty else "a file",
        },
        "summary": {
            **figures,
            "target": f"lag p99 <= {TARGET_P99_MS:g} ms",
            "met": p99 <= TARGET_P99_MS,
            **run.figures(),
        },
        "timer_probe": {
            "what": f"wake-up minus due time, {PROBE_SLEEPS} sleeps of 0.2-4 ms, uvloop",
            **probe,
        },
        "total_wall_s": round(time.monotonic() - started, 1),
    }
    write_json(a.out, doc)
    lag = figures["lag_ms"]
    console.print(
        f"open loop {a.rate:g} rps x {a.duration_s:g} s ({figures['sent']} sent): lag p50 "
        f"{lag['p50']:.3f} p99 {lag['p99']:.3f} max {lag['max']:.3f} ms "
        f"({'met' if doc['summary']['met'] else 'missed'}: p99 <= {TARGET_P99_MS:g} ms); "
        f"CPU replay {run.cpu_s:.1f} s, server {run.server_cpu_s:.1f} s, other "
        f"{doc['summary']['other_cpu_s']:.1f} s; wrote {a.out}"
    )


if __name__ == "__main__":
    main()
