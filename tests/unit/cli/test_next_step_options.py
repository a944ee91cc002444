"""The options that take a canary past CALIBRATE: a quality pass whose answers do not depend on
batching (``--quality-pass serial``), a layers arm (``--skip-layers NAME=LAYERS``) and kvcal
advise's figures (``--advice FILE``), each refused by name when given wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from replay.analysis.verdict.advice import advice_facts, read_advice
from replay.cli import main
from replay.cli.plan import Plan, with_skip_layers
from replay.cli.run_options import RunOptions
from replay.core.errors import InputError
from replay.serving.targets import TargetSpec

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "traces" / "sample.jsonl"


def options(*args: str) -> RunOptions:
    ctx = main.make_context("replay", ["--trace", str(SAMPLE), *args], resilient_parsing=True)
    return RunOptions.from_click(dict(ctx.params))


@pytest.mark.parametrize(
    ("args", "labels"),
    [
        (["--concurrency", "4"], ["c1", "c4"]),
        (["--concurrency", "1,4,16"], ["c1", "c4", "c16"]),
        (["--rate", "2"], ["c1", "poisson-2rps"]),
    ],
)
def test_a_serial_quality_pass_is_the_first_phase(args: list[str], labels: list[str]) -> None:
    o = options("--targets", "bf16=http://127.0.0.1:9", "--quality-pass", "serial", *args)
    assert [s.label for s in Plan.of(o).schedules] == labels


def test_a_serial_quality_pass_and_the_sequential_canary_exclude_each_other() -> None:
    o = options("--targets", "bf16=http://127.0.0.1:9", "--quality-pass", "serial")
    with pytest.raises(InputError, match="--sequential"):
        Plan.of(o.replace(sequential=True))


LOCAL = [
    TargetSpec("bf16", model="/m", args=("--x",)),
    TargetSpec("fp8-skip", model="/m", kv_cache_dtype="fp8"),
    TargetSpec("remote", url="http://127.0.0.1:9"),
]


def test_skip_layers_serve_a_local_target_with_its_layers_in_bf16() -> None:
    out = with_skip_layers(LOCAL, "fp8-skip=29,0, 3")
    skip = out[1]
    assert skip.args == ("--kv-cache-dtype-skip-layers", "0", "3", "29")
    assert skip.role == "layers" and out[0] == LOCAL[0]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("fp8-skip", "expected NAME=LAYERS"),
        ("fp8-skip=a,b", "expected NAME=LAYERS"),
        ("fp8-skip=-1", "expected NAME=LAYERS"),
        ("nope=1", "'nope' is not one of the targets"),
        ("remote=1", "a server kvcanary does not start"),
    ],
)
def test_skip_layers_refuses_what_it_cannot_serve(text: str, words: str) -> None:
    with pytest.raises(InputError, match=words):
        with_skip_layers(LOCAL, text)


def _advice_file(tmp_path: Path, doc: Any) -> Path:
    path = tmp_path / "advice.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def test_advice_keeps_what_the_verdict_reads(tmp_path: Path) -> None:
    doc = {
        "backend_rounding": "cpu",
        "per_head_supported": False,
        "next_step": {
            "action": "reject",
            "reasons": ["fp8@cal: ΔNLL +0.1", "76% of the loss is the backend's rounding"],
            "rounding_share": 0.76,
        },
    }
    kept = read_advice(_advice_file(tmp_path, doc))
    facts = advice_facts({"advice": kept})
    assert facts is not None
    assert (facts.action, facts.rounding_share, facts.backend_rounding) == ("reject", 0.76, "cpu")
    assert advice_facts({}) is None


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({"next_step": {"action": "maybe"}}, "next_step.action"),
        ([1, 2], "next_step.action"),
        ({"next_step": {"action": "reject", "reasons": "x"}}, "reasons list"),
        ({"next_step": {"action": "skip_layers", "skip_layers": [0, True]}}, "layer indices"),
    ],
)
def test_a_wrong_advice_file_is_named(tmp_path: Path, doc: Any, words: str) -> None:
    with pytest.raises(InputError, match=words):
        read_advice(_advice_file(tmp_path, doc))
