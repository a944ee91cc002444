"""``kvcal advise``: what to try when FP8 (calibrated or not) still loses, from measurements.

One model load, one BF16 reference, then the settings a decision needs, each scored
teacher-forced on the same requests (:mod:`kvcal.emulate`'s scorer and intervals):

* FP8 at scale 1.0 and at the calibrated scales (``--overlay``), each with the backend's own
  rounding (``--rounding``: vLLM CPU truncates the mantissa, CUDA rounds to nearest) and with
  the other one: how much of the loss is the kernel's rounding rather than the format;
* per-head scales from the overlay's calibration report (``kvcal_report.json``: each head's
  amax / 448), and whether the backend here takes them (vLLM's own answer);
* the layers to keep in BF16: each layer kept BF16 alone, ranked by the loss it recovers on
  the best per-tensor setting the backend serves, and the smallest set that recovers
  ``--recover`` of it, scored again to confirm; with its cost in cache capacity
  (``--kv-cache-dtype-skip-layers`` keeps those layers' cache in BF16);
* on a hybrid model (sliding-window and full-attention layers), every sliding-window layer
  kept in BF16 (vLLM's ``--kv-cache-dtype-skip-layers sliding_window``) as one more
  candidate. A sliding-window layer caches only its window, so what a layer costs in BF16
  depends on its attention type and the request's length: capacity is counted per layer
  type at the model's max length (:mod:`kvcal._capacity`), never by counting layers.

Then the advice, in this order: nothing to do when the best setting shows no real loss; keep
layers in BF16 when that recovers enough and keeps at least the capacity ``--max-skip-share``
of a uniform model's layers would (:func:`keep_floor`): the confirmed set or the
sliding-window layers, whichever keeps more; per-head scales when they recover it and the
backend takes them; otherwise reject FP8 on this backend, saying how much of the loss the
backend's rounding makes (a backend that rounds to nearest may keep it: test there). Each
step names its figures. An emulation: it predicts quality, never capacity or kernel speed;
``replay canary`` with the advised arm served (``--skip-layers NAME=LAYERS``) checks it, and
``--advice`` shows this file's figures in the verdict.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from replay.core.buckets import Buckets
from replay.core.errors import InputError
from replay.serving.kv_layout import SLIDING_WINDOW

from ._advise_scoring import Meter, NoMeter, TapedScorer, tokens
from ._capacity import Capacity, model_capacity
from ._fp8 import E4M3_MAX, hf_head_scale
from ._kv_formats import ENGINE_ROUNDING
from .emulate.cache import Setting, uniform
from .emulate.overlay import overlay_setting, read_overlay
from .emulate.report import CAVEAT, INTERVAL, EmulateArgs, capacity_notes, draw_requests
from .emulate.score import bf16_answers, by_bucket, reference_scores, tf_summary
from .emulate.sensitivity import loss_is_real

FLAG = "--kv-cache-dtype-skip-layers"
OTHER_ROUNDING = {"cpu": "cuda", "cuda": "cpu"}
ROUNDING_WORDS = {
    "cpu": "vLLM CPU's truncation",
    "cuda": "CUDA's round-to-nearest",
}


@dataclass
class AdviseArgs(EmulateArgs):
    """``EmulateArgs`` plus what the advice weighs."""

    max_skip_share: float = 0.5  # more layers in BF16 than this share is not worth FP8
    per_head_supported: bool = False
    per_head_why: str = ""
    skip_candidates: int = 8  # best-ranked layers tried for the confirmed set, at most
    whole_passes: bool = False  # score every setting by whole passes (the benchmark's before)
    notes: list[str] = field(default_factory=list)


def per_head_setting(overlay: Path, base: Setting, kv_heads: int) -> Setting | None:
    """Per-head scales from the overlay's calibration report (each head's amax / 448), at
    the base setting's rounding; None when the report has no per-head amax."""
    report = overlay / "kvcal_report.json"
    if not report.is_file():
        return None
    try:
        rows = json.loads(report.read_text("utf-8"))["tensors"]
        amax = {(int(r["layer"]), str(r["which"])): list(map(float, r["head_amax"])) for r in rows}
    except (ValueError, KeyError, TypeError):
        return None
    k: list[torch.Tensor] = []
    v: list[torch.Tensor] = []
    for layer in range(len(base.k)):
        for which, out in (("k", k), ("v", v)):
            heads = amax.get((layer, which))
            if heads is None or len(heads) != kv_heads:
                return None
            scale = torch.tensor([max(h, 1e-12) / E4M3_MAX for h in heads])
            out.append(hf_head_scale(scale, kv_heads))
    return replace(base, name="fp8@per-head", k=tuple(k), v=tuple(v), scales=str(overlay))


def backend_rounding(rounding: str) -> str:
    """The rounding of the backend advised for: ``--rounding`` cpu or cuda, or the engine's
    for FP8 (vLLM CPU's truncation). Advise scores the other one itself."""
    if rounding == "both":
        raise InputError(
            "kvcal advise --rounding both: advise scores both roundings already; give the "
            "backend's (cpu, cuda, or engine: vLLM CPU's)"
        )
    return ENGINE_ROUNDING["fp8"] if rounding == "engine" else rounding


def keep_floor(max_skip_share: float) -> float:
    """The least capacity (x BF16) that still counts as keeping FP8: what ``max_skip_share``
    of a uniform model's layers in BF16 leave, 2 / (1 + share) (1.33x at a half). On a
    uniform model the same rule as counting layers; on a hybrid one each layer weighs what
    its cache holds (a sliding-window layer little, at length)."""
    return 2 / (1 + max_skip_share)


def _row(
    scorer: TapedScorer, s: Setting, labels: list[str], keep: str | None = None
) -> dict[str, Any]:
    scores, overall = scorer.overall(s, keep=keep)
    buckets = by_bucket(scorer.items, labels)
    return {
        "setting": s.name,
        "rounding": s.rounding,
        "scales": s.scales,
        "skip_layers": list(s.skip),
        "all": overall,
        "buckets": {b: tf_summary(scores, scorer.ref, ids) for b, ids in buckets.items()},
    }


def _mean(row: dict[str, Any] | None) -> float | None:
    return None if row is None else row["all"].get("nll_delta_mean")


def rank_layers(scorer: TapedScorer, base: Setting, loss: float) -> list[dict[str, Any]]:
    """Each layer kept in BF16 alone (the others as ``base``): the loss it recovers. Each
    pass resumes from the base setting's tape at its layer."""
    rows = []
    scorer.meter.plan(sum(scorer.work(base.skipping([i])) for i in range(len(base.k))))
    for layer in range(len(base.k)):
        _, kept = scorer.overall(base.skipping([layer]), f"layer {layer} kept BF16")
        recovered = loss - float(kept.get("nll_delta_mean") or 0.0)
        rows.append({"layer": layer, "kept_bf16": kept, "recovered": recovered})
    return sorted(rows, key=lambda r: -r["recovered"])


def confirm_skip(
    scorer: TapedScorer,
    base: Setting,
    ranked: list[dict[str, Any]],
    loss: float,
    args: AdviseArgs,
    cap: Capacity,
) -> dict[str, Any] | None:
    """The smallest prefix of the ranking whose confirmed recovery reaches ``recover`` of
    the loss, scored set by set (up to ``skip_candidates`` layers), and stopped before the
    first set that keeps less capacity than :func:`keep_floor` (None when the first does).
    Each set resumes from the one before it at the layer it adds (the ``chain`` tape)."""
    tries: list[dict[str, Any]] = []
    sets = [
        sorted(int(r["layer"]) for r in ranked[:k])
        for k in range(1, min(args.skip_candidates, len(ranked)) + 1)
    ]
    # each set resumes at the layer it adds: its work planned (the search may stop sooner)
    total = sum(tokens(it) for it in scorer.items)
    share = 0.0 if scorer.whole else 1 / len(base.k)
    planned = [total * (1 - r["layer"] * share) for r in ranked[: len(sets)]]
    scorer.meter.plan(sum(planned))
    floor, stopped = keep_floor(args.max_skip_share), None
    for k, chosen in enumerate(sets, 1):
        if cap.ratio("fp8", chosen) < floor - 1e-9:
            # neither this set nor a larger one keeps the capacity advice asks for: the
            # search cannot change the advice any more
            stopped = {"skip_layers": chosen, "capacity_ratio": cap.ratio("fp8", chosen)}
            scorer.meter.plan(-sum(planned[k - 1 :]))
            break
        _, summary = scorer.overall(
            base.skipping(chosen, f"{base.name} skip {chosen}"),
            f"confirming layers {chosen}",
            keep="chain",
        )
        share = (loss - float(summary.get("nll_delta_mean") or 0.0)) / loss
        tries.append({"skip_layers": chosen, "summary": summary, "recovered_share": share})
        if share >= args.recover:
            scorer.meter.plan(-sum(planned[k:]))
            break
    scorer.drop("chain")
    if not tries:
        return None
    best = max(tries, key=lambda t: float(t["recovered_share"]))
    skip: list[int] = best["skip_layers"]
    return {
        "tries": tries,
        "stopped_below_floor": stopped,
        "skip_layers": skip,
        "recovered_share": best["recovered_share"],
        "reached": best["recovered_share"] >= args.recover,
        "flag": f"{FLAG} {' '.join(map(str, skip))}",
        "capacity_ratio": cap.ratio("fp8", skip),
        "capacity_at_tokens": cap.context,
    }


def sliding_candidate(
    scorer: TapedScorer, base: Setting, cap: Capacity, labels: list[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``base`` with every sliding-window layer in BF16 (vLLM's ``sliding_window`` word): its
    settings row, and as a candidate its recovery of ``base``'s loss and its capacity."""
    sliding = cap.layout.sliding
    setting = base.skipping(sliding, f"{base.name}, sliding-window layers in BF16")
    row = _row(scorer, setting, labels)
    return row, {
        "setting": setting.name,
        "skip_layers": list(sliding),
        "flag": f"{FLAG} {SLIDING_WINDOW}",
        "all": row["all"],
        "capacity_ratio": cap.ratio("fp8", sliding),
        "capacity_at_tokens": cap.context,
    }


def _recovery(candidate: dict[str, Any], loss: float, recover: float) -> dict[str, Any]:
    share = (loss - float(candidate["all"].get("nll_delta_mean") or 0.0)) / loss
    return {**candidate, "recovered_share": share, "reached": share >= recover}


def _kept(
    skip: dict[str, Any] | None,
    sliding: dict[str, Any] | None,
    args: AdviseArgs,
    at: str,
    reasons: list[str],
) -> dict[str, Any] | None:
    """Of the confirmed layer set and the sliding-window layers, the one that recovers
    ``recover`` of the loss and keeps the most capacity, at least :func:`keep_floor`'s;
    each one's figures added to ``reasons``."""
    floor = keep_floor(args.max_skip_share)
    if skip is not None:
        reasons.append(
            f"layers {skip['skip_layers']} in BF16 recover {skip['recovered_share']:.0%} of the "
            f"loss (confirmed; capacity {skip['capacity_ratio']:.2f}x BF16{at} instead of 2x)"
        )
    if sliding is not None:
        reasons.append(
            f"the {len(sliding['skip_layers'])} sliding-window layers in BF16 ({sliding['flag']}) "
            f"recover {sliding['recovered_share']:.0%} of the loss (capacity "
            f"{sliding['capacity_ratio']:.2f}x BF16{at} instead of 2x)"
        )
    enough = [c for c in (skip, sliding) if c is not None and c["reached"]]
    ok = [c for c in enough if c["capacity_ratio"] >= floor - 1e-9]
    for c in enough:
        if c not in ok:
            reasons.append(
                f"{_what(c)} recover enough but keep {c['capacity_ratio']:.2f}x BF16{at}, "
                f"less than {floor:.2f}x (--max-skip-share {args.max_skip_share:g})"
            )
    if not ok:
        return None
    best = max(ok, key=lambda c: float(c["capacity_ratio"]))
    if len(ok) == 2:
        other = ok[1] if best is ok[0] else ok[0]
        reasons.append(
            f"both recover {args.recover:.0%} of the loss: {_what(best)} keep more capacity "
            f"({best['capacity_ratio']:.2f}x against {other['capacity_ratio']:.2f}x BF16{at})"
        )
    return best


def _what(candidate: dict[str, Any]) -> str:
    if str(candidate["flag"]).endswith(SLIDING_WINDOW):
        return "the sliding-window layers"
    return f"layers {candidate['skip_layers']}"


def next_step(
    rows: dict[str, dict[str, Any]],
    skip: dict[str, Any] | None,
    args: AdviseArgs,
    sliding: dict[str, Any] | None = None,
    at: str = "",
) -> dict[str, Any]:
    """The advice: one ``action`` (none, skip_layers, per_head, reject) with its reasons.
    ``sliding``: the sliding-window layers in BF16 as a candidate beside the confirmed set
    ``skip``; ``at``: the context the capacity figures hold at (a hybrid model's)."""
    best = rows.get("fp8@cal") or rows["fp8@1.0"]
    real, why = loss_is_real(best["all"], args.min_loss)
    reasons = [f"{best['setting']} ({ROUNDING_WORDS[best['rounding']]}): {why}"]
    if not real:
        return {"action": "none", "reasons": reasons}
    loss = float(_mean(best) or 0.0)
    other = rows.get(best["setting"] + "/" + OTHER_ROUNDING[best["rounding"]])
    rounding_share = None
    if other is not None and loss > 0:
        rounding_share = max(0.0, min(1.0, (loss - float(_mean(other) or 0.0)) / loss))
        reasons.append(
            f"with {ROUNDING_WORDS[other['rounding']]} the same scales lose "
            f"ΔNLL {float(_mean(other) or 0.0):+.4f}/token: {rounding_share:.0%} of the loss is "
            "the backend's rounding"
        )
    out: dict[str, Any] = {"rounding_share": rounding_share, "loss": loss}
    kept = _kept(skip, sliding, args, at, reasons)
    if kept is not None:
        return {
            **out,
            "action": "skip_layers",
            "skip_layers": kept["skip_layers"],
            "flag": kept["flag"],
            "capacity_ratio": kept["capacity_ratio"],
            "reasons": reasons,
        }
    head = rows.get("fp8@per-head")
    if head is not None:
        head_share = (loss - float(_mean(head) or 0.0)) / loss
        support = "the backend here takes them" if args.per_head_supported else args.per_head_why
        reasons.append(f"per-head scales recover {head_share:.0%} of the loss; {support}")
        if head_share >= args.recover and args.per_head_supported:
            return {**out, "action": "per_head", "reasons": reasons}
    if rounding_share is not None and rounding_share >= 0.5:
        reasons.append(
            "reject FP8 on this backend; a backend that rounds to nearest may keep it: replay "
            "the canary there before rejecting it everywhere"
        )
    return {**out, "action": "reject", "reasons": reasons}


def _settings(
    args: AdviseArgs, layers: int, kv_heads: int, backend: str
) -> tuple[list[Setting], frozenset[str]]:
    """FP8 at scale 1.0 and at the overlay's scales, each at both roundings, and per-head
    scales where the overlay's report has them; the calibration ids to leave out."""
    settings = [uniform("fp8@1.0", layers, 1.0, backend)]
    exclude: frozenset[str] = frozenset()
    if args.overlay is not None:
        scales = read_overlay(args.overlay, layers, kv_heads)
        exclude = scales.calibration_ids
        args.notes += list(scales.notes)
        settings.append(overlay_setting("fp8@cal", scales, args.overlay, backend))
    other = OTHER_ROUNDING[backend]
    settings += [replace(s, name=f"{s.name}/{other}", rounding=other) for s in list(settings)]
    head = per_head_setting(args.overlay, settings[0], kv_heads) if args.overlay else None
    if head is not None:
        settings.append(head)
    elif args.overlay is not None:
        args.notes.append(
            "no per-head amax in the overlay's kvcal_report.json: per-head not scored"
        )
    return settings, exclude


def advise(args: AdviseArgs, meter: Meter | None = None) -> dict[str, Any]:
    from transformers import AutoConfig

    from ._observe import kv_shape, load_model

    started = time.perf_counter()
    if not (args.model_dir / "config.json").is_file():
        raise InputError(
            f"{args.model_dir}: no config.json; give the model folder the server loads"
        )
    config = AutoConfig.from_pretrained(str(args.model_dir))
    layers, kv_heads, head_dim = kv_shape(config)
    cap = model_capacity(args.model_dir, config, (layers, kv_heads, head_dim))
    backend = backend_rounding(args.rounding)
    settings, exclude = _settings(args, layers, kv_heads, backend)
    drawn = draw_requests(args, config, exclude)
    if not drawn.items:
        raise InputError("no requests to score: the trace has none that fit the model")
    model = load_model(str(args.model_dir), args.dtype, args.device)
    labels = list(Buckets.parse(args.buckets).labels)
    meter = meter or NoMeter()
    lap = _Laps(started)
    lap("loading")
    ref = _reference(model, drawn.items, args, len(settings) + cap.hybrid, meter, lap)
    scorer = TapedScorer(model, drawn.items, ref, args.chunk_tokens, meter, whole=args.whole_passes)
    base = settings[1] if args.overlay is not None else settings[0]
    rows = {s.name: _row(scorer, s, labels, "base" if s is base else None) for s in settings}
    sliding = None
    if cap.hybrid:  # the one set vLLM names by a word: every sliding-window layer
        row, sliding = sliding_candidate(scorer, base, cap, labels)
        rows[row["setting"]] = row
    lap("settings")
    real, _ = loss_is_real(rows[base.name]["all"], args.min_loss)
    skip = None
    ranking: list[dict[str, Any]] = []
    if real:
        loss = float(_mean(rows[base.name]) or 0.0)
        ranking = rank_layers(scorer, base, loss)
        lap("ranking layers")
        skip = confirm_skip(scorer, base, ranking, loss, args, cap)
        lap("confirming sets")
        sliding = None if sliding is None else _recovery(sliding, loss, args.recover)
    return {
        "emulated": True,
        "caveat": CAVEAT,
        "interval": INTERVAL,
        "model": str(args.model_dir.resolve()),
        "overlay": str(args.overlay.resolve()) if args.overlay else None,
        "backend_rounding": backend,
        "layers": layers,
        "kv_heads": kv_heads,
        "per_head_supported": args.per_head_supported,
        "per_head_why": args.per_head_why,
        "sampling": drawn.info,
        "notes": [*args.notes, *capacity_notes(cap)],
        "capacity": cap.to_json(),
        "settings": list(rows.values()),
        "sensitivity_base": base.name,
        "ranking": ranking,
        "skip": skip,
        "sliding_window": sliding,
        "next_step": next_step(rows, skip, args, sliding, cap.at()),
        "seconds": time.perf_counter() - started,
        "stage_seconds": lap.seconds,
        "passes": "whole"
        if args.whole_passes
        else f"resumed (tape every {scorer.stride} layer(s))",
    }


class _Laps:
    """Seconds each stage of advise took, in order (where the time goes, for the report)."""

    def __init__(self, started: float) -> None:
        self.last = started
        self.seconds: dict[str, float] = {}

    def __call__(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = round(now - self.last, 1)
        self.last = now


def _reference(
    model: Any, items: list[Any], args: AdviseArgs, passes: int, meter: Meter, lap: _Laps
) -> Any:
    """BF16 first: the greedy answers a trace without answers needs (each with its reference
    scores: they share the prompt's prefill), and the reference's scores of answers a run
    gave; the work of those and of ``passes`` whole passes is planned."""
    missing = [it for it in items if not it.answer]
    work = sum(len(it.prompt) for it in items) * (1 + passes)
    meter.plan(work)
    done = iter(missing)
    known = bf16_answers(
        model,
        missing,
        args.chunk_tokens,
        lambda _n: meter.step("BF16 greedy answer", len(next(done).prompt)),
    )
    lap("BF16 greedy answers")
    left = iter([it for it in items if it.id not in known.nll])
    ref = reference_scores(
        model,
        items,
        args.chunk_tokens,
        lambda _n: meter.step("BF16 scores", tokens(next(left))),
        known,
    )
    lap("BF16 reference scores")
    return ref
