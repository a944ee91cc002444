"""``RunSpec``: what one run was asked to do, as plain typed data that both drivers produce (the
CLI from its ``RunOptions``, the Locust adapter from its ``Config``), the manifest records in
its ``run_spec`` block and reads back typed (``Manifest.run_spec``), and a re-analysis or a resume
can compare. Built of five records: the trace, the load, quality, the error budget and the run
directory. A field a driver has no equivalent of says so in its default and its comment; there
is no second type per driver."""

from __future__ import annotations

from replay.analysis.thresholds import Thresholds
from replay.core.record_json import Record, record

_DEFAULT = Thresholds()


@record
class TraceSpec(Record):
    """Which trace ran, and how its lengths were changed (the CLI's length policy; Locust
    replays the trace's own lengths, the defaults)."""

    path: str
    format: str
    sha256: str
    requests: int  # valid requests replayed (after --limit and --exclude-ids)
    length_scale: float = 1.0
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None


@record
class LoadSpec(Record):
    """Who gets the load and how: the targets by name, the phases by label, and how they are
    sent."""

    targets: tuple[str, ...]
    schedules: tuple[str, ...]  # phase labels, in order (c1, c4, poisson-2rps, trace-x1)
    seed: int = 0
    timeout_s: float = 600.0  # per request
    phase_timeout_s: float | None = None  # None: phases have no time limit (Locust)
    workers: int = 1  # load processes (the CLI's --workers; Locust's shards)
    salt_phases: bool = True
    loop: bool = False  # the trace starts over when exhausted (Locust's --kvc-loop; never the CLI)
    parallel_targets: bool = False  # the CLI only; Locust drives one target
    interleave: bool = False  # the CLI only
    block_size: int = 0
    session_history: str = "trace"  # Locust sends each turn as the trace has it
    stop_at_saturation: bool = False  # the CLI only


@record
class QualitySpec(Record):
    """How answers are grouped, graded and judged. The CLI grades every answer; Locust can turn
    the checkers off, has one target (the reference: None as in the CLI's default) and scores
    no answer teacher-forced."""

    buckets: str  # the bounds, as --buckets takes them
    slo: str | None = None  # as --slo takes it
    checkers: bool = True
    reference: str | None = None
    candidate: str | None = None
    calibrated: str | None = None
    control: bool = False
    teacher_forced: bool = False
    quality_phase: str | None = None  # the one phase the stop rule's quality side reads
    tolerance: float = _DEFAULT.tolerance
    alpha: float = _DEFAULT.alpha
    min_pairs: int = _DEFAULT.min_pairs
    required_capacity_ratio: float = _DEFAULT.required_capacity_ratio
    accept_emulated: bool = False
    systems_threshold: float = _DEFAULT.systems_threshold

    def thresholds(self, max_error_rate: float | None) -> Thresholds:
        """The verdict's thresholds; ``max_error_rate``: the budget's (None: the default)."""
        return Thresholds(
            tolerance=self.tolerance,
            alpha=self.alpha,
            min_pairs=self.min_pairs,
            required_capacity_ratio=self.required_capacity_ratio,
            max_error_rate=_DEFAULT.max_error_rate if max_error_rate is None else max_error_rate,
            accept_emulated=self.accept_emulated,
            systems_threshold=self.systems_threshold,
        )


@record
class BudgetSpec(Record):
    """What stops sending: the error budget (per target in the CLI, per worker in Locust), the
    drain after an interrupt, and how many results are stored."""

    max_errors: int | None = None  # None: no absolute cap
    max_error_rate: float | None = 0.05
    drain_s: float | None = None  # None: no drain (Locust's own stop waits for its results)
    max_results: int | None = None  # None: every result is stored (the CLI)


@record
class RunDirSpec(Record):
    """Where the run is written, and whether it continues an interrupted run there."""

    path: str
    resume: bool = False


@record
class RunSpec(Record):
    """One run, as both drivers describe it."""

    trace: TraceSpec
    load: LoadSpec
    quality: QualitySpec
    budget: BudgetSpec
    run_dir: RunDirSpec
