"""``RunSpec``: one run, complete, as plain typed data: every option that changes what is sent
or how it is decided. Both drivers build it once from their own options (the CLI from its
``RunOptions``, the Locust adapter from its ``Config``); the manifest records it in its
``run_spec`` block, and it is what the runner runs, what ``--resume`` continues and what the
analysis and ``replay report --reanalyse`` read (``Manifest.run_spec``). Built of records: the
trace, the targets, the load, quality, the error budget, the run directory, and the sequential
canary's rounds and the capacity phase where the run has them. A field a driver has no
equivalent of says so in its default and its comment; there is no second type per driver."""

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
    on_bad_line: str = "fail"  # Locust: a bad line stops the test
    limit: int | None = None  # the first N requests only
    exclude_ids: str | None = None  # a file of request ids left out (the CLI only)


@record
class TargetsSpec(Record):
    """How the targets were named: as given (a URL's credentials redacted: a resume asks for
    them again), the file that defines them, the model of the local ones, the layers kept in
    BF16, and the KV formats emulated instead of served."""

    given: str
    targets_file: str | None = None
    model: str | None = None  # the CLI only; Locust drives a running server
    skip_layers: str | None = None  # NAME=LAYERS, the CLI only
    emulate: str | None = None  # "fp8" or "kv" (the CLI only)
    startup_timeout_s: float = 900.0  # for the servers the run starts itself


@record
class LoadSpec(Record):
    """Who gets the load and how: the targets by name, the phases by label, and how they are
    sent."""

    targets: tuple[str, ...]
    schedules: tuple[str, ...]  # phase labels, in order (c1, c4, poisson-2rps, trace-x1)
    # What the phases are made of: closed-loop levels, or an open loop at a Poisson rate or
    # at the trace's own times (its gaps times ``time_scale``), at most ``max_in_flight``.
    concurrency: str = "4"
    rate: float | None = None
    trace_times: bool = False
    time_scale: float = 1.0
    max_in_flight: int = 0
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
    think_time: str = "auto"  # between a session's turns: the trace's gaps, or seconds
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
    advice: str | None = None  # a `kvcal advise --json` file: the verdict's next-step evidence

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
class SequentialSpec(Record):
    """The sequential canary (``--sequential``): requests per open bucket in a round, and its
    bounds (pairs sent, seconds of rounds)."""

    round_size: int = 20
    max_requests: int | None = None
    max_time_s: float | None = None


@record
class CapacitySpec(Record):
    """The capacity phase (replay/run/capacity_phase.py): ``mode`` on, off, or auto (run when the
    workload's own load never filled the reference's cache and the quality side left the
    verdict to whether FP8 pays); its closed loop's concurrency; the KV-cache memory of its
    servers in MiB (0: sized from the workload); the time its blocks may take."""

    mode: str = "off"
    concurrency: int = 12
    cache_mib: int = 0
    time_limit_s: float = 600.0


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
    # Read as empty from a manifest written before the run spec held them.
    targets: TargetsSpec | None = None
    capacity: CapacitySpec = CapacitySpec()
    sequential: SequentialSpec | None = None  # None: fixed phases, not rounds

    @property
    def thresholds(self) -> Thresholds:
        """The verdict's thresholds: quality's, with the error budget's rate."""
        return self.quality.thresholds(self.budget.max_error_rate)
