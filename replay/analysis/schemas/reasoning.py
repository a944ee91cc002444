"""The records of reasoning length in summary.json (``reasoning``): each target's reasoning
tokens per bucket against the reference's and the A/A floor (``analysis.reasoning`` builds
them; ``schemas`` holds the rest of the summary)."""

from __future__ import annotations

from collections.abc import Mapping

from replay.core.record_json import Record, record


@record
class ReasoningDelta(Record):
    """A target's reasoning tokens minus the reference's on the requests both answered, in one
    bucket: means, the mean difference with a paired bootstrap interval, and the A/A
    control's upper bound in the same bucket (None: no control ran, or it has no pair here)."""

    pairs: int
    reference_mean: float | None
    target_mean: float | None
    delta_mean: float | None
    lo: float | None
    hi: float | None
    floor_hi: float | None


@record
class ReasoningLength(Record):
    """``analysis.reasoning``: phase -> target -> bucket, for runs whose answers reasoned."""

    reference: str | None
    control: str | None  # the A/A control's name, when it ran
    phases: Mapping[str, Mapping[str, Mapping[str, ReasoningDelta]]]
