"""Which K/V scales a server runs with, judged from real vLLM CPU 0.32 start-up logs.

The logs in tests/data/vllm_logs/ were recorded from FP8 servers on an AVX-512/AMX CPU: the
original model (scale 1.0) and its kvcal overlay. They let every machine, AVX2-only ones
included, check the logic that `kvcal verify` and the replay's serving-path check apply to a
live server's log there.
"""

from __future__ import annotations

import pytest

from kvcal._verify import APPLIED, NOT_APPLIED, ServerCheck, _decide, _from_log, compare_scores
from replay.analysis.schemas import TargetSummary
from replay.analysis.schemas.manifest import Manifest
from replay.analysis.verdict.serving_path import serving_problems
from replay.run.teacher import TFScore
from replay.serving.introspect import engine_config_from_log
from replay.serving.scale_log import (
    CHECKPOINT,
    DEFAULT_UNQUANTIZED,
    DEFAULT_WARNED,
    SCALE_ONE_WARNING,
    UNKNOWN,
    scale_evidence,
    scale_lines,
)
from tests.conftest import ROOT

LOGS = ROOT / "tests" / "data" / "vllm_logs"
ORIGINAL = (LOGS / "fp8_scale_one_original.log").read_text()
OVERLAY = (LOGS / "fp8_calibrated_overlay.log").read_text()
# Different scores, as the live comparison found (119 of 120 positions on the twin).
MOVED = compare_scores(
    [TFScore(3, (1.0, 2.5, 3.0), (True,) * 3)], [TFScore(3, (1.0, 2.0, 3.0), (True,) * 3)]
)


def test_the_original_at_scale_one_is_recognized_without_any_warning() -> None:
    ev = scale_evidence(ORIGINAL)
    # vLLM 0.32 logs no "Using KV cache scaling factor 1.0" for a checkpoint without a
    # quantization config: the engine line's quantization=None is what shows it.
    assert not ev.warning and SCALE_ONE_WARNING not in ORIGINAL
    assert ev.source == DEFAULT_UNQUANTIZED and ev.runs_at_scale_one is True
    assert ev.kv_cache_dtype == "fp8" and ev.quantization is None


def test_the_overlay_runs_with_its_checkpoint_scales() -> None:
    ev = scale_evidence(OVERLAY)
    assert ev.source == CHECKPOINT and ev.runs_at_scale_one is False
    assert ev.quantization == "compressed-tensors" and ev.kv_cache_dtype == "fp8"


def test_the_warning_wins_and_no_engine_line_is_unknown() -> None:
    warned = OVERLAY + "\nWARNING [kv_cache.py:163] Using KV cache scaling factor 1.0 for fp8_e4m3."
    assert scale_evidence(warned).source == DEFAULT_WARNED
    assert scale_evidence("INFO Started server process").source == UNKNOWN
    assert scale_evidence("").runs_at_scale_one is None


@pytest.mark.parametrize(("log", "status"), [(OVERLAY, APPLIED), (ORIGINAL, NOT_APPLIED)])
def test_verify_decides_from_the_recorded_logs(log: str, status: str) -> None:
    check = ServerCheck("calibrated", "MODEL-kvcal", cache_dtype="fp8")
    _from_log(check, log)
    got, reasons = _decide(check, MOVED, [])
    # A "calibrated" server whose engine has no quantization config runs at 1.0, whatever
    # the scores say (they may differ for another reason, e.g. batching).
    assert got == status, reasons
    if status == NOT_APPLIED:
        assert "quantization=None" in reasons[-1]


def test_the_replay_refuses_a_calibrated_target_that_runs_at_scale_one() -> None:
    served = TargetSummary.from_json({"status": "ok", "cache_dtype": "fp8"})

    def problems(name: str, log: str, calibrated: bool) -> list[str]:
        # What the runner keeps of a local server's log in the manifest.
        info = {"engine_config": engine_config_from_log(log), "scale_log_lines": scale_lines(log)}
        manifest = {"reference": "bf16", "targets": {"bf16": {}, name: info}}
        return serving_problems(name, served, Manifest.from_json(manifest), calibrated=calibrated)

    assert any("quantization=None" in p for p in problems("fp8-cal", ORIGINAL, True))
    assert problems("fp8-cal", OVERLAY, True) == []
    assert problems("fp8", ORIGINAL, False) == []  # the scale-1.0 arm is meant to run at 1.0
