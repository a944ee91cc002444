"""The options of one replay as a typed, validated object, parsed once from the command line
and resolved into the run's ``RunSpec`` (replay/cli/replay_run.py), which the manifest records
and ``--resume`` continues. Adding an option that changes the run means a field here, its
``click.option``, and its place in the spec (``run_spec``, and back: ``run_directory.options_of``).
``from_saved`` reads the options an older version saved (``cli_options``), for its runs."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import click

from replay.cli.measuring_options import MEASURING_OPTIONS
from replay.core.buckets import DEFAULT_BOUNDS
from replay.core.credentials import redact
from replay.core.errors import InputError
from replay.traces.importers import FORMAT_HELP, LengthPolicy

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class RunOptions:
    """What ``replay`` and ``replay canary`` were asked to do (one field per option; the
    option's name is the field's with dashes). Fields with defaults are options added after
    runs were first saved: an older run resumes with them."""

    trace_path: Path
    trace_format: str
    targets: str
    targets_file: Path | None
    model_dir: Path | None
    concurrency: str
    rate: float | None
    trace_times: bool
    time_scale: float
    max_in_flight: int
    bucket_spec: str
    on_bad_line: str
    length_scale: float
    max_input_tokens: int | None
    max_output_tokens: int | None
    limit: int | None
    parallel_targets: bool
    timeout_s: float
    phase_timeout_s: float
    reference: str | None
    no_teacher_forced: bool
    tolerance: float
    share_prefix_cache: bool
    out_dir: Path
    run_id: str | None
    seed: int
    min_pairs: int
    required_capacity_ratio: float
    alpha: float
    drain_s: float
    markdown_path: Path | None
    exclude_ids: Path | None = None
    candidate: str | None = None
    calibrated: str | None = None
    emulate_fp8: bool = False
    emulate_kv: bool = False
    accept_emulated: bool = False
    # None: decided when the trace is read (on in `canary` for unlabeled traffic); saved
    # resolved, so a resume replays the same arms.
    control: bool | None = None
    max_errors: int | None = None
    max_error_rate: float = 0.05
    slo: str | None = None
    session_history: str = "trace"
    think_time: str = "auto"
    stop_at_saturation: bool = False
    sequential: bool = False
    round_size: int = 20
    max_requests: int | None = None
    max_time: float | None = None
    workers: int = 1
    # None: decided when the plan is known (on when targets are compared, where it can be);
    # saved resolved, so a resume sends the same way.
    interleave: bool | None = None
    block_size: int = 0
    systems_threshold: float = 0.05
    # None: on for `canary` when the workload's own load never fills the reference's cache.
    capacity_phase: bool | None = None
    capacity_concurrency: int = 12
    capacity_cache_mib: int = 0
    capacity_time_limit: float = 600.0
    skip_layers: str | None = None
    advice_path: Path | None = None
    quality_pass: str = "load"

    @classmethod
    def from_click(cls, opts: Mapping[str, Any]) -> RunOptions:
        """From click's keyword arguments (``resume_dir`` is not a run option: it names
        the run whose saved options are used instead)."""
        return cls(**{k: v for k, v in opts.items() if k != "resume_dir"})

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any], where: str) -> RunOptions:
        """From a manifest's ``cli_options``, each value checked against its field's type;
        a bad or missing value is an InputError naming ``where`` and the option."""
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in saved:
                if f.default is dataclasses.MISSING:
                    raise InputError(f"{where}: cli_options.{f.name}: missing")
                continue
            values[f.name] = _typed(saved[f.name], hints[f.name], f"{where}: cli_options.{f.name}")
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        """As the manifest saves it: paths as strings, ``--targets`` redacted (a URL's user-info
        and query values are credentials: ``--resume`` asks for them again), everything else
        as is."""
        saved = {
            f.name: str(v) if isinstance(v, Path) else v
            for f in fields(self)
            for v in [getattr(self, f.name)]
        }
        return saved | {"targets": redact(self.targets)}

    def given_json(self, given: Mapping[str, str]) -> dict[str, Any]:
        """The flags the command line named (``given``: parameter name to flag), each with its
        value as the run took it (``to_json``): the manifest's ``cli_options``, an audit
        record. Nothing reads it back: the run is its ``RunSpec``."""
        saved = self.to_json()
        return {flag: saved[name] for name, flag in sorted(given.items()) if name in saved}

    def replace(self, **changes: Any) -> RunOptions:
        return dataclasses.replace(self, **changes)

    @property
    def length_policy(self) -> LengthPolicy:
        return LengthPolicy(self.length_scale, self.max_input_tokens, self.max_output_tokens)


def _typed(value: Any, hint: Any, where: str) -> Any:
    """``value`` as the field type ``hint`` (a plain type or ``T | None``) wants it."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise InputError(f"{where}: must not be null")
    for want in options:
        if want is Path and isinstance(value, str):
            return Path(value)
        if want is bool and isinstance(value, bool):
            return value
        if want is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if want is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if want is str and isinstance(value, str):
            return value
    names = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise InputError(f"{where}: expected {names}, got {value!r}")


RUN_OPTIONS = [
    click.option(
        "--trace",
        "trace_path",
        type=click.Path(path_type=Path),
        help="Trace file: kvcanary v1 JSONL, or a production trace (see --trace-format).",
    ),
    click.option(
        "--trace-format",
        default="auto",
        show_default=True,
        help=FORMAT_HELP,
    ),
    click.option(
        "--targets",
        default="bf16,fp8",
        show_default=True,
        help="Comma-separated: bf16/fp8 (local servers of --model), name=URL, or names "
        "from --targets-file.",
    ),
    click.option(
        "--targets-file",
        type=click.Path(path_type=Path, exists=True, dir_okay=False),
        help="TOML with [targets.NAME] tables (see scenarios/targets.example.toml).",
    ),
    click.option(
        "--model",
        "model_dir",
        type=click.Path(path_type=Path),
        help="Model folder for the built-in bf16/fp8 local targets, or a built-in model: "
        "embedded (the default: `replay model` prints it), twin, real (SmolLM2-135M-Instruct: "
        "`replay model --real`), long (Gemma 3 270M, 32K tokens, sliding-window layers: "
        "`replay model --long`).",
    ),
    click.option(
        "--concurrency",
        default="4",
        show_default=True,
        help="Closed loop: requests in flight; a list sweeps levels (1,4,16).",
    ),
    click.option("--rate", type=float, help="Open loop: Poisson arrivals at this many requests/s."),
    click.option("--trace-times", is_flag=True, help="Open loop at the trace's own timestamps."),
    click.option(
        "--time-scale",
        default=1.0,
        show_default=True,
        help="With --trace-times: multiply gaps (0.5 = twice as fast).",
    ),
    click.option(
        "--max-in-flight",
        default=0,
        show_default=True,
        help="Open loop: cap on requests in flight (0 = none).",
    ),
    click.option(
        "--buckets",
        "bucket_spec",
        default=DEFAULT_BOUNDS,
        show_default=True,
        help="Context-length bucket bounds in tokens.",
    ),
    click.option(
        "--on-bad-line",
        type=click.Choice(["fail", "skip"]),
        default="fail",
        show_default=True,
        help="A bad trace line stops the run, or is skipped and listed.",
    ),
    click.option(
        "--length-scale",
        default=1.0,
        show_default=True,
        help="Length-only traces: scale input/output lengths (fit a small model).",
    ),
    click.option("--max-input-tokens", type=int, help="Length-only traces: cap prompt length."),
    click.option("--max-output-tokens", type=int, help="Length-only traces: cap output length."),
    click.option("--limit", type=int, help="Replay only the first N requests."),
    click.option(
        "--exclude-ids",
        type=click.Path(path_type=Path, dir_okay=False),
        help="Leave out the request ids this file lists (one a line), e.g. the "
        "calibration_ids.txt of `kvcal sample`.",
    ),
    click.option(
        "--parallel-targets",
        is_flag=True,
        help="Run targets at the same time, each its own schedule (default: interleaved, "
        "see --interleave).",
    ),
    *MEASURING_OPTIONS,
    click.option(
        "--timeout",
        "timeout_s",
        default=600.0,
        show_default=True,
        help="Per-request timeout, seconds.",
    ),
    click.option(
        "--phase-timeout",
        "phase_timeout_s",
        default=3600.0,
        show_default=True,
        help="Time limit per phase; unsent requests are recorded as cancelled.",
    ),
    click.option(
        "--reference", help="Target the others are compared with [default: bf16, else the first]."
    ),
    click.option(
        "--candidate",
        help="Target judged against the reference (FP8 at scale 1.0) "
        "[default: a targets-file `role`, else the first other target that is not "
        "calibrated].",
    ),
    click.option(
        "--calibrated",
        help="Target with calibrated scales [default: a targets-file "
        "`role`, else a name with the word cal, calibrated or kvcal, as fp8-cal].",
    ),
    click.option(
        "--quality-pass",
        type=click.Choice(["load", "serial"]),
        default="load",
        show_default=True,
        help="Where quality is graded: the load phases' answers, or a first phase at "
        "concurrency 1 (c1) whose answers do not depend on batching (vLLM CPU cannot serve "
        "batch-invariant kernels); the load phases still measure the systems side.",
    ),
    click.option(
        "--skip-layers",
        metavar="NAME=LAYERS",
        help="Serve the local target NAME with these layers' KV cache in BF16 "
        "(--kv-cache-dtype-skip-layers; e.g. fp8-skip=0,29, or fp8-swa=sliding_window for "
        "every sliding-window layer): the layers arm of the stop rule, what `kvcal advise` "
        "proposes. A NAME no other option defines is FP8 (its name's format) on --model.",
    ),
    click.option(
        "--advice",
        "advice_path",
        type=click.Path(path_type=Path, dir_okay=False),
        help="A `kvcal advise --json` file: its emulated figures (layers to keep in BF16, "
        "per-head scales, the backend's rounding) become the verdict's next-step evidence.",
    ),
    click.option(
        "--emulate-fp8",
        is_flag=True,
        help="Serve local FP8 targets (fp8, fp8_e4m3, fp8_e5m2) with a BF16 cache and "
        "kvcal's FP8 round trip of K/V at the cache write (where the CPU cannot serve "
        "FP8): quality evidence only; capacity and speed are BF16's.",
    ),
    click.option(
        "--emulate-kv",
        is_flag=True,
        help="Serve every local target of a quantized KV format kvcanary emulates (FP8, "
        "per-token-head INT8/FP8/INT4, NVFP4) with a BF16 cache and that format's round "
        "trip of K/V at the cache write: quality evidence only.",
    ),
    click.option(
        "--accept-emulated",
        is_flag=True,
        help="Let the verdict rest on emulated targets (otherwise it refuses).",
    ),
    click.option(
        "--control/--no-control",
        default=None,
        help="Replay the reference a second time (A/A): the noise floor of every "
        "metric, latency's included [default: on when a candidate is compared with the "
        "reference].",
    ),
    click.option(
        "--no-teacher-forced",
        is_flag=True,
        help="Skip scoring the reference's answers under each target (prompt_logprobs).",
    ),
    click.option(
        "--tolerance",
        default=0.05,
        show_default=True,
        help="Quality drop (pass-rate points, 0.05 = 5) a bucket must be able to detect.",
    ),
    click.option(
        "--share-prefix-cache",
        is_flag=True,
        help="Let a phase reuse the prefix cache earlier phases filled (default: a "
        "cache salt per phase keeps phases comparable).",
    ),
    click.option(
        "--out",
        "out_dir",
        default=Path("reports"),
        type=click.Path(path_type=Path),
        show_default=True,
        help="Where run directories go.",
    ),
    click.option("--run-id", help="Name of the run directory [default: timestamp]."),
    click.option("--seed", default=0, show_default=True, help="Sampling and schedule seed."),
    click.option(
        "--min-pairs",
        default=20,
        show_default=True,
        help="Graded pairs a bucket needs before it counts as evidence.",
    ),
    click.option(
        "--required-capacity-ratio",
        default=1.5,
        show_default=True,
        help="FP8/BF16 KV-cache capacity that counts as the gain.",
    ),
    click.option(
        "--alpha", default=0.05, show_default=True, help="Significance level for a repeatable loss."
    ),
    click.option(
        "--slo",
        help="Service goals, e.g. ttft=2s,itl=80ms,e2e=30s, per bucket after a ';' "
        "('ttft=2s;>=32K:ttft=8s'): SLO attainment and goodput per bucket, and FP8 pays "
        "by goodput.",
    ),
    click.option(
        "--stop-at-saturation",
        is_flag=True,
        help="Sweeps: stop raising the load for a target once it is saturated (its "
        "throughput fell, or past its knee it misses the SLOs; without --slo, past its knee).",
    ),
    click.option(
        "--sequential",
        is_flag=True,
        help="Sequential canary: serve the reference and the candidate at once and send the "
        "trace in rounds, stopping as soon as every bucket is decided (always-valid evidence "
        "read after every round; --max-requests and --max-time bound it).",
    ),
    click.option(
        "--round-size",
        default=20,
        show_default=True,
        type=click.IntRange(min=1),
        help="With --sequential: requests per open bucket in each round.",
    ),
    click.option(
        "--max-requests",
        type=click.IntRange(min=1),
        help="With --sequential: stop after this many requests (pairs) sent.",
    ),
    click.option(
        "--max-time",
        type=click.FloatRange(min=0.0, min_open=True),
        help="With --sequential: stop after this many seconds of rounds.",
    ),
    click.option(
        "--workers",
        default=1,
        show_default=True,
        type=click.IntRange(min=1),
        help="Load processes that send each phase, each with its own event loop and "
        "connections, into one run directory (a closed loop's concurrency is split among them).",
    ),
    click.option(
        "--session-history",
        type=click.Choice(["trace", "reference"]),
        default="trace",
        show_default=True,
        help="Multi-turn sessions: send each turn as the trace has it (its logged history), "
        "or with the reference target's answers to the earlier turns (every target the same).",
    ),
    click.option(
        "--think-time",
        default="auto",
        show_default=True,
        help="Multi-turn sessions: seconds between a turn's end and the next turn, or auto "
        "(the trace's gap between their arrivals, times --time-scale).",
    ),
    click.option(
        "--max-errors",
        type=click.IntRange(min=1),
        help="Stop sending to a target after this many failed requests (it fails).",
    ),
    click.option(
        "--max-error-rate",
        default=0.05,
        show_default=True,
        type=click.FloatRange(0.0, 1.0),
        help="A target with more failed requests than this share (after 20) gets no "
        "more and fails; replay then exits 4. 1 turns it off.",
    ),
    click.option(
        "--drain",
        "drain_s",
        default=30.0,
        show_default=True,
        help="On Ctrl-C or SIGTERM: seconds in-flight requests get to finish.",
    ),
    click.option(
        "--resume",
        "resume_dir",
        type=click.Path(path_type=Path, file_okay=False, exists=True),
        help="Continue an interrupted or killed run in this run directory (its "
        "options are read from its manifest).",
    ),
    click.option(
        "--markdown",
        "markdown_path",
        type=click.Path(path_type=Path),
        help="Also write the Markdown summary here (for a PR comment).",
    ),
]


def run_options(f: F) -> F:
    """The run options on a command, in the order --help lists them."""
    for option in reversed(RUN_OPTIONS):
        f = option(f)
    return f
