"""A deterministic run for the analysis pipeline: results, trace checks, teacher-forced scores
and metrics of three targets and an A/A control over two phases, built here (no server).

``analysis(run_dir)`` gives what the runner would hand to ``analyse`` (``analyse(*case)``); the
goldens in tests/data/analysis/ are what the analysis wrote for it before it passed typed records
(``python -m tests.support.analysis_run`` rewrites them: only do that for a deliberate format
change).
It covers explicit checks that pass and fail, requests without a check graded against the
reference (facts, JSON, tool calls, ungraded), failed and cancelled requests, a request answered
twice in one phase (a looping Locust test), a bucket outside the run's labels, teacher-forced
scores, and server snapshots with counters and histograms.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from replay.analysis.grading.rows import grading_spec
from replay.analysis.result_table import ResultTable
from replay.analysis.schemas.manifest import Manifest
from replay.core.records import Result, ToolCall
from replay.pipeline.analyse import AnalysedRun, Sources
from replay.rundir.files import TEACHER_FORCED
from replay.traces.trace import Request
from tests.conftest import ROOT
from tests.support.run_config import bare_spec

GOLDEN = ROOT / "tests" / "data" / "analysis"
SORTED = orjson.OPT_SORT_KEYS | orjson.OPT_APPEND_NEWLINE
BUCKETS = ["<256", "256-1K", ">=1K"]
TARGETS = ("bf16", "fp8", "fp8-cal", "bf16-control")
PHASES = {"c1": (0.0, 100.0), "c4": (100.0, 200.0)}
RECORDS = (
    "Records:\n- zuze 4,821 (P30) near Lake Tahoe.\n- nipi 963 (P43) by the harbor.\n"
    'The vault code is "blue falcon". Find the value of zuze.'
)
FACTS = 'The value of zuze is 4,821 (P30), by Lake Tahoe; the code is "blue falcon".'
CHECKS: list[dict[str, Any]] = [
    {"type": "exact", "value": "yes"},
    {"type": "contains", "values": ["yes"]},
    {"type": "regex", "pattern": "^y"},
]


def requests() -> list[Request]:
    """Checked requests (q*) and requests without a check (u*) of four kinds."""
    out = [
        Request(
            id=f"q{i}",
            task="chat",
            check=CHECKS[i % 3],
            messages=({"role": "user", "content": f"Answer yes {i}"},),
        )
        for i in range(18)
    ]
    # The prompt of request i (of all) fits the kind of answer _answer gives it.
    prompts = [RECORDS, "Give the JSON config.", "Set a timer.", "Say hello."]
    out += [
        Request(id=f"u{i}", messages=({"role": "user", "content": prompts[i % 4]},))
        for i in range(18, 26)
    ]
    return out


def _bucket(i: int) -> str:
    return "unlisted" if i == 7 else BUCKETS[i % 3]


def _answer(target: str, rid: str, i: int) -> tuple[str, list[ToolCall]]:
    """fp8 fails a third of the checked requests in 256-1K and some derived ones; fp8-cal only
    a few; the control differs from the reference once."""
    bad = (target == "fp8" and i % 3 == 1 and i % 2 == 0) or (target == "fp8-cal" and i in (4, 22))
    if rid.startswith("q"):
        return ("no" if bad else "yes"), []
    kind = i % 4
    wrong = bad or (target == "bf16-control" and i == 25)
    if kind == 0:
        return ("I do not know." if wrong else FACTS), []
    if kind == 1:
        return ('{"a": 1, "b": [2, 3]}' if not wrong else '{"a": 2}'), []
    if kind == 2:
        args = '{"minutes": 4}' if not wrong else '{"minutes": "4"}'
        return "", [ToolCall(0, "c0", "set_timer", args)]
    return "Hello there.", []


def _result(target: str, phase: str, rid: str, i: int, rng: random.Random) -> Result:
    start = PHASES[phase][0] + TARGETS.index(target) * 20 + i * 0.3
    sent = start + rng.uniform(0.0, 0.02)
    ttft = rng.uniform(0.02, 0.06) * (1 + i % 3) * (1.2 if target.startswith("fp8") else 1.0)
    n = 4 + i % 5
    times = [sent + ttft + j * rng.uniform(0.008, 0.012) for j in range(n)]
    tokens = [1] * n if i % 4 else [2] + [1] * (n - 1)
    text, calls = _answer(target, rid, i)
    r = Result(
        request_id=rid,
        target=target,
        phase=phase,
        bucket=_bucket(i),
        scheduled=start,
        sent=sent,
        first_token=times[0],
        done=times[-1],
        prompt_tokens=80 + 37 * i,
        output_tokens=sum(tokens),
        chunk_times=times,
        chunk_tokens=tokens,
        output_text=text,
        tool_calls=calls,
        output_ids=[1, 2, 3 + (text != "yes")],
        finish_reason="stop",
        tokens_estimated=(i == 9 and target == "fp8"),
    )
    if target == "fp8" and i == 11:
        r.status, r.error_kind, r.error = "error", "timeout", "no answer in 5 s"
        r.first_token = r.done = None
        r.chunk_times, r.chunk_tokens, r.output_tokens, r.output_text = [], [], 0, ""
    if target == "fp8-cal" and i == 17 and phase == "c4":
        r.status, r.error_kind, r.error, r.sent = "cancelled", "cancelled", "stopped", None
        r.first_token = r.done = None
        r.chunk_times, r.chunk_tokens, r.output_tokens, r.output_text = [], [], 0, ""
    if i == 3 and target == "bf16":
        r.prompt_tokens = None
    return r


def results() -> list[Result]:
    rng = random.Random(7)
    out = [
        _result(t, ph, req.id, i, rng)
        for ph in PHASES
        for t in TARGETS
        for i, req in enumerate(requests())
    ]
    # Answered twice in one phase: the second answer's grade counts.
    again = _result("fp8", "c4", "q4", 4, rng)
    again.output_text = "yes"
    out.append(again)
    return out


def teacher_forced() -> list[dict[str, Any]]:
    rows = []
    for t in TARGETS:
        for i, req in enumerate(requests()):
            worse = t == "fp8" and i % 3 == 1
            n = 3 + i % 3
            rows.append(
                {
                    "target": t,
                    "request_id": req.id,
                    "bucket": _bucket(i),
                    "n": n,
                    "nll": [0.1 + (0.4 if worse else 0.01 * (i % 2))] * n,
                    "top1": [not worse or j % 2 == 0 for j in range(n)],
                    "error": "no logprobs" if (t == "fp8-cal" and i == 2) else None,
                }
            )
    return rows


def series(target: str) -> list[dict[str, Any]]:
    base = TARGETS.index(target) * 20
    out = []
    for ph, (start, _) in PHASES.items():
        for k in range(21):
            t = start + base + k
            out.append(
                {
                    "t": t,
                    "kv_usage": 0.01 * ((k * 7 + base) % 90),
                    "running": float(k % 5),
                    "waiting": float(k % 2 if ph == "c4" else 0),
                    "preemptions": float(k // 10),
                    "prefix_queries": 50.0 * k,
                    "prefix_hits": 20.0 * k + (3 if target == "fp8" else 0),
                    "ttft_hist": {"sum": 0.04 * k, "count": float(k)},
                    "itl_hist": {"sum": 0.01 * k * k, "count": float(k * k)},
                }
            )
    return out


def manifest() -> dict[str, Any]:
    targets: dict[str, Any] = {}
    for t in TARGETS:
        fp8 = t.startswith("fp8")
        targets[t] = {
            "spec": {"name": t, "kv_cache_dtype": "fp8" if fp8 else "auto", "args": []},
            "status": "ok",
            "reason": None,
            "engine_version": "0.11.0",
            "model_root": "/models/tiny",
            "max_model_len": 4096,
            "cache_config": _cache(t),
            "phases": {ph: {"start": a, "end": b} for ph, (a, b) in PHASES.items()},
            "scale_log_lines": [],
            "engine_config": {
                "kv_cache_dtype": "fp8" if fp8 else "auto",
                **({"quantization": "compressed-tensors"} if t == "fp8-cal" else {}),
            },
        }
    return {
        "reference": "bf16",
        "options": {"seed": 3},
        "schedules": list(PHASES),
        "roles": {"reference": "bf16", "candidate": "fp8", "calibrated": "fp8-cal"},
        "buckets": {"labels": BUCKETS},
        "targets": targets,
    }


def _cache(target: str) -> dict[str, str]:
    fp8 = target.startswith("fp8")
    return {
        "cache_dtype": "fp8_e4m3" if fp8 else "auto",
        "kv_cache_size_tokens": "40000" if fp8 else "20000",
    }


@dataclass(frozen=True)
class Case:
    """What ``analyse`` reads of this run: ``analyse(*case)``."""

    run_dir: Path
    manifest: Manifest
    sources: Sources

    def __iter__(self) -> Iterator[Any]:
        return iter((self.run_dir, self.manifest, self.sources))

    def with_manifest(self, **changes: Any) -> Case:
        return replace(self, manifest=replace(self.manifest, **changes))

    def with_slo(self, text: str) -> Case:
        """The run as if started with ``--slo text``."""
        return self.with_manifest(options={**self.manifest.options, "slo": text})

    def run(self) -> AnalysedRun:
        """The run as the analysis sees it (its derived facts)."""
        results = ResultTable.of(list(self.sources.results or []))
        return AnalysedRun.of(self.run_dir, self.manifest, self.sources, results)


def analysis(run_dir: Path) -> Case:
    """What the runner hands to ``analyse`` at the end of this run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / TEACHER_FORCED).open("w", encoding="utf-8") as fh:
        for row in teacher_forced():
            fh.write(orjson.dumps(row).decode() + "\n")
    specs = {r.id: grading_spec(r) for r in requests()}
    series_ = {t: series(t) for t in TARGETS if t != "bf16-control"}
    series_["bf16-control"] = series_["bf16"]
    sources = Sources(
        grading_specs=lambda ids: {k: v for k, v in specs.items() if k in ids},
        results=results(),
        series=series_,
    )
    return Case(run_dir, Manifest.from_json(manifest()), sources)


def locust_analysis(run_dir: Path) -> Case:
    """One target, no verdict, no grading: what the Locust recorder hands over."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rs = [r for r in results() if r.target == "fp8" and r.phase == "c1"]
    entry = {**manifest()["targets"]["fp8"], "phases": {"c1": {"start": 0.0, "end": 100.0}}}
    spec = bare_spec(["fp8"], ["c1"], checkers=False, buckets="256,1K")
    locust = {
        "driver": {"name": "locust", "version": "2.x"},
        "reference": "fp8",
        "schedules": ["c1"],
        "buckets": {"labels": BUCKETS},
        "run_spec": spec.to_json(),
        "targets": {"fp8": entry},
    }
    sources = Sources(grading_specs=lambda ids: {}, results=rs, series={"fp8": series("fp8")})
    return Case(run_dir, Manifest.from_json(locust), sources)


def main() -> None:  # pragma: no cover - rewrites the goldens
    from replay.pipeline.analyse import analyse

    tmp = GOLDEN / "tmp"
    for name, build in (("run", analysis), ("locust", locust_analysis)):
        analyse(*build(tmp))
        summary = orjson.loads((tmp / "summary.json").read_bytes())
        summary.pop("run_dir")
        (GOLDEN / f"{name}_summary.json").write_bytes(orjson.dumps(summary, option=SORTED))
        if (tmp / "grades.jsonl").exists():
            shutil.copy(tmp / "grades.jsonl", GOLDEN / f"{name}_grades.jsonl")
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
