"""``Thresholds``: the stop rule's parameters. Their evidence rule (``Thresholds.rule``, a
``stats.rule.Rule``) is the one grading's evidence column, the verdict and the sequential canary
apply. Their own module, below the verdict and the run spec that both carry them, so that the
manifest's records can hold the run spec without a cycle."""

from __future__ import annotations

from dataclasses import dataclass

from replay.analysis.stats.equivalence import ALPHA, MIN_PAIRS, TOLERANCE
from replay.analysis.stats.rule import Rule

# The systems rule's smallest change that counts (--systems-threshold; ``systems_cells``).
# Here rather than there, so that the manifest's records (``schemas.manifest``) hold the run
# spec without importing the systems rule, which imports them.
SYSTEMS_THRESHOLD = 0.05


@dataclass(frozen=True)
class Thresholds:
    tolerance: float = TOLERANCE  # largest acceptable pass-rate drop per bucket (/100)
    alpha: float = ALPHA  # level of a loss and of the bound that shows a match
    min_pairs: int = MIN_PAIRS  # graded pairs a bucket needs to count as evidence
    required_capacity_ratio: float = 1.5  # FP8 / BF16 KV-cache tokens that count as the gain
    capacity_needed_usage: float = 0.5  # peak KV usage of the reference that means "needed"
    max_error_rate: float = 0.05  # failed requests above this make a target "failed"
    # Teacher-forced divergence that warns (never decides): a per-token NLL increase whose
    # interval lies above this and above the A/A floor, or a top-1 agreement whose interval
    # lies below 1 - this and below the floor's.
    tf_warn_nll: float = 0.05
    tf_warn_top1: float = 0.05
    # Reasoning length that warns (never decides): a bucket where the target's reasoning
    # tokens exceed the reference's by an interval lying above this share of the
    # reference's mean and above the A/A floor, over at least ``reasoning_warn_pairs``.
    reasoning_warn: float = 0.10
    reasoning_warn_pairs: int = 5
    # Decide on emulated FP8 arms (quality only) instead of refusing to.
    accept_emulated: bool = False
    # The systems rule (``systems_cells``): the smallest change of a latency or a rate that
    # counts as faster, slower, more or fewer (either way: x1.05 or /1.05 at 0.05).
    systems_threshold: float = SYSTEMS_THRESHOLD

    @property
    def rule(self) -> Rule:
        """The evidence rule of ``tolerance``, ``alpha`` and ``min_pairs`` (checked here): the
        one place a ``Rule`` is made from a run's thresholds."""
        return Rule(tolerance=self.tolerance, alpha=self.alpha, min_pairs=self.min_pairs)
