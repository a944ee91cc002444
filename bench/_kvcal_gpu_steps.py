"""The kvcal commands ``bench/kvcal_gpu.py`` times: ``calibrate``, ``emulate --rounding both``
and ``advise`` on the embedded model and its outlier twin, each in a process of its own.

A step is the command as a user runs it (``python -m kvcal.cli``, the repository on the path,
as on a machine where kvcanary is not installed), with vLLM hidden (``sys.modules["vllm"] =
None``): the GPU machine has no vLLM, and where one is installed the path must still be the
one taken there (kvcal asks vLLM only whether its backend takes per-head scales, and answers
"unknown" without it). The child records, as it exits, the top-level modules it imported
(what ``pack`` carries), whether it used CUDA, its peak RSS and CPU time, and the GPU memory
it peaked at. ``calibrate`` has no ``--device``: it takes the GPU when torch sees one, so the
CPU steps run with ``CUDA_VISIBLE_DEVICES`` empty, and the record says which one ran.
A step that fails or runs out of time is a result (its exit code and the end of its output),
and the steps that needed its overlay are recorded as skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CAL_TRACE = "traces/sample.jsonl"
EVAL_TRACE = "traces/testmodel_heldout.jsonl"
MODELS = ("embedded", "twin")
STEPS = ("calibrate", "emulate", "advise")

# Sizes: "quick" for the dry run in the tests (every step and both models, a request or two a
# bucket), "full" for a GPU machine (sized to finish well inside its 8 minutes, CPU beside).
SIZES: dict[str, dict[str, int]] = {
    "quick": {"cal_per_bucket": 1, "per_bucket": 1, "new_tokens": 4, "greedy": 1, "skip": 1},
    "full": {"cal_per_bucket": 8, "per_bucket": 8, "new_tokens": 24, "greedy": 2, "skip": 4},
}

CHILD = """
import atexit, json, resource, sys
sys.modules["vllm"] = None  # as on the GPU machine: no vLLM
record = sys.argv.pop(1)

def _record():
    torch = sys.modules.get("torch")
    cuda = bool(torch is not None and torch.cuda.is_initialized())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    doc = {
        "modules": sorted({n.split(".")[0] for n, m in list(sys.modules.items()) if m}),
        "cuda_used": cuda,
        "gpu_peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "cpu_s": usage.ru_utime + usage.ru_stime,
    }
    with open(record, "w") as fh:
        json.dump(doc, fh)

atexit.register(_record)
from kvcal.cli import main
sys.argv[0] = "kvcal"
main()
"""


@dataclass(frozen=True, slots=True)
class Step:
    """One kvcal command on one model and device, and where it writes."""

    model: str
    device: str
    name: str
    args: tuple[str, ...]
    report: Path  # the JSON the command writes, read for its figures
    record: Path  # what the child process records of itself as it exits
    needs: Path | None = None  # the overlay an earlier step writes
    shown: str = ""  # the command as a user would type it, the bench's folders left out


def plan(models: tuple[str, ...], device: str, size: str, work: Path) -> list[Step]:
    """calibrate, emulate and advise for each model on ``device``, at ``size``."""
    z = {k: str(v) for k, v in SIZES[size].items()}
    steps = []
    for model in models:
        here = work / device / model
        cal = here / "calibrated"
        calibrate = ["calibrate", model, "--trace", CAL_TRACE, "--buckets", "256,1K"]
        calibrate += ["--per-bucket", z["cal_per_bucket"], "-o", str(cal)]
        common = ["--trace", EVAL_TRACE, "--buckets", "128,512", "--per-bucket", z["per_bucket"]]
        common += ["--max-new-tokens", z["new_tokens"], "--overlay", str(cal), "--device", device]
        emulate = ["emulate", model, *common, "--rounding", "both"]
        emulate += ["--greedy-sample", z["greedy"], "--json", str(here / "emulate.json")]
        advise = ["advise", model, *common, "--skip-candidates", z["skip"]]
        advise += ["--json", str(here / "advise.json")]
        for name, args, report, needs in (
            ("calibrate", calibrate, cal / "kvcal_report.json", None),
            ("emulate", emulate, here / "emulate.json", cal),
            ("advise", advise, here / "advise.json", cal),
        ):
            shown = " ".join(["kvcal", *args]).replace(str(here) + os.sep, "")
            record = here / f"{name}.child.json"
            steps.append(Step(model, device, name, tuple(args), report, record, needs, shown))
    return steps


def child_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # calibrate takes the GPU whenever torch sees one
    return env


def run_step(step: Step, timeout_s: float) -> dict[str, Any]:
    """Run one step; what it took and what it reported, or why it did not finish."""
    row: dict[str, Any] = {
        "model": step.model,
        "device": step.device,
        "step": step.name,
        "command": step.shown,
    }
    if step.needs is not None and not (step.needs / "kvcal_report.json").is_file():
        return {**row, "status": "skipped", "why": "calibrate wrote no overlay"}
    if timeout_s <= 0:
        return {**row, "status": "skipped", "why": "over the run's time budget"}
    step.record.parent.mkdir(parents=True, exist_ok=True)
    record = step.record
    cmd = [sys.executable, "-c", CHILD, str(record), *step.args]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=child_env(step.device), capture_output=True, text=True,
            timeout=timeout_s, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-2000:]
        text = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {**row, "status": "timed_out", "wall_s": time.perf_counter() - start, "tail": text}
    row["wall_s"] = time.perf_counter() - start
    row["exit_code"] = done.returncode
    if record.is_file():
        row.update(json.loads(record.read_text(encoding="utf-8")))
    if done.returncode != 0 or not step.report.is_file():
        return {**row, "status": "failed", "tail": (done.stderr or done.stdout)[-2000:]}
    report = json.loads(step.report.read_text(encoding="utf-8"))
    return {**row, "status": "ok", "figures": FIGURES[step.name](report)}


def _calibrate_figures(report: dict[str, Any]) -> dict[str, Any]:
    return {
        "tokens": report["tokens"],
        "tokens_per_second": report["tokens_per_second"],
        "observe_s": report["observe_seconds"],
        "k_scales": [t["scale"] for t in report["tensors"] if t["which"] == "k"],
        "v_scales": [t["scale"] for t in report["tensors"] if t["which"] == "v"],
    }


def _emulate_figures(report: dict[str, Any]) -> dict[str, Any]:
    return {
        "device": report["device"],
        "seconds": report["seconds"],
        "nll_delta_all": {
            r["setting"]: r["nll_delta_mean"] for r in report["results"] if r["bucket"] == "all"
        },
    }


def _advise_figures(report: dict[str, Any]) -> dict[str, Any]:
    return {"seconds": report["seconds"], "next_step": report["next_step"]["action"]}


FIGURES = {
    "calibrate": _calibrate_figures,
    "emulate": _emulate_figures,
    "advise": _advise_figures,
}
