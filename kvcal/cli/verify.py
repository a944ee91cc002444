"""``kvcal verify``: did an FP8 server apply the calibrated scales (or refuse FP8)?"""

from __future__ import annotations

import json
from pathlib import Path

import click

from .common import console, guard


@click.command("verify")
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
    logs = log_dir or overlay / "verify"
    # A server it starts is vLLM's; servers reached by URL need nothing installed here.
    starts = url is None or baseline_url is None
    guard(
        "verify",
        lambda: _verify(overlay, url, baseline_url, sequences, logs, emulate_fp8, as_json),
        ("vllm",) if starts else (),
        " to start its FP8 servers",
        "give --url and --baseline-url",
    )


def _verify(
    overlay: Path,
    url: str | None,
    baseline_url: str | None,
    sequences: int,
    logs: Path,
    emulate_fp8: bool,
    as_json: bool,
) -> int:
    from .._backend import per_head_backend_support
    from .._checkpoint import read_manifest
    from .._sample import SAMPLES, read_samples
    from .._verify import verify

    manifest = read_manifest(overlay)
    samples = read_samples(overlay / SAMPLES)[: max(1, sequences)]
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
