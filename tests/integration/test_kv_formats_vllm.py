"""Every KV format on real vLLM CPU servers: each emulated format in a BF16 server (kvcal's
plugin), fp8_e5m2 served beside its emulation, and the canary deciding several candidates.

1. One replay on the outlier twin (keys past E4M3's range at scale 1.0) with the BF16
   reference, fp8_e5m2 served, and every other emulated format, each in its own BF16 server:
   each server logs the plugin's line with its format, stores BF16, and scores the
   reference's answers differently from BF16 (the rounding acts); the emulated fp8_e5m2
   scores as the served one does.
2. ``replay canary --targets bf16,fp8,fp8_e5m2`` on the embedded model, both FP8 formats
   served: each candidate decided, at alpha / 2, with twice the reference's cache.

Served FP8 needs AVX-512 or AMX; bench/kvcal_formats.py records the figures docs/kvcal.md shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import ROOT, cpu_can_serve_fp8_kv

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.fp8,
    pytest.mark.skipif(
        not cpu_can_serve_fp8_kv(), reason="vLLM CPU serves FP8 only with AVX-512 or AMX"
    ),
]

HELDOUT = ROOT / "traces" / "testmodel_heldout.jsonl"
EMULATED = (
    "fp8_e5m2",
    "int8_per_token_head",
    "fp8_per_token_head",
    "int4_per_token_head",
    "nvfp4",
    "nvfp4_4over6",
)
ROUNDING = {"fp8_e5m2": "cpu"}  # the engine's: vLLM CPU serves FP8; CUDA the others
DNLL_TOLERANCE = 0.03  # as the E4M3 emulation's (tests/integration/test_fp8_emulation_vllm.py)


def _replay(tmp: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    cmd = [sys.executable, "-m", "replay.cli", *args, "--out", str(tmp), "--run-id", "run"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    return proc, tmp / "run"


@pytest.fixture(scope="module")
def formats_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every third held-out request (50: every family and length band) on the twin."""
    tmp = tmp_path_factory.mktemp("formats")
    trace = tmp / "every_third.jsonl"
    lines = HELDOUT.read_text().splitlines()
    trace.write_text("".join(line + "\n" for line in lines[::3]))
    targets = ["bf16", "fp8_e5m2", *(f"{f}-emulated" for f in EMULATED if f != "fp8_e5m2")]
    targets.insert(2, "fp8_e5m2-emulated")
    proc, run = _replay(
        tmp,
        "--model",
        "twin",
        "--trace",
        str(trace),
        "--targets",
        ",".join(targets),
        "--buckets",
        "256,1K",
        "--concurrency",
        "4",
    )
    assert (run / "summary.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _scores(run: Path) -> dict[str, dict[str, list[float]]]:
    by: dict[str, dict[str, list[float]]] = defaultdict(dict)
    for line in (run / "teacher_forced.jsonl").read_text().splitlines():
        row = json.loads(line)
        assert not row["error"], row
        by[row["target"]][row["request_id"]] = row["nll"]
    return by


def _bucket_dnll(summary: dict[str, Any], target: str) -> dict[str, float]:
    (phase,) = summary["quality"]["phases"].values()
    return {
        b: row["teacher_forced"]["nll_delta_mean"] for b, row in phase[target]["buckets"].items()
    }


def test_each_emulated_format_runs_in_a_bf16_server(formats_run: Path) -> None:
    manifest, summary = _json(formats_run / "manifest.json"), _json(formats_run / "summary.json")
    bf16 = manifest["targets"]["bf16"]["cache_config"]
    for fmt in EMULATED:
        name = f"{fmt}-emulated"
        info = manifest["targets"][name]
        assert info["status"] == "ok" and not info.get("problems"), (name, info.get("problems"))
        assert info["cache_config"]["cache_dtype"] in ("auto", "bfloat16"), name
        assert info["cache_config"]["kv_cache_size_tokens"] == bf16["kv_cache_size_tokens"]
        marker = f"kvcanary kv emulation: active [{fmt}, {ROUNDING.get(fmt, 'cuda')} rounding]"
        assert any(marker in ln for ln in info["scale_log_lines"]), (name, info["scale_log_lines"])
        # no rollout decision on an emulated cache, said in its format's words
        verdict = summary["candidates"][name]
        assert verdict["verdict"] == "emulated", verdict
        assert verdict["headline"].startswith(f"NO VERDICT ON EMULATED {fmt}")


def test_the_rounding_acts_in_every_emulated_server(formats_run: Path) -> None:
    """The reference's answers score differently under each emulated cache than under BF16
    (the twin's answers are nearly certain, so by little on most positions)."""
    by = _scores(formats_run)
    for fmt in EMULATED:
        name = f"{fmt}-emulated"
        diffs = [
            abs(a - b)
            for rid, nll in by[name].items()
            for a, b in zip(nll, by["bf16"][rid], strict=True)
        ]
        assert len(diffs) >= 200 and sum(d > 1e-6 for d in diffs) >= 5, (name, max(diffs))


def test_emulated_e5m2_scores_as_the_served_one(formats_run: Path) -> None:
    manifest, summary = _json(formats_run / "manifest.json"), _json(formats_run / "summary.json")
    served = manifest["targets"]["fp8_e5m2"]["cache_config"]
    assert served["cache_dtype"] == "fp8_e5m2"
    bf16 = manifest["targets"]["bf16"]["cache_config"]
    assert int(served["kv_cache_size_tokens"]) == 2 * int(bf16["kv_cache_size_tokens"])
    by = _scores(formats_run)
    a = [x for rid, nll in by["fp8_e5m2"].items() for x in nll]
    b = [x for rid in by["fp8_e5m2"] for x in by["fp8_e5m2-emulated"][rid]]
    assert np.corrcoef(a, b)[0, 1] >= 0.99
    served_d = _bucket_dnll(summary, "fp8_e5m2")
    emulated_d = _bucket_dnll(summary, "fp8_e5m2-emulated")
    for bucket, d in served_d.items():
        assert abs(emulated_d[bucket] - d) <= DNLL_TOLERANCE, (bucket, d, emulated_d[bucket])


def test_canary_decides_each_served_fp8_format(tmp_path: Path) -> None:
    proc, run = _replay(
        tmp_path,
        "canary",
        "--trace",
        str(HELDOUT),
        "--targets",
        "bf16,fp8,fp8_e5m2",
        "--buckets",
        "256,1K",
        "--concurrency",
        "4",
        # What each format holds is read from its server (below); the capacity phase, which
        # restarts the servers to fill them, has its own test (test_capacity_vllm).
        "--no-capacity-phase",
    )
    summary, manifest = _json(run / "summary.json"), _json(run / "manifest.json")
    verdicts = summary["candidates"]
    assert list(verdicts) == ["fp8", "fp8_e5m2"]
    assert proc.returncode == summary["verdict"]["exit_code"] == verdicts["fp8"]["exit_code"]
    assert summary["verdict"] == verdicts["fp8"]
    for name, v in verdicts.items():
        # decided on its evidence (on this CPU a match can still be rejected for speed), never
        # for its serving path: each server runs its own format
        assert v["verdict"] != "emulated" and v["reasons"], (name, v["headline"])
        assert not [e for e in v["evidence"] if e["kind"] == "serving"], v["evidence"]
        notes = [e["text"] for e in v["evidence"] if e["kind"] == "multiplicity"]
        assert notes and "each decided at alpha 0.025" in notes[0], v["evidence"]
        cache = manifest["targets"][name]["cache_config"]
        ref = manifest["targets"]["bf16"]["cache_config"]
        assert int(cache["kv_cache_size_tokens"]) == 2 * int(ref["kv_cache_size_tokens"])
        assert f"candidate {name}: {v['verdict']} (exit {v['exit_code']})" in proc.stderr
    kind = verdicts["fp8_e5m2"]["verdict"]
    title = {
        "keep": "KEEP fp8_e5m2",
        "calibrate": "CALIBRATE fp8_e5m2",
        "reject": "REJECT fp8_e5m2",
    }
    assert verdicts["fp8_e5m2"]["headline"].startswith(title.get(kind, kind.upper()[:5]))
    assert "### Every candidate" in proc.stdout
