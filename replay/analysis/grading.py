"""Grades per request and quality per target x bucket, against the reference target.

Each answered request gets its checker's grade and its agreement with the reference's answer
to the same request in the same phase (exact, normalized, first divergent token). A request
that failed is not a quality result: it is counted as an error and left out of the pairs.
Quality per bucket pairs each target with the reference on the requests both answered; the
A/A control (the reference replayed a second time) gives the noise floor.

A request without a ``check`` is graded against the reference's answer instead (the
reference's answer is the label; rules in ``checkers._derived``): every other target's answer,
the A/A control's included, gets a ``derived`` grade naming its rule. A request with a check
gets none: explicit checks always win. Derived grades are reported beside the explicit ones
(``quality``'s ``derived`` blocks), each target paired with the control's derived agreement on
the same requests, which is their noise floor.

Grading is bounded (``checkers.Grader``): an answer that makes its checker raise, run too long
or read too much fails with a "checker error" reason; it never stops the run's analysis.

Quality reads the grades as a table (``grades_frame``, one row per answer): pandas groups it by
phase, target and bucket, and a target's requests are paired with the reference's (or the
control's) by request id, in the target's own order, which the seeded bootstrap depends on.
The result is a ``Quality`` record (``schemas``); ``quality`` gives its JSON.
"""

from __future__ import annotations

import json
import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from replay.analysis.schemas import (
    OMITTED,
    Agreement,
    BucketQuality,
    Combined,
    DerivedComparison,
    EvidenceRule,
    EvidenceSummary,
    NoiseFloor,
    Quality,
    QualityTotals,
    RuleCounts,
    Shift,
    TargetQuality,
    TeacherForced,
    VsControl,
    VsReference,
)
from replay.analysis.stats.equivalence import ALPHA, MIN_PAIRS, TOLERANCE
from replay.analysis.stats.evidence import evidence as pairs_evidence
from replay.analysis.stats.exact_tests import mcnemar_exact, stratified_shift
from replay.analysis.stats.intervals import PairedDiff, paired_bootstrap, wilson
from replay.checkers import Answer, Grader, derived_record, normalize
from replay.core.records import Result

if TYPE_CHECKING:
    import pandas as pd

CONTROL_SUFFIX = "-control"
# Derived grades read the prompt for facts and code examples; a longer prompt keeps its first
# three quarters and its last quarter of this many characters.
PROMPT_KEEP_CHARS = 131_072


class Gradable(Protocol):
    """What grading needs of a trace record (a ``Request`` is one)."""

    @property
    def id(self) -> str: ...

    @property
    def task(self) -> str: ...

    @property
    def check(self) -> dict[str, Any] | None: ...


@dataclass(frozen=True, slots=True)
class GradingSpec:
    """What grading keeps of a trace record: a long run keeps one per request it sent, so the
    prompt's text is kept only where derived grading reads it (no check), capped at
    ``PROMPT_KEEP_CHARS`` and zlib-compressed (``grading_spec`` builds one)."""

    id: str
    task: str
    check: dict[str, Any] | None
    prompt_z: bytes = b""

    @property
    def prompt_text(self) -> str:
        if not self.prompt_z:
            return ""
        return zlib.decompress(self.prompt_z).decode("utf-8", "surrogatepass")


def _cap(text: str) -> str:
    if len(text) <= PROMPT_KEEP_CHARS:
        return text
    head = PROMPT_KEEP_CHARS * 3 // 4
    return text[:head] + "\n" + text[len(text) - (PROMPT_KEEP_CHARS - head) :]


def prompt_text(record: Any) -> str:
    """The text a record's prompt shows the model (capped): its messages' contents and the
    calls earlier turns made, or a completions prompt; "" for token ids, synthetic prompts and
    records that carry no prompt."""
    if isinstance(record, GradingSpec):
        return record.prompt_text
    messages = getattr(record, "messages", None)
    parts: list[str] = []
    for m in messages or ():
        if not isinstance(m, Mapping):
            continue
        content = m.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [
                p["text"]
                for p in content
                if isinstance(p, Mapping) and isinstance(p.get("text"), str)
            ]
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(fn, Mapping):
                args = fn.get("arguments", "")
                args = args if isinstance(args, str) else json.dumps(args, default=str)
                parts.append(f"{fn.get('name', '')}({args})")
    prompt = getattr(record, "prompt", None)
    if not messages and isinstance(prompt, str):
        parts.append(prompt)
    return _cap("\n".join(parts))


def grading_spec(record: Gradable) -> GradingSpec:
    """A record's ``GradingSpec``: with its prompt's text only when it has no check."""
    text = prompt_text(record) if record.check is None else ""
    return GradingSpec(
        record.id,
        record.task,
        record.check,
        zlib.compress(text.encode("utf-8", "surrogatepass"), 6) if text else b"",
    )


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token; None when identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(r: Result, ref: Result) -> dict[str, Any]:
    calls = [(c.name, c.arguments) for c in r.tool_calls]
    ref_calls = [(c.name, c.arguments) for c in ref.tool_calls]
    exact = r.output_text == ref.output_text and calls == ref_calls
    return {
        "exact": exact,
        "normalized": exact
        or (normalize(r.output_text) == normalize(ref.output_text) and calls == ref_calls),
        "first_divergence": first_divergence(r.output_ids, ref.output_ids)
        if r.output_ids or ref.output_ids
        else (None if exact else 0),
    }


def grade_rows(
    results: Sequence[Result],
    requests: Mapping[str, Gradable],
    reference: str,
    grader: Grader | None = None,
) -> list[dict[str, Any]]:
    """One row per result: checker grade, agreement with the reference, and, for a request
    without a check, the derived grade against the reference's answer (every target but the
    reference; the A/A control is graded like a candidate)."""
    if grader is None:
        with Grader() as own:
            return grade_rows(results, requests, reference, own)
    refs = {(r.phase, r.request_id): r for r in results if r.target == reference}
    rows = []
    for r in results:
        req = requests.get(r.request_id)
        row: dict[str, Any] = {
            "target": r.target,
            "phase": r.phase,
            "request_id": r.request_id,
            "bucket": r.bucket,
            "answered": r.status == "ok",
            "task": req.task if req else None,
            "grade": None,
            "agreement": None,
            "derived": None,
        }
        if r.status != "ok":
            row["error"] = f"{r.error_kind}: {r.error}"
        else:
            if req is not None and req.check is not None:
                answer = Answer(r.output_text, tuple(r.tool_calls))
                row["grade"] = grader.grade(req.check, answer).to_json()
            ref = refs.get((r.phase, r.request_id))
            if r.target != reference and ref is not None and ref.status == "ok":
                row["agreement"] = agreement(r, ref)
                if req is not None and req.check is None:
                    grade = grader.grade_derived(
                        Answer(ref.output_text, tuple(ref.tool_calls)),
                        Answer(r.output_text, tuple(r.tool_calls)),
                        prompt_text(req),
                    )
                    row["derived"] = derived_record(grade, row["agreement"]["normalized"])
        rows.append(row)
    return rows


def _rate(values: Iterable[bool]) -> float | None:
    v = list(values)
    return sum(v) / len(v) if v else None


# -- quality per target x bucket: the grades as a table ------------------------------------------

GRADE_COLUMNS = (
    "phase",
    "target",
    "request_id",
    "bucket",
    "answered",
    "passed",
    "rule",
    "d_passed",
    "d_exact",
    "d_error",
    "agreed",
    "exact",
    "normalized",
    "divergence",
)
KEY = ["phase", "target", "request_id"]


def grades_frame(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per graded answer (``grade_rows``), flattened: ``passed`` is the check's
    outcome (None: no check graded it), ``rule``/``d_passed`` the derived grade's (None: none,
    or ungraded), ``agreed`` whether it was compared with the reference's answer. A request
    answered twice in one phase (a looping Locust test) keeps its last grade, in the place of
    its first."""
    import pandas as pd

    flat = []
    for row in rows:
        g, d, ag = row["grade"], row.get("derived"), row["agreement"]
        flat.append(
            (
                row["phase"],
                row["target"],
                row["request_id"],
                row["bucket"],
                bool(row["answered"]),
                None if g is None else bool(g["passed"]),
                str(d["rule"]) if d else None,
                None if not d or d["passed"] is None else bool(d["passed"]),
                None if not d or d.get("exact") is None else bool(d["exact"]),
                bool(d and (d.get("detail") or {}).get("checker_error")),
                ag is not None,
                ag and ag["exact"],
                ag and ag["normalized"],
                ag and ag["first_divergence"],
            )
        )
    frame = pd.DataFrame.from_records(flat, columns=GRADE_COLUMNS)
    first = frame.groupby(KEY, sort=False).ngroup()
    return (
        frame.assign(first=first)
        .drop_duplicates(KEY, keep="last")
        .sort_values("first")
        .drop(columns="first")
        .set_index("request_id", drop=False)
    )


def _outcomes(values: pd.Series) -> list[bool]:
    return [bool(v) for v in values]


def _paired(
    rows: pd.DataFrame,
    base: pd.DataFrame | None,
    column: str,
) -> tuple[list[bool], list[bool]]:
    """``column``'s outcomes of the requests graded in both, in ``rows``' order: (base,
    rows)."""
    if base is None or rows.empty:
        return [], []
    theirs = base[column].reindex(rows.index)
    both = rows[column].notna() & theirs.notna()
    return _outcomes(theirs[both]), _outcomes(rows.loc[both, column])


@dataclass(frozen=True)
class _Rule:
    """The verdict's evidence rule, which grading's evidence column applies too."""

    tolerance: float
    alpha: float
    min_pairs: int

    def evidence(self, a: Sequence[bool], b: Sequence[bool]) -> EvidenceSummary:
        mc = mcnemar_exact(a, b)
        ev = pairs_evidence(
            len(a),
            mc.a_only,
            mc.b_only,
            tolerance=self.tolerance,
            alpha=self.alpha,
            min_pairs=self.min_pairs,
        )
        return EvidenceSummary(
            status=ev.status,
            sufficient=ev.sufficient,
            needed=ev.needed,
            p_value=ev.p_value,
            drop_bound=ev.drop_bound,
            rule=EvidenceRule(
                tolerance=ev.tolerance, alpha=ev.alpha, min_pairs=ev.min_pairs, power=ev.power
            ),
            short=ev.short,
            reason=ev.reason,
        )


def _bootstrap(a: Sequence[bool], b: Sequence[bool], seed: int) -> PairedDiff | None:
    return paired_bootstrap([float(x) for x in a], [float(x) for x in b], seed=seed)


def _comparison(
    rows: pd.DataFrame, ref: pd.DataFrame | None, rule: _Rule, seed: int
) -> dict[str, Any]:
    """``Comparison``'s fields: pass rate, paired difference to the reference, McNemar,
    agreement, and ``evidence`` (whether the pairs show a loss or a drop bounded below the
    tolerance, and only while they show neither, how many pairs would)."""
    graded = rows["passed"].dropna()
    k, n = int(graded.astype(bool).sum()), len(graded)
    a, b = _paired(rows, ref, "passed")
    diff, mc = _bootstrap(a, b, seed), mcnemar_exact(a, b)
    agree = rows[rows["agreed"]]
    divs = agree["divergence"].dropna().tolist()
    return {
        "answered": int(rows["answered"].sum()),
        "requests": len(rows),
        "graded": n,
        "passed": k,
        "pass_rate": k / n if n else None,
        "wilson": wilson(k, n),
        "vs_reference": None
        if diff is None
        else VsReference(
            pairs=diff.n,
            diff=diff.diff,
            lo=diff.lo,
            hi=diff.hi,
            mcnemar_p=mc.p_value,
            ref_only=mc.a_only,
            target_only=mc.b_only,
        ),
        "agreement": Agreement(
            compared=len(agree),
            exact=_rate(agree["exact"].tolist()),
            normalized=_rate(agree["normalized"].tolist()),
            first_divergence_median=float(np.median(divs)) if divs else None,
        ),
        "evidence": rule.evidence(a, b),
    }


def compare_derived(
    rows: pd.DataFrame, control: pd.DataFrame | None, seed: int
) -> DerivedComparison:
    """Derived grades of one target: pass rate, counts (by rule, ungraded, checker errors), the
    normalized exact rate beside them, and ``vs_control``: the paired comparison with the A/A
    control's derived grades of the same requests, its floor (None for the control itself, the
    reference, or when no control ran)."""
    import pandas as pd

    recs = rows[rows["rule"].notna()]
    outcome = recs["d_passed"]
    graded = outcome.dropna()
    k, n = int(graded.astype(bool).sum()), len(graded)
    counts = (
        pd.DataFrame(
            {
                "rule": recs["rule"],
                "graded": outcome.notna(),
                "passed": outcome.eq(True),
                "ungraded": outcome.isna(),
            }
        )
        .groupby("rule")
        .sum()
    )
    vs = None
    if control is not None:
        a, b = _paired(recs, control, "d_passed")
        diff, mc = _bootstrap(a, b, seed), mcnemar_exact(a, b)
        vs = (
            None
            if diff is None
            else VsControl(
                pairs=diff.n,
                control_pass_rate=diff.mean_a,
                pass_rate=diff.mean_b,
                diff=diff.diff,
                lo=diff.lo,
                hi=diff.hi,
                mcnemar_p=mc.p_value,
                control_only=mc.a_only,
                target_only=mc.b_only,
            )
        )
    return DerivedComparison(
        graded=n,
        passed=k,
        pass_rate=k / n if n else None,
        wilson=wilson(k, n),
        ungraded=len(recs) - n,
        checker_errors=int(recs["d_error"].sum()),
        by_rule={
            str(r): RuleCounts(
                graded=int(c["graded"]), passed=int(c["passed"]), ungraded=int(c["ungraded"])
            )
            for r, c in counts.iterrows()
        },
        exact_rate=_rate(_outcomes(recs["d_exact"].dropna())),
        vs_control=vs,
    )


def combined_pairs(
    rows: pd.DataFrame, ref: pd.DataFrame | None, control: pd.DataFrame | None
) -> tuple[list[bool], list[bool], int]:
    """Every graded pair of one target and bucket, explicit and derived pooled, and how many
    are derived. A request is one pair at most: with a check, its grade against the
    reference's (explicit checks win); without one, its derived grade (agreement with the
    reference's answer) against the A/A control's derived grade of the same request, the
    reference agreeing with itself. Without a control the baseline is a pass: every
    disagreement with the reference counts against the candidate, the conservative reading
    (no noise floor)."""
    a, b = _paired(rows, ref, "passed")
    derived = rows[rows["passed"].isna() & rows["d_passed"].notna()]
    if control is None:
        base, mine = [True] * len(derived), _outcomes(derived["d_passed"])
    else:
        base, mine = _paired(derived, control, "d_passed")
    return a + base, b + mine, len(base)


def compare_combined(
    rows: pd.DataFrame,
    ref: pd.DataFrame | None,
    control: pd.DataFrame | None,
    rule: _Rule,
    seed: int,
) -> Combined | None:
    """The paired comparison the verdict decides on: ``combined_pairs`` under the same
    statistics and evidence rule as the explicit grades alone."""
    a, b, derived = combined_pairs(rows, ref, control)
    diff = _bootstrap(a, b, seed)
    if diff is None:
        return None
    mc = mcnemar_exact(a, b)
    return Combined(
        pairs=diff.n,
        explicit=diff.n - derived,
        derived=derived,
        baseline="control" if control is not None else "pass",
        diff=diff.diff,
        lo=diff.lo,
        hi=diff.hi,
        mcnemar_p=mc.p_value,
        ref_only=mc.a_only,
        target_only=mc.b_only,
        evidence=rule.evidence(a, b),
    )


def teacher_forced(
    tf: Mapping[str, Mapping[str, Any]],
    tf_ref: Mapping[str, Mapping[str, Any]],
    ids: Iterable[str],
    seed: int = 0,
) -> TeacherForced:
    """Mean NLL difference per token to the reference's own scores, and top-1 agreement, with
    intervals over requests (each request's mean, resampled: tokens of one answer are not
    independent), the early warning the verdict reports beside the outcomes."""
    deltas: list[float] = []
    top1: list[bool] = []
    per_request: list[float] = []
    top1_per_request: list[float] = []
    errors = 0
    for rid in ids:
        s, base = tf.get(rid), tf_ref.get(rid)
        if not s or not base or s["error"] or base["error"] or s["n"] != base["n"]:
            errors += s is not None
            continue
        d = [x - y for x, y in zip(s["nll"], base["nll"], strict=True)]
        deltas.extend(d)
        top1.extend(s["top1"])
        if d:
            per_request.append(float(np.mean(d)))
            top1_per_request.append(sum(map(bool, s["top1"])) / len(s["top1"]))
    nll_ci = paired_bootstrap([0.0] * len(per_request), per_request, seed=seed)
    top1_ci = paired_bootstrap([0.0] * len(top1_per_request), top1_per_request, seed=seed)
    return TeacherForced(
        tokens=len(deltas),
        requests=len(per_request),
        errors=errors,
        nll_delta_mean=float(np.mean(deltas)) if deltas else None,
        nll_delta_lo=None if nll_ci is None else nll_ci.lo,
        nll_delta_hi=None if nll_ci is None else nll_ci.hi,
        top1_agreement=_rate(top1),
        top1_lo=None if top1_ci is None else top1_ci.lo,
        top1_hi=None if top1_ci is None else top1_ci.hi,
        identical_to_reference=bool(deltas) and all(d == 0.0 for d in deltas),
    )


def checker_error_notes(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """One note per target (and kind of grade) whose answers could not all be graded (they
    count as failed)."""
    import pandas as pd

    rows = list(rows)
    notes = []
    for key, what in (("grade", "answer(s)"), ("derived", "derived grade(s)")):
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
    rule: _Rule,
    seed: int,
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
            **_comparison(sub, ref, rule, seed),
            derived=compare_derived(sub, floor, seed),
            combined=compare_combined(sub, ref, floor, rule, seed) if compared else OMITTED,
            teacher_forced=teacher_forced(mine, theirs, sub.index, seed),
        )
        # The shift test pools what the verdict decides on: explicit and derived.
        strata.append(combined_pairs(sub, ref, floor)[:2])
    shift = stratified_shift(strata) if name != reference else None
    return TargetQuality(
        buckets=buckets,
        all=QualityTotals(
            **_comparison(rows, ref, rule, seed), derived=compare_derived(rows, floor, seed)
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


def assess_quality(
    rows: Sequence[Mapping[str, Any]],
    tf_rows: Sequence[Mapping[str, Any]],
    reference: str,
    bucket_order: Sequence[str],
    tolerance: float = TOLERANCE,
    seed: int = 0,
    *,
    alpha: float = ALPHA,
    min_pairs: int = MIN_PAIRS,
) -> Quality:
    """phase -> target -> buckets, all and shift, plus notes. ``tolerance``, ``alpha`` and
    ``min_pairs`` are the verdict's, so the evidence column says what it says."""
    tf: dict[str, dict[str, Mapping[str, Any]]] = defaultdict(dict)
    for t in tf_rows:
        tf[t["target"]][t["request_id"]] = t
    rule, control = _Rule(tolerance, alpha, min_pairs), reference + CONTROL_SUFFIX
    phases: dict[str, dict[str, TargetQuality]] = {}
    notes = []
    frame = grades_frame(rows)
    for phase, in_phase in frame.groupby("phase", sort=False):
        targets = dict(iter(in_phase.groupby("target", sort=False)))
        out = {
            str(t): _target_quality(
                str(t), t_rows, targets, tf, reference, bucket_order, rule, seed
            )
            for t, t_rows in targets.items()
        }
        if control not in targets and in_phase["rule"].notna().any():
            notes.append(
                f"{phase}: derived grades have no noise floor: no A/A control ({control}) ran, "
                "so every disagreement with the reference's answer counts against the "
                "candidate (--control gives the floor)"
            )
        if control in out:
            floors = out[control].buckets
            out = {
                t: replace(
                    q,
                    buckets={
                        b: replace(row, noise_floor=_noise_floor(floors.get(b)))
                        for b, row in q.buckets.items()
                    },
                )
                for t, q in out.items()
            }
        phases[str(phase)] = out
    notes += checker_error_notes(rows)
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
        tolerance=tolerance,
        alpha=alpha,
        min_pairs=min_pairs,
        phases=phases,
        notes=tuple(notes),
    )


def quality(
    rows: Sequence[Mapping[str, Any]],
    tf_rows: Sequence[Mapping[str, Any]],
    reference: str,
    bucket_order: Sequence[str],
    tolerance: float = TOLERANCE,
    seed: int = 0,
    *,
    alpha: float = ALPHA,
    min_pairs: int = MIN_PAIRS,
) -> dict[str, Any]:
    """``assess_quality`` as JSON, for callers outside the pipeline."""
    return assess_quality(
        rows, tf_rows, reference, bucket_order, tolerance, seed, alpha=alpha, min_pairs=min_pairs
    ).to_json()
