"""What each emulated setting costs and buys, and the advice ``kvcal emulate`` gives from it.

* **Capacity**: the cache bytes one token takes in the model (every layer and KV head, K and
  V; a layer kept in BF16 at BF16's bytes), from the format's layout
  (``replay.serving.kv_formats``), and what that implies: tokens per GiB of cache and the
  multiple of BF16's. A sliding-window layer holds at most its window, so in a hybrid model
  these are a request's figures at the model's max length (:mod:`kvcal._capacity`). Implied
  by the bytes, never measured: a served cache's own figures come from the replay.
* **Largest ΔNLL per token** (``--max-dnll``, formerly ``--tolerance``; the report keeps the
  key ``tolerance``): a setting stays within it when, in every bucket, the upper end of its
  ΔNLL-per-token interval is at most that bound (the loss is bounded below it, not merely not
  shown).
* **Rounding**: a format scored at both roundings loses ``cpu - cuda`` more to truncation
  than to rounding to nearest; that difference over the truncated loss is the share of the
  loss the rounding makes, given when the truncated loss is real (its interval above 0 and
  its mean at least ``--min-loss``): a share of noise means nothing, and the line says which
  of the two each loss misses. Where rounding to nearest loses as much or more, the loss is
  the format's own, not its rounding's. Where only one rounding stays within the bound,
  the line says so: there the rounding decides whether the format is affordable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._capacity import Capacity
from .cache import Setting
from .sensitivity import why_no_loss

GIB = 1 << 30


def setting_facts(s: Setting, cap: Capacity) -> dict[str, Any]:
    """Bytes per token in the model under ``s``, and the capacity they imply, each layer
    by its attention type at ``cap``'s context (see :mod:`kvcal._capacity`)."""
    total = cap.bytes_per_token(s.fmt, s.skip)
    return {
        "bytes_per_token": total,
        "bf16_bytes_per_token": cap.bytes_per_token("bfloat16"),
        "capacity_ratio": cap.ratio(s.fmt, s.skip),
        "tokens_per_gib": GIB / total,
        "capacity_at_tokens": cap.context,
    }


def _rows(report: Mapping[str, Any], name: str) -> list[Mapping[str, Any]]:
    return [r for r in report["results"] if r["setting"] == name]


def _all(report: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    return next(r for r in _rows(report, name) if r["bucket"] == "all")


def within_max_dnll(report: Mapping[str, Any], max_dnll: float) -> dict[str, bool]:
    """Each setting: is its ΔNLL per token bounded by ``max_dnll`` in every bucket?"""
    out = {}
    for s in report["settings"]:
        his = [r.get("nll_delta_hi") for r in _rows(report, s["name"])]
        out[s["name"]] = bool(his) and all(h is not None and h <= max_dnll for h in his)
    return out


def rounding_costs(
    report: Mapping[str, Any], fits: Mapping[str, bool] | None = None
) -> list[dict[str, Any]]:
    """For each setting scored at both roundings: the loss each gives, whether each is real
    (and why not), the share of the truncated loss that rounding to nearest removes (None
    unless the truncated loss is real) and, given ``fits``, whether each stays within the
    largest ΔNLL per token (``within_max_dnll``)."""
    by_key: dict[tuple[str, ...], dict[str, str]] = {}
    for s in report["settings"]:
        key = (s["format"], s["scales"], ",".join(map(str, s["skip_layers"])))
        by_key.setdefault(key, {})[s["rounding"]] = s["name"]
    min_loss = float(report.get("min_loss", 0.0))
    out = []
    for names in by_key.values():
        if set(names) != {"cpu", "cuda"}:
            continue
        cpu, cuda = _all(report, names["cpu"]), _all(report, names["cuda"])
        lc, lg = cpu.get("nll_delta_mean"), cuda.get("nll_delta_mean")
        if lc is None or lg is None:
            continue
        why_cpu, why_cuda = why_no_loss(cpu, min_loss), why_no_loss(cuda, min_loss)
        real_cpu, real_cuda = why_cpu is None, why_cuda is None
        out.append(
            {
                "cpu": names["cpu"],
                "cuda": names["cuda"],
                "loss_cpu": lc,
                "loss_cuda": lg,
                "real_cpu": real_cpu,
                "real_cuda": real_cuda,
                "why_cpu": why_cpu,
                "why_cuda": why_cuda,
                "difference": lc - lg,
                "share": (lc - lg) / lc if real_cpu else None,
                "fits_cpu": None if fits is None else fits[names["cpu"]],
                "fits_cuda": None if fits is None else fits[names["cuda"]],
            }
        )
    return out


def _nll(x: float) -> str:
    return f"{x:+.1e}" if x and abs(x) < 5e-4 else f"{x:+.4f}"


def _max_dnll_line(
    settings: Sequence[Mapping[str, Any]], fits: Mapping[str, bool], max_dnll: float
) -> str:
    ok = [s for s in settings if fits[s["name"]]]
    bound = f"ΔNLL/token bounded by {max_dnll:g} in every bucket"
    if not ok:
        return f"no setting keeps {bound}"
    top = max(s["capacity_ratio"] for s in ok)
    best = [s["name"] for s in ok if s["capacity_ratio"] >= top - 1e-9]
    listed = ", ".join(f"{s['name']} ({s['capacity_ratio']:.2f}x BF16)" for s in ok)
    return f"{bound}: {listed}; the most capacity ({top:.2f}x): {', '.join(best)}"


def _loss_verdict(c: Mapping[str, Any]) -> str:
    if c["share"] is not None and c["share"] >= 1:
        # Rounded to nearest loses nothing (or gains a little): no share above all of it.
        return "the rounding is all of the truncated loss: rounded to nearest, none is left"
    if c["share"] is not None and c["share"] > 0:
        return f"the rounding is {c['share']:.0%} of the truncated loss"
    if c["share"] is not None:
        return "truncation costs nothing over rounding to nearest; the loss is the format's"
    if c["real_cuda"]:
        return (
            "only rounding to nearest loses beyond noise and --min-loss; the loss is the format's"
        )
    return (
        f"no real loss to split between the format and its rounding (truncated: {c['why_cpu']}; "
        f"rounded to nearest: {c['why_cuda']})"
    )


def _max_dnll_note(c: Mapping[str, Any]) -> str:
    if c["fits_cpu"] is None or c["fits_cpu"] == c["fits_cuda"]:
        return ""
    kept = "rounded to nearest" if c["fits_cuda"] else "truncated"
    return f"; within the tolerance in every bucket only when {kept}: the rounding decides"


def _rounding_line(c: Mapping[str, Any]) -> str:
    head = (
        f"{c['cpu']}: truncated (vLLM CPU) {_nll(c['loss_cpu'])}/token, rounded to nearest "
        f"(CUDA, {c['cuda']}) {_nll(c['loss_cuda'])}"
    )
    return f"{head}: {_loss_verdict(c)}{_max_dnll_note(c)}"


def advise(report: Mapping[str, Any]) -> dict[str, Any]:
    """Which settings stay within the largest ΔNLL per token (the report's ``tolerance``), the
    rounding shares and the advice lines."""
    max_dnll = report.get("tolerance")
    fits, lines = None, []
    if max_dnll is not None:
        fits = within_max_dnll(report, float(max_dnll))
        lines.append(_max_dnll_line(report["settings"], fits, float(max_dnll)))
    costs = rounding_costs(report, fits)
    lines += [_rounding_line(c) for c in costs]
    return {"within_tolerance": fits, "rounding": costs, "lines": lines}
