"""``kvcal calibrate``: observe K/V on calibration samples (from ``kvcal sample``, or drawn
from a trace now) and write the scales as an overlay checkpoint vLLM loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from replay.core.errors import InputError
from replay.present.terminal import print_tables
from replay.testmodel.named import resolve_model

from .common import EXIT_OK, console, guard, with_options
from .sample import SAMPLING_OPTIONS, TraceDraw, draw_split, takes_draw
from .tables import advice_lines, scale_table

if TYPE_CHECKING:  # torch comes with _calibrate, imported once torch is known to be there
    from .._calibrate import Recipe
    from .._sample import Sample

# The model runs in transformers (torch); the overlay is written with safetensors.
CALIBRATE_NEEDS = ("torch", "transformers", "safetensors")

CALIBRATE_OPTIONS = [
    click.option(
        "--samples",
        "samples_path",
        type=click.Path(path_type=Path, dir_okay=False),
        help="samples.jsonl from `kvcal sample` (else give --trace to draw them now).",
    ),
    *SAMPLING_OPTIONS,
    click.option(
        "-o",
        "--out",
        "out_dir",
        type=click.Path(path_type=Path),
        required=True,
        help="New folder for the overlay checkpoint.",
    ),
    click.option(
        "--strategy",
        type=click.Choice(["tensor", "attn_head"]),
        default="tensor",
        show_default=True,
        help="One scale per layer, or one per KV head.",
    ),
    click.option(
        "--chunk-tokens",
        default=2048,
        show_default=True,
        help="Prefill chunk: bounds activation memory on long samples.",
    ),
    click.option(
        "--dtype",
        default="auto",
        show_default=True,
        help="Compute dtype for observation (auto: the checkpoint's).",
    ),
    click.option(
        "--mse-search",
        is_flag=True,
        help="Also report the scale minimizing estimated FP8 reconstruction error.",
    ),
    click.option(
        "--legacy-json",
        is_flag=True,
        help="Also write vLLM's deprecated --quantization-param-path scale file.",
    ),
    click.option("--json", "as_json", is_flag=True, help="Print the report as JSON."),
]


@click.command("calibrate")
@click.argument("model_dir", type=click.Path(path_type=Path), metavar="MODEL")
@with_options(CALIBRATE_OPTIONS)
@takes_draw
def calibrate_cmd(
    model_dir: Path,
    samples_path: Path | None,
    draw: TraceDraw,
    out_dir: Path,
    strategy: str,
    chunk_tokens: int,
    dtype: str,
    mse_search: bool,
    legacy_json: bool,
    as_json: bool,
) -> None:
    """Observe K/V on the samples, write scales as an overlay checkpoint vLLM loads."""

    def run() -> int:
        nonlocal model_dir
        model_dir = resolve_model(model_dir, "kvcal calibrate")
        if (samples_path is None) == (draw.trace_path is None):
            raise InputError("give exactly one of --samples FILE and --trace TRACE")
        if chunk_tokens < 16:
            raise InputError("--chunk-tokens must be at least 16")
        from .._calibrate import Recipe, refuse_uncalibratable

        # before the samples: drawing them writes the split into the overlay folder
        refuse_uncalibratable(model_dir)
        samples, sampling = _samples(model_dir, samples_path, draw, out_dir)
        recipe = Recipe(strategy, chunk_tokens, dtype, mse_search)
        seed_used = int(sampling.get("seed", draw.seed))
        report = _observe(
            model_dir, samples, out_dir, recipe, seed_used, sampling, legacy_json, as_json
        )
        if as_json:
            click.echo(json.dumps(report, indent=2))
        else:
            _show(report, out_dir)
        return EXIT_OK

    guard("calibrate", run, CALIBRATE_NEEDS)


def _samples(
    model_dir: Path, samples_path: Path | None, draw: TraceDraw, out_dir: Path
) -> tuple[list[Sample], dict[str, Any]]:
    """The calibration samples and what they were drawn from: a ``kvcal sample`` file (and
    the manifest beside it), or a split drawn from the trace now and written to ``out_dir``."""
    from .._sample import read_samples, write_split

    if samples_path is not None:
        samples = read_samples(samples_path)
        manifest_path = samples_path.parent / "sample_manifest.json"
        sampling: dict[str, Any] = (
            json.loads(manifest_path.read_text(encoding="utf-8")) if manifest_path.is_file() else {}
        )
        sampling["samples_file"] = str(samples_path)
    else:
        split, sampling = draw_split(model_dir, draw)
        write_split(out_dir, split, sampling)
        samples = split.calibration
    if not samples:
        raise InputError(
            "no calibration samples: the trace has too few requests per "
            "bucket (raise --max-share or give a larger trace)"
        )
    return list(samples), sampling


def _observe(
    model_dir: Path,
    samples: list[Sample],
    out_dir: Path,
    recipe: Recipe,
    seed: int,
    sampling: dict[str, Any],
    legacy_json: bool,
    quiet: bool,
) -> dict[str, Any]:
    """Calibrate, with a progress bar in tokens on stderr (none when ``quiet``)."""
    from .._calibrate import calibrate

    total = sum(len(s.input_ids) for s in samples)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=quiet,
    ) as bar:
        task = bar.add_task(f"observing K/V ({len(samples)} samples)", total=total)
        return calibrate(
            model_dir,
            samples,
            out_dir,
            recipe,
            seed,
            sampling,
            legacy_json,
            on_sample=lambda n: bar.advance(task, n),
        )


def _show(report: dict[str, Any], out_dir: Path) -> None:
    print_tables([scale_table(report)])
    for line in advice_lines(report):
        console.print(f"[yellow]advice:[/yellow] {line}")
    console.print(
        f"{report['tokens']} tokens at {report['tokens_per_second']:.0f} "
        f"tokens/s; overlay checkpoint: [bold]{out_dir}[/bold] (serve it with "
        "--kv-cache-dtype fp8; check with `kvcal verify`)"
    )
