"""bench/README.md's block for ``bench/kvcal_gpu.py`` and its rows in the figures table, from
``bench/results/kvcal_gpu.json``; where no GPU run is recorded, the block says so and no row
is made up. Imports nothing heavy: ``tables.py`` reads it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import _blocks

BEGIN, END = "<!-- generated: bench/kvcal_gpu.py -->", "<!-- end kvcal_gpu -->"
NOT_RECORDED = (
    "Not yet recorded: no GPU machine has run it. `python bench/kvcal_gpu.py pack` prepares "
    "what one needs and prints its command; `python bench/kvcal_gpu.py record FILE` keeps "
    "the results it writes, here and in `bench/results/kvcal_gpu.json`."
)


def _seconds(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    if row["status"] != "ok":
        return str(row["status"]).replace("_", " ")
    return f"{row['wall_s']:.1f}"


def _ratio(cpu: dict[str, Any] | None, gpu: dict[str, Any] | None) -> str:
    if not (cpu and gpu and cpu["status"] == gpu["status"] == "ok"):
        return ""
    return f"{cpu['wall_s'] / gpu['wall_s']:.2f}x"


def step_table(doc: dict[str, Any]) -> list[str]:
    """A row per model and step: its wall time on the GPU and on the same machine's CPU."""
    by = {(s["model"], s["step"], s["device"]): s for s in doc["steps"]}
    lines = [
        "| model | kvcal step | GPU: s | CPU: s | CPU / GPU |",
        "| --- | --- | --- | --- | --- |",
    ]
    for model in doc["config"]["models"]:
        for step in doc["config"]["steps"]:
            gpu, cpu = by.get((model, step, "cuda")), by.get((model, step, "cpu"))
            lines.append(
                f"| {model} | {step} | {_seconds(gpu)} | {_seconds(cpu)} | {_ratio(cpu, gpu)} |"
            )
    return lines


def rounding_text(r: dict[str, Any]) -> str:
    kinds = " and ".join(k.upper() for k in r["kinds"])
    return (
        f"Rounding, value for value ({r['values']:,} values: every bf16 bit pattern, "
        f"{r['random_values']:,} random fp32 bit patterns, subnormals, each format's grid, "
        f"midpoints and their neighbours, and values beyond its largest; {kinds} at scales "
        f"{', '.join(f'{s:g}' for s in r['scales'])}): kvcal's emulated CUDA rounding differs "
        f"from torch's own float8 cast on {r['device']} in {r['emulated_vs_cast']:,} values "
        f"computed on the CPU and {r['emulated_on_device_vs_cast']:,} computed on the GPU; "
        f"vLLM CPU's truncation differs in {r['truncation_vs_cast']:,}."
    )


def render(doc: dict[str, Any] | None) -> str:
    """The block: the run's machine and command, the steps' times, the rounding counts."""
    if doc is None:
        return _blocks.paragraph(NOT_RECORDED) + "\n"
    m, c = doc["machine"], doc["config"]
    intro = (
        f"Measured on {m['gpu']} beside its own CPU ({m['cpu_model']}, {m['nproc']} cores; "
        f"{m['date'][:10]}, torch {m['versions']['torch']}, CUDA {m['cuda']}, transformers "
        f"{m['versions']['transformers']}; `python bench/kvcal_gpu.py run --device cuda`, "
        f"size {c['size']}, {doc['wall_s'] / 60:.1f} minutes in all). Each step is one "
        f"`kvcal` process, the model's load included:"
    )
    commands = sorted({s["command"] for s in doc["steps"] if s["device"] == "cuda"})
    lines = [_blocks.paragraph(intro), "", *step_table(doc), "", "```bash", *commands, "```"]
    lines += ["", _blocks.paragraph(rounding_text(doc["rounding"]))]
    return "\n".join(lines) + "\n"


def rows(doc: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(figure, value, target) rows for ``tables.py``: each step's GPU and CPU time, and the
    rounding's mismatches."""
    gpu = doc["machine"]["gpu"]
    by = {(s["model"], s["step"], s["device"]): s for s in doc["steps"]}
    for model in doc["config"]["models"]:
        for step in doc["config"]["steps"]:
            g, c = by.get((model, step, "cuda")), by.get((model, step, "cpu"))
            value = f"{_seconds(g) or '-'} on the GPU, {_seconds(c) or '-'} on its CPU"
            yield f"kvcal {step}, {model}: seconds on {gpu}", value, ""
    r = doc["rounding"]
    yield (
        f"emulated CUDA rounding vs torch's float8 cast on {gpu}: values that differ",
        f"{r['emulated_vs_cast']:,} of {r['values']:,}",
        "0",
    )
