"""``kvcal advise``: when FP8 still loses, what to try next, from emulated measurements.

The options (most are ``kvcal emulate``'s), the run with its progress bars, and the tables;
the work is :mod:`kvcal._advise`'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.progress import (
    BarColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from replay.core.errors import InputError
from replay.present.terminal import print_tables
from replay.testmodel.named import resolve_model

from .common import EXIT_OK, console, guard, with_options
from .emulate import EMULATE_NEEDS, EMULATE_OPTIONS, check_options
from .tables import _ci, nll


def _option_name(option: Callable[[Any], Any]) -> str:
    """The parameter name a click.option decorator declares (to pick emulate's options)."""

    @option
    def probe(**_: Any) -> None: ...

    params = getattr(probe, "__click_params__", [])
    return str(params[0].name) if params else ""


# What advise adds to emulate's options; emulate's --skip-layers, --sensitivity and
# --greedy-sample are its own (advise finds the layers itself and scores, not decodes), and
# --formats, --max-dnll and --markdown are emulate's alone (advise weighs FP8 E4M3, the
# format kvcal calibrates, and writes JSON).
_NOT_HERE = {
    "skip_text",
    "sensitivity",
    "greedy_sample",
    "formats_text",
    "max_dnll",
    "markdown_path",
}
ADVISE_OPTIONS = [
    *(o for o in EMULATE_OPTIONS if _option_name(o) not in _NOT_HERE),
    click.option(
        "--max-skip-share",
        default=0.5,
        show_default=True,
        help="Most layers kept in BF16 that still count as keeping FP8 (a hybrid model: "
        "the capacity that share of a uniform model's layers would leave).",
    ),
    click.option(
        "--skip-candidates",
        default=8,
        show_default=True,
        help="Best-ranked layers tried, one more at a time, for the confirmed set.",
    ),
    # what kvcal did before it resumed passes at a layer: bench/advise_speed.py's baseline
    click.option("--whole-passes", is_flag=True, hidden=True),
]


@click.command("advise")
@click.argument("model_dir", type=click.Path(path_type=Path), metavar="MODEL")
@with_options(ADVISE_OPTIONS)
def advise_cmd(model_dir: Path, json_path: Path | None, **opts: Any) -> None:
    """When FP8 still loses after calibration: which layers to keep in BF16, whether
    per-head scales would help (and the backend takes them), how much of the loss is the
    backend's rounding; or reject. Emulated: it predicts quality, never capacity or speed."""

    def run() -> int:
        from .._advise import AdviseArgs, advise
        from .._backend import per_head_backend_support

        model = resolve_model(model_dir, "kvcal advise")
        check_options(
            opts["trace_path"],
            opts["answers_dir"],
            opts["per_bucket"],
            0,
            opts["max_new_tokens"],
            opts["chunk_tokens"],
            opts["recover"],
            opts["device"],
            opts["bucket_spec"],
            opts["max_prompt_tokens"],
        )
        if not 0 < opts["max_skip_share"] <= 1 or opts["skip_candidates"] < 1:
            raise InputError("--max-skip-share must be in (0, 1], --skip-candidates at least 1")
        supported, why = per_head_backend_support()
        args = AdviseArgs(
            model_dir=model,
            trace=opts["trace_path"],
            answers=opts["answers_dir"],
            trace_format=opts["trace_format"],
            buckets=opts["bucket_spec"],
            per_bucket=opts["per_bucket"],
            seed=opts["seed"],
            on_bad_line=opts["on_bad_line"],
            overlay=opts["overlay_dir"],
            rounding=opts["rounding"],
            max_prompt_tokens=opts["max_prompt_tokens"],
            max_new_tokens=opts["max_new_tokens"],
            greedy_sample=0,
            recover=opts["recover"],
            min_loss=opts["min_loss"],
            chunk_tokens=opts["chunk_tokens"],
            dtype=opts["dtype"],
            device=opts["device"],
            max_skip_share=opts["max_skip_share"],
            per_head_supported=supported,
            per_head_why=why,
            skip_candidates=opts["skip_candidates"],
            whole_passes=opts["whole_passes"],
        )
        with _Meter() as meter:
            report = advise(args, meter)
        show(report)
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
            console.print(f"wrote {json_path} (replay canary --advice {json_path})")
        return EXIT_OK

    guard("advise", run, EMULATE_NEEDS)


class _Meter:
    """One progress line on stderr: what is being scored (setting, request) and the time
    left for the work planned so far, in tokens computed (a resumed pass counts only the
    layers it computes)."""

    def __enter__(self) -> _Meter:
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self.bar.__enter__()
        self.task = self.bar.add_task("loading", total=0.0)
        return self

    def plan(self, work: float) -> None:
        total = self.bar.tasks[0].total or 0.0
        self.bar.update(self.task, total=max(0.0, total + work))

    def step(self, what: str, work: float) -> None:
        self.bar.update(self.task, advance=work, description=what)

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)


def settings_table(report: dict[str, Any]) -> Table:
    buckets = list(report["settings"][0]["buckets"])
    table = Table(title="emulated settings: ΔNLL/token [95% CI] against BF16")
    table.add_column("setting")
    table.add_column("rounding")
    for b in [*buckets, "all"]:
        table.add_column(b, justify="right")
    for row in report["settings"]:
        cells = [row["buckets"].get(b) for b in buckets] + [row["all"]]
        table.add_row(
            row["setting"],
            row["rounding"],
            *(
                "-" if c is None else _ci(c["nll_delta_mean"], c["nll_delta_lo"], c["nll_delta_hi"])
                for c in cells
            ),
        )
    return table


def ranking_table(report: dict[str, Any], top: int = 8) -> Table:
    table = Table(title=f"layers kept in BF16 one at a time, on {report['sensitivity_base']}")
    for col in ("layer", "ΔNLL with it in BF16", "recovered"):
        table.add_column(col, justify="right")
    for r in report["ranking"][:top]:
        table.add_row(str(r["layer"]), nll(r["kept_bf16"]["nll_delta_mean"]), nll(r["recovered"]))
    return table


def show(report: dict[str, Any]) -> None:
    print_tables([settings_table(report), *([ranking_table(report)] if report["ranking"] else [])])
    for note in report["notes"]:
        console.print(f"[yellow]note:[/yellow] {note}")
    sliding = report.get("sliding_window")
    if sliding is not None:
        at = f" at {report['capacity']['context_tokens']:,} tokens"
        console.print(
            f"candidate: {sliding['setting']} ({sliding['flag']}): capacity "
            f"{sliding['capacity_ratio']:.2f}x BF16{at} (the model's max length) instead of 2x"
        )
    step = report["next_step"]
    console.print(f"[bold]next step: {step['action']}[/bold]")
    for reason in step["reasons"]:
        console.print(f"  - {reason}")
    if step["action"] == "skip_layers":
        swa = step["flag"].endswith("sliding_window")
        name = "fp8-swa" if swa else "fp8-skip"
        layers = "sliding_window" if swa else ",".join(map(str, step["skip_layers"]))
        console.print(
            f"  serve it and replay: replay canary ... --targets bf16,{name}=MODEL "
            f"--skip-layers {name}={layers}"
        )
    console.print(f"[dim]{report['caveat']}; intervals: {report['interval']}[/dim]")
