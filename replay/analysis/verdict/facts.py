"""What a run shows, as plain facts the stop rule decides on (``rule.decide``).

``Facts`` name the reference and the FP8 arms (``ArmFacts``), each with its serving-path
problems (``serving_path``) and one ``BucketFacts`` per bucket and phase, plus the systems
side (capacity, latency). ``facts_from_run`` builds them from a run's ``Summary`` record
(``schemas``) and manifest; the table tests of the rule build them by hand. ``Thresholds`` are
the rule's parameters; their evidence rule (``Thresholds.rule``) is the one grading's evidence
column applies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from replay.analysis.roles import Roles
from replay.analysis.schemas import (
    OMITTED,
    BucketQuality,
    CapacityPhase,
    Combined,
    ReasoningDelta,
    ReasoningLength,
    Sequential,
    Shift,
    Summary,
    SystemsRule,
    TargetQuality,
    TargetSummary,
)
from replay.analysis.schemas.manifest import Manifest
from replay.analysis.stats.evidence import Evidence
from replay.analysis.thresholds import Thresholds
from replay.analysis.verdict.advice import Advice, advice_facts
from replay.analysis.verdict.serving_path import error_problem, serving_problems, target_layout
from replay.analysis.verdict.trend import TrendFacts, trend_facts
from replay.serving.kv_layout import SLIDING_WINDOW


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

    def evidence(self, th: Thresholds, phases: int = 1) -> Evidence | None:
        """What these pairs settle under ``th`` (a loss at alpha / phases); None without the
        discordant counts."""
        if self.ref_only is None or self.target_only is None:
            return None
        return th.rule.evidence(
            self.pairs, self.ref_only, self.target_only, loss_alpha=th.alpha / max(1, phases)
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
    # Its reasoning length against the reference's, per bucket: (phase, named only when the
    # run has several; bucket; the difference and the A/A floor), for the early warning.
    reasoning: tuple[tuple[str | None, str, ReasoningDelta], ...] = ()
    # Its trends across context length, one per phase (``verdict.trend``).
    trends: tuple[TrendFacts, ...] = ()


@dataclass(frozen=True)
class Facts:
    reference: str
    candidate: ArmFacts | None
    calibrated: ArmFacts | None = None
    capacity_ratio: float | None = None
    capacity_needed: bool | None = None  # the reference's cache ran close to full
    # The systems rule's cells (every latency and rate it weighs, judged against the A/A
    # floor: ``systems_cells``) and the capacity phase; None: not measured (``verdict.payoff``).
    systems: SystemsRule | None = None
    capacity_phase: CapacityPhase | None = None
    below_break_even: bool | None = None
    per_head_supported: bool = False
    outlier_layers: tuple[int, ...] = ()
    # FP8 with some layers' cache in BF16, served (``--skip-layers``): the layers it keeps.
    layers: ArmFacts | None = None
    layers_skipped: tuple[int | str, ...] = ()  # ``sliding_window`` where no layout resolves it
    # ``kvcal advise``'s emulated figures and advice (``--advice``), for the next step.
    advice: Advice | None = None
    # A sequential canary: its decision replaces the fixed design's at scale 1.0.
    sequential: Sequential | None = None


# -- from a run -----------------------------------------------------------------------------


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
    summary: Summary,
    manifest: Manifest,
    *,
    candidate: str | None = None,
    calibrated: str | None = None,
    thresholds: Thresholds = Thresholds(),
) -> Facts:
    """The verdict's facts from a run's summary: every phase's paired grades, per bucket and
    phase (see ``replay.analysis.verdict`` for how phases combine), judged under
    ``thresholds``."""
    targets = summary.targets
    roles = Roles.from_manifest(manifest, list(targets))
    reference = (summary.quality.reference if summary.quality else None) or roles.reference
    cal = calibrated or roles.calibrated
    cand = candidate or roles.candidate
    phases = summary.quality.phases if summary.quality else {}
    # --quality-pass serial: quality is decided on the answers that do not depend on batching.
    only = manifest.quality_phase
    if only is not None and only in phases:
        phases = {only: phases[only]}
    ref_t = targets.get(reference)
    ref_problem = None if ref_t is None else error_problem(ref_t, thresholds.max_error_rate)
    cand_emulated = manifest.emulated(cand)
    usage = [
        ph.server.peak_kv_usage
        for ph in (ref_t.phases.values() if ref_t else ())
        if ph.server.peak_kv_usage is not None
    ]
    candidate_arm = _with_reasoning(
        _arm_facts(cand, False, targets, phases, manifest, thresholds), summary.reasoning
    )
    if ref_problem and candidate_arm is not None:
        # Without a working reference there is nothing to compare with.
        candidate_arm = replace(
            candidate_arm,
            serving_problems=(
                f"the reference {reference}: {ref_problem}",
                *candidate_arm.serving_problems,
            ),
        )
    layers = roles.layers
    return Facts(
        reference=reference,
        candidate=candidate_arm,
        calibrated=_with_reasoning(
            _arm_facts(cal, True, targets, phases, manifest, thresholds), summary.reasoning
        ),
        layers=_arm_facts(
            layers, _on_overlay(manifest, layers, reference), targets, phases, manifest, thresholds
        ),
        layers_skipped=_skipped(manifest, layers),
        advice=advice_facts(manifest.options),
        per_head_supported=_per_head_supported(manifest, cal),
        outlier_layers=_outlier_layers(manifest, cal),
        capacity_ratio=_capacity_ratio(ref_t, targets.get(cand or ""), cand_emulated),
        capacity_needed=(max(usage) >= thresholds.capacity_needed_usage) if usage else None,
        systems=summary.systems.rule if summary.systems and not cand_emulated else None,
        capacity_phase=summary.systems.capacity if summary.systems and not cand_emulated else None,
        below_break_even=summary.systems.below_break_even if summary.systems else None,
        sequential=summary.sequential,
    )


def _on_overlay(manifest: Manifest, name: str | None, reference: str) -> bool:
    """Whether a target serves another checkpoint than the reference (a calibrated overlay:
    its scales must be applied, and its model path differs by design). A target at a URL has
    no model in its spec: the folder its server reports (``model_root``) says it."""
    mine, ref = manifest.target(name), manifest.target(reference)
    if mine is None or ref is None:
        return False
    if mine.model_root and ref.model_root:
        return mine.model_root != ref.model_root
    return bool(mine.spec.model and ref.spec.model and mine.spec.model != ref.spec.model)


def _skipped(manifest: Manifest, name: str | None) -> tuple[int | str, ...]:
    """The layers a target's server keeps in BF16 (its ``--kv-cache-dtype-skip-layers``):
    indices, vLLM's ``sliding_window`` resolved through the model's layout where it is known
    (the verdict then names the layers), else kept as the word (what the flag takes)."""
    spec = manifest.spec(name)
    args = list(spec.args) if spec is not None else []
    flag = "--kv-cache-dtype-skip-layers"
    if flag not in args:
        return ()
    words: list[str] = []
    for word in args[args.index(flag) + 1 :]:
        if str(word).startswith("-"):
            break
        words += [x.strip() for x in str(word).split(",") if x.strip()]
    layout = target_layout(manifest.target(name)) if SLIDING_WINDOW in words else None
    if layout is not None:
        return layout.skip_indices(words)
    return tuple(int(w) if w.isdigit() else w for w in words if w.isdigit() or w == SLIDING_WINDOW)


def _calibration_report(manifest: Manifest, name: str | None) -> Mapping[str, Any]:
    """The calibrated target's ``kvcal_report.json`` (its overlay's), when it is local."""
    import json
    from pathlib import Path

    spec = manifest.spec(name)
    model = spec.model if spec is not None else None
    path = Path(str(model)) / "kvcal_report.json" if model else None
    if path is None or not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _per_head_supported(manifest: Manifest, cal: str | None) -> bool:
    return bool(_calibration_report(manifest, cal).get("per_head_supported"))


def _outlier_layers(manifest: Manifest, cal: str | None) -> tuple[int, ...]:
    """The layers calibration found standing out (its advice), measured on the samples."""
    advice = _calibration_report(manifest, cal).get("advice") or {}
    layers = advice.get("outlier_layers") if isinstance(advice, dict) else None
    return tuple(int(x) for x in layers or () if isinstance(x, int))


def _capacity_ratio(
    ref: TargetSummary | None, cand: TargetSummary | None, cand_emulated: bool
) -> float | None:
    """The candidate's KV-cache tokens over the reference's; an emulated cache's capacity is
    BF16's, never FP8's."""
    if (
        ref
        and cand
        and ref.kv_cache_size_tokens
        and cand.kv_cache_size_tokens
        and not cand_emulated
    ):
        return cand.kv_cache_size_tokens / ref.kv_cache_size_tokens
    return None


def _arm_facts(
    name: str | None,
    is_cal: bool,
    targets: Mapping[str, TargetSummary],
    phases: Mapping[str, Mapping[str, TargetQuality]],
    manifest: Manifest,
    thresholds: Thresholds,
) -> ArmFacts | None:
    """One FP8 target's facts: its serving problems, and its cells (bucket by bucket, each
    in every phase that graded it; a phase is named only when there are several)."""
    if name is None or name not in targets:
        return None
    problems = serving_problems(name, targets[name], manifest, is_cal, thresholds.max_error_rate)
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
    shift = _strongest_shift([q.shift for _, q in per_phase])
    return ArmFacts(
        name,
        tuple(problems),
        tuple(cells),
        shift.p_value if shift else None,
        shift.direction if shift else None,
        max(1, len(per_phase)),
        manifest.emulated(name),
        trends=trend_facts(per_phase),
    )


def _with_reasoning(arm: ArmFacts | None, length: ReasoningLength | None) -> ArmFacts | None:
    """The arm with its reasoning length per bucket and phase, where answers reasoned."""
    if arm is None or length is None:
        return arm
    per_phase = [(ph, rows[arm.name]) for ph, rows in length.phases.items() if arm.name in rows]
    several = len(per_phase) > 1
    cells = tuple(
        (ph if several else None, bucket, d) for ph, rows in per_phase for bucket, d in rows.items()
    )
    return replace(arm, reasoning=cells)


def _strongest_shift(shifts: Sequence[Shift | None]) -> Shift | None:
    """The phase with the strongest downward shift, else the first phase's shift."""
    down = [
        sh for sh in shifts if sh is not None and sh.direction == "down" and sh.p_value is not None
    ]
    return min(down, key=lambda sh: sh.p_value or 0.0) if down else (shifts[0] if shifts else None)
