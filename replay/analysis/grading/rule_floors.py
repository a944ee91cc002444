"""Each derived rule's A/A floor in a phase, and the rules demoted for grading noise.

A derived grade asks whether a target's answer agrees with the reference's by one rule (the
facts it copied from the prompt, its JSON value, its code's behaviour ...). The A/A control is
the reference replayed: its pass rate under a rule is what that rule gives when nothing but
the serving's nondeterminism differs, the rule's floor. On a real model's free text a rule
can grade noise (the reference's answer picked incidental strings as facts; a sampled
summary words itself differently); its pairs then add discordance in both directions and
bury a real loss. A rule whose floor is below ``NOISY_BELOW`` over at least
``MIN_GRADED`` control answers is demoted: it is still graded and shown, but its pairs
leave the comparison the verdict decides on, and a note says so. With fewer answers the
floor is too uncertain to demote on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from replay.analysis.schemas import RuleCounts, RuleFloor

if TYPE_CHECKING:
    import pandas as pd

NOISY_BELOW = 0.8
MIN_GRADED = 20


def _counts(rows: pd.DataFrame) -> dict[str, RuleCounts]:
    graded = rows[rows["rule"].notna()]
    out = {}
    for rule, sub in graded.groupby("rule", sort=True):
        outcome = sub["d_passed"]
        out[str(rule)] = RuleCounts(
            graded=int(outcome.notna().sum()),
            passed=int(outcome.eq(True).sum()),
            ungraded=int(outcome.isna().sum()),
        )
    return out


def rule_floors(phase_rows: pd.DataFrame, control: str) -> dict[str, RuleFloor]:
    """rule -> its floor in one phase's grades (every target's rows), from the control's
    derived grades; empty when the control did not run there."""
    by_target = {str(t): _counts(rows) for t, rows in phase_rows.groupby("target", sort=False)}
    mine = by_target.get(control)
    if mine is None:
        return {}
    requests = int((phase_rows["target"] == control).sum())
    out = {}
    for rule, c in mine.items():
        floor = c.passed / c.graded if c.graded else None
        out[rule] = RuleFloor(
            requests=requests,
            graded=c.graded,
            passed=c.passed,
            floor=floor,
            demoted=floor is not None and c.graded >= MIN_GRADED and floor < NOISY_BELOW,
            targets={t: counts[rule] for t, counts in by_target.items() if rule in counts},
        )
    return out


def demotion_note(phase: str, floors: dict[str, RuleFloor]) -> str | None:
    demoted = [f"{r} ({f.passed}/{f.graded})" for r, f in floors.items() if f.demoted]
    if not demoted:
        return None
    return (
        f"{phase}: derived rule(s) demoted for grading noise, their A/A floor below "
        f"{NOISY_BELOW:.0%}: {', '.join(demoted)}; their pairs leave the comparison the verdict "
        "decides on"
    )
