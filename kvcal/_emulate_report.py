"""``kvcal emulate``: settings in, per-bucket intervals, per-layer sensitivity and advice out.

The settings are every ``--formats`` format at its rounding (``--rounding``: the engine's,
cpu, cuda or both), an overlay's scales and skip-layers variants; what each costs in cache
bytes, which stay within ``--tolerance`` and how much of a loss is the rounding are
:mod:`kvcal._emulate_advice`'s.

ΔNLL per token is the mean over every answer token of (NLL under the setting - NLL under
BF16), as replay reports it; its 95% interval is a percentile bootstrap over requests (2,000
resamples, seeded): requests are resampled with all their tokens, since the tokens of one
answer are not independent, and the per-token mean is recomputed (a cluster bootstrap, so the
interval is that of the reported figure; replay's own interval is over per-request means).
Top-1 agreement is the share of answer positions where the setting's argmax is BF16's argmax,
with the same kind of interval. Greedy agreement (a small
sample per bucket) is the exact-match rate with a Wilson interval and the mean common prefix
in tokens.

Sensitivity, on each format at scale 1.0 (FP8 first): ΔNLL with one layer in the format (the
others BF16), and with one layer kept in BF16 (the others in the format). A layer's
"recovered" loss is the all-layers ΔNLL minus the ΔNLL with it kept in BF16. The smallest set
of the best-ranked layers whose recoveries add up to the target share is scored to confirm it
(and grown a layer at a time until it does).
Emulation is deterministic, so there is no A/A noise floor: the loss counts as real when its
interval lies above 0 and the mean reaches ``min_loss``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from replay.core.buckets import DEFAULT_BOUNDS, Buckets
from replay.core.errors import InputError

from ._emulate import Setting, uniform
from ._emulate_advice import advise, setting_facts
from ._emulate_overlay import carries_scales, overlay_setting, read_overlay
from ._emulate_requests import Drawn, Item, draw_from_run, draw_from_trace
from ._emulate_score import (
    Reference,
    Score,
    bf16_answers,
    greedy_agreement,
    reference_scores,
    score_setting,
)
from ._kv_formats import ENGINE_ROUNDING, SCALED

Track = Callable[[str, int], Callable[[int], None]]  # (description, total) -> advance(n)
INTERVAL = (
    "95% percentile bootstrap over requests (2000 resamples, seed 0), each resampled "
    "with all its answer tokens, of the per-token mean"
)
CAVEAT = (
    "emulated: each format's round trip of K/V at the cache write in transformers; the "
    "capacity is what the format's bytes imply, not measured, it says nothing of kernel "
    "speed, and attention numerics differ from vLLM's kernels by about a bf16 step"
)
# vLLM 0.32 (engine/arg_utils.py, CacheConfig.kv_cache_dtype_skip_layers: list[str]) takes the
# layer indices as separate words, "--kv-cache-dtype-skip-layers 0 3"; "0,3" parses as the one
# pattern '0,3', which matches no layer (attention.py compares str(layer_idx) with each).
FLAG = "--kv-cache-dtype-skip-layers"


def _layers(layers: Sequence[int]) -> str:
    return ",".join(map(str, layers))


def _no_track(_what: str, _total: int) -> Callable[[int], None]:
    return lambda _n: None


@dataclass
class EmulateArgs:
    model_dir: Path
    trace: Path | None = None
    answers: Path | None = None
    trace_format: str = "auto"
    buckets: str = DEFAULT_BOUNDS
    per_bucket: int = 16
    seed: int = 0
    on_bad_line: str = "fail"
    overlay: Path | None = None
    skip_layers: tuple[int, ...] = ()
    rounding: str = "engine"  # engine (each format's), cpu, cuda or both
    formats: tuple[str, ...] = ("fp8",)
    tolerance: float | None = None  # ΔNLL/token a format may lose, in every bucket
    max_prompt_tokens: int | None = None  # leave out longer prompts (a cheaper run)
    max_new_tokens: int = 32
    greedy_sample: int = 4
    sensitivity: bool = False
    recover: float = 0.8
    min_loss: float = 0.01
    chunk_tokens: int = 2048
    dtype: str = "auto"
    device: str = "auto"
    notes: list[str] = field(default_factory=list)


# -- statistics -----------------------------------------------------------------------------


N_BOOT = 2000


def cluster_ci(
    sums: Sequence[float], counts: Sequence[int], seed: int = 0, n_boot: int = N_BOOT
) -> tuple[float, float] | None:
    """95% percentile-bootstrap interval of ``sum(sums) / sum(counts)``, resampling requests
    (each with all its tokens): a per-token mean whose tokens are clustered by request."""
    import numpy as np

    s, c = np.asarray(sums, dtype=float), np.asarray(counts, dtype=float)
    if s.size == 0 or c.sum() <= 0:
        return None
    point = float(s.sum() / c.sum())
    idx = np.random.default_rng(seed).integers(0, s.size, size=(n_boot, s.size))
    est = s[idx].sum(axis=1) / c[idx].sum(axis=1)
    lo, hi = np.percentile(est, [2.5, 97.5])
    return min(float(lo), point), max(float(hi), point)


def tf_summary(
    scores: dict[str, Score], ref: Reference, ids: Sequence[str], seed: int = 0
) -> dict[str, Any]:
    """ΔNLL per token and top-1 agreement over the answer tokens of ``ids``, each with a
    request-level (cluster) bootstrap interval; the keys of replay's teacher-forced summary."""
    sums, agree, counts = [], [], []
    identical = True
    for rid in ids:
        s, base = scores[rid], ref.nll[rid]
        d = [x - y for x, y in zip(s["nll"], base, strict=True)]
        identical = identical and all(x == 0.0 for x in d)
        sums.append(sum(d))
        agree.append(float(sum(s["top1"])))
        counts.append(len(d))
    tokens = sum(counts)
    nll_ci, top1_ci = cluster_ci(sums, counts, seed), cluster_ci(agree, counts, seed)
    return {
        "tokens": tokens,
        "requests": len(counts),
        "nll_delta_mean": sum(sums) / tokens if tokens else None,
        "nll_delta_lo": None if nll_ci is None else nll_ci[0],
        "nll_delta_hi": None if nll_ci is None else nll_ci[1],
        "top1_agreement": sum(agree) / tokens if tokens else None,
        "top1_lo": None if top1_ci is None else top1_ci[0],
        "top1_hi": None if top1_ci is None else top1_ci[1],
        "identical_to_bf16": bool(tokens) and identical,
    }


def greedy_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    from replay.analysis.stats.intervals import wilson

    if not rows:
        return None
    exact = sum(bool(r["exact"]) for r in rows)
    ci = wilson(exact, len(rows))
    return {
        "requests": len(rows),
        "exact": exact,
        "exact_rate": exact / len(rows),
        "exact_lo": ci[0] if ci else None,
        "exact_hi": ci[1] if ci else None,
        "mean_common_prefix": sum(r["common_prefix"] for r in rows) / len(rows),
        "mean_tokens": sum(r["tokens"] for r in rows) / len(rows),
    }


def by_bucket(items: Sequence[Item], labels: Sequence[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {label: [] for label in labels}
    for it in items:
        out[it.bucket].append(it.id)
    return {label: ids for label, ids in out.items() if ids}


def _mean(summary: dict[str, Any]) -> float:
    m = summary.get("nll_delta_mean")
    return 0.0 if m is None else float(m)


# -- sensitivity ----------------------------------------------------------------------------


@dataclass
class Scorer:
    """Scores settings over every item against the BF16 reference."""

    model: Any
    items: Sequence[Item]
    ref: Reference
    chunk: int
    track: Track

    def overall(
        self, setting: Setting, what: str | None = None
    ) -> tuple[dict[str, Score], dict[str, Any]]:
        advance = self.track(what or f"scoring {setting.name}", len(self.items))
        scores = score_setting(self.model, self.items, setting, self.ref, self.chunk, advance)
        return scores, tf_summary(scores, self.ref, [it.id for it in self.items])


def _nll(x: float) -> str:
    return f"{x:+.1e}" if x and abs(x) < 5e-4 else f"{x:+.4f}"


def loss_is_real(summary: dict[str, Any], min_loss: float) -> tuple[bool, str]:
    mean, lo, hi = (summary.get(k) for k in ("nll_delta_mean", "nll_delta_lo", "nll_delta_hi"))
    if mean is None or lo is None or hi is None:
        return False, "no scored tokens"
    figure = f"ΔNLL {_nll(mean)}/token [{_nll(lo)}, {_nll(hi)}]"
    if mean <= 0:
        return False, f"{figure}: no loss"
    if lo <= 0:
        return False, f"{figure}: within noise (the interval reaches 0)"
    if mean < min_loss:
        return False, f"{figure} is below --min-loss {min_loss:g}"
    return True, figure


def layer_rows(scorer: Scorer, base: Setting, loss: float) -> list[dict[str, Any]]:
    rows = []
    layers = len(base.k)
    for layer in range(layers):
        _, only = scorer.overall(base.only(layer), f"sensitivity: layer {layer} alone {base.fmt}")
        _, kept = scorer.overall(base.skipping([layer]), f"sensitivity: layer {layer} kept BF16")
        recovered = loss - _mean(kept)
        rows.append(
            {
                "layer": layer,
                "only_fp8": only,
                "kept_bf16": kept,
                "recovered": recovered,
                "recovered_share": recovered / loss if loss else None,
            }
        )
    return rows


def choose_skip(
    scorer: Scorer, base: Setting, rows: Sequence[dict[str, Any]], loss: float, target: float
) -> dict[str, Any]:
    """The smallest prefix of the ranking whose estimated recovery reaches ``target`` of the
    loss, scored to confirm; grown one layer at a time until the confirmation reaches it."""
    ranked = [r["layer"] for r in sorted(rows, key=lambda r: -r["recovered"])]
    k, total = 0, 0.0
    while k < len(ranked) and (k == 0 or total < target * loss):
        total += rows[ranked[k]]["recovered"]
        k += 1
    tries: list[dict[str, Any]] = []
    while True:
        chosen = sorted(ranked[:k])
        _, summary = scorer.overall(
            base.skipping(chosen, f"{base.name} skip {_layers(chosen)}"),
            f"confirming skip layers {_layers(chosen)}",
        )
        recovered = loss - _mean(summary)
        tries.append(
            {
                "skip_layers": chosen,
                "summary": summary,
                "recovered": recovered,
                "recovered_share": recovered / loss,
            }
        )
        if recovered >= target * loss or k >= len(ranked):
            break
        k += 1
    last = tries[-1]
    return {
        "ranking": ranked,
        "estimated_share": total / loss,
        "confirmations": tries,
        "skip_layers": last["skip_layers"],
        "confirmed_share": last["recovered_share"],
        "reached": bool(last["recovered"] >= target * loss),
    }


def sensitivity(
    scorer: Scorer, base: Setting, base_summary: dict[str, Any], target: float, min_loss: float
) -> dict[str, Any]:
    real, why = loss_is_real(base_summary, min_loss)
    loss = _mean(base_summary)
    out: dict[str, Any] = {
        "base": base.name,
        "loss": loss,
        "loss_summary": base_summary,
        "target_share": target,
        "loss_is_real": real,
        "why": why,
    }
    out["layers"] = layer_rows(scorer, base, loss)
    if not real:
        for row in out["layers"]:
            row["recovered_share"] = None  # a share of no loss means nothing
        out.update(skip_layers=[], flag=None, advice=f"no layer needs to stay BF16: {why}")
        return out
    choice = choose_skip(scorer, base, out["layers"], loss, target)
    out.update(choice)
    chosen = choice["skip_layers"]
    flag = f"{FLAG} {' '.join(map(str, chosen))}"
    out["flag"] = flag
    layers = len(base.k)
    if len(chosen) == layers:
        # kvcal calibrates E4M3 scales; the other formats have no scale it could fix
        instead = "; calibrate (kvcal calibrate) instead" if base.fmt in ("fp8", "fp8_e4m3") else ""
        out["advice"] = (
            f"only every layer in BF16 recovers {target:.0%} of the loss: {base.name} "
            f"is not worth keeping here{instead}"
        )
    else:
        share = choice["confirmed_share"]
        out["advice"] = (
            f"keep layer(s) {', '.join(map(str, chosen))} in BF16: {flag} "
            f"(confirmed: recovers {share:.0%} of the {base.name} loss; {why} before)"
        )
    return out


# -- the run --------------------------------------------------------------------------------


def _draw(args: EmulateArgs, config: Any, exclude: frozenset[str]) -> Drawn:
    from transformers import AutoTokenizer

    buckets = Buckets.parse(args.buckets)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    max_len = int(getattr(text, "max_position_embeddings", None) or 1 << 30)
    if args.answers is not None:
        return draw_from_run(
            args.answers,
            buckets,
            args.per_bucket,
            args.seed,
            exclude,
            max_len,
            args.max_prompt_tokens,
        )
    assert args.trace is not None
    tok = AutoTokenizer.from_pretrained(str(args.model_dir))
    drawn = draw_from_trace(
        tok,
        args.trace,
        args.trace_format,
        buckets,
        args.per_bucket,
        args.seed,
        args.on_bad_line,
        args.max_new_tokens,
        exclude,
        max_len,
        args.max_prompt_tokens,
    )
    if drawn.info.get("over_max_prompt"):
        args.notes.append(
            f"{drawn.info['over_max_prompt']} request(s) with a prompt over "
            f"--max-prompt-tokens {args.max_prompt_tokens} left out"
        )
    if drawn.info["bad_lines"]:
        args.notes.append(
            f"skipped {drawn.info['bad_lines']} bad line(s) (first: "
            f"{drawn.info['first_bad_line']}); `replay trace validate` lists them"
        )
    return drawn


def roundings(args: EmulateArgs, fmt: str) -> list[str]:
    """The roundings ``fmt`` is emulated at: the engine's (vLLM CPU's truncation for the FP8
    formats it serves, CUDA's for the rest), one of them, or both."""
    if args.rounding == "both":
        return ["cpu", "cuda"]
    return [ENGINE_ROUNDING[fmt] if args.rounding == "engine" else args.rounding]


def _name(fmt: str, rounding: str, args: EmulateArgs, scales: str = "1.0") -> str:
    name = f"{fmt}@{scales}" if fmt in SCALED else fmt
    return f"{name} {rounding}" if args.rounding == "both" else name


def settings_for(
    args: EmulateArgs, layers: int, kv_heads: int
) -> tuple[list[Setting], list[Setting], list[str], frozenset[str]]:
    """The settings to score (each format at scale 1.0 first), the sensitivity bases (each
    format at its first rounding), notes, and the calibration ids to leave out."""
    out = [
        uniform(_name(fmt, r, args), layers, 1.0, r, fmt)
        for fmt in args.formats
        for r in roundings(args, fmt)
    ]
    bases = [next(s for s in out if s.fmt == fmt) for fmt in args.formats]
    notes: list[str] = []
    exclude = frozenset[str]()
    bad = [i for i in args.skip_layers if not 0 <= i < layers]
    if bad:
        raise InputError(
            f"--skip-layers: layer(s) {bad} out of range; the model has {layers} "
            f"layers (0-{layers - 1})"
        )
    if args.overlay is not None:
        scales = read_overlay(args.overlay, layers, kv_heads)
        notes += list(scales.notes)
        exclude = scales.calibration_ids
        if exclude:
            notes.append(f"{len(exclude)} calibration request(s) of the overlay left out")
        if scales.per_head:
            notes.append(
                "per-head scales: vLLM serves them only with FlashAttention 3 (not on "
                "CPU); emulated as written"
            )
        if (
            scales.model
            and args.overlay.resolve() != args.model_dir.resolve()
            and Path(scales.model).resolve() != args.model_dir.resolve()
        ):
            notes.append(f"the overlay was calibrated on {scales.model}, not {args.model_dir}")
        # kvcal calibrates E4M3 scales (amax / 448): they are FP8 E4M3's
        out += [
            replace(
                overlay_setting(_name("fp8", r, args, "cal"), scales, args.overlay, r), fmt="fp8"
            )
            for r in roundings(args, "fp8")
        ]
    if args.skip_layers:
        out += [
            s.skipping(args.skip_layers, f"{s.name} skip {_layers(args.skip_layers)}")
            for s in list(out)
        ]
    return out, bases, notes, exclude


def _greedy_sample(items: Sequence[Item], labels: Sequence[str], n: int) -> list[Item]:
    picked = {i for ids in by_bucket(items, labels).values() for i in ids[:n]}
    return [it for it in items if it.id in picked]


def _score_all(
    scorer: Scorer, settings: Sequence[Setting], labels: Sequence[str], sample: Sequence[Item]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per setting and bucket: teacher-forced summary and greedy agreement; per request."""
    rows, per_request = [], []
    buckets = by_bucket(scorer.items, labels)
    for s in settings:
        scores, overall = scorer.overall(s)
        advance = scorer.track(f"greedy under {s.name}", len(sample))
        greedy = greedy_agreement(scorer.model, sample, s, scorer.chunk, advance)
        for label, ids in [*buckets.items(), ("all", [it.id for it in scorer.items])]:
            tf = overall if label == "all" else tf_summary(scores, scorer.ref, ids)
            g = [r for r in greedy.values() if label in ("all", r["bucket"])]
            rows.append(
                {
                    "setting": s.name,
                    "format": s.fmt,
                    "rounding": s.rounding,
                    "bucket": label,
                    **tf,
                    "greedy": greedy_summary(g),
                }
            )
        for it in scorer.items:
            sc, base = scores[it.id], scorer.ref.nll[it.id]
            per_request.append(
                {
                    "setting": s.name,
                    "id": it.id,
                    "bucket": it.bucket,
                    "tokens": sc["n"],
                    "nll_delta": sum(a - b for a, b in zip(sc["nll"], base, strict=True)) / sc["n"],
                    "top1_agreement": sum(sc["top1"]) / sc["n"],
                    "greedy": greedy.get(it.id),
                }
            )
    return rows, per_request


def emulate(args: EmulateArgs, track: Track = _no_track) -> dict[str, Any]:
    from transformers import AutoConfig

    from ._observe import kv_shape, load_model

    started = time.perf_counter()
    if not (args.model_dir / "config.json").is_file():
        raise InputError(
            f"{args.model_dir}: no config.json; give the model folder the server loads"
        )
    if args.overlay is None and carries_scales(args.model_dir):
        args.overlay = args.model_dir
        args.notes.append(f"{args.model_dir} carries k/v scales: emulated as fp8@cal")
    # everything that can be refused is checked before the weights load
    config = AutoConfig.from_pretrained(str(args.model_dir))
    layers, kv_heads, head_dim = kv_shape(config)
    if head_dim % 16 and any(f.startswith("nvfp4") for f in args.formats):
        raise InputError(f"--formats nvfp4: head_dim {head_dim} is not a multiple of 16")
    settings, bases, notes, exclude = settings_for(args, layers, kv_heads)
    drawn = _draw(args, config, exclude)
    items = drawn.items
    if not items:
        raise InputError(
            "no requests to score: the trace has none that fit the model "
            f"({drawn.info.get('too_long', 0)} too long)"
        )
    model = load_model(str(args.model_dir), args.dtype, args.device)
    labels = Buckets.parse(args.buckets).labels
    sample = _greedy_sample(items, labels, args.greedy_sample)
    missing = [it for it in items if not it.answer] + [it for it in sample if it.answer]
    bf16_answers(model, missing, args.chunk_tokens, track("BF16 greedy answers", len(missing)))
    ref = reference_scores(model, items, args.chunk_tokens, track("BF16 scores", len(items)))
    scorer = Scorer(model, items, ref, args.chunk_tokens, track)
    rows, per_request = _score_all(scorer, settings, labels, sample)
    by_format: dict[str, Any] = {}
    for base in bases if args.sensitivity else ():
        base_all = next(r for r in rows if r["setting"] == base.name and r["bucket"] == "all")
        by_format[base.fmt] = sensitivity(scorer, base, base_all, args.recover, args.min_loss)
    device = next(model.parameters()).device
    report = {
        "emulated": True,
        "caveat": CAVEAT,
        "interval": INTERVAL,
        "model": str(args.model_dir.resolve()),
        "device": str(device),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "rounding": args.rounding,
        "formats": list(args.formats),
        "tolerance": args.tolerance,
        "min_loss": args.min_loss,
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "sampling": drawn.info,
        "notes": [*args.notes, *notes],
        "reference": {
            "answers": "replay run" if args.answers else "BF16 greedy, transformers",
            "max_new_tokens": args.max_new_tokens,
            "requests": len(items),
            "tokens": sum(len(it.answer) for it in items),
            "greedy_sample_per_bucket": args.greedy_sample,
        },
        "settings": [
            {**s.to_json(), **setting_facts(s, layers, kv_heads, head_dim)} for s in settings
        ],
        "results": rows,
        "per_request": per_request,
        # the first format's (the one the rest of kvcanary calibrates), and every format's
        "sensitivity": by_format.get(args.formats[0]),
        "sensitivity_by_format": by_format or None,
        "seconds": time.perf_counter() - started,
    }
    report["advice"] = advise(report)
    return report
