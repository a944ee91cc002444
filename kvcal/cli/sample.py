"""``kvcal sample``: calibration requests drawn from a trace, stratified by context-length
bucket; and the sampling options and the draw that ``kvcal calibrate --trace`` shares."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import click

from replay.core.buckets import Buckets
from replay.core.errors import InputError
from replay.present.terminal import print_tables
from replay.testmodel.named import resolve_model

from .common import EXIT_OK, console, guard, with_options
from .tables import bucket_table
from .trace_options import BUCKETS_OPTION, ON_BAD_LINE_OPTION, TRACE_FORMAT_OPTION

# transformers renders the prompts (the model's tokenizer and chat template).
SAMPLE_NEEDS = ("transformers",)

SAMPLING_OPTIONS = [
    click.option(
        "--trace",
        "trace_path",
        type=click.Path(path_type=Path, dir_okay=False),
        help="Trace to draw from (any format replay reads).",
    ),
    TRACE_FORMAT_OPTION,
    BUCKETS_OPTION,
    click.option(
        "--per-bucket", default=64, show_default=True, help="Calibration requests per bucket."
    ),
    click.option(
        "--max-share",
        default=0.5,
        show_default=True,
        help="At most this share of a bucket calibrates; the rest evaluates.",
    ),
    click.option("--seed", default=0, show_default=True, help="Split seed (hash of id + seed)."),
    ON_BAD_LINE_OPTION,
]
sampling_options = with_options(SAMPLING_OPTIONS)


@dataclass(frozen=True)
class TraceDraw:
    """The sampling options: the trace and how its calibration split is drawn (a field per
    option, named as its click parameter)."""

    trace_path: Path | None
    trace_format: str
    bucket_spec: str
    per_bucket: int
    max_share: float
    seed: int
    on_bad_line: str


def takes_draw(command: Callable[..., Any]) -> Callable[..., Any]:
    """Hand ``command`` the sampling options as one ``draw: TraceDraw``, in place of its
    click parameters."""

    @functools.wraps(command)
    def with_draw(*args: Any, **kwargs: Any) -> Any:
        draw = TraceDraw(**{f.name: kwargs.pop(f.name) for f in fields(TraceDraw)})
        return command(*args, draw=draw, **kwargs)

    return with_draw


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    from .._preflight import TOKENIZER_VOCAB, read_config

    read_config(model_dir)  # transformers reads it too, and trips over a broken one deep inside
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        if not any((model_dir / name).is_file() for name in TOKENIZER_VOCAB):
            raise InputError(
                f"{model_dir}: no tokenizer (none of {', '.join(TOKENIZER_VOCAB)}); copy the "
                "tokenizer files of the model the server loads into the folder"
            ) from exc
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"{model_dir}: transformers cannot load its tokenizer ({reason}); copy the "
            "tokenizer files of the model the server loads into the folder"
        ) from exc


def draw_split(model_dir: Path, opts: TraceDraw) -> tuple[Any, dict[str, Any]]:
    """Load the trace (replay's importers) and draw the stratified split."""
    from replay.core.errors import TraceError
    from replay.traces.importers import stream

    from .._sample import PromptRenderer, draw

    trace = opts.trace_path
    if trace is None:
        raise InputError("--trace is required")
    if not trace.is_file():
        raise InputError(f"--trace {trace}: no such file")
    bad: list[TraceError] = []  # the first bad line only: a trace may have many
    n_bad = [0]

    def on_bad(_k: int, err: TraceError) -> None:
        n_bad[0] += 1
        bad[:] = bad or [err]

    buckets = Buckets.parse(opts.bucket_spec)
    requests = stream(
        trace,
        opts.trace_format,
        on_bad_line=opts.on_bad_line,  # type: ignore[arg-type]
        bad=on_bad,
    )
    renderer = PromptRenderer(_tokenizer(model_dir))
    split = draw(requests, renderer, buckets, opts.per_bucket, opts.seed, opts.max_share)
    if n_bad[0]:
        console.print(
            f"[yellow]skipped {n_bad[0]} bad line(s)[/yellow] (first: {bad[0]}); "
            "`replay trace validate` lists them all"
        )
    info = _sampling_info(model_dir, trace, buckets, opts, n_bad[0])
    _note_short_buckets(split, opts)
    return split, info


def _sampling_info(
    model_dir: Path, trace: Path, buckets: Buckets, opts: TraceDraw, bad_lines: int
) -> dict[str, Any]:
    """What the split was drawn from and how: the sample manifest."""
    from replay.rundir.files import file_digest

    from .._checkpoint import model_digests

    digests = model_digests(model_dir.resolve())
    return {
        "trace": str(trace),
        "trace_sha256": file_digest(trace),
        "model": str(model_dir.resolve()),
        "tokenizer": digests["tokenizer"],
        "chat_template": digests["chat_template"],
        "bucket_bounds": buckets.spec(),
        "per_bucket": opts.per_bucket,
        "max_share": opts.max_share,
        "seed": opts.seed,
        "bad_lines": bad_lines,
    }


def _note_short_buckets(split: Any, opts: TraceDraw) -> None:
    for label, row in split.buckets.items():
        if row["calibration"] < opts.per_bucket and row["available"]:
            console.print(
                f"[yellow]note:[/yellow] bucket {label}: {row['calibration']} of "
                f"{opts.per_bucket} asked ({row['available']} requests; at most "
                f"{opts.max_share:.0%} of a bucket calibrates, the rest evaluates)"
            )


@click.command("sample")
@click.argument("model_dir", type=click.Path(path_type=Path), metavar="MODEL")
@sampling_options
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    required=True,
    help="Folder for calibration_ids.txt, evaluation_ids.txt, samples.jsonl.",
)
@takes_draw
def sample_cmd(model_dir: Path, draw: TraceDraw, out_dir: Path) -> None:
    """Draw calibration requests from a trace, stratified by context-length bucket."""
    guard(
        "sample",
        lambda: _sample(resolve_model(model_dir, "kvcal sample"), draw, out_dir),
        SAMPLE_NEEDS,
    )


def _sample(model_dir: Path, opts: TraceDraw, out_dir: Path) -> int:
    from .._sample import write_split

    split, info = draw_split(model_dir, opts)
    write_split(out_dir, split, info)
    print_tables([bucket_table(split)])
    click.echo(
        f"wrote {out_dir}: {len(split.calibration)} calibration, "
        f"{len(split.evaluation_ids)} evaluation request(s); replay with "
        f"--exclude-ids {out_dir / 'calibration_ids.txt'}"
    )
    return EXIT_OK
