"""Train the embedded test model on the three task families, on the CPU, and write it.

    python -m replay.testmodel.train --out replay/testmodel/models/kvcanary-tiny-llama

builds the tokenizer (byte-level BPE whose keys and values are single tokens, the tool-call
markers as special tokens), the chat template, and a 4-layer Llama; trains it with a curriculum
(short retrieval contexts with many lookups first, long contexts last, so the lookup forms
before attention gets expensive); evaluates greedy answers on held-out examples with the
project's own checkers; and writes the checkpoint with a manifest (seed, script digest, data
sizes, accuracies per family and length band). Deterministic for a given seed and thread
count, apart from floating-point reduction order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from replay.testmodel import factory, tasks

VOCAB_SIZE = 4096
# Steps of each phase: (name, steps, retrieval shapes, most lookups a retrieval example,
# tokens a step, family weights: retrieval, tool, code). Short contexts first, long ones
# last: the formats are learned where attention is cheap. Two lookups at most, because a
# third key would follow the second comma of the question, which no longer names one key.
PHASES: list[tuple[str, int, tuple[str, ...], int, int, tuple[int, ...]]] = [
    ("short", 1200, ("dense", "dense", "short"), 2, 2048, (2, 3, 1)),
    ("medium", 150, ("dense", "short", "medium"), 2, 4096, (3, 1, 1)),
    ("long", 40, ("short", "medium", "long"), 2, 8192, (3, 1, 1)),
]
# Attention biases give layer 0 a head whose scores depend on position alone; a RoPE base
# of 1e8 leaves 17 of 32 frequency pairs nearly unrotated across 2K tokens, so a later head
# can match content at any distance, and 6 fast enough to single out the previous position.
ARCH = {**factory.DEFAULT_ARCH, "intermediate_size": 512, "attention_bias": True, "rope_theta": 1e8}
# The previous-token head's query and key biases: the query carries the scale, because
# keys are what an FP8 cache stores, and small keys keep their relative precision there.
PREV_QUERY, PREV_KEY = 100.0, 2.0
# Residual-stream slots of the built-in induction circuit: token code, the previous
# token's code, and the code of the token to copy (read by the output projection).
CODE, PREV, COPY = slice(0, 64), slice(128, 192), slice(192, 256)
MATCH_SHARPNESS, COPY_LOGIT_SCALE = 15.0, 0.5


def rope_pairs(config: Any, reach: int = 2048) -> tuple[Any, list[int], list[int]]:
    """RoPE frequencies, the pairs fast enough to single out the previous position, and
    the pairs slow enough (under half a radian across ``reach`` tokens) to match content."""
    import torch

    d = config.head_dim
    theta = config.rope_parameters["rope_theta"]
    freqs = theta ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    fast = [i for i in range(d // 2) if freqs[i] > 0.05]
    slow = [i for i in range(d // 2) if freqs[i] * reach < 0.5]
    return freqs, fast, slow


def pin_previous_token_head(model: Any) -> None:
    """Layer 0, head 0 attends to the previous position, whatever the tokens.

    Its query and key are constant biases (the projections' weights are zero), so after
    RoPE their product depends only on the distance: with the key bias rotated one step
    ahead of the query bias in every fast pair, the score peaks at distance one. Called
    after every optimizer step, so that training never moves it.
    """
    import torch

    att = model.model.layers[0].self_attn
    d = model.config.head_dim
    freqs, fast, _ = rope_pairs(model.config)
    bq, bk = torch.zeros(d), torch.zeros(d)
    for i in fast:
        bq[i] = PREV_QUERY
        bk[i], bk[i + d // 2] = PREV_KEY * torch.cos(freqs[i]), PREV_KEY * torch.sin(freqs[i])
    with torch.no_grad():
        att.q_proj.weight[:d].zero_()
        att.q_proj.bias[:d] = bq
        att.k_proj.weight[:d].zero_()
        att.k_proj.bias[:d] = bk


def build_induction_circuit(model: Any, vocab: dict[str, int] | None = None) -> None:
    """Start training from a model that already copies what followed a token before.

    Every task here is a copy: the value after a key, the arguments in the question, the
    constants in the spec. Gradient descent finds the two-head induction circuit on two
    CPU cores only after thousands of steps (measured: loss still falling at 1,500 steps on
    pure copying), so it is built by hand and trained from there:
    layer 0 head 0 writes the previous token's code to the PREV slot; layer 1 head 0
    matches the current token's code against PREV (on the slow RoPE pairs) and writes the
    matched position's code to the COPY slot; the output projection reads COPY as logits.
    With ``vocab``, a word and its leading-space form (``Ġ`` in byte-level BPE) share one
    code: a question says `` Boston``, the tool call's JSON ``"Boston"``, and a copy is
    then a copy; which form to write is one feature the model learns for all words.
    Measured: greedy copies of a 200-token span 1,300 tokens back are 99-100% right before
    any training, and after 900 steps on the tasks every retrieved value is right in all
    three length bands, teacher-forced.
    """
    import torch

    vocab = vocab or {}
    m, d = model.model, model.config.head_dim
    _, _, slow = rope_pairs(model.config)
    content = slow + [i + d // 2 for i in slow]
    a0, a1 = m.layers[0].self_attn, m.layers[1].self_attn
    eye = torch.eye(d)
    with torch.no_grad():
        emb = m.embed_tokens.weight
        emb.normal_(0.0, 1.0)
        emb[:, CODE.stop :].zero_()  # PREV and COPY slots start empty
        for word, idx in vocab.items():
            if word.startswith("Ġ") and word[1:] in vocab:
                emb[vocab[word[1:]], CODE] = emb[idx, CODE]
        a0.v_proj.weight[:d].zero_()
        a0.v_proj.weight[:d, CODE] = eye / math.sqrt(2)
        a0.o_proj.weight[:, :d].zero_()
        a0.o_proj.weight[PREV, :d] = eye
        a1.q_proj.weight[:d].zero_()
        a1.k_proj.weight[:d].zero_()
        for j, dim in enumerate(content):
            a1.q_proj.weight[dim, CODE.start + j] = MATCH_SHARPNESS
            a1.k_proj.weight[dim, PREV.start + j] = 1.0
        a1.v_proj.weight[:d].zero_()
        a1.v_proj.weight[:d, CODE] = eye
        a1.o_proj.weight[:, :d].zero_()
        a1.o_proj.weight[COPY, :d] = eye
        # Later layers get the same copy output in the heads on their first KV head, and
        # learn where to attend: copying a tool argument or a key from the question needs
        # attention by content class ("a city"), which no fixed circuit gives.
        for layer in m.layers[2:]:
            layer.self_attn.v_proj.weight[:d].zero_()
            layer.self_attn.v_proj.weight[:d, CODE] = eye
            layer.self_attn.o_proj.weight[:, : 2 * d].zero_()
            layer.self_attn.o_proj.weight[COPY, :d] = eye
            layer.self_attn.o_proj.weight[COPY, d : 2 * d] = eye
        model.lm_head.weight[:, COPY] = COPY_LOGIT_SCALE * emb[:, CODE]
    pin_previous_token_head(model)


def tokenizer_corpus(n: int = 3000) -> list[str]:
    """Text the BPE is trained on: task examples, every key and value many times, code."""
    texts: list[str] = []
    for i in range(n):
        for fam in tasks.FAMILIES:
            ex = tasks.example("train", fam, i, shape="short")
            texts.extend(m["content"] for m in ex.messages)
            if ex.answer.get("content"):
                texts.append(ex.answer["content"])
            for call in ex.answer.get("tool_calls") or []:
                fn = call["function"]
                texts.append(json.dumps({"name": fn["name"], "arguments": fn["arguments"]}))
            texts.extend(json.dumps(t) for t in ex.tools or [])
    # Repeated so that every key and value ends up a single token with its leading space.
    for _ in range(12):
        texts.append(" ".join(tasks.KEYS))
        texts.append(" ".join(tasks.VALUES))
    texts.append(factory.CHAT_TEMPLATE)
    return texts


def check_single_tokens(tok: Any) -> None:
    bad = [w for w in tasks.KEYS + tasks.VALUES if len(tok.encode(" " + w).ids) != 1]
    if bad:
        raise SystemExit(f"{len(bad)} keys/values are not single tokens, e.g. {bad[:5]}")


class Encoder:
    """Chat examples -> (input ids, loss mask), rendered by the model's own chat template."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))

    def prompt_ids(self, ex: tasks.Example) -> list[int]:
        ids = self.tok.apply_chat_template(
            ex.messages,
            tools=ex.tools,  # type: ignore[arg-type]
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return list(ids)

    def encode(self, ex: tasks.Example) -> tuple[list[int], list[int]]:
        prompt = self.prompt_ids(ex)
        full = list(
            self.tok.apply_chat_template(
                [*ex.messages, ex.answer],
                tools=ex.tools,  # type: ignore[arg-type]
                tokenize=True,
                return_dict=False,
            )
        )
        if full[: len(prompt)] != prompt:
            raise RuntimeError(f"{ex.id}: the template does not extend the prompt")
        end = self.tok.convert_tokens_to_ids("<|im_end|>")
        answer = full[len(prompt) :]
        answer = answer[: answer.index(end) + 1]  # train the stop, not what follows it
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)


def batches(enc: Encoder, seed: int) -> Any:
    """(phase, examples, examples drawn so far) batches following PHASES."""
    counter: dict[str, int] = defaultdict(int)
    rng = random.Random(seed)
    for name, steps, shapes, queries, budget, weights in PHASES:
        for _ in range(steps):
            batch: list[tuple[list[int], list[int]]] = []
            longest = 0
            while True:
                fam = rng.choices(tasks.FAMILIES, weights=weights)[0]
                idx = counter[fam]
                counter[fam] += 1
                if fam == "retrieval":
                    ex = tasks.example(
                        "train", fam, idx, shape=rng.choice(shapes), queries=rng.randint(1, queries)
                    )
                    item = enc.encode(ex)
                else:
                    item = enc.encode(tasks.example("train", fam, idx))
                longest = max(longest, len(item[0]))
                if batch and longest * (len(batch) + 1) > budget:
                    break
                batch.append(item)
            yield name, batch, dict(counter)


def collate(batch: list[tuple[list[int], list[int]]], pad: int) -> tuple[Any, Any]:
    """Right-padded ids and next-token labels (-100 where nothing is learned). With causal
    attention and padding only at the end, no real token ever sees a pad: no mask needed."""
    import torch

    n = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), n), pad, dtype=torch.long)
    labels = torch.full((len(batch), n), -100, dtype=torch.long)
    for i, (x, m) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(x) - 1] = torch.tensor(
            [t if keep else -100 for t, keep in zip(x[1:], m[1:], strict=True)]
        )
    return ids, labels


def answer_logits(model: Any, ids: Any, labels: Any) -> tuple[Any, Any]:
    """Logits only where an answer token is predicted: the vocabulary projection of every
    prompt position would cost as much as a layer and teach nothing."""
    hidden = model.model(input_ids=ids).last_hidden_state
    keep = labels != -100
    return model.lm_head(hidden[keep]), labels[keep]


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


def main() -> None:
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
    args = ap.parse_args()

    if args.measure_served:
        record_served(args.out, args.heldout_trace)
        return

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    global PHASES
    PHASES = [(p[0], max(1, int(p[1] * args.steps_scale)), *p[2:]) for p in PHASES]
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
    model.train()
    total_steps = sum(p[1] for p in PHASES)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)

    def lr_at(step: int) -> float:
        warm = 30
        if step < warm:
            return float(args.lr) * (step + 1) / warm
        return float(args.lr) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total_steps)))

    pad = enc.tok.pad_token_id
    log: list[dict[str, Any]] = []
    tokens_seen = 0
    counts: dict[str, int] = {}
    for step, (phase, batch, seen) in enumerate(batches(enc, args.seed)):
        counts = seen
        ids, labels = collate(batch, pad)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        # float32: this CPU has no bf16 matrix units, and autocast to bf16 was 3x slower.
        logits, target = answer_logits(model, ids, labels)
        loss = torch.nn.functional.cross_entropy(logits, target)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pin_previous_token_head(model)
        tokens_seen += sum(len(x) for x, _ in batch)
        if step % 10 == 0 or step == total_steps - 1:
            row: dict[str, Any] = {
                "step": step,
                "phase": phase,
                "loss": round(loss.item(), 4),
                "batch": len(batch),
                "seq": ids.shape[1],
                "elapsed_s": round(time.monotonic() - started, 1),
            }
            if step % 50 == 0 or step == total_steps - 1:
                row["probe"] = probe(model, enc)
            log.append(row)
            print(json.dumps(row), flush=True)
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
    script = Path(__file__)
    manifest = json.loads((out / "kvcanary_model.json").read_text())
    manifest.update(
        {
            "training": {
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
                    for p in PHASES
                ],
                "steps": total_steps,
                "tokens_seen": tokens_seen,
                "examples_seen": counts,
                "train_seconds": round(train_s, 1),
                "torch_threads": torch.get_num_threads(),
                "script_sha256": {
                    p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                    for p in (script, script.with_name("tasks.py"), script.with_name("factory.py"))
                },
                "loss_log": log,
            },
            "heldout_greedy_transformers": acc,
            "params": sum(p.numel() for p in model.parameters()),
        }
    )
    (out / "kvcanary_model.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {out} in {time.monotonic() - started:.0f} s")
    if args.heldout_trace.exists():
        record_served(out, args.heldout_trace)


def record_served(model_dir: Path, trace: Path) -> None:
    path = model_dir / "kvcanary_model.json"
    acc = measure_served(model_dir, trace)
    manifest = json.loads(path.read_text())
    manifest["heldout_greedy_vllm"] = acc
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps({"heldout_greedy_vllm": acc}), flush=True)


if __name__ == "__main__":
    main()
