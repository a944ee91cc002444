"""The figures ``bench/kvcal_formats.py`` keeps of each step, read from the step's folder: the
replay's own files (``summary.json``, ``manifest.json``, ``teacher_forced.jsonl``) and
``kvcal emulate --json`` reports. No path and no per-request row is kept."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orjson

Doc = Mapping[str, Any]
# The served step's pairs: served FP8, its emulation, and the offline report and setting that
# score the same arm (kvcal emulate's names: the overlay's setting is the one not at 1.0).
SERVED_PAIRS = (
    ("original, FP8 at 1.0", "fp8", "fp8-emu", "original", "fp8@1.0"),
    ("outlier twin, FP8 at 1.0", "twin-fp8", "twin-fp8-emu", "twin", "fp8@1.0"),
    ("outlier twin, kvcal's scales", "cal-fp8", "cal-fp8-emu", "twin", "overlay"),
)
PLUGIN_LINE = "kvcanary kv emulation: active"


def _load(path: Path) -> Any:
    return orjson.loads(path.read_bytes())


def _phase(summary: Doc) -> Doc:
    """The run's only phase (one concurrency, one rate)."""
    (phase,) = summary["quality"]["phases"].values()
    return phase  # type: ignore[no-any-return]


def _tf(row: Doc | None) -> dict[str, Any] | None:
    """Teacher-forced ΔNLL per token with its interval, and top-1 agreement."""
    if not row or row.get("nll_delta_mean") is None:
        return None
    keys = ("nll_delta_mean", "nll_delta_lo", "nll_delta_hi", "top1_agreement", "tokens")
    return {k: row.get(k) for k in keys}


def _nll(run: Path) -> dict[str, dict[str, list[float]]]:
    """Each target's per-position NLL of the reference's answers, by request."""
    by: dict[str, dict[str, list[float]]] = defaultdict(dict)
    with (run / "teacher_forced.jsonl").open("rb") as fh:
        for line in fh:
            row = orjson.loads(line)
            if not row.get("error"):
                by[row["target"]][row["request_id"]] = row["nll"]
    return by


def positions(run: Path, a: str, b: str) -> dict[str, Any]:
    """Per-position NLL of ``a`` against ``b`` over the requests both scored: how many, their
    correlation and the share that are the same number."""
    by = _nll(run)
    x: list[float] = []
    y: list[float] = []
    for rid, nll in by[a].items():
        other = by[b].get(rid)
        if other is not None and len(other) == len(nll):
            x += nll
            y += other
    same = sum(p == q for p, q in zip(x, y, strict=True))
    corr = float(np.corrcoef(x, y)[0, 1]) if len(x) > 1 else None
    return {"positions": len(x), "correlation": corr, "identical": same}


def _bucket(row: Doc) -> dict[str, Any]:
    """A target's bucket: pass rate, graded pairs against the reference and their difference,
    teacher-forced ΔNLL."""
    vs = row.get("vs_reference") or {}
    return {
        "requests": row.get("requests"),
        "pass_rate": row.get("pass_rate"),
        "pairs": vs.get("pairs"),
        "pass_rate_diff": vs.get("diff"),
        "teacher_forced": _tf(row.get("teacher_forced")),
    }


def _cache(manifest: Doc, name: str) -> dict[str, Any]:
    info = manifest["targets"][name]
    cache = info.get("cache_config") or {}
    lines = [ln for ln in info.get("scale_log_lines") or () if PLUGIN_LINE in ln]
    return {
        "cache_dtype": cache.get("cache_dtype"),
        "kv_cache_size_tokens": int(cache["kv_cache_size_tokens"]),
        "plugin_line": lines[0][lines[0].index(PLUGIN_LINE) :] if lines else None,
    }


def _verdict(summary: Doc, name: str) -> dict[str, Any] | None:
    v = (summary.get("candidates") or {}).get(name)
    if v is None:
        return None
    notes = [e["text"] for e in v.get("evidence") or () if e.get("kind") == "multiplicity"]
    return {
        "verdict": v["verdict"],
        "exit_code": v["exit_code"],
        "headline": v["headline"],
        "multiplicity": notes[0] if notes else None,
    }


def replay_targets(run: Path) -> dict[str, Any]:
    """Every target of a replay run: its buckets, its cache and its verdict."""
    summary, manifest = _load(run / "summary.json"), _load(run / "manifest.json")
    phase = _phase(summary)
    return {
        name: {
            "buckets": {b: _bucket(row) for b, row in phase[name]["buckets"].items()},
            **_cache(manifest, name),
            "verdict": _verdict(summary, name),
        }
        for name in manifest["targets"]
        if name in phase
    }


# -- kvcal emulate reports ------------------------------------------------------------------


def _setting(report: Doc, which: str) -> str:
    """A report's setting by its kvcal name, or ``overlay``: the one at the overlay's scales."""
    if which != "overlay":
        return which
    return next(  # type: ignore[no-any-return]
        s["name"]
        for s in report["settings"]
        if s["scales"] not in ("1", "1.0") and not s["skip_layers"]
    )


def emulated_rows(report: Doc, which: str) -> dict[str, dict[str, Any]]:
    """A setting's rows by bucket (``all`` among them): ΔNLL with its interval, top-1
    agreement and greedy agreement on the sample."""
    name = _setting(report, which)
    out = {}
    for r in report["results"]:
        if r["setting"] == name:
            greedy = r.get("greedy") or {}
            out[r["bucket"]] = {
                **(_tf(r) or {}),
                "rounding": r.get("rounding"),
                "requests": r["requests"],
                "greedy_exact": greedy.get("exact"),
                "greedy_requests": greedy.get("requests"),
            }
    return out


def _report_facts(report: Doc) -> dict[str, Any]:
    return {
        "rounding": report["rounding"],
        "requests": report["reference"]["requests"],
        "tokens": report["reference"]["tokens"],
        "answers": report["reference"]["answers"],
        "seconds": round(report["seconds"], 1),
    }


# -- the steps ------------------------------------------------------------------------------


def emulate(work: Path) -> dict[str, Any]:
    """The twin at scale 1.0, with its overlay's scales and with the layers the sensitivity
    advises in BF16; the original at scale 1.0 (every bucket, ``all`` among them)."""
    twin, original = _load(work / "twin.json"), _load(work / "original.json")
    sens = twin["sensitivity"]
    skip = sens.get("skip_layers") or []
    confirmed = (sens.get("confirmations") or [{}])[-1].get("summary")
    rows = [
        {"model": "outlier twin", "setting": "FP8 at 1.0", **_of(twin, "fp8@1.0")},
        {"model": "outlier twin", "setting": "kvcal's scales", **_of(twin, "overlay")},
        {
            "model": "outlier twin",
            "setting": "FP8 at 1.0, skip layers",
            "skip_layers": skip,
            "buckets": {"all": _tf(confirmed)} if confirmed else {},
        },
        {"model": "original", "setting": "FP8 at 1.0", **_of(original, "fp8@1.0")},
    ]
    return {
        "twin": _report_facts(twin),
        "original": _report_facts(original),
        "sensitivity": {
            "advice": sens.get("advice"),
            "skip_layers": skip,
            "confirmed_share": sens.get("confirmed_share"),
            "reached": sens.get("reached"),
        },
        "rows": rows,
    }


def _of(report: Doc, which: str) -> dict[str, Any]:
    return {"kvcal_setting": _setting(report, which), "buckets": emulated_rows(report, which)}


def served(work: Path) -> dict[str, Any]:
    """Each FP8 arm served, emulated in vLLM and emulated offline, bucket by bucket, with the
    per-position agreement of the served and the emulated scores."""
    run = work / "run"
    targets = replay_targets(run)
    reports = {"twin": _load(work / "twin.json"), "original": _load(work / "original.json")}
    rows = []
    for label, a, b, report, setting in SERVED_PAIRS:
        rows.append(
            {
                "label": label,
                "served": a,
                "emulated": b,
                "kvcal_setting": _setting(reports[report], setting),
                "buckets": {
                    bucket: {
                        "served": row,
                        "emulated": targets[b]["buckets"].get(bucket),
                        "offline": emulated_rows(reports[report], setting).get(bucket),
                    }
                    for bucket, row in targets[a]["buckets"].items()
                },
                "positions": positions(run, a, b),
            }
        )
    return {
        "requests": sum(r["requests"] or 0 for r in targets["bf16"]["buckets"].values()),
        "offline": {k: _report_facts(v) for k, v in reports.items()},
        "caches": {
            name: {k: t[k] for k in ("cache_dtype", "kv_cache_size_tokens", "plugin_line")}
            for name, t in targets.items()
        },
        "rows": rows,
    }


def canary(work: Path) -> dict[str, Any]:
    """Each candidate decided against the reference: its cache, its buckets and its verdict."""
    run = work / "run"
    summary = _load(run / "summary.json")
    return {
        "verdict": summary["verdict"]["verdict"],
        "exit_code": summary["verdict"]["exit_code"],
        "targets": replay_targets(run),
    }


def formats(work: Path) -> dict[str, Any]:
    """Every target's buckets and cache, and the emulated E5M2 against the served one."""
    run = work / "run"
    return {
        "targets": replay_targets(run),
        "e5m2_positions": positions(run, "fp8_e5m2", "fp8_e5m2-emulated"),
        "bf16_positions": {
            name: positions(run, "bf16", name)
            for name in _load(run / "manifest.json")["targets"]
            if name.endswith("-emulated")
        },
    }
