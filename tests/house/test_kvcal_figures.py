"""docs/kvcal.md's emulation and KV-format tables come from bench/results/kvcal_formats.json:
each figure there is one a run recorded, in the form the tables print."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _kvcal_figures as figures
import doc_figures


def _recorded() -> dict:  # type: ignore[type-arg]
    return orjson.loads(doc_figures.KV.read_bytes())  # type: ignore[no-any-return]


def test_a_dnll_keeps_its_sign_and_its_small_digits() -> None:
    assert figures.nat(1.4451) == "+1.445"
    assert figures.nat(0.00112) == "+0.0011"
    assert figures.nat(-1.07e-05) == "-1.1e-05"
    assert figures.nat(None) == ""


def test_buckets_are_listed_shortest_first() -> None:
    rows = {">=1K": 0, "256-1K": 0, "all": 0, "<256": 0, "unlisted": 0}
    assert figures._buckets(rows) == ["<256", "256-1K", ">=1K"]


def test_a_command_is_shown_without_the_bench_s_files() -> None:
    cmd = "kvcal emulate twin --answers run --buckets 256,1K --json twin.json"
    assert figures.command(cmd) == "kvcal emulate twin --answers RUN_DIR --buckets 256,1K"
    assert (
        figures.command("replay --trace t.jsonl --out . --run-id run") == "replay --trace t.jsonl"
    )


def test_every_step_is_recorded_with_its_machine_and_figures() -> None:
    doc = _recorded()
    for step in ("emulate", "served", "canary", "formats"):
        entry = doc[step]
        assert entry["figures"] is not None, step
        assert entry["machine"]["cpu_model"] and entry["commands"], step


def test_a_recorded_figure_reaches_its_table() -> None:
    """Change one recorded ΔNLL: the served table prints the new value."""
    doc = copy.deepcopy(_recorded())
    bucket = doc["served"]["figures"]["rows"][1]["buckets"]["<256"]
    bucket["served"]["teacher_forced"]["nll_delta_mean"] = 7.654
    assert "+7.654" in figures.served(doc)
    assert "+7.654" not in figures.served(_recorded())
