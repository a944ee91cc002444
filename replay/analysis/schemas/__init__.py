"""The records the analysis passes between its stages, which are also what summary.json holds.

    Summary                      summary.json: targets, quality, systems, saturation, verdict
    ├── TargetSummary            one target: served cache dtype and size, its phases
    │   ├── LayerCapacity        its cache read per layer type, where its model is here
    │   └── PhaseSummary         one phase: its window, totals, server figures, buckets
    │       ├── PhaseTotals      ResultStats of the whole phase, with output throughput
    │       ├── ServerStats      figures from the scraped /metrics over the phase
    │       └── BucketStats      ResultStats of one bucket, with the KV-cache capacity
    │                            (ResultStats hold SloStats when the run has --slo, and
    │                            ReasoningStats where the answers reasoned)
    ├── Quality                  phase -> target -> TargetQuality, and notes
    │   └── TargetQuality        buckets (BucketQuality), all (QualityTotals), shift, TF,
    │       │                    the trend across context length (Trend)
    │       └── BucketQuality    explicit checks (Comparison), derived grades, the combined
    │                            pairs the verdict decides on, teacher-forced scores, floor
    ├── Systems                  paired latency per bucket (LatencyDelta), fits (Fit), the
    │                            systems rule's cells (SystemsRule), the capacity phase
    ├── Saturation               a load sweep's curves (``schemas.sweep``), per target
    ├── Sequential               a sequential canary's decision, buckets and interval path
    ├── ReasoningLength          reasoning tokens per target x bucket against the reference
    └── Verdict                  the stop rule's outcome (``verdict.rule.decide``); with
                                 several candidates, one per candidate as well

Every record is a frozen dataclass (``record_json``): ``to_json()`` gives exactly the JSON
summary.json has always held, field order being key order, and ``from_json(data)`` reads it
back, type-checked, naming the field when a value is wrong. Missing keys (older summaries) read
as None, 0 or empty; ``absent_if_none`` and ``Omitted`` mark keys that are sometimes left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from replay.analysis.schemas.layers import LayerCapacity as LayerCapacity
from replay.analysis.schemas.reasoning import ReasoningDelta as ReasoningDelta
from replay.analysis.schemas.reasoning import ReasoningLength as ReasoningLength
from replay.analysis.schemas.sequential import Sequential as Sequential
from replay.analysis.schemas.sequential import SequentialBucket as SequentialBucket
from replay.analysis.schemas.sweep import Saturation
from replay.analysis.schemas.systems import CapacityArm as CapacityArm
from replay.analysis.schemas.systems import CapacityPhase as CapacityPhase
from replay.analysis.schemas.systems import SystemsCell as SystemsCell
from replay.analysis.schemas.systems import SystemsRule as SystemsRule
from replay.analysis.schemas.trend import LengthSlope as LengthSlope
from replay.analysis.schemas.trend import Trend as Trend
from replay.core.errors import SummaryError as SummaryError
from replay.core.record_json import OMITTED as OMITTED
from replay.core.record_json import Omitted as Omitted
from replay.core.record_json import Record, absent_if_none, record

Interval = tuple[float, float]  # (low, high): a Wilson or bootstrap interval


# -- the summary: latency, throughput and server figures ------------------------------------


@record
class Percentiles(Record):
    """Milliseconds (``summary.PCTS``, numpy's linear interpolation); None: nothing measured."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None


@record
class Capacity(Record):
    """The cache in tokens, and how many sequences of the bucket's median context it holds."""

    kv_cache_size_tokens: float | None
    concurrency_at_context: float | None
    # True: counted per layer type (``TargetSummary.layer_capacity``); absent: tokens / context.
    per_layer_type: bool | None = absent_if_none()


@record
class SloStats(Record):
    """A group of results against the run's SLOs (``replay/core/slo.py``). ``attainment`` is
    the share of the requests sent (cancelled ones left out) that succeeded within every bound;
    ``goodput_rps`` those requests per second of the phase."""

    bounds_ms: Mapping[str, float]  # the bounds that applied: ttft_ms, itl_ms, e2e_ms
    sent: int
    met: int
    attainment: float | None
    met_by_metric: Mapping[str, int]  # requests within each bound, whatever the others
    goodput_rps: float | None


@record
class SessionStats(Record):
    """Later turns of multi-turn sessions in a group: how much of their prompts the previous
    turn's prompt and answer began with (what a prefix cache could serve), from token ids."""

    later_turns: int
    measured: int  # later turns whose prompt and previous tokens are known
    reused_prefix_tokens_mean: float | None
    reused_prefix_share: float | None  # reused tokens over their prompt tokens


@record
class ReasoningStats(Record):
    """The answers of a group that reasoned before answering (a reasoning model behind a
    reasoning parser). ``ttft_ms`` beside it counts the first token of either kind; this is
    the time to the first answer token, over the answers that gave one. Reasoning tokens are
    in ``output_tokens`` too (the server generated them); ``no_answer`` counts the ok answers
    whose reasoning was cut (by max_tokens) before any answer."""

    answers: int  # ok answers with reasoning
    tokens: int  # their reasoning tokens
    tokens_median: float | None
    tokens_estimated: bool  # some counts are the client's (no count from the server)
    time_to_answer_ms: Percentiles
    no_answer: int


@record
class ResultStats(Record):
    """Client-side figures of a group of results (a phase, or one bucket of it)."""

    requests: int
    ok: int
    errors: int
    errors_by_kind: Mapping[str, int]
    output_tokens: int
    prompt_tokens_median: float | None
    output_tokens_median: float | None
    ttft_ms: Percentiles
    ttft_from_schedule_ms: Percentiles
    queue_delay_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    decode_tok_s_median: float | None
    tokens_estimated: bool
    slo: SloStats | None = absent_if_none()  # only with --slo
    sessions: SessionStats | None = absent_if_none()  # only for traces with sessions
    # Requests not sent because their prompt does not fit the target's max_model_len: neither
    # ok nor errors (absent when there are none).
    skipped_too_long: int | None = absent_if_none()
    reasoning: ReasoningStats | None = absent_if_none()  # only where answers reasoned


@record
class PhaseTotals(ResultStats):
    throughput_out_tok_s: float | None


@record
class BucketStats(ResultStats):
    capacity: Capacity


@record
class ServerStats(Record):
    """From the snapshots scraped inside the phase (counter deltas cover exactly the phase)."""

    scrapes: int
    peak_kv_usage: float | None
    peak_running: float | None
    peak_waiting: float | None
    preemptions: float | None
    prefix_cache_hit_rate: float | None
    server_ttft_mean_ms: float | None
    server_itl_mean_ms: float | None
    server_e2e_mean_ms: float | None
    # Requests the server finished inside the phase: its means are over these, which are the
    # phase's own answers unless other traffic shared the server.
    server_finished: float | None


@record
class PhaseSummary(Record):
    start: float | None
    end: float | None
    duration_s: float | None
    all: PhaseTotals
    server: ServerStats
    buckets: Mapping[str, BucketStats]  # in the run's bucket order


@record
class TargetSummary(Record):
    status: str | None
    reason: str | None
    cache_dtype: str | None
    kv_cache_size_tokens: float | None
    phases: Mapping[str, PhaseSummary]
    layer_capacity: LayerCapacity | None = absent_if_none()  # where its model's layout is known


# -- quality: explicit checks, derived grades, the pairs the verdict decides on ---------------


@record
class EvidenceRule(Record):
    tolerance: float | None
    alpha: float | None
    min_pairs: int | None
    power: float | None


@record
class EvidenceSummary(Record):
    """``stats.evidence.Evidence.to_json()``: what a bucket's pairs settle (summaries written
    before the exact rule carry no ``status`` or ``short``)."""

    status: str | None
    sufficient: bool
    needed: int | None
    p_value: float | None
    drop_bound: float | None
    rule: EvidenceRule
    short: str | None
    reason: str | None


@record
class Agreement(Record):
    """Answers compared with the reference's to the same request: exact and normalized rates."""

    compared: int
    exact: float | None
    normalized: float | None
    first_divergence_median: float | None


@record
class VsReference(Record):
    """Paired checker outcomes against the reference: bootstrap interval and McNemar."""

    pairs: int
    diff: float | None
    lo: float | None
    hi: float | None
    mcnemar_p: float | None
    ref_only: int
    target_only: int


@record
class Comparison(Record):
    """A target's explicit checks in a group of requests, beside the reference's."""

    answered: int
    requests: int
    graded: int
    passed: int
    pass_rate: float | None
    wilson: Interval | None
    vs_reference: VsReference | None
    agreement: Agreement
    evidence: EvidenceSummary | None = absent_if_none()  # None: written before the column


@record
class RuleCounts(Record):
    graded: int
    passed: int
    ungraded: int


@record
class RuleFloor(Record):
    """One derived rule in one phase: how many of the A/A control's answers it graded out of
    the phase's requests (its share), the control's pass rate (the rule's floor: what the
    reference scores against itself), each target's counts, and whether it is demoted (its
    floor says it grades noise, so its pairs leave the comparison the verdict decides on)."""

    requests: int
    graded: int
    passed: int
    floor: float | None
    demoted: bool
    targets: Mapping[str, RuleCounts]


@record
class VsControl(Record):
    """Derived grades paired with the A/A control's derived grades of the same requests."""

    pairs: int
    control_pass_rate: float | None
    pass_rate: float | None
    diff: float | None
    lo: float | None
    hi: float | None
    mcnemar_p: float | None
    control_only: int
    target_only: int


@record
class DerivedComparison(Record):
    """Grades against the reference's answer, of requests without a check."""

    graded: int
    passed: int
    pass_rate: float | None
    wilson: Interval | None
    ungraded: int
    checker_errors: int
    by_rule: Mapping[str, RuleCounts]
    exact_rate: float | None
    vs_control: VsControl | None


@record
class Combined(Record):
    """Every graded pair, explicit and derived pooled: what the verdict decides on."""

    pairs: int
    explicit: int
    derived: int
    baseline: str | None  # "control" (the A/A control's derived grades) or "pass"
    diff: float | None
    lo: float | None
    hi: float | None
    mcnemar_p: float | None
    ref_only: int
    target_only: int
    evidence: EvidenceSummary


@record
class TeacherForced(Record):
    """The reference's answers scored under a target: per-token NLL change and top-1."""

    tokens: int
    requests: int
    errors: int
    nll_delta_mean: float | None
    nll_delta_lo: float | None
    nll_delta_hi: float | None
    top1_agreement: float | None
    top1_lo: float | None
    top1_hi: float | None
    identical_to_reference: bool


@record
class NoiseFloor(Record):
    """The A/A control's figures in the same bucket: how far two replays of one server differ."""

    diff: float | None
    lo: float | None
    hi: float | None
    agreement_exact: float | None
    nll_delta_mean: float | None
    nll_delta_hi: float | None
    top1_lo: float | None


@record
class QualityTotals(Comparison):
    derived: DerivedComparison | None = absent_if_none()  # None: written before derived grades


@record
class BucketQuality(QualityTotals):
    # Omitted for the reference and its control (not compared); None: no graded pair.
    combined: Combined | Omitted | None = OMITTED
    teacher_forced: TeacherForced
    # Omitted when no A/A control ran in the phase; None: the control has no such bucket.
    noise_floor: NoiseFloor | Omitted | None = OMITTED


@record
class Shift(Record):
    """The stratified test for a consistent downward shift across buckets."""

    p_value: float | None
    direction: str | None
    ref_only: int
    target_only: int
    pairs: int


@record
class TargetQuality(Record):
    buckets: Mapping[str, BucketQuality]
    all: QualityTotals
    shift: Shift | None  # None for the reference
    teacher_forced: TeacherForced
    # Change per doubling of context (``schemas.trend``); None for the reference, and in
    # summaries written before the trend.
    trend: Trend | None = absent_if_none()


@record
class Quality(Record):
    reference: str | None
    tolerance: float | None
    alpha: float | None
    min_pairs: int | None
    phases: Mapping[str, Mapping[str, TargetQuality]]  # phase -> target
    notes: tuple[str, ...]
    # phase -> derived rule; None (left out) where no A/A control ran, and in older summaries.
    rules: Mapping[str, Mapping[str, RuleFloor]] | None = absent_if_none()


# -- systems ----------------------------------------------------------------------------------


@record
class LatencyDelta(Record):
    """Candidate minus reference on the same requests, ms, with a bootstrap interval."""

    reference_median: float | None
    candidate_median: float | None
    delta_mean: float | None
    lo: float | None
    hi: float | None
    pairs: int


@record
class SystemsBucket(Record):
    """One bucket's paired deltas; a metric without pairs there is left out."""

    ttft_ms: LatencyDelta | None = absent_if_none()
    e2e_ms: LatencyDelta | None = absent_if_none()
    itl_ms: LatencyDelta | None = absent_if_none()


@record
class Fit(Record):
    """Latency against prompt tokens, a least-squares line per target, and where they cross."""

    reference: Interval | None  # (intercept, slope)
    candidate: Interval | None
    tokens: float | None
    fp8_wins: str | None  # "always", "never", "above", "below" or "unknown"


@record
class Systems(Record):
    reference: str | None
    candidate: str | None
    phase: str | None
    pairs: int
    buckets: Mapping[str, SystemsBucket]
    fits: Mapping[str, Fit]
    median_context_tokens: float | None
    # A latency cell better and none worse (``rule``); None: nothing was weighed.
    latency_better: bool | None
    below_break_even: bool | None
    throughput_ratio: float | None
    rule: SystemsRule | None = absent_if_none()  # None: written before the systems rule
    capacity: CapacityPhase | None = absent_if_none()  # None: no capacity phase planned


# -- the verdict and the whole summary --------------------------------------------------------


@record
class Verdict(Record):
    """``verdict.rule.decide``'s outcome. Each evidence entry is the verdict's own JSON object:
    its keys depend on its kind (a serving finding has kind and text, a quality finding the
    bucket's facts and evidence as well), and the decision reads them by key."""

    verdict: str
    exit_code: int
    headline: str
    reasons: tuple[str, ...]
    evidence: tuple[Mapping[str, Any], ...] = ()


@record
class Summary(Record):
    """summary.json (version ``summary.SUMMARY_VERSION``)."""

    version: int | None
    targets: Mapping[str, TargetSummary]
    run_dir: str | None = absent_if_none()
    driver: Mapping[str, Any] | None = absent_if_none()  # a Locust run: what drove it
    quality: Quality | None = absent_if_none()  # None: not graded (Locust, checkers off)
    systems: Systems | None = absent_if_none()  # None: no candidate compared
    saturation: Saturation | None = absent_if_none()  # None: the phases are not a load sweep
    sequential: Sequential | None = absent_if_none()  # None: not a sequential canary
    reasoning: ReasoningLength | None = absent_if_none()  # None: no answer reasoned
    verdict: Verdict | None = absent_if_none()  # None: no verdict (a Locust run)
    # Several candidates (verdict.candidates): each one's verdict; the primary's is `verdict`.
    candidates: Mapping[str, Verdict] | None = absent_if_none()
