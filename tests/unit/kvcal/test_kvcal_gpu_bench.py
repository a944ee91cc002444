"""bench/kvcal_gpu.py's dry run on the CPU, end to end: the script a GPU machine runs, at its
quick size, on ``--device cpu``. Every kvcal step runs on both models with its times and
figures, the emulated CUDA rounding matches torch's own float8 cast value for value (and vLLM
CPU's truncation does not), no step imports vLLM, and what ``pack`` would carry is read off
the modules the steps imported."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.conftest import ROOT

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import _kvcal_gpu_figures as figures
import _kvcal_gpu_pack as pack
import kvcal_gpu

BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], str]:
    out = tmp_path_factory.mktemp("kvcal-gpu")
    cmd = [sys.executable, str(BENCH / "kvcal_gpu.py"), "run", "--device", "cpu", "--quick"]
    # The budget is the GPU machine's 8 minutes; a shared CPU may take longer, and here every
    # step must run (about 90 s on 2 idle cores).
    cmd += ["--budget-s", "1800", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=2400)
    written = out / "kvcal_gpu.json"
    doc = json.loads(written.read_text()) if written.is_file() else {}
    return done.returncode, doc, done.stderr


def test_every_step_ran_on_the_cpu_with_its_times(dry_run: tuple[int, dict[str, Any], str]) -> None:
    code, doc, stderr = dry_run
    assert code == 0, stderr[-3000:]
    c = doc["config"]
    assert (c["device"], c["devices"], c["size"]) == ("cpu", ["cpu"], "quick")
    ran = {(s["model"], s["step"]) for s in doc["steps"]}
    assert ran == {(m, s) for m in ("embedded", "twin") for s in ("calibrate", "emulate", "advise")}
    for s in doc["steps"]:
        where = f"{s['model']} {s['step']}"
        assert s["status"] == "ok" and s["exit_code"] == 0, where
        assert s["device"] == "cpu" and s["cuda_used"] is False, where
        assert s["wall_s"] > 0 and s["cpu_s"] > 0 and s["peak_rss_mib"] > 0, where
        assert s["command"].startswith(f"kvcal {s['step']} {s['model']} "), where
    assert doc["summary"] == {"steps_ok": True, "not_ok": [], "ran_elsewhere": [], "met": True}


def test_each_step_reports_its_own_figures(dry_run: tuple[int, dict[str, Any], str]) -> None:
    by = {(s["model"], s["step"]): s["figures"] for s in dry_run[1]["steps"]}
    for model in ("embedded", "twin"):
        cal = by[(model, "calibrate")]
        assert cal["tokens"] > 0 and len(cal["k_scales"]) == len(cal["v_scales"]) == 4
        emulated = by[(model, "emulate")]
        assert emulated["device"] == "cpu"
        assert set(emulated["nll_delta_all"]) == {
            f"fp8@{s} {r}" for s in ("1.0", "cal") for r in ("cpu", "cuda")
        }
        assert by[(model, "advise")]["next_step"]
    # the twin's keys are the embedded model's times a power of two, and so are their scales
    twin, embedded = (
        by[("twin", "calibrate")]["k_scales"],
        by[("embedded", "calibrate")]["k_scales"],
    )
    ratios = [t / e for t, e in zip(twin, embedded, strict=True)]
    assert all(r >= 2 and r == 2 ** round(math.log2(r)) for r in ratios), ratios


def test_the_emulated_cuda_rounding_is_torchs_cast_value_for_value(
    dry_run: tuple[int, dict[str, Any], str],
) -> None:
    r = dry_run[1]["rounding"]
    assert r["device"] == "cpu" and r["kinds"] == ["e4m3", "e5m2"]
    assert r["emulated_vs_cast"] == 0 and r["emulated_on_device_vs_cast"] == 0, r["rows"]
    bf16 = [row for row in r["rows"] if row["inputs"].startswith("bf16")]
    assert [row["values"] for row in bf16] == [65536 * len(r["scales"])] * 2
    # the comparison sees a rounding that is not the kernel's: truncation differs
    assert r["truncation_vs_cast"] > 0
    assert r["values"] == sum(row["values"] for row in r["rows"]) > 2_000_000


def test_no_step_imports_vllm_and_pack_carries_what_the_machine_lacks(
    dry_run: tuple[int, dict[str, Any], str],
) -> None:
    imports = dry_run[1]["imports"]
    assert imports["vllm_imported"] is False and "vllm" not in imports["modules"]
    carried = pack.to_carry(imports["modules"])
    assert {"click", "rich", "orjson", "pydantic", "pydantic-core", "jsonschema"} <= set(carried)
    assert not {"torch", "transformers", "numpy", "tokenizers", "safetensors", "vllm"} & set(
        carried
    )
    assert "--device cuda" in pack.device_command() and str(pack.CARRY) in pack.device_command()


def test_a_cpu_run_is_not_recorded_as_the_gpus(
    dry_run: tuple[int, dict[str, Any], str], tmp_path: Path
) -> None:
    path = tmp_path / "kvcal_gpu.json"
    path.write_text(json.dumps(dry_run[1]))
    before = kvcal_gpu.RESULTS.read_bytes() if kvcal_gpu.RESULTS.is_file() else None
    assert kvcal_gpu.main(["record", str(path)]) == kvcal_gpu.EXIT_INPUT
    after = kvcal_gpu.RESULTS.read_bytes() if kvcal_gpu.RESULTS.is_file() else None
    assert after == before


def test_a_gpu_run_renders_its_steps_beside_the_cpus(
    dry_run: tuple[int, dict[str, Any], str],
) -> None:
    """The dry run's steps, doubled as a GPU run's (half as long): the block and the table
    rows show both times and their ratio, and the rounding counts."""
    doc = copy.deepcopy(dry_run[1])
    doc["machine"]["gpu"], doc["machine"]["cuda"] = "Test GPU", "13.0"
    gpu = [{**s, "device": "cuda", "wall_s": s["wall_s"] / 2} for s in doc["steps"]]
    doc["steps"] += gpu
    text = figures.render(doc)
    assert "Measured on Test GPU" in text and "2.00x" in text
    first = doc["steps"][0]
    assert f"| embedded | calibrate | {first['wall_s'] / 2:.1f} | {first['wall_s']:.1f} |" in text
    rows = list(figures.rows(doc))
    assert len(rows) == 7 and rows[-1][1] == f"0 of {doc['rounding']['values']:,}"
    assert figures.render(None).startswith("Not yet recorded")


def test_a_step_past_the_budget_or_without_its_overlay_is_skipped(tmp_path: Path) -> None:
    from _kvcal_gpu_steps import plan, run_step

    calibrate, emulate, advise = plan(("embedded",), "cpu", "quick", tmp_path)
    assert run_step(calibrate, 0.0)["why"] == "over the run's time budget"
    for step in (emulate, advise):
        assert run_step(step, 60.0) == {
            "model": "embedded",
            "device": "cpu",
            "step": step.name,
            "command": step.shown,
            "status": "skipped",
            "why": "calibrate wrote no overlay",
        }
    assert "--overlay calibrated --device cpu" in emulate.shown
