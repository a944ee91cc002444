"""``kvcal emulate``: settings in, per-bucket intervals, per-layer sensitivity and advice out.

The settings are every ``--formats`` format at its rounding (``--rounding``: the engine's,
cpu, cuda or both), an overlay's scales and skip-layers variants; what each costs in cache
bytes, which stay within ``--max-dnll`` and how much of a loss is the rounding are
:mod:`kvcal.emulate.advice`'s.

Scores and their intervals are :mod:`kvcal.emulate.score`'s, per-layer sensitivity
:mod:`kvcal.emulate.sensitivity`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from replay.core.buckets import DEFAULT_BOUNDS, Buckets
from replay.core.errors import InputError

from .._capacity import Capacity, model_capacity
from .._kv_formats import ENGINE_ROUNDING, SCALED
from .advice import advise, setting_facts
from .cache import Setting, uniform
from .overlay import carries_scales, overlay_setting, read_overlay
from .requests import Drawn, Item, draw_from_run, draw_from_trace
from .score import (
    bf16_answers,
    by_bucket,
    greedy_agreement,
    greedy_summary,
    reference_scores,
    tf_summary,
)
from .sensitivity import Scorer, Track, layer_list, sensitivity

INTERVAL = (
    "95% percentile bootstrap over requests (2000 resamples, seed 0), each resampled "
    "with all its answer tokens, of the per-token mean"
)
CAVEAT = (
    "emulated: each format's round trip of K/V at the cache write in transformers; the "
    "capacity is what the format's bytes imply, not measured, it says nothing of kernel "
    "speed, and attention numerics differ from vLLM's kernels by about a bf16 step"
)


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
    max_dnll: float | None = None  # ΔNLL per token a format may lose, in every bucket
    max_prompt_tokens: int | None = None  # leave out longer prompts (a cheaper run)
    max_new_tokens: int = 32
    greedy_sample: int = 4
    sensitivity: bool = False
    recover: float = 0.8
    min_loss: float = 0.01
    chunk_tokens: int = 8192  # the CLI's --chunk-tokens default: see kvcal/cli/emulate.py
    dtype: str = "auto"
    device: str = "auto"
    notes: list[str] = field(default_factory=list)


# -- the run --------------------------------------------------------------------------------


def draw_requests(args: EmulateArgs, config: Any, exclude: frozenset[str]) -> Drawn:
    """The requests to score, drawn from ``args.answers``' run or from ``args.trace`` (see
    :mod:`kvcal.emulate.requests`) with ``exclude`` left out; what a trace's draw skipped is
    noted in ``args.notes``."""
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
            s.skipping(args.skip_layers, f"{s.name} skip {layer_list(args.skip_layers)}")
            for s in list(out)
        ]
    return out, bases, notes, exclude


def capacity_notes(cap: Capacity) -> list[str]:
    """What a hybrid model's capacity figures mean: a request's at one length."""
    if not cap.hybrid:
        return []
    sliding = cap.layout.sliding
    window = cap.layout.windows[sliding[0]]
    return [
        f"capacity per request of {cap.context:,} tokens (the model's max length): "
        f"{len(sliding)} of {cap.layout.layers} layers slide over {window} tokens and cache "
        "only their window (and one step's tokens); a shorter request gains less"
    ]


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

    from .._observe import kv_shape, load_model

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
    cap = model_capacity(args.model_dir, config, (layers, kv_heads, head_dim))
    if head_dim % 16 and any(f.startswith("nvfp4") for f in args.formats):
        raise InputError(f"--formats nvfp4: head_dim {head_dim} is not a multiple of 16")
    settings, bases, notes, exclude = settings_for(args, layers, kv_heads)
    drawn = draw_requests(args, config, exclude)
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
    known = bf16_answers(
        model, missing, args.chunk_tokens, track("BF16 greedy answers", len(missing))
    )
    left = sum(it.id not in known.nll for it in items)
    ref = reference_scores(model, items, args.chunk_tokens, track("BF16 scores", left), known)
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
        "tolerance": args.max_dnll,  # the key reports and bench/ read
        "min_loss": args.min_loss,
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "sampling": drawn.info,
        "notes": [*args.notes, *notes, *capacity_notes(cap)],
        "capacity": cap.to_json(),
        "reference": {
            "answers": "replay run" if args.answers else "BF16 greedy, transformers",
            "max_new_tokens": args.max_new_tokens,
            "requests": len(items),
            "tokens": sum(len(it.answer) for it in items),
            "greedy_sample_per_bucket": args.greedy_sample,
        },
        "settings": [{**s.to_json(), **setting_facts(s, cap)} for s in settings],
        "results": rows,
        "per_request": per_request,
        # the first format's (the one the rest of kvcanary calibrates), and every format's
        "sensitivity": by_format.get(args.formats[0]),
        "sensitivity_by_format": by_format or None,
        "seconds": time.perf_counter() - started,
    }
    report["advice"] = advise(report)
    return report
