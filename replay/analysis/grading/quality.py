"""Quality per phase, target and bucket: the ``Quality`` record summary.json holds.

Each target is compared bucket by bucket (``compare``) with the reference, and with the A/A
control (the reference replayed a second time, named ``<reference>-control``), whose own
comparison with the reference is every bucket's noise floor. The notes say what the numbers
cannot: derived grades without a floor, answers a checker could not grade, and teacher-forced
scores identical to the reference's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from replay.analysis.grading.compare import (
    compare_combined,
    compare_derived,
    compare_explicit,
    teacher_forced,
)
from replay.analysis.grading.pairing import GradeColumns, combined_pairs, flat_grade
from replay.analysis.grading.rule_floors import demotion_note, rule_floors
from replay.analysis.grading.trend import with_trends
from replay.analysis.schemas import (
    OMITTED,
    BucketQuality,
    NoiseFloor,
    Quality,
    QualityTotals,
    RuleFloor,
    Shift,
    TargetQuality,
)
from replay.analysis.stats.exact_tests import stratified_shift
from replay.analysis.stats.rule import Rule

if TYPE_CHECKING:
    import pandas as pd

# The A/A control is the reference replayed under its name plus this suffix.
CONTROL_SUFFIX = "-control"
_GRADES = ("grade", "derived")  # a grade row's grades: its check's, its derived one


def checker_error_notes(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """One note per target (and kind of grade) whose answers could not all be graded (they
    count as failed)."""
    import pandas as pd

    rows = list(rows)
    notes = []
    for key, what in zip(_GRADES, ("answer(s)", "derived grade(s)"), strict=True):
        failed = [
            (row["target"], kind, f"{row['request_id']}: {row[key]['reason']}")
            for row in rows
            if (kind := ((row.get(key) or {}).get("detail") or {}).get("checker_error"))
        ]
        if not failed:
            continue
        frame = pd.DataFrame.from_records(failed, columns=["target", "kind", "first"])
        for target, errors in frame.groupby("target", sort=False):
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(errors["kind"].value_counts().items()))
            notes.append(
                f"{target}: {len(errors)} {what} failed with a checker error ({kinds}); "
                f"first: {errors['first'].iloc[0]}"
            )
    return notes


def _noise_floor(floor: BucketQuality | None) -> NoiseFloor | None:
    if floor is None:
        return None
    vs, tf = floor.vs_reference, floor.teacher_forced
    return NoiseFloor(
        diff=None if vs is None else vs.diff,
        lo=None if vs is None else vs.lo,
        hi=None if vs is None else vs.hi,
        agreement_exact=floor.agreement.exact,
        nll_delta_mean=tf.nll_delta_mean,
        nll_delta_hi=tf.nll_delta_hi,
        top1_lo=tf.top1_lo,
    )


def _target_quality(
    name: str,
    rows: pd.DataFrame,
    targets: Mapping[str, pd.DataFrame],
    tf: Mapping[str, Mapping[str, Mapping[str, Any]]],
    reference: str,
    bucket_order: Sequence[str],
    rule: Rule,
    seed: int,
    demoted: frozenset[str],
) -> TargetQuality:
    control = reference + CONTROL_SUFFIX
    compared = name not in (reference, control)
    ref, floor = targets.get(reference), targets.get(control) if compared else None
    mine, theirs = tf.get(name, {}), tf.get(reference, {})
    buckets, strata = {}, []
    by_bucket = dict(iter(rows.groupby("bucket", sort=False)))
    for b in sorted(
        by_bucket, key=lambda b: (bucket_order.index(b) if b in bucket_order else 99, b)
    ):
        sub = by_bucket[b]
        buckets[str(b)] = BucketQuality(
            **compare_explicit(sub, ref, rule, seed),
            derived=compare_derived(sub, floor, seed),
            combined=(
                compare_combined(sub, ref, floor, rule, seed, demoted) if compared else OMITTED
            ),
            teacher_forced=teacher_forced(mine, theirs, sub.index, seed),
        )
        # The shift test pools what the verdict decides on: explicit and derived.
        strata.append(combined_pairs(sub, ref, floor, demoted)[:2])
    shift = stratified_shift(strata) if name != reference else None
    return TargetQuality(
        buckets=buckets,
        all=QualityTotals(
            **compare_explicit(rows, ref, rule, seed), derived=compare_derived(rows, floor, seed)
        ),
        shift=None
        if shift is None
        else Shift(
            p_value=shift.p_value,
            direction=shift.direction,
            ref_only=shift.a_only,
            target_only=shift.b_only,
            pairs=shift.n,
        ),
        teacher_forced=teacher_forced(mine, theirs, rows.index),
    )


def _with_floors(out: dict[str, TargetQuality], control: str) -> dict[str, TargetQuality]:
    """Every bucket of a phase with the A/A control's figures in it as its noise floor
    (unchanged where no control ran)."""
    if control not in out:
        return out
    floors = out[control].buckets
    return {
        t: replace(
            q,
            buckets={
                b: replace(row, noise_floor=_noise_floor(floors.get(b)))
                for b, row in q.buckets.items()
            },
        )
        for t, q in out.items()
    }


class Graded:
    """What quality reads of the grade rows, kept as they are written (``add``): each row
    flattened (``pairing.flat_grade``) into columns (``GradeColumns``), and whole only where
    a checker failed (its note)."""

    def __init__(self, rows: Iterable[Mapping[str, Any]] = ()) -> None:
        self.flat = GradeColumns()
        self.failed: list[Mapping[str, Any]] = []
        for row in rows:
            self.add(row)

    def take_frame(self) -> pd.DataFrame:
        """The grades as a table (``pairing.frame_of``); the flattened rows are let go, so a
        million of them are not held beside their table."""
        flat, self.flat = self.flat, GradeColumns()
        return flat.frame()

    def add(self, row: Mapping[str, Any]) -> Mapping[str, Any]:
        self.flat.append(flat_grade(row))
        if any(((row.get(k) or {}).get("detail") or {}).get("checker_error") for k in _GRADES):
            self.failed.append(row)
        return row


def assess_quality(
    rows: Sequence[Mapping[str, Any]] | Graded,
    tf_rows: Sequence[Mapping[str, Any]],
    reference: str,
    bucket_order: Sequence[str],
    rule: Rule = Rule(),
    seed: int = 0,
    *,
    prompt_tokens: Mapping[str, float] | None = None,
) -> Quality:
    """phase -> target -> buckets, all and shift, plus notes. ``rule`` is the verdict's (the
    run's ``Thresholds.rule``), so the evidence column says what it says. With
    ``prompt_tokens`` (request id -> its prompt's tokens: ``trend.prompt_token_counts``),
    every target but the reference gets its trend across context length."""
    tf: dict[str, dict[str, Mapping[str, Any]]] = defaultdict(dict)
    for t in tf_rows:
        tf[t["target"]][t["request_id"]] = t
    control = reference + CONTROL_SUFFIX
    phases: dict[str, dict[str, TargetQuality]] = {}
    rules: dict[str, dict[str, RuleFloor]] = {}
    notes = []
    graded = rows if isinstance(rows, Graded) else Graded(rows)
    frame = graded.take_frame()
    for phase, in_phase in frame.groupby("phase", sort=False):
        targets = dict(iter(in_phase.groupby("target", sort=False)))
        by_rule = rule_floors(in_phase, control)
        demoted = frozenset(r for r, f in by_rule.items() if f.demoted)
        if by_rule:
            rules[str(phase)] = by_rule
        if note := demotion_note(str(phase), by_rule):
            notes.append(note)
        out = {
            str(t): _target_quality(
                str(t), t_rows, targets, tf, reference, bucket_order, rule, seed, demoted
            )
            for t, t_rows in targets.items()
        }
        if prompt_tokens is not None:
            out = with_trends(
                out,
                targets,
                tf,
                prompt_tokens,
                (reference, control),
                demoted=demoted,
                seed=seed,
                alpha=rule.alpha,
            )
        if control not in targets and in_phase["rule"].notna().any():
            notes.append(
                f"{phase}: derived grades have no noise floor: no A/A control ({control}) ran, "
                "so every disagreement with the reference's answer counts against the "
                "candidate (--control gives the floor)"
            )
        phases[str(phase)] = _with_floors(out, control)
    notes += checker_error_notes(graded.failed)
    notes += [
        f"{phase}/{target}: teacher-forced scores are identical to {reference}'s: this "
        "path does not exercise a different KV cache on this backend; it is not evidence "
        "of no loss"
        for phase, out in phases.items()
        for target, q in out.items()
        if target not in (reference, control) and q.teacher_forced.identical_to_reference
    ]
    return Quality(
        reference=reference,
        tolerance=rule.tolerance,
        alpha=rule.alpha,
        min_pairs=rule.min_pairs,
        phases=phases,
        notes=tuple(notes),
        rules=rules or None,
    )
