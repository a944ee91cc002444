"""The stop rule: one verdict with its evidence, and an exit code a pipeline can act on.

    KEEP           FP8 at scale 1.0 matches the reference in every bucket (an exact one-sided
                   bound at alpha puts the drop below the tolerance: ``stats.equivalent``) and
                   pays for itself (capacity, or latency).
    CALIBRATE      the scale-1.0 gap is repeatable (significant in a bucket, or a consistent
                   downward shift across buckets); or a calibrated target fixes it.
    PER-HEAD/SKIP  after calibration a localized problem remains (one bucket): try per-head
                   scales (FlashAttention only) or BF16 for the outlier layers.
    REJECT         the backend fell back (served cache dtype is not FP8, scales not applied,
                   the server refused FP8), calibrated quality still misses, or the workload is
                   too short/prefill-heavy to recover the overhead with no capacity need.
    INSUFFICIENT   no loss shown, but too few graded pairs to show there is none.
    EMULATED       an FP8 arm is emulated (kvcal's plugin: a BF16 server rounding K/V through
                   E4M3): its quality evidence is reported, but no rollout decision rests on
                   it unless ``Thresholds.accept_emulated`` (``--accept-emulated``); and then
                   on quality alone, since an emulated cache has BF16's capacity and speed.

``decide`` takes plain ``Facts`` (so every rule is table-tested); ``facts_from_run`` builds
them from a run's ``Summary`` record (``schemas``) and manifest. Tolerance, alpha and
minimum pairs come from the ``Thresholds`` given, the same ones grading's evidence column uses
(``stats.evidence``).

Every phase of a sweep counts. A bucket is judged in each phase (one ``BucketFacts`` per
phase and bucket), because the phases replay the *same* requests: pooling their pairs would
count a request once per phase, and where the servers answer alike in every phase that
multiplies the apparent evidence by the number of phases without adding any. So:

* a match (KEEP, or a calibration that works) needs the drop bounded below the tolerance in
  every phase: an intersection-union test, of level alpha whatever the dependence between
  phases (Berger 1982), and the one that asks whether batching under load changes answers;
* a loss, or a consistent shift across buckets, in any phase counts, each phase tested at
  alpha / phases (Bonferroni, valid whatever the dependence), so a sweep is not more likely to
  cry loss than a single phase. With one phase all of this is the single-phase rule.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from replay.analysis import stats
from replay.analysis.roles import Roles
from replay.analysis.schemas import (
    OMITTED,
    BucketQuality,
    Combined,
    Summary,
    TargetSummary,
    Verdict,
)
from replay.core.exit_codes import ExitCode
from replay.serving.scale_log import (
    EMULATED_FP8,
    SCALE_ONE_WARNING,
    from_engine_config,
    is_emulated,
)

VERDICTS: dict[str, tuple[int, str]] = {
    "keep": (ExitCode.OK, "KEEP FP8 at scale 1.0"),
    "calibrate": (ExitCode.VERDICT_CALIBRATE, "CALIBRATE the FP8 K/V scales"),
    "per_head_or_skip_layers": (
        ExitCode.VERDICT_PER_HEAD_OR_SKIP_LAYERS,
        "TRY PER-HEAD SCALES OR BF16 FOR SOME LAYERS",
    ),
    "reject": (ExitCode.VERDICT_REJECT, "REJECT FP8 for this path"),
    "insufficient_evidence": (ExitCode.VERDICT_INSUFFICIENT_EVIDENCE, "INSUFFICIENT EVIDENCE"),
    "emulated": (ExitCode.VERDICT_EMULATED_FP8, "NO VERDICT ON EMULATED FP8"),
}


@dataclass(frozen=True)
class Thresholds:
    tolerance: float = stats.TOLERANCE  # largest acceptable pass-rate drop per bucket (/100)
    alpha: float = stats.ALPHA  # level of a loss and of the bound that shows a match
    min_pairs: int = stats.MIN_PAIRS  # graded pairs a bucket needs to count as evidence
    required_capacity_ratio: float = 1.5  # FP8 / BF16 KV-cache tokens that count as the gain
    capacity_needed_usage: float = 0.5  # peak KV usage of the reference that means "needed"
    max_error_rate: float = 0.05  # failed requests above this make a target "failed"
    # Teacher-forced divergence that warns (never decides): a per-token NLL increase whose
    # interval lies above this and above the A/A floor, or a top-1 agreement whose interval
    # lies below 1 - this and below the floor's.
    tf_warn_nll: float = 0.05
    tf_warn_top1: float = 0.05
    # Decide on emulated FP8 arms (quality only) instead of refusing to.
    accept_emulated: bool = False


@dataclass(frozen=True)
class BucketFacts:
    bucket: str
    pairs: int
    diff: float | None = None  # candidate - reference pass rate
    lo: float | None = None
    hi: float | None = None
    mcnemar_p: float | None = None
    floor_lo: float | None = None  # A/A control's interval low end (noise floor)
    needed: int | None = None
    ref_only: int | None = None  # pairs the reference passed and the candidate failed
    target_only: int | None = None  # pairs the candidate passed and the reference failed
    phase: str | None = None  # named only when the run has several phases
    derived: int = 0  # of ``pairs``, those graded by the reference's answer
    # Teacher-forced scores of the reference's answers under the candidate (the early warning):
    # per-token NLL increase and top-1 agreement with intervals over requests; the A/A floor.
    tf_nll: float | None = None
    tf_nll_lo: float | None = None
    tf_nll_hi: float | None = None
    tf_top1: float | None = None
    tf_top1_hi: float | None = None
    tf_floor_nll_hi: float | None = None
    tf_floor_top1_lo: float | None = None

    def evidence(self, th: Thresholds, phases: int = 1) -> stats.Evidence | None:
        """What these pairs settle under ``th`` (a loss at alpha / phases); None without the
        discordant counts."""
        if self.ref_only is None or self.target_only is None:
            return None
        return stats.evidence(
            self.pairs,
            self.ref_only,
            self.target_only,
            tolerance=th.tolerance,
            alpha=th.alpha,
            min_pairs=th.min_pairs,
            loss_alpha=th.alpha / max(1, phases),
        )


@dataclass(frozen=True)
class ArmFacts:
    """One FP8 target compared with the reference."""

    name: str
    serving_problems: tuple[str, ...] = ()
    buckets: tuple[BucketFacts, ...] = ()  # one per bucket and phase
    shift_p: float | None = None  # the phase with the strongest downward shift
    shift_direction: str | None = None
    phases: int = 1  # loss and shift tests run at alpha / phases
    emulated: bool = False  # FP8 emulated in a BF16 server (no systems facts)


@dataclass(frozen=True)
class Facts:
    reference: str
    candidate: ArmFacts | None
    calibrated: ArmFacts | None = None
    capacity_ratio: float | None = None
    latency_better: bool | None = None  # FP8 faster (TTFT or E2E) somewhere that matters
    capacity_needed: bool | None = None  # the reference's cache ran close to full
    below_break_even: bool | None = None
    per_head_supported: bool = False
    outlier_layers: tuple[int, ...] = ()


def _verdict(kind: str, reasons: Sequence[str], evidence: Sequence[dict[str, Any]]) -> Verdict:
    code, title = VERDICTS[kind]
    return Verdict(
        verdict=kind,
        exit_code=code,
        headline=f"{title}: {reasons[0]}" if reasons else title,
        reasons=tuple(reasons),
        evidence=tuple(evidence),
    )


def _pts(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}"


def _where(b: BucketFacts) -> str:
    return b.bucket if b.phase is None else f"{b.bucket} ({b.phase})"


def _bucket_text(arm: str, ref: str, b: BucketFacts, th: Thresholds) -> str:
    if b.mcnemar_p is None:
        return f"{arm} in {_where(b)}: no graded pairs"
    floor = "" if b.floor_lo is None else f", noise floor from {_pts(b.floor_lo)}"
    ev = b.evidence(th)
    bound = (
        ""
        if ev is None
        else (
            f", drop at most {100 * ev.drop_bound:.1f} points (exact "
            f"one-sided {100 * (1 - th.alpha):g}%)"
        )
    )
    kinds = f" ({b.pairs - b.derived} explicit, {b.derived} derived)" if b.derived else ""
    return (
        f"{arm} vs {ref} in {_where(b)}: {_pts(b.diff)} points [{_pts(b.lo)}, {_pts(b.hi)}]"
        f" over {b.pairs} pairs{kinds}, McNemar p={b.mcnemar_p:.3g}{floor}{bound}"
    )


def _evidence(
    kind: str,
    text: str,
    b: BucketFacts | None = None,
    th: Thresholds | None = None,
    phases: int = 1,
) -> dict[str, Any]:
    if b is None:
        return {"kind": kind, "text": text}
    ev = None if th is None else b.evidence(th, phases)
    # The evidence under the thresholds decided with, not whatever the facts were built with.
    extra = (
        {}
        if ev is None
        else {"needed": ev.needed, "status": ev.status, "drop_bound": ev.drop_bound}
    )
    return {"kind": kind, "text": text, **asdict(b), **extra}


def _quality(arm: ArmFacts, ref: str, th: Thresholds) -> list[dict[str, Any]]:
    return [
        _evidence("quality", _bucket_text(arm.name, ref, b, th), b, th, arm.phases)
        for b in arm.buckets
    ]


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
        and stats.equivalent(
            b.pairs,
            b.ref_only,
            b.target_only,
            tolerance=th.tolerance,
            alpha=th.alpha,
            min_pairs=th.min_pairs,
        )
    )


def matches(arm: ArmFacts, th: Thresholds) -> tuple[bool, list[BucketFacts]]:
    """(every bucket, in every phase, shown within tolerance; the buckets not shown yet).

    Shown means :func:`stats.equivalent`: at least ``min_pairs`` pairs and an exact one-sided
    bound at alpha that puts the drop below the tolerance. The noise floor does not widen it:
    the bound already carries the pairs' own disagreement, and a KEEP must mean "the drop is
    below the tolerance at alpha"."""
    open_ = [b for b in arm.buckets if not _shown(b, th)]
    return bool(arm.buckets) and not open_, open_


def _shifted(arm: ArmFacts, th: Thresholds) -> bool:
    return (
        arm.shift_p is not None and arm.shift_p < _level(arm, th) and arm.shift_direction == "down"
    )


def decide(f: Facts, th: Thresholds = Thresholds()) -> Verdict:
    """The stop rule (module docstring), with the teacher-forced warnings added to its
    evidence: perplexity warns, it never decides (the outcomes do)."""
    v = _decide(f, th)
    warnings = [
        w for arm in (f.candidate, f.calibrated) if arm is not None for w in tf_warnings(arm, th)
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
            f"{arm.name} in {_where(b)}: teacher-forced ΔNLL {b.tf_nll:+.3f}/token "
            f"[{b.tf_nll_lo:+.3f}, {b.tf_nll_hi:+.3f}], top-1 agreement "
            f"{100 * (b.tf_top1 or 0):.0f}% ({floor}): the reference's answers are less "
            "likely under this target. An early warning only: the verdict rests on the "
            "graded outcomes"
        )
        out.append(_evidence("warning", text, b))
    return out


def _decide(f: Facts, th: Thresholds) -> Verdict:
    ev: list[dict[str, Any]] = []
    # 1. The serving path: a fallback means this path cannot be tested, so it is rejected.
    for arm in (f.candidate, f.calibrated):
        if arm is not None and arm.serving_problems:
            ev += [_evidence("serving", p) for p in arm.serving_problems]
            return _verdict("reject", [f"{arm.name}: {arm.serving_problems[0]}"], ev)
    if f.candidate is None:
        return _verdict("insufficient_evidence", ["no FP8 target to compare"], ev)
    emulated = [arm.name for arm in (f.candidate, f.calibrated) if arm is not None and arm.emulated]
    if emulated and not th.accept_emulated:
        for arm in (f.calibrated, f.candidate):
            if arm is not None:
                ev += _quality(arm, f.reference, th)
        return _verdict(
            "emulated",
            [
                f"{', '.join(emulated)} emulated FP8 (a BF16 server rounding K/V through E4M3): "
                "its quality evidence is below, but a rollout decision needs a server that serves "
                "FP8 (or --accept-emulated to decide on quality alone)"
            ],
            ev,
        )

    # 2. With a calibrated target, judge the calibration.
    if f.calibrated is not None:
        cal_loss = losses(f.calibrated, th)
        ev += _quality(f.calibrated, f.reference, th)
        if not cal_loss and not _shifted(f.calibrated, th):
            ok, thin = matches(f.calibrated, th)
            if ok:
                return _verdict(
                    "calibrate",
                    [
                        f"{f.calibrated.name} matches {f.reference} in "
                        "every bucket: ship the calibrated scales"
                    ],
                    ev,
                )
            return _insufficient(f.calibrated, thin, ev, th)
        # One bucket, in however many phases: a localized problem, not a broad miss.
        if (
            len({b.bucket for b in cal_loss}) == 1
            and len({b.bucket for b in f.calibrated.buckets}) > 1
        ):
            b = min(cal_loss, key=lambda c: c.diff if c.diff is not None else 0.0)
            how = (
                "per-head scales (the backend supports them)"
                if f.per_head_supported
                else "BF16 for the outlier layers (--kv-cache-dtype-skip-layers "
                f"{' '.join(map(str, f.outlier_layers)) or 'LAYERS'}); per-head scales "
                "need FlashAttention"
            )
            return _verdict(
                "per_head_or_skip_layers",
                [
                    f"after calibration only {_where(b)} still loses ({_pts(b.diff)} points): try "
                    + how
                ],
                ev,
            )
        where = ", ".join(_where(b) for b in cal_loss) or "across buckets"
        return _verdict("reject", [f"calibrated quality still misses ({where})"], ev)

    # 3. Scale 1.0 against the reference.
    arm = f.candidate
    ev += _quality(arm, f.reference, th)
    lost = losses(arm, th)
    if lost or _shifted(arm, th):
        if lost:
            b = lost[0]
            reason = f"repeatable loss in {_where(b)}: {_bucket_text(arm.name, f.reference, b, th)}"
        else:
            reason = (
                f"consistent downward shift across buckets (stratified p="
                f"{arm.shift_p:.3g}) although no single bucket is significant"
            )
        return _verdict("calibrate", [reason], ev)
    ok, thin = matches(arm, th)
    if not ok:
        return _insufficient(arm, thin, ev, th)
    return _gain(f, th, ev)


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
        need.append(f"{_where(b)}: {b.pairs} graded pairs, {what}")
    need = need or [f"{arm.name}: no bucket graded"]
    return _verdict(
        "insufficient_evidence", [f"no loss shown, but too little evidence ({'; '.join(need)})"], ev
    )


def _gain(f: Facts, th: Thresholds, ev: list[dict[str, Any]]) -> Verdict:
    if f.candidate is not None and f.candidate.emulated:
        ev.append(
            _evidence(
                "systems",
                f"{f.candidate.name} is emulated: its capacity and speed "
                "are a BF16 server's, so FP8's gain is not measured here",
            )
        )
        return _verdict(
            "keep",
            [
                f"matches {f.reference} in every bucket (emulated FP8, quality "
                "only: capacity and speed not measured)"
            ],
            ev,
        )
    cap_ok = f.capacity_ratio is not None and f.capacity_ratio >= th.required_capacity_ratio
    if f.capacity_ratio is not None:
        ev.append(
            _evidence(
                "systems",
                f"KV-cache capacity {f.capacity_ratio:.2f}x the reference "
                f"(required {th.required_capacity_ratio:g}x)",
            )
        )
    if cap_ok and f.capacity_needed is not False:
        return _verdict(
            "keep",
            [
                f"matches {f.reference} in every bucket and holds "
                f"{f.capacity_ratio:.2f}x the KV cache"
            ],
            ev,
        )
    if f.latency_better:
        return _verdict("keep", [f"matches {f.reference} in every bucket and is faster"], ev)
    if cap_ok:
        # Capacity is there but this workload does not need it and pays FP8's overhead.
        why = (
            "the workload sits below the latency break-even"
            if f.below_break_even
            else "FP8 is slower here"
        )
        return _verdict(
            "reject",
            [
                f"too short or prefill-heavy to pay off: {why}, and the "
                "reference's cache never ran close to full"
            ],
            ev,
        )
    return _verdict("reject", ["no memory or latency gain on this backend"], ev)


# -- from a run -----------------------------------------------------------------------------


def _target(name: str, target: TargetSummary | Mapping[str, Any]) -> TargetSummary:
    """A target's summary; a JSON one (a caller outside the pipeline) is read first."""
    if isinstance(target, TargetSummary):
        return target
    return TargetSummary.from_json(target, where=f"summary of target {name}")


def error_problem(
    name: str, target: TargetSummary | Mapping[str, Any], max_rate: float
) -> str | None:
    """A target whose requests fail is a failed target, not a quality result."""
    total, kinds = 0, dict[str, int]()
    for ph in _target(name, target).phases.values():
        total += ph.all.requests
        for k, n in ph.all.errors_by_kind.items():
            kinds[k] = kinds.get(k, 0) + n
    failed = sum(kinds.values())
    if total and failed / total > max_rate:
        detail = ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items()))
        return f"{failed} of {total} requests failed ({detail})"
    return None


def serving_problems(
    name: str,
    target: TargetSummary | Mapping[str, Any],
    manifest: Mapping[str, Any],
    calibrated: bool,
    max_error_rate: float = 0.05,
) -> list[str]:
    """What says this target does not run the FP8 path it is meant to test, or not the same
    engine and model as the reference."""
    out = []
    summary = _target(name, target)
    if summary.status != "ok":
        out.append(f"target failed: {summary.reason}")
        return out
    dtype = summary.cache_dtype
    info = manifest.get("targets", {}).get(name, {}) or {}
    spec = info.get("spec") or {}
    meant = spec.get("expect_cache_dtype") or spec.get("kv_cache_dtype")
    # A candidate whose spec says BF16 is a deliberate BF16 comparison (another checkpoint,
    # other server flags); one meant to be FP8, or of unknown kind, must serve FP8. An
    # emulated one stores BF16 by design (the runner checked its plugin ran).
    meant_fp8 = (meant is None or str(meant).startswith("fp8")) and meant != EMULATED_FP8
    if meant_fp8 and dtype is not None and not str(dtype).startswith("fp8"):
        out.append(f"served cache_dtype is '{dtype}', not FP8 (the backend fell back)")
    ref = manifest.get("targets", {}).get(manifest.get("reference", ""), {}) or {}
    for key, what in (("engine_version", "engine version"), ("max_model_len", "max_model_len")):
        if info.get(key) is not None and ref.get(key) is not None and info[key] != ref[key]:
            out.append(f"{what} {info[key]} differs from the reference's {ref[key]}")
    if (
        not calibrated
        and info.get("model_root")
        and ref.get("model_root")
        and info["model_root"] != ref["model_root"]
    ):
        out.append(f"serves model {info['model_root']}, the reference {ref['model_root']}")
    skip = _skip_layers_problem(
        list(spec.get("args") or []),
        str((info.get("cache_config") or {}).get("kv_cache_dtype_skip_layers", "")),
    )
    if skip and meant != EMULATED_FP8:  # an emulated target's plugin does the skipping
        out.append(skip)
    failing = error_problem(name, summary, max_error_rate)
    if failing:
        out.append(failing)
    lines = info.get("scale_log_lines") or []
    scales = from_engine_config(
        info.get("engine_config") or {}, any(SCALE_ONE_WARNING in ln for ln in lines)
    )
    if calibrated and scales.runs_at_scale_one:
        out.append(f"{scales.explain()}: the calibrated scales were not applied")
    if any(
        "per-head" in ln.lower() and ("not supported" in ln.lower() or "reject" in ln.lower())
        for ln in lines
    ):
        out.append("the backend rejected per-head scales")
    return out


def _skip_layers_problem(args: Sequence[str], served: str) -> str | None:
    """``--kv-cache-dtype-skip-layers 0 3`` against the server's ``['0', '3']``. vLLM 0.32
    takes one pattern per word, so ``0,3`` is a single pattern that matches no layer."""
    flag = "--kv-cache-dtype-skip-layers"
    if flag not in args:
        return None
    i = list(args).index(flag) + 1
    words = []
    while i < len(args) and not args[i].startswith("-"):
        words.append(args[i])
        i += 1
    if any("," in w for w in words):
        return (
            f"{flag} {' '.join(words)}: vLLM takes one layer index per word ("
            f"{' '.join(w for word in words for w in word.split(',') if w)}); a "
            "comma-separated value is one pattern that matches no layer"
        )
    if not set(words) <= set(re.findall(r"\w+", served)):
        return f"skip-layers configured as {' '.join(words)!r} but the server reports {served!r}"
    return None


def _cell(
    bucket: str, row: BucketQuality, phase: str | None, th: Thresholds, phases: int
) -> BucketFacts:
    # Every graded pair: explicit checks and, for requests without one, derived grades
    # (``grading.combined_pairs``: one pair per request, explicit checks win). Summaries
    # written before derived grading have only the explicit comparison.
    vs = row.combined if isinstance(row.combined, Combined) else row.vs_reference
    floor = row.noise_floor if row.noise_floor is not OMITTED else None
    tf = row.teacher_forced
    b = BucketFacts(
        bucket,
        pairs=vs.pairs if vs else 0,
        diff=vs.diff if vs else None,
        lo=vs.lo if vs else None,
        hi=vs.hi if vs else None,
        mcnemar_p=vs.mcnemar_p if vs else None,
        floor_lo=floor.lo if floor else None,
        ref_only=vs.ref_only if vs else None,
        target_only=vs.target_only if vs else None,
        phase=phase,
        derived=vs.derived if isinstance(vs, Combined) else 0,
        tf_nll=tf.nll_delta_mean,
        tf_nll_lo=tf.nll_delta_lo,
        tf_nll_hi=tf.nll_delta_hi,
        tf_top1=tf.top1_agreement,
        tf_top1_hi=tf.top1_hi,
        tf_floor_nll_hi=floor.nll_delta_hi if floor else None,
        tf_floor_top1_lo=floor.top1_lo if floor else None,
    )
    ev = b.evidence(th, phases)
    if ev is None:  # no discordant counts: the evidence column's word, if it has one
        return replace(b, needed=row.evidence.needed if row.evidence else None)
    return replace(b, needed=ev.needed)


def facts_from_run(
    summary: Summary | Mapping[str, Any],
    manifest: Mapping[str, Any],
    *,
    candidate: str | None = None,
    calibrated: str | None = None,
    thresholds: Thresholds = Thresholds(),
) -> Facts:
    """The verdict's facts from a run's summary (a JSON one is read first): every phase's
    paired grades, per bucket and phase (see the module docstring for how phases combine),
    judged under ``thresholds``."""
    s = summary if isinstance(summary, Summary) else Summary.from_json(summary)
    targets = s.targets
    roles = Roles.from_manifest(manifest, list(targets))
    reference = (s.quality.reference if s.quality else None) or roles.reference
    cal = calibrated or roles.calibrated
    cand = candidate or roles.candidate
    phases = s.quality.phases if s.quality else {}

    def arm(name: str | None, is_cal: bool) -> ArmFacts | None:
        if name is None or name not in targets:
            return None
        problems = serving_problems(
            name, targets[name], manifest, is_cal, thresholds.max_error_rate
        )
        per_phase = [
            (ph, rows[name]) for ph, rows in phases.items() if name in rows and rows[name].buckets
        ]
        several = len(per_phase) > 1
        order = list(dict.fromkeys(b for _, q in per_phase for b in q.buckets))
        cells = [
            _cell(b, q.buckets[b], ph if several else None, thresholds, len(per_phase))
            for b in order
            for ph, q in per_phase
            if b in q.buckets
        ]
        shifts = [q.shift for _, q in per_phase]
        down = [
            sh
            for sh in shifts
            if sh is not None and sh.direction == "down" and sh.p_value is not None
        ]
        shift = (
            min(down, key=lambda sh: sh.p_value or 0.0) if down else (shifts[0] if shifts else None)
        )
        emulated = is_emulated(manifest.get("targets", {}).get(name) or {})
        return ArmFacts(
            name,
            tuple(problems),
            tuple(cells),
            shift.p_value if shift else None,
            shift.direction if shift else None,
            max(1, len(per_phase)),
            emulated,
        )

    ref_t = targets.get(reference)
    ref_problem = (
        None if ref_t is None else error_problem(reference, ref_t, thresholds.max_error_rate)
    )
    cand_t = targets.get(cand or "")
    ratio = None
    cand_emulated = is_emulated(manifest.get("targets", {}).get(cand or "") or {})
    if (
        ref_t
        and cand_t
        and ref_t.kv_cache_size_tokens
        and cand_t.kv_cache_size_tokens
        and not cand_emulated
    ):  # an emulated cache's capacity is BF16's, never FP8's
        ratio = cand_t.kv_cache_size_tokens / ref_t.kv_cache_size_tokens
    usage = [
        ph.server.peak_kv_usage
        for ph in (ref_t.phases.values() if ref_t else ())
        if ph.server.peak_kv_usage is not None
    ]
    candidate_arm = arm(cand, False)
    if ref_problem and candidate_arm is not None:
        # Without a working reference there is nothing to compare with.
        candidate_arm = replace(
            candidate_arm,
            serving_problems=(
                f"the reference {reference}: {ref_problem}",
                *candidate_arm.serving_problems,
            ),
        )
    return Facts(
        reference=reference,
        candidate=candidate_arm,
        calibrated=arm(cal, True),
        capacity_ratio=ratio,
        latency_better=s.systems.latency_better if s.systems and not cand_emulated else None,
        capacity_needed=(max(usage) >= thresholds.capacity_needed_usage) if usage else None,
        below_break_even=s.systems.below_break_even if s.systems else None,
    )
