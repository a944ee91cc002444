"""``kvcal emulate``: KV-cache quality predicted offline, format by format, each format's
round trip at the cache write.

The options, their checks and the run with its progress bars; the work is
:mod:`kvcal.emulate`'s, the tables :mod:`kvcal.cli.tables`'.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from replay.core.buckets import Buckets
from replay.core.errors import InputError
from replay.present.terminal import print_tables
from replay.serving.kv_formats import EMULABLE as EMULATED
from replay.serving.kv_layout import SLIDING_WINDOW, KvLayout
from replay.testmodel.named import resolve_model

from .common import EXIT_OK, console, guard, with_options
from .tables import emulation_markdown, emulation_tables, sensitivity_table
from .trace_options import BUCKETS_OPTION, ON_BAD_LINE_OPTION, TRACE_FORMAT_OPTION

if TYPE_CHECKING:  # torch comes with kvcal.emulate, imported once torch is known to be there
    from ..emulate import EmulateArgs

# transformers runs the model (torch); safetensors reads the k/v scales a checkpoint carries.
EMULATE_NEEDS = ("torch", "transformers", "safetensors")

EMULATE_OPTIONS = [
    click.option(
        "--trace",
        "trace_path",
        type=click.Path(path_type=Path, dir_okay=False),
        help="Trace to draw requests from (any format replay reads).",
    ),
    click.option(
        "--answers",
        "answers_dir",
        type=click.Path(path_type=Path, file_okay=False),
        help="A replay run directory: score its reference target's answers instead.",
    ),
    TRACE_FORMAT_OPTION,
    BUCKETS_OPTION,
    click.option("--per-bucket", default=16, show_default=True, help="Requests per bucket."),
    click.option("--seed", default=0, show_default=True, help="Draw seed (hash of id + seed)."),
    ON_BAD_LINE_OPTION,
    click.option(
        "--overlay",
        "overlay_dir",
        type=click.Path(path_type=Path, file_okay=False),
        help="A calibrated overlay (kvcal calibrate): also emulate its k/v scales.",
    ),
    click.option(
        "--skip-layers",
        "skip_text",
        help="Also emulate with these layers kept BF16, e.g. 0,3 (vLLM: "
        "--kv-cache-dtype-skip-layers 0 3), or sliding_window: every sliding-window layer.",
    ),
    click.option(
        "--formats",
        "formats_text",
        default="fp8",
        show_default=True,
        help="KV-cache formats to emulate, vLLM's --kv-cache-dtype names: "
        + ", ".join(EMULATED)
        + ".",
    ),
    click.option(
        "--rounding",
        type=click.Choice(["engine", "cpu", "cuda", "both"]),
        default="engine",
        show_default=True,
        help="cpu: truncation, as vLLM's CPU kernel writes FP8; cuda: the CUDA/Triton "
        "kernels' (nearest); engine: the FP8 formats at cpu (vLLM CPU serves them), the "
        "rest at cuda; both: each format twice, and how much of its loss is the rounding.",
    ),
    click.option(
        "--max-dnll",
        "--tolerance",
        "max_dnll",
        type=float,
        help="ΔNLL per token a format may lose: name the formats whose interval stays at or "
        "below it in every bucket (--tolerance: its former name).",
    ),
    click.option(
        "--max-prompt-tokens",
        type=int,
        help="Leave out requests whose prompt is longer (counted in the report): a cheaper run.",
    ),
    click.option(
        "--max-new-tokens",
        default=32,
        show_default=True,
        help="Longest BF16 answer generated (capped by each request's max_tokens).",
    ),
    click.option(
        "--greedy-sample",
        default=4,
        show_default=True,
        help="Requests per bucket also decoded greedily under each setting (0: none).",
    ),
    click.option(
        "--sensitivity",
        is_flag=True,
        help="Per-layer sensitivity and the skip-layers value that recovers the loss.",
    ),
    click.option(
        "--recover",
        default=0.8,
        show_default=True,
        help="--sensitivity: share of the FP8 loss the skip layers must recover.",
    ),
    click.option(
        "--min-loss",
        default=0.01,
        show_default=True,
        help="--sensitivity: ΔNLL/token below which no layer needs BF16.",
    ),
    click.option(
        "--chunk-tokens",
        # A prompt up to 8K tokens in one pass: SDPA then skips the causal mask's upper
        # half, where a later chunk attends to the whole past through a mask and computes
        # all of it (a quarter less time per scored pass on 2 cores; bench/README.md).
        default=8192,
        show_default=True,
        help="Prefill chunk: bounds activation memory on long prompts.",
    ),
    click.option(
        "--dtype",
        type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
        default="auto",
        show_default=True,
        help="Compute dtype (auto: the checkpoint's).",
    ),
    click.option(
        "--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True
    ),
    click.option(
        "--markdown",
        "markdown_path",
        type=click.Path(path_type=Path, dir_okay=False),
        help="Write the tables as one Markdown table here (a row per setting, a column per "
        "bucket), with the advice below it.",
    ),
    click.option(
        "--json",
        "json_path",
        type=click.Path(path_type=Path, dir_okay=False),
        help="Write everything (settings, per bucket, per request, sensitivity) here.",
    ),
]


@click.command("emulate")
@click.argument("model_dir", type=click.Path(path_type=Path), metavar="MODEL")
@with_options(EMULATE_OPTIONS)
def emulate_cmd(
    model_dir: Path,
    trace_path: Path | None,
    answers_dir: Path | None,
    trace_format: str,
    bucket_spec: str,
    per_bucket: int,
    seed: int,
    on_bad_line: str,
    overlay_dir: Path | None,
    skip_text: str | None,
    formats_text: str,
    rounding: str,
    max_dnll: float | None,
    max_prompt_tokens: int | None,
    max_new_tokens: int,
    greedy_sample: int,
    sensitivity: bool,
    recover: float,
    min_loss: float,
    chunk_tokens: int,
    dtype: str,
    device: str,
    markdown_path: Path | None,
    json_path: Path | None,
) -> None:
    """Predict KV-cache quality offline, format by format: K/V round-tripped through each
    format where they enter the cache (transformers, CPU or GPU), scored against BF16 on the
    trace's requests, with the capacity each format's bytes imply. An emulation: it measures
    neither capacity nor kernel speed."""

    def run() -> int:
        nonlocal model_dir
        model_dir = resolve_model(model_dir, "kvcal emulate")
        check_options(
            trace_path,
            answers_dir,
            per_bucket,
            greedy_sample,
            max_new_tokens,
            chunk_tokens,
            recover,
            device,
            bucket_spec,
            max_prompt_tokens,
        )
        from ..emulate import EmulateArgs

        args = EmulateArgs(
            model_dir,
            trace=trace_path,
            answers=answers_dir,
            trace_format=trace_format,
            buckets=bucket_spec,
            per_bucket=per_bucket,
            seed=seed,
            on_bad_line=on_bad_line,
            overlay=overlay_dir,
            skip_layers=_parse_layers(skip_text, model_dir),
            rounding=rounding,
            formats=_parse_formats(formats_text),
            max_dnll=max_dnll,
            max_prompt_tokens=max_prompt_tokens,
            max_new_tokens=max_new_tokens,
            greedy_sample=greedy_sample,
            sensitivity=sensitivity,
            recover=recover,
            min_loss=min_loss,
            chunk_tokens=chunk_tokens,
            dtype=dtype,
            device=device,
        )
        _emulate(args, json_path, markdown_path)
        return EXIT_OK

    guard("emulate", run, EMULATE_NEEDS)


def check_options(
    trace_path: Path | None,
    answers_dir: Path | None,
    per_bucket: int,
    greedy_sample: int,
    max_new_tokens: int,
    chunk_tokens: int,
    recover: float,
    device: str,
    bucket_spec: str,
    max_prompt_tokens: int | None,
) -> None:
    """Refuse what the emulation cannot run with, before the model loads."""
    if (trace_path is None) == (answers_dir is None):
        raise InputError("give exactly one of --trace TRACE and --answers RUN_DIR")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise InputError("--max-prompt-tokens must be at least 1")
    for name, value, low in (
        ("--per-bucket", per_bucket, 1),
        ("--greedy-sample", greedy_sample, 0),
        ("--max-new-tokens", max_new_tokens, 1),
        ("--chunk-tokens", chunk_tokens, 16),
    ):
        if value < low:
            raise InputError(f"{name} must be at least {low}")
    if not 0 < recover <= 1:
        raise InputError("--recover must be in (0, 1]")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InputError("--device cuda: torch sees no CUDA device here")
    Buckets.parse(bucket_spec)


def _parse_formats(text: str) -> tuple[str, ...]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [n for n in names if n not in EMULATED]
    if bad or not names:
        raise InputError(
            f"--formats {text!r}: {', '.join(bad) or 'none given'}; the emulated formats are "
            + ", ".join(EMULATED)
        )
    return tuple(dict.fromkeys(names))


def _parse_layers(text: str | None, model_dir: Path) -> tuple[int, ...]:
    """Layer indices, and ``sliding_window`` for every sliding-window layer of the model (as
    vLLM's ``--kv-cache-dtype-skip-layers`` reads it)."""
    if not text:
        return ()
    words = text.replace(",", " ").split()
    if SLIDING_WINDOW in words:
        layout = KvLayout.of_model(model_dir)
        if layout is None or not layout.sliding:
            raise InputError(
                f"--skip-layers {SLIDING_WINDOW}: {model_dir} has no sliding-window layer"
            )
        words = [w for w in words if w != SLIDING_WINDOW] + [str(i) for i in layout.sliding]
    try:
        layers = tuple(sorted({int(p) for p in words}))
    except ValueError:
        raise InputError(
            f"--skip-layers {text!r}: expected layer indices such as 0,3 (or {SLIDING_WINDOW})"
        ) from None
    if any(i < 0 for i in layers):
        raise InputError(f"--skip-layers {text!r}: layer indices start at 0")
    return layers


def _emulate(args: EmulateArgs, json_path: Path | None, markdown_path: Path | None) -> None:
    """Run the emulation with transient progress bars on stderr; print the report's tables
    (stdout), notes and advice (stderr); write it all as JSON where asked."""
    from ..emulate import emulate

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:

        def track(what: str, total: int) -> Callable[[int], None]:
            task = bar.add_task(what, total=total)
            return lambda n: bar.advance(task, n)

        report = emulate(args, track)
    print_tables(emulation_tables(report))
    for note in report["notes"]:
        console.print(f"[yellow]note:[/yellow] {note}")
    for sens in (report["sensitivity_by_format"] or {}).values():
        print_tables([sensitivity_table(sens)])
        console.print(f"[yellow]advice:[/yellow] {sens['advice']}")
    for line in report["advice"]["lines"]:
        console.print(f"[yellow]advice:[/yellow] {line}")
    console.print(f"[dim]{report['caveat']}; intervals: {report['interval']}[/dim]")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {json_path}")
    if markdown_path is not None:
        advice = [f"- {line}" for line in report["advice"]["lines"]]
        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        text = emulation_markdown(report) + ("\n" + "\n".join(advice) + "\n" if advice else "")
        markdown_path.write_text(text, encoding="utf-8")
        console.print(f"wrote {markdown_path}")
