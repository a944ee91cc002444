"""What the serving path says before any quality does: a target that does not run the KV
cache it is meant to test (the format its spec names, FP8 when it names none), or not the
engine and model of the reference, or whose requests fail, cannot be judged on its answers
(the stop rule rejects the path instead). A calibrated arm must run a format that reads
checkpoint scales: the per-token-head formats compute theirs when the cache is written."""

from __future__ import annotations

import re
from collections.abc import Sequence

from replay.analysis.schemas import TargetSummary
from replay.analysis.schemas.manifest import Manifest, TargetEntry
from replay.serving import kv_formats
from replay.serving.kv_layout import SLIDING_WINDOW, KvLayout
from replay.serving.kv_served import layout_of, skip_words
from replay.serving.scale_log import SCALE_ONE_WARNING, from_engine_config


def error_problem(target: TargetSummary, max_rate: float) -> str | None:
    """A target whose requests fail is a failed target, not a quality result."""
    total, kinds = 0, dict[str, int]()
    for ph in target.phases.values():
        total += ph.all.requests
        for k, n in ph.all.errors_by_kind.items():
            kinds[k] = kinds.get(k, 0) + n
    failed = sum(kinds.values())
    if total and failed / total > max_rate:
        detail = ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items()))
        return f"{failed} of {total} requests failed ({detail})"
    return None


def serving_problems(
    name: str,
    target: TargetSummary,
    manifest: Manifest,
    calibrated: bool,
    max_error_rate: float = 0.05,
) -> list[str]:
    """What says this target does not run the FP8 path it is meant to test, or not the same
    engine and model as the reference."""
    out = []
    if target.status != "ok":
        out.append(f"target failed: {target.reason}")
        return out
    dtype = target.cache_dtype
    info = manifest.target(name) or TargetEntry.from_json({})
    meant = info.spec.meant_format
    emulated = kv_formats.emulated_format(str(meant)) is not None
    fell_back = _fallback(meant, dtype)
    if fell_back:
        out.append(fell_back)
    fmt = kv_formats.get(meant) if meant else None
    if calibrated and fmt is not None and fmt.quantized and not fmt.reads_checkpoint_scales:
        out.append(
            f"{fmt.name} computes its K/V scales per token and head when the cache is "
            "written and ignores the checkpoint's: a calibrated arm cannot apply to it"
        )
    ref = manifest.target(manifest.reference) or TargetEntry.from_json({})
    for mine, theirs, what in (
        (info.engine_version, ref.engine_version, "engine version"),
        (info.max_model_len, ref.max_model_len, "max_model_len"),
    ):
        if mine is not None and theirs is not None and mine != theirs:
            out.append(f"{what} {mine} differs from the reference's {theirs}")
    if not calibrated and info.model_root and ref.model_root and info.model_root != ref.model_root:
        out.append(f"serves model {info.model_root}, the reference {ref.model_root}")
    skip = _skip_layers_problem(
        list(info.spec.args),
        str(info.cache_config.get("kv_cache_dtype_skip_layers", "")),
        target_layout(info),
    )
    if skip and not emulated:  # an emulated target's plugin does the skipping
        out.append(skip)
    failing = error_problem(target, max_error_rate)
    if failing:
        out.append(failing)
    lines = info.scale_log_lines
    scales = from_engine_config(
        info.engine_config or {}, any(SCALE_ONE_WARNING in ln for ln in lines)
    )
    if calibrated and scales.runs_at_scale_one and (fmt is None or fmt.reads_checkpoint_scales):
        out.append(f"{scales.explain()}: the calibrated scales were not applied")
    if any(
        "per-head" in ln.lower() and ("not supported" in ln.lower() or "reject" in ln.lower())
        for ln in lines
    ):
        out.append("the backend rejected per-head scales")
    return out


def _fallback(meant: str | None, served: str | None) -> str | None:
    """A candidate whose spec says BF16 is a deliberate BF16 comparison (another checkpoint,
    other server flags); one meant to be quantized must serve that format, and one of unknown
    kind must serve FP8. An emulated one stores BF16 by design (the runner checked its plugin
    ran)."""
    if served is None or (meant is not None and kv_formats.emulated_format(meant) is not None):
        return None
    if meant is None:
        if not kv_formats.same_format("auto", served):
            return None
        return (
            f"served cache_dtype is '{served}', not FP8 or another quantized cache (the "
            "backend fell back)"
        )
    fmt = kv_formats.get(meant)
    if fmt is None or not fmt.quantized or kv_formats.same_format(meant, served):
        return None
    what = "FP8" if fmt.name in ("fp8", "fp8_e4m3") else fmt.name
    return f"served cache_dtype is '{served}', not {what} (the backend fell back)"


def target_layout(entry: TargetEntry | None) -> KvLayout | None:
    """A target's model layout: its spec's folder, else the folder its server reports
    (``/v1/models``' root) where that folder is here too."""
    if entry is None:
        return None
    found = layout_of(entry.spec.model, entry.model_root)
    return found[0] if found is not None else None


def _skip_layers_problem(args: Sequence[str], served: str, layout: KvLayout | None) -> str | None:
    """``--kv-cache-dtype-skip-layers 0 3`` against the server's ``['0', '3']`` (vLLM echoes
    the words: ``['sliding_window']``). vLLM 0.32 takes one pattern per word, so ``0,3`` is a
    single pattern that matches no layer. With the model's layout, the words are compared as
    the layers they name, and words that name none are a problem."""
    flag = "--kv-cache-dtype-skip-layers"
    if flag not in args:
        return None
    i = list(args).index(flag) + 1
    words = []
    while i < len(args) and not args[i].startswith("-"):
        words.append(args[i])
        i += 1
    if any("," in w for w in words):
        return (
            f"{flag} {' '.join(words)}: vLLM takes one layer index per word ("
            f"{' '.join(w for word in words for w in word.split(',') if w)}); a "
            "comma-separated value is one pattern that matches no layer"
        )
    missing = _names_no_layer(words, layout)
    if missing:
        return missing
    reported = re.findall(r"\w+", served)
    if set(words) <= set(reported):
        return None
    if layout is not None and layout.skip_indices(words) == layout.skip_indices(reported):
        return None
    return f"skip-layers configured as {' '.join(words)!r} but the server reports {served!r}"


def _names_no_layer(words: Sequence[str], layout: KvLayout | None) -> str | None:
    """Indices past the model's last layer, or ``sliding_window`` on a model with none: vLLM
    matches no layer with them and keeps those layers' cache quantized, silently."""
    if layout is None or skip_words(words) != tuple(words):
        return None  # other patterns are vLLM's to read
    past = [w for w in words if w.isdigit() and int(w) >= layout.layers]
    if past:
        return (
            f"skip-layers {' '.join(past)}: the model has {layout.layers} layers "
            f"(0-{layout.layers - 1}); vLLM keeps no layer in BF16 for them"
        )
    if SLIDING_WINDOW in words and not layout.sliding:
        return (
            f"skip-layers {SLIDING_WINDOW}: the model has no sliding-window layer, so it keeps "
            "nothing in BF16"
        )
    return None
