"""The trained test model on real vLLM CPU servers: it does the tasks on held-out requests,
its outlier twin answers the same in BF16, and (where FP8 can be served) scale 1.0 breaks the
twin while calibrated scales restore it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from replay.serving.local_server import LocalServer
from replay.testmodel.heldout import served_accuracy
from replay.testmodel.tasks import BANDS, FAMILIES
from tests.conftest import ROOT, fp8_flags, url_targets

pytestmark = pytest.mark.vllm

HELDOUT = ROOT / "traces" / "testmodel_heldout.jsonl"
BUCKET_OF_BAND = {"short": "<256", "medium": "256-1K", "long": ">=1K"}
# The targets for BF16 greedy answers served by vLLM.
FAMILY_TARGET, BAND_TARGET = 0.90, 0.80


def replay_heldout(targets: str, out: Path, *extra: str) -> Path:
    """The held-out trace, one request at a time (greedy answers do not depend on batching)."""
    cmd = [
        sys.executable,
        "-m",
        "replay.cli",
        "--trace",
        str(HELDOUT),
        "--targets",
        targets,
        "--concurrency",
        "1",
        "--buckets",
        "256,1K",
        "--out",
        str(out),
        "--run-id",
        "run",
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    run_dir = out / "run"
    assert (run_dir / "grades.jsonl").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "grades.jsonl").read_text().splitlines()]


def test_trained_model_passes_heldout_tasks_and_twin_answers_identically(
    bf16_server: LocalServer, twin_server: LocalServer, model_dir: Path, tmp_path: Path
) -> None:
    run_dir = replay_heldout(
        f"bf16={bf16_server.url},twin={twin_server.url}", tmp_path, "--no-teacher-forced"
    )
    acc = served_accuracy(run_dir / "grades.jsonl", "bf16")
    assert acc["n"]["retrieval"] == 90 and acc["n"]["tool"] == acc["n"]["code"] == 30
    misses = {k: v for k, v in acc.items() if k in FAMILIES and v < FAMILY_TARGET}
    misses |= {
        f"retrieval/{BUCKET_OF_BAND[b]}": acc[f"retrieval/{BUCKET_OF_BAND[b]}"]
        for b in BANDS
        if acc[f"retrieval/{BUCKET_OF_BAND[b]}"] < BAND_TARGET
    }
    assert not misses, f"below target: {misses}"
    # What the manifest records is what a fresh server reproduces (up to one answer in 30:
    # another CPU's kernels may round one near-tie the other way).
    recorded = json.loads((model_dir / "kvcanary_model.json").read_text())["heldout_greedy_vllm"]
    drift = {
        k: (v, recorded.get(k))
        for k, v in acc.items()
        if k != "n" and abs(v - recorded.get(k, -1.0)) > 0.034
    }
    assert not drift, f"served accuracy (now, recorded) differs: {drift}"
    # The twin computes the same bits in BF16, so every greedy answer is identical.
    twin = [r for r in rows(run_dir) if r["target"] == "twin"]
    assert len(twin) == 150 and all(r["answered"] for r in twin)
    different = [r["request_id"] for r in twin if not r["agreement"]["exact"]]
    assert not different


# --- FP8: served where vLLM can serve an FP8 KV cache (AVX-512/AMX), emulated elsewhere -------


@pytest.fixture
def twin_servers(
    twin_server: LocalServer, twin_fp8_server: LocalServer, twin_cal_fp8_server: LocalServer
) -> dict[str, LocalServer]:
    """The twin in BF16, in FP8 at scale 1.0 and with kvcal's scales, by their target names."""
    return {"bf16": twin_server, "fp8": twin_fp8_server, "fp8-cal": twin_cal_fp8_server}


def _family_rates(run_dir: Path, target: str) -> dict[str, float]:
    acc = served_accuracy(run_dir / "grades.jsonl", target)
    return {f: acc[f] for f in FAMILIES}


@pytest.mark.fp8
def test_fp8_at_scale_one_on_the_original_is_within_aa_noise(
    bf16_server: LocalServer, fp8_server: LocalServer, tmp_path: Path
) -> None:
    targets = url_targets(tmp_path / "targets.toml", {"bf16": bf16_server, "fp8": fp8_server})
    run_dir = replay_heldout(
        "bf16,fp8", tmp_path, "--targets-file", str(targets), "--control", *fp8_flags()
    )
    bf16, ctrl = _family_rates(run_dir, "bf16"), _family_rates(run_dir, "bf16-control")
    fp8 = _family_rates(run_dir, "fp8")
    for fam in FAMILIES:
        noise = abs(bf16[fam] - ctrl[fam])
        assert abs(fp8[fam] - bf16[fam]) <= noise + 0.05, (fam, bf16, fp8, ctrl)


@pytest.mark.fp8
def test_fp8_at_scale_one_breaks_the_twin_and_calibration_restores_it(
    twin_servers: dict[str, LocalServer], tmp_path: Path
) -> None:
    """The whole story on one model: bf16 / fp8 at scale 1.0 / fp8 with kvcal's scales."""
    targets = url_targets(tmp_path / "targets.toml", twin_servers)
    run_dir = replay_heldout(
        "bf16,fp8,fp8-cal", tmp_path / "runs", "--targets-file", str(targets), *fp8_flags()
    )
    bf16 = _family_rates(run_dir, "bf16")
    fp8, cal = _family_rates(run_dir, "fp8"), _family_rates(run_dir, "fp8-cal")
    broken = [f for f in FAMILIES if bf16[f] - fp8[f] >= 0.30]
    assert len(broken) >= 2, (bf16, fp8)
    for fam in FAMILIES:
        assert bf16[fam] - cal[fam] <= 0.02, (fam, bf16, cal)


# --- the same story on traffic without labels (derived grades, the A/A control) -------------


def unlabeled_first_run(out: Path) -> Path:
    """The first-run trace with every check and task removed, as production traffic comes."""
    with out.open("w") as fh:
        for line in (ROOT / "traces" / "first_run.jsonl").read_text().splitlines():
            rec = json.loads(line)
            rec.pop("check", None)
            rec.pop("task", None)
            fh.write(json.dumps(rec) + "\n")
    return out


def canary_unlabeled(servers: dict[str, LocalServer], tmp_path: Path) -> dict[str, Any]:
    trace = unlabeled_first_run(tmp_path / "unlabeled.jsonl")
    targets = url_targets(tmp_path / "targets.toml", servers)
    cmd = [
        sys.executable,
        "-m",
        "replay.cli",
        "canary",
        "--trace",
        str(trace),
        "--targets-file",
        str(targets),
        "--targets",
        ",".join(servers),
        "--buckets",
        "256,1K",
        "--no-teacher-forced",
        "--out",
        str(tmp_path),
        "--run-id",
        "run",
        *fp8_flags(),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    summary = tmp_path / "run" / "summary.json"
    assert summary.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(json.loads(summary.read_text()))


def _combined(summary: dict[str, Any], target: str) -> dict[str, dict[str, Any]]:
    (phase,) = summary["quality"]["phases"].values()
    return {b: row["combined"] for b, row in phase[target]["buckets"].items()}


@pytest.mark.fp8
def test_unlabeled_twin_loses_at_scale_one_and_its_calibration_matches(
    twin_servers: dict[str, LocalServer], tmp_path: Path
) -> None:
    summary = canary_unlabeled(twin_servers, tmp_path)
    assert "bf16-control" in summary["targets"]
    broken = _combined(summary, "fp8")
    assert all(c["derived"] == c["pairs"] for c in broken.values())
    assert sum(c["evidence"]["status"] == "loss" for c in broken.values()) >= 2, broken
    fixed = _combined(summary, "fp8-cal")
    assert all(c["evidence"]["status"] == "equivalent" for c in fixed.values()), fixed
    verdict = summary["verdict"]
    assert verdict["verdict"] == "calibrate", verdict
    assert "fp8-cal matches bf16 in every bucket" in verdict["headline"]


@pytest.mark.fp8
def test_unlabeled_original_shows_no_loss_at_scale_one(
    bf16_server: LocalServer, fp8_server: LocalServer, tmp_path: Path
) -> None:
    summary = canary_unlabeled({"bf16": bf16_server, "fp8": fp8_server}, tmp_path)
    for bucket, c in _combined(summary, "fp8").items():
        assert c["derived"] == c["pairs"] >= 59, (bucket, c)
        assert c["evidence"]["status"] == "equivalent", (bucket, c)
    assert summary["verdict"]["verdict"] in ("keep", "reject"), summary["verdict"]
    assert not any("loss" in r for r in summary["verdict"]["reasons"])
