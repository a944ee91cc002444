"""Reports of a run directory: one self-contained HTML file and a Markdown summary.

The HTML report opens without network access: CSS is inline, the charts are inline SVG drawn
here, there is no script, and a Content-Security-Policy forbids loading anything. It puts the
verdict and its evidence first, then the serving path, quality per bucket (intervals, noise
floor), the systems comparison, latency distributions, capacity, KV usage over time and a
per-request drill-down. The Markdown report (for a PR comment) has the verdict, its evidence,
the serving-path findings and per-bucket quality and latency tables.

Model and trace text is data: the template autoescapes everything, and nothing here marks text
as safe. Charts are lists of plain shapes (``Shape``) that the template draws, so labels in
them are escaped too. Any file or key may be missing (older or partial runs): a missing value
renders as a dash, a missing section says "not measured in this run", and a section whose data
has an unexpected shape says so instead of failing the whole report.
"""

from __future__ import annotations

import functools
import math
import os
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import jinja2
import numpy as np
import orjson

from replay.analysis.roles import Roles
from replay.analysis.schemas import (
    BucketQuality,
    Combined,
    Comparison,
    DerivedComparison,
    LatencyDelta,
    NoiseFloor,
    Percentiles,
    Summary,
    SystemsBucket,
    TargetSummary,
    VsReference,
)
from replay.analysis.verdict.serving_path import serving_problems
from replay.analysis.verdict.wording import VERDICTS
from replay.run.rundir import GRADES, MANIFEST, RESULTS, SUMMARY, file_digest
from replay.serving.scale_log import is_emulated

TEMPLATE = "report_template.html.j2"
DASH = "—"
MAX_REQUESTS = 500
ANSWER_CHARS = 500
PROMPT_HEAD = PROMPT_TAIL = 300
CONTROL_SUFFIX = "-control"
PALETTE = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#0891b2", "#be185d")
CONTROL_COLOR = "#64748b"
T = TypeVar("T")
SHORT = {
    "keep": "KEEP",
    "calibrate": "CALIBRATE",
    "per_head_or_skip_layers": "PER-HEAD / SKIP LAYERS",
    "reject": "REJECT",
    "insufficient_evidence": "INSUFFICIENT EVIDENCE",
    "emulated": "EMULATED: NO VERDICT",
}


# -- tolerant access to JSON ----------------------------------------------------------------


def obj(x: object) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def lst(x: object) -> list[Any]:
    return x if isinstance(x, list) else []


def dig(x: object, *keys: str) -> Any:
    """``x[k1][k2]...`` or None where a key is missing or a level is not an object."""
    for k in keys:
        if not isinstance(x, dict):
            return None
        x = x.get(k)
    return x


def num(x: object) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


def text(x: object) -> str:
    return DASH if x is None or x == "" else str(x)


# -- formatting: None is a dash, never 0 ----------------------------------------------------


def f_sig(x: object) -> str:
    v = num(x)
    if v is None:
        return DASH
    a = abs(v)
    return f"{v:,.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}"


def f_int(x: object) -> str:
    v = num(x)
    return DASH if v is None else f"{v:,.0f}"


def f_pct(x: object) -> str:
    v = num(x)
    return DASH if v is None else f"{100 * v:.1f}%"


def f_pts(x: object) -> str:
    v = num(x)
    return DASH if v is None else f"{100 * v:+.1f}"


def f_p(x: object) -> str:
    v = num(x)
    return DASH if v is None else f"{v:.3g}"


def f_ratio(x: object) -> str:
    v = num(x)
    return DASH if v is None else f"{v:.2f}×"


def f_bool(x: object) -> str:
    return DASH if not isinstance(x, bool) else ("yes" if x else "no")


def f_ci(lo: object, hi: object, fmt: Callable[[object], str]) -> str:
    return DASH if num(lo) is None and num(hi) is None else f"[{fmt(lo)}, {fmt(hi)}]"


def f_est(x: object, lo: object, hi: object, fmt: Callable[[object], str]) -> str:
    """An estimate with its interval: ``-3.0 [-8.1, +1.9]``."""
    ci = f_ci(lo, hi, fmt)
    return fmt(x) if ci == DASH else f"{fmt(x)} {ci}"


# -- the run directory ------------------------------------------------------------------------


@dataclass
class Run:
    dir: Path
    manifest: dict[str, Any]
    summary: Summary  # read leniently: a value of the wrong type is a problem, and a dash
    results: list[dict[str, Any]]
    grades: list[dict[str, Any]]
    series: dict[str, list[dict[str, Any]]]
    problems: list[str] = field(default_factory=list)

    @property
    def reference(self) -> str | None:
        q = self.summary.quality
        ref = (q.reference if q else None) or self.manifest.get("reference")
        return ref if isinstance(ref, str) else None

    def targets(self) -> list[str]:
        """Every target, in the run's order (the reference first)."""
        names: list[object] = [*obj(self.manifest.get("targets")), *self.summary.targets]
        names += [r.get("target") for r in self.results]
        out = list(dict.fromkeys(n for n in names if isinstance(n, str)))
        return sorted(out, key=lambda n: (n != self.reference, n.endswith(CONTROL_SUFFIX)))

    def candidate(self) -> str | None:
        systems = self.summary.systems
        if systems is not None and systems.candidate is not None:
            return systems.candidate
        return self.roles().candidate

    def emulated(self, name: object) -> bool:
        """An emulated FP8 target: its quality is FP8's, its capacity and speed BF16's."""
        return isinstance(name, str) and is_emulated(obj(dig(self.manifest, "targets", name)))

    def roles(self) -> Roles:
        return Roles.from_manifest(
            self.manifest, [n for n in self.targets() if not n.endswith(CONTROL_SUFFIX)]
        )

    def phases(self) -> list[str]:
        q = self.summary.quality
        names = [*lst(self.manifest.get("schedules")), *(q.phases if q else ())]
        names += [p for t in self.summary.targets.values() for p in t.phases]
        names += [r.get("phase") for r in self.results]
        return list(dict.fromkeys(n for n in names if isinstance(n, str)))

    def in_order(self, items: Mapping[str, T], kind: str) -> list[tuple[str, T]]:
        """Items in the run's order of buckets, targets or phases (summary.json is written
        with sorted keys, which would put "256-1K" before "<256")."""
        order = {
            "bucket": [str(b) for b in lst(dig(self.manifest, "buckets", "labels"))],
            "target": self.targets(),
            "phase": self.phases(),
        }[kind]
        return sorted(
            items.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)
        )

    def color(self, target: str) -> str:
        if target.endswith(CONTROL_SUFFIX):
            return CONTROL_COLOR
        plain = [n for n in self.targets() if not n.endswith(CONTROL_SUFFIX)]
        return PALETTE[plain.index(target) % len(PALETTE)] if target in plain else PALETTE[-1]


def _read_object(path: Path, problems: list[str]) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return obj(orjson.loads(path.read_bytes()))
    except (OSError, orjson.JSONDecodeError) as exc:
        problems.append(f"{path.name}: unreadable ({exc})")
        return {}


def _read_lines(path: Path, problems: list[str]) -> list[dict[str, Any]]:
    """JSON objects of a JSONL file; bad lines (a run cut short) are counted, not fatal."""
    if not path.exists():
        return []
    out, bad = [], 0
    with path.open("rb") as fh:
        for raw in fh:
            if not raw.strip():
                continue
            try:
                row = orjson.loads(raw)
            except orjson.JSONDecodeError:
                row = None
            if isinstance(row, dict):
                out.append(row)
            else:
                bad += 1
    if bad:
        problems.append(f"{path.name}: {bad} unreadable line(s) skipped")
    return out


def load_run(run_dir: Path) -> Run:
    problems: list[str] = []
    series = {}
    metrics = run_dir / "metrics"
    if metrics.is_dir():
        series = {p.stem: _read_lines(p, problems) for p in sorted(metrics.glob("*.jsonl"))}
    manifest = _read_object(run_dir / MANIFEST, problems)
    summary = Summary.from_json(
        _read_object(run_dir / SUMMARY, problems), where=SUMMARY, problems=problems
    )
    return Run(
        run_dir,
        manifest,
        summary,
        _read_lines(run_dir / RESULTS, problems),
        _read_lines(run_dir / GRADES, problems),
        series,
        problems,
    )


# -- prompts from the trace -------------------------------------------------------------------


def trace_file(run: Run) -> tuple[Path | None, str]:
    """The run's trace file, if it can be found, and a note (for a changed or missing one)."""
    raw = dig(run.manifest, "trace", "path")
    if not isinstance(raw, str) or not raw:
        return None, "the manifest names no trace file"
    p = Path(raw)
    roots = [Path.cwd(), run.dir.resolve().parent.parent, run.dir.resolve().parent]
    found = [q for q in ([p] if p.is_absolute() else [r / p for r in roots]) if q.is_file()]
    if not found:
        return None, f"trace file {raw} not found"
    digest = dig(run.manifest, "trace", "sha256")
    for q in found:
        if not isinstance(digest, str) or file_digest(q) == digest:
            return q, ""
    return found[0], f"{found[0]} has changed since the run (sha256 differs): prompts may not match"


def prompt_text(rec: Mapping[str, Any]) -> str:
    """A trace record's prompt as readable text (chat messages, text, token ids or synth)."""
    messages = rec.get("messages")
    if isinstance(messages, list):
        return "\n".join(
            f"[{obj(m).get('role', '?')}] {_content(obj(m).get('content'))}" for m in messages
        )
    prompt = rec.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        head = " ".join(str(t) for t in prompt[:24])
        return f"({len(prompt)} token ids) {head}{' …' if len(prompt) > 24 else ''}"
    synth = obj(rec.get("synth"))
    if synth:
        return (
            f"(synthetic prompt: {synth.get('input_tokens')} tokens, hash ids "
            f"{synth.get('hash_ids', [])})"
        )
    return "(no prompt in the trace record)"


def _content(content: object) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return " ".join(str(obj(p).get("text", f"({obj(p).get('type', 'part')})")) for p in content)
    return "" if content is None else str(content)


def excerpt(s: str, head: int = PROMPT_HEAD, tail: int = PROMPT_TAIL) -> str:
    if len(s) <= head + tail + 40:
        return s
    return f"{s[:head]}\n… [{len(s) - head - tail:,} characters omitted] …\n{s[-tail:]}"


def load_prompts(run: Run, ids: Iterable[str]) -> tuple[dict[str, str], str]:
    """Prompt excerpts of the given request ids, and a note when the trace is unavailable."""
    path, note = trace_file(run)
    if path is None:
        return {}, note
    wanted, out = set(ids), {}
    with path.open("rb") as fh:
        for raw in fh:
            try:
                rec = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            rid = str(obj(rec).get("id"))
            if rid in wanted and rid not in out:
                out[rid] = excerpt(prompt_text(obj(rec)))
    return out, note


# -- view models: tables and charts -----------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    text: str
    cls: str = ""
    title: str = ""


@dataclass
class Table:
    headers: list[str]
    rows: list[list[Cell]] = field(default_factory=list)
    caption: str = ""

    def add(self, *cells: str | Cell) -> None:
        self.rows.append([c if isinstance(c, Cell) else Cell(c, _numeric(c)) for c in cells])


NUMERIC = re.compile(r"[+\-]?\d[\d,]*(\.\d+)?[%×]?(\s.*)?")


def _numeric(s: str) -> str:
    """Right-align numbers (with an interval or a count after them), not labels like 256-1K."""
    return "num" if NUMERIC.fullmatch(s) else ""


@dataclass(frozen=True)
class Shape:
    """One SVG element: rect, line, text or poly (a polyline)."""

    kind: str
    x: float = 0.0
    y: float = 0.0
    w: float = 0.0
    h: float = 0.0
    x2: float = 0.0
    y2: float = 0.0
    color: str = "#334155"
    opacity: float = 1.0
    text: str = ""
    anchor: str = "start"
    size: int = 11
    bold: bool = False
    points: str = ""
    dash: str = ""
    title: str = ""


@dataclass
class Chart:
    width: int
    height: int
    label: str
    shapes: list[Shape]


def _axis(hi: float, n: int = 5) -> tuple[float, list[float]]:
    """A round upper bound >= hi and its ticks."""
    hi = hi if hi > 0 else 1.0
    mag = 10 ** math.floor(math.log10(hi / n))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= hi / n)
    top = math.ceil(hi / step - 1e-9) * step
    return top, [i * step for i in range(round(top / step) + 1)]


def _xaxis(
    x0: float, x1: float, y: float, top: float, ticks: Sequence[float], unit: str, y_top: float
) -> list[Shape]:
    out = []
    for t in ticks:
        x = round(x0 + (x1 - x0) * t / top, 1)
        out += [
            Shape("line", x, y_top, x2=x, y2=y, color="#e2e8f0"),
            Shape("text", x, y + 14, text=f"{t:,.6g}", anchor="middle", size=10, color="#64748b"),
        ]
    return [*out, Shape("text", x1, y + 28, text=unit, anchor="end", size=10, color="#64748b")]


BoxRow = tuple[str, str, Sequence[float]]  # (label, color, values)


def box_chart(
    groups: Sequence[tuple[str, Sequence[BoxRow]]],
    unit: str,
    label: str,
) -> Chart | None:
    """Horizontal box plots (box p25-p75, median, whiskers p5-p95), one row per label, in
    groups (buckets). None when there is nothing to draw."""
    stats = [(g, [(name, color, _quantiles(v)) for name, color, v in rows]) for g, rows in groups]
    highs = [q[4] for _, rows in stats for _, _, q in rows if q]
    if not highs:
        return None
    top, ticks = _axis(max(highs))
    left, right, row_h, width = 200.0, 760.0, 20, 960
    y, shapes = 6.0, []
    for group, rows in stats:
        shapes.append(Shape("text", 4, y + 13, text=group, bold=True))
        y += row_h
        for name, color, q in rows:
            shapes += _box_row(name, color, q, y, left, right, top, unit)
            y += row_h
    shapes = _xaxis(left, right, y + 4, top, ticks, unit, 6) + shapes
    return Chart(width, int(y + 40), label, shapes)


def _quantiles(values: Sequence[float]) -> tuple[float, ...] | None:
    if not len(values):
        return None
    return tuple(float(v) for v in np.percentile(np.asarray(values, float), (5, 25, 50, 75, 95)))


def _box_row(
    name: str,
    color: str,
    q: tuple[float, ...] | None,
    y: float,
    left: float,
    right: float,
    top: float,
    unit: str,
) -> list[Shape]:
    out = [Shape("text", 20, y + 14, text=name, color=color)]
    if q is None:
        return [*out, Shape("text", left, y + 14, text="no data", color="#94a3b8")]

    def sx(v: float) -> float:
        return round(left + (right - left) * min(v, top) / top, 1)

    tip = (
        f"{name}: p5 {f_sig(q[0])}, p25 {f_sig(q[1])}, median {f_sig(q[2])}, "
        f"p75 {f_sig(q[3])}, p95 {f_sig(q[4])} {unit}"
    )
    mid = y + 10
    return [
        *out,
        Shape("line", sx(q[0]), mid, x2=sx(q[4]), y2=mid, color=color),
        Shape(
            "rect",
            sx(q[1]),
            y + 4,
            w=max(1.0, sx(q[3]) - sx(q[1])),
            h=12,
            color=color,
            opacity=0.35,
            title=tip,
        ),
        Shape("line", sx(q[2]), y + 3, x2=sx(q[2]), y2=y + 17, color=color),
        Shape(
            "text", right + 8, y + 14, text=f"median {f_sig(q[2])} {unit}", size=10, color="#475569"
        ),
    ]


def line_chart(
    points: Sequence[tuple[float, float]],
    color: str,
    windows: Sequence[tuple[str, float, float]],
    label: str,
) -> Chart | None:
    """A usage fraction over seconds since its first point, with phase windows shaded. The
    y axis runs to a round value above the peak (at most 100%) so a small peak stays visible;
    its top label says where that is."""
    if not points:
        return None
    t0 = points[0][0]
    top, ticks = _axis(max(points[-1][0] - t0, 1.0), 8)
    ytop = min(1.0, _axis(max(max(v for _, v in points), 0.01), 2)[0])
    left, right, y0, y1, width = 50.0, 940.0, 10.0, 150.0, 960

    def sx(t: float) -> float:
        return round(left + (right - left) * (min(max(t, t0), t0 + top) - t0) / top, 1)

    def sy(v: float) -> float:
        return round(y1 - (y1 - y0) * max(0.0, min(v / ytop, 1.0)), 1)

    shapes = _xaxis(left, right, y1, top, ticks, "s", y0)
    for i, (name, a, b) in enumerate(windows):  # labels alternate rows: windows can be narrow
        if sx(b) > sx(a):
            shapes += [
                Shape(
                    "rect",
                    sx(a),
                    y0,
                    w=sx(b) - sx(a),
                    h=y1 - y0,
                    color="#94a3b8",
                    opacity=0.12,
                    title=name,
                ),
                Shape(
                    "text", sx(a) + 3, y0 + 11 + 12 * (i % 2), text=name, size=10, color="#475569"
                ),
            ]
    for v in (0.0, ytop / 2, ytop):
        shapes += [
            Shape("line", left, sy(v), x2=right, y2=sy(v), color="#e2e8f0"),
            Shape(
                "text",
                left - 6,
                sy(v) + 4,
                text=f"{100 * v:.3g}%",
                anchor="end",
                size=10,
                color="#64748b",
            ),
        ]
    pts = " ".join(f"{sx(t)},{sy(v)}" for t, v in _thin(points))
    shapes.append(Shape("poly", points=pts, color=color))
    return Chart(width, int(y1 + 36), label, shapes)


def _thin(points: Sequence[tuple[float, float]], n: int = 1500) -> list[tuple[float, float]]:
    """At most about n points, keeping each stretch's peak (peaks are what matter here)."""
    k = math.ceil(len(points) / n)
    if k <= 1:
        return list(points)
    return [max(points[i : i + k], key=lambda p: p[1]) for i in range(0, len(points), k)]


def bar_chart(
    bars: Sequence[tuple[str, str, float | None]],
    unit: str,
    label: str,
) -> Chart | None:
    """Horizontal bars (label, color, value); a missing value is a dash, not a zero bar."""
    values = [v for _, _, v in bars if v is not None]
    if not values:
        return None
    top, ticks = _axis(max(values))
    left, right, row_h, width = 200.0, 760.0, 26, 960
    shapes: list[Shape] = []
    for i, (name, color, v) in enumerate(bars):
        y = 6.0 + i * row_h
        shapes.append(Shape("text", 4, y + 15, text=name, color=color))
        w = 0.0 if v is None else (right - left) * v / top
        if v is not None:
            shapes.append(
                Shape(
                    "rect",
                    left,
                    y + 3,
                    w=max(1.0, round(w, 1)),
                    h=16,
                    color=color,
                    opacity=0.8,
                    title=f"{name}: {f_int(v)} {unit}",
                )
            )
        shapes.append(Shape("text", left + w + 6, y + 15, text=f"{f_int(v)} {unit}", size=10))
    y_axis = 6.0 + len(bars) * row_h + 4
    return Chart(
        width, int(y_axis + 36), label, _xaxis(left, right, y_axis, top, ticks, unit, 6) + shapes
    )


# -- sections -------------------------------------------------------------------------------


def verdict_view(run: Run) -> dict[str, Any]:
    v = run.summary.verdict
    kind = (v.verdict if v else None) or None
    title = VERDICTS.get(kind or "", (None, ""))[1]
    ev = Table(
        [
            "Kind",
            "Bucket",
            "Finding",
            "Pairs",
            "Δ pass rate, pts [95% CI]",
            "McNemar p",
            "Noise floor (low end, pts)",
        ]
    )
    # An evidence entry is the verdict's own JSON object (its keys depend on its kind).
    for e in v.evidence if v else ():
        ev.add(
            text(e.get("kind")),
            text(e.get("bucket")),
            Cell(text(e.get("text"))),
            f_int(e.get("pairs")),
            f_est(e.get("diff"), e.get("lo"), e.get("hi"), f_pts),
            f_p(e.get("mcnemar_p")),
            f_pts(e.get("floor_lo")),
        )
    headline = v.headline if v else None
    return {
        "present": v is not None,
        "kind": kind or "none",
        "word": SHORT.get(kind or "", (kind or "no verdict").upper()),
        "title": title,
        "headline": text(headline),
        "exit_code": text(v.exit_code if v else None),
        "reasons": [r for r in (v.reasons if v else ()) if not str(headline).endswith(r)],
        "evidence": ev,
        "glance": glance(run),
    }


def glance(run: Run) -> list[tuple[str, str]]:
    """A few numbers beside the verdict: who was compared, on how much, what FP8 gains."""
    ref, cand = run.reference, run.candidate()
    t_ref, t_cand = (run.summary.targets.get(n or "") for n in (ref, cand))
    a, b = (t.kv_cache_size_tokens if t else None for t in (t_ref, t_cand))
    cap = b / a if a and b and not run.emulated(cand) else None
    q, systems = run.summary.quality, run.summary.systems
    first = next(iter(run.in_order(q.phases, "phase")), None) if q else None
    arm = first[1].get(cand or "") if first else None
    vs = arm.all.vs_reference if arm else None
    return [
        ("reference", text(ref)),
        ("candidate", text(cand)),
        (
            "status (reference / candidate)",
            f"{text(t_ref.status if t_ref else None)} / {text(t_cand.status if t_cand else None)}",
        ),
        ("graded pairs", f_int(vs.pairs if vs else None)),
        ("KV-cache capacity", f_ratio(cap)),
        ("throughput", f_ratio(systems.throughput_ratio if systems else None)),
    ]


def serving_view(run: Run) -> dict[str, Any]:
    t = Table(
        [
            "Target",
            "Role",
            "Status",
            "Expected cache dtype",
            "Served cache dtype",
            "KV cache (tokens)",
            "Engine",
            "Model",
            "Max model len",
            "Server",
            "Findings",
        ]
    )
    details = []
    for name in run.targets():
        m = obj(dig(run.manifest, "targets", name))
        s = run.summary.targets.get(name) or TargetSummary.from_json({})
        served = s.cache_dtype or dig(m, "cache_config", "cache_dtype")
        findings = _findings(run, name, m, s, served)
        server = obj(m.get("server"))
        t.add(
            Cell(name, title=text(dig(m, "spec", "model"))),
            _role(run, name),
            Cell(
                text(s.status or m.get("status")),
                "good" if (s.status or m.get("status")) == "ok" else "bad",
            ),
            text(dig(m, "spec", "expect_cache_dtype") or dig(m, "spec", "kv_cache_dtype")),
            text(served) + (" (emulated FP8)" if run.emulated(name) else ""),
            f_int(
                s.kv_cache_size_tokens
                or num(_float(dig(m, "cache_config", "kv_cache_size_tokens")))
            ),
            text(m.get("engine_version")),
            text(m.get("model_id")),
            f_int(m.get("max_model_len")),
            text(server.get("url")) + (f" (pid {server['pid']})" if server.get("pid") else ""),
            Cell("; ".join(findings) or "none", "bad" if findings else "good"),
        )
        details.append(
            {
                "name": name,
                "reason": m.get("reason") or s.reason,
                "scale_lines": [str(x) for x in lst(m.get("scale_log_lines"))],
                "engine": sorted((str(k), str(v)) for k, v in obj(m.get("engine_config")).items()),
                "cache": sorted((str(k), str(v)) for k, v in obj(m.get("cache_config")).items()),
                "problems": [str(x) for x in lst(m.get("problems"))],
            }
        )
    return {"table": t if t.rows else None, "details": details}


def _role(run: Run, name: str) -> str:
    if name == run.reference:
        return "reference"
    if name.endswith(CONTROL_SUFFIX):
        return "A/A control"
    return "calibrated" if name == run.roles().calibrated else "candidate"


def _float(x: object) -> float | None:
    try:
        return float(x) if isinstance(x, str | int | float) else None
    except ValueError:
        return None


def _findings(
    run: Run, name: str, m: Mapping[str, Any], s: TargetSummary, served: object
) -> list[str]:
    """What says this target does not run the path it is meant to test (as the verdict sees
    it); the reference and the control only report failing."""
    status = s.status or m.get("status")
    reason = s.reason or m.get("reason")
    if status not in ("ok", "failed", None):
        return [f"status '{status}': {text(reason) if reason else 'no outcome recorded'}"]
    if name == run.reference or name.endswith(CONTROL_SUFFIX):
        return [] if status in ("ok", None) else [f"target failed: {text(reason)}"]
    merged = TargetSummary(
        status=None if status is None else str(status),
        reason=None if reason is None else str(reason),
        cache_dtype=None if served is None else str(served),
        kv_cache_size_tokens=None,
        phases={},
    )
    # The verdict's own check, on what the manifest keeps of this target.
    info = {k: m[k] for k in ("scale_log_lines", "engine_config", "spec") if k in m}
    return serving_problems(name, merged, {"targets": {name: info}}, name == run.roles().calibrated)


QUALITY_HEADERS = [
    "Target",
    "Bucket",
    "Explicit checks: pass rate [95% Wilson] (passed/graded)",
    "Derived from the reference: pass rate [95% Wilson] (passed/graded)",
    "Δ vs reference, pts [95% CI] (every pair)",
    "Pairs (explicit + derived)",
    "McNemar p",
    "Noise floor Δ, pts [95% CI]",
    "Agreement exact / normalized",
    "First divergence (median token)",
    "Teacher-forced ΔNLL / top-1",
    "Evidence",
]


def quality_view(run: Run) -> dict[str, Any]:
    q = run.summary.quality
    tol = q.tolerance if q else None
    tables = []
    for phase, targets in run.in_order(q.phases if q else {}, "phase"):
        t = Table(QUALITY_HEADERS, caption=f"phase {phase}")
        shifts = []
        for target, tq in run.in_order(targets, "target"):
            for bucket, row in run.in_order(tq.buckets, "bucket"):
                t.add(*_quality_row(target, bucket, row, tol, target == run.reference))
            if tq.shift:
                shifts.append(
                    f"{target}: stratified shift across buckets "
                    f"p={f_p(tq.shift.p_value)} ({text(tq.shift.direction)})"
                )
        tables.append({"table": t, "shifts": shifts})
    return {
        "present": bool(tables),
        "tables": tables,
        "reference": text(q.reference if q else None),
        "tolerance": f_pts(tol).lstrip("+") if tol is not None else DASH,
        "notes": list(q.notes if q else ()),
    }


def _quality_row(
    target: str, bucket: str, row: BucketQuality, tol: float | None, is_reference: bool
) -> list[str | Cell]:
    # What the verdict decides on: every graded pair, explicit and derived (summaries from
    # before derived grading have the explicit comparison only).
    combined = row.combined if isinstance(row.combined, Combined) else None
    vs = combined or row.vs_reference
    floor = row.noise_floor if isinstance(row.noise_floor, NoiseFloor) else None
    ag, tf = row.agreement, row.teacher_forced
    # The reference paired with itself settles nothing: no evidence (and no "need N") there.
    ev = None if is_reference else combined.evidence if combined else row.evidence
    evidence = (
        DASH
        if ev is None
        else ev.short
        if ev.short
        else ("sufficient" if ev.sufficient else f"~{f_int(ev.needed)} needed")
    )
    pairs = f_int(vs.pairs if vs else None)
    if combined:
        pairs += f" ({f_int(combined.explicit)} + {f_int(combined.derived)})"
    diff, lo, hi, p = (vs.diff, vs.lo, vs.hi, vs.mcnemar_p) if vs else (None,) * 4
    versus: list[str | Cell] = (
        [Cell("reference", "dim"), DASH, DASH]
        if is_reference
        else [Cell(f_est(diff, lo, hi, f_pts), "num " + _loss_class(vs, tol)), pairs, f_p(p)]
    )
    derived = row.derived
    return [
        target,
        bucket,
        _f_rate(row),
        _f_rate(derived) if derived and derived.graded else DASH,
        *versus,
        f_est(*((floor.diff, floor.lo, floor.hi) if floor else (None,) * 3), f_pts),
        f"{f_pct(ag.exact)} / {f_pct(ag.normalized)}",
        f_int(ag.first_divergence_median),
        f"{_f_nll(tf.nll_delta_mean)} / {f_pct(tf.top1_agreement)}",
        Cell(
            evidence,
            "nowrap" + ("" if ev and ev.sufficient else " dim"),
            text(ev.reason) if ev else "",
        ),
    ]


def _f_rate(row: Comparison | DerivedComparison) -> str:
    """``60.0% [42.3, 75.4] (18/30)``."""
    lo, hi = row.wilson or (None, None)
    rate = f_pct(row.pass_rate)
    if num(lo) is not None or num(hi) is not None:
        rate += f" [{f_pct(lo).rstrip('%')}, {f_pct(hi).rstrip('%')}]"
    if not row.graded:
        return f"{rate} (none graded)"
    return f"{rate} ({f_int(row.passed)}/{f_int(row.graded)})"


def _f_nll(x: object) -> str:
    v = num(x)
    return DASH if v is None else f"{v:+.4f}"


def _loss_class(vs: Combined | VsReference | None, tol: float | None) -> str:
    if vs is None:
        return ""
    diff, lo, hi, p = (num(x) for x in (vs.diff, vs.lo, vs.hi, vs.mcnemar_p))
    tol = 0.05 if tol is None else tol
    if diff is not None and (
        (p is not None and p < 0.05 and diff < 0) or (hi is not None and hi < -tol)
    ):
        return "bad"
    return "good" if lo is not None and lo >= -tol else ""


SYS_METRICS = (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def _deltas(row: SystemsBucket) -> list[tuple[str, LatencyDelta | None]]:
    return [("TTFT", row.ttft_ms), ("ITL", row.itl_ms), ("E2E", row.e2e_ms)]


def systems_view(run: Run) -> dict[str, Any] | None:
    s = run.summary.systems
    if s is None:
        return None
    ref, cand = text(s.reference), text(s.candidate)
    emulated = (
        f"; {cand} is emulated FP8: a BF16 server rounding K/V, not FP8's speed"
        if run.emulated(s.candidate)
        else ""
    )
    lat = Table(
        [
            "Bucket",
            "Metric",
            f"{ref} median (ms)",
            f"{cand} median (ms)",
            "Δ mean, ms [95% CI]",
            "Pairs",
        ],
        caption=f"phase {text(s.phase)}, "
        f"{cand} − {ref} on the same requests (negative: {cand} is faster){emulated}",
    )
    for bucket, row in run.in_order(s.buckets, "bucket"):
        for name, m in _deltas(row):
            if m is None:
                lat.add(bucket, name, DASH, DASH, Cell(DASH, "num "), DASH)
                continue
            cls = "good" if (num(m.hi) or 0) < 0 else "bad" if (num(m.lo) or 0) > 0 else ""
            lat.add(
                bucket,
                name,
                f_sig(m.reference_median),
                f_sig(m.candidate_median),
                Cell(f_est(m.delta_mean, m.lo, m.hi, f_sig), "num " + cls),
                f_int(m.pairs),
            )
    fits = Table(
        [
            "Metric",
            f"{ref}: ms = a + b·tokens",
            f"{cand}: ms = a + b·tokens",
            "Break-even (prompt tokens)",
            f"{cand} wins",
        ]
    )
    for key, name in SYS_METRICS:
        f = s.fits.get(key)
        if f:
            fits.add(
                name, _f_line(f.reference), _f_line(f.candidate), f_int(f.tokens), text(f.fp8_wins)
            )
    facts = [
        ("paired requests", f_int(s.pairs)),
        ("median context (tokens)", f_int(s.median_context_tokens)),
        ("output throughput ratio", f_ratio(s.throughput_ratio)),
        (f"{cand} faster somewhere", f_bool(s.latency_better)),
        ("below the break-even", f_bool(s.below_break_even)),
    ]
    return {
        "latency": lat if lat.rows else None,
        "fits": fits if fits.rows else None,
        "facts": facts,
    }


def _f_line(x: tuple[float, float] | None) -> str:
    if x is None or num(x[0]) is None or num(x[1]) is None:
        return DASH
    return f"{f_sig(x[0])} + {num(x[1]):.4g}·t"


def latency_view(run: Run) -> dict[str, Any]:
    """Per phase: TTFT and ITL distributions (target x bucket) and the summary's figures."""
    dist: dict[tuple[str, str, str, str], list[float]] = defaultdict(list)
    for r in run.results:
        if r.get("status", "ok") != "ok":
            continue
        key = (str(r.get("phase")), str(r.get("bucket")), str(r.get("target")))
        ttft, first, sent = (num(r.get(k)) for k in ("ttft", "first_token", "sent"))
        if ttft is None and first is not None and sent is not None:
            ttft = first - sent
        if ttft is not None:
            dist[(*key, "ttft")].append(1000 * ttft)
        dist[(*key, "itl")].extend(1000 * g for g in _itl(r))
    out = []
    for phase in run.phases():
        charts = [
            box_chart(
                _groups(run, dist, phase, metric),
                "ms",
                f"{name} per target and bucket, phase {phase}",
            )
            for metric, name in (("ttft", "TTFT"), ("itl", "Inter-token latency"))
        ]
        out.append(
            {
                "phase": phase,
                "charts": [c for c in charts if c],
                "table": _latency_table(run, phase),
            }
        )
    return {"phases": [p for p in out if p["charts"] or p["table"]]}


def _itl(r: Mapping[str, Any]) -> list[float]:
    """Inter-token gaps in seconds; a chunk of n tokens spreads its gap over n tokens."""
    times, tokens = lst(r.get("chunk_times")), lst(r.get("chunk_tokens"))
    out: list[float] = []
    for k in range(1, min(len(times), len(tokens))):
        a, b, n = num(times[k - 1]), num(times[k]), num(tokens[k])
        if a is not None and b is not None and n is not None and n > 0:
            out.extend([(b - a) / n] * int(n))
    return out


def _groups(
    run: Run, dist: Mapping[tuple[str, str, str, str], list[float]], phase: str, metric: str
) -> list[tuple[str, list[BoxRow]]]:
    buckets = list(dict.fromkeys(k[1] for k in dist if k[0] == phase))
    order = [str(b) for b in lst(dig(run.manifest, "buckets", "labels"))]
    buckets.sort(key=lambda b: order.index(b) if b in order else len(order))
    return [
        (
            f"bucket {b}",
            [
                (t, run.color(t), dist.get((phase, b, t, metric), []))
                for t in run.targets()
                if (phase, b, t, "ttft") in dist or (phase, b, t, "itl") in dist
            ],
        )
        for b in buckets
    ]


def _windows(run: Run, name: str) -> list[tuple[str, float, float]]:
    """Phase windows on this target's server: its own, and those of targets that shared it
    (the A/A control replays on the reference's server)."""
    url = dig(run.manifest, "targets", name, "server", "url")
    out = []
    for other in run.targets():
        m = obj(dig(run.manifest, "targets", other))
        if other != name and (url is None or dig(m, "server", "url") != url):
            continue
        for phase, w in run.in_order(obj(m.get("phases")), "phase"):
            a, b = num(dig(w, "start")), num(dig(w, "end"))
            if a is not None and b is not None:
                out.append((phase if other == name else f"{other} {phase}", a, b))
    return out


def _latency_table(run: Run, phase: str) -> Table | None:
    t = Table(
        [
            "Target",
            "Bucket",
            "Requests",
            "OK",
            "Errors",
            "TTFT p50 / p90 / p99 (ms)",
            "ITL p50 / p90 / p99 (ms)",
            "E2E p50 / p90 (ms)",
            "Queue delay p90 (ms)",
        ]
    )
    for name in run.targets():
        target = run.summary.targets.get(name)
        ph = target.phases.get(phase) if target else None
        for bucket, row in run.in_order(ph.buckets if ph else {}, "bucket"):
            kinds = ", ".join(f"{k}: {n}" for k, n in row.errors_by_kind.items())
            t.add(
                name,
                bucket,
                f_int(row.requests),
                f_int(row.ok),
                Cell(
                    f_int(row.errors) + (f" ({kinds})" if kinds else ""),
                    "bad" if row.errors else "",
                ),
                _f_pcts(row.ttft_ms, True),
                _f_pcts(row.itl_ms, True),
                _f_pcts(row.e2e_ms, False),
                f_sig(row.queue_delay_ms.p90),
            )
    return t if t.rows else None


def _f_pcts(x: Percentiles, p99: bool) -> str:
    return " / ".join(f_sig(v) for v in (x.p50, x.p90, *([x.p99] if p99 else [])))


def capacity_view(run: Run) -> dict[str, Any]:
    targets = run.summary.targets
    reference = targets.get(run.reference or "")
    ref_size = reference.kv_cache_size_tokens if reference else None
    bars, t = (
        [],
        Table(
            [
                "Target",
                "Served cache dtype",
                "KV cache (tokens)",
                "× reference",
                "Block size",
                "Blocks",
                "Max concurrency (engine)",
                "Sequences at each bucket's median context",
            ]
        ),
    )
    for name in run.targets():
        s = targets.get(name) or TargetSummary.from_json({})
        cfg = obj(dig(run.manifest, "targets", name, "cache_config"))
        size = num(s.kv_cache_size_tokens) or _float(cfg.get("kv_cache_size_tokens"))
        bars.append((name, run.color(name), size))
        first = next(iter(run.in_order(s.phases, "phase")), None)
        conc = [
            f"{b}: {f_sig(row.capacity.concurrency_at_context)}"
            for b, row in run.in_order(first[1].buckets if first else {}, "bucket")
        ]
        emulated = run.emulated(name)
        if emulated:  # BF16 storage: never shown as FP8's capacity
            bars.pop()
        t.add(
            name,
            text(s.cache_dtype or cfg.get("cache_dtype"))
            + (" (emulated FP8: BF16 storage)" if emulated else ""),
            f_int(size),
            "not FP8's: emulated"
            if emulated
            else f_ratio(size / ref_size if size and ref_size else None),
            text(cfg.get("block_size")),
            text(cfg.get("num_gpu_blocks")),
            text(cfg.get("kv_cache_max_concurrency")),
            ", ".join(conc) or DASH,
        )
    chart = bar_chart(bars, "tokens", "KV-cache capacity per target (tokens)")
    return {"chart": chart, "table": t if t.rows else None}


def kv_view(run: Run) -> dict[str, Any]:
    charts = []
    for name in run.targets():
        pts = sorted(
            (float(s["t"]), float(s["kv_usage"]))
            for s in run.series.get(name, [])
            if num(s.get("t")) is not None and num(s.get("kv_usage")) is not None
        )
        peak = f_pct(max(v for _, v in pts)) if pts else DASH
        chart = line_chart(
            pts,
            run.color(name),
            _windows(run, name),
            f"{name}: KV-cache usage over time (peak {peak})",
        )
        if chart:
            charts.append(chart)
    t = Table(
        [
            "Target",
            "Phase",
            "Duration (s)",
            "Peak KV usage",
            "Peak running",
            "Peak waiting",
            "Preemptions",
            "Prefix-cache hit rate",
            "Server TTFT mean (ms)",
            "Output tok/s",
        ]
    )
    for name in run.targets():
        target = run.summary.targets.get(name)
        for phase, ph in run.in_order(target.phases if target else {}, "phase"):
            srv = ph.server
            t.add(
                name,
                phase,
                f_sig(ph.duration_s),
                f_pct(srv.peak_kv_usage),
                f_int(srv.peak_running),
                f_int(srv.peak_waiting),
                f_int(srv.preemptions),
                f_pct(srv.prefix_cache_hit_rate),
                f_sig(srv.server_ttft_mean_ms),
                f_sig(ph.all.throughput_out_tok_s),
            )
    return {"charts": charts, "table": t if t.rows else None}


# -- per-request drill-down ---------------------------------------------------------------


def requests_view(run: Run) -> dict[str, Any]:
    def key(row: Mapping[str, Any]) -> tuple[str, str, str]:
        return str(row.get("target")), str(row.get("phase")), str(row.get("request_id"))

    grades = {key(g): g for g in run.grades}
    by_id: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in run.results:
        by_id[str(r.get("request_id"))].append(r)
    rank = {t: i for i, t in enumerate(run.targets())}
    phases = {p: i for i, p in enumerate(run.phases())}
    items = []
    for i, (rid, rs) in enumerate(by_id.items()):
        rs.sort(
            key=lambda r: (phases.get(str(r.get("phase")), 99), rank.get(str(r.get("target")), 99))
        )
        attempts = [_attempt(r, grades.get(key(r))) for r in rs]
        flags = _flags(run, attempts)
        items.append((_severity(flags), i, rid, rs, attempts, flags))
    items.sort(key=lambda x: (x[0], x[1]))
    shown = items[:MAX_REQUESTS]
    prompts, note = load_prompts(run, [x[2] for x in shown]) if shown else ({}, "")
    return {
        "total": len(items),
        "shown": len(shown),
        "trace_note": note,
        "items": [
            {
                "id": rid,
                "bucket": text(rs[0].get("bucket")),
                "flags": flags,
                "task": text(next((a["task"] for a in att if a["task"] != DASH), None)),
                "prompt": prompts.get(rid),
                "attempts": att,
                "badges": _badges(run, att),
            }
            for _, _, rid, rs, att, flags in shown
        ],
    }


def _attempt(r: Mapping[str, Any], g: Mapping[str, Any] | None) -> dict[str, Any]:
    g = obj(g)
    grade, ag = obj(g.get("grade")), obj(g.get("agreement"))
    out = str(r.get("output_text") or "")
    calls = [
        f"{obj(c).get('name', '?')}({obj(c).get('arguments', '')})"
        for c in lst(r.get("tool_calls"))
    ]
    err = r.get("error") or g.get("error")
    passed = grade.get("passed") if isinstance(grade.get("passed"), bool) else None
    return {
        "target": text(r.get("target")),
        "phase": text(r.get("phase")),
        "status": text(r.get("status")),
        "ok": r.get("status", "ok") == "ok",
        "error": None
        if r.get("status", "ok") == "ok" and not err
        else f"{text(r.get('error_kind'))}: {text(err)}",
        "ttft": f_sig(None if num(r.get("ttft")) is None else 1000 * float(r["ttft"])),
        "tokens": f_int(r.get("output_tokens")),
        "finish": text(r.get("finish_reason")),
        "answer": out[:ANSWER_CHARS],
        "more": max(0, len(out) - ANSWER_CHARS),
        "calls": calls,
        "passed": passed,
        "reason": grade.get("reason"),
        "task": text(g.get("task")),
        "agreement": DASH
        if not ag
        else (
            "identical"
            if ag.get("exact")
            else "same after normalizing"
            if ag.get("normalized")
            else f"differs from token {f_int(ag.get('first_divergence'))}"
        ),
    }


def _flags(run: Run, attempts: Sequence[Mapping[str, Any]]) -> list[str]:
    """regressed: a candidate fails where the reference passes (same phase)."""
    ref_pass = {a["phase"] for a in attempts if a["target"] == run.reference and a["passed"]}
    flags = []
    if any(
        a["passed"] is False
        and a["phase"] in ref_pass
        and a["target"] != run.reference
        and not a["target"].endswith(CONTROL_SUFFIX)
        for a in attempts
    ):
        flags.append("regressed")
    if any(not a["ok"] for a in attempts):
        flags.append("error")
    if any(a["agreement"].startswith("differs") for a in attempts):
        flags.append("differs")
    return flags


def _severity(flags: Sequence[str]) -> int:
    return next((i for i, f in enumerate(("regressed", "error", "differs")) if f in flags), 3)


def _badges(run: Run, attempts: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, str]]:
    """Per target: (name, passed/graded or status, css class)."""
    out = []
    for t in run.targets():
        mine = [a for a in attempts if a["target"] == t]
        if not mine:
            continue
        graded = [a["passed"] for a in mine if a["passed"] is not None]
        bad = sum(not a["ok"] for a in mine)
        label = f"{sum(graded)}/{len(graded)} pass" if graded else "ungraded"
        label += f", {bad} error{'s' if bad > 1 else ''}" if bad else ""
        cls = "bad" if bad or (graded and not all(graded)) else "good" if graded else "dim"
        out.append((t, label, cls))
    return out


# -- rendering --------------------------------------------------------------------------------

SECTIONS = (
    ("verdict", "Verdict"),
    ("serving", "Serving path"),
    ("quality", "Quality"),
    ("systems", "Systems"),
    ("latency", "Latency"),
    ("capacity", "Capacity"),
    ("kv-usage", "KV usage"),
    ("requests", "Requests"),
)
BUILDERS: dict[str, Callable[[Run], Any]] = {
    "verdict": verdict_view,
    "serving": serving_view,
    "quality": quality_view,
    "systems": systems_view,
    "latency": latency_view,
    "capacity": capacity_view,
    "kv-usage": kv_view,
    "requests": requests_view,
}


def _build(run: Run, keys: Iterable[str] = BUILDERS) -> tuple[dict[str, Any], list[str]]:
    """Each section's view, and the problems reading the run: a section whose data has an
    unexpected shape is reported there (and left out) rather than losing the whole report."""
    views: dict[str, Any] = {}
    problems = list(run.problems)
    for key in keys:
        try:
            views[key] = BUILDERS[key](run)
        except Exception as exc:  # one bad section must not lose the report
            views[key] = None
            problems.append(f"section '{key}' could not be rendered: {exc!r}")
    return views, problems


def _header(run: Run) -> dict[str, Any]:
    m, trace = run.manifest, obj(run.manifest.get("trace"))
    started = num(m.get("started_at"))
    return {
        "run_id": run.dir.name,
        "started": DASH
        if started is None
        else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
        "tool": f"{text(dig(m, 'tool', 'name'))} {text(dig(m, 'tool', 'version'))}",
        "trace": text(trace.get("path")),
        "sha": _f_sha(trace.get("sha256")),
        "requests": f_int(trace.get("requests")),
        "bad_lines": f_int(trace.get("bad_lines")),
        "buckets": ", ".join(str(b) for b in lst(dig(m, "buckets", "labels"))) or DASH,
        "schedules": ", ".join(str(s) for s in lst(m.get("schedules"))) or DASH,
        "command": " ".join(str(c) for c in lst(m.get("command"))) or DASH,
        "summary_version": text(run.summary.version),
    }


def _f_sha(x: object) -> str:
    return f"{x[:12]}…" if isinstance(x, str) and x else DASH


@functools.cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.globals["DASH"] = DASH
    return env


def render_html(run_dir: Path) -> str:
    """The full, self-contained HTML report of a run directory."""
    return _html(load_run(Path(run_dir)))


def render_markdown(run_dir: Path) -> str:
    """Verdict, evidence, serving-path findings and per-bucket tables, for a PR comment."""
    return _markdown(load_run(Path(run_dir)))


def write_reports(run_dir: Path) -> tuple[Path, Path]:
    """Write ``report.html`` and ``report.md`` into the run directory; return both paths."""
    run_dir = Path(run_dir)
    run = load_run(run_dir)
    html_path, md_path = run_dir / "report.html", run_dir / "report.md"
    _write(html_path, _html(run))
    _write(md_path, _markdown(run))
    return html_path, md_path


def _html(run: Run) -> str:
    views, problems = _build(run)
    return (
        _environment()
        .get_template(TEMPLATE)
        .render(h=_header(run), sections=SECTIONS, v=views, problems=problems)
    )


# The columns of QUALITY_HEADERS a PR comment keeps (explicit and derived side by side).
MD_QUALITY = tuple(QUALITY_HEADERS[i] for i in (0, 1, 2, 3, 4, 5, 6, 7, 11))


def _markdown(run: Run) -> str:
    views, problems = _build(run, ("verdict", "serving", "quality", "systems", "latency"))
    out = _md_verdict(run, views["verdict"] or {})
    out += _md_section("Serving path", (views["serving"] or {}).get("table"))
    tables = (views["quality"] or {}).get("tables") or [{"table": None}]
    for qt in tables:
        caption = f" ({qt['table'].caption})" if qt["table"] else ""
        out += _md_section(f"Quality{caption}", qt["table"], MD_QUALITY)
    out += _md_section(
        "Latency",
        (views["systems"] or {}).get("latency")
        or next(
            (p["table"] for p in (views["latency"] or {}).get("phases", []) if p["table"]), None
        ),
    )
    if problems:
        out += ["### Problems reading this run", ""] + [f"- {md(p)}" for p in problems]
    return "\n".join(out).rstrip() + "\n"


def _md_verdict(run: Run, v: Mapping[str, Any]) -> list[str]:
    out = [f"## kvcanary `{md(run.dir.name)}`: {md(v.get('word', 'NO VERDICT'))}", ""]
    if not v.get("present"):
        return [*out, "Verdict: not measured in this run.", ""]
    out += [f"**{md(v['headline'])}** (exit code {md(v['exit_code'])})", ""]
    out += [f"- {md(r)}" for r in v["reasons"]] + ([""] if v["reasons"] else [])
    if v["evidence"].rows:
        out += ["### Evidence", ""]
        for kind, bucket, finding, *_ in v["evidence"].rows:
            where = f" ({md(bucket.text)})" if bucket.text != DASH else ""
            out.append(f"- **{md(kind.text)}**{where}: {md(finding.text)}")
        out.append("")
    return out


def md(s: object) -> str:
    """Text for a Markdown table cell or bullet: one line, pipes and angle brackets escaped."""
    t = " ".join(str(s).split())
    return t.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _md_section(title: str, t: Table | None, cols: Sequence[str] | None = None) -> list[str]:
    if t is None:
        return [f"### {title}", "", "Not measured in this run.", ""]
    idx = [i for i, h in enumerate(t.headers) if cols is None or h in cols]
    caption = [f"_{md(t.caption)}_", ""] if t.caption and t.caption not in title else []
    out = [f"### {title}", "", *caption]
    out.append("| " + " | ".join(md(t.headers[i]) for i in idx) + " |")
    out.append("|" + "|".join(" --- " for _ in idx) + "|")
    out += ["| " + " | ".join(md(row[i].text) for i in idx) + " |" for row in t.rows]
    return [*out, ""]


def _write(path: Path, content: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(content, encoding="utf-8")
    os.replace(tmp, path)
