"""kvcal's observer: calibration tokens/s and its overhead against a plain forward pass.

The same samples are prefilled twice per round, once through kvcal's ObservingCache and once
through a plain DynamicCache (same chunking, same model, same dtype), in alternating order,
for several rounds; the ratio of the process's CPU time is taken per round (so load that
drifts over the run hits both sides alike) and its median reported, the wall-time ratio
beside it. Target: at most 1.15x.

    python bench/kvcal_observer.py                        # sample trace, default model
    python bench/kvcal_observer.py --model DIR --trace T --per-bucket 16 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _machine import machine_busy_s  # noqa: E402


def _timed(fn: Callable[[], Any]) -> dict[str, float]:
    """Wall seconds, this process's CPU seconds and the machine's busy CPU seconds of one
    call. On a shared machine the process's CPU time is the steadier measure: other work
    stretches wall time without adding to it."""
    busy, cpu, t = machine_busy_s(), time.process_time(), time.perf_counter()
    fn()
    return {
        "wall_s": time.perf_counter() - t,
        "cpu_s": time.process_time() - cpu,
        "machine_busy_cpu_s": machine_busy_s() - busy,
    }


def run(
    model_dir: Path, trace: Path, buckets: str, per_bucket: int, chunk: int, rounds: int, dtype: str
) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, DynamicCache

    from kvcal._observe import KVStats, ObservingCache, kv_shape, load_model, prefill
    from kvcal._sample import PromptRenderer, draw
    from replay.core.buckets import Buckets
    from replay.traces.importers import load

    reqs = load(trace).requests
    split = draw(
        reqs,
        PromptRenderer(AutoTokenizer.from_pretrained(str(model_dir))),
        Buckets.parse(buckets),
        per_bucket,
        seed=0,
    )
    samples: Sequence[Sequence[int]] = [s.input_ids for s in split.calibration]
    tokens = sum(len(s) for s in samples)
    model = load_model(str(model_dir), dtype)
    layers, heads, _ = kv_shape(model.config)

    def plain() -> None:
        for ids in samples:
            prefill(model, ids, DynamicCache(config=model.config), chunk)

    def observed() -> None:
        stats = KVStats.empty(layers, heads)
        for ids in samples:
            prefill(model, ids, ObservingCache(stats, model.config), chunk)

    plain()
    observed()  # warm-up: allocator, kernels
    rows = []
    for r in range(rounds):
        order = [("plain", plain), ("observed", observed)]
        if r % 2:
            order.reverse()
        row: dict[str, Any] = {"round": r}
        for name, fn in order:
            row[name] = _timed(fn)
        row["ratio_wall"] = row["observed"]["wall_s"] / row["plain"]["wall_s"]
        row["ratio"] = row["observed"]["cpu_s"] / row["plain"]["cpu_s"]
        rows.append(row)
    ratio = statistics.median(r["ratio"] for r in rows)
    obs_s = statistics.median(r["observed"]["wall_s"] for r in rows)
    return {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        },
        "config": {
            "model": model_dir.name,
            "trace": trace.name,
            "buckets": buckets,
            "per_bucket": per_bucket,
            "chunk_tokens": chunk,
            "rounds": rounds,
            "dtype": str(next(model.parameters()).dtype),
        },
        "samples": len(samples),
        "tokens": tokens,
        "summary": {
            "overhead_ratio_median": ratio,
            "overhead_ratio_min": min(r["ratio"] for r in rows),
            "overhead_ratio_max": max(r["ratio"] for r in rows),
            "overhead_ratio_wall_median": statistics.median(r["ratio_wall"] for r in rows),
            "calibration_tokens_per_s": tokens / obs_s,
            "plain_tokens_per_s": tokens / statistics.median(r["plain"]["wall_s"] for r in rows),
            "target_ratio": 1.15,
            "meets_target": ratio <= 1.15,
        },
        "rounds": rows,
    }


def main() -> None:
    from replay.testmodel.factory import ensure_default_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="model folder [default: the test model]")
    ap.add_argument("--trace", type=Path, default=ROOT / "traces" / "sample.jsonl")
    ap.add_argument("--buckets", default="128,512")
    ap.add_argument("--per-bucket", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default); 1 is kinder to a shared machine",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kvcal_observer.json")
    a = ap.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    result = run(
        a.model or ensure_default_model(),
        a.trace,
        a.buckets,
        a.per_bucket,
        a.chunk_tokens,
        a.rounds,
        a.dtype,
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    s = result["summary"]
    print(
        f"{result['samples']} samples, {result['tokens']} tokens, {result['config']['dtype']}: "
        f"observer/plain = {s['overhead_ratio_median']:.3f}x median "
        f"[{s['overhead_ratio_min']:.3f}, {s['overhead_ratio_max']:.3f}] over "
        f"{len(result['rounds'])} rounds (CPU time; wall "
        f"{s['overhead_ratio_wall_median']:.3f}x; target <= 1.15x); calibration "
        f"{s['calibration_tokens_per_s']:.0f} tokens/s, plain {s['plain_tokens_per_s']:.0f}; "
        f"wrote {a.out}"
    )


if __name__ == "__main__":
    main()
