"""Aggregates per target x phase x bucket, from the results file and the metrics series.

Missing data is ``None`` (shown as a dash), never 0: "no TTFT measured" is not "0 ms".
The results become one table (``results_frame``: a row per result, latencies in seconds, built
column by column, and every ITL gap in one array beside it); pandas groups it by target, phase
and bucket, and each group's percentiles are numpy's (linear interpolation) of its values in the
order the results came, as they always were: every figure is exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from replay.analysis.layer_capacity import served_cache
from replay.analysis.result_table import ResultTable
from replay.analysis.schemas import (
    BucketStats,
    Capacity,
    Percentiles,
    PhaseSummary,
    PhaseTotals,
    ReasoningStats,
    ResultStats,
    ServerStats,
    SessionStats,
    SloStats,
    TargetSummary,
)
from replay.core.records import Result
from replay.core.slo import SloSpec
from replay.serving.kv_served import ServedCache

if TYPE_CHECKING:
    import pandas as pd

SUMMARY_VERSION = 1
PCTS = (50, 90, 99)


def pct(
    values: Iterable[float] | pd.Series | npt.NDArray[np.float64], scale: float = 1000.0
) -> Percentiles:
    """Mean and p50/p90/p99 in ms; Nones when there is nothing to measure. A missing value
    is left out: None, or a frame's NaN (the one value for which ``v == v`` is false)."""
    if isinstance(values, np.ndarray):
        arr = values[~np.isnan(values)] * scale
    else:
        arr = np.asarray([v for v in values if v is not None and v == v], dtype=float) * scale
    if not arr.size:
        return Percentiles(mean=None, p50=None, p90=None, p99=None)
    p50, p90, p99 = (float(np.percentile(arr, p)) for p in PCTS)
    return Percentiles(mean=float(arr.mean()), p50=p50, p90=p90, p99=p99)


def _median(values: pd.Series) -> float | None:
    arr = values.dropna().to_numpy(dtype=float)
    return float(np.median(arr)) if arr.size else None


def tpot(r: Result) -> float | None:
    """Mean time per output token after the first (``vllm bench serve``'s TPOT)."""
    if r.done is None or r.first_token is None or r.output_tokens <= 1:
        return None
    return (r.done - r.first_token) / (r.output_tokens - 1)


def _decode_rate(r: Result) -> float | None:
    """Output tokens per second after the first token (a one-token answer has no rate)."""
    if r.done is None or r.first_token is None or r.done <= r.first_token or r.output_tokens <= 1:
        return None
    return r.output_tokens / (r.done - r.first_token)


_FLOATS = (
    "ttft",
    "from_schedule",
    "queue_delay",
    "e2e",
    "decode_rate",
    "tpot",
    "prompt_tokens",
    "turn",
    "reused",
    "time_to_answer",
)
_FLAGS = ("ok", "estimated", "cancelled", "skipped", "reasoning_estimated")
_TEXTS = ("target", "phase", "bucket", "error_kind")


def results_frame(results: Iterable[Result]) -> tuple[pd.DataFrame, npt.NDArray[np.float64]]:
    """One row per result, with what the summary's figures are computed from, column by
    column from the results' table (8 bytes a number, NaN where there is none), and the ITL
    gaps of every result in one array: a row's are ``itl_n`` of them from ``itl_at``
    (``gaps``). The latencies, ITL gaps and decode rate count only when ok."""
    import pandas as pd

    t = ResultTable.of(results)
    sent, first, done = t.floats("sent"), t.floats("first_token"), t.floats("done")
    scheduled, tokens = t.floats("scheduled"), t.counts("output_tokens")
    status = t.codes("status")
    itl, itl_n = itl_gaps(t)
    with np.errstate(invalid="ignore", divide="ignore"):
        decoding = done - first
        # NaN where a time is missing (NaN compares false) or the answer has one token.
        rate = np.where((decoding > 0) & (tokens > 1), tokens / decoding, np.nan)
        per_token = np.where(tokens > 1, decoding / (tokens - 1), np.nan)
    frame = pd.DataFrame(
        {
            # The labels stay Python strings (each shared by every row that has it): a
            # column of arrow strings would copy them into a pool that keeps its memory.
            "target": pd.Series(t.labels("target"), dtype=object),
            "phase": pd.Series(t.labels("phase"), dtype=object),
            "bucket": pd.Series(t.labels("bucket"), dtype=object),
            "error_kind": pd.Series(t.labels("error_kind", none="unknown"), dtype=object),
            "ttft": first - sent,
            "from_schedule": first - scheduled,
            "queue_delay": sent - scheduled,
            "e2e": done - sent,
            "decode_rate": rate,
            "tpot": per_token,
            "prompt_tokens": t.floats("prompt_tokens"),
            "turn": t.floats("turn"),
            "reused": t.floats("reused_prefix_tokens"),
            "time_to_answer": t.floats("first_answer_token") - sent,
            "ok": status == t.code_of("status", "ok"),
            "estimated": t.flags("tokens_estimated"),
            "cancelled": status == t.code_of("status", "cancelled"),
            "skipped": status == t.code_of("status", "skipped"),
            "reasoning_estimated": t.flags("reasoning_tokens_estimated"),
            "output_tokens": tokens,
            "reasoning_tokens": t.counts("reasoning_tokens"),
            "itl_at": np.cumsum(itl_n) - itl_n,
            "itl_n": itl_n,
        }
    )
    return frame, itl


def itl_gaps(t: ResultTable) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Every result's inter-token gaps in one array, in the results' order, and how many
    each result has: as ``Result.itl`` gives them, a chunk of n tokens spreading its gap
    over n tokens (a chunk with none adds no gap)."""
    times, tokens, times_at, tokens_at = t.chunks()
    lengths = np.diff(times_at)
    row = np.repeat(np.arange(len(t)), lengths)  # each chunk's result
    k = np.arange(times.size) - np.repeat(times_at[:-1], lengths)  # its place in its result
    n = tokens[np.repeat(tokens_at[:-1], lengths) + k] if times.size else tokens[:0]
    counted = (k > 0) & (n > 0)
    at = np.flatnonzero(counted)
    gap = (times[at] - times[at - 1]) / n[at]
    per_row = np.bincount(row[at], weights=n[at], minlength=len(t)).astype(np.int64)
    return np.repeat(gap, n[at]), per_row


def gaps(group: pd.DataFrame, itl: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """The ITL gaps of a group's rows, pooled in the rows' order."""
    at = group["itl_at"].to_numpy()
    n = group["itl_n"].to_numpy()
    ends = np.cumsum(n)
    picked: npt.NDArray[np.float64] = itl[
        np.repeat(at - ends + n, n) + np.arange(int(ends[-1]) if n.size else 0)
    ]
    return picked


def with_slo(frame: pd.DataFrame, slo: SloSpec) -> pd.DataFrame:
    """The frame with, per result, whether it met its bucket's SLOs (``met``) and each bound
    on its own (``met_ttft``, ``met_itl``, ``met_e2e``)."""
    frame = frame.copy()
    ok = frame["ok"].to_numpy(dtype=bool)
    met = ok.copy()
    for metric, column in (("ttft", "ttft"), ("itl", "tpot"), ("e2e", "e2e")):
        bound = frame["bucket"].map(lambda b, m=metric: getattr(slo.for_bucket(str(b)), m))
        values = frame[column].to_numpy(dtype=float, na_value=np.nan)
        limit = bound.to_numpy(dtype=float, na_value=np.nan)
        no_bound = np.isnan(limit)
        # A one-token answer has no TPOT: its ITL bound holds; a missing TTFT/E2E does not.
        missing_ok = metric == "itl"
        within = np.where(np.isnan(values), missing_ok, values <= limit)
        hit = ok & (no_bound | within)
        frame[f"met_{metric}"] = hit
        met &= hit
    frame["met"] = met
    return frame


def _session_stats(group: pd.DataFrame) -> SessionStats:
    later = group[group["turn"].fillna(1) > 1]
    known = later.dropna(subset=["reused", "prompt_tokens"])
    reused = known["reused"].to_numpy(dtype=float)
    prompt = known["prompt_tokens"].to_numpy(dtype=float)
    return SessionStats(
        later_turns=len(later),
        measured=len(known),
        reused_prefix_tokens_mean=float(reused.mean()) if reused.size else None,
        reused_prefix_share=float(reused.sum() / prompt.sum()) if prompt.sum() > 0 else None,
    )


def _slo_stats(group: pd.DataFrame, bounds: Mapping[str, float], dur: float | None) -> SloStats:
    sent = group[~group["cancelled"] & ~group["skipped"]]
    met = int(sent["met"].sum())
    return SloStats(
        bounds_ms=dict(bounds),
        sent=len(sent),
        met=met,
        attainment=met / len(sent) if len(sent) else None,
        met_by_metric={m: int(sent[f"met_{m}"].sum()) for m in ("ttft", "itl", "e2e")},
        goodput_rps=met / dur if dur and dur > 0 else None,
    )


def _figures(
    group: pd.DataFrame,
    itl: npt.NDArray[np.float64],
    slo: tuple[Mapping[str, float], float | None] | None = None,
) -> dict[str, Any]:
    """``ResultStats``' fields of one group of results (``itl``: the table's ITL gaps); with
    ``slo`` (the bounds that apply and the phase's duration), how the group did against
    them."""
    ok = group[group["ok"]]
    # A request never sent because it cannot fit the target is counted apart: not an error.
    errors = group.loc[~group["ok"] & ~group["skipped"], "error_kind"].value_counts()
    return {
        "requests": len(group),
        "ok": len(ok),
        "errors": int(errors.sum()),
        "skipped_too_long": int(group["skipped"].sum()) or None,
        "errors_by_kind": {str(k): int(n) for k, n in sorted(errors.items())},
        "output_tokens": int(ok["output_tokens"].sum()),
        "prompt_tokens_median": _median(group["prompt_tokens"]),
        "output_tokens_median": _median(ok["output_tokens"]),
        "ttft_ms": pct(ok["ttft"]),
        "ttft_from_schedule_ms": pct(ok["from_schedule"]),
        "queue_delay_ms": pct(group["queue_delay"]),
        "itl_ms": pct(gaps(ok, itl)),  # every gap of every answer, pooled
        "e2e_ms": pct(ok["e2e"]),
        "decode_tok_s_median": _median(ok["decode_rate"]),
        "tokens_estimated": bool(ok["estimated"].any()),
        **({"reasoning": _reasoning_stats(ok)} if ok["reasoning_tokens"].any() else {}),
        **({"slo": _slo_stats(group, *slo)} if slo is not None else {}),
        **({"sessions": _session_stats(group)} if group["turn"].notna().any() else {}),
    }


def _reasoning_stats(ok: pd.DataFrame) -> ReasoningStats:
    reasoned = ok[ok["reasoning_tokens"] > 0]
    return ReasoningStats(
        answers=len(reasoned),
        tokens=int(reasoned["reasoning_tokens"].sum()),
        tokens_median=_median(reasoned["reasoning_tokens"]),
        tokens_estimated=bool(reasoned["reasoning_estimated"].any()),
        time_to_answer_ms=pct(ok["time_to_answer"]),
        no_answer=int(reasoned["time_to_answer"].isna().sum()),
    )


def summarize(results: Iterable[Result]) -> ResultStats:
    """Client-side figures for one group of results."""
    return ResultStats(**_figures(*results_frame(results)))


def summarize_server(series: Sequence[Mapping[str, Any]], start: float, end: float) -> ServerStats:
    """Server-side figures over a phase from scraped snapshots; the runner scrapes at the
    phase's start and end, so counter deltas cover exactly the phase."""
    inside = [s for s in series if start <= s["t"] <= end]

    def peak(key: str) -> float | None:
        vals = [s[key] for s in inside if key in s]
        return max(vals) if vals else None

    first, last = (inside[0], inside[-1]) if inside else ({}, {})

    def delta(key: str) -> float | None:
        if key in first and key in last:
            return float(last[key] - first[key])
        return None

    def hist_mean_ms(name: str) -> float | None:
        a, b = first.get(f"{name}_hist"), last.get(f"{name}_hist")
        if a and b and b["count"] > a["count"]:
            return float(1000 * (b["sum"] - a["sum"]) / (b["count"] - a["count"]))
        return None

    q, h = delta("prefix_queries"), delta("prefix_hits")
    a, b = first.get("e2e_hist"), last.get("e2e_hist")
    return ServerStats(
        scrapes=len(inside),
        peak_kv_usage=peak("kv_usage"),
        peak_running=peak("running"),
        peak_waiting=peak("waiting"),
        preemptions=delta("preemptions"),
        prefix_cache_hit_rate=(h / q) if q and h is not None else None,
        server_ttft_mean_ms=hist_mean_ms("ttft"),
        server_itl_mean_ms=hist_mean_ms("itl"),
        server_e2e_mean_ms=hist_mean_ms("e2e"),
        server_finished=float(b["count"] - a["count"]) if a and b else None,
    )


def server_over(
    series: Sequence[Mapping[str, Any]], spans: Sequence[tuple[float, float]]
) -> ServerStats:
    """``summarize_server`` over several spans of one phase (the blocks an interleaved phase
    gave this arm, each with its own edge scrapes): peaks over all of them, counters summed
    span by span, the server's means over every request it finished in them. Snapshots
    between the spans (another arm's blocks on the same server) are left out."""
    parts = [summarize_server(series, a, b) for a, b in spans]
    inside = [s for s in series if any(a <= s["t"] <= b for a, b in spans)]

    def peak(key: str) -> float | None:
        vals = [s[key] for s in inside if key in s]
        return max(vals) if vals else None

    def total(values: Sequence[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return float(sum(known)) if known else None

    def mean_ms(name: str) -> float | None:
        sums = counts = 0.0
        for a, b in spans:
            snaps = [s for s in series if a <= s["t"] <= b]
            first = snaps[0].get(f"{name}_hist") if snaps else None
            last = snaps[-1].get(f"{name}_hist") if snaps else None
            if first and last and last["count"] > first["count"]:
                sums += last["sum"] - first["sum"]
                counts += last["count"] - first["count"]
        return 1000 * sums / counts if counts else None

    q = total([_delta(series, a, b, "prefix_queries") for a, b in spans])
    h = total([_delta(series, a, b, "prefix_hits") for a, b in spans])
    return ServerStats(
        scrapes=len(inside),
        peak_kv_usage=peak("kv_usage"),
        peak_running=peak("running"),
        peak_waiting=peak("waiting"),
        preemptions=total([p.preemptions for p in parts]),
        prefix_cache_hit_rate=(h / q) if q and h is not None else None,
        server_ttft_mean_ms=mean_ms("ttft"),
        server_itl_mean_ms=mean_ms("itl"),
        server_e2e_mean_ms=mean_ms("e2e"),
        server_finished=total([p.server_finished for p in parts]),
    )


def _delta(series: Sequence[Mapping[str, Any]], start: float, end: float, key: str) -> float | None:
    inside = [s for s in series if start <= s["t"] <= end and key in s]
    return float(inside[-1][key] - inside[0][key]) if inside else None


def spans_of(window: Mapping[str, Any]) -> list[tuple[float, float]] | None:
    """An interleaved phase's blocks as (start, end) spans; None for a phase sent whole."""
    blocks = window.get("blocks")
    return [(float(b[1]), float(b[2])) for b in blocks] if blocks else None


def capacity(
    cache_config: Mapping[str, str], context_tokens: float | None, served: ServedCache | None = None
) -> Capacity:
    """Cache size in tokens and how many sequences of ``context_tokens`` it holds at once:
    counted per layer type where the model's layout is known (``served``), else as tokens over
    context (right only when every layer attends in full)."""
    size = _num(cache_config.get("kv_cache_size_tokens"))
    if served is not None and context_tokens:
        held = served.concurrency(context_tokens)
        return Capacity(kv_cache_size_tokens=size, concurrency_at_context=held, per_layer_type=True)
    conc = size / context_tokens if size is not None and context_tokens else None
    return Capacity(kv_cache_size_tokens=size, concurrency_at_context=conc)


def _num(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "None", "") else None
    except ValueError:
        return None


def _phase(
    group: pd.DataFrame,
    itl: npt.NDArray[np.float64],
    window: Mapping[str, float],
    cache: Mapping[str, str],
    series: Sequence[Mapping[str, Any]],
    bucket_order: Sequence[str],
    slo: SloSpec | None = None,
    served: ServedCache | None = None,
) -> PhaseSummary:
    import pandas as pd

    start, end = window["start"], window["end"]
    spans = spans_of(window)
    # An interleaved phase's arm was busy only in its own blocks: its rates are over those.
    dur = sum(b - a for a, b in spans) if spans else end - start
    by_bucket = dict(iter(group.groupby("bucket", sort=False)))
    # The phase's results bucket by bucket, as the summary has always taken them: a mean's
    # last digit depends on the order it adds in.
    totals = _figures(
        pd.concat(by_bucket.values()) if by_bucket else group,
        itl,
        (slo.default.to_json(), dur) if slo is not None else None,
    )
    buckets = {}
    for b in sorted(
        by_bucket, key=lambda b: (bucket_order.index(b) if b in bucket_order else 99, b)
    ):
        figures = _figures(
            by_bucket[b], itl, (slo.for_bucket(str(b)).to_json(), dur) if slo is not None else None
        )
        ctx = None
        if figures["prompt_tokens_median"] is not None:
            ctx = figures["prompt_tokens_median"] + (figures["output_tokens_median"] or 0)
        buckets[str(b)] = BucketStats(**figures, capacity=capacity(cache, ctx, served))
    throughput = totals["output_tokens"] / dur if dur > 0 and len(group) else None
    return PhaseSummary(
        start=start,
        end=end,
        duration_s=dur,
        all=PhaseTotals(**totals, throughput_out_tok_s=throughput),
        server=server_over(series, spans) if spans else summarize_server(series, start, end),
        buckets=buckets,
    )


def summarize_targets(
    results: Iterable[Result],
    targets: Mapping[str, Mapping[str, Any]],
    series: Mapping[str, Sequence[Mapping[str, Any]]],
    bucket_order: Sequence[str],
    slo: SloSpec | None = None,
) -> dict[str, TargetSummary]:
    """Each target's phases (its windows) and, in each, its buckets in the run's order; with
    ``slo``, each group's SLO attainment and goodput."""
    frame, itl = results_frame(results)
    if slo is not None:
        frame = with_slo(frame, slo)
    groups = dict(iter(frame.groupby(["target", "phase"], sort=False)))
    out = {}
    for name, info in targets.items():
        cache = info.get("cache_config") or {}
        served, layers = served_cache(info) or (None, None)
        out[name] = TargetSummary(
            status=info.get("status"),
            reason=info.get("reason"),
            cache_dtype=cache.get("cache_dtype"),
            kv_cache_size_tokens=_num(cache.get("kv_cache_size_tokens")),
            phases={
                label: _phase(
                    groups.get((name, label), frame.iloc[:0]),
                    itl,
                    window,
                    cache,
                    series.get(name, ()),
                    bucket_order,
                    slo,
                    served,
                )
                for label, window in (info.get("phases") or {}).items()
            },
            layer_capacity=layers,
        )
    return out
