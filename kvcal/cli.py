"""``kvcal``: calibrate FP8 K/V scales from the traffic you serve.

    kvcal sample MODEL --trace T -o DIR       stratified calibration ids, evaluation ids, samples
    kvcal calibrate MODEL --samples F -o OUT  observe K/V, scales, overlay checkpoint, manifest
    kvcal verify OUT                          did an FP8 server apply the scales? (or refuse?)
    kvcal inspect MODEL                       what KV scheme and k/v scales a checkpoint carries
    kvcal emulate MODEL --trace T             FP8 quality offline: E4M3 at the cache write

Exit codes: 0 done (verify: scales applied); 1 verify: not applied; 2 bad input; 3 verify: the
FP8 server refused (unsupported on this backend).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click
from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from replay.core.buckets import DEFAULT_BOUNDS, Buckets
from replay.core.errors import InputError

console = Console(stderr=True)
EXIT_OK, EXIT_NOT_APPLIED, EXIT_INPUT = 0, 1, 2


def _guard(fn: Callable[[], int]) -> NoReturn:
    try:
        code = fn()
    except InputError as exc:
        console.print(f"[red]error:[/red] {exc}")
        code = EXIT_INPUT
    sys.exit(code)


def inspect_checkpoint(model_dir: Path) -> dict[str, Any]:
    """kv_cache_scheme from config.json and every ``*.k_scale``/``*.v_scale`` tensor."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise click.ClickException(f"{model_dir}: no config.json; is this a model folder?")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise click.ClickException(f"{config_path}: not valid JSON: {exc}") from None
    qcfg = config.get("quantization_config") or {}
    scales: dict[str, list[float]] = {}
    shards = sorted(model_dir.glob("*.safetensors"))
    if shards:
        from safetensors import safe_open

        for shard in shards:
            with safe_open(str(shard), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    if key.endswith((".k_scale", ".v_scale")):
                        scales[key] = [float(x) for x in f.get_tensor(key).float().flatten()]
    return {
        "model": str(model_dir),
        "quant_method": qcfg.get("quant_method"),
        "kv_cache_scheme": qcfg.get("kv_cache_scheme"),
        "scale_tensors": len(scales),
        "scales": scales,
        "layers": config.get("num_hidden_layers"),
    }


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Calibrate FP8 K/V scales from the traffic you serve (see README)."""


@main.command("inspect")
@click.argument("model_dir", type=click.Path(path_type=Path, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a summary.")
def inspect_cmd(model_dir: Path, as_json: bool) -> None:
    """Show the KV-cache scheme and k/v scales a checkpoint carries."""
    info = inspect_checkpoint(model_dir)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    scheme = info["kv_cache_scheme"]
    click.echo(f"{model_dir}: {info['layers']} layers")
    if scheme is None:
        click.echo("  no kv_cache_scheme: an FP8 KV cache on this checkpoint uses scale 1.0")
    else:
        click.echo(f"  kv_cache_scheme: {json.dumps(scheme)}")
    click.echo(f"  k/v scale tensors: {info['scale_tensors']}")
    for key, values in sorted(info["scales"].items()):
        shown = ", ".join(f"{v:.4g}" for v in values[:8])
        click.echo(f"    {key}: [{shown}{', ...' if len(values) > 8 else ''}]")


# -- sample / calibrate -------------------------------------------------------------------


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    if not (model_dir / "config.json").is_file():
        raise InputError(f"{model_dir}: no config.json; give the model folder the server loads")
    return AutoTokenizer.from_pretrained(str(model_dir))


def _draw(
    model_dir: Path,
    trace: Path,
    trace_format: str,
    bucket_spec: str,
    per_bucket: int,
    max_share: float,
    seed: int,
    on_bad_line: str,
) -> tuple[Any, dict[str, Any]]:
    """Load the trace (replay's importers) and draw the stratified split."""
    from replay.core.errors import TraceError
    from replay.core.importers import stream
    from replay.run.rundir import file_digest

    from ._checkpoint import model_digests
    from ._sample import PromptRenderer, draw

    if not trace.is_file():
        raise InputError(f"--trace {trace}: no such file")
    bad: list[TraceError] = []  # the first bad line only: a trace may have many
    n_bad = [0]

    def on_bad(_k: int, err: TraceError) -> None:
        n_bad[0] += 1
        bad[:] = bad or [err]

    buckets = Buckets.parse(bucket_spec)
    requests = stream(
        trace,
        trace_format,
        on_bad_line=on_bad_line,  # type: ignore[arg-type]
        bad=on_bad,
    )
    split = draw(
        requests, PromptRenderer(_tokenizer(model_dir)), buckets, per_bucket, seed, max_share
    )
    if n_bad[0]:
        console.print(
            f"[yellow]skipped {n_bad[0]} bad line(s)[/yellow] (first: {bad[0]}); "
            "`replay trace validate` lists them all"
        )
    digests = model_digests(model_dir.resolve())
    info = {
        "trace": str(trace),
        "trace_sha256": file_digest(trace),
        "model": str(model_dir.resolve()),
        "tokenizer": digests["tokenizer"],
        "chat_template": digests["chat_template"],
        "bucket_bounds": buckets.spec(),
        "per_bucket": per_bucket,
        "max_share": max_share,
        "seed": seed,
        "bad_lines": n_bad[0],
    }
    for label, row in split.buckets.items():
        if row["calibration"] < per_bucket and row["available"]:
            console.print(
                f"[yellow]note:[/yellow] bucket {label}: {row['calibration']} of "
                f"{per_bucket} asked ({row['available']} requests; at most "
                f"{max_share:.0%} of a bucket calibrates, the rest evaluates)"
            )
    return split, info


SAMPLING_OPTIONS = [
    click.option(
        "--trace",
        "trace_path",
        type=click.Path(path_type=Path, dir_okay=False),
        help="Trace to draw from (any format replay reads).",
    ),
    click.option("--trace-format", default="auto", show_default=True),
    click.option(
        "--buckets",
        "bucket_spec",
        default=DEFAULT_BOUNDS,
        show_default=True,
        help="Context-length bucket bounds, as in replay --buckets.",
    ),
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
    click.option(
        "--on-bad-line", type=click.Choice(["fail", "skip"]), default="fail", show_default=True
    ),
]


def sampling_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(SAMPLING_OPTIONS):
        f = option(f)
    return f


def _bucket_table(split: Any) -> Table:
    table = Table(title="calibration samples per bucket")
    for col in ("bucket", "requests", "calibration", "evaluation"):
        table.add_column(col, justify="right")
    for label, row in split.buckets.items():
        table.add_row(
            label,
            str(row["available"]),
            str(row["calibration"]),
            str(row["available"] - row["calibration"]),
        )
    return table


@main.command("sample")
@click.argument("model_dir", type=click.Path(path_type=Path, file_okay=False, exists=True))
@sampling_options
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    required=True,
    help="Folder for calibration_ids.txt, evaluation_ids.txt, samples.jsonl.",
)
def sample_cmd(
    model_dir: Path,
    trace_path: Path | None,
    trace_format: str,
    bucket_spec: str,
    per_bucket: int,
    max_share: float,
    seed: int,
    on_bad_line: str,
    out_dir: Path,
) -> None:
    """Draw calibration requests from a trace, stratified by context-length bucket."""
    from ._sample import write_split

    def run() -> int:
        if trace_path is None:
            raise InputError("--trace is required")
        split, info = _draw(
            model_dir,
            trace_path,
            trace_format,
            bucket_spec,
            per_bucket,
            max_share,
            seed,
            on_bad_line,
        )
        write_split(out_dir, split, info)
        Console().print(_bucket_table(split))
        click.echo(
            f"wrote {out_dir}: {len(split.calibration)} calibration, "
            f"{len(split.evaluation_ids)} evaluation request(s); replay with "
            f"--exclude-ids {out_dir / 'calibration_ids.txt'}"
        )
        return EXIT_OK

    _guard(run)


def _pct(x: float) -> str:
    return "0" if x == 0 else f"{100 * x:.3g}%"


def _scale_table(report: dict[str, Any]) -> Table:
    search = any(t["mse_scale"] is not None for t in report["tensors"])
    table = Table(title=f"K/V scales ({report['samples']} samples, {report['tokens']} tokens)")
    cols = [
        "layer",
        "tensor",
        "amax",
        "scale",
        "heads amax",
        "clip@1",
        "zero@1",
        "zero@s",
        "subnormal@s",
    ] + (["mse scale", "mse gain"] if search else [])
    for col in cols:
        table.add_column(col, justify="right")
    for t in report["tensors"]:
        row = [
            str(t["layer"]),
            t["which"].upper(),
            f"{t['amax']:.4g}",
            f"{t['scale']:.4g}",
            " ".join(f"{h:.3g}" for h in t["head_amax"][:8]),
            _pct(t["clip_at_1"]),
            _pct(t["zero_at_1"]),
            _pct(t["zero_at_scale"]),
            _pct(t["subnormal_at_scale"]),
        ]
        if search:
            row += [f"{t['mse_scale']:.4g}", f"{t['mse_gain']:.3g}x"]
        table.add_row(*row)
    return table


def _advice_lines(report: dict[str, Any]) -> list[str]:
    adv = report["advice"]
    out = list(adv["reasons"]) or ["no layer or head range stands out: per-tensor scales fit"]
    if adv["skip_layers_flag"]:
        out.append(f"to keep the outlier layers in BF16: {adv['skip_layers_flag']}")
    out.append(f"per-head scales here: {report['per_head_backend']}")
    return out


@main.command("calibrate")
@click.argument("model_dir", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option(
    "--samples",
    "samples_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="samples.jsonl from `kvcal sample` (else give --trace to draw them now).",
)
@sampling_options
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    required=True,
    help="New folder for the overlay checkpoint.",
)
@click.option(
    "--strategy",
    type=click.Choice(["tensor", "attn_head"]),
    default="tensor",
    show_default=True,
    help="One scale per layer, or one per KV head.",
)
@click.option(
    "--chunk-tokens",
    default=2048,
    show_default=True,
    help="Prefill chunk: bounds activation memory on long samples.",
)
@click.option(
    "--dtype",
    default="auto",
    show_default=True,
    help="Compute dtype for observation (auto: the checkpoint's).",
)
@click.option(
    "--mse-search",
    is_flag=True,
    help="Also report the scale minimizing estimated FP8 reconstruction error.",
)
@click.option(
    "--legacy-json",
    is_flag=True,
    help="Also write vLLM's deprecated --quantization-param-path scale file.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def calibrate_cmd(
    model_dir: Path,
    samples_path: Path | None,
    trace_path: Path | None,
    trace_format: str,
    bucket_spec: str,
    per_bucket: int,
    max_share: float,
    seed: int,
    on_bad_line: str,
    out_dir: Path,
    strategy: str,
    chunk_tokens: int,
    dtype: str,
    mse_search: bool,
    legacy_json: bool,
    as_json: bool,
) -> None:
    """Observe K/V on the samples, write scales as an overlay checkpoint vLLM loads."""
    from ._calibrate import Recipe, calibrate
    from ._sample import read_samples, write_split

    def run() -> int:
        if (samples_path is None) == (trace_path is None):
            raise InputError("give exactly one of --samples FILE and --trace TRACE")
        if chunk_tokens < 16:
            raise InputError("--chunk-tokens must be at least 16")
        if samples_path is not None:
            samples = read_samples(samples_path)
            manifest_path = samples_path.parent / "sample_manifest.json"
            sampling: dict[str, Any] = (
                json.loads(manifest_path.read_text(encoding="utf-8"))
                if manifest_path.is_file()
                else {}
            )
            sampling["samples_file"] = str(samples_path)
        else:
            assert trace_path is not None
            split, sampling = _draw(
                model_dir,
                trace_path,
                trace_format,
                bucket_spec,
                per_bucket,
                max_share,
                seed,
                on_bad_line,
            )
            write_split(out_dir, split, sampling)
            samples = split.calibration
        if not samples:
            raise InputError(
                "no calibration samples: the trace has too few requests per "
                "bucket (raise --max-share or give a larger trace)"
            )
        total = sum(len(s.input_ids) for s in samples)
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("tokens"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            disable=as_json,
        ) as bar:
            task = bar.add_task(f"observing K/V ({len(samples)} samples)", total=total)
            report = calibrate(
                model_dir,
                samples,
                out_dir,
                Recipe(strategy, chunk_tokens, dtype, mse_search),
                int(sampling.get("seed", seed)),
                sampling,
                legacy_json,
                on_sample=lambda n: bar.advance(task, n),
            )
        if as_json:
            click.echo(json.dumps(report, indent=2))
            return EXIT_OK
        out = Console()
        out.print(_scale_table(report))
        for line in _advice_lines(report):
            console.print(f"[yellow]advice:[/yellow] {line}")
        console.print(
            f"{report['tokens']} tokens at {report['tokens_per_second']:.0f} "
            f"tokens/s; overlay checkpoint: [bold]{out_dir}[/bold] (serve it with "
            "--kv-cache-dtype fp8; check with `kvcal verify`)"
        )
        return EXIT_OK

    _guard(run)


# -- verify -------------------------------------------------------------------------------


@main.command("verify")
@click.argument("overlay", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option("--url", help="An FP8 server already serving the calibrated checkpoint.")
@click.option("--baseline-url", help="An FP8 server of the original model (scale 1.0).")
@click.option(
    "--sequences",
    default=4,
    show_default=True,
    help="Calibration samples scored teacher-forced on both servers.",
)
@click.option(
    "--log-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Server logs [default: OVERLAY/verify].",
)
@click.option(
    "--emulate-fp8",
    is_flag=True,
    help="Start BF16 servers that emulate the FP8 cache (kvcal's vLLM plugin), where "
    "this CPU cannot serve FP8: checks the scales reach the cache write.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def verify_cmd(
    overlay: Path,
    url: str | None,
    baseline_url: str | None,
    sequences: int,
    log_dir: Path | None,
    emulate_fp8: bool,
    as_json: bool,
) -> None:
    """Start (or reach) FP8 servers on the calibrated checkpoint and on the original, and
    check that the engine applied the scales: served cache dtype, log, teacher-forced scores.
    A server that refuses FP8 (or per-head scales) is reported as unsupported, exit 3."""
    from ._checkpoint import read_manifest
    from ._sample import SAMPLES, read_samples
    from ._scales import per_head_backend_support
    from ._verify import verify

    def run() -> int:
        manifest = read_manifest(overlay)
        samples = read_samples(overlay / SAMPLES)[: max(1, sequences)]
        logs = log_dir or overlay / "verify"
        result = verify(
            overlay,
            str(manifest["model"]),
            samples,
            logs,
            strategy=str(manifest["kv_cache_scheme"]["strategy"]),
            per_head=per_head_backend_support(),
            url=url,
            baseline_url=baseline_url,
            emulate=emulate_fp8,
            status=lambda m: console.print(f"[dim]{m}[/dim]"),
        )
        data = result.to_json()
        logs.mkdir(parents=True, exist_ok=True)
        (logs / "verify.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        if as_json:
            click.echo(json.dumps(data, indent=2))
        else:
            style = {"applied": "green", "not_applied": "red"}.get(result.status, "yellow")
            console.print(f"[bold {style}]{result.status.upper()}[/bold {style}]")
            for reason in result.reasons:
                console.print(f"  {reason}")
            console.print(f"details: {logs / 'verify.json'}")
        return result.exit_code

    _guard(run)


# -- emulate ------------------------------------------------------------------------------


def _parse_layers(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        layers = tuple(sorted({int(p) for p in text.replace(",", " ").split()}))
    except ValueError:
        raise InputError(f"--skip-layers {text!r}: expected layer indices such as 0,3") from None
    if any(i < 0 for i in layers):
        raise InputError(f"--skip-layers {text!r}: layer indices start at 0")
    return layers


def _nll(x: float) -> str:
    return f"{x:+.1e}" if x and abs(x) < 5e-4 else f"{x:+.4f}"


def _pct1(x: float) -> str:
    return f"{x:.1%}"


def _ci(
    mean: float | None, lo: float | None, hi: float | None, fmt: Callable[[float], str] = _nll
) -> str:
    if mean is None:
        return "-"
    if lo is None or hi is None:
        return fmt(mean)
    return f"{fmt(mean)}\n[{fmt(lo)}, {fmt(hi)}]"


def _emulation_table(report: dict[str, Any]) -> Table:
    ref = report["reference"]
    table = Table(
        title=f"EMULATED FP8 E4M3 ({report['rounding']} rounding) vs BF16: "
        f"{ref['requests']} requests, {ref['tokens']} answer tokens "
        "teacher-forced (95% intervals)",
        box=box.SIMPLE_HEAD,
    )
    for col in (
        "setting",
        "bucket",
        "req",
        "ΔNLL/token",
        "top-1",
        "greedy\nexact",
        "common\nprefix",
    ):
        table.add_column(col, justify="left" if col == "setting" else "right")
    for row in report["results"]:
        g = row["greedy"]
        table.add_row(
            row["setting"],
            row["bucket"],
            str(row["requests"]),
            _ci(row["nll_delta_mean"], row["nll_delta_lo"], row["nll_delta_hi"]),
            _ci(row["top1_agreement"], row["top1_lo"], row["top1_hi"], _pct1),
            f"{g['exact']}/{g['requests']}" if g else "-",
            f"{g['mean_common_prefix']:.1f}/{g['mean_tokens']:.1f}" if g else "-",
            end_section=row["bucket"] == "all",
        )
    return table


def _sensitivity_table(sens: dict[str, Any]) -> Table:
    table = Table(
        title=f"per-layer sensitivity on {sens['base']} (every layer FP8: ΔNLL "
        f"{_nll(sens['loss'])}/token)",
        box=box.SIMPLE_HEAD,
    )
    for col in (
        "layer",
        "ΔNLL/token,\nonly this layer FP8",
        "ΔNLL/token,\nthis layer BF16",
        "recovered",
        "share",
    ):
        table.add_column(col, justify="right")
    for r in sens["layers"]:
        only, kept = r["only_fp8"], r["kept_bf16"]
        share = r["recovered_share"]
        table.add_row(
            str(r["layer"]),
            _ci(only["nll_delta_mean"], only["nll_delta_lo"], only["nll_delta_hi"]),
            _ci(kept["nll_delta_mean"], kept["nll_delta_lo"], kept["nll_delta_hi"]),
            _nll(r["recovered"]),
            "-" if share is None else f"{share:.0%}",
        )
    return table


@main.command("emulate")
@click.argument("model_dir", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Trace to draw requests from (any format replay reads).",
)
@click.option(
    "--answers",
    "answers_dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="A replay run directory: score its reference target's answers instead.",
)
@click.option("--trace-format", default="auto", show_default=True)
@click.option(
    "--buckets",
    "bucket_spec",
    default=DEFAULT_BOUNDS,
    show_default=True,
    help="Context-length bucket bounds, as in replay --buckets.",
)
@click.option("--per-bucket", default=16, show_default=True, help="Requests per bucket.")
@click.option("--seed", default=0, show_default=True, help="Draw seed (hash of id + seed).")
@click.option(
    "--on-bad-line", type=click.Choice(["fail", "skip"]), default="fail", show_default=True
)
@click.option(
    "--overlay",
    "overlay_dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="A calibrated overlay (kvcal calibrate): also emulate its k/v scales.",
)
@click.option(
    "--skip-layers",
    "skip_text",
    help="Also emulate with these layers kept BF16, "
    "e.g. 0,3 (vLLM: --kv-cache-dtype-skip-layers 0 3).",
)
@click.option(
    "--rounding",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="vLLM's CPU kernel (truncates) or CUDA's (nearest).",
)
@click.option(
    "--max-new-tokens",
    default=32,
    show_default=True,
    help="Longest BF16 answer generated (capped by each request's max_tokens).",
)
@click.option(
    "--greedy-sample",
    default=4,
    show_default=True,
    help="Requests per bucket also decoded greedily under each setting (0: none).",
)
@click.option(
    "--sensitivity",
    is_flag=True,
    help="Per-layer sensitivity and the skip-layers value that recovers the loss.",
)
@click.option(
    "--recover",
    default=0.8,
    show_default=True,
    help="--sensitivity: share of the FP8 loss the skip layers must recover.",
)
@click.option(
    "--min-loss",
    default=0.01,
    show_default=True,
    help="--sensitivity: ΔNLL/token below which no layer needs BF16.",
)
@click.option(
    "--chunk-tokens",
    default=2048,
    show_default=True,
    help="Prefill chunk: bounds activation memory on long prompts.",
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
    default="auto",
    show_default=True,
    help="Compute dtype (auto: the checkpoint's).",
)
@click.option(
    "--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write everything (settings, per bucket, per request, sensitivity) here.",
)
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
    rounding: str,
    max_new_tokens: int,
    greedy_sample: int,
    sensitivity: bool,
    recover: float,
    min_loss: float,
    chunk_tokens: int,
    dtype: str,
    device: str,
    json_path: Path | None,
) -> None:
    """Predict FP8 KV-cache quality offline: K/V round-tripped through E4M3 where they enter
    the cache (transformers, CPU or GPU), scored against BF16 on the trace's requests. An
    emulation: it says nothing of capacity or kernel speed."""
    from ._emulate_report import EmulateArgs, emulate

    def run() -> int:
        if (trace_path is None) == (answers_dir is None):
            raise InputError("give exactly one of --trace TRACE and --answers RUN_DIR")
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
        args = EmulateArgs(
            model_dir,
            trace_path,
            answers_dir,
            trace_format,
            bucket_spec,
            per_bucket,
            seed,
            on_bad_line,
            overlay_dir,
            _parse_layers(skip_text),
            rounding,
            max_new_tokens,
            greedy_sample,
            sensitivity,
            recover,
            min_loss,
            chunk_tokens,
            dtype,
            device,
        )
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
        out = Console()
        out.print(_emulation_table(report))
        for note in report["notes"]:
            console.print(f"[yellow]note:[/yellow] {note}")
        sens = report["sensitivity"]
        if sens is not None:
            out.print(_sensitivity_table(sens))
            console.print(f"[yellow]advice:[/yellow] {sens['advice']}")
        console.print(f"[dim]{report['caveat']}; intervals: {report['interval']}[/dim]")
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
            console.print(f"wrote {json_path}")
        return EXIT_OK

    _guard(run)


if __name__ == "__main__":
    sys.exit(main())
