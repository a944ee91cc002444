"""Aggregates per target x phase x bucket, from the results file and the metrics series.

Missing data is ``None`` (shown as a dash), never 0: "no TTFT measured" is not "0 ms".
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ._records import Result

SUMMARY_VERSION = 1
PCTS = (50, 90, 99)


def pct(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | None]:
    """p50/p90/p99 (and mean) in ms; Nones when there is nothing to measure."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PCTS}}
    arr = np.asarray(values, dtype=float) * scale
    out: dict[str, float | None] = {"mean": float(arr.mean())}
    for p in PCTS:
        out[f"p{p}"] = float(np.percentile(arr, p))
    return out


def summarize_results(results: Sequence[Result]) -> dict[str, Any]:
    """Client-side figures for one group of results."""
    ok = [r for r in results if r.status == "ok"]
    errors = Counter(r.error_kind or "unknown" for r in results if r.status != "ok")
    itl: list[float] = []
    for r in ok:
        itl.extend(r.itl())
    rates = [r.output_tokens / (r.done - r.first_token) for r in ok
             if r.done is not None and r.first_token is not None and r.done > r.first_token
             and r.output_tokens > 1]
    prompt = [r.prompt_tokens for r in results if r.prompt_tokens is not None]
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": sum(errors.values()),
        "errors_by_kind": dict(sorted(errors.items())),
        "output_tokens": sum(r.output_tokens for r in ok),
        "prompt_tokens_median": float(np.median(prompt)) if prompt else None,
        "output_tokens_median": float(np.median([r.output_tokens for r in ok])) if ok else None,
        "ttft_ms": pct([r.ttft for r in ok if r.ttft is not None]),
        "ttft_from_schedule_ms": pct([r.first_token - r.scheduled for r in ok
                                      if r.first_token is not None]),
        "queue_delay_ms": pct([r.queue_delay for r in results if r.queue_delay is not None]),
        "itl_ms": pct(itl),
        "e2e_ms": pct([r.e2e for r in ok if r.e2e is not None]),
        "decode_tok_s_median": float(np.median(rates)) if rates else None,
        "tokens_estimated": any(r.tokens_estimated for r in ok),
    }


def summarize_server(series: Sequence[Mapping[str, Any]], start: float,
                     end: float) -> dict[str, Any]:
    """Server-side figures over a phase from scraped snapshots; the runner scrapes at the
    phase's start and end, so counter deltas cover exactly the phase."""
    window = inside = [s for s in series if start <= s["t"] <= end]
    out: dict[str, Any] = {"scrapes": len(inside)}
    usage = [s["kv_usage"] for s in inside if "kv_usage" in s]
    out["peak_kv_usage"] = max(usage) if usage else None
    for key in ("running", "waiting"):
        vals = [s[key] for s in inside if key in s]
        out[f"peak_{key}"] = max(vals) if vals else None
    first, last = (window[0], window[-1]) if window else ({}, {})

    def delta(key: str) -> float | None:
        if key in first and key in last:
            return float(last[key] - first[key])
        return None

    out["preemptions"] = delta("preemptions")
    q, h = delta("prefix_queries"), delta("prefix_hits")
    out["prefix_cache_hit_rate"] = (h / q) if q and h is not None else None
    for name in ("ttft", "itl", "e2e"):
        a, b = first.get(f"{name}_hist"), last.get(f"{name}_hist")
        if a and b and b["count"] > a["count"]:
            out[f"server_{name}_mean_ms"] = 1000 * (b["sum"] - a["sum"]) / (b["count"] - a["count"])
        else:
            out[f"server_{name}_mean_ms"] = None
    return out


def capacity(cache_config: Mapping[str, str], context_tokens: float | None) -> dict[str, Any]:
    """Cache size in tokens and how many sequences of ``context_tokens`` it holds at once."""
    size = _num(cache_config.get("kv_cache_size_tokens"))
    conc = size / context_tokens if size is not None and context_tokens else None
    return {"kv_cache_size_tokens": size, "concurrency_at_context": conc}


def _num(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "None", "") else None
    except ValueError:
        return None


def build_summary(results: Iterable[Result], targets: Mapping[str, Mapping[str, Any]],
                  series: Mapping[str, Sequence[Mapping[str, Any]]],
                  bucket_order: Sequence[str]) -> dict[str, Any]:
    """The summary document (versioned): targets -> phases -> buckets."""
    grouped: dict[str, dict[str, dict[str, list[Result]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list)))
    for r in results:
        grouped[r.target][r.phase][r.bucket].append(r)
    out: dict[str, Any] = {"version": SUMMARY_VERSION, "targets": {}}
    for name, info in targets.items():
        cache_cfg = info.get("cache_config") or {}
        t_out: dict[str, Any] = {
            "status": info.get("status"), "reason": info.get("reason"),
            "cache_dtype": cache_cfg.get("cache_dtype"),
            "kv_cache_size_tokens": _num(cache_cfg.get("kv_cache_size_tokens")),
            "phases": {},
        }
        for label, window in (info.get("phases") or {}).items():
            by_bucket = grouped[name][label]
            everything = [r for rs in by_bucket.values() for r in rs]
            dur = window["end"] - window["start"]
            phase: dict[str, Any] = {
                "start": window["start"], "end": window["end"], "duration_s": dur,
                "all": summarize_results(everything),
                "server": summarize_server(series.get(name, ()), window["start"], window["end"]),
                "buckets": {},
            }
            phase["all"]["throughput_out_tok_s"] = (
                phase["all"]["output_tokens"] / dur if dur > 0 and everything else None)
            ordered = sorted(by_bucket, key=lambda b: (bucket_order.index(b)
                                                       if b in bucket_order else 99, b))
            for b in ordered:
                row = summarize_results(by_bucket[b])
                ctx = None
                if row["prompt_tokens_median"] is not None:
                    ctx = row["prompt_tokens_median"] + (row["output_tokens_median"] or 0)
                row["capacity"] = capacity(cache_cfg, ctx)
                phase["buckets"][b] = row
            t_out["phases"][label] = phase
        out["targets"][name] = t_out
    return out
