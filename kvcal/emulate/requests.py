"""The requests ``kvcal emulate`` scores: drawn per context-length bucket from a trace, or
from a replay run's reference answers.

Up to ``per_bucket`` per bucket, by a hash of id and seed (as ``kvcal sample`` draws, with its
own salt); a calibration overlay's own samples are left out, and so are requests whose prompt
and answer would not fit the model. A trace's prompts are rendered as vLLM renders them and
answered later (BF16 greedy, here); a run's come with the prompt and answer token ids the
server reported. No torch here: drawing needs only the tokenizer.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replay.core.buckets import Buckets
from replay.core.errors import InputError
from replay.core.strict import token_ids


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
    max_prompt: int | None = None,
) -> Drawn:
    """Up to ``per_bucket`` rows per bucket, the smallest hash keys of id and seed, of those
    that fit the model (and ``max_prompt`` tokens, where given)."""
    from .._sample import split_key

    heaps: dict[str, list[tuple[int, str, Item]]] = {b: [] for b in buckets.labels}
    seen = dict.fromkeys(buckets.labels, 0)
    skipped = {"excluded": 0, "too_long": 0, "over_max_prompt": 0}
    for rid, prompt, max_new, answer in rows:
        if rid in exclude:
            skipped["excluded"] += 1
            continue
        if len(prompt) + max_new > max_len:
            skipped["too_long"] += 1
            continue
        if max_prompt is not None and len(prompt) > max_prompt:
            skipped["over_max_prompt"] += 1
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
    max_prompt: int | None = None,
) -> Drawn:
    """Requests of a trace (any format replay reads), rendered as vLLM renders them."""
    from replay.core.errors import TraceError
    from replay.traces.importers import stream

    from .._sample import PromptRenderer

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

    drawn = _pick(rows(), buckets, per_bucket, seed, exclude, max_len, max_prompt)
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
    max_prompt: int | None = None,
) -> Drawn:
    """The reference target's answers of a replay run (first phase, as the replay scores
    them): its prompt and output token ids, as the server reported them."""
    from replay.core.errors import KvcanaryError
    from replay.rundir.files import MANIFEST, RESULTS, read_jsonl
    from replay.rundir.manifest import read_manifest

    try:
        manifest = read_manifest(run_dir)
    except (OSError, ValueError, KvcanaryError):
        manifest = None
    if manifest is None or not manifest.reference or not manifest.schedules:
        raise InputError(
            f"--answers {run_dir}: no readable {MANIFEST} naming the reference "
            "target; give a run directory replay wrote"
        )
    reference, first = manifest.reference, manifest.schedules[0]

    def rows() -> Iterable[Row]:
        for row in read_jsonl(run_dir / RESULTS):
            if not (
                isinstance(row, dict)
                and row.get("target") == reference
                and row.get("phase") == first
                and row.get("status") == "ok"
            ):
                continue
            # Token ids by replay.core.strict's rule: a row that has none is not an answer.
            prompt, answer = token_ids(row.get("prompt_ids")), token_ids(row.get("output_ids"))
            if prompt and answer:
                yield str(row["request_id"]), tuple(prompt), len(answer), tuple(answer)

    drawn = _pick(rows(), buckets, per_bucket, seed, exclude, max_len, max_prompt)
    if not drawn.items:
        raise InputError(
            f"--answers {run_dir}: no answers of the reference target "
            f"'{reference}' with token ids in {RESULTS}"
        )
    drawn.info.update(
        {"source": "run", "run_dir": str(run_dir), "reference": reference, "phase": first}
    )
    return drawn
