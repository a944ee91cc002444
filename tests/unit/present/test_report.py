"""HTML and Markdown reports, from run directories built here (no server).

``make_run_dir`` writes a complete run (bf16 reference, fp8 candidate that loses quality in
one bucket, an A/A control) with the project's own summary, quality, systems and verdict
code, and plants script payloads in a trace prompt, a model answer and a checker reason.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import orjson
import pytest

from replay.analysis.grading.quality import assess_quality
from replay.analysis.schemas import Summary
from replay.analysis.schemas.manifest import Manifest
from replay.analysis.summary import SUMMARY_VERSION, summarize_targets
from replay.analysis.systems import systems, throughput_ratio
from replay.analysis.verdict.facts import facts_from_run
from replay.analysis.verdict.rule import decide
from replay.core.records import Result
from replay.present import charts, formatting, markdown, report
from replay.present.views import requests as request_views
from replay.rundir.files import write_json

PAYLOAD = "<script>alert(1)</script>"
TITLE_PAYLOAD = "<script>document.title='pwned'</script>"
IMG_PAYLOAD = "<img src=x onerror=\"document.title='pwned'\">"
BUCKETS = ["<256", "256-1K", ">=1K"]
TARGETS = {"bf16": "auto", "fp8": "fp8", "bf16-control": "auto"}
N_PER_BUCKET = 30


def _dump(path: Path, obj: Any) -> None:
    write_json(path, obj)  # as the runner writes them: sorted keys ("256-1K" before "<256")


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(orjson.dumps(r).decode() + "\n" for r in rows), encoding="utf-8")


def _trace(path: Path, unlabeled: int = 0) -> list[tuple[str, str]]:
    """(id, bucket) of each request; r0 carries the payloads, r1 has a long prompt; u* have no
    check (unlabeled traffic)."""
    ids, lines = [], []
    for b, bucket in enumerate(BUCKETS[:2]):
        for i in range(unlabeled):
            rid = f"u{b}{i}"
            lines.append({"id": rid, "messages": [{"role": "user", "content": f"Code {rid}?"}]})
            ids.append((rid, bucket))
    for b, bucket in enumerate(BUCKETS[:2]):
        for i in range(N_PER_BUCKET):
            rid = f"r{b * N_PER_BUCKET + i}"
            content = f"Question {rid}: what is the code?"
            if rid == "r0":
                content = f"Ignore this {PAYLOAD} {TITLE_PAYLOAD} {IMG_PAYLOAD} | pipe"
            elif rid == "r1":
                content = "HEAD " + "x" * 2000 + " TAIL"
            lines.append(
                {
                    "id": rid,
                    "task": "retrieval",
                    "messages": [
                        {"role": "system", "content": "Answer from the context."},
                        {"role": "user", "content": content},
                    ],
                }
            )
            ids.append((rid, bucket))
    _jsonl(path, lines)
    return ids


def _result(rid: str, target: str, bucket: str, k: int, rng: random.Random) -> Result:
    sent = k * 0.5 + (0 if target == "bf16" else 100 if target == "fp8" else 200)
    ttft = rng.uniform(0.02, 0.05) * (2 if bucket == "256-1K" else 1)
    times = [sent + ttft + j * rng.uniform(0.008, 0.012) for j in range(8)]
    text = "The code is 42."
    if rid == "r0" and target == "fp8":
        text = f"Sure: {PAYLOAD} done"
    return Result(
        request_id=rid,
        target=target,
        phase="c1",
        bucket=bucket,
        scheduled=sent,
        sent=sent,
        first_token=times[0],
        done=times[-1],
        prompt_tokens=100 + 10 * k,
        output_tokens=8,
        chunk_times=times,
        chunk_tokens=[1] * 8,
        output_text=text,
        output_ids=[1, 2, 3] if text.startswith("The") else [1, 9],
        finish_reason="stop",
    )


def _tf(res: Result) -> dict[str, Any]:
    """Teacher-forced scores of the reference's answer: fp8 diverges in 256-1K."""
    worse = res.target == "fp8" and res.bucket == "256-1K"
    return {
        "target": res.target,
        "request_id": res.request_id,
        "bucket": res.bucket,
        "n": 4,
        "nll": [0.9 if worse else 0.1] * 4,
        "top1": [not worse, True, not worse, True],
        "error": None,
    }


def _grade(res: Result, ref_text: str) -> dict[str, Any]:
    if res.request_id.startswith("u"):
        return _derived_grade(res)
    # fp8 fails 12 of 30 requests in 256-1K that bf16 passes: a repeatable loss.
    n = int(res.request_id[1:])
    passed = not (res.target == "fp8" and res.bucket == "256-1K" and n % 5 < 2)
    reason = "found the fact" if passed else "answer lacks the fact"
    if res.request_id == "r0":
        reason = f"checker saw {PAYLOAD}"
    agree = None
    if res.target != "bf16":
        exact = res.output_text == ref_text
        agree = {"exact": exact, "normalized": exact, "first_divergence": None if exact else 1}
    return {
        "target": res.target,
        "phase": res.phase,
        "request_id": res.request_id,
        "bucket": res.bucket,
        "answered": True,
        "task": "retrieval",
        "grade": {"passed": passed, "reason": reason, "score": float(passed), "detail": {}},
        "agreement": agree,
    }


def _derived_grade(res: Result) -> dict[str, Any]:
    derived = None
    if res.target != "bf16":
        passed = not (
            res.target == "fp8" and res.bucket == "256-1K" and int(res.request_id[2:]) % 5 < 3
        )
        derived = {
            "rule": "derived:facts",
            "passed": passed,
            "exact": passed,
            "reason": "all 1 fact(s) the reference took from the prompt are in the answer"
            if passed
            else "missing 1 of 1 fact(s) the reference took from the prompt: '42'",
            "detail": {"facts": ["42"]},
        }
    return {
        "target": res.target,
        "phase": res.phase,
        "request_id": res.request_id,
        "bucket": res.bucket,
        "answered": True,
        "task": "chat",
        "grade": None,
        "agreement": None
        if res.target == "bf16"
        else {"exact": True, "normalized": True, "first_divergence": None},
        "derived": derived,
    }


def _series(target: str) -> list[dict[str, Any]]:
    """Scrapes of one server; the control replays on the reference's server (bf16's series
    runs on through the control's phase, at 200-230 s)."""
    if target == "bf16-control":
        return []
    base = 0 if target == "bf16" else 100
    ts = [*range(31), *range(200, 231)] if target == "bf16" else range(100, 131)
    return [
        {
            "t": float(t),
            "kv_usage": 0.02 * ((t - base) % 100),
            "running": t % 4,
            "waiting": 0,
            "preemptions": 0,
            "prefix_queries": 10 * t,
            "prefix_hits": 4 * t,
        }
        for t in ts
    ]


def _manifest(trace: Path) -> dict[str, Any]:
    targets = {}
    for name, dtype in TARGETS.items():
        base = 0 if name == "bf16" else 100 if name == "fp8" else 200
        size = 20000 if dtype == "fp8" else 10000
        targets[name] = {
            "spec": {
                "name": name,
                "kv_cache_dtype": dtype,
                "expect_cache_dtype": dtype,
                "model": "/models/tiny",
            },
            "status": "ok",
            "reason": None,
            "engine_version": "0.11.0",
            "model_id": "tiny",
            "max_model_len": 4096,
            "server": {
                "pid": 1234,
                "url": "http://127.0.0.1:800" + ("1" if name == "fp8" else "0"),
            },
            "cache_config": {
                "cache_dtype": dtype,
                "kv_cache_size_tokens": str(size),
                "block_size": "16",
                "num_gpu_blocks": str(size // 16),
            },
            "scale_log_lines": ["Using KV cache scaling factor 1.0 for fp8_e4m3"]
            if dtype == "fp8"
            else [],
            "engine_config": {"kv_cache_dtype": dtype},
            "phases": {"c1": {"start": float(base), "end": base + 30.0}},
        }
    return {
        "tool": {"name": "kvcanary", "version": "0.1.0"},
        "command": ["replay", "--trace", str(trace)],
        "started_at": 1.7e9,
        "reference": "bf16",
        "schedules": ["c1"],
        "buckets": {"bounds": "256,1K", "labels": BUCKETS},
        "trace": {"path": str(trace), "sha256": None, "requests": 2 * N_PER_BUCKET, "bad_lines": 0},
        "targets": targets,
    }


def make_run_dir(root: Path, unlabeled: int = 0) -> Path:
    """A complete run directory, summarized by the project's own code. ``unlabeled`` adds that
    many requests without a check per bucket (graded against the reference's answers; fp8
    fails 3 in 5 of them in 256-1K) and teacher-forced scores (fp8 diverges in 256-1K)."""
    run = root / "run1"
    (run / "metrics").mkdir(parents=True)
    ids = _trace(root / "trace.jsonl", unlabeled)
    manifest = _manifest(root / "trace.jsonl")
    rng = random.Random(0)
    results = [
        _result(rid, t, bucket, k, rng) for t in TARGETS for k, (rid, bucket) in enumerate(ids)
    ]
    ref_text = {r.request_id: r.output_text for r in results if r.target == "bf16"}
    grades = [_grade(r, ref_text[r.request_id]) for r in results]
    series = {t: _series(t) for t in TARGETS}
    targets = {
        n: {
            "status": "ok",
            "reason": None,
            "cache_config": m["cache_config"],
            "phases": m["phases"],
        }
        for n, m in manifest["targets"].items()
    }
    tf_rows = [_tf(r) for r in results] if unlabeled else []
    # As the analysis builds it (replay.pipeline.analyse): targets and quality, then the systems
    # comparison with its throughput ratio, then the verdict on both.
    summary = Summary(
        version=SUMMARY_VERSION,
        targets=summarize_targets(results, targets, series, BUCKETS),
        quality=assess_quality(grades, tf_rows, "bf16", BUCKETS),
    )
    ratio = throughput_ratio(summary, "bf16", "fp8", "c1")
    compared = replace(systems(results, "bf16", "fp8", "c1"), throughput_ratio=ratio)
    summary = replace(summary, systems=compared)
    facts = facts_from_run(summary, Manifest.from_json(manifest), candidate="fp8")
    summary = replace(summary, verdict=decide(facts))
    _dump(run / "manifest.json", manifest)
    _dump(run / "summary.json", summary.to_json())
    _jsonl(run / "results.jsonl", [r.to_json() for r in results])
    _jsonl(run / "grades.jsonl", grades)
    for t, s in series.items():
        if s:
            _jsonl(run / "metrics" / f"{t}.jsonl", s)
    return run


# -- helpers ----------------------------------------------------------------------------------


class _Sections(HTMLParser):
    """Text of each section (by id) and the cell texts of its table rows."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.text: dict[str, str] = {}
        self.attrs: list[tuple[str, str]] = []
        self.rows: dict[str, list[list[str]]] = {}
        self._sec: str | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.attrs += [(k, v or "") for k, v in attrs]
        if tag == "section":
            self._sec = dict(attrs).get("id") or "_"
            self.text.setdefault(self._sec, "")
            self.rows.setdefault(self._sec, [])
        elif tag == "tr":
            self._row = []
        elif tag == "td":
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._row is not None and self._cell is not None:
            self._row.append("".join(self._cell))
            self._cell = None
        elif tag == "tr" and self._sec and self._row:
            self.rows[self._sec].append(self._row)
            self._row = None
        elif tag == "section":
            self._sec = None

    def handle_data(self, data: str) -> None:
        if self._sec:
            self.text[self._sec] += data
        if self._cell is not None:
            self._cell.append(data)


def sections(html: str) -> _Sections:
    p = _Sections()
    p.feed(html)
    return p


SECTION_IDS = [
    "verdict",
    "serving",
    "quality",
    "systems",
    "latency",
    "capacity",
    "kv-usage",
    "requests",
]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return make_run_dir(tmp_path)


# -- the full report --------------------------------------------------------------------------


def test_report_has_verdict_first_and_every_section(run_dir: Path) -> None:
    html = report.render_html(run_dir)
    assert html.startswith("<!DOCTYPE html>")
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["verdict"]["verdict"] == "calibrate"
    positions = [html.index(f'<section id="{s}"') for s in SECTION_IDS]
    assert positions == sorted(positions)
    s = sections(html)
    assert "CALIBRATE" in s.text["verdict"]
    assert "repeatable loss in 256-1K" in s.text["verdict"]
    assert "could not be rendered" not in html
    assert "not measured in this run" not in html
    assert html.count("<svg") == 2 + 1 + 2  # TTFT + ITL, capacity, one KV chart per server


def test_quality_rows_carry_intervals_and_noise_floor(run_dir: Path) -> None:
    rows = sections(report.render_html(run_dir)).rows["quality"]
    fp8 = {r[1]: r for r in rows if r[0] == "fp8"}
    assert set(fp8) == {"<256", "256-1K"}
    loss = fp8["256-1K"]
    assert re.fullmatch(r"60\.0% \[42\.\d, 75\.\d\] \(18/30\)", loss[2])  # Wilson interval
    assert loss[3] == formatting.DASH  # no derived grades here
    assert loss[4].startswith("-40.0 [-")  # paired Δ with its interval
    assert loss[5] == "30 (30 + 0)" and float(loss[6]) < 0.05  # pairs, McNemar p
    assert loss[7] == "+0.0 [+0.0, +0.0]"  # the A/A control's noise floor
    assert loss[11] == "loss shown"  # no "need N" for a loss
    ref = next(r for r in rows if r[0] == "bf16")
    assert ref[4:7] == ["reference", formatting.DASH, formatting.DASH]


def test_rows_follow_the_runs_order_not_sorted_keys(run_dir: Path) -> None:
    rows = sections(report.render_html(run_dir)).rows["quality"]
    assert [r[:2] for r in rows] == [
        [t, b] for t in ("bf16", "fp8", "bf16-control") for b in ("<256", "256-1K")
    ]


def test_serving_capacity_systems_and_kv_usage(run_dir: Path) -> None:
    s = sections(report.render_html(run_dir))
    serving = {r[0]: r for r in s.rows["serving"]}
    assert serving["fp8"][4] == "fp8" and serving["fp8"][5] == "20,000"
    assert serving["fp8"][10] == "none" and serving["bf16"][1] == "reference"
    capacity = {r[0]: r for r in s.rows["capacity"]}
    assert capacity["fp8"][3] == "2.00×"
    assert any(r[1] == "TTFT" for r in s.rows["systems"])
    kv = s.text["kv-usage"]
    assert "bf16: KV-cache usage over time (peak 60.0%)" in kv
    assert "bf16-control c1" in kv  # the control's phase, on the reference's server
    peaks = {r[0]: r[3] for r in s.rows["kv-usage"]}
    assert peaks == {"bf16": "60.0%", "fp8": "60.0%", "bf16-control": formatting.DASH}


def test_planted_payloads_are_text(run_dir: Path) -> None:
    html = report.render_html(run_dir)
    assert "<script" not in html.lower()
    assert "<img" not in html.lower()
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;"
    req = sections(html).text["requests"]
    # r0's prompt, fp8's answer, and the checker reason of each of the three targets
    assert req.count(PAYLOAD) == 5
    assert html.count(escaped) == 5
    assert "document.title=&#39;pwned&#39;" in html and "&lt;img src=x" in html


def test_self_contained(run_dir: Path) -> None:
    html = report.render_html(run_dir)
    assert "Content-Security-Policy" in html
    attrs = sections(html).attrs
    assert not [a for a in attrs if a[0] in ("src", "srcset", "action", "data", "poster")]
    assert {v[:1] for k, v in attrs if k == "href"} == {"#"}
    assert "url(" not in html and "@import" not in html
    # The SVG namespace, and the servers' URLs as text: nothing else names a network address.
    servers = ["http://127.0.0.1:8000"] * 2 + ["http://127.0.0.1:8001"]
    assert sorted(re.findall(r"https?://[^\s\"<]+", html)) == [
        *servers,
        *["http://www.w3.org/2000/svg"] * 5,
    ]


def test_prompt_excerpt_and_request_order(run_dir: Path) -> None:
    html = report.render_html(run_dir)
    req = sections(html).text["requests"]
    assert "HEAD " in req and " TAIL" in req and "characters omitted" in req
    first = re.search(r'<details class="req" open>\s*<summary><b>([^<]+)</b>', html)
    assert first and first.group(1) in {f"r{i}" for i in range(30, 60) if i % 5 < 2}
    assert "regressed" in req


def test_requests_chosen_from_the_scan_are_those_a_full_read_ranks_first(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report keeps a few facts per request (``present.run_scan``), not every row: the
    requests it shows, and their flags, are those that ranking every attempt would show."""
    from replay.present.reading import load_run

    run = load_run(run_dir)
    results = [orjson.loads(x) for x in (run_dir / "results.jsonl").read_bytes().splitlines()]
    grades = {
        (g["target"], g["phase"], g["request_id"]): g
        for g in map(orjson.loads, (run_dir / "grades.jsonl").read_bytes().splitlines())
    }
    by_id: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_id.setdefault(r["request_id"], []).append(r)
    ranked = []
    for i, (rid, rs) in enumerate(by_id.items()):
        attempts = [
            request_views._attempt(r, grades.get((r["target"], r["phase"], rid))) for r in rs
        ]
        flags = request_views._flags(run, attempts)
        ranked.append((request_views._severity(flags), i, rid, flags))
    ranked.sort()
    assert {f for *_, flags in ranked for f in flags} >= {"regressed", "differs"}
    monkeypatch.setattr(request_views, "MAX_REQUESTS", 25)
    view = request_views.requests_view(run)
    assert view["total"] == len(by_id)
    assert [(x["id"], x["flags"]) for x in view["items"]] == [(r, f) for *_, r, f in ranked[:25]]


def test_request_cap(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_views, "MAX_REQUESTS", 5)
    html = report.render_html(run_dir)
    assert html.count('<details class="req"') == 5
    assert "60 requests; showing the first 5" in html


def test_prompt_not_available_without_trace(run_dir: Path) -> None:
    (run_dir.parent / "trace.jsonl").unlink()
    req = sections(report.render_html(run_dir)).text["requests"]
    assert "prompt not available" in req and "not found" in req


def test_changed_trace_is_noted(run_dir: Path) -> None:
    m = orjson.loads((run_dir / "manifest.json").read_bytes())
    m["trace"]["sha256"] = "0" * 64
    _dump(run_dir / "manifest.json", m)
    assert "has changed since the run" in report.render_html(run_dir)


def test_missing_values_are_dashes_not_zeros(run_dir: Path) -> None:
    s = orjson.loads((run_dir / "summary.json").read_bytes())
    s["targets"]["fp8"]["kv_cache_size_tokens"] = None
    s["targets"]["fp8"]["phases"]["c1"]["buckets"]["<256"]["ttft_ms"] = {
        "mean": None,
        "p50": None,
        "p90": None,
        "p99": None,
    }
    _dump(run_dir / "summary.json", s)
    m = orjson.loads((run_dir / "manifest.json").read_bytes())
    del m["targets"]["fp8"]["cache_config"]["kv_cache_size_tokens"]
    _dump(run_dir / "manifest.json", m)
    sec = sections(report.render_html(run_dir))
    cap = {r[0]: r for r in sec.rows["capacity"]}
    assert cap["fp8"][2] == formatting.DASH and cap["fp8"][3] == formatting.DASH
    lat = [r for r in sec.rows["latency"] if r[:2] == ["fp8", "<256"]]
    assert lat[0][5] == " / ".join([formatting.DASH] * 3)


# -- partial and odd run directories ---------------------------------------------------------


def test_empty_run_dir(tmp_path: Path) -> None:
    html = report.render_html(tmp_path)
    s = sections(html)
    assert set(SECTION_IDS) <= set(s.text)
    for sid in SECTION_IDS:
        assert "not measured in this run" in s.text[sid], sid
    assert "NO VERDICT" in s.text["verdict"]
    assert "not measured in this run" in report.render_markdown(tmp_path)


def test_failed_target_run(run_dir: Path) -> None:
    """Like a run where the fp8 server did not start: no results or grades for it."""
    s = orjson.loads((run_dir / "summary.json").read_bytes())
    s["targets"]["fp8"].update(
        status="failed",
        reason="server did not start: exit 1",
        cache_dtype=None,
        kv_cache_size_tokens=None,
        phases={},
    )
    facts = facts_from_run(Summary.from_json(s), Manifest.from_json({}), candidate="fp8")
    s["verdict"] = decide(facts).to_json()
    del s["systems"]
    _dump(run_dir / "summary.json", s)
    html = report.render_html(run_dir)
    sec = sections(html)
    assert "REJECT" in sec.text["verdict"]
    serving = {r[0]: r for r in sec.rows["serving"]}
    assert serving["fp8"][2] == "failed" and "server did not start" in serving["fp8"][10]
    assert "Systems comparison: not measured in this run" in sec.text["systems"]


@pytest.mark.parametrize("key", ["targets", "quality", "systems", "verdict", "version"])
@pytest.mark.parametrize("junk", [None, "text", 3, [1, 2], {"x": [None]}])
def test_odd_summary_values_never_crash(run_dir: Path, key: str, junk: Any) -> None:
    s = orjson.loads((run_dir / "summary.json").read_bytes())
    s[key] = junk
    _dump(run_dir / "summary.json", s)
    s_html = sections(report.render_html(run_dir))
    assert set(SECTION_IDS) <= set(s_html.text)
    report.render_markdown(run_dir)


def _paths(doc: Any, pre: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    items = (
        doc.items()
        if isinstance(doc, dict)
        else enumerate(doc[:2])
        if isinstance(doc, list)
        else ()
    )
    return [p for k, v in items for p in [(*pre, k), *_paths(v, (*pre, k))]]


def _junk_copies(
    doc: Any, paths: list[tuple[Any, ...]], rng: random.Random
) -> Iterator[tuple[tuple[Any, ...], Any, Any]]:
    """40 copies of ``doc``, each with the value at one of ``paths`` (drawn by ``rng``)
    replaced by junk: (path, junk, copy)."""
    for _ in range(40):
        path, junk = rng.choice(paths), rng.choice([None, "x", -1.5, [1, 2], {"x": [None]}])
        copy = orjson.loads(orjson.dumps(doc))
        node = copy
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = junk
        yield path, junk, copy


@pytest.mark.parametrize("name", ["summary.json", "manifest.json"])
def test_odd_nested_values_never_crash(run_dir: Path, name: str) -> None:
    """Any value anywhere replaced by junk: every section still renders."""
    doc = orjson.loads((run_dir / name).read_bytes())
    for path, junk, copy in _junk_copies(doc, _paths(doc), random.Random(name)):
        _dump(run_dir / name, copy)
        html = report.render_html(run_dir)
        assert "could not be rendered" not in html, (path, junk)
        report.render_markdown(run_dir)


def test_odd_rows_never_crash(run_dir: Path) -> None:
    with (run_dir / "results.jsonl").open("a") as fh:
        fh.write('{"request_id": 5, "target": null, "chunk_times": "x", "ttft": "fast"}\n')
        fh.write("[1, 2]\n{not json\n")
    with (run_dir / "grades.jsonl").open("a") as fh:
        fh.write('{"grade": "yes", "agreement": 3}\n')
    (run_dir / "metrics" / "fp8.jsonl").write_text('{"t": "now", "kv_usage": null}\n')
    html = report.render_html(run_dir)
    assert "results.jsonl: 2 unreadable line(s) skipped" in html
    assert "could not be rendered" not in html


# -- Markdown and files -----------------------------------------------------------------------


def test_markdown(run_dir: Path) -> None:
    text = report.render_markdown(run_dir)
    assert text.startswith("## kvcanary `run1`: CALIBRATE")
    assert "repeatable loss in 256-1K" in text
    assert "### Evidence" in text and "### Serving path" in text
    assert "| fp8 | 256-1K | 60.0% [" in text and "(18/30) | — | -40.0 [" in text
    assert "### Latency" in text and "| 256-1K | TTFT |" in text
    assert "<" not in text.replace("&lt;", "")  # bucket "<256" escaped too


def test_markdown_cells_are_escaped() -> None:
    assert markdown.md("a|b\n<script>") == "a\\|b &lt;script&gt;"


def test_markdown_tables_keep_their_shape(run_dir: Path) -> None:
    s = orjson.loads((run_dir / "summary.json").read_bytes())
    s["verdict"]["evidence"].append({"kind": "serving", "text": "a | b <b>"})
    s["targets"]["fp8"]["cache_dtype"] = "fp8|e4m3"
    _dump(run_dir / "summary.json", s)
    text = report.render_markdown(run_dir)
    assert "a \\| b &lt;b&gt;" in text and "fp8\\|e4m3" in text
    table: list[int] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            table.append(len(re.findall(r"(?<!\\)\|", line)))
        elif table:
            assert len(set(table)) == 1, table
            table = []


def test_write_reports(run_dir: Path) -> None:
    html_path, md_path = report.write_reports(run_dir)
    assert (html_path, md_path) == (run_dir / "report.html", run_dir / "report.md")
    assert html_path.read_text(encoding="utf-8") == report.render_html(run_dir)
    assert md_path.read_text(encoding="utf-8") == report.render_markdown(run_dir)
    assert not list(run_dir.glob("*.tmp"))


# -- pieces ------------------------------------------------------------------------------------


def test_formatting_of_missing_values() -> None:
    for f in (
        formatting.f_sig,
        formatting.f_int,
        formatting.f_pct,
        formatting.f_pts,
        formatting.f_p,
        formatting.f_ratio,
    ):
        assert f(None) == formatting.DASH
        assert f(float("nan")) == formatting.DASH
        assert f(True) == formatting.DASH
    assert formatting.f_pct(0.0) == "0.0%" and formatting.f_sig(0) == "0.00"
    assert (
        formatting.f_est(-0.1, -0.2, None, formatting.f_pts) == f"-10.0 [-20.0, {formatting.DASH}]"
    )


def test_charts() -> None:
    assert charts.box_chart([("bucket a", [("x", "#000", [])])], "ms", "t") is None
    chart = charts.box_chart(
        [("bucket a", [("x", "#000", [1.0, 2.0, 3.0]), ("y", "#111", [])])], "ms", "t"
    )
    assert chart is not None and any(s.text == "no data" for s in chart.shapes)
    assert charts.bar_chart([("a", "#000", None)], "tokens", "t") is None
    assert charts.line_chart([], "#000", [], "t") is None
    top, ticks = charts._axis(87.0)
    assert top == 100 and ticks[0] == 0 and ticks[-1] == 100
    assert len(charts._thin([(float(i), 0.0) for i in range(10000)], 100)) == 100


def test_replay_compare_two_runs(tmp_path: Path) -> None:
    import subprocess
    import sys

    a = make_run_dir(tmp_path / "a")
    b = make_run_dir(tmp_path / "b")
    out = subprocess.run(
        [sys.executable, "-m", "replay.cli", "compare", str(a), str(b)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "verdict: calibrate -> calibrate" in out.stdout
    assert "Δ pass" in out.stdout and "fp8" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "replay.cli", "compare", str(a), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "summary.json" in bad.stderr


def test_explicit_and_derived_grades_side_by_side_and_the_warning(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path, unlabeled=10)
    s = sections(report.render_html(run_dir))
    fp8 = {r[1]: r for r in s.rows["quality"] if r[0] == "fp8"}
    # Derived pass rates beside the explicit ones; the Δ and the evidence take every pair.
    assert re.fullmatch(r"40\.0% \[\d+\.\d, \d+\.\d\] \(4/10\)", fp8["256-1K"][3])
    assert fp8["256-1K"][5] == "40 (30 + 10)" and fp8["256-1K"][11] == "loss shown"
    assert fp8["<256"][3].startswith("100.0%") and fp8["<256"][5] == "40 (30 + 10)"
    assert "needed" in fp8["<256"][11]  # open: the only bucket that names N
    verdict = s.text["verdict"]
    assert "30 explicit, 10 derived" in verdict
    assert "teacher-forced ΔNLL +0.800/token" in verdict and "early warning" in verdict
    md = report.render_markdown(run_dir)
    assert "| fp8 | 256-1K | 60.0% [" in md and "(4/10) |" in md


def test_an_emulated_target_never_shows_fp8_capacity(run_dir: Path) -> None:
    """Emulated FP8 (kvcal's plugin in a BF16 server): its quality rows stay, its served dtype
    says emulated, and its capacity is never presented as FP8's."""
    manifest = orjson.loads((run_dir / "manifest.json").read_bytes())
    spec = manifest["targets"]["fp8"]["spec"]
    spec["kv_cache_dtype"] = spec["expect_cache_dtype"] = "fp8-emulated"
    write_json(run_dir / "manifest.json", manifest)
    s = sections(report.render_html(run_dir))
    serving = {r[0]: r for r in s.rows["serving"]}
    assert serving["fp8"][3] == "fp8-emulated" and serving["fp8"][4].endswith("(emulated FP8)")
    capacity = {r[0]: r for r in s.rows["capacity"]}
    assert capacity["fp8"][3] == "not FP8's: emulated"
    assert "emulated FP8" in s.text["systems"]
    assert any(r[0] == "fp8" for r in s.rows["quality"])


def test_several_candidates_each_show_their_verdict(run_dir: Path) -> None:
    """Each candidate's verdict (summary ``candidates``) is a row under the run's verdict, in
    the HTML and the Markdown report; an emulated format's capacity is its bytes' only."""
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    other = {
        "verdict": "reject",
        "exit_code": 12,
        "headline": "REJECT int8_per_token_head for this path: no calibration applies",
        "reasons": ["no calibration applies"],
        "evidence": [],
    }
    summary["candidates"] = {"fp8": summary["verdict"], "int8_per_token_head": other}
    write_json(run_dir / "summary.json", summary)
    md = report.render_markdown(run_dir)
    assert "### Every candidate" in md
    assert "| int8_per_token_head | int8_per_token_head | REJECT | 12 |" in md
    s = sections(report.render_html(run_dir))
    assert "REJECT int8_per_token_head for this path" in s.text["verdict"]
