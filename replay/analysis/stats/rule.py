"""``Rule``: the evidence rule every reading of a bucket's pairs applies, checked once.

Its tolerance, alpha and minimum pairs are the stop rule's (``Thresholds.rule`` makes it from
a run's thresholds, and nothing else does), so grading's evidence column, the verdict and the
sequential canary read the same pairs the same way: :meth:`Rule.evidence` (a loss, a drop
shown below the tolerance, or neither yet: ``evidence``) and :meth:`Rule.equivalent` (the
bound alone: ``equivalence``). ``pool_share`` is the sequential canary's split of its LOSS
alpha between the pool and the buckets (:meth:`Rule.bucket_loss_alpha`,
:meth:`Rule.pool_loss_alpha`; ``sequential.state`` says why).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from replay.analysis.stats.equivalence import (
    ALPHA,
    MIN_PAIRS,
    TOLERANCE,
    check_tolerance_alpha,
    equivalent,
)
from replay.analysis.stats.evidence import Evidence, evidence
from replay.analysis.stats.pairs import discordant

POOL_SHARE = 0.5
"""Share of the sequential LOSS alpha the pooled question gets; the buckets share the rest."""


@dataclass(frozen=True, slots=True)
class Rule:
    """Tolerance, alpha, minimum pairs and the sequential LOSS alpha's split, checked when
    made: 0 < tolerance < 1, 0 < alpha < 0.5, min_pairs >= 0 and 0 < pool_share < 1."""

    tolerance: float = TOLERANCE
    alpha: float = ALPHA
    min_pairs: int = MIN_PAIRS
    pool_share: float = POOL_SHARE

    def __post_init__(self) -> None:
        check_tolerance_alpha(self.tolerance, self.alpha, "Rule")
        if self.min_pairs < 0 or not 0.0 < self.pool_share < 1.0:
            raise ValueError(
                f"Rule: need min_pairs >= 0 and 0 < pool_share < 1 (got "
                f"{self.min_pairs}, {self.pool_share})"
            )

    def evidence(
        self,
        n_pairs: int,
        regressions: int = 0,
        improvements: int = 0,
        *,
        loss_alpha: float | None = None,
    ) -> Evidence:
        """What a bucket's pairs settle under this rule (``evidence.evidence``): a loss at
        ``loss_alpha`` (default alpha; the verdict passes alpha / phases for a sweep)."""
        return evidence(
            n_pairs,
            regressions,
            improvements,
            tolerance=self.tolerance,
            alpha=self.alpha,
            min_pairs=self.min_pairs,
            loss_alpha=loss_alpha,
        )

    def paired_evidence(self, a: Sequence[bool], b: Sequence[bool]) -> Evidence:
        """:meth:`evidence` of paired grades (a: reference, b: candidate), from their
        discordant counts."""
        return self.evidence(*discordant(a, b, "Rule.paired_evidence"))

    def equivalent(self, n: int, regressions: int, improvements: int) -> bool:
        """Is the drop shown below the tolerance (``equivalence.equivalent``)? The bound
        alone: unlike :meth:`evidence`, a loss does not stop it."""
        return equivalent(
            n,
            regressions,
            improvements,
            tolerance=self.tolerance,
            alpha=self.alpha,
            min_pairs=self.min_pairs,
        )

    def bucket_loss_alpha(self, buckets: int) -> float:
        """Level of one bucket's sequential LOSS question in a run of ``buckets`` buckets."""
        return self.alpha if buckets <= 1 else self.alpha * (1 - self.pool_share) / buckets

    def pool_loss_alpha(self) -> float:
        """Level of the sequential pooled LOSS question (asked only with two buckets or
        more)."""
        return self.alpha * self.pool_share
