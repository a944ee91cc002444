"""How well the trained test model answers held-out examples: a cheap teacher-forced probe
during training, greedy answers in transformers graded by the project's own checkers, and
the accuracy served by vLLM through a replay of the held-out trace.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from replay.testmodel import tasks
from replay.testmodel.curriculum import Encoder, answer_logits, collate


def probe(model: Any, enc: Encoder) -> dict[str, float]:
    """Teacher-forced answer-token accuracy on fixed held-out examples: cheap progress."""
    import torch

    out = {}
    model.eval()
    with torch.no_grad():
        for fam, shape in (
            ("retrieval", "short"),
            ("retrieval", "medium"),
            ("retrieval", "long"),
            ("tool", None),
            ("code", None),
        ):
            exs = [tasks.example("heldout", fam, 900_000 + i, shape=shape) for i in range(4)]
            ids, labels = collate([enc.encode(e) for e in exs], enc.tok.pad_token_id)
            logits, target = answer_logits(model, ids, labels)
            out[shape or fam] = round(float((logits.argmax(-1) == target).float().mean()), 3)
    model.train()
    return out


def greedy(model: Any, enc: Encoder, ex: tasks.Example, max_new: int) -> str:
    import torch

    ids = torch.tensor([enc.prompt_ids(ex)])
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=enc.tok.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=enc.tok.pad_token_id,
        )
    return str(enc.tok.decode(out[0, ids.shape[1] :], skip_special_tokens=False))


def grade_text(ex: tasks.Example, text: str) -> bool:
    """Grade a raw completion the way the server's answer will be graded."""
    from replay.checkers import Answer, parse_check
    from replay.core.records import ToolCall

    text = text.replace("<|im_end|>", "")
    calls = []
    if ex.family == "tool":
        for i, chunk in enumerate(text.split("<tool_call>")[1:]):
            body = chunk.split("</tool_call>")[0]
            try:
                obj = json.loads(body)
                calls.append(ToolCall(i, None, obj["name"], json.dumps(obj["arguments"])))
            except (ValueError, KeyError, TypeError):
                return False
        text = ""
    return parse_check(ex.check).grade(Answer(text=text, tool_calls=tuple(calls))).passed


def evaluate(model: Any, enc: Encoder, per_band: int) -> dict[str, Any]:
    """Greedy accuracy on held-out examples, per family and per retrieval length band."""
    model.eval()
    scores: dict[str, list[bool]] = defaultdict(list)
    for ex in tasks.heldout_set(per_band):
        ok = grade_text(ex, greedy(model, enc, ex, 64))
        scores[ex.family].append(ok)
        if ex.family == "retrieval":
            scores[f"retrieval/{ex.meta['band']}"].append(ok)
    model.train()
    return {k: round(sum(v) / len(v), 3) for k, v in sorted(scores.items())} | {
        "n": {k: len(v) for k, v in sorted(scores.items())}
    }


def served_accuracy(grades: Path, target: str) -> dict[str, Any]:
    """Pass rates per task family and per retrieval context bucket from a replay's grades."""
    scores: dict[str, list[bool]] = defaultdict(list)
    for line in grades.read_text().splitlines():
        row = json.loads(line)
        if row["target"] != target or row["grade"] is None:
            continue
        scores[row["task"]].append(bool(row["grade"]["passed"]))
        if row["task"] == "retrieval":
            scores[f"retrieval/{row['bucket']}"].append(bool(row["grade"]["passed"]))
    return {k: round(sum(v) / len(v), 3) for k, v in sorted(scores.items())} | {
        "n": {k: len(v) for k, v in sorted(scores.items())}
    }


def measure_served(model_dir: Path, trace: Path) -> dict[str, Any]:
    """Replay the held-out trace against a real vLLM server of the model (BF16 KV cache,
    greedy, one request at a time) and grade it with the project's checkers."""
    import subprocess
    import sys

    import vllm

    with tempfile.TemporaryDirectory(prefix="kvcanary-eval-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "replay.cli",
            "--trace",
            str(trace),
            "--targets",
            "bf16",
            "--model",
            str(model_dir),
            "--concurrency",
            "1",
            "--buckets",
            "256,1K",
            "--no-teacher-forced",
            "--out",
            tmp,
            "--run-id",
            "heldout",
        ]
        proc = subprocess.run(cmd, check=False)
        if proc.returncode not in (0, 13):  # 13: one target, so no verdict pair
            raise SystemExit(f"the held-out replay failed (exit {proc.returncode})")
        acc = served_accuracy(Path(tmp) / "heldout" / "grades.jsonl", "bf16")
    return acc | {
        "vllm": vllm.__version__,
        "kv_cache_dtype": "auto (bf16)",
        "trace": trace.name,
        "concurrency": 1,
    }


def record_served(model_dir: Path, trace: Path) -> None:
    path = model_dir / "kvcanary_model.json"
    acc = measure_served(model_dir, trace)
    manifest = json.loads(path.read_text())
    manifest["heldout_greedy_vllm"] = acc
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps({"heldout_greedy_vllm": acc}), flush=True)
