"""The records of the trend across context length in summary.json (``TargetQuality.trend``):
per phase and compared target, how its paired difference to the reference changes per doubling
of the prompt's tokens (``stats.trend`` fits it, ``grading.trend`` gathers the requests;
``schemas`` holds the rest of the summary)."""

from __future__ import annotations

from replay.core.record_json import Record, absent_if_none, record


@record
class LengthSlope(Record):
    """The least-squares slope of a per-request paired difference against log2(prompt
    tokens): its change per doubling of context, with an interval at the run's alpha (95% by
    default) from a bootstrap that resamples requests within each bucket, and the two-sided
    p-value of "no trend". Without a slope (too few requests or buckets, one context length)
    ``reason`` says why."""

    requests: int  # requests with a difference and a known prompt length
    buckets: int  # buckets holding them
    slope: float | None  # per doubling of context (a pass-rate difference, or ΔNLL per token)
    lo: float | None  # the interval's ends
    hi: float | None
    p_value: float | None  # two-sided, of "no trend": the bootstrap's share beyond 0, doubled
    reason: str | None = absent_if_none()  # why no slope (None: fitted)


@record
class Trend(Record):
    """A target's trend across context length in one phase. ``graded``: its graded pairs as
    the verdict pools them (explicit checks against the reference's grade, derived grades
    against the A/A control's), candidate minus baseline, per request. ``teacher_forced``: the
    reference's answer scored under the target, its ΔNLL per token, per request. The A/A
    control's own trend is its explicit checks against the reference's (its derived grades
    are every candidate's baseline, so they have no A/A pair of their own) and its
    teacher-forced ΔNLL; every other target carries it as its floor."""

    graded: LengthSlope  # a pass-rate difference per doubling of context
    teacher_forced: LengthSlope  # a ΔNLL per token per doubling of context
    # The A/A control's slopes in the same phase: the trend's noise floor. Absent for the
    # control itself, and where no control ran.
    graded_floor: LengthSlope | None = absent_if_none()
    teacher_forced_floor: LengthSlope | None = absent_if_none()  # the same, of its ΔNLL
