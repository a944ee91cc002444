"""Bounded memory: peak RSS of `replay`, `replay trace import` and `replay trace validate`
on traces of 10k, 100k and 1M records.

    python bench/memory.py [--sizes 10000,100000,1000000] [--send 200] [--out PATH]

The traces are generated into a temporary folder, deterministically (record i depends on i
alone): a kvcanary v1 chat trace (every record a text prompt, every third one with a checker)
and a Mooncake length-only trace. Each command runs in its own process; its peak resident set
is the ``ru_maxrss`` that ``os.wait4`` reports for that one child (Linux: KiB), so neither
this script nor the other commands count. The child is started by a small launcher process,
not by this script (see ``SPAWN``). The replay sends a fixed number of requests
(``--limit``, the CLI's existing cap) to a fake OpenAI server in its own process
(``_fast_sse_server.py``; ``--url`` points it at any server instead, e.g. a real vLLM), so
the trace length is the only thing that changes between sizes. ``--root DIR`` runs the
commands from another checkout (e.g. the commit before streaming, for a before/after).
The summary gives each command's peak RSS per size and the ratio largest/smallest size.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from _machine import cpu_model
from _replay_runs import SPAWN, spawned_usage
from client_overhead import FastServer
from rich.console import Console
from rich.table import Table

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
COMMAND_TIMEOUT_S = 1800.0
CHECK = {"type": "retrieval", "passage_ids": ["P1"], "fact": "0000"}


def v1_record(i: int, *, distinct: bool = False) -> bytes:
    """Record i of the v1 chat trace; its check's fact is ``i % 10_000``, or i itself where
    ``distinct`` (no two checked records then ask the same check)."""
    fact = f"{i if distinct else i % 10_000:04d}"
    rec: dict[str, Any] = {
        "id": f"req-{i:07d}",
        "t": round(i * 0.05, 3),
        "api": "chat",
        "max_tokens": 4,
        "task": "retrieval" if i % 3 == 0 else "chat",
        "messages": [
            {"role": "system", "content": "Answer from the context."},
            {
                "role": "user",
                "content": f"[P0] The river code is {fact}.\n[P1] The "
                f"stone code is {fact[::-1]}.\nWhich passage names the stone code, and "
                f"what is it? (record {i})",
            },
        ],
    }
    if i % 3 == 0:
        rec["check"] = {**CHECK, "fact": fact[::-1]}
    return orjson.dumps(rec)


def mooncake_record(i: int) -> bytes:
    blocks = 1 + i % 6
    return orjson.dumps(
        {
            "timestamp": i * 50,
            "input_length": 512 * blocks - i % 100,
            "output_length": 16 + i % 200,
            "hash_ids": [(i * 7 + b) % 50_000 for b in range(blocks)],
        }
    )


def write_trace(path: Path, n: int, record: Any) -> Path:
    with path.open("wb") as fh:
        batch: list[bytes] = []
        for i in range(n):
            batch.append(record(i))
            if len(batch) == 10_000:
                fh.write(b"\n".join(batch) + b"\n")
                batch = []
        if batch:
            fh.write(b"\n".join(batch) + b"\n")
    return path


def run_measured(cmd: list[str], root: Path) -> dict[str, Any]:
    """Run one command; its own peak RSS (``wait4``), wall and CPU time, exit code."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    env["COLUMNS"] = "160"
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvcanary-peak-") as tmp:
        report = Path(tmp) / "rusage"
        with (Path(tmp) / "out").open("w+b") as out:
            proc = subprocess.Popen(
                [sys.executable, "-c", SPAWN, str(report), *cmd],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=root,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=COMMAND_TIMEOUT_S)
            finally:
                if proc.poll() is None:  # timed out or interrupted: the command goes too
                    os.killpg(proc.pid, 9)
                    proc.wait()
            wall = time.monotonic() - start
            out.seek(0)
            tail = out.read().decode("utf-8", "replace")[-1500:]
        kib, cpu, code = spawned_usage(report)
    return {
        "peak_rss_mib": round(kib / 1024, 1),
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "exit_code": code,
        "output_tail": tail,
    }


def commands(
    v1: Path, mooncake: Path, work: Path, url: str, send: int, concurrency: int, n: int
) -> dict[str, list[str]]:
    py = [sys.executable, "-m", "replay"]
    return {
        "trace validate": [*py, "trace", "validate", str(v1)],
        "trace import": [
            *py,
            "trace",
            "import",
            str(mooncake),
            "--format",
            "mooncake",
            "-o",
            str(work / f"imported-{n}.jsonl"),
        ],
        "replay": [
            *py,
            "--trace",
            str(v1),
            "--targets",
            f"bench={url}",
            "--limit",
            str(send),
            "--concurrency",
            str(concurrency),
            "--no-teacher-forced",
            "--out",
            str(work / "runs"),
            "--run-id",
            f"n{n}",
        ],
    }


def machine_info(root: Path) -> dict[str, Any]:
    from importlib.metadata import version

    try:
        head = subprocess.run(
            ["git", "-C", str(root), "log", "-1", "--format=%h %cI"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "replay"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        head, dirty = "", None
    mem = next(
        (
            ln.split()[1]
            for ln in Path("/proc/meminfo").read_text().splitlines()
            if ln.startswith("MemTotal")
        ),
        "0",
    )
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "nproc": os.cpu_count(),
        "mem_total_gib": round(int(mem) / 2**20, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {p: version(p) for p in ("pydantic", "orjson", "aiohttp")},
        "code": {
            "last_commit": head or None,
            "uncommitted_replay_changes": bool(dirty and dirty.stdout.strip()),
        },
    }


def summarize(runs: dict[str, dict[int, dict[str, Any]]], floor: float) -> dict[str, Any]:
    out: dict[str, Any] = {"interpreter_floor_mib": floor}
    for name, by_size in runs.items():
        sizes = sorted(by_size)
        lo, hi = by_size[sizes[0]]["peak_rss_mib"], by_size[sizes[-1]]["peak_rss_mib"]
        out[name] = {
            "peak_rss_mib": {str(n): by_size[n]["peak_rss_mib"] for n in sizes},
            f"ratio_{sizes[-1]}_over_{sizes[0]}": round(hi / lo, 3),
            "above_floor_mib": {
                str(n): round(by_size[n]["peak_rss_mib"] - floor, 1) for n in sizes
            },
            "all_exit_0": all(r["exit_code"] == 0 for r in by_size.values()),
        }
    return out


def render(
    console: Console, runs: dict[str, dict[int, dict[str, Any]]], summary: dict[str, Any]
) -> None:
    sizes = sorted({n for by in runs.values() for n in by})
    table = Table(
        title=f"peak RSS, MiB (interpreter + imports alone: {summary['interpreter_floor_mib']} MiB)"
    )
    table.add_column("command")
    for n in sizes:
        table.add_column(f"{n:,} records", justify="right")
    table.add_column(f"{sizes[-1]:,} / {sizes[0]:,}", justify="right")
    for name, by in runs.items():
        cells = [
            f"{by[n]['peak_rss_mib']:.1f} ({by[n]['wall_s']:.0f} s)" if n in by else "-"
            for n in sizes
        ]
        ratio = next(v for k, v in summary[name].items() if k.startswith("ratio_"))
        table.add_row(name, *cells, f"{ratio:.2f}")
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000,1000000", help="trace lengths, records")
    ap.add_argument("--send", type=int, default=200, help="requests the replay sends (--limit)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--url", help="replay against this server instead of the fake one")
    ap.add_argument("--root", type=Path, default=ROOT, help="checkout whose replay/ is run")
    ap.add_argument(
        "--only",
        default="trace validate,trace import,replay",
        help="commands to measure, comma-separated",
    )
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "memory.json")
    ap.add_argument("--keep", type=Path, help="generate into this folder and keep it")
    a = ap.parse_args(argv)
    sizes = sorted(int(s) for s in a.sizes.split(",") if s.strip())
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    console = Console()
    root = a.root.resolve()
    work = a.keep or Path(tempfile.mkdtemp(prefix="kvcanary-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in only}
    try:
        # The floor (what importing the CLI costs), and a check that the measurement sees a
        # known allocation: 256 MiB more than the floor, not the launcher's size.
        floor = run_measured([sys.executable, "-c", "import replay.cli, replay.run.runner"], root)[
            "peak_rss_mib"
        ]
        probe = run_measured(
            [
                sys.executable,
                "-c",
                "import replay.cli, replay.run.runner; "
                "x = bytearray(256 * 2**20); x[::4096] = b'1' * (2**16)",
            ],
            root,
        )["peak_rss_mib"]
        console.print(f"floor {floor} MiB; floor + 256 MiB measured as {probe} MiB")
        server = FastServer(20.0, 5.0, False) if a.url is None else None
        with server or _NoServer():
            url = a.url or (server.url if server else "")
            for n in sizes:
                t0 = time.monotonic()
                v1 = write_trace(work / f"v1-{n}.jsonl", n, v1_record)
                mc = write_trace(work / f"mooncake-{n}.jsonl", n, mooncake_record)
                console.print(
                    f"{n:,} records: traces written in {time.monotonic() - t0:.1f} s "
                    f"({v1.stat().st_size / 2**20:.0f} + "
                    f"{mc.stat().st_size / 2**20:.0f} MiB)"
                )
                for name, cmd in commands(v1, mc, work, url, a.send, a.concurrency, n).items():
                    if name not in only:
                        continue
                    r = run_measured(cmd, root)
                    # No paths of this machine in the results: the work folder is temporary.
                    r["command"] = [Path(c).name if c.startswith(str(work)) else c for c in cmd[1:]]
                    r["output_tail"] = (
                        r["output_tail"].replace(str(work), "<work>").replace(str(root), "<root>")
                    )
                    runs[name][n] = r
                    console.print(
                        f"  {name}: {r['peak_rss_mib']:.1f} MiB peak, "
                        f"{r['wall_s']:.1f} s, exit {r['exit_code']}"
                    )
                    if r["exit_code"] != 0:
                        console.print(r["output_tail"])
                for p in work.glob(f"*-{n}.jsonl"):
                    p.unlink()  # the next size needs the disk more than we need these
    finally:
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    summary = summarize(runs, floor)
    summary["probe_floor_plus_256_mib"] = probe
    render(console, runs, summary)
    report = {
        "machine": machine_info(root),
        "config": {
            "sizes": sizes,
            "send": a.send,
            "concurrency": a.concurrency,
            "server": a.url or "fake (_fast_sse_server.py: TTFT 20 ms, ITL 5 ms)",
            "max_tokens": 4,
            "teacher_forced": False,
        },
        "summary": summary,
        "runs": {name: {str(n): r for n, r in by.items()} for name, by in runs.items()},
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    console.print(f"wrote {a.out}")


class _NoServer:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds: the server is stopped, the temp folder removed


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_signal)
    main()
