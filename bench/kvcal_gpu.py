"""kvcal on a GPU: ``kvcal calibrate``, ``emulate --rounding both`` and ``advise`` on the
embedded model and its outlier twin with ``--device cuda``, timed beside the same machine's
CPU, and kvcal's emulated CUDA rounding checked against torch's own float8 cast on the GPU,
value for value.

    python bench/kvcal_gpu.py pack                     # here: the wheels to carry, the command
    python bench/kvcal_gpu.py run --device cuda --out DIR   # there (what pack prints)
    python bench/kvcal_gpu.py run --device cpu --quick --out DIR  # the dry run (the tests')
    python bench/kvcal_gpu.py record FILE              # keep a GPU run's results; README block
    python bench/kvcal_gpu.py render [--check]         # only the README block

``run`` writes ``DIR/kvcal_gpu.json``: the machine (GPU, CUDA, versions), each step's wall and
CPU time, peak RSS and GPU memory, whether it used CUDA, and a few of its figures (scales,
ΔNLL per setting, the advice) to compare across devices; the rounding counts; the modules the
steps imported. Exit 0 when every step ran and the emulation matched the cast everywhere, 1
otherwise (the file is written either way). ``--device cuda`` runs the steps on the GPU, then
on the CPU beside it (``--no-cpu`` leaves that out); ``--device cpu`` runs them on the CPU
only. The whole run keeps to ``--budget-s`` (420: the GPU machine's command may take 8 minutes,
the install of the wheels included); a step that would start past it is recorded as skipped.

``pack`` runs the dry run (or reads ``--from FILE``, one's results) to learn what kvcal
imports, downloads the wheels the GPU machine lacks into ``bench/.kvcal_gpu/`` (git-ignored;
``_kvcal_gpu_pack``), checks that they and the working tree fit in 64 MiB, and prints the carry
list and the command.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

import _blocks  # noqa: E402
import _kvcal_gpu_figures as figures  # noqa: E402
import _kvcal_gpu_pack as pack  # noqa: E402
from _kvcal_gpu_steps import MODELS, STEPS, plan, run_step  # noqa: E402
from _machine import describe  # noqa: E402

RESULTS = BENCH / "results" / "kvcal_gpu.json"
README = BENCH / "README.md"
NAME = "kvcal_gpu.json"
RANDOM_VALUES = {"quick": 1 << 16, "full": 1 << 20}
EXIT_OK, EXIT_FAILED, EXIT_INPUT = 0, 1, 2


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def machine(device: str) -> dict[str, Any]:
    """describe()'s machine, with the GPU and the CUDA torch was built with."""
    import torch

    m: dict[str, Any] = describe(("torch", "transformers"))
    m["cuda"] = torch.version.cuda
    m["gpu"] = torch.cuda.get_device_name() if device == "cuda" else None
    m["torch_threads"] = torch.get_num_threads()
    return m


def prepare_models() -> dict[str, float]:
    """Each model ready before any step is timed (the twin is derived on first use)."""
    from replay.testmodel.named import resolve_model

    took = {}
    for name in MODELS:
        start = time.perf_counter()
        resolve_model(name, "bench/kvcal_gpu.py")
        took[name] = time.perf_counter() - start
    return took


def run_steps(device: str, size: str, work: Path, deadline: float) -> list[dict[str, Any]]:
    rows = []
    for step in plan(MODELS, device, size, work):
        rows.append(run_step(step, deadline - time.perf_counter()))
        r = rows[-1]
        took = f"{r['wall_s']:.1f} s" if "wall_s" in r else r.get("why", "")
        _say(f"{device} {step.model} {step.name}: {r['status']} {took}")
    return rows


def summarize(steps: list[dict[str, Any]], rounding: dict[str, Any]) -> dict[str, Any]:
    """Did every step run, on the device it was meant for, and did the rounding match?"""

    def name(s: dict[str, Any]) -> str:
        return f"{s['device']} {s['model']} {s['step']}"

    not_ok = [f"{name(s)}: {s['status']}" for s in steps if s["status"] != "ok"]
    elsewhere = [
        name(s)
        for s in steps
        if s["status"] == "ok" and s.get("cuda_used") != (s["device"] == "cuda")
    ]
    return {
        "steps_ok": not not_ok,
        "not_ok": not_ok,
        "ran_elsewhere": elsewhere,
        "met": not not_ok
        and not elsewhere
        and rounding["emulated_vs_cast"] == rounding["emulated_on_device_vs_cast"] == 0,
    }


def _outside(modules: set[str]) -> list[str]:
    """The top-level modules that come from outside the standard library (what pack reads)."""
    return sorted(m for m in modules if m not in sys.stdlib_module_names and m[0] != "_")


def _own_modules() -> set[str]:
    return {name.split(".")[0] for name, m in list(sys.modules.items()) if m is not None}


def run(args: argparse.Namespace) -> int:
    sys.modules["vllm"] = None  # type: ignore[assignment]  # as on the GPU machine: no vLLM
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        _say("--device cuda: torch sees no CUDA device here (the dry run is --device cpu)")
        return EXIT_INPUT
    size = "quick" if args.quick else "full"
    start = time.perf_counter()
    deadline = start + args.budget_s
    doc: dict[str, Any] = {"bench": "kvcal_gpu", "machine": machine(args.device)}
    devices = [args.device] + (["cpu"] if args.device == "cuda" and args.cpu else [])
    doc["config"] = {
        "device": args.device,
        "devices": devices,
        "size": size,
        "models": list(MODELS),
        "steps": list(STEPS),
        "budget_s": args.budget_s,
    }
    doc["prepare_models_s"] = prepare_models()
    from _kvcal_gpu_rounding import compare

    doc["rounding"] = compare(args.device, RANDOM_VALUES[size], progress=_say)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="kvcal-gpu-"))
    try:
        doc["steps"] = [
            row for device in devices for row in run_steps(device, size, work, deadline)
        ]
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    modules = {m for s in doc["steps"] for m in s.pop("modules", [])} | _own_modules()
    doc["imports"] = {"modules": _outside(modules), "vllm_imported": "vllm" in modules}
    doc["summary"] = summarize(doc["steps"], doc["rounding"])
    doc["wall_s"] = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / NAME).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    _say(f"wrote {out / NAME} ({doc['wall_s']:.0f} s; met: {doc['summary']['met']})")
    return EXIT_OK if doc["summary"]["met"] else EXIT_FAILED


def do_pack(args: argparse.Namespace) -> int:
    if args.results is None:
        with tempfile.TemporaryDirectory() as tmp:
            dry = [sys.executable, __file__, "run", "--device", "cpu", "--quick", "--out", tmp]
            _say("the dry run, to learn what kvcal imports: " + " ".join(dry[1:]))
            subprocess.run(dry, check=True)
            doc = json.loads((Path(tmp) / NAME).read_text(encoding="utf-8"))
    else:
        doc = json.loads(Path(args.results).read_text(encoding="utf-8"))
    carried = pack.to_carry(doc["imports"]["modules"], args.python)
    dest = ROOT / pack.CARRY
    wheels = pack.download(carried, dest, args.python)
    carry_bytes = sum(w.stat().st_size for w in wheels)
    total = pack.tree_bytes() + carry_bytes
    manifest = {"python": args.python, "carried": carried, "wheels": [w.name for w in wheels]}
    manifest["bytes"] = {"wheels": carry_bytes, "with_the_tree": total}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    print(f"carried: {', '.join(f'{n}=={v}' for n, v in carried.items())}")
    print(f"wheels {carry_bytes / 2**20:.1f} MiB; with the working tree {total / 2**20:.1f} MiB")
    if total > pack.LIMIT_BYTES:
        _say(f"over the {pack.LIMIT_BYTES // 2**20} MiB a device call carries")
        return EXIT_FAILED
    print(f'carry: ["{pack.CARRY}"]')
    print(f"command: {pack.device_command()}")
    return EXIT_OK


def committed() -> dict[str, Any] | None:
    return json.loads(RESULTS.read_text(encoding="utf-8")) if RESULTS.is_file() else None


def readme_text(doc: dict[str, Any] | None) -> str:
    text = README.read_text(encoding="utf-8")
    return _blocks.rewrite(text, figures.BEGIN, figures.END, figures.render(doc), README)


def record(args: argparse.Namespace) -> int:
    """Keep a GPU run's results and regenerate the README's blocks from them."""
    doc = json.loads(Path(args.file).read_text(encoding="utf-8"))
    if doc.get("bench") != "kvcal_gpu" or doc["config"]["device"] != "cuda":
        _say(f"{args.file}: not a `kvcal_gpu.py run --device cuda` results file")
        return EXIT_INPUT
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    README.write_text(readme_text(doc), encoding="utf-8")
    import tables

    tables.main([])
    _say(f"wrote {RESULTS}; rewrote {README}'s blocks")
    return EXIT_OK


def render(args: argparse.Namespace) -> int:
    new = readme_text(committed())
    if args.check:
        if new != README.read_text(encoding="utf-8"):
            _say(f"{README}: the kvcal_gpu block is stale; run python bench/kvcal_gpu.py render")
            return EXIT_FAILED
        return EXIT_OK
    README.write_text(new, encoding="utf-8")
    return EXIT_OK


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="the steps and the rounding check; DIR/kvcal_gpu.json")
    r.add_argument("--device", choices=["cuda", "cpu"], required=True)
    r.add_argument("--out", required=True, help="folder for kvcal_gpu.json")
    r.add_argument("--quick", action="store_true", help="the dry run's size: few requests")
    r.add_argument("--no-cpu", dest="cpu", action="store_false", help="no CPU steps beside")
    r.add_argument("--budget-s", type=float, default=420.0, help="no step starts after it")
    r.add_argument("--work", help="keep the steps' files here (default: a temporary folder)")
    r.set_defaults(fn=run)
    p = sub.add_parser("pack", help="the wheels a GPU machine lacks, and its command")
    p.add_argument("--from", dest="results", help="a dry run's kvcal_gpu.json to read")
    p.add_argument("--python", default=pack.PYTHON, help="the GPU machine's Python")
    p.set_defaults(fn=do_pack)
    c = sub.add_parser("record", help="keep a GPU run's kvcal_gpu.json; rewrite the README")
    c.add_argument("file")
    c.set_defaults(fn=record)
    v = sub.add_parser("render", help="rewrite the README block from the committed results")
    v.add_argument("--check", action="store_true", help="exit 1 when the block is stale")
    v.set_defaults(fn=render)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    code: int = args.fn(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
