"""FP8 K/V emulated in transformers: the E4M3 round trip at the cache write, and what it costs.

``EmulatingCache`` is a ``DynamicCache`` whose ``update()`` passes each layer's new keys and
values through :func:`kvcal._fp8.e4m3_roundtrip` before storing them, at the layer's scale,
so attention (over the prompt's own chunk as well as the past) reads K/V as an FP8 cache
returns them. That is the point kvcal observes (after RoPE) and where vLLM quantizes: its
cache-write op runs before attention, and attention reads the cache. A layer without a scale
(``--skip-layers``) stays BF16, as vLLM's ``--kv-cache-dtype-skip-layers`` keeps it.

The requests are drawn from the same traces the replay sends, per context-length bucket, by
a hash of id and seed (a calibration overlay's own samples are left out); the reference
answers are BF16 greedy answers generated here, or a replay run's reference answers. Each
setting then scores the answer tokens teacher-forced (:func:`teacher_forced`), and on a small
sample generates greedily (:func:`greedy`). :mod:`kvcal._emulate_report` turns the scores
into per-bucket intervals, per-layer sensitivity and the report.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from replay.core.buckets import Buckets
from replay.core.errors import InputError

from ._fp8 import e4m3_roundtrip, hf_head_scale

Scale = torch.Tensor  # 0-d, or [1, kv_heads, 1, 1] over transformers' cache layout
_SCALE_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\..*\b([kv])_scale$")


@dataclass(frozen=True)
class Setting:
    """One emulated FP8 cache: a scale per layer for K and V (None: the layer stays BF16)."""

    name: str
    k: tuple[Scale | None, ...]
    v: tuple[Scale | None, ...]
    scales: str = "1.0"  # "1.0" or the overlay's folder
    rounding: str = "cpu"

    @property
    def skip(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.k) if s is None)

    def skipping(self, layers: Iterable[int], name: str | None = None) -> Setting:
        drop = set(layers)
        return replace(
            self,
            name=name or self.name,
            k=tuple(None if i in drop else s for i, s in enumerate(self.k)),
            v=tuple(None if i in drop else s for i, s in enumerate(self.v)),
        )

    def only(self, layer: int, name: str | None = None) -> Setting:
        return self.skipping((i for i in range(len(self.k)) if i != layer), name)

    def to_json(self) -> dict[str, Any]:
        def show(s: Scale | None) -> float | list[float] | None:
            return None if s is None else (float(s) if s.dim() == 0 else s.flatten().tolist())

        return {
            "name": self.name,
            "scales": self.scales,
            "rounding": self.rounding,
            "skip_layers": list(self.skip),
            "k_scale": [show(s) for s in self.k],
            "v_scale": [show(s) for s in self.v],
        }


def uniform(name: str, layers: int, scale: float = 1.0, rounding: str = "cpu") -> Setting:
    s = hf_head_scale(scale)
    return Setting(name, (s,) * layers, (s,) * layers, f"{scale:g}", rounding)


class EmulatingCache(DynamicCache):
    """A DynamicCache that stores K and V as an FP8 E4M3 cache would return them."""

    def __init__(self, setting: Setting, config: Any = None) -> None:
        super().__init__(config=config)
        self.setting = setting

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.setting.k[layer_idx], self.setting.v[layer_idx]
        if k is not None:
            key_states = e4m3_roundtrip(key_states, k, rounding=self.setting.rounding)
        if v is not None:
            value_states = e4m3_roundtrip(value_states, v, rounding=self.setting.rounding)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def new_cache(model: Any, setting: Setting | None) -> DynamicCache:
    if setting is None:
        return DynamicCache(config=model.config)
    return EmulatingCache(setting, model.config)


# -- model passes ---------------------------------------------------------------------------


def _ids(model: Any, tokens: Sequence[int]) -> torch.Tensor:
    return torch.tensor([list(tokens)], dtype=torch.long, device=next(model.parameters()).device)


@torch.inference_mode()
def _prefill(
    model: Any, ids: torch.Tensor, cache: DynamicCache, chunk: int, keep_last: bool
) -> torch.Tensor | None:
    """Run ``ids`` [1, n] through the model in chunks sharing ``cache``; the last position's
    logits when ``keep_last``."""
    logits = None
    for start in range(0, ids.shape[1], chunk):
        out = model(
            input_ids=ids[:, start : start + chunk],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[0, -1]
    return logits if keep_last else None


@torch.inference_mode()
def teacher_forced(
    model: Any, prompt: Sequence[int], answer: Sequence[int], cache: DynamicCache, chunk: int
) -> tuple[list[float], list[int]]:
    """NLL of each answer token after the prompt and the answer before it, and the argmax
    there. The prompt but its last token is prefilled in chunks (only the cache kept)."""
    if not prompt or not answer:
        raise ValueError("teacher_forced needs a prompt and an answer")
    ids = _ids(model, [*prompt, *answer])
    head = len(prompt) - 1
    _prefill(model, ids[:, :head], cache, chunk, keep_last=False)
    nll: list[float] = []
    top: list[int] = []
    tail = ids[:, head : head + len(answer)]  # positions whose next token is an answer token
    for start in range(0, tail.shape[1], chunk):
        part = tail[:, start : start + chunk]
        logits = model(input_ids=part, past_key_values=cache, use_cache=True).logits[0].float()
        target = ids[0, head + start + 1 : head + start + 1 + part.shape[1]]
        logp = torch.log_softmax(logits, dim=-1)
        nll.extend((-logp.gather(1, target[:, None])[:, 0]).tolist())
        top.extend(logits.argmax(dim=-1).tolist())
    return nll, top


@torch.inference_mode()
def greedy(
    model: Any,
    prompt: Sequence[int],
    max_new: int,
    eos: frozenset[int],
    cache: DynamicCache,
    chunk: int,
) -> list[int]:
    """Greedy decoding, token by token after a chunked prefill; stops after an EOS token
    (kept, as vLLM keeps it in its output ids) or ``max_new`` tokens."""
    logits = _prefill(model, _ids(model, prompt), cache, chunk, keep_last=True)
    out: list[int] = []
    while logits is not None and len(out) < max_new:
        token = int(logits.argmax())
        out.append(token)
        if token in eos or len(out) == max_new:
            break
        logits = model(
            input_ids=_ids(model, [token]), past_key_values=cache, use_cache=True
        ).logits[0, -1]
    return out


def eos_ids(model: Any) -> frozenset[int]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = getattr(model.config, "eos_token_id", None)
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)


# -- requests -------------------------------------------------------------------------------


@dataclass
class Item:
    """One evaluation request: the prompt's token ids and the reference answer's."""

    id: str
    bucket: str
    prompt: tuple[int, ...]
    max_new: int
    answer: tuple[int, ...] = ()
    bf16_greedy: tuple[int, ...] | None = None  # the BF16 greedy answer generated here


@dataclass
class Drawn:
    items: list[Item] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


Row = tuple[str, tuple[int, ...], int, tuple[int, ...]]  # id, prompt, max new tokens, answer


def _pick(
    rows: Iterable[Row],
    buckets: Buckets,
    per_bucket: int,
    seed: int,
    exclude: frozenset[str],
    max_len: int,
) -> Drawn:
    """Up to ``per_bucket`` rows per bucket, the smallest hash keys of id and seed."""
    from ._sample import split_key

    heaps: dict[str, list[tuple[int, str, Item]]] = {b: [] for b in buckets.labels}
    seen = dict.fromkeys(buckets.labels, 0)
    skipped = {"excluded": 0, "too_long": 0}
    for rid, prompt, max_new, answer in rows:
        if rid in exclude:
            skipped["excluded"] += 1
            continue
        if len(prompt) + max_new > max_len:
            skipped["too_long"] += 1
            continue
        label = buckets.label(len(prompt))
        seen[label] += 1
        item = (-split_key("emulate\0" + rid, seed), rid, Item(rid, label, prompt, max_new, answer))
        if len(heaps[label]) < per_bucket:
            heapq.heappush(heaps[label], item)
        elif item[0] > heaps[label][0][0]:
            heapq.heapreplace(heaps[label], item)
    out = Drawn(
        info={
            "per_bucket": per_bucket,
            "seed": seed,
            "bucket_bounds": buckets.spec(),
            **skipped,
            "buckets": {},
        }
    )
    for label in buckets.labels:
        chosen = [it for _, _, it in sorted(heaps[label], key=lambda t: -t[0])]
        out.items.extend(chosen)
        out.info["buckets"][label] = {"available": seen[label], "drawn": len(chosen)}
    return out


def draw_from_trace(
    tokenizer: Any,
    trace: Path,
    trace_format: str,
    buckets: Buckets,
    per_bucket: int,
    seed: int,
    on_bad_line: str,
    max_new: int,
    exclude: frozenset[str],
    max_len: int,
) -> Drawn:
    """Requests of a trace (any format replay reads), rendered as vLLM renders them."""
    from replay.core.errors import TraceError
    from replay.core.importers import stream

    from ._sample import PromptRenderer

    if not trace.is_file():
        raise InputError(f"--trace {trace}: no such file")
    bad: list[TraceError] = []

    def on_bad(_k: int, err: TraceError) -> None:
        bad.append(err)

    renderer = PromptRenderer(tokenizer)

    def rows() -> Iterable[Row]:
        for req in stream(
            trace,
            trace_format,
            on_bad_line=on_bad_line,  # type: ignore[arg-type]
            bad=on_bad,
        ):
            ids, _ = renderer.render(req)
            yield req.id, tuple(ids), min(max_new, req.max_tokens), ()

    drawn = _pick(rows(), buckets, per_bucket, seed, exclude, max_len)
    drawn.info.update(
        {
            "source": "trace",
            "trace": str(trace),
            "bad_lines": len(bad),
            "first_bad_line": str(bad[0]) if bad else None,
        }
    )
    return drawn


def draw_from_run(
    run_dir: Path,
    buckets: Buckets,
    per_bucket: int,
    seed: int,
    exclude: frozenset[str],
    max_len: int,
) -> Drawn:
    """The reference target's answers of a replay run (first phase, as the replay scores
    them): its prompt and output token ids, as the server reported them."""
    import json

    from replay.run.rundir import MANIFEST, RESULTS, read_jsonl

    try:
        manifest = json.loads((run_dir / MANIFEST).read_text(encoding="utf-8"))
        reference, first = manifest["reference"], manifest["schedules"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        raise InputError(
            f"--answers {run_dir}: no readable {MANIFEST} naming the reference "
            "target; give a run directory replay wrote"
        ) from None

    def rows() -> Iterable[Row]:
        for row in read_jsonl(run_dir / RESULTS):
            if (
                isinstance(row, dict)
                and row.get("target") == reference
                and row.get("phase") == first
                and row.get("status") == "ok"
                and row.get("prompt_ids")
                and row.get("output_ids")
            ):
                answer = tuple(int(t) for t in row["output_ids"])
                yield (
                    str(row["request_id"]),
                    tuple(int(t) for t in row["prompt_ids"]),
                    len(answer),
                    answer,
                )

    drawn = _pick(rows(), buckets, per_bucket, seed, exclude, max_len)
    if not drawn.items:
        raise InputError(
            f"--answers {run_dir}: no answers of the reference target "
            f"'{reference}' with token ids in {RESULTS}"
        )
    drawn.info.update(
        {"source": "run", "run_dir": str(run_dir), "reference": reference, "phase": first}
    )
    return drawn


# -- overlay scales -------------------------------------------------------------------------


@dataclass(frozen=True)
class OverlayScales:
    k: tuple[Scale, ...]
    v: tuple[Scale, ...]
    per_head: bool
    notes: tuple[str, ...] = ()
    calibration_ids: frozenset[str] = frozenset()
    model: str | None = None  # what its manifest says it was calibrated on


def _read_scale_tensors(overlay: Path) -> dict[tuple[int, str], torch.Tensor]:
    from safetensors import safe_open

    found: dict[tuple[int, str], torch.Tensor] = {}
    for shard in sorted(overlay.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                m = _SCALE_KEY.search(key)
                if m:
                    found[(int(m.group(1)), m.group(2))] = f.get_tensor(key).float()
    return found


def carries_scales(model_dir: Path) -> bool:
    """Whether a checkpoint folder has k/v scale tensors (a calibrated overlay)."""
    return bool(_read_scale_tensors(model_dir))


def read_overlay(overlay: Path, layers: int, kv_heads: int) -> OverlayScales:
    """The k/v scales an overlay checkpoint carries, as ``kvcal calibrate`` (or LLM
    Compressor) writes them: ``[]``/``[1]`` per tensor, ``[kv_heads, 1, 1]`` per head. A layer
    without scales runs at 1.0, as vLLM runs it."""
    import json

    if not overlay.is_dir():
        raise InputError(f"--overlay {overlay}: no such folder")
    found = _read_scale_tensors(overlay)
    if not found:
        raise InputError(
            f"--overlay {overlay}: no *.k_scale / *.v_scale tensors in its "
            "*.safetensors; write one with `kvcal calibrate`"
        )
    scales: dict[str, list[Scale]] = {"k": [], "v": []}
    notes: list[str] = []
    per_head = False
    for layer in range(layers):
        for which in ("k", "v"):
            t = found.get((layer, which))
            if t is None:
                notes.append(f"layer {layer} has no {which}_scale: emulated at 1.0, as vLLM")
                t = torch.tensor(1.0)
            if (
                t.numel() not in (1, kv_heads)
                or not bool((t > 0).all())
                or not bool(torch.isfinite(t).all())
            ):
                raise InputError(
                    f"--overlay {overlay}: layer {layer} {which}_scale has shape "
                    f"{tuple(t.shape)} / values {t.flatten().tolist()[:4]}; expected "
                    f"one positive scale or one per KV head ({kv_heads})"
                )
            per_head = per_head or t.numel() > 1
            scales[which].append(hf_head_scale(t, kv_heads))
    extra = sorted({la for la, _ in found if la >= layers})
    if extra:
        raise InputError(
            f"--overlay {overlay}: scales for layer(s) {extra}, but the model has "
            f"{layers} layers; is it the overlay of this model?"
        )
    ids: frozenset[str] = frozenset()
    model = None
    manifest = overlay / "kvcal_manifest.json"
    if manifest.is_file():
        try:
            data = json.loads(manifest.read_text("utf-8"))
            model = str(data["model"]) if data.get("model") else None
            ids = frozenset(map(str, data["sample_ids"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            notes.append(f"{manifest}: no readable sample_ids; calibration requests not excluded")
    return OverlayScales(tuple(scales["k"]), tuple(scales["v"]), per_head, tuple(notes), ids, model)


def overlay_setting(name: str, scales: OverlayScales, source: Path, rounding: str) -> Setting:
    return Setting(name, scales.k, scales.v, str(source), rounding)


# -- scoring --------------------------------------------------------------------------------


Score = dict[str, Any]  # replay's teacher-forced row: {"n", "nll", "top1", "error"}


@dataclass
class Reference:
    """BF16 teacher-forced scores of every item's answer: NLL and argmax per token."""

    nll: dict[str, list[float]] = field(default_factory=dict)
    argmax: dict[str, list[int]] = field(default_factory=dict)


def reference_scores(
    model: Any, items: Sequence[Item], chunk: int, advance: Callable[[int], None]
) -> Reference:
    ref = Reference()
    for it in items:
        ref.nll[it.id], ref.argmax[it.id] = teacher_forced(
            model, it.prompt, it.answer, new_cache(model, None), chunk
        )
        advance(1)
    return ref


def score_setting(
    model: Any,
    items: Sequence[Item],
    setting: Setting,
    ref: Reference,
    chunk: int,
    advance: Callable[[int], None],
) -> dict[str, Score]:
    """Teacher-forced scores under ``setting``; top-1 = the argmax agrees with BF16's."""
    out: dict[str, Score] = {}
    for it in items:
        nll, top = teacher_forced(model, it.prompt, it.answer, new_cache(model, setting), chunk)
        agree = [a == b for a, b in zip(top, ref.argmax[it.id], strict=True)]
        out[it.id] = {"n": len(nll), "nll": nll, "top1": agree, "error": None}
        advance(1)
    return out


def bf16_answers(
    model: Any, items: Sequence[Item], chunk: int, advance: Callable[[int], None]
) -> None:
    """Each item's BF16 greedy answer (its reference answer unless a run gave one)."""
    eos = eos_ids(model)
    for it in items:
        it.bf16_greedy = tuple(
            greedy(model, it.prompt, it.max_new, eos, new_cache(model, None), chunk)
        )
        if not it.answer:
            it.answer = it.bf16_greedy
        advance(1)


def greedy_agreement(
    model: Any, items: Sequence[Item], setting: Setting, chunk: int, advance: Callable[[int], None]
) -> dict[str, dict[str, Any]]:
    """Greedy answers under ``setting`` against the BF16 greedy answers: exact match and the
    common prefix, in tokens."""
    eos = eos_ids(model)
    out: dict[str, dict[str, Any]] = {}
    for it in items:
        assert it.bf16_greedy is not None
        got = greedy(
            model,
            it.prompt,
            len(it.bf16_greedy) or it.max_new,
            eos,
            new_cache(model, setting),
            chunk,
        )
        prefix = next(
            (i for i, (a, b) in enumerate(zip(got, it.bf16_greedy, strict=False)) if a != b),
            min(len(got), len(it.bf16_greedy)),
        )
        out[it.id] = {
            "bucket": it.bucket,
            "exact": tuple(got) == it.bf16_greedy,
            "common_prefix": prefix,
            "tokens": len(it.bf16_greedy),
        }
        advance(1)
    return out
