"""The terminal table: one row per target x phase x bucket."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def _tokens(v: float | None) -> str:
    return "–" if v is None else f"{v:,.0f}"


def summary_table(summary: dict[str, Any]) -> Table:
    t = Table(title="kvcanary replay: per target x phase x bucket", show_lines=False)
    for col, just in (("target", "left"), ("phase", "left"), ("bucket", "left"), ("n", "right"),
                      ("err", "right"), ("TTFT p50/p99 ms", "right"),
                      ("ITL p50/p99 ms", "right"), ("E2E p50 ms", "right"),
                      ("out tok/s", "right"), ("KV cache tokens", "right"),
                      ("seqs fit", "right"), ("peak KV", "right"), ("preempt", "right"),
                      ("prefix hit", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for name, tgt in summary["targets"].items():
        if tgt["status"] != "ok":
            t.add_row(name, "", "", "", "all", f"[red]{tgt['status']}[/red]", "", "", "",
                      _tokens(tgt.get("kv_cache_size_tokens")), "", "", "", "")
        for label, ph in tgt["phases"].items():
            srv = ph["server"]
            for i, (bucket, row) in enumerate(ph["buckets"].items()):
                first = i == 0
                t.add_row(
                    name, label, bucket, str(row["requests"]),
                    str(row["errors"]) if row["errors"] else "0",
                    f"{_f(row['ttft_ms']['p50'])} / {_f(row['ttft_ms']['p99'])}",
                    f"{_f(row['itl_ms']['p50'], '{:.2f}')} / {_f(row['itl_ms']['p99'], '{:.2f}')}",
                    _f(row["e2e_ms"]["p50"], "{:.0f}"),
                    _f(ph["all"].get("throughput_out_tok_s")) if first else "",
                    _tokens(row["capacity"]["kv_cache_size_tokens"]),
                    _f(row["capacity"]["concurrency_at_context"], "{:,.0f}"),
                    _f(None if srv["peak_kv_usage"] is None else 100 * srv["peak_kv_usage"],
                       "{:.1f}%") if first else "",
                    _f(srv["preemptions"], "{:.0f}") if first else "",
                    _f(None if srv["prefix_cache_hit_rate"] is None
                       else 100 * srv["prefix_cache_hit_rate"], "{:.0f}%") if first else "",
                )
    return t
