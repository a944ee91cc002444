"""Train the embedded test model on the three task families, on the CPU, and write it.

    python -m replay.testmodel.train --out replay/testmodel/models/kvcanary-tiny-llama

builds the tokenizer (byte-level BPE whose keys and values are single tokens, the tool-call
markers as special tokens), the chat template, and a 4-layer Llama; trains it with a curriculum
(short retrieval contexts with many lookups first, long contexts last, so the lookup forms
before attention gets expensive); evaluates greedy answers on held-out examples with the
project's own checkers; and writes the checkpoint with a manifest (seed, script digest, data
sizes, accuracies per family and length band). Deterministic for a given seed and thread
count, apart from floating-point reduction order.

This module is the command and the training loop; the induction circuit training starts from
is ``circuit``, the data ``curriculum``, the evaluations ``heldout``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replay.core.errors import MissingExtra
from replay.core.extras import require
from replay.testmodel import factory
from replay.testmodel.circuit import ARCH, build_induction_circuit, pin_previous_token_head
from replay.testmodel.curriculum import (
    PHASES,
    VOCAB_SIZE,
    Encoder,
    Phase,
    answer_logits,
    batches,
    check_single_tokens,
    collate,
    scaled,
    tokenizer_corpus,
)
from replay.testmodel.heldout import evaluate, probe, record_served

# What training and serving the model need beyond the core dependencies.
TRAIN_NEEDS = ("torch", "transformers", "tokenizers", "safetensors")
SERVE_NEEDS = ("vllm",)
COMMAND = "python -m replay.testmodel.train"
# The modules whose source the manifest's script digest covers.
SCRIPTS = ("train.py", "circuit.py", "curriculum.py", "heldout.py", "tasks.py", "factory.py")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--measure-served",
        action="store_true",
        help="Only measure an existing checkpoint at --out on a vLLM server and "
        "record it in its manifest",
    )
    ap.add_argument(
        "--heldout-trace",
        type=Path,
        default=Path(__file__).parents[2] / "traces" / "testmodel_heldout.jsonl",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--eval-per-family",
        type=int,
        default=10,
        help="held-out examples per family and band for the quick in-process "
        "check (the served evaluation uses the whole held-out trace)",
    )
    ap.add_argument(
        "--steps-scale",
        type=float,
        default=1.0,
        help="multiply every phase's steps (for quick trials)",
    )
    return ap.parse_args(argv)


def _require(needs: Sequence[str], purpose: str = "") -> None:
    """Stop with one line naming what to install (exit 2, as for a usage error), before
    anything runs, when an optional dependency is missing."""
    try:
        require(COMMAND, needs, purpose)
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.measure_served:
        _require(SERVE_NEEDS, " to serve the model")
        record_served(args.out, args.heldout_trace)
        return
    _require(TRAIN_NEEDS)
    out = train(args, scaled(PHASES, args.steps_scale))
    if args.heldout_trace.exists():
        _require(SERVE_NEEDS, " to serve the model (the checkpoint is written)")
        record_served(out, args.heldout_trace)


@dataclass
class Fit:
    """What the training loop saw: the loss log, tokens and examples per family."""

    steps: int
    log: list[dict[str, Any]] = field(default_factory=list)
    tokens_seen: int = 0
    examples_seen: dict[str, int] = field(default_factory=dict)


def train(args: argparse.Namespace, phases: list[Phase]) -> Path:
    """Build the tokenizer and the circuit, train, evaluate, write the checkpoint to
    ``args.out`` with its manifest; returns the checkpoint folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    started = time.monotonic()
    tok = factory.build_tokenizer(tokenizer_corpus(), VOCAB_SIZE)
    check_single_tokens(tok)
    work = Path(tempfile.mkdtemp(prefix="kvcanary-train-"))
    factory.build(work, arch=ARCH, tokenizer=tok, seed=args.seed)
    enc = Encoder(work)
    cfg = json.loads((work / "config.json").read_text())
    config = LlamaConfig(
        **{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}
    )
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    build_induction_circuit(model, enc.tok.get_vocab())
    fit = _fit(model, enc, phases, args, started)
    train_s = time.monotonic() - started

    # A tied lm_head is the embedding itself; the checkpoint stores it once.
    state = {
        k: v.detach().to(torch.bfloat16).contiguous()
        for k, v in model.state_dict().items()
        if "rotary" not in k and not (config.tie_word_embeddings and k == "lm_head.weight")
    }
    model = model.bfloat16()
    acc = evaluate(model, enc, args.eval_per_family)
    print(json.dumps({"heldout_greedy_transformers": acc}), flush=True)
    out = factory.build(args.out, arch=ARCH, tokenizer=tok, weights=state, seed=args.seed)
    manifest = json.loads((out / "kvcanary_model.json").read_text())
    manifest.update(
        {
            "training": _training_record(args, phases, fit, train_s, torch.get_num_threads()),
            "heldout_greedy_transformers": acc,
            "params": sum(p.numel() for p in model.parameters()),
        }
    )
    (out / "kvcanary_model.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {out} in {time.monotonic() - started:.0f} s")
    return out


def _fit(
    model: Any, enc: Encoder, phases: list[Phase], args: argparse.Namespace, started: float
) -> Fit:
    """AdamW over the curriculum's batches, warm-up then cosine decay, the previous-token
    head pinned after every step; logs every 10 steps, probes every 50."""
    import torch

    model.train()
    fit = Fit(steps=sum(p[1] for p in phases))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    pad = enc.tok.pad_token_id
    for step, (phase, batch, seen) in enumerate(batches(enc, args.seed, phases)):
        fit.examples_seen = seen
        ids, labels = collate(batch, pad)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, float(args.lr), fit.steps)
        # float32: this CPU has no bf16 matrix units, and autocast to bf16 was 3x slower.
        logits, target = answer_logits(model, ids, labels)
        loss = torch.nn.functional.cross_entropy(logits, target)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pin_previous_token_head(model)
        fit.tokens_seen += sum(len(x) for x, _ in batch)
        last = step == fit.steps - 1
        if step % 10 == 0 or last:
            row: dict[str, Any] = {
                "step": step,
                "phase": phase,
                "loss": round(loss.item(), 4),
                "batch": len(batch),
                "seq": ids.shape[1],
                "elapsed_s": round(time.monotonic() - started, 1),
            }
            if step % 50 == 0 or last:
                row["probe"] = probe(model, enc)
            fit.log.append(row)
            print(json.dumps(row), flush=True)
    return fit


def _lr_at(step: int, lr: float, total_steps: int) -> float:
    warm = 30
    if step < warm:
        return lr * (step + 1) / warm
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total_steps)))


def _training_record(
    args: argparse.Namespace, phases: list[Phase], fit: Fit, train_s: float, threads: int
) -> dict[str, Any]:
    """The manifest's ``training``: what was trained how, and the digest of the code."""
    here = Path(__file__).parent
    return {
        "seed": args.seed,
        "lr": args.lr,
        "phases": [
            {
                "name": p[0],
                "steps": p[1],
                "retrieval_shapes": list(p[2]),
                "max_lookups": p[3],
                "tokens_per_step": p[4],
                "weights_retrieval_tool_code": list(p[5]),
            }
            for p in phases
        ],
        "steps": fit.steps,
        "tokens_seen": fit.tokens_seen,
        "examples_seen": fit.examples_seen,
        "train_seconds": round(train_s, 1),
        "torch_threads": threads,
        "script_sha256": {
            name: hashlib.sha256((here / name).read_bytes()).hexdigest() for name in SCRIPTS
        },
        "loss_log": fit.log,
    }


if __name__ == "__main__":
    main()
