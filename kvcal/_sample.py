"""Calibration samples drawn from the traces that are replayed, disjoint from evaluation.

Scales describe the K/V ranges of the inputs they were collected on, so the samples come from
the served traffic, stratified over the same context-length buckets that replay reports (one
average would let short chat prompts set the range of a 64K document service). Which request
goes where is a pure function of its id and the seed (a hash, not a shuffle), so the split is
the same on every machine and a later replay can exclude exactly the calibration ids.

Prompts are token ids rendered the way vLLM renders them: chat requests through the model's
chat template (tools included) and tokenized without special tokens; text completions with
them; token-id prompts as they are; length-only records made of the same deterministic token
blocks replay sends.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replay.core.buckets import Buckets
from replay.core.errors import InputError
from replay.core.ids import id_problem, write_ids
from replay.core.strict import is_token_ids
from replay.traces.synth import POOL_TEXT, TokenPool, synthesize
from replay.traces.trace import Request

CALIBRATION_IDS = "calibration_ids.txt"
EVALUATION_IDS = "evaluation_ids.txt"
SAMPLES = "samples.jsonl"
SAMPLE_MANIFEST = "sample_manifest.json"


@dataclass(frozen=True)
class Sample:
    """One calibration prompt: the token ids the server would put in its KV cache."""

    id: str
    bucket: str
    input_ids: tuple[int, ...]
    text: str | None = None  # the rendered prompt, where the request had text

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "bucket": self.bucket,
            "num_tokens": len(self.input_ids),
            "input_ids": list(self.input_ids),
            "text": self.text,
        }


@dataclass
class Split:
    calibration: list[Sample] = field(default_factory=list)
    evaluation_ids: list[str] = field(default_factory=list)
    # per bucket: requests available, chosen for calibration, asked for
    buckets: dict[str, dict[str, int]] = field(default_factory=dict)


def split_key(request_id: str, seed: int) -> int:
    """Where a request falls in the deterministic order (smallest keys calibrate); 128 bits,
    so two ids never tie in practice."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{request_id}".encode()).digest()[:16], "big")


class PromptRenderer:
    """Token ids of a request's prompt on one model's tokenizer and chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._pool: TokenPool | None = None

    def pool(self) -> TokenPool:
        if self._pool is None:
            self._pool = TokenPool(self.tok.encode(POOL_TEXT, add_special_tokens=False))
        return self._pool

    def render(self, req: Request) -> tuple[list[int], str | None]:
        if req.synth is not None:
            return synthesize(req, self.pool()), None
        if isinstance(req.prompt, tuple):
            return list(req.prompt), None
        if isinstance(req.prompt, str):
            return list(self.tok.encode(req.prompt)), req.prompt
        if getattr(self.tok, "chat_template", None) is None:
            raise InputError(
                f"request {req.id}: a chat request, but the model's tokenizer has "
                "no chat template; give the model folder the server uses"
            )
        text = self.tok.apply_chat_template(
            [dict(m) for m in req.messages or ()],
            tools=[dict(t) for t in req.tools] if req.tools else None,
            add_generation_prompt=True,
            tokenize=False,
        )
        # vLLM tokenizes a rendered chat prompt without adding special tokens again.
        return list(self.tok.encode(text, add_special_tokens=False)), str(text)


def draw(
    requests: Iterable[Request],
    renderer: PromptRenderer,
    buckets: Buckets,
    per_bucket: int,
    seed: int,
    max_share: float = 0.5,
) -> Split:
    """Up to ``per_bucket`` calibration requests per bucket, never more than ``max_share`` of
    a bucket (the rest of it must stay for evaluation); every other request evaluates.

    Streams: per bucket only the ``per_bucket`` smallest hash keys are kept with their
    prompts (a max-heap), so memory grows with the sample, not with the trace (ids aside).
    """
    if per_bucket < 1:
        raise InputError("--per-bucket must be at least 1")
    if not 0 < max_share < 1:
        raise InputError("--max-share must be between 0 and 1 (exclusive)")
    heaps: dict[str, list[tuple[int, str, Sample]]] = {label: [] for label in buckets.labels}
    sizes = dict.fromkeys(buckets.labels, 0)
    order: list[str] = []
    for req in requests:
        ids, text = renderer.render(req)
        label = buckets.label(len(ids))
        sizes[label] += 1
        order.append(req.id)
        # max-heap by key (negated): its root is the first to give way to a smaller key
        item = (-split_key(req.id, seed), req.id, Sample(req.id, label, tuple(ids), text))
        if len(heaps[label]) < per_bucket:
            heapq.heappush(heaps[label], item)
        elif item[0] > heaps[label][0][0]:
            heapq.heapreplace(heaps[label], item)
    out = Split()
    for label in buckets.labels:
        take = min(per_bucket, int(sizes[label] * max_share))
        smallest = sorted(heaps[label], key=lambda it: -it[0])[:take]
        out.calibration.extend(sample for _, _, sample in smallest)
        out.buckets[label] = {"available": sizes[label], "calibration": take, "asked": per_bucket}
    chosen = {s.id for s in out.calibration}
    out.evaluation_ids = [i for i in order if i not in chosen]
    return out


def write_split(out_dir: Path, split: Split, info: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_ids(out_dir / CALIBRATION_IDS, (s.id for s in split.calibration))
    write_ids(out_dir / EVALUATION_IDS, split.evaluation_ids)
    with (out_dir / SAMPLES).open("w", encoding="utf-8") as fh:
        for s in split.calibration:
            fh.write(json.dumps(s.to_json(), ensure_ascii=False) + "\n")
    manifest = {
        **info,
        "buckets": split.buckets,
        "calibration": len(split.calibration),
        "evaluation": len(split.evaluation_ids),
    }
    (out_dir / SAMPLE_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def read_samples(path: Path) -> list[Sample]:
    """A ``samples.jsonl`` written by ``kvcal sample``; a bad line names itself."""
    if not path.is_file():
        raise InputError(f"{path}: no such samples file (write one with `kvcal sample`)")
    return list(_iter_samples(path))


def _iter_samples(path: Path) -> Iterator[Sample]:
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield _sample(line)
            except ValueError as exc:
                field_name, _, reason = str(exc).partition(": ")
                raise InputError(
                    f"{path}:{lineno}: field '{field_name}': {reason}; each line "
                    "needs 'id' and 'input_ids' (as `kvcal sample` writes)"
                ) from None


def _sample(line: str) -> Sample:
    """One line of a samples file; ``ValueError("FIELD: reason")`` when it is not one."""
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"(line): not valid JSON ({exc})") from None
    if not isinstance(row, dict):
        raise ValueError("(line): must be a JSON object")
    for key in ("id", "input_ids"):
        if key not in row:
            raise ValueError(f"{key}: required")
    rid = str(row["id"])
    why = id_problem(rid)
    if why is not None:
        raise ValueError(f"id: {rid!r} {why}")
    ids = row["input_ids"]
    if not ids or not is_token_ids(ids):
        raise ValueError("input_ids: must be a non-empty list of token ids")
    return Sample(rid, str(row.get("bucket", "")), tuple(ids), row.get("text"))
