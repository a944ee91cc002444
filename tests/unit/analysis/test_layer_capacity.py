"""A hybrid-attention model in the analysis: the layers arm's ``sliding_window`` read back as
the layers it names (the verdict's facts, the serving-path check) and each bucket's capacity
counted per layer type (the summary), from the model's config.json where it is here. Gemma 3
270M's figures: vLLM CPU 0.32 reported 247,802 BF16 tokens for a 1 GiB cache at 32,768."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from replay.analysis.schemas import Summary, TargetSummary
from replay.analysis.schemas.manifest import Manifest
from replay.analysis.summary import summarize_targets
from replay.analysis.verdict.facts import facts_from_run
from replay.analysis.verdict.serving_path import serving_problems
from replay.core.records import Result
from replay.pipeline.target_facts import target_for_summary
from tests.support.gemma_layout import GEMMA, SERVED, SLIDING

FLAG = "--kv-cache-dtype-skip-layers"
BF16_LABELS = SERVED["bf16"]


@pytest.fixture
def gemma(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(GEMMA), encoding="utf-8")
    return tmp_path


def _manifest(model: str | None, words: list[str], served: str, root: str = "/m") -> Manifest:
    def entry(args: list[str], skip: str) -> dict[str, Any]:
        return {
            "spec": {"model": model, "args": args, "kv_cache_dtype": "fp8"},
            "model_root": root,
            "cache_config": {"cache_dtype": "fp8", "kv_cache_dtype_skip_layers": skip},
        }

    return Manifest.from_json(
        {
            "reference": "bf16",
            "roles": {"reference": "bf16", "candidate": "fp8", "layers": "fp8-swa"},
            "targets": {
                "bf16": {**entry([], "[]"), "spec": {"model": model, "args": []}},
                "fp8": entry([], "[]"),
                "fp8-swa": entry([FLAG, *words], served),
            },
        }
    )


SUMMARY = Summary.from_json(
    {"targets": {n: {"status": "ok", "phases": {}} for n in ("bf16", "fp8", "fp8-swa")}}
)


def test_the_layers_arm_names_the_sliding_layers_where_its_model_is_here(gemma: Path) -> None:
    m = _manifest(str(gemma), ["sliding_window"], "['sliding_window']")
    assert facts_from_run(SUMMARY, m).layers_skipped == SLIDING
    both = _manifest(str(gemma), ["5", "sliding_window"], "['5', 'sliding_window']")
    assert facts_from_run(SUMMARY, both).layers_skipped == tuple(sorted((*SLIDING, 5)))


def test_a_url_target_reads_its_layout_from_the_folder_its_server_reports(gemma: Path) -> None:
    m = _manifest(None, ["sliding_window"], "['sliding_window']", root=str(gemma))
    assert facts_from_run(SUMMARY, m).layers_skipped == SLIDING


def test_without_a_layout_the_keyword_is_kept_as_the_flag_takes_it() -> None:
    m = _manifest("/no/such/model", ["0", "sliding_window"], "['0', 'sliding_window']")
    assert facts_from_run(SUMMARY, m).layers_skipped == (0, "sliding_window")
    indices = _manifest("/no/such/model", ["0", "29"], "['0', '29']")
    assert facts_from_run(SUMMARY, indices).layers_skipped == (0, 29)


def _problems(m: Manifest) -> list[str]:
    served = TargetSummary.from_json({"status": "ok", "cache_dtype": "fp8"})
    return serving_problems("fp8-swa", served, m, False)


def test_the_served_keyword_matches_the_configured_one(gemma: Path) -> None:
    """What the running server reports for --kv-cache-dtype-skip-layers sliding_window."""
    assert _problems(_manifest(str(gemma), ["sliding_window"], "['sliding_window']")) == []
    assert _problems(_manifest(None, ["sliding_window"], "['sliding_window']")) == []


def test_the_keyword_and_its_indices_are_the_same_layers(gemma: Path) -> None:
    served = str([str(i) for i in SLIDING])
    assert _problems(_manifest(str(gemma), ["sliding_window"], served)) == []
    wrong = _manifest(str(gemma), ["sliding_window"], "['5']")
    assert any("skip-layers configured as 'sliding_window'" in p for p in _problems(wrong))


@pytest.mark.parametrize(
    ("config", "words", "problem"),
    [
        ({**GEMMA, "layer_types": None, "sliding_window": None}, ["sliding_window"], "no sliding"),
        (GEMMA, ["3", "18"], "skip-layers 18: the model has 18 layers (0-17)"),
    ],
)
def test_words_that_name_no_layer_of_the_model_are_a_problem(
    tmp_path: Path, config: dict[str, Any], words: list[str], problem: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    m = _manifest(str(tmp_path), words, str(words))
    assert any(problem in p for p in _problems(m)), _problems(m)


def _results(tokens: int) -> list[Result]:
    return [
        Result(
            request_id=f"r{i}",
            target="bf16",
            phase="c1",
            bucket="1K-4K",
            status="ok",
            scheduled=float(i),
            prompt_tokens=tokens - 8,
            output_tokens=8,
        )
        for i in range(3)
    ]


def test_a_buckets_capacity_is_counted_per_layer_type(gemma: Path) -> None:
    """At 2,000 tokens the 1 GiB BF16 cache holds 27 requests, not 247,802 / 2,000 = 124."""
    phases = {"c1": {"start": 0.0, "end": 10.0}}
    info = target_for_summary(
        "ok", None, BF16_LABELS, phases, model_dirs=(None, str(gemma)), max_model_len=32768
    )
    t = summarize_targets(_results(2000), {"bf16": info}, {}, ["1K-4K"])["bf16"]
    cap = t.phases["c1"].buckets["1K-4K"].capacity
    assert cap.per_layer_type is True
    assert cap.concurrency_at_context == pytest.approx(27.04, abs=0.01)
    layers = t.layer_capacity
    assert layers is not None and layers.model == str(gemma)
    assert (layers.layers, layers.sliding_layers, layers.sliding_window) == (18, 15, 512)
    assert layers.cache_bytes_from == "kv_cache_memory_bytes"
    assert layers.predicted_kv_cache_size_tokens == pytest.approx(247_802, rel=1e-3)
    assert Summary.from_json({"targets": {"bf16": t.to_json()}}).targets["bf16"] == t


def test_without_a_model_folder_the_capacity_is_tokens_over_context() -> None:
    phases = {"c1": {"start": 0.0, "end": 10.0}}
    for info in (
        target_for_summary("ok", None, BF16_LABELS, phases),
        target_for_summary("ok", None, BF16_LABELS, phases, model_dirs=("/no/such/model",)),
    ):
        t = summarize_targets(_results(2000), {"bf16": info}, {}, ["1K-4K"])["bf16"]
        cap = t.phases["c1"].buckets["1K-4K"].capacity
        assert cap.concurrency_at_context == pytest.approx(247_802 / 2000)
        assert cap.per_layer_type is None and t.layer_capacity is None
        assert "per_layer_type" not in cap.to_json() and "layer_capacity" not in t.to_json()
