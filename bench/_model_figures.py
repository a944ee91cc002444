"""docs/models.md's figures of the embedded test model, rendered from the manifest its trainer
wrote beside the checkpoint (``kvcanary_model.json``: the training run and the served
measurement); ``bench/doc_figures.py`` puts each between its markers."""

from __future__ import annotations

from typing import Any

from _blocks import paragraph

Doc = dict[str, Any]

# What each family of the served measurement is, in the doc's words; a family not listed is
# shown by its key.
FAMILIES = {
    "retrieval/<256": "retrieval, `<256` tokens",
    "retrieval/256-1K": "retrieval, `256-1K`",
    "retrieval/>=1K": "retrieval, `>=1K` (up to about 1,500 tokens)",
    "tool": "tool call (hermes `<tool_call>`, parsed by vLLM into `tool_calls`)",
    "code": "code (two-step functions, operation/constant combinations never trained)",
}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}".removesuffix(".0") + "%"


def served(doc: Doc) -> str:
    """What the model does served by vLLM CPU: each family's held-out pass rate."""
    m = doc["heldout_greedy_vllm"]
    n = m["n"]
    keys = [k for k in FAMILIES if k in n] + sorted(
        k for k in n if k not in FAMILIES and not any(f.startswith(k + "/") for f in n)
    )
    one = "one request at a time" if m["concurrency"] == 1 else f"concurrency {m['concurrency']}"
    lines = [
        paragraph(
            f"**What it does, served by vLLM CPU {m['vllm']}** (KV cache dtype "
            f"{m['kv_cache_dtype']}, greedy, {one}, on `traces/{m['trace']}`, held-out seeds; "
            "recorded in the checkpoint's `kvcanary_model.json` and checked again by "
            "`tests/integration/test_testmodel_vllm.py`):"
        ),
        "",
        "| family | held-out requests | passed |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {FAMILIES.get(k, k)} | {n[k]} | {_pct(m[k])} |" for k in keys]
    return "\n".join(lines) + "\n"


def _greedy_check(doc: Doc) -> str:
    """The in-process check: one rate when every family and band scored the same."""
    m = doc["heldout_greedy_transformers"]
    n = m["n"]
    bands = [k for k in n if not any(f.startswith(k + "/") for f in n)]
    if len({m[k] for k in bands}) == 1 and len({n[k] for k in bands}) == 1:
        return f"{_pct(m[bands[0]])} on {n[bands[0]]} per family and band"
    return ", ".join(f"{k} {_pct(m[k])} of {n[k]}" for k in bands)


def training(doc: Doc) -> str:
    """How the checkpoint was trained: steps, time, threads, and the in-process check."""
    t = doc["training"]
    return paragraph(
        "**Training.** `python -m replay.testmodel.train --out "
        "replay/testmodel/models/kvcanary-tiny-llama` regenerates it (deterministic for a "
        f"seed and thread count): {t['steps']:,} steps in {t['train_seconds']:.0f} s on "
        f"{t['torch_threads']} CPU threads, short contexts first and long ones last, then a "
        f"greedy check in-process ({_greedy_check(doc)}) and the served measurement above, "
        "written to the manifest with the seed, the scripts' sha256, the phases and examples "
        "seen and the loss log."
    ) + ("\n`--measure-served` re-measures an existing checkpoint.\n")
