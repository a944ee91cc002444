"""The rich tables kvcal prints: samples per bucket, the scales calibrated, emulated quality
and per-layer sensitivity; and the number formats they share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich import box
from rich.table import Table


def _pct(x: float) -> str:
    return "0" if x == 0 else f"{100 * x:.3g}%"


def _pct1(x: float) -> str:
    return f"{x:.1%}"


def nll(x: float) -> str:
    """A ΔNLL per token, signed; tiny ones in scientific notation rather than as +0.0000."""
    return f"{x:+.1e}" if x and abs(x) < 5e-4 else f"{x:+.4f}"


def _ci(
    mean: float | None, lo: float | None, hi: float | None, fmt: Callable[[float], str] = nll
) -> str:
    if mean is None:
        return "-"
    if lo is None or hi is None:
        return fmt(mean)
    return f"{fmt(mean)}\n[{fmt(lo)}, {fmt(hi)}]"


def bucket_table(split: Any) -> Table:
    table = Table(title="calibration samples per bucket")
    for col in ("bucket", "requests", "calibration", "evaluation"):
        table.add_column(col, justify="right")
    for label, row in split.buckets.items():
        table.add_row(
            label,
            str(row["available"]),
            str(row["calibration"]),
            str(row["available"] - row["calibration"]),
        )
    return table


def scale_table(report: dict[str, Any]) -> Table:
    search = any(t["mse_scale"] is not None for t in report["tensors"])
    table = Table(title=f"K/V scales ({report['samples']} samples, {report['tokens']} tokens)")
    cols = [
        "layer",
        "tensor",
        "amax",
        "scale",
        "heads amax",
        "clip@1",
        "zero@1",
        "zero@s",
        "subnormal@s",
    ] + (["mse scale", "mse gain"] if search else [])
    for col in cols:
        table.add_column(col, justify="right")
    for t in report["tensors"]:
        row = [
            str(t["layer"]),
            t["which"].upper(),
            f"{t['amax']:.4g}",
            f"{t['scale']:.4g}",
            " ".join(f"{h:.3g}" for h in t["head_amax"][:8]),
            _pct(t["clip_at_1"]),
            _pct(t["zero_at_1"]),
            _pct(t["zero_at_scale"]),
            _pct(t["subnormal_at_scale"]),
        ]
        if search:
            row += [f"{t['mse_scale']:.4g}", f"{t['mse_gain']:.3g}x"]
        table.add_row(*row)
    return table


def advice_lines(report: dict[str, Any]) -> list[str]:
    adv = report["advice"]
    out = list(adv["reasons"]) or ["no layer or head range stands out: per-tensor scales fit"]
    if adv["skip_layers_flag"]:
        out.append(f"to keep the outlier layers in BF16: {adv['skip_layers_flag']}")
    out.append(f"per-head scales here: {report['per_head_backend']}")
    return out


def _capacity(setting: dict[str, Any]) -> tuple[str, str]:
    return (
        f"{setting['bytes_per_token'] / 1024:.3g}",
        f"{setting['capacity_ratio']:.2f}x",
    )


def emulation_tables(report: dict[str, Any]) -> list[Table]:
    """One table per bucket (and all), a row per setting: its format's loss with intervals,
    greedy agreement, bytes per token and the capacity they imply, and whether it stays within
    ``--max-dnll`` (ΔNLL per token) in every bucket."""
    ref = report["reference"]
    settings = {s["name"]: s for s in report["settings"]}
    fits = report["advice"]["within_tolerance"]
    buckets = list(dict.fromkeys(r["bucket"] for r in report["results"]))
    tables = []
    for bucket in buckets:
        rows = [r for r in report["results"] if r["bucket"] == bucket]
        table = Table(
            title=f"EMULATED KV formats vs BF16, bucket {bucket}: {rows[0]['requests']} "
            f"requests ({ref['requests']} in all, {ref['tokens']} answer tokens "
            "teacher-forced; 95% intervals)",
            box=box.SIMPLE_HEAD,
        )
        cols = ["setting", "rounding", "ΔNLL/token", "top-1", "greedy\nexact", "common\nprefix"]
        cols += ["KiB/token", "capacity\nvs BF16"] + (
            ["within tol.\n(all buckets)"] if fits else []
        )
        for col in cols:
            table.add_column(col, justify="left" if col == "setting" else "right")
        for row in rows:
            g = row["greedy"]
            cells = [
                row["setting"].removesuffix(f" {row['rounding']}"),
                row["rounding"],
                _ci(row["nll_delta_mean"], row["nll_delta_lo"], row["nll_delta_hi"]),
                _ci(row["top1_agreement"], row["top1_lo"], row["top1_hi"], _pct1),
                f"{g['exact']}/{g['requests']}" if g else "-",
                f"{g['mean_common_prefix']:.1f}/{g['mean_tokens']:.1f}" if g else "-",
                *_capacity(settings[row["setting"]]),
            ]
            if fits:
                cells.append("yes" if fits[row["setting"]] else "no")
            table.add_row(*cells)
        tables.append(table)
    return tables


def emulation_markdown(report: dict[str, Any]) -> str:
    """The per-bucket tables as one Markdown table (a README, a PR comment): a row per setting,
    ΔNLL/token [95% CI] per bucket, then top-1 agreement and greedy exact matches over every
    bucket, bytes and capacity, and whether it stays within ``--max-dnll`` (ΔNLL per token)."""
    settings = {s["name"]: s for s in report["settings"]}
    fits = report["advice"]["within_tolerance"]
    buckets = list(dict.fromkeys(r["bucket"] for r in report["results"]))
    rows = {(r["setting"], r["bucket"]): r for r in report["results"]}
    head = ["setting", "rounding", *(f"ΔNLL/token {b}" for b in buckets)]
    head += ["top-1, all", "greedy exact", "KiB/token", "x BF16"]
    head += [f"ΔNLL <= {report['tolerance']:g} in every bucket"] if fits else []
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, s in settings.items():
        every = rows[(name, "all")]
        g = every["greedy"]
        cells = [f"`{name.removesuffix(' ' + s['rounding'])}`", s["rounding"]]
        for b in buckets:
            r = rows[(name, b)]
            cells.append(_ci(r["nll_delta_mean"], r["nll_delta_lo"], r["nll_delta_hi"]))
        cells += [
            _pct1(every["top1_agreement"]) if every["top1_agreement"] is not None else "-",
            f"{g['exact']}/{g['requests']}" if g else "-",
            *_capacity(s),
        ]
        if fits:
            cells.append("yes" if fits[name] else "no")
        out.append("| " + " | ".join(c.replace("\n", " ") for c in cells) + " |")
    return "\n".join(out) + "\n"


def sensitivity_table(sens: dict[str, Any]) -> Table:
    table = Table(
        title=f"per-layer sensitivity on {sens['base']} (every layer in it: ΔNLL "
        f"{nll(sens['loss'])}/token)",
        box=box.SIMPLE_HEAD,
    )
    for col in (
        "layer",
        "ΔNLL/token,\nonly this layer\nquantized",
        "ΔNLL/token,\nthis layer BF16",
        "recovered",
        "share",
    ):
        table.add_column(col, justify="right")
    for r in sens["layers"]:
        only, kept = r["only_fp8"], r["kept_bf16"]
        share = r["recovered_share"]
        table.add_row(
            str(r["layer"]),
            _ci(only["nll_delta_mean"], only["nll_delta_lo"], only["nll_delta_hi"]),
            _ci(kept["nll_delta_mean"], kept["nll_delta_lo"], kept["nll_delta_hi"]),
            nll(r["recovered"]),
            "-" if share is None else f"{share:.0%}",
        )
    return table
