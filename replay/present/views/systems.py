"""Speed and capacity: the paired latency comparison and its break-even, latency
distributions per phase, KV-cache capacity per target, and KV-cache usage over time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from replay.analysis.schemas import (
    LatencyDelta,
    LayerCapacity,
    Percentiles,
    ReasoningStats,
    SystemsBucket,
    TargetSummary,
)
from replay.present.charts import BoxRow, bar_chart, box_chart, line_chart
from replay.present.formatting import (
    DASH,
    f_bool,
    f_est,
    f_int,
    f_pct,
    f_ratio,
    f_sig,
    num,
    text,
)
from replay.present.reading import Run, dig, to_float
from replay.present.run_scan import LatencyKey
from replay.present.views import Cell, Table
from replay.present.views.systems_rule import capacity_table, rule_note, rule_table
from replay.serving import kv_formats

SYS_METRICS = (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def _deltas(row: SystemsBucket) -> list[tuple[str, LatencyDelta | None]]:
    return [("TTFT", row.ttft_ms), ("ITL", row.itl_ms), ("E2E", row.e2e_ms)]


def systems_view(run: Run) -> dict[str, Any] | None:
    s = run.summary.systems
    if s is None:
        return None
    ref, cand = text(s.reference), text(s.candidate)
    emulated = (
        f"; {cand} is emulated {run.format_label(cand)}: a BF16 server rounding K/V, not its "
        "format's speed"
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
        (f"{cand} faster in a cell, slower in none", f_bool(s.latency_better)),
        ("below the break-even", f_bool(s.below_break_even)),
    ]
    return {
        "rule": rule_table(s.rule, ref, cand),
        "rule_note": rule_note(s.rule),
        "capacity": capacity_table(s.capacity, ref),
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
    dist = run.scan.latency
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


def _groups(
    run: Run, dist: Mapping[LatencyKey, Sequence[float]], phase: str, metric: str
) -> list[tuple[str, list[BoxRow]]]:
    buckets = list(dict.fromkeys(k[1] for k in dist if k[0] == phase))
    order = list(run.manifest.buckets.labels)
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


def _latency_table(run: Run, phase: str) -> Table | None:
    phases = [t.phases.get(phase) for t in run.summary.targets.values()]
    slo = [b.slo for ph in phases if ph for b in ph.buckets.values() if b.slo is not None]
    sessions = any(b.sessions for ph in phases if ph for b in ph.buckets.values())
    reasoning = any(b.reasoning for ph in phases if ph for b in ph.buckets.values())
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
            *(["SLO met", "Goodput (req/s)"] if slo else []),
            *(["Later turns", "Prefix reused"] if sessions else []),
            *(
                ["First answer token p50 / p90 (ms)", "Reasoning tokens median"]
                if reasoning
                else []
            ),
        ],
        caption=_slo_caption(slo[0].bounds_ms) if slo else "",
    )
    for name in run.targets():
        target = run.summary.targets.get(name)
        ph = target.phases.get(phase) if target else None
        for bucket, row in run.in_order(ph.buckets if ph else {}, "bucket"):
            extra: list[str | Cell] = []
            if slo:
                s = row.slo
                extra = [
                    Cell(
                        f_pct(s.attainment) if s else DASH,
                        "num",
                        _slo_caption(s.bounds_ms) if s else "",
                    ),
                    f_sig(s.goodput_rps) if s else DASH,
                ]
            if sessions:
                ss = row.sessions
                extra += [
                    f_int(ss.later_turns) if ss else DASH,
                    Cell(
                        f_pct(ss.reused_prefix_share) if ss else DASH,
                        "num",
                        "share of later turns' prompt tokens the previous turn's prompt and "
                        "answer began with (what a prefix cache can serve)",
                    ),
                ]
            if reasoning:
                extra += _reasoning_cells(row.reasoning)
            kinds = ", ".join(f"{k}: {n}" for k, n in row.errors_by_kind.items())
            if row.skipped_too_long:
                kinds += (", " if kinds else "") + (
                    f"{row.skipped_too_long} not sent: longer than max_model_len"
                )
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
                *extra,
            )
    return t if t.rows else None


def _reasoning_cells(r: ReasoningStats | None) -> list[str | Cell]:
    """Time to the first answer token (TTFT counts the first reasoning token) and the median
    reasoning length; answers cut while reasoning have no answer token, and are counted."""
    if r is None:
        return [DASH, DASH]
    cut = f" ({r.no_answer} cut before an answer)" if r.no_answer else ""
    est = " (client's count)" if r.tokens_estimated else ""
    return [_f_pcts(r.time_to_answer_ms, False) + cut, f_sig(r.tokens_median) + est]


def _slo_caption(bounds_ms: Mapping[str, float]) -> str:
    """The SLO bounds as the report states them: 'SLOs: TTFT <= 2000 ms, ITL <= 80 ms'."""
    names = {"ttft_ms": "TTFT", "itl_ms": "ITL (per-request mean)", "e2e_ms": "E2E"}
    parts = [f"{names.get(k, k)} <= {f_sig(v)} ms" for k, v in bounds_ms.items()]
    return "SLOs: " + ", ".join(parts) + " (met: succeeded within every bound)" if parts else ""


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
                "Its layer types predict (tokens)",
                "Its format's bytes imply (× BF16)",
                "Block size",
                "Blocks",
                "Max concurrency (engine)",
                "Requests in flight at each bucket's median context",
            ]
        ),
    )
    for name in run.targets():
        s = targets.get(name) or TargetSummary.from_json({})
        entry = run.manifest.target(name)
        cfg = entry.cache_config if entry is not None else {}
        size = num(s.kv_cache_size_tokens) or to_float(cfg.get("kv_cache_size_tokens"))
        bars.append((name, run.color(name), size))
        first = next(iter(run.in_order(s.phases, "phase")), None)
        rows = run.in_order(first[1].buckets if first else {}, "bucket")
        conc = [f"{b}: {f_sig(row.capacity.concurrency_at_context)}" for b, row in rows]
        if conc and not all(row.capacity.per_layer_type for _, row in rows):
            conc[-1] += " (tokens ÷ context)"
        emulated = run.emulated(name)
        fmt = run.format_label(name)
        if emulated:  # BF16 storage: never shown as the format's capacity
            bars.pop()
        t.add(
            name,
            text(s.cache_dtype or cfg.get("cache_dtype"))
            + (f" (emulated {fmt}: BF16 storage)" if emulated else ""),
            f_int(size),
            f"not {fmt}'s: emulated"
            if emulated
            else f_ratio(size / ref_size if size and ref_size else None),
            _predicted(s.layer_capacity, size),
            _implied(run, name),
            text(cfg.get("block_size")),
            text(cfg.get("num_gpu_blocks")),
            text(cfg.get("kv_cache_max_concurrency")),
            ", ".join(conc) or DASH,
        )
    if any(targets[n].layer_capacity for n in run.targets() if n in targets):
        t.caption = LAYER_TYPES_CAPTION
    chart = bar_chart(bars, "tokens", "KV-cache capacity per target (tokens)")
    return {"chart": chart, "table": t if t.rows else None}


# Counted per layer type: why the figures differ from tokens / context.
LAYER_TYPES_CAPTION = (
    "Where a target's model folder is here, each layer is counted by its attention type (its "
    "config.json): a sliding-window layer holds at most its window, so the requests in flight "
    "at a context come from the served cache's bytes, not kv_cache_size_tokens ÷ context "
    "(vLLM's figure is its concurrency at max_model_len times max_model_len)."
)
MATCH_WITHIN = 0.05  # the served size and the layout's prediction agree within this share


def _predicted(layers: LayerCapacity | None, served: float | None) -> str | Cell:
    """The cache the model's layer types predict, and whether the server's figure agrees:
    a server reporting another size runs another layout than its config.json says (other
    skip layers, another window, another block size), which its capacity figures inherit."""
    if layers is None:
        return DASH
    pred = layers.predicted_kv_cache_size_tokens
    if pred is None:
        return f"— (bytes read from {layers.cache_bytes_from})"
    if not served:
        return f_int(pred)
    off = served / pred - 1
    if abs(off) <= MATCH_WITHIN:
        return f"{f_int(pred)} (served within 5%)"
    return Cell(
        f"{f_int(pred)} (served {off:+.0%}: not the cache this layout predicts)",
        "num",
        "check the served model, its skip layers and its block size against its config.json",
    )


def _implied(run: Run, name: str) -> str:
    """The capacity a target's format implies over BF16 at the model's head size (its bytes
    per token, replay.serving.kv_formats): for an emulated target the only capacity figure,
    for a served one a check of the measured one."""
    fmt = kv_formats.get(run.kv_format(name) or "")
    spec = run.manifest.spec(name)
    head = kv_formats.head_size_of(spec.model if spec is not None else None)
    if fmt is None or fmt.family == "other" or head is None:  # "other": layout not modelled
        return DASH
    return f_ratio(fmt.capacity_ratio(head))


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
            "Finished at server",
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
                f_int(srv.server_finished),
                f_sig(ph.all.throughput_out_tok_s),
            )
    return {"charts": charts, "table": t if t.rows else None}


def _windows(run: Run, name: str) -> list[tuple[str, float, float]]:
    """Phase windows on this target's server: its own, and those of targets that shared it
    (the A/A control replays on the reference's server)."""
    mine = run.manifest.target(name)
    url = mine.server.get("url") if mine is not None else None
    out = []
    for other in run.targets():
        m = run.manifest.target(other)
        if m is None or (other != name and (url is None or m.server.get("url") != url)):
            continue
        for phase, w in run.in_order(m.phases, "phase"):
            a, b = num(dig(w, "start")), num(dig(w, "end"))
            if a is not None and b is not None:
                out.append((phase if other == name else f"{other} {phase}", a, b))
    return out
