"""Emulated FP8 (kvcal's plugin in a BF16 server) against served FP8, on the same tokens.

One replay with seven targets: the BF16 reference, and for the original, the outlier twin and
the twin's kvcal overlay, a served FP8 server and an emulated one. The teacher-forced scores
of the reference's answers are compared position by position and per bucket. Only where
vLLM can serve FP8: elsewhere there is nothing served to compare with (the other FP8 tests
run against emulation there). bench/kvcal_formats.py records the figures docs/kvcal.md shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from replay.serving.local_server import LocalServer
from replay.serving.targets import DEFAULT_MODEL_ARGS, EMULATED_FP8
from tests.conftest import ROOT, cpu_can_serve_fp8_kv, fp8_emulated, url_target

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.fp8,
    pytest.mark.skipif(
        not cpu_can_serve_fp8_kv(),
        reason="needs served FP8 to compare with: this CPU has neither AVX-512 nor AMX",
    ),
]

HELDOUT = ROOT / "traces" / "testmodel_heldout.jsonl"
PAIRS = {"fp8": "fp8-emu", "twin-fp8": "twin-fp8-emu", "cal-fp8": "cal-fp8-emu"}
# Emulation matches the stored bytes exactly; attention reads them back through different
# kernels (fp8 dequantization vs a bf16 cache), about one bf16 step per position. Measured
# on this test's run: per-bucket dNLL within 0.007 nat/token of the served value.
DNLL_TOLERANCE = 0.03
# The arms the session's servers serve (served FP8, where the session's FP8 is not emulated).
SHARED_ARMS = {
    "bf16": "bf16_server",
    "fp8": "fp8_server",
    "twin-fp8": "twin_fp8_server",
    "cal-fp8": "twin_cal_fp8_server",
}
# Asked for at run time (run_dir): named here so that each stops after its last user.
pytestmark.append(pytest.mark.uses_servers(*SHARED_ARMS.values()))


def _targets_file(
    path: Path, model: Path, twin: Path, overlay: Path, shared: Mapping[str, LocalServer]
) -> Path:
    lines = []
    arms = [
        ("bf16", model, "auto"),
        ("fp8", model, "fp8"),
        ("fp8-emu", model, EMULATED_FP8),
        ("twin-fp8", twin, "fp8"),
        ("twin-fp8-emu", twin, EMULATED_FP8),
        ("cal-fp8", overlay, "fp8"),
        ("cal-fp8-emu", overlay, EMULATED_FP8),
    ]
    for name, folder, dtype in arms:
        role = "reference" if name == "bf16" else None
        if name in shared:
            lines += url_target(name, shared[name], role)
            continue
        lines += [
            f"[targets.{name}]",
            f"model = {json.dumps(str(folder))}",
            f"kv_cache_dtype = {json.dumps(dtype)}",
            f"args = {json.dumps(list(DEFAULT_MODEL_ARGS))}",
            *([f'role = "{role}"'] if role else []),
            "",
        ]
    path.write_text("\n".join(lines))
    return path


@pytest.fixture(scope="module")
def run_dir(
    model_dir: Path,
    twin_dir: Path,
    twin_overlay: Path,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Path:
    tmp = tmp_path_factory.mktemp("emulation")
    # The emulated arms are this test's own servers; the others are the session's, unless
    # the session's FP8 is emulated (KVCANARY_TEST_FP8): then this test serves FP8 itself.
    shared = (
        {}
        if fp8_emulated()
        else {name: request.getfixturevalue(f) for name, f in SHARED_ARMS.items()}
    )
    targets = _targets_file(tmp / "targets.toml", model_dir, twin_dir, twin_overlay, shared)
    cmd = [
        sys.executable,
        "-m",
        "replay.cli",
        "--trace",
        str(HELDOUT),
        "--targets-file",
        str(targets),
        "--targets",
        ",".join(["bf16", *PAIRS, *PAIRS.values()]),
        "--buckets",
        "256,1K",
        "--concurrency",
        "4",
        "--limit",
        "60",
        "--out",
        str(tmp),
        "--run-id",
        "run",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    out = tmp / "run"
    assert (out / "teacher_forced.jsonl").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _scores(run_dir: Path) -> dict[str, dict[str, dict[str, Any]]]:
    by: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for line in (run_dir / "teacher_forced.jsonl").read_text().splitlines():
        row = json.loads(line)
        by[row["target"]][row["request_id"]] = row
    return by


def _bucket_dnll(run_dir: Path, target: str) -> dict[str, float]:
    summary = json.loads((run_dir / "summary.json").read_text())
    (phase,) = summary["quality"]["phases"].values()
    return {
        b: row["teacher_forced"]["nll_delta_mean"] for b, row in phase[target]["buckets"].items()
    }


@pytest.mark.parametrize("served", list(PAIRS))
def test_emulated_scores_match_served_fp8(run_dir: Path, served: str) -> None:
    emulated = PAIRS[served]
    by = _scores(run_dir)
    a: list[float] = []
    b: list[float] = []
    for rid, row in by[served].items():
        other = by[emulated].get(rid)
        assert other is not None and not row["error"] and not other["error"], rid
        assert row["n"] == other["n"]
        a += row["nll"]
        b += other["nll"]
    assert len(a) >= 200
    assert np.corrcoef(a, b)[0, 1] >= 0.99
    served_d, emulated_d = _bucket_dnll(run_dir, served), _bucket_dnll(run_dir, emulated)
    assert set(served_d) == set(emulated_d) == {"<256", "256-1K"}
    for bucket, d in served_d.items():
        assert abs(emulated_d[bucket] - d) <= DNLL_TOLERANCE, (bucket, d, emulated_d[bucket])
    if served == "twin-fp8":  # the loss that emulation exists to predict
        assert min(served_d.values()) > 0.5 and min(emulated_d.values()) > 0.5
    else:  # the original at scale 1.0, and the twin with its calibrated scales: no loss
        assert max(abs(d) for d in [*served_d.values(), *emulated_d.values()]) <= 0.02


def test_emulated_targets_say_so(run_dir: Path) -> None:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    for name in PAIRS.values():
        info = manifest["targets"][name]
        assert info["cache_config"]["cache_dtype"] in ("auto", "bfloat16")
        assert int(info["cache_config"]["kv_cache_size_tokens"]) == int(
            manifest["targets"]["bf16"]["cache_config"]["kv_cache_size_tokens"]
        )
        assert any(
            "kvcanary kv emulation: active [fp8, cpu rounding]" in ln
            for ln in info["scale_log_lines"]
        )
    cal_lines = manifest["targets"]["cal-fp8-emu"]["scale_log_lines"]
    assert any("(checkpoint)" in ln for ln in cal_lines)
