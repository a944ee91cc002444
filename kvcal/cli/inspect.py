"""``kvcal inspect``: the KV-cache scheme and the k/v scales a checkpoint carries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from replay.core.extras import require

from .common import EXIT_OK, guard


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
        # Only the weights need them (framework="pt" reads the tensors with torch).
        require("kvcal inspect", ("safetensors", "torch"), " to read *.safetensors")
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
def inspect_cmd(model_dir: Path, as_json: bool) -> None:
    """Show the KV-cache scheme and k/v scales a checkpoint carries."""

    def run() -> int:
        info = inspect_checkpoint(model_dir)
        if as_json:
            click.echo(json.dumps(info, indent=2))
        else:
            _show(model_dir, info)
        return EXIT_OK

    guard("inspect", run)
