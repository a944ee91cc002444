"""The terminal table: one row per target x phase x bucket."""

from __future__ import annotations

from rich.table import Table

from replay.analysis.schemas import (
    BucketQuality,
    Combined,
    EvidenceSummary,
    LengthSlope,
    NoiseFloor,
    Quality,
    Summary,
    Trend,
)
from replay.present.formatting import TERMINAL_DASH, fixed, percent, points


# The terminal's missing mark is an en dash (the reports use an em dash).
def _f(v: float | None, spec: str = ".1f") -> str:
    return fixed(v, spec, TERMINAL_DASH)


def _pct(v: float | None, digits: int = 0) -> str:
    return percent(v, digits, TERMINAL_DASH)


def _has_slo(summary: Summary) -> bool:
    return any(
        row.slo is not None
        for tgt in summary.targets.values()
        for ph in tgt.phases.values()
        for row in ph.buckets.values()
    )


def _has_reasoning(summary: Summary) -> bool:
    return any(
        row.reasoning is not None
        for tgt in summary.targets.values()
        for ph in tgt.phases.values()
        for row in ph.buckets.values()
    )


def summary_table(summary: Summary) -> Table:
    t = Table(title="kvcanary replay: per target x phase x bucket", show_lines=False)
    slo = _has_slo(summary)
    reasoning = _has_reasoning(summary)
    columns = [
        ("target", "left"),
        ("phase", "left"),
        ("bucket", "left"),
        ("n", "right"),
        ("err", "right"),
        ("TTFT p50/p99 ms", "right"),
        ("ITL p50/p99 ms", "right"),
        ("E2E p50 ms", "right"),
        ("out tok/s", "right"),
        ("KV cache tokens", "right"),
        ("seqs fit", "right"),
        ("peak KV", "right"),
        ("preempt", "right"),
        ("prefix hit", "right"),
    ]
    if slo:
        columns += [("SLO met", "right"), ("goodput/s", "right")]
    if reasoning:  # TTFT is the first token of either kind; this, the first answer token's
        columns += [("answer p50 ms", "right"), ("reasoning tok", "right")]
    for col, just in columns:
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for name, tgt in summary.targets.items():
        if tgt.status != "ok":
            row = [name, "", "", "", "all", f"[red]{tgt.status}[/red]", "", "", ""]
            row += [_f(tgt.kv_cache_size_tokens, ",.0f"), "", "", "", ""]
            t.add_row(*row, *(["", ""] if slo else []), *(["", ""] if reasoning else []))
        for label, ph in tgt.phases.items():
            srv = ph.server
            for i, (bucket, b) in enumerate(ph.buckets.items()):
                first = i == 0
                cells = [
                    name,
                    label,
                    bucket,
                    str(b.requests),
                    str(b.errors)
                    + (f" +{b.skipped_too_long} too long" if b.skipped_too_long else ""),
                    f"{_f(b.ttft_ms.p50)} / {_f(b.ttft_ms.p99)}",
                    f"{_f(b.itl_ms.p50, '.2f')} / {_f(b.itl_ms.p99, '.2f')}",
                    _f(b.e2e_ms.p50, ".0f"),
                    _f(ph.all.throughput_out_tok_s) if first else "",
                    _f(b.capacity.kv_cache_size_tokens, ",.0f"),
                    _f(b.capacity.concurrency_at_context, ",.0f"),
                    _pct(srv.peak_kv_usage, 1) if first else "",
                    _f(srv.preemptions, ".0f") if first else "",
                    _pct(srv.prefix_cache_hit_rate) if first else "",
                ]
                if slo:
                    cells += [
                        _pct(b.slo.attainment) if b.slo else "",
                        _f(b.slo.goodput_rps, ".2f") if b.slo else "",
                    ]
                if reasoning:
                    rs = b.reasoning
                    cells += [
                        _f(rs.time_to_answer_ms.p50) if rs else "",
                        _f(rs.tokens_median, ".0f") if rs else "",
                    ]
                t.add_row(*cells)
    return t


def _interval(lo: float | None, hi: float | None, signed: bool = True) -> str:
    """`` [-8, +2]`` in points, or `` [42-75%]`` for a rate."""
    if lo is None or hi is None:
        return ""
    if signed:
        return f" [{points(lo, 0)}, {points(hi, 0)}]"
    return f" [{percent(lo, 0).rstrip('%')}-{percent(hi, 0)}]"


def _evidence_cell(ev: EvidenceSummary) -> str:
    """What a bucket's pairs settle: "within tolerance", "loss shown", or while neither, how
    many pairs it needs (summaries written before the exact rule carry no ``short``)."""
    if ev.short:
        return ev.short
    return "ok" if ev.sufficient else f"need {ev.needed}"


def quality_table(q: Quality) -> Table:
    """Pass rates with intervals, the paired difference to the reference with its noise
    floor, agreement and teacher-forced divergence, per target x phase x bucket."""
    t = Table(title=f"quality vs {q.reference} (pass rate, paired difference in points)")
    for col in (
        "target",
        "phase",
        "bucket",
        "graded",
        "pass rate [95%]",
        "derived [95%]",
        "Δ vs ref [95%]",
        "pairs (+derived)",
        "McNemar p",
        "noise floor Δ",
        "agree exact",
        "first div",
        "TF ΔNLL/tok",
        "TF top-1",
        "evidence",
    ):
        t.add_column(col, justify="left" if col in ("target", "phase", "bucket") else "right")
    for phase, targets in q.phases.items():
        for name, tq in targets.items():
            for bucket, row in tq.buckets.items():
                t.add_row(name, phase, bucket, *_quality_cells(row, name == q.reference))
            shift = tq.shift
            if shift and shift.pairs:
                t.add_row(
                    name,
                    phase,
                    "all (stratified)",
                    str(shift.pairs),
                    "",
                    "",
                    "",
                    "",
                    f"{_f(shift.p_value, '.3f')} {shift.direction}",
                    "",
                    "",
                    "",
                    "",
                    "",
                    "",
                )
            if tq.trend is not None:
                t.add_row(name, phase, "trend per doubling", *_trend_cells(tq.trend))
    return t


def _slope(s: LengthSlope | None, graded: bool) -> str:
    """A slope per doubling of context with its interval: points for a pass-rate difference,
    ΔNLL per token for teacher-forced scores; why not, where no slope was fitted."""
    if s is None:
        return ""
    if s.slope is None:
        return "no trend"
    if graded:
        lo, hi = points(s.lo, 1, TERMINAL_DASH), points(s.hi, 1, TERMINAL_DASH)
        return f"{points(s.slope, 1, TERMINAL_DASH)} [{lo}, {hi}]"
    return f"{_f(s.slope, '+.4f')} [{_f(s.lo, '+.4f')}, {_f(s.hi, '+.4f')}]"


def _trend_cells(tr: Trend) -> list[str]:
    """The trend across context length in the quality table's columns: the graded slope
    under the difference, its requests and p-value, the A/A control's under the floor, the
    teacher-forced slope (with the control's) under ΔNLL."""
    g, tf, floor = tr.graded, tr.teacher_forced, tr.teacher_forced_floor
    tf_floor = "" if floor is None or floor.slope is None else f" (A/A {_f(floor.slope, '+.4f')})"
    return [
        "",
        "",
        "",
        _slope(g, True),
        str(g.requests),
        _f(g.p_value, ".3f"),
        _slope(tr.graded_floor, True),
        "",
        "",
        _slope(tf, False) + (tf_floor if tf.slope is not None else ""),
        "",
        "",
    ]


def _quality_cells(row: BucketQuality, is_ref: bool) -> list[str]:
    w = row.wilson
    # The verdict's comparison: every graded pair, explicit and derived.
    combined = row.combined if isinstance(row.combined, Combined) else None
    vs = combined or row.vs_reference
    evidence = combined.evidence if combined else row.evidence
    derived = row.derived
    dw = derived.wilson if derived else None
    floor = row.noise_floor if isinstance(row.noise_floor, NoiseFloor) else None
    tf = row.teacher_forced
    return [
        str(row.graded),
        _pct(row.pass_rate) + (_interval(w[0], w[1], signed=False) if w else ""),
        ""
        if not derived or not derived.graded
        else _pct(derived.pass_rate)
        + (_interval(dw[0], dw[1], signed=False) if dw else "")
        + f" n={derived.graded}",
        "" if is_ref or not vs else points(vs.diff, 1, TERMINAL_DASH) + _interval(vs.lo, vs.hi),
        ""
        if is_ref or not vs
        else f"{vs.pairs}" + (f" (+{combined.derived})" if combined and combined.derived else ""),
        "" if is_ref or not vs else _f(vs.mcnemar_p, ".3f"),
        ""
        if not floor or floor.diff is None
        else points(floor.diff) + _interval(floor.lo, floor.hi),
        "" if is_ref else _pct(row.agreement.exact),
        "" if is_ref else _f(row.agreement.first_divergence_median, ".0f"),
        _f(tf.nll_delta_mean, "+.4f"),
        _pct(tf.top1_agreement),
        "" if is_ref or evidence is None else _evidence_cell(evidence),
    ]


def compare_table(a: Summary, b: Summary, name_a: str, name_b: str) -> Table:
    """Two runs side by side: verdict, then pass rate and TTFT p50 per target x bucket."""
    va, vb = (s.verdict.verdict if s.verdict else TERMINAL_DASH for s in (a, b))
    t = Table(title=f"A = {name_a}  ->  B = {name_b}\nverdict: {va} -> {vb}")
    for col in (
        "target",
        "phase",
        "bucket",
        "pass A",
        "pass B",
        "Δ pass",
        "TTFT p50 A",
        "TTFT p50 B",
        "E2E p50 A",
        "E2E p50 B",
    ):
        t.add_column(col, justify="left" if col in ("target", "phase", "bucket") else "right")
    keys = []
    for s in (a, b):
        for name, tgt in s.targets.items():
            for phase, ph in tgt.phases.items():
                for bucket in ph.buckets:
                    if (name, phase, bucket) not in keys:
                        keys.append((name, phase, bucket))

    def get(
        s: Summary, name: str, phase: str, bucket: str
    ) -> tuple[float | None, float | None, float | None]:
        tgt = s.targets.get(name)
        ph = tgt.phases.get(phase) if tgt else None
        row = ph.buckets.get(bucket) if ph else None
        tq = s.quality.phases.get(phase, {}).get(name) if s.quality else None
        q = tq.buckets.get(bucket) if tq else None
        return (
            q.pass_rate if q else None,
            row.ttft_ms.p50 if row else None,
            row.e2e_ms.p50 if row else None,
        )

    for name, phase, bucket in keys:
        pa, ta, ea = get(a, name, phase, bucket)
        pb, tb, eb = get(b, name, phase, bucket)
        delta = points(None if pa is None or pb is None else pb - pa, 1, TERMINAL_DASH)
        t.add_row(
            name,
            phase,
            bucket,
            _pct(pa),
            _pct(pb),
            delta,
            _f(ta),
            _f(tb),
            _f(ea, ".0f"),
            _f(eb, ".0f"),
        )
    return t
