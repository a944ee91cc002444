"""Long requests at the client's cost: the replay's own CPU and memory per request, from 64
to 30K prompt tokens, on the long-context model served by vLLM CPU.

    python bench/long_requests.py                 # 64, 2K, 8K, 16K, 30K tokens, 3 requests each
    python bench/long_requests.py --lengths 64,2000 --per-length 2   # a quick look

A 32K-token request costs the server a long prefill; it must not cost the client much more
than a short one. The client's share of a long request is: counting its prompt on the
target's tokenizer (``/tokenize``: 32K ids back), bucketing it, streaming its answer,
teacher-forced scoring and, after the run, the analysis (``replay report --reanalyse``). The
bench starts one BF16 server of the long model (``replay model --long``) and replays, for each
length, ``--per-length`` distinct prompts of real text (Python's ``pydoc_data`` topics) to it
under two target names, so that every request is counted, answered twice and scored
teacher-forced, one request at a time. Both names answer alike (one server, greedy), so every
position is scored from the target's own answer (``own``): no scoring request is sent, and
``scored_positions_cached`` stays 0. What a scoring request costs where the answers differ
(``prompt_logprobs`` over the prefix cache, or a whole prefill where the cache no longer holds
the prompt) is in the long model's matrix (``bench/long_model.py``). Each replay and each
re-analysis is its own process: its CPU seconds and peak RSS come from ``wait4`` (the server
is not its child, so none of the server's work is counted). Per request: the run's CPU less
the shortest length's, over the requests.

Writes ``bench/results/long_requests.json``; about 10 minutes on 2 cores (the server's
prefill of the long prompts is most of it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from _replay_runs import SPAWN, machine_info, spawned_usage, wait_rusage, write_json

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results" / "long_requests.json"
LENGTHS = (64, 2000, 8000, 16000, 30000)
MAX_TOKENS = 16
RUN_TIMEOUT_S = 3600.0


def _text_ids(tokenizer: Any) -> list[int]:
    """Real English prose, as token ids without the BOS (the server adds it)."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False).ids
    return ids


def write_trace(path: Path, tokenizer: Any, ids: list[int], length: int, n: int) -> None:
    """``n`` completions requests of about ``length`` prompt tokens, each from its own part of
    the text (no two share a prefix)."""
    stride = max(1, (len(ids) - length) // max(1, n))
    with path.open("wb") as fh:
        for i in range(n):
            piece = ids[i * stride : i * stride + length - 1]
            prompt = tokenizer.decode(piece) + "\n\nIn one sentence, the text above is about"
            rec = {"id": f"len{length}-{i}", "api": "completions", "prompt": prompt}
            fh.write(orjson.dumps({**rec, "max_tokens": MAX_TOKENS}) + b"\n")


def measured(cmd: list[str], log: Path) -> dict[str, Any]:
    """Run ``cmd`` in its own process, spawned by a bare launcher (``SPAWN``: so that its peak
    RSS is its own, not this script's with its tokenizer): exit code, wall and CPU seconds,
    peak RSS in MiB."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "160"}
    report = log.with_suffix(".rusage")
    t0 = time.monotonic()
    with log.open("wb") as out:
        launcher = [sys.executable, "-c", SPAWN, str(report), *cmd]
        proc = subprocess.Popen(launcher, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        wait_rusage(proc, RUN_TIMEOUT_S)
    kib, cpu, code = spawned_usage(report)
    return {
        "exit_code": code,
        "wall_s": round(time.monotonic() - t0, 2),
        "cpu_s": round(cpu, 3),
        "peak_rss_mib": round(kib / 1024, 1),
    }


def one_length(url: str, trace: Path, work: Path, length: int) -> dict[str, Any]:
    """A replay of ``trace`` (two target names on one server) and its re-analysis."""
    run_id = f"len{length}"
    targets = f"bf16={url},bf16-b={url}"
    replay = [sys.executable, "-m", "replay", "--trace", str(trace), "--targets", targets]
    replay += ["--reference", "bf16", "--no-control", "--concurrency", "1"]
    replay += ["--buckets", "2K,8K,16K", "--out", str(work), "--run-id", run_id]
    shutil.rmtree(work / run_id, ignore_errors=True)  # a run of an earlier bench
    run = measured(replay, work / f"{run_id}.log")
    if run["exit_code"] != 0:
        tail = (work / f"{run_id}.log").read_text(errors="replace")[-2000:]
        sys.exit(f"the replay of {length}-token prompts failed (exit {run['exit_code']}):\n{tail}")
    analyse = [sys.executable, "-m", "replay", "report", str(work / run_id), "--reanalyse"]
    again = measured(analyse, work / f"{run_id}-report.log")
    rows = [orjson.loads(x) for x in (work / run_id / "results.jsonl").read_bytes().splitlines()]
    tf = [orjson.loads(x) for x in (work / run_id / "teacher_forced.jsonl").read_bytes().split()]
    return {
        "length": length,
        "requests": len({r["request_id"] for r in rows}),
        "answers_ok": sum(r["status"] == "ok" for r in rows),
        "prompt_tokens": sorted({r["prompt_tokens"] for r in rows if r.get("prompt_tokens")}),
        "scored_positions_cached": sum(int(r.get("cached") or 0) for r in tf),
        "scored": len(tf),
        "replay": run,
        "reanalyse": again,
    }


def per_request(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each length's cost per request over the shortest length's (start-up, imports and the
    run's fixed work cancel out)."""
    base = rows[0]
    out = []
    for r in rows:
        n = max(1, r["requests"])
        out.append(
            {
                "length": r["length"],
                "replay_cpu_s_per_request": round(
                    (r["replay"]["cpu_s"] - base["replay"]["cpu_s"]) / n, 3
                ),
                "reanalyse_cpu_s_per_request": round(
                    (r["reanalyse"]["cpu_s"] - base["reanalyse"]["cpu_s"]) / n, 3
                ),
                "replay_peak_rss_mib": r["replay"]["peak_rss_mib"],
                "reanalyse_peak_rss_mib": r["reanalyse"]["peak_rss_mib"],
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--per-length", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/kvcanary-long-requests"))
    a = ap.parse_args(argv)
    from tokenizers import Tokenizer

    from replay.serving.local_server import LocalServer
    from replay.serving.targets import TargetSpec
    from replay.testmodel.long import ensure_long_model

    model = ensure_long_model("bench/long_requests.py")
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    ids = _text_ids(tokenizer)
    a.work.mkdir(parents=True, exist_ok=True)
    spec = TargetSpec(name="bf16", model=str(model), kv_cache_dtype="auto")
    rows = []
    with LocalServer(spec, a.work / "server.log") as server:
        server.wait_healthy()
        for length in (int(x) for x in a.lengths.split(",")):
            trace = a.work / f"len{length}.jsonl"
            write_trace(trace, tokenizer, ids, length, a.per_length)
            rows.append(one_length(server.url, trace, a.work, length))
            print(orjson.dumps(rows[-1]).decode(), flush=True)
    doc = {
        "bench": "long_requests",
        "machine": machine_info(),
        "config": {"per_length": a.per_length, "max_tokens": MAX_TOKENS, "model": "long"},
        "lengths": rows,
        "per_request": per_request(rows),
    }
    write_json(RESULTS, doc)
    print("->", RESULTS)


if __name__ == "__main__":
    main()
