"""Analysis at scale: wall time and peak RSS of the analysis, the report, ``replay compare`` and
``replay export`` on runs of 10k, 100k and 1M results.

    python bench/analysis_scale.py [--sizes 10000,100000,1000000] [--base 2000] [--out PATH]

A base run is made through the real replay, as a user makes one: ``replay`` sends ``--base``
chat requests of ``memory.py``'s trace (every third with a check) to two targets, ``ref`` and
``cand``, on the fast fake server (``_fast_sse_server.py --burst``, its own process),
``--concurrency 64 --no-teacher-forced``; the replay adds the reference's A/A control, so the
run has three arms. A run of N results is that run tiled: its trace holds N/3 records
(``memory.v1_record``: record i depends on i alone) and its results.jsonl, for every record i
and arm, the base run's result of request i mod base, renamed and shifted in time by whole
base spans; the manifest is the base's, with the trace's path, digest and counts and the
phases' windows replaced. So each size is what the replay of that trace against that server
would have written, without sending a million requests first.

The trace's checked records are distinct, as a real run's are: each check's fact is its
record's index (``v1_record(i, distinct=True)``; the base run's records are the same either
way), so no two records ask the grader the same (check, answer) and its cache of grades by
request digest hits only across the arms of one record, where their answers are alike. (With
the fact repeating every 10,000 records, as ``memory.py``'s trace has it, a 1M run asked the
grading worker a few thousand requests: a hit rate no real run of that size would see.)

Each command runs in its own process (``memory.run_measured``: ``wait4`` gives its own peak
RSS and CPU):

- ``analyse``: ``replay report RUN --reanalyse`` (grades, summary.json, report.html and .md);
- ``report``: ``replay report RUN`` (the report from the saved summary);
- ``compare``: ``replay compare RUN RUN``;
- ``export``: ``replay export RUN --format parquet``.

Each command's record holds the machine's 1-minute load average before and after it
(``load_avg_1m``): on a shared machine the wall time includes the other work's share.

Sizes are rounded down to a multiple of the arms (1,000,000 is 999,999 results: 333,333
requests to each arm); ``results_summarized`` is the count the analysis reported. The summary
gives, per command, the figures per size, the growth from each size to the next
(time and RSS ratios, against the ratio of sizes) and the issue's targets for 1M results
(at most 60 s and 1 GB).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson
from client_overhead import FastServer
from memory import machine_info, run_measured, v1_record
from rich.console import Console
from rich.table import Table

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
TARGETS = ("ref", "cand")
TARGET_WALL_S, TARGET_RSS_MIB = 60.0, 1024.0


def write_trace(path: Path, n: int) -> Path:
    with path.open("wb") as fh:
        for i in range(n):
            fh.write(v1_record(i, distinct=True) + b"\n")
    return path


def base_run(work: Path, base: int) -> Path:
    """The real replay of ``base`` requests against two targets on the fast fake server."""
    trace = write_trace(work / "base.jsonl", base)
    with FastServer(0.0, 0.0, pin=False, extra_args=("--burst",)) as server:
        targets = ",".join(f"{t}={server.url}" for t in TARGETS)
        cmd = [
            sys.executable,
            "-m",
            "replay",
            "--trace",
            str(trace),
            "--targets",
            targets,
            "--buckets",
            "256,1K",
            "--concurrency",
            "64",
            "--no-teacher-forced",
            "--out",
            str(work),
            "--run-id",
            "base",
        ]
        got = run_measured(cmd, ROOT)
    run_dir = work / "base"
    if not (run_dir / "results.jsonl").exists():
        raise SystemExit(f"the base run wrote no results:\n{got['output_tail']}")
    return run_dir


def tiled_run(base_dir: Path, base: int, size: int, work: Path) -> Path:
    """A run directory of ``size`` results: the base run tiled over size/arms requests."""
    from replay.rundir.files import file_digest

    rows = [orjson.loads(line) for line in (base_dir / "results.jsonl").open("rb")]
    # Each arm's base result by request index (ids are req-0000000, ...); the arms are the
    # targets and the reference's A/A control, which the replay adds.
    by_arm: dict[str, dict[int, dict[str, Any]]] = {}
    for r in rows:
        by_arm.setdefault(r["target"], {})[int(r["request_id"].split("-")[1])] = r
    requests = size // len(by_arm)
    run_dir = work / f"n{size}"
    run_dir.mkdir(parents=True, exist_ok=True)
    trace = write_trace(work / f"trace-{size}.jsonl", requests)
    times = [r[k] for r in rows for k in ("scheduled", "done") if r.get(k) is not None]
    t0, span = min(times), max(times) - min(times) + 1.0
    time_keys = ("scheduled", "sent", "first_token", "done", "first_answer_token")
    with (run_dir / "results.jsonl").open("wb") as out:
        for source in by_arm.values():
            for i in range(requests):
                row = dict(source[i % base])
                shift = (i // base) * span
                row["request_id"] = f"req-{i:07d}"
                for k in time_keys:
                    if row.get(k) is not None:
                        row[k] = row[k] + shift
                if row.get("chunk_times"):
                    row["chunk_times"] = [t + shift for t in row["chunk_times"]]
                out.write(orjson.dumps(row) + b"\n")
    manifest = orjson.loads((base_dir / "manifest.json").read_bytes())
    # The trace's path, digest and requests are the run spec's; the lines read, its own block's.
    spec = manifest["run_spec"]["trace"]
    spec.update(path=str(trace), sha256=file_digest(trace), requests=requests)
    manifest["trace"]["lines"] = requests
    end = t0 + span * -(-requests // base)
    for entry in manifest["targets"].values():
        for window in entry["phases"].values():
            window["end"] = end
    (run_dir / "manifest.json").write_bytes(orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
    for sub in ("metrics", "servers"):
        (run_dir / sub).mkdir(exist_ok=True)
    return run_dir


def summarized(run_dir: Path) -> int:
    """The results the analysis counted (every arm, every phase): the run's size, if it read
    them all."""
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    return sum(
        phase["all"]["requests"]
        for target in summary["targets"].values()
        for phase in target["phases"].values()
    )


def commands(run_dir: Path) -> dict[str, list[str]]:
    py = [sys.executable, "-m", "replay"]
    return {
        "analyse": [*py, "report", str(run_dir), "--reanalyse"],
        "report": [*py, "report", str(run_dir)],
        "compare": [*py, "compare", str(run_dir), str(run_dir)],
        "export": [*py, "export", str(run_dir), "--format", "parquet"],
    }


def summarize(runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {"targets_at_1m": {"wall_s": TARGET_WALL_S, "rss_mib": TARGET_RSS_MIB}}
    for name, by_size in runs.items():
        sizes = sorted(by_size)
        growth = [
            {
                "from": a,
                "to": b,
                "size_ratio": round(b / a, 2),
                "wall_ratio": round(by_size[b]["wall_s"] / by_size[a]["wall_s"], 2),
                "rss_ratio": round(by_size[b]["peak_rss_mib"] / by_size[a]["peak_rss_mib"], 2),
            }
            for a, b in itertools.pairwise(sizes)
        ]
        top = by_size[sizes[-1]]
        out[name] = {
            "wall_s": {str(n): by_size[n]["wall_s"] for n in sizes},
            "peak_rss_mib": {str(n): by_size[n]["peak_rss_mib"] for n in sizes},
            "growth": growth,
            "all_exit_0": all(r["exit_code"] == 0 for r in by_size.values()),
            **(
                {
                    "meets_1m_targets": top["wall_s"] <= TARGET_WALL_S
                    and top["peak_rss_mib"] <= TARGET_RSS_MIB
                }
                if sizes[-1] == 1_000_000
                else {}
            ),
        }
    return out


def render(console: Console, runs: dict[str, dict[int, dict[str, Any]]]) -> None:
    sizes = sorted({n for by in runs.values() for n in by})
    table = Table(title="wall s / peak RSS MiB, each command in its own process")
    table.add_column("command")
    for n in sizes:
        table.add_column(f"{n:,} results", justify="right")
    for name, by in runs.items():
        cells = [
            f"{by[n]['wall_s']:.1f} s / {by[n]['peak_rss_mib']:.0f}" if n in by else "-"
            for n in sizes
        ]
        table.add_row(name, *cells)
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--base", type=int, default=2000, help="requests the base run sends")
    ap.add_argument("--commands", default="analyse,report,compare,export")
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "analysis_scale.json")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    wanted = args.commands.split(",")
    console = Console()
    runs: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in wanted}
    with tempfile.TemporaryDirectory(prefix="kvcanary-analysis-") as tmp:
        work = Path(tmp)
        console.print(f"base run: {args.base} requests x {len(TARGETS)} targets")
        base_dir = base_run(work, args.base)
        for size in sizes:
            run_dir = tiled_run(base_dir, args.base, size, work)
            for name, cmd in commands(run_dir).items():
                if name not in wanted:
                    continue
                load = os.getloadavg()[0]
                got = run_measured(cmd, ROOT)
                # The machine's other work, which the wall time includes (2 cores, shared).
                got["load_avg_1m"] = {
                    "before": round(load, 2),
                    "after": round(os.getloadavg()[0], 2),
                }
                got["output_tail"] = got["output_tail"].replace(str(work), "WORK")
                if got["exit_code"] != 0:
                    console.print(f"[red]{name} at {size}: exit {got['exit_code']}[/red]")
                    console.print(got["output_tail"])
                if name == "analyse":
                    got["results_summarized"] = summarized(run_dir)
                runs[name][size] = got
                console.print(
                    f"{name} {size:,}: {got['wall_s']:.1f} s, {got['peak_rss_mib']:.0f} MiB"
                )
    summary = summarize(runs)
    render(console, runs)
    doc = {
        "bench": "analysis_scale",
        "machine": machine_info(ROOT),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "config": {"sizes": sizes, "base": args.base, "targets": list(TARGETS)},
        "runs": {n: {str(k): v for k, v in by.items()} for n, by in runs.items()},
        "summary": summary,
    }
    args.out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
