"""``kvcal inspect``: the KV-cache scheme and the k/v scales a checkpoint carries, and which of
those scales no FP8 cache can use (a warning; with ``--strict``, exit 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from replay.core.errors import InputError
from replay.core.extras import require

from .._preflight import read_config, unusable_scales, weight_map
from .common import EXIT_OK, console, guard

SHOWN_BAD = 6  # unusable scales a message names; the rest it counts


def inspect_checkpoint(model_dir: Path) -> dict[str, Any]:
    """kv_cache_scheme from config.json and every ``*.k_scale``/``*.v_scale`` tensor; under
    ``bad_scales`` the ones no FP8 cache can use, with why."""
    config = read_config(model_dir)
    qcfg = config.get("quantization_config") or {}
    names = weight_map(model_dir)
    if names:
        # Only the weights need them (framework="pt" reads the tensors with torch).
        require("kvcal inspect", ("safetensors", "torch"), " to read *.safetensors")
    holder = {k: s for k, s in names.items() if k.endswith((".k_scale", ".v_scale"))}
    scales = _read_scales(model_dir, holder)
    return {
        "model": str(model_dir),
        "quant_method": qcfg.get("quant_method"),
        "kv_cache_scheme": qcfg.get("kv_cache_scheme"),
        "scale_tensors": len(scales),
        "scales": scales,
        "bad_scales": unusable_scales(scales),
        "layers": config.get("num_hidden_layers"),
    }


def _read_scales(model_dir: Path, holder: dict[str, str]) -> dict[str, list[float]]:
    """Each scale tensor's values, read from the shard ``holder`` names for it."""
    if not holder:
        return {}
    from safetensors import SafetensorError, safe_open

    scales: dict[str, list[float]] = {}
    for shard in sorted(set(holder.values())):
        path = model_dir / shard
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in sorted(k for k, s in holder.items() if s == shard):
                    scales[key] = [float(x) for x in f.get_tensor(key).float().flatten()]
        except SafetensorError as exc:
            raise InputError(
                f"{path}: safetensors cannot read it ({exc}); download or copy the checkpoint again"
            ) from exc
    return dict(sorted(scales.items()))


def _unusable_message(model_dir: Path, bad: dict[str, str]) -> str:
    """One line naming the unusable scales (the first ``SHOWN_BAD``) and what to do."""
    named = ", ".join(f"{key} {why}" for key, why in sorted(bad.items())[:SHOWN_BAD])
    more = f" and {len(bad) - SHOWN_BAD} more" if len(bad) > SHOWN_BAD else ""
    return (
        f"{model_dir}: {len(bad)} k/v scale tensor(s) no FP8 cache can use: {named}{more}; "
        "calibrate again from the base checkpoint (`kvcal calibrate`)"
    )


def _show(model_dir: Path, info: dict[str, Any]) -> None:
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


@click.command("inspect")
@click.argument("model_dir", type=click.Path(path_type=Path, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a summary.")
@click.option(
    "--strict",
    is_flag=True,
    help="Exit 2 when a k/v scale is NaN, infinite, negative, zero or absurd (else a warning).",
)
def inspect_cmd(model_dir: Path, as_json: bool, strict: bool) -> None:
    """Show the KV-cache scheme and k/v scales a checkpoint carries."""

    def run() -> int:
        info = inspect_checkpoint(model_dir)
        if as_json:
            click.echo(json.dumps(info, indent=2))
        else:
            _show(model_dir, info)
        if info["bad_scales"]:
            message = _unusable_message(model_dir, info["bad_scales"])
            if strict:
                raise InputError(message)
            console.print(f"[yellow]warning:[/yellow] {escape(message)}", soft_wrap=True)
        return EXIT_OK

    guard("inspect", run)
