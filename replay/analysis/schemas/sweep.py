"""The records of a load sweep in summary.json (``saturation``): each target's latency and
throughput against load, its knee and the SLOs' ceiling (``analysis.saturation`` builds them;
``schemas`` holds the rest of the summary)."""

from __future__ import annotations

from collections.abc import Mapping

from replay.core.record_json import Record, absent_if_none, record


@record
class LoadPoint(Record):
    """One level of a sweep (a phase) for one target and bucket, or the phase's totals."""

    phase: str
    load: float | None  # requests in flight (concurrency) or requests per second (rate)
    requests: int
    ok: int
    throughput_rps: float | None  # successful requests per second of the phase
    throughput_out_tok_s: float | None
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    queue_delay_p50_ms: float | None
    queue_delay_p90_ms: float | None
    slo_attainment: float | None = absent_if_none()  # only with --slo
    goodput_rps: float | None = absent_if_none()


@record
class Knee(Record):
    """The last level before the curve bends (``saturation.KneeRule``): what bent, and how."""

    phase: str
    load: float | None
    metric: str  # the LoadPoint field that bent: ttft_p90_ms, queue_delay_p90_ms, throughput_rps
    reason: str


@record
class SloCeiling(Record):
    """The highest level up to which every level met the SLOs; None: not even the first."""

    attainment: float | None  # the share of requests within every bound that counts as met
    phase: str | None
    load: float | None


@record
class LoadCurve(Record):
    points: tuple[LoadPoint, ...]  # in rising load
    knee: Knee | None  # None: no knee within the sweep
    max_load_meeting_slo: SloCeiling | None = absent_if_none()  # only with --slo


@record
class TargetSaturation(Record):
    all: LoadCurve
    buckets: Mapping[str, LoadCurve]  # in the run's bucket order


@record
class Saturation(Record):
    """A sweep's phases (``c<N>``: concurrency, ``poisson-<r>rps``: rate) as load curves."""

    kind: str  # "concurrency" or "rate"
    phases: tuple[str, ...]  # the sweep's phases, in rising load
    attainment: float | None  # the SLO attainment a level must reach to meet the SLOs
    rule: Mapping[str, float]  # the knee rule's parameters (``saturation.KneeRule``)
    targets: Mapping[str, TargetSaturation]
