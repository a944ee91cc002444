"""The stop rule: from a run's ``Facts`` to one ``Verdict`` (``replay.analysis.verdict`` says
what each verdict means and how the phases of a sweep combine).

:func:`decide` goes in order: the serving path (a fallback rejects the path; an emulated FP8
arm gets no rollout decision unless accepted), then a calibrated arm if there is one, else
scale 1.0 against the reference (:func:`losses`, a consistent shift, a loss that grows with
context length, :func:`matches`), and last whether FP8 pays for itself. Teacher-forced
divergence (per bucket, or growing with length) and a longer chain of thought only warn
(:func:`tf_warnings`, :func:`reasoning_warnings`, ``trend.trend_evidence``).
:func:`quality_decides` runs the same steps and stops where whether FP8 pays would decide: a
run asks it before its capacity phase, which only that question needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from replay.analysis.schemas import Sequential, Verdict
from replay.analysis.thresholds import Thresholds
from replay.analysis.verdict.facts import ArmFacts, BucketFacts, Facts
from replay.analysis.verdict.payoff import gain
from replay.analysis.verdict.trend import TrendFacts, falling, falling_reason, trend_evidence
from replay.analysis.verdict.wording import (
    bucket_text,
    evidence_entry,
    points,
    quality_evidence,
    verdict_record,
    where,
)

# What decides once quality has matched: ``payoff.gain`` (whether FP8 pays), or, asking whether
# the quality side decides alone, nothing (``quality_decides``).
Paid = TypeVar("Paid")
Pays = Callable[[Facts, Thresholds, list[dict[str, Any]]], Paid]


def _level(arm: ArmFacts, th: Thresholds) -> float:
    return th.alpha / max(1, arm.phases)


def losses(arm: ArmFacts, th: Thresholds) -> list[BucketFacts]:
    """Buckets (per phase) with a real loss: significant (at alpha / phases) and below the
    noise floor, or an interval that lies wholly below -tolerance."""
    out = []
    for b in arm.buckets:
        if b.diff is None or b.lo is None or b.hi is None:
            continue
        beyond_floor = b.floor_lo is None or b.diff < b.floor_lo
        significant = b.mcnemar_p is not None and b.mcnemar_p < _level(arm, th) and b.diff < 0
        if (significant and beyond_floor) or b.hi < -th.tolerance:
            out.append(b)
    return out


def _shown(b: BucketFacts, th: Thresholds) -> bool:
    # The bound itself, not the evidence's status: a significant drop that stays inside the
    # noise floor (so no loss) and is bounded below the tolerance is a match.
    return (
        b.ref_only is not None
        and b.target_only is not None
        and th.rule.equivalent(b.pairs, b.ref_only, b.target_only)
    )


def matches(arm: ArmFacts, th: Thresholds) -> tuple[bool, list[BucketFacts]]:
    """(every bucket, in every phase, shown within tolerance; the buckets not shown yet).

    Shown means ``Thresholds.rule.equivalent`` (``stats.equivalence.equivalent``): at least
    ``min_pairs`` pairs and an exact one-sided bound at alpha that puts the drop below the
    tolerance. The noise floor does not widen it: the bound already carries the pairs' own
    disagreement, and a KEEP must mean "the drop is below the tolerance at alpha"."""
    open_ = [b for b in arm.buckets if not _shown(b, th)]
    return bool(arm.buckets) and not open_, open_


def _shifted(arm: ArmFacts, th: Thresholds) -> bool:
    return (
        arm.shift_p is not None and arm.shift_p < _level(arm, th) and arm.shift_direction == "down"
    )


def _trending(arm: ArmFacts, th: Thresholds) -> list[TrendFacts]:
    """The phases where the arm's graded difference falls as the context doubles, beyond the
    A/A control's trend (``verdict.trend``): a loss that grows with length is repeatable."""
    return falling(arm.trends, _level(arm, th))


def _repeatable(arm: ArmFacts, th: Thresholds) -> bool:
    """A loss in a bucket, a consistent shift across buckets, or one that grows with length."""
    return bool(losses(arm, th)) or _shifted(arm, th) or bool(_trending(arm, th))


def _lost_in(arm: ArmFacts, th: Thresholds) -> str:
    """Where the arm loses, in words: its buckets, else across them, else with length."""
    lost = ", ".join(where(b) for b in losses(arm, th))
    return lost or ("across buckets" if _shifted(arm, th) else "growing with context length")


def decide(f: Facts, th: Thresholds = Thresholds()) -> Verdict:
    """The stop rule (``replay.analysis.verdict``), with the teacher-forced warnings added to its
    evidence: perplexity warns, it never decides (the outcomes do)."""
    v = _decide(f, th, gain)
    warnings = [
        w
        for arm in (f.candidate, f.calibrated, f.layers)
        if arm is not None
        for w in (
            *tf_warnings(arm, th),
            *reasoning_warnings(arm, th),
            *trend_evidence(arm.name, arm.trends, _level(arm, th)),
        )
    ]
    return replace(v, evidence=(*v.evidence, *warnings)) if warnings else v


def tf_warnings(arm: ArmFacts, th: Thresholds) -> list[dict[str, Any]]:
    """Buckets whose teacher-forced divergence lies beyond the A/A floor (or, without a
    control, beyond zero) by more than the warning thresholds."""
    out = []
    for b in arm.buckets:
        nll_up = b.tf_nll_lo is not None and b.tf_nll_lo > max(
            th.tf_warn_nll, b.tf_floor_nll_hi or 0.0
        )
        top1_down = b.tf_top1_hi is not None and b.tf_top1_hi < min(
            1.0 - th.tf_warn_top1, b.tf_floor_top1_lo if b.tf_floor_top1_lo is not None else 1.0
        )
        if not (nll_up or top1_down):
            continue
        floor = (
            "no A/A control"
            if b.tf_floor_nll_hi is None
            else f"A/A floor ΔNLL up to {b.tf_floor_nll_hi:+.3f}"
        )
        text = (
            f"{arm.name} in {where(b)}: teacher-forced ΔNLL {b.tf_nll:+.3f}/token "
            f"[{b.tf_nll_lo:+.3f}, {b.tf_nll_hi:+.3f}], top-1 agreement "
            f"{100 * (b.tf_top1 or 0):.0f}% ({floor}): the reference's answers are less "
            "likely under this target. An early warning only: the verdict rests on the "
            "graded outcomes"
        )
        out.append(evidence_entry("warning", text, b))
    return out


def reasoning_warnings(arm: ArmFacts, th: Thresholds) -> list[dict[str, Any]]:
    """Buckets where the arm reasons longer than the reference on the same requests: the
    interval of the difference lies above ``reasoning_warn`` of the reference's mean and
    above the A/A floor (zero without a control). A systems cost (decode time and cache the
    answer did not need) and an early warning, like teacher-forced divergence."""
    out = []
    for phase, bucket, d in arm.reasoning:
        if d.pairs < th.reasoning_warn_pairs or d.lo is None or d.reference_mean is None:
            continue
        floor = d.floor_hi if d.floor_hi is not None else 0.0
        if d.lo <= max(floor, th.reasoning_warn * d.reference_mean):
            continue
        at = bucket if phase is None else f"{bucket} ({phase})"
        said = "no A/A control" if d.floor_hi is None else f"A/A floor up to {d.floor_hi:+.1f}"
        text = (
            f"{arm.name} in {at}: reasons longer than the reference on the same requests: "
            f"{d.target_mean:.1f} reasoning tokens per answer against {d.reference_mean:.1f}, "
            f"{d.delta_mean:+.1f} [{d.lo:+.1f}, {d.hi:+.1f}] over {d.pairs} pairs ({said}). "
            "A systems cost (decode time and cache the answer did not need) and an early "
            "warning only: the verdict rests on the graded outcomes"
        )
        out.append({"kind": "warning", "text": text, "bucket": bucket, "phase": phase})
    return out


def quality_decides(f: Facts, th: Thresholds = Thresholds()) -> Verdict | None:
    """The verdict where the quality side decides it alone (a serving problem, a loss, too
    little evidence, a calibrated or layers arm, emulated FP8), the same one ``decide`` gives
    whatever the systems side measures; None where quality matched and whether FP8 pays
    decides. A run asks before its capacity phase: that phase can only answer the second."""
    return _decide(f, th, _undecided)


def _undecided(f: Facts, th: Thresholds, ev: list[dict[str, Any]]) -> None:
    return None


def _decide(f: Facts, th: Thresholds, pays: Pays[Paid]) -> Verdict | Paid:
    """The stop rule itself, its steps in order; each step's evidence is kept in ``ev``."""
    ev: list[dict[str, Any]] = []
    # 1. The serving path: a fallback means this path cannot be tested, so it is rejected.
    for arm in (f.candidate, f.calibrated, f.layers):
        if arm is not None and arm.serving_problems:
            ev += [evidence_entry("serving", p) for p in arm.serving_problems]
            return verdict_record("reject", [f"{arm.name}: {arm.serving_problems[0]}"], ev)
    if f.candidate is None:
        return verdict_record("insufficient_evidence", ["no FP8 target to compare"], ev)
    emulated = [arm.name for arm in (f.candidate, f.calibrated) if arm is not None and arm.emulated]
    if emulated and not th.accept_emulated:
        for arm in (f.calibrated, f.candidate):
            if arm is not None:
                ev += quality_evidence(arm, f.reference, th)
        return verdict_record(
            "emulated",
            [
                f"{', '.join(emulated)} emulated FP8 (a BF16 server rounding K/V through E4M3): "
                "its quality evidence is below, but a rollout decision needs a server that serves "
                "FP8 (or --accept-emulated to decide on quality alone)"
            ],
            ev,
        )
    # 2. With a calibrated target, judge the calibration (and a layers arm after it).
    if f.calibrated is not None:
        return _calibration(f, f.calibrated, th, ev)
    if f.layers is not None and _repeatable(f.candidate, th):
        ev += quality_evidence(f.candidate, f.reference, th)
        return _layers_arm(f, f.layers, th, ev, "FP8 at scale 1.0")
    # 3. Scale 1.0 against the reference.
    return _scale_one(f, f.candidate, th, ev, pays)


def _calibration(f: Facts, cal: ArmFacts, th: Thresholds, ev: list[dict[str, Any]]) -> Verdict:
    """A calibrated arm: it fixes the gap, fixes it but for one bucket, or still misses;
    then what was measured of the next step decides (a served layers arm, else kvcal
    advise's emulated figures)."""
    cal_loss = losses(cal, th)
    ev += quality_evidence(cal, f.reference, th) + _advice_evidence(f)
    if not _repeatable(cal, th):
        ok, thin = matches(cal, th)
        if ok:
            return verdict_record(
                "calibrate",
                [f"{cal.name} matches {f.reference} in every bucket: ship the calibrated scales"],
                ev,
            )
        return _insufficient(cal, thin, ev, th)
    if f.layers is not None:
        return _layers_arm(f, f.layers, th, ev, f"calibrated ({cal.name})")
    lost_in = _lost_in(cal, th)
    advice = f.advice
    if advice is not None and advice.action in ("skip_layers", "per_head"):
        how = (
            f"BF16 for layers {list(advice.skip_layers)} ({advice.flag()}; kvcal advise "
            "measured it in emulation): serve it with --skip-layers NAME="
            f"{','.join(map(str, advice.skip_layers))} and replay to confirm"
            if advice.action == "skip_layers"
            else "per-head scales (kvcal advise measured them recovering it, and the backend "
            "takes them)"
        )
        return verdict_record(
            "per_head_or_skip_layers",
            [f"calibrated quality still misses ({lost_in}): try {how}"],
            ev,
        )
    if (
        advice is None
        and len({b.bucket for b in cal_loss}) == 1
        and len({b.bucket for b in cal.buckets}) > 1
    ):
        # One bucket: a localized problem, and no measurement yet of what fixes it.
        b = min(cal_loss, key=lambda c: c.diff if c.diff is not None else 0.0)
        return verdict_record(
            "per_head_or_skip_layers",
            [
                f"after calibration only {where(b)} still loses ({points(b.diff)} points): "
                + _untested_next_step(f)
            ],
            ev,
        )
    why = [f"calibrated quality still misses ({lost_in})"]
    if advice is None:
        why.append(
            "to know whether BF16 layers or another backend would keep FP8, measure it: "
            "kvcal advise MODEL --trace TRACE --overlay OVERLAY --json advice.json, then "
            "replay with --advice advice.json"
        )
    return verdict_record("reject", why, ev)


def _untested_next_step(f: Facts) -> str:
    """What to try when nothing has measured the fix yet: calibration's own outlier layers,
    or the command that measures it."""
    if f.per_head_supported:
        return "try per-head scales (the backend supports them)"
    if f.outlier_layers:
        layers = " ".join(map(str, f.outlier_layers))
        return (
            f"try BF16 for the layers calibration found standing out (--kv-cache-dtype-skip-layers "
            f"{layers}); per-head scales need FlashAttention"
        )
    return (
        "no layer stood out in calibration: measure which to keep in BF16 with "
        "kvcal advise MODEL --trace TRACE --overlay OVERLAY (per-head scales need FlashAttention)"
    )


def _layers_arm(
    f: Facts, arm: ArmFacts, th: Thresholds, ev: list[dict[str, Any]], after: str
) -> Verdict:
    """FP8 with some layers' cache in BF16, served after ``after`` still lost: it matches
    (keep FP8 that way), still loses (reject, with what was measured), or is not decided."""
    ev += quality_evidence(arm, f.reference, th)
    ev += [e for e in _advice_evidence(f) if e not in ev]  # after calibration: already there
    kept = " ".join(map(str, f.layers_skipped)) or "?"
    if not _repeatable(arm, th):
        ok, thin = matches(arm, th)
        if ok:
            return verdict_record(
                "per_head_or_skip_layers",
                [
                    f"{after} still loses, but {arm.name} (layers {kept} in BF16) matches "
                    f"{f.reference} in every bucket: serve FP8 with "
                    f"--kv-cache-dtype-skip-layers {kept}"
                ],
                ev,
            )
        return _insufficient(arm, thin, ev, th)
    lost_in = _lost_in(arm, th)
    return verdict_record(
        "reject",
        [f"{after} and {arm.name} (layers {kept} in BF16) both still lose ({lost_in})"],
        ev,
    )


def _advice_evidence(f: Facts) -> list[dict[str, Any]]:
    """kvcal advise's emulated figures, each a line of evidence (never the decision alone)."""
    if f.advice is None:
        return []
    return [
        evidence_entry("emulation", f"kvcal advise (emulated, {f.advice.action}): {reason}")
        for reason in f.advice.reasons
    ]


def _scale_one(
    f: Facts, arm: ArmFacts, th: Thresholds, ev: list[dict[str, Any]], pays: Pays[Paid]
) -> Verdict | Paid:
    """FP8 at scale 1.0: a repeatable loss asks for calibration; a match in every bucket is
    kept if FP8 pays for itself (``pays``: ``payoff.gain``)."""
    ev += quality_evidence(arm, f.reference, th)
    if f.sequential is not None:
        return _sequential(f, f.sequential, th, ev, pays)
    lost, trending = losses(arm, th), _trending(arm, th)
    if lost or _shifted(arm, th) or trending:
        if lost:
            b = lost[0]
            reason = f"repeatable loss in {where(b)}: {bucket_text(arm.name, f.reference, b, th)}"
        elif _shifted(arm, th):
            reason = (
                f"consistent downward shift across buckets (stratified p="
                f"{arm.shift_p:.3g}) although no single bucket is significant"
            )
        else:
            reason = falling_reason(arm.name, trending[0])
        return verdict_record("calibrate", [reason], ev)
    ok, thin = matches(arm, th)
    if not ok:
        return _insufficient(arm, thin, ev, th)
    return pays(f, th, ev)


def _sequential(
    f: Facts, seq: Sequential, th: Thresholds, ev: list[dict[str, Any]], pays: Pays[Paid]
) -> Verdict | Paid:
    """A sequential canary decides on its own always-valid evidence: a bucket (or the pool)
    decided LOSS asks for calibration, every bucket EQUIVALENT is the match (then FP8 must
    pay), and anything else is too little evidence, with what each open bucket still needs."""
    sent = f"{seq.requests_sent} requests sent, the fixed design would have sent {seq.fixed_n}"
    ev.append(evidence_entry("sequential", f"{seq.decision} after {seq.rounds} rounds: {sent}"))
    if seq.decision == "loss":
        lost = [b for b in seq.buckets if b.status == "loss"]
        where_ = f"bucket {lost[0].name}" if lost else "the pool of every bucket"
        b = lost[0] if lost else seq.pool
        drop = f" (drop above {100 * b.lower:.1f} points)" if b is not None else ""
        return verdict_record(
            "calibrate", [f"sequential canary: a loss in {where_}{drop}; {sent}"], ev
        )
    if seq.decision == "equivalent":
        return pays(f, th, ev)
    need = "; ".join(seq.needs) or "no bucket decided"
    return verdict_record(
        "insufficient_evidence",
        [f"sequential canary stopped ({seq.stopped}) undecided: {need}; {sent}"],
        ev,
    )


def _insufficient(
    arm: ArmFacts, thin: Sequence[BucketFacts], ev: list[dict[str, Any]], th: Thresholds
) -> Verdict:
    need = []
    for b in thin:
        e = b.evidence(th, arm.phases)
        if e is None:
            what = f"about {b.needed or '?'} needed"
        elif e.status == "loss":  # not counted as one: it stays inside the noise floor
            what = (
                f"a drop inside the noise floor, bounded only below {100 * e.drop_bound:.1f} points"
            )
        else:
            what = e.short
        need.append(f"{where(b)}: {b.pairs} graded pairs, {what}")
    need = need or [f"{arm.name}: no bucket graded"]
    return verdict_record(
        "insufficient_evidence", [f"no loss shown, but too little evidence ({'; '.join(need)})"], ev
    )
