"""The report's capacity table for a hybrid-attention model: beside the served KV-cache tokens,
what the model's layer types predict and whether the server agrees within 5%, and the requests
in flight at each bucket's context counted per layer type (summary ``layer_capacity``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from replay.present import formatting, report
from replay.rundir.files import write_json
from tests.unit.present.test_report import make_run_dir, sections

PREDICTED = 4  # the capacity table's column of the layout's prediction
IN_FLIGHT = 9  # its column of requests in flight at each bucket's context


def _layers(predicted: float | None) -> dict[str, Any]:
    return {
        "model": "/models/gemma",
        "layers": 18,
        "sliding_layers": 15,
        "sliding_window": 512,
        "skip_layers": [],
        "cache_bytes": 1073741824.0,
        "cache_bytes_from": "kv_cache_memory_bytes" if predicted else "kv_cache_size_tokens",
        "predicted_kv_cache_size_tokens": predicted,
    }


def _with_layers(run: Path, fp8_predicted: float | None) -> Path:
    """bf16 (10,000 served) predicted 10,100; fp8 (20,000 served) as given; the control none."""
    doc = orjson.loads((run / "summary.json").read_bytes())
    for name, predicted in (("bf16", 10_100.0), ("fp8", fp8_predicted)):
        t = doc["targets"][name]
        t["layer_capacity"] = _layers(predicted)
        for phase in t["phases"].values():
            for bucket, b in phase["buckets"].items():
                held = {"<256": 27.0, "256-1K": 28.0}[bucket]
                b["capacity"].update(concurrency_at_context=held, per_layer_type=True)
    write_json(run / "summary.json", doc)
    return run


def test_the_prediction_stands_beside_the_served_tokens(tmp_path: Path) -> None:
    run = _with_layers(make_run_dir(tmp_path), 30_000.0)
    s = sections(report.render_html(run))
    rows = {r[0]: r for r in s.rows["capacity"]}
    assert rows["bf16"][2] == "10,000" and rows["bf16"][PREDICTED] == "10,100 (served within 5%)"
    # 20,000 served where 30,000 are predicted: a finding, said in the cell.
    assert rows["fp8"][PREDICTED].startswith("30,000 (served -33%: not the cache this layout")
    assert rows["bf16-control"][PREDICTED] == formatting.DASH
    assert rows["bf16"][IN_FLIGHT].startswith("<256: 27.0, 256-1K: 28.0")
    assert "tokens ÷ context" not in rows["bf16"][IN_FLIGHT]
    assert "each layer is counted by its attention type" in s.text["capacity"]


def test_bytes_read_back_from_the_size_have_no_prediction(tmp_path: Path) -> None:
    run = _with_layers(make_run_dir(tmp_path), None)
    rows = {r[0]: r for r in sections(report.render_html(run)).rows["capacity"]}
    assert rows["fp8"][PREDICTED] == "— (bytes read from kv_cache_size_tokens)"


def test_a_run_without_layouts_says_how_its_figure_was_counted(tmp_path: Path) -> None:
    s = sections(report.render_html(make_run_dir(tmp_path)))
    rows = {r[0]: r for r in s.rows["capacity"]}
    assert rows["bf16"][PREDICTED] == formatting.DASH
    assert rows["bf16"][IN_FLIGHT].endswith("(tokens ÷ context)")
    assert "attention type" not in s.text["capacity"]
