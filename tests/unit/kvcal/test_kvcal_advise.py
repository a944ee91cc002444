"""kvcal advise without a server: on the outlier twin, which loses at scale 1.0, it scores both
roundings, ranks the layers, confirms a set to keep in BF16 and advises it, from the same
emulation ``kvcal emulate`` runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from click.testing import CliRunner

from kvcal.cli import main
from tests.conftest import ROOT

TRACE = ROOT / "traces" / "testmodel_heldout.jsonl"
ARGS = ["--trace", str(TRACE), "--buckets", "128,512", "--per-bucket", "2"]


@pytest.fixture(scope="module")
def twin_advice(twin_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("advise") / "advice.json"
    res = CliRunner().invoke(
        main, ["advise", str(twin_dir), *ARGS, "--max-new-tokens", "16", "--json", str(out)]
    )
    assert res.exit_code == 0, res.output
    doc: dict[str, Any] = json.loads(out.read_text())
    doc["_output"] = " ".join(res.output.split())
    return doc


def test_advise_keeps_the_layers_that_recover_the_twins_loss(twin_advice: dict[str, Any]) -> None:
    # --rounding engine: FP8 on vLLM CPU truncates; the other rounding is scored beside it
    assert twin_advice["backend_rounding"] == "cpu"
    rows = {r["setting"]: r for r in twin_advice["settings"]}
    assert set(rows) == {"fp8@1.0", "fp8@1.0/cuda"}
    assert rows["fp8@1.0/cuda"]["rounding"] == "cuda"
    assert rows["fp8@1.0"]["all"]["nll_delta_lo"] > 0.1  # the twin's outliers lose
    ranking = twin_advice["ranking"]
    assert sorted(r["layer"] for r in ranking) == list(range(twin_advice["layers"]))
    assert ranking == sorted(ranking, key=lambda r: -r["recovered"])
    skip = twin_advice["skip"]
    assert skip["reached"] and skip["tries"][-1]["skip_layers"] == skip["skip_layers"]
    step = twin_advice["next_step"]
    assert step["action"] == "skip_layers" and step["skip_layers"] == skip["skip_layers"]
    assert step["flag"] == "--kv-cache-dtype-skip-layers " + " ".join(map(str, skip["skip_layers"]))
    assert 0 <= step["rounding_share"] <= 1
    assert "--skip-layers fp8-skip=" in twin_advice["_output"]


def test_advise_refuses_both_roundings_and_emulates_fp8_only(twin_dir: Path) -> None:
    res = CliRunner().invoke(main, ["advise", str(twin_dir), *ARGS, "--rounding", "both"])
    assert res.exit_code != 0 and "advise scores both roundings already" in res.output
    res = CliRunner().invoke(main, ["advise", str(twin_dir), *ARGS, "--formats", "nvfp4"])
    assert res.exit_code != 0 and "No such option '--formats'" in res.output
